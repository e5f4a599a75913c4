"""router/answer_heads.py: an engine's plain whole answer read without httptools. What it reads of
one, that a remembered head still reads each answer's own body, that every answer outside its
subset is left to httptools (None), and, through a real router against a raw-socket engine, that
the client gets the same answer either way."""

from __future__ import annotations

import asyncio
import json

import httptools
import pytest

from router.answer_heads import LIMIT, AnswerHeads
from router_helpers import running_router, serve_raw, tolerant, wait_for
from test_router_front import post, read_response


def answer(body: bytes, *lines: str, start: str = "HTTP/1.1 200 OK", length: str | None = None) -> bytes:
    cl = [f"Content-Length: {len(body) if length is None else length}"]
    return ("\r\n".join((start, *lines, *cl)) + "\r\n\r\n").encode("latin-1") + body


def parsed(data: bytes) -> tuple[int, list, bytes, bool]:
    """What httptools makes of the same bytes: status, headers, body, keep-alive."""
    got: dict = {"headers": [], "body": b""}

    class P:
        def on_header(self, name, value):
            got["headers"].append((name, value))

        def on_headers_complete(self):
            got["alive"] = p.should_keep_alive()

        def on_body(self, body):
            got["body"] += body

    p = httptools.HttpResponseParser(P())
    p.feed_data(data)
    return p.get_status_code(), got["headers"], got["body"], got["alive"]


def test_a_plain_answer_reads_as_httptools_reads_it_less_the_content_length():
    data = answer(b'{"id":"c"}', "Date: Thu, 03 Dec 2026 06:00:00 GMT", "Content-Type: application/json; charset=utf-8",
                  "X-Trace:  t-1 \t", "Server: engine")
    status, fields, content_type, keep_alive, lines, body = AnswerHeads().read(data)
    ref_status, ref_headers, ref_body, ref_alive = parsed(data)
    assert (status, body, keep_alive) == (ref_status, ref_body, ref_alive) == (200, b'{"id":"c"}', True)
    assert fields == [(k, v.strip(b" \t")) for k, v in ref_headers if k != b"Content-Length"]
    assert content_type == "application/json"
    # the client's lines: end-to-end headers only (router/forward.py drops Date, Server, framing)
    assert lines == b"Content-Type: application/json; charset=utf-8\r\nX-Trace: t-1\r\n"


def test_a_remembered_head_gives_each_answer_its_own_body_and_a_new_head_is_checked_again():
    heads = AnswerHeads()
    first = heads.read(answer(b"a" * 5, "Content-Type: application/json"))
    second = heads.read(answer(b"b" * 12, "Content-Type: application/json"))
    assert first[-1] == b"aaaaa" and second[-1] == b"b" * 12
    assert first[:-1] == second[:-1] and len(heads.seen) == 1  # one head, two lengths: one entry
    assert heads.read(answer(b"c", "Content-Type: text/plain"))[2] == "text/plain"
    assert heads.read(answer(b"c", "Content-Type: application/json", "X-Bad: \x1b[31m")) is None
    assert len(heads.seen) == 2  # the refused head is not remembered
    assert heads.read(answer(b"c", "Content-Type: application/json", "X-Bad: \x1b[31m")) is None


def test_the_remembered_heads_are_bounded():
    heads = AnswerHeads()
    for i in range(3 * LIMIT):
        assert heads.read(answer(b"x", f"X-N: {i}"))[-1] == b"x"
        assert len(heads.seen) <= LIMIT


@pytest.mark.parametrize("status,alive", [("close", False), ("keep-alive, Close", False), ("keep-alive", True)])
def test_connection_close_ends_keep_alive(status, alive):
    assert AnswerHeads().read(answer(b"x", f"Connection: {status}"))[3] is alive


@pytest.mark.parametrize("data", [
    answer(b"abc")[:-1],  # the body split over reads
    answer(b"abc") + b"HTTP/1.1 200 OK\r\n",  # more bytes after it
    answer(b"abc")[:20],  # no blank line yet
    answer(b"abc", length="4"), answer(b"abc", length="2"),
    answer(b"abc", length="+3"), answer(b"abc", length="3 3"), answer(b"abc", length="3, 3"), answer(b"abc", length=""),
    answer(b"abc", "Content-Length: 3"),  # two of them
    answer(b"abc", "Transfer-Encoding: chunked"),
    answer(b"abc", start="HTTP/1.0 200 OK"), answer(b"abc", start="HTTP/1.1 200"), answer(b"abc", start="HTTP/1.1 20 OK"),
    answer(b"", start="HTTP/1.1 204 No Content"), answer(b"", start="HTTP/1.1 304 Not Modified"),
    answer(b"", start="HTTP/1.1 100 Continue"),
    answer(b"abc", "X-A: b\x00c"), answer(b"abc", "X(A): b"), answer(b"abc", "Host : x"),
    answer(b"abc", "X-A: b", " folded"),
    b"HTTP/1.1 200 OK\r\nX-A: b\nContent-Length: 3\r\n\r\nabc",  # bare LF
    b"HTTP/1.1 200 OK\r\nContent-Length : 3\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\n\r\nabc",  # no length: delimited by the close
])
def test_an_answer_outside_the_subset_is_left_to_httptools(data):
    heads = AnswerHeads()
    assert heads.read(data) is None
    assert heads.read(data) is None and not heads.seen


def test_a_remembered_head_cannot_stand_for_one_with_two_lengths():
    """The key is the head less its first Content-Length line: a head with a second one keeps that
    line in its key, so it never meets a checked head's key."""
    heads = AnswerHeads()
    assert heads.read(answer(b"abc", "X-A: b")) is not None
    assert heads.read(b"HTTP/1.1 200 OK\r\nX-A: b\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc") is None
    assert heads.read(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nX-A: b\r\nContent-Length: 3\r\n\r\nabc") is None


# -- through the router ------------------------------------------------------------------------------

class RawEngine:
    """An engine on a raw socket: /ready answers ready; each completion gets the next of ``plan``'s
    raw answers, in one write or, for a tuple, in its parts 20 ms apart."""

    def __init__(self, plan: list) -> None:
        self.plan = list(plan)
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                if head.startswith(b"GET /ready"):
                    writer.write(answer(b'{"ready":true}', "Content-Type: application/json"))
                    continue
                parts = self.plan.pop(0)
                parts = parts if isinstance(parts, tuple) else (parts,)
                for i, part in enumerate(parts):
                    if i:
                        await asyncio.sleep(0.02)
                    writer.write(part)
                if b"Connection: close" in parts[0]:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def completion(text: str, *lines: str) -> bytes:
    body = json.dumps({"id": "c", "choices": [{"index": 0, "text": text}]}).encode()
    return answer(body, "Content-Type: application/json", "X-Engine: raw", *lines)


@pytest.mark.asyncio
async def test_whole_answers_reach_the_client_alike_whichever_reads_them():
    plan = [completion("warm"), completion("one"), completion("a longer second answer"),
            (completion("split")[:30], completion("split")[30:]),  # httptools reads this one
            completion("closing", "Connection: close"), completion("after the close")]
    engine = RawEngine(plan)
    async with serve_raw(engine.serve) as url:
        async with running_router(tolerant(), primary=url) as router:
            svc = router.services["tiny"]
            await wait_for(lambda: svc.routable() is not None)
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            try:
                texts, engine_headers = [], []
                for _ in plan:
                    writer.write(post("/v1/completions", b'{"model":"tiny","prompt":"Hello","max_tokens":1}'))
                    status, headers, body = await read_response(reader)
                    assert status == 200, body
                    texts.append(json.loads(body)["choices"][0]["text"])
                    engine_headers.append((headers["x-engine"], headers["content-type"], headers["x-failover-instance"]))
            finally:
                writer.close()
            assert texts == ["warm", "one", "a longer second answer", "split", "closing", "after the close"]
            assert set(engine_headers) == {("raw", "application/json", "primary-0")}
            pool = next(iter(svc.instances.values()))._session
            assert pool is not None and len(pool.heads.seen) == 2  # the plain head and the closing one
            # /ready's connection, the completions' pooled one, and a new one after the close
            assert engine.connections >= 2
