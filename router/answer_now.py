"""Whole answers on router/front.py's listener, written in the upstream connection's callback.

``Direct`` is the common case with nothing in it but callbacks (issue 20): a plain whole-answer
request (not a stream) whose service has a routable primary with a free gate slot and an idle pooled
connection is sent at once from the listener's ``data_received``, and answered from the upstream's
``data_received`` once read and checked: no Task, no future, no coroutine. Anything else goes to
the proxy's task path (router/proxy.py): before sending (no idle connection, no primary, a stream),
and after a failed send (refused, reset, garbage, a retry status, a fence), which then carries on
exactly as after a failed attempt of its own (the failure counted once, a retry).

``AnswerNow`` is the task path's form of the same early write: the answer goes out from the
callback, the task does the bookkeeping after.
"""

from __future__ import annotations

import asyncio
import os
import time

import structlog

from router.backend import Attempt, Instance, Recovery, Service
from router.errors import BackendFailed
from router.forward import MIGRATABLE_PATHS, RETRY_STATUS, is_json_object
from router.upstream import ProtocolError, ResetError, Response

log = structlog.get_logger(__name__)


def hand_over() -> None:
    """Let the client we just answered run before our bookkeeping does (issue 20, router25).

    Where the client shares the router's cores (a bench, a sidecar, the engines' own box), the
    answer's write wakes it, and the router would go on for ~0.1-0.2 ms of cache-cold bookkeeping
    (the pool, the gate, ``note_ok``, the metrics) while the woken client waits for a core:
    ``perf sched`` put the client's wait for a core at 50 us p50 behind the router against 20 us
    behind a bare relay. ``sched_yield`` lets a runnable task on this core go first; with none it
    returns at once (one syscall). Only when nothing else is in flight: under load other requests
    are waiting on the router, and the yield would only add context switches."""
    os.sched_yield()


class AnswerNow:
    """A whole answer on router/front.py's listener, written in the upstream connection's callback
    (``Response.on_done``) once read and past ``_attempt``'s checks (no retry status; a completion's
    200 is a JSON object), before the task wakes. The attempt is then disarmed: a fence can no longer
    make it a retry (a second answer). Anything else, and a fenced attempt, is left to the task."""

    __slots__ = ("answer", "path", "instance", "attempt", "sent")

    def __init__(self, answer, path: str, instance: str, attempt: Attempt) -> None:
        self.answer, self.path, self.instance, self.attempt, self.sent = answer, path, instance, attempt, False

    def __call__(self, up: Response) -> None:
        attempt = self.attempt
        if attempt.aborted or up.status in RETRY_STATUS:
            return
        data = up.body()
        if up.status == 200 and self.path in MIGRATABLE_PATHS and not is_json_object(data):
            return
        attempt.disarm()
        try:
            self.answer(up.status, up.client_lines(), self.instance, data)
        except Exception:  # never into the parser's callback: the task answers instead
            log.exception("answer_failed", instance=self.instance)
            attempt.rearm()
            return
        self.sent = True


def checked(path: str, up: Response) -> tuple[str, str] | None:
    """Why a complete whole answer is a failed attempt (kind, detail), or None: it is the client's."""
    if up.status in RETRY_STATUS:
        return "unavailable", f"answered {up.status}"
    if up.status == 200 and path in MIGRATABLE_PATHS and not is_json_object(up.body()):
        return "garbage", f"200 with a non-JSON body: {up.body()[:80]!r}"
    return None


class Direct:
    """One whole-answer request in flight with no task (module docstring). It stands in the
    instance's ``attempts`` (``abort``: fenced) and in the client connection's ``task`` slot
    (``cancel``: the client went away, or the router's stop ran out of grace).

    Ownership: from ``start`` until it ends, it holds one gate slot and one ``inflight`` of ``inst``,
    and the upstream connection ``conn``; every way out (answered, failed, cancelled, aborted) gives
    all three back exactly once (``_release``)."""

    __slots__ = ("proxy", "req", "front", "service", "inst", "generation", "pool", "conn", "resp",
                 "body", "target", "t0", "n", "over")
    last = 0.0  # as Attempt's, for router/stall.py: not a stream relay
    armed = True

    def __init__(self, proxy, req, service: Service, inst: Instance, body: bytes, target: str,
                 t0: float, n: int) -> None:
        self.proxy, self.req, self.front, self.service, self.inst = proxy, req, req.conn, service, inst
        self.generation = inst.generation
        self.body, self.target, self.t0, self.n = body, target, t0, n
        self.pool = self.conn = self.resp = None
        self.over = False

    @classmethod
    def start(cls, proxy, req, service: Service, body: bytes, target: str, t0: float, n: int) -> "Direct | None":
        """Send the request now and return its ``Direct``, or None (nothing taken: the task path)."""
        inst = service.routable()
        if inst is None or not inst.gate.try_enter():
            return None
        pool = inst.session(proxy.config.connect_timeout)
        sent = pool.send_now(req.method, pool.encode(req.method, target, req.forward, body))
        if sent is None:  # no idle connection: the task path connects
            inst.gate.leave()
            return None
        self = cls(proxy, req, service, inst, body, target, t0, n)
        self.pool, (self.conn, self.resp) = pool, sent
        resp = self.resp
        resp.whole = True
        resp.on_done = self._done
        resp.waker = self._woken
        inst.begin()
        inst.attempts.add(self)
        return self

    # -- the upstream's callbacks ---------------------------------------------------------------
    def _woken(self) -> None:
        resp = self.resp
        if resp.error is not None and not self.over:
            err = resp.error
            if isinstance(err, ProtocolError):
                self._failed("garbage", f"{type(err).__name__}: {err}")
            elif isinstance(err, ResetError) and not resp.headers_done and self.req.method == "GET":
                self._failed(None, "")  # a pooled connection the engine had closed: once more, fresh
            else:
                self._failed("reset", f"{type(err).__name__}: {err}")

    def _done(self, up: Response) -> None:
        if self.over:
            return
        why = checked(self.req.path, up)
        if why is not None:
            self._failed(*why)
            return
        self.over = True
        status, inst = up.status, self.inst
        try:
            self.req.answer(status, up.client_lines(), inst.name, up.body())
        except Exception:  # never into the parser's callback
            log.exception("answer_failed", instance=inst.name)
            self.front.keep_alive = False
        if self.front.site.inflight == 1:  # the only request in flight: see hand_over()
            hand_over()
        self._release()
        if status < 400:
            self.proxy.promoter.note_ok(inst)
        self.proxy.count(self.service, status, time.monotonic(), self.t0)
        self.front.finished(self.n)

    # -- from outside -------------------------------------------------------------------------------
    def abort(self) -> None:
        """The instance was fenced (``Instance.abort_inflight``, which iterates ``attempts``: the
        failure is handled on the next loop step, not inside that loop)."""
        if not self.over:
            self.resp.waker = self.resp.on_done = None
            self.conn.close()
            asyncio.get_running_loop().call_soon(self._failed, "fenced", "aborted: the instance was fenced")

    def cancel(self) -> None:
        """The client is gone (or the router's stop gave up on it): the engine's request is closed."""
        if not self.over:
            self.over = True
            self._release()
            self.proxy.metrics.requests.labels(self.service.name, "client_gone").inc()
            self.front.finished(self.n)

    # -- ours ---------------------------------------------------------------------------------------
    def _release(self) -> None:
        resp, inst = self.resp, self.inst
        resp.waker = resp.on_done = None
        self.pool.finish(self.conn, resp)
        inst.attempts.discard(self)
        inst.end()
        inst.gate.leave()

    def _failed(self, kind: str | None, detail: str) -> None:
        """As the task path after a failed attempt: count it, then its retry loop (in a task) goes
        on from there. ``kind`` None: not a failure (a stale pooled connection), just the task path."""
        if self.over:
            return
        self.over = True
        self._release()
        recovery = Recovery(self.service)
        failure = None
        if kind is not None:
            failure = BackendFailed(self.inst.name, kind, detail)
            recovery.begin()
            self.proxy.promoter.passive_failure(self.inst, self.generation, kind, detail)
        self.front.in_task(self.proxy.carry_on(self.req, self.target, self.service, self.body, self.t0,
                                               recovery, failure, *self._carried()), self.n, self.req.path,
                           lambda: self._dropped(recovery))

    def _carried(self) -> tuple:
        """What the task path takes over besides the request (a stream: its relay as it stands)."""
        return ()

    def _dropped(self, recovery: Recovery) -> None:
        """The client went away before the carry-on's task ran a line: what ``Proxy._run`` ends."""
        recovery.end()
        self.proxy.metrics.requests.labels(self.service.name, "client_gone").inc()
