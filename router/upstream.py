"""The router's HTTP/1.1 client to its engines: one keep-alive pool per instance, httptools' parser.

Issue 20: aiohttp's ClientSession cost about 0.15 ms of CPU per request here. This client does what
the router needs: a request is one ``transport.write``; the response is parsed by httptools (llhttp)
in the protocol's callbacks; body chunks go straight to the one reader (the relay) or are joined once.

    pool = Pool("http://127.0.0.1:9001", limit=128, connect_timeout=1.0)
    async with pool.request("POST", "/v1/completions", head_lines, body) as up:
        up.status, up.headers, up.content_type
        await up.read()            # whole body, or:  chunk = await up.readany()  (b"" at the end)
    await pool.close()             # every connection, in-flight ones too (fencing, shutdown)

Errors, which the proxy maps to failure kinds (router/errors.py BackendFailed): ConnectError (the
connect was refused or failed: "connect"), ConnectTimeout (a TimeoutError: "slow"), ProtocolError
(not HTTP: "garbage"), ResetError (a ConnectionResetError: the connection ended early, "reset"),
PoolClosed (a RuntimeError: the pool was closed, i.e. fenced). As aiohttp does (RFC 9112 9.3.1),
an idempotent request that meets a dead pooled connection before any response byte is sent once
more on a fresh one; a POST is not. A response left unread (``async with`` exited before its end)
closes its connection instead of pooling it.
"""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_mod
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

from router.answer_heads import AnswerHeads
from router.upstream_errors import ConnectError, ConnectTimeout, PoolClosed, ProtocolError, ResetError
from router.upstream_response import HIGH_WATER, Response

__all__ = ["ConnectError", "ConnectTimeout", "PoolClosed", "Pool", "ProtocolError", "ResetError", "Response"]

IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class _Conn(asyncio.Protocol):
    """One connection to the engine; at most one request on it at a time."""

    def __init__(self, pool: "Pool", loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.paused = False
        self.head = False  # the request in flight is a HEAD: its response has no body
        self.fed: Response | None = None  # the response whose bytes httptools has seen
        self.mid = False  # httptools is inside a chunk of a chunked body (between its header and its end)

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp.complete:  # bytes while idle: not a response to anything
            self.close()
            return
        if resp.whole and self.fed is not resp and not self.head and self._whole(resp, data):
            return
        lane = resp.lane
        if lane is not None and not self.mid and resp.sink is not None and lane(data):
            return  # one whole chunk, taken by the relay's lane: httptools stays at a chunk's boundary
        self.fed = resp  # httptools has seen this response's bytes: it reads the rest
        try:
            self.parser.feed_data(data)
            if resp.sink is not None and resp._chunks:  # the relay: all this read's chunks in one call
                chunks = resp._chunks
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                resp.sink(body)
            elif resp.complete:
                resp.hand_on()
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("the engine upgraded the connection"))
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"bad HTTP from the engine: {exc}"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        resp = self.resp
        if resp is not None and not resp.complete:
            if resp.headers_done and not resp.delimited:
                resp.complete = True  # delimited by the close itself (HTTP/1.0 style)
                resp._wake()
                resp.hand_on()
            else:
                self._fail(ResetError("the engine closed the connection before its response ended"))

    def eof_received(self):
        return False  # close on the engine's FIN

    def _whole(self, resp: Response, data: bytes) -> bool:
        """A whole answer in this one read, inside router/heads.py's subset: the response as
        httptools' callbacks would leave it, with one wake-up, and ``on_done``. The parser never saw
        it, so it is still at a message's start, as after a complete one."""
        a = self.pool.heads.read(data)
        if a is None:
            return False
        resp.status, resp.raw_headers, resp.content_type, resp.keep_alive, resp.lines, body = a
        resp.headers_done = resp.delimited = resp.complete = True
        resp._chunks.append(body)
        resp._size = len(body)
        resp._wake()
        resp.hand_on()
        return True

    # -- httptools callbacks ------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        resp.raw_headers.append((name, value))
        lk = name.lower()
        if lk == b"content-type":
            resp.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif lk == b"content-length":
            resp.delimited = True
        elif lk == b"transfer-encoding" and b"chunked" in value.lower():
            resp.delimited = resp.chunked = True

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp.complete:  # a second response to one request
            self._fail(ProtocolError("the engine sent more than one response"))
            return
        resp.status = status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (we never ask for one): the real one follows
            resp.raw_headers, resp.content_type, resp.delimited = [], "", False
            return
        resp.keep_alive = self.parser.should_keep_alive()
        resp.headers_done = True
        if self.head or status in (204, 304):
            resp.delimited = True
            if self.head:  # llhttp would wait for a body it was not told is absent
                resp.keep_alive = False
                self.on_message_complete()
                return
        resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        resp._chunks.append(body)
        if resp.sink is not None:  # the relay takes them after the parse (data_received): no wake-up
            return
        resp._size += len(body)
        if resp._size > HIGH_WATER and not self.paused and not resp.whole:
            self.paused = True
            self.transport.pause_reading()
        resp._wake()

    def on_chunk_header(self) -> None:
        self.mid = True

    def on_chunk_complete(self) -> None:
        self.mid = False

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp.status and resp.status < 200:
            return
        if resp.complete:
            return
        resp.complete = True
        resp._wake()

    # -- ours ---------------------------------------------------------------------------
    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def _fail(self, exc: BaseException) -> None:
        resp = self.resp
        if resp is not None and resp.error is None and not resp.complete:
            resp.error = exc
            resp._wake()
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


class _Request:
    """``async with pool.request(...) as up``: connect (or reuse), send, wait for the headers;
    on exit the connection goes back to the pool if its response was read to the end."""

    __slots__ = ("pool", "method", "data", "conn", "resp", "on_done")

    def __init__(self, pool: "Pool", method: str, data: bytes,
                 on_done: Callable[[Response], None] | None = None) -> None:
        self.pool, self.method, self.data, self.on_done = pool, method, data, on_done
        self.conn: _Conn | None = None
        self.resp: Response | None = None

    async def __aenter__(self) -> Response:
        pool = self.pool
        retry = self.method in IDEMPOTENT
        while True:
            conn, reused = await pool._take()
            self.conn = conn
            resp = conn.resp = Response(conn)
            resp.on_done = self.on_done
            conn.head = self.method == "HEAD"
            try:
                conn.transport.write(self.data)
                while not resp.headers_done:
                    if resp.error is not None:
                        break
                    await resp._wait()
            except BaseException:  # cancelled (a fence, a stall, the client gone): __aexit__ will not run
                conn.close()
                raise
            if resp.error is None:
                self.resp = resp
                return resp
            conn.close()
            if reused and retry and isinstance(resp.error, ResetError):
                retry = False  # a pooled connection the engine had closed: once more, fresh
                continue
            raise resp.error

    async def __aexit__(self, et, exc, tb) -> None:
        conn = self.conn
        if conn is None:
            return
        resp = self.resp
        if et is None and resp is not None and resp.complete and resp.keep_alive and not conn.closed:
            conn.resp = None
            self.pool._give(conn)
        else:
            conn.close()


class Pool:
    """Keep-alive connections to one instance, at most ``limit`` at once (the instance's gate keeps
    its requests there already: this is a second fence)."""

    def __init__(self, url: str, limit: int, connect_timeout: float) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"an instance URL must be http(s)://host[:port], not {url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl_mod.create_default_context() if u.scheme == "https" else None
        self.host_header = u.netloc.rsplit("@", 1)[-1]
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.closed = False
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._connecting = 0
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self.heads = AnswerHeads()  # its engine's whole-answer heads, checked once each

    def request(self, method: str, target: str, head: bytes, body: bytes | bytearray | None,
                on_done: Callable[[Response], None] | None = None) -> _Request:
        """``head``: the request's header lines, latin-1, each ending in CRLF (no Host, no
        Content-Length). The request is one bytes object, written at once. ``on_done``: see
        ``Response.on_done``."""
        return _Request(self, method, self.encode(method, target, head, body), on_done)

    def encode(self, method: str, target: str, head: bytes, body: bytes | bytearray | None) -> bytes:
        """The request's bytes (``request``'s arguments)."""
        n = len(body) if body else 0
        start = f"{method} {target} HTTP/1.1\r\nHost: {self.host_header}\r\n".encode("latin-1")
        if n or method not in ("GET", "HEAD"):
            return b"%b%bContent-Length: %d\r\n\r\n%b" % (start, head, n, body or b"")
        return b"%b%b\r\n" % (start, head)

    def send_now(self, method: str, data: bytes) -> tuple["_Conn", Response] | None:
        """Send ``data`` on an idle pooled connection, with no await: its (connection, response),
        or None when none is idle (the caller takes the ``request`` path, which may connect). The
        caller owns the connection until it hands it back with ``finish``."""
        if self.closed:
            return None
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                self._busy.add(conn)
                resp = conn.resp = Response(conn)
                conn.head = method == "HEAD"
                conn.transport.write(data)
                return conn, resp
        return None

    def finish(self, conn: "_Conn", resp: Response) -> None:
        """``send_now``'s connection back: pooled if its response was read to the end, else closed."""
        if resp.complete and resp.keep_alive and not conn.closed and resp.error is None:
            conn.resp = None
            self._give(conn)
        else:
            conn.close()

    async def _take(self) -> tuple[_Conn, bool]:
        if self.closed:
            raise PoolClosed("Session is closed")
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                self._busy.add(conn)
                return conn, True
        while len(self._busy) + self._connecting >= self.limit:
            fut = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._slot_waiters:
                    self._slot_waiters.remove(fut)
            if self.closed:
                raise PoolClosed("Session is closed")
        self._connecting += 1
        try:
            conn = await self._connect()
        finally:
            self._connecting -= 1
        if self.closed:
            conn.close()
            raise PoolClosed("Session is closed")
        self._busy.add(conn)
        return conn, False

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout) as t:
                _, conn = await loop.create_connection(lambda: _Conn(self, loop), self.host, self.port, ssl=self.ssl)
        except TimeoutError as exc:
            if t.expired():
                raise ConnectTimeout(f"connect to {self.host}:{self.port} timed out after "
                                     f"{self.connect_timeout}s") from None
            raise exc
        except OSError as exc:
            raise ConnectError(exc.errno, f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from exc
        return conn

    def _give(self, conn: _Conn) -> None:
        self._busy.discard(conn)
        if self.closed:
            conn.close()
            return
        self._idle.append(conn)
        self._wake_one()

    def _forget(self, conn: _Conn) -> None:
        if conn in self._busy:
            self._busy.discard(conn)
            self._wake_one()
        # a closed idle connection is skipped (and dropped) by _take

    def _wake_one(self) -> None:
        while self._slot_waiters:
            fut = self._slot_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    async def close(self) -> None:
        """Close every connection now: requests in flight fail with ResetError."""
        self.close_now()

    def close_now(self) -> None:
        """``close``, from a callback."""
        self.closed = True
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        for fut in self._slot_waiters:
            if not fut.done():
                fut.set_result(None)
