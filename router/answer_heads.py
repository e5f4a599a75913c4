"""The engines' plain whole answers, read without httptools (router/upstream.py, issue 20).

A whole answer to a ``Direct`` request (router/answer_now.py) usually arrives in one read: a head
and a Content-Length body. httptools reads it with a Python callback per header and a wake-up per
callback, cache-cold after the engine's forward pass; a strict pattern over the head (as
router/heads.py's for requests) was no cheaper. One engine's answer heads differ only in their
Content-Length within a second (and in Date between seconds), so each distinct head is checked once
by the strict pattern and remembered by its bytes less the Content-Length line; the next answers
with that head cost a few ``bytes`` methods. Anything else (a chunked body, an answer split over
reads or followed by more bytes, a head outside the pattern, 1xx/204/304, no or two
Content-Length) is left to httptools, as before.
"""

from __future__ import annotations

import re

from router.forward import answer_lines
from router.heads import FIELD, FIELDS

# An answer with a body, in HTTP/1.1: not 1xx, 204 or 304.
_ANSWER = re.compile(rb"HTTP/1\.1 ((?!204|304)[2-5][0-9][0-9]) [\t\x20-\x7e\x80-\xff]*+\r\n(" + FIELDS + rb")\r\n")

LIMIT = 16  # distinct heads remembered per pool (a new Date each second makes a new one)


class AnswerHeads:
    """One pool's remembered heads: key (the head less its Content-Length line) -> (status,
    fields, content type, keep-alive, the client's header lines), ``fields`` as (name, value) with
    the value's whitespace stripped and without the Content-Length (the framing: the body's own
    length)."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: dict[bytes, tuple[int, list, str, bool, bytes]] = {}

    def read(self, data: bytes) -> tuple[int, list, str, bool, bytes, bytes] | None:
        """(status, fields, content type, keep-alive, client header lines, body) of the whole
        answer that ``data`` is, exactly, or None (httptools reads it). The fields list is shared:
        do not change it."""
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return None
        i = data[:end + 2].lower().find(b"\r\ncontent-length:")
        if i < 0:
            return None
        j = data.find(b"\r\n", i + 2)
        value = data[i + 17:j].strip(b" \t")
        if not value.isdigit() or len(data) != end + 4 + int(value):
            return None
        key = data[:i] + data[j:end + 4]
        known = self.seen.get(key)
        if known is None:
            known = _check(data, end + 4)
            if known is None:
                return None
            if len(self.seen) >= LIMIT:
                self.seen.clear()
            self.seen[key] = known
        return *known, data[end + 4:]


def _check(data: bytes, size: int) -> tuple[int, list, str, bool, bytes] | None:
    """The strict pattern over a head of ``size`` bytes: one Content-Length, no Transfer-Encoding."""
    m = _ANSWER.match(data)
    if m is None or m.end() != size:
        return None
    fields, lengths, keep_alive, content_type = [], 0, True, ""
    for name, value in FIELD.findall(m.group(2)):
        value = value.strip(b" \t")
        lname = name.lower()
        if lname == b"content-length":
            lengths += 1
            continue
        if lname == b"transfer-encoding":
            return None
        if lname == b"content-type":
            content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif lname == b"connection":
            keep_alive = b"close" not in [t.strip().lower() for t in value.split(b",")]
        fields.append((name, value))
    return (int(m.group(1)), fields, content_type, keep_alive, answer_lines(fields)) if lengths == 1 else None
