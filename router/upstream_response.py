"""One upstream response of router/upstream.py's client, and its own body reader (``content``).

The connection (router/upstream.py's ``_Conn``) fills it from httptools' callbacks; exactly one
reader takes the body: a coroutine (``readany``, ``read``), the relay's ``sink`` (each read's chunks
in the connection's callback), or a task-less reader's ``waker`` and ``on_done``
(router/answer_now.py).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from router.forward import answer_lines

HIGH_WATER = 1 << 20  # response bytes buffered before the socket is paused (a slow client)


class Response:
    """One response; also its own ``content`` (``readany``/``at_eof``, as aiohttp's StreamReader)."""

    __slots__ = ("status", "content_type", "_chunks", "_size", "complete", "error",
                 "_waiter", "_conn", "headers_done", "raw_headers", "lines", "keep_alive", "delimited", "sink",
                 "on_done", "waker", "whole", "chunked", "lane")

    def __init__(self, conn) -> None:  # router/upstream.py's _Conn
        self._conn = conn
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []  # as received (names as the engine spelt them)
        self.lines: bytes | None = None  # client_lines(), once known
        self.content_type = ""
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self.headers_done = self.complete = False
        self.keep_alive = False
        self.delimited = False  # Content-Length or chunked: the end is known without a close
        self.error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        # set by the one reader (router/stream.py's relay): each read's body chunks go to it, joined,
        # in data_received, without a wake-up; it must not raise, and hands back by setting this
        # to None and calling _wake()
        self.sink: Callable[[bytes], None] | None = None
        # called once, in data_received, when the whole response has been read (router/proxy.py
        # answers a whole response from here, before its task wakes); it must not raise
        self.on_done: Callable[["Response"], None] | None = None
        # a reader with no task (router/answer_now.py): called instead of waking a future, on every
        # change (headers, body, end, error); it must not raise
        self.waker: Callable[[], None] | None = None
        self.whole = False  # the reader takes the body whole: never pause reading for it
        self.chunked = False  # Transfer-Encoding: chunked
        # the relay's lane (router/stream.py ``_lane``): while ``sink`` is set, offered each read that
        # starts at a chunk's boundary, before httptools sees it; True: it took the read (one whole
        # chunk), which httptools then never sees; False: the read goes the usual way. Must not raise.
        self.lane: Callable[[bytes], bool] | None = None

    @property
    def headers(self) -> list[tuple[str, str]]:
        """The headers, decoded (latin-1)."""
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_headers]

    def client_lines(self) -> bytes:
        """The end-to-end headers as the client's header lines (router/forward.py ``answer_lines``);
        router/answer_heads.py knows them already for a head it has seen."""
        lines = self.lines
        if lines is None:
            self.lines = lines = answer_lines(self.raw_headers)
        return lines

    def hand_on(self) -> None:
        """Give a complete response to its ``on_done``, once."""
        done, self.on_done = self.on_done, None
        if done is not None:
            done(self)

    @property
    def content(self) -> "Response":
        return self

    def at_eof(self) -> bool:
        return self.complete and not self._chunks

    # -- for a reader that hands the body to a sink and back (router/stream.py, router/stream_now.py)
    def can_sink(self) -> bool:
        """Nothing buffered, not ended, not failed: a ``sink`` may take the body from the next read."""
        return not self._chunks and not self.complete and self.error is None

    def buffered(self) -> bool:
        return bool(self._chunks)

    def take(self) -> bytes:
        """The body bytes buffered now, joined (b"" if none), without a wait: ``readany``'s."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._size > HIGH_WATER:
            self._conn.resume()
        self._size = 0
        return data

    async def changed(self) -> None:
        """Wait for the next change: body bytes (with no sink), the end, an error, a sink's hand-back."""
        await self._wait()

    def unsink(self) -> None:
        """The sink hands the body back to the coroutine reader, waking it."""
        self.sink = None  # the lane stays: it is offered only while a sink is set
        self._wake()

    def _wake(self) -> None:
        if self.waker is not None:
            self.waker()
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = w = self._conn.loop.create_future()
        await w

    async def readany(self) -> bytes:
        """The body bytes buffered now (waiting for some), b"" once the response is complete."""
        while not self._chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()
        return self.take()

    def body(self) -> bytes:
        """The whole body of a complete response, joined once (``read`` then returns the same)."""
        chunks = self._chunks
        if len(chunks) != 1:
            data = b"".join(chunks)
            chunks.clear()
            chunks.append(data)
        return chunks[0]

    async def read(self) -> bytes:
        self.whole = True  # past HIGH_WATER nothing else would resume the socket
        self._conn.resume()
        while not self.complete:
            if self.error is not None:
                raise self.error
            await self._wait()
        return self.body()
