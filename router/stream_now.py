"""A stream on router/front.py's listener with no task while nothing fails (issue 20).

``DirectStream`` is router/answer_now.py's ``Direct`` for a stream: sent at once on an idle pooled
connection, its SSE relayed by the relay's per-read callback (router/stream.py ``_on_chunk``, as on
the task path), its end, its errors and a paused client's drain seen in callbacks. The one thing
the callbacks cannot do, continuing after a failure (a retry before the first byte, a migration
after it), goes to the proxy's task path with the relay as it stands (``Proxy.carry_on``): the
tokens the client has are the relay's record, exactly as when a task's own attempt fails.

An answer that is not SSE (a 4xx, a retry status) is a whole answer, as ``Direct``'s. After
``[DONE]`` (sent with the chunked terminator) the client's request is over at once; the engine's
last chunk is awaited in a callback (at most ``DRAIN_TIMEOUT``) so that the connection is pooled.
"""

from __future__ import annotations

import asyncio

import structlog

from router.answer_now import Direct
from router.backend import Attempt, Service
from router.errors import BackendFailed
from router.stream import ClientGone, StreamRelay
from router.upstream import ProtocolError

log = structlog.get_logger(__name__)

DRAIN_TIMEOUT = 0.5  # after [DONE]: how long the end of the upstream response may take to arrive
HEAD, WHOLE, SINK = 0, 1, 2  # waiting for the headers; a whole (non-SSE) answer; relaying SSE


class StreamAttempt(Attempt):
    """An ``Attempt`` with no task to cancel: an abort while armed (a fence, the stall watchdog)
    tells its ``DirectStream``; one while disarmed (the client's socket paused, or after [DONE]) is
    seen where the relay re-arms, as on the task path."""

    __slots__ = ("owner",)

    def abort(self) -> None:
        first = not self.aborted
        self.aborted = True
        if first and self.armed:
            asyncio.get_running_loop().call_soon(self.owner.aborted)  # not inside abort_inflight's loop


class DirectStream(Direct):
    __slots__ = ("relay", "attempt", "mode", "pumping", "timer")

    @classmethod
    def start(cls, proxy, req, service: Service, relay: StreamRelay, body: bytes, target: str, t0: float,
              n: int) -> "DirectStream | None":
        """Send the stream's request now and return its ``DirectStream``, or None (nothing taken)."""
        inst = service.routable()
        if inst is None or not inst.gate.try_enter():
            return None
        pool = inst.session(proxy.config.connect_timeout)
        sent = pool.send_now(req.method, pool.encode(req.method, target, req.forward, relay.first_body(body)))
        if sent is None:
            inst.gate.leave()
            return None
        self = cls(proxy, req, service, inst, body, target, t0, n)
        self.pool, (self.conn, self.resp) = pool, sent
        self.relay, self.mode, self.pumping, self.timer = relay, HEAD, False, None
        self.attempt = attempt = StreamAttempt()
        attempt.owner = self
        self.resp.waker = self._woken
        self.resp.on_done = self._ended
        inst.begin()
        inst.attempts.add(attempt)
        proxy.wake()
        return self

    # -- the upstream's callbacks ---------------------------------------------------------------
    def _woken(self) -> None:
        if self.over or self.pumping or self.attempt.aborted:
            return
        resp = self.resp
        if self.mode == HEAD:
            if resp.error is not None:
                super()._woken()
            elif resp.headers_done:
                if resp.status == 200 and resp.content_type == "text/event-stream":
                    self.mode = SINK
                    self.attempt.watch(self.proxy.config.stall_timeout)
                    self.relay.attach(resp, self.inst.name, self.attempt, self._mark_ok, self._first_ok)
                    self._pump()
                else:  # a whole answer to a stream request (a 4xx, a retry status): as Direct's
                    self.mode = WHOLE
                    resp.whole = True
                    self.conn.resume()
        elif self.mode == WHOLE:
            super()._woken()
        elif resp.sink is None:  # the relay handed back: done, an error, a paused client
            self._pump()
        elif resp.error is not None:  # the read failed under the sink: it will not be called again
            self._error(resp.error)

    def _ended(self, up) -> None:
        """The response is complete (``on_done``): a whole answer's end, or a stream's without [DONE]
        (with [DONE], the relay's hand-back comes first and finishes it)."""
        if self.over:
            return
        if self.mode == SINK:
            if self.resp.sink is not None and not self.attempt.aborted:
                self.resp.sink = None
                self._pump()
            return
        self.attempt.disarm()  # answered: a fence can no longer make it a retry
        self._done(up)

    def _pump(self) -> None:
        """The task path's ``pump`` loop, in callbacks: put the sink back, or say why not."""
        relay, resp, attempt, front = self.relay, self.resp, self.attempt, self.front
        self.pumping = True
        try:
            while not self.over:
                exc = relay.take_error()
                if isinstance(exc, ClientGone):
                    self._client_gone()
                elif isinstance(exc, BackendFailed):
                    self._failed(exc.kind, exc.detail)
                elif exc is not None:
                    self._error(exc)
                elif relay.done:
                    self._finish()
                elif not attempt.armed and front.paused():  # the client is not reading: wait for it
                    front.on_drain = self._pump
                elif not attempt.armed and not attempt.rearm():
                    self.aborted()
                elif resp.can_sink():
                    resp.sink = relay.on_chunk  # the next reads go straight to the relay
                elif resp.buffered():
                    relay.on_chunk(resp.take())  # what came while the client was paused
                    continue
                elif resp.error is not None:
                    self._error(resp.error)
                else:  # complete, without [DONE]
                    self._failed("reset", "stream ended before [DONE]")
                return
        finally:
            self.pumping = False

    # -- from outside -------------------------------------------------------------------------------
    def aborted(self) -> None:
        """Fenced, or the stall watchdog fired: the attempt failed (as the task path's guard)."""
        if self.over:
            return
        if self.attempt.stalled:
            self._failed("stall", f"no stream chunk within {self.proxy.config.stall_timeout}s")
        else:
            self._failed("fenced", "aborted: the instance was fenced")

    def cancel(self) -> None:
        if not self.over:
            self._client_gone()

    # -- ours ---------------------------------------------------------------------------------------
    def _mark_ok(self, now: float) -> None:
        self.inst.last_ok = now

    def _first_ok(self) -> None:
        self.proxy.promoter.note_ok(self.inst)

    def _error(self, err: BaseException) -> None:
        kind = "garbage" if isinstance(err, ProtocolError) else "reset"
        self._failed(kind, f"{type(err).__name__}: {err}")

    def _release(self) -> None:
        self.resp.sink = None
        self.attempt.unwatch()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.inst.attempts.discard(self.attempt)
        super()._release()

    def _client_gone(self) -> None:
        self.over = True
        self._release()
        log.info("client_gone", service=self.service.name, path=self.req.path)
        self.proxy.metrics.requests.labels(self.service.name, "client_gone").inc()
        self.front.keep_alive = False
        self.front.finished(self.n)

    def _finish(self) -> None:
        """[DONE] is out (with the terminator): the client's request is over; the engine's last
        chunk is awaited for the pool, the slot held till then (as the task path's ``_drain``)."""
        self.over = True
        self.relay.response.end_now()
        self.proxy.count_stream(self.service, self.relay, self.t0)
        resp = self.resp
        if resp.complete or resp.error is not None or self.conn.closed:
            self._release()
        else:  # each of these ends it once: _release clears the other two
            resp.waker = self._tail_failed
            resp.on_done = self._tail_done
            self.timer = asyncio.get_running_loop().call_later(DRAIN_TIMEOUT, self._release)
        self.front.finished(self.n)

    def _tail_failed(self) -> None:
        if self.resp.error is not None:
            self._release()  # the connection is closed, not pooled: nothing lost

    def _tail_done(self, up) -> None:
        self._release()

    def _carried(self) -> tuple:
        return (self.relay,)

