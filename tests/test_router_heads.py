"""router/heads.py: the lean listener's request head. What it reads of a plain head, and that
every head outside its strict subset is refused (router/front.py then hands it to aiohttp)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from router import heads
from router.forward import FORWARD_TAIL, REQUEST_DROP_B, forward_headers


def head(*lines: str, start: str = "POST /v1/completions HTTP/1.1") -> bytes:
    return ("\r\n".join((start, *lines)) + "\r\n\r\n").encode("latin-1")


def test_a_plain_head_gives_its_method_path_fields_length_and_the_lines_that_go_upstream():
    raw = head("Host: router:8080", "Content-Type: application/json", "X-Trace:  t-1 \t",
               "Accept-Encoding: gzip", "Content-Length: 42", "Authorization: Bearer k")
    r = heads.request(raw, REQUEST_DROP_B)
    assert (r.method, r.path, r.length, r.keep_alive, r.size) == (b"POST", b"/v1/completions", 42, True, len(raw))
    assert r.fields == [(b"Host", b"router:8080"), (b"Content-Type", b"application/json"), (b"X-Trace", b"t-1"),
                        (b"Accept-Encoding", b"gzip"), (b"Content-Length", b"42"), (b"Authorization", b"Bearer k")]
    # the same lines aiohttp's path builds from the same headers (router/forward.py)
    parsed = CIMultiDict((k.decode(), v.decode()) for k, v in r.fields)
    assert b"".join(r.forward) + FORWARD_TAIL == forward_headers(parsed)
    assert b"Host" not in b"".join(r.forward) and b"Accept-Encoding: gzip" not in b"".join(r.forward)


def test_a_get_without_fields_and_the_connection_header_decide_keep_alive():
    r = heads.request(b"GET /v1/models HTTP/1.1\r\n\r\n", REQUEST_DROP_B)
    assert (r.method, r.path, r.length, r.fields, r.keep_alive) == (b"GET", b"/v1/models", None, [], True)
    for value, alive in (("close", False), ("keep-alive, Close", False), ("keep-alive", True), ("closed", True)):
        assert heads.request(head(f"Connection: {value}"), REQUEST_DROP_B).keep_alive is alive, value


@pytest.mark.parametrize("raw", [
    head(start="POST /v1/completions HTTP/1.0"),
    head(start="PUT /v1/completions HTTP/1.1"),
    head(start="POST http://engine/v1/completions HTTP/1.1"),  # absolute form
    head(start="POST /v1/completions  HTTP/1.1"),
    head("Host : x"),  # space before the colon
    head("X-A: b", " folded"),  # obs-fold
    b"POST /v1/completions HTTP/1.1\r\nX-A: b\nX-B: c\r\n\r\n",  # bare LF
    b"POST /v1/completions HTTP/1.1\r\nX-A: b\rX-B: c\r\n\r\n",  # bare CR
    head("X-A: b\x00c"),
    head("X-A: \x1b[31m"),
    head("X(A): b"),  # not a token
    head("Content-Length: 1", "Content-Length: 1"),
    head("Content-Length: +1"), head("Content-Length: 1e3"), head("Content-Length: "),
    head("Content-Length: 1".replace("1", "\xd9\xa1")),  # UTF-8 of an Arabic-Indic one: a digit to str, not to HTTP
    *(head(f"{name}: x") for name in ("Transfer-Encoding", "transfer-encoding", "Content-Encoding", "Expect", "Upgrade")),
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # no blank line
])
def test_a_head_outside_the_subset_is_refused(raw):
    assert heads.request(raw, REQUEST_DROP_B) is None


def test_obs_text_in_a_value_is_plain_and_kept_as_bytes():
    r = heads.request(head("X-Name: caf\xe9"), REQUEST_DROP_B)
    assert r.fields == [(b"X-Name", b"caf\xe9")] and r.forward == [b"X-Name: caf\xe9\r\n"]


def test_a_hostile_head_is_refused_not_backtracked():
    # whitespace runs before a forbidden byte: a pattern that backtracks over them would take
    # minutes on 16 KB; this one refuses at once (pytest-timeout guards the run)
    for tail in ("\x01", "\t" * 3 + "\x7f"):
        raw = head("X-A: a" + " \t" * 8000 + tail)
        assert heads.request(raw, REQUEST_DROP_B) is None
    assert heads.request(head(*(f"X-{i}: {'v ' * 20}" for i in range(300))), REQUEST_DROP_B) is not None
