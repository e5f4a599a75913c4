"""The router's listener: a lean HTTP/1.1 front for plain proxied requests, aiohttp for the rest.

Issue 20: aiohttp's server cost the router about 0.15 ms of CPU per request here (its protocol,
request and payload objects, routing, response preparation), half the latency it added. Each
connection starts on ``Front``, which takes a request itself only when it is plain:

- HTTP/1.1, GET or POST, the raw target exactly one of ``forward_paths`` (no query, no escapes);
- a head inside router/heads.py's strict subset of HTTP/1.1, at most one Content-Length, none of
  Transfer-Encoding, Content-Encoding, Expect, Upgrade;
- a body of at most ``FAST_BODY`` bytes that fits in the router's body budget, all of it arriving
  within ``BODY_WAIT`` of the headers.

Such a request goes to ``Proxy.serve`` (the same path as aiohttp's handler, after its body is
read) with the body counted in the same ``BodyBudget``. Anything else, at a request boundary,
hands the connection (with every byte received and not yet served) to aiohttp's own protocol for
the rest of its life: the admin API, the status page, odd paths (404), chunked or gzip bodies,
slow senders (408), huge bodies (413/503) all get exactly aiohttp's handling, as before.

As aiohttp's handler_cancellation: a client that disconnects cancels its request's task. The
common whole answer has no task (router/answer_now.py's ``Direct``, in the same ``task`` slot: it
has ``cancel``, and ends through ``finished``); a stream, or any request the proxy cannot send at
once, runs in a task.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiohttp import web

from router import heads
from router.answer_now import Direct
from router.forward import FORWARD_TAIL, REQUEST_DROP_B
from router.front_answer import FastRequest, FastStream, http_date
from router.proxy import ANSWERED

log = structlog.get_logger(__name__)

FAST_BODY = 256 * 1024  # larger bodies go to aiohttp's path
BODY_WAIT = 0.25  # a body not all here this long after its headers: aiohttp's path (its 408 timer)
MAX_HEAD = 16 * 1024  # no end of headers within this: aiohttp's path (its 431/400)
KEEPALIVE = 75.0  # an idle connection is closed after this (aiohttp's default)
class Front(asyncio.Protocol):
    """One client connection, until (if ever) it is handed to aiohttp."""

    def __init__(self, site: "FrontSite") -> None:
        self.site = site
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.task = None  # the request being served: an asyncio.Task, or a Direct (no task)
        self._pending: tuple | None = None  # (coroutine, body bytes, on_drop) of a task not started yet
        self.on_drain = None  # a task-less stream waiting for the client's socket (router/stream_now.py)
        self.keep_alive = True
        self.closed = False
        self.handed = False
        self.started = False  # the current request's response has begun
        self._paused_writing = False
        self._drain: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None  # the body wait
        self._ka: asyncio.TimerHandle | None = None  # keep-alive: one timer, re-armed only when it fires
        self.last = 0.0  # loop time the last request ended (or the connection began)
        self.loop: asyncio.AbstractEventLoop | None = None  # (Python 3.11's get_running_loop is a getpid syscall)

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.site.conns.add(self)
        self.loop = loop = asyncio.get_running_loop()
        self.last = loop.time()
        self._ka = loop.call_later(KEEPALIVE, self._check_idle)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.task is None:
            self._next()
        elif len(self.buf) > MAX_HEAD + FAST_BODY:  # pipelined requests piling up: wait for ours
            self.transport.pause_reading()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.on_drain = None
        self.site.conns.discard(self)
        self._cancel_timer(keepalive=True)
        if self.task is not None:
            self._cancel()  # the client is gone: so is its request (handler_cancellation)
        self._wake_drain()

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        self._wake_drain()
        cb, self.on_drain = self.on_drain, None
        if cb is not None:
            cb()

    def paused(self) -> bool:
        """The client's socket is not taking bytes now (its buffer is past the high-water mark)."""
        return self._paused_writing

    # -- writing ----------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        if self.closed or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._paused_writing:
            self._drain = fut = asyncio.get_running_loop().create_future()
            await fut
            if self.closed:
                raise ConnectionResetError("the client closed the connection")

    def _wake_drain(self) -> None:
        fut, self._drain = self._drain, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    # -- requests ---------------------------------------------------------------------------
    def _cancel_timer(self, keepalive: bool = False) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if keepalive and self._ka is not None:
            self._ka.cancel()
            self._ka = None

    def _check_idle(self) -> None:
        loop = asyncio.get_running_loop()
        idle = loop.time() - self.last
        if self.task is not None or idle < KEEPALIVE:
            self._ka = loop.call_later(KEEPALIVE - idle if self.task is None else KEEPALIVE, self._check_idle)
            return
        self._ka = None
        if self.task is None:
            if self.buf:  # a head trickling in: aiohttp's limits and timers decide
                self._handover()
            else:
                self.transport.close()

    def _next(self) -> None:
        """Serve the next whole request in the buffer, wait for more, or hand over."""
        buf = self.buf
        if not buf:
            return
        if self.site.closing:
            self.transport.close()
            return
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                self._handover()
            return
        head = heads.request(bytes(buf[:end + 4]), REQUEST_DROP_B)
        if head is None or head.size != end + 4:
            self._handover()
            return
        path = head.path.decode("ascii")  # visible ASCII, by the pattern
        if path not in self.site.paths:
            self._handover()
            return
        n = head.length or 0
        total = end + 4 + n
        if n > self.site.max_body:  # aiohttp's path: its 413, or its budget and timers for a big one
            self._handover()
            return
        if len(buf) < total:  # the body is on its way: a short while, else aiohttp's path
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(BODY_WAIT, self._handover)
            return
        budget = self.site.proxy.bodies
        if n > budget.left:
            self._handover()  # aiohttp's path answers 503 (the budget is full)
            return
        self._cancel_timer()
        body = bytes(buf[end + 4:total])
        del buf[:total]
        self.keep_alive = head.keep_alive
        forward = head.forward
        forward.append(FORWARD_TAIL)
        req = FastRequest(head.method.decode(), path, head.fields, b"".join(forward), self)
        budget.take(n)
        self.started = False
        self.site.inflight += 1
        try:
            now = self.site.proxy.serve_now(req, body, time.monotonic(), n)
        except Exception:
            log.exception("front_request_failed", path=req.path)
            self.keep_alive = False
            self.transport.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
            self.finished(n)
            return
        if isinstance(now, Direct):  # (not asyncio.iscoroutine: an ABC check, 1 % of the router's samples)
            self.task = now  # sent already; it ends through finished()
        else:
            self.in_task(now, n, path)

    def in_task(self, coro, n: int, path: str, on_drop=None) -> None:
        """Serve the current request by the coroutine ``coro`` (router/proxy.py's task path).
        ``on_drop()``: what ``coro`` would have ended had it run, if it is cancelled before it does."""
        self._pending = (coro, n, on_drop)
        self.task = self.loop.create_task(self._serve(coro, n, path))

    def _cancel(self) -> None:
        """Cancel the current request. A task cancelled before its first step never runs a line of
        ``_serve`` (not even its ``finally``): its request is ended here instead."""
        task, pending = self.task, self._pending
        task.cancel()
        if pending is not None and isinstance(task, asyncio.Task):
            self._pending = None
            coro, n, on_drop = pending
            coro.close()  # never awaited
            if on_drop is not None:
                on_drop()
            self.keep_alive = False
            self.finished(n)

    async def _serve(self, coro, n: int, path: str) -> None:
        self._pending = None  # running: its finally ends the request
        try:
            resp = await coro
            if resp is ANSWERED:
                pass
            elif not isinstance(resp, FastStream):
                self._respond(resp)
            elif not resp.eof:  # a stream that did not end (ClientGone): the connection is unusable
                self.keep_alive = False
        except asyncio.CancelledError:
            self.keep_alive = False
        except Exception:
            log.exception("front_request_failed", path=path)
            self.keep_alive = False
            if not self.closed and not self.started:
                self.transport.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                                     b"Connection: close\r\n\r\n")
        finally:
            self.finished(n)

    def finished(self, n: int) -> None:
        """The current request is over (its task's, or a Direct's, last step): its body leaves the
        budget, then the next request in the buffer, if any, is served."""
        site = self.site
        site.proxy.bodies.give(n)
        site.inflight -= 1
        self.task = None
        if site.closing and not site.inflight:
            site.idle.set()
        if self.closed:
            return
        if not self.keep_alive or site.closing:
            self.transport.close()
            return
        self.transport.resume_reading()
        self.last = self.loop.time()
        self._next()

    def _respond(self, resp: web.StreamResponse) -> None:
        if self.closed or resp.status == 499:  # ClientGone: nobody to answer
            self.keep_alive = False
            return
        body = resp.body or b""
        lines = "".join(f"{k}: {v}\r\n" for k, v in resp.headers.items() if k != "Content-Length")
        close = "" if self.keep_alive else "Connection: close\r\n"
        self.transport.write(f"HTTP/1.1 {resp.status} {resp.reason}\r\n{lines}Content-Length: {len(body)}\r\n"
                             f"Date: {http_date()}\r\n{close}\r\n".encode("latin-1") + body)

    def _handover(self) -> None:
        """aiohttp's protocol takes this connection, with the bytes not yet served."""
        if self.handed or self.closed or self.task is not None:
            return
        self._cancel_timer(keepalive=True)
        self.handed = True
        self.site.conns.discard(self)
        proto = self.site.runner.server()
        self.transport.set_protocol(proto)
        proto.connection_made(self.transport)
        self.transport.resume_reading()
        data, self.buf = bytes(self.buf), bytearray()
        if data:
            proto.data_received(data)


class FrontSite(web.TCPSite):
    """aiohttp's TCPSite, with each connection starting on Front."""

    def __init__(self, runner: web.AppRunner, config, proxy) -> None:
        super().__init__(runner, config.host, config.port)
        self.runner, self.proxy, self.paths = runner, proxy, frozenset(config.forward_paths)
        self.max_body = min(FAST_BODY, config.max_body_bytes)
        self.conns: set[Front] = set()
        self.closing = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.grace = config.shutdown_timeout
        self.reuse_port = config.reuse_port  # the kernel spreads new connections over the workers

    async def start(self) -> None:
        self._runner._reg_site(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Front(self), self._host, self._port,
                                                backlog=self._backlog, reuse_port=self.reuse_port or None)
        self._bound_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening; idle connections close now, requests in flight get ``grace`` to end."""
        self.closing = True
        await super().stop()
        for c in list(self.conns):
            if c.task is None:
                c.transport.close()
        if self.inflight:
            self.idle.clear()
            try:
                async with asyncio.timeout(self.grace):
                    await self.idle.wait()
            except TimeoutError:
                for c in list(self.conns):
                    if c.task is not None:
                        c._cancel()
        for c in list(self.conns):
            c.transport.close()
