"""router/front.py's answers: what the proxy reads of a lean request, and the response writers.

``FastRequest.answer`` writes a whole response in one write; ``FastStream`` is a chunked SSE
response whose head goes out with its first chunk, and whose last chunk can carry the terminator.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from multidict import CIMultiDict

_date = ["", 0, b""]
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_STATUS_LINES = {s: b"HTTP/1.1 %d %b\r\n" % (s, r.encode()) for s, r in _REASONS.items()}


def http_date() -> str:
    now = int(time.time())
    if _date[1] != now:
        _date[0], _date[1] = formatdate(now, usegmt=True), now
        _date[2] = _date[0].encode()
    return _date[0]


def _date_b() -> bytes:
    http_date()
    return _date[2]


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


class FastRequest:
    """What the proxy reads of a request (as aiohttp's web.Request offers it), plus ``forward``
    (the header lines that go upstream, as bytes) and ``answer`` (the response, written now)."""

    __slots__ = ("method", "path", "raw_headers", "forward", "conn")

    def __init__(self, method: str, path: str, raw_headers: list[tuple[bytes, bytes]], forward: bytes,
                 conn) -> None:
        self.method, self.path, self.raw_headers, self.forward, self.conn = method, path, raw_headers, forward, conn

    @property
    def headers(self) -> CIMultiDict:
        return CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_headers)

    @property
    def raw_path(self) -> str:
        return self.path

    def answer(self, status: int, lines: bytes, instance: str, body: bytes) -> None:
        """Write a whole response now (the proxy's bookkeeping comes after it); ``lines``: the
        engine's end-to-end headers, as header lines. A client already gone is not an error here:
        its task ends."""
        conn = self.conn
        conn.started = True
        if conn.closed or conn.transport.is_closing():
            conn.keep_alive = False
            return
        close = b"" if conn.keep_alive else b"Connection: close\r\n"
        conn.transport.write(b"%b%bX-Failover-Instance: %b\r\nContent-Length: %d\r\nDate: %b\r\n%b\r\n%b"
                             % (status_line(status), lines, instance.encode("latin-1"), len(body), _date_b(), close, body))

    def open_stream(self, headers: dict) -> "FastStream":
        """Start a chunked 200 (router/stream.py's SSE answer)."""
        return FastStream(self.conn, headers)


class FastStream:
    """A chunked response on a Front connection: ``write``/``write_eof`` as web.StreamResponse's.
    Its head goes out with its first chunk (one write, not two); a client already gone is seen
    there (ConnectionResetError), as it would have been at the head's own write."""

    __slots__ = ("conn", "eof", "ended", "head")

    def __init__(self, conn, headers: dict) -> None:
        self.conn, self.eof, self.ended = conn, False, False  # ended: the terminator is sent
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        close = "" if conn.keep_alive else "Connection: close\r\n"
        self.head = (f"HTTP/1.1 200 OK\r\n{lines}Date: {http_date()}\r\nTransfer-Encoding: chunked\r\n"
                     f"{close}\r\n").encode("latin-1")
        conn.started = True

    def send(self, data: bytes, last: bool = False) -> bool:
        """``write`` without the wait: True when the client's socket is now paused (drain it).
        ``last``: the response ends with these bytes (the chunked terminator goes in the same
        write; ``write_eof`` then only waits for the client, as it would after sending it)."""
        head, self.head = self.head, b""
        if last:
            self.ended = True
            self.conn.send(b"%b%x\r\n%b\r\n0\r\n\r\n" % (head, len(data), data))
        else:
            self.conn.send(b"%b%x\r\n%b\r\n" % (head, len(data), data))
        return self.conn._paused_writing

    def send_chunk(self, chunk: bytes) -> bool:
        """``send`` of bytes already framed as one chunk, once the head is out (router/stream.py's
        lane: the engine's own chunk); True when the client's socket is now paused."""
        assert not self.head and not self.ended, "send_chunk before the head or after the end"
        self.conn.send(chunk)
        return self.conn._paused_writing

    async def write(self, data: bytes) -> None:
        if data:
            if self.send(data):  # only then is there anything to wait for (send raised if closed)
                await self.conn.drain()

    def end_now(self) -> None:
        """``write_eof`` without waiting for the client to take the bytes."""
        if not self.eof:
            self.eof = True
            if not self.ended:
                head, self.head = self.head, b""
                self.conn.send(head + b"0\r\n\r\n")

    async def write_eof(self) -> None:
        if not self.eof:
            self.eof = True
            if not self.ended:
                head, self.head = self.head, b""
                self.conn.send(head + b"0\r\n\r\n")
            await self.conn.drain()
