"""Backends: one engine instance, and the service (one primary, its standbys, its wait queue).

Ownership: an Instance owns its upstream pool (router/upstream.py) and knows the attempts in
flight to it. Fencing aborts them: each attempt runs under a ``Guard`` (asyncio.timeout's
cancel-then-TimeoutError, by hand), and firing it raises TimeoutError inside exactly that request,
even one blocked on a hung engine (closing the pool alone does not wake a reader whose peer went
silent).
"""

from __future__ import annotations

import asyncio
import collections
import time

from router import states
from router.errors import NoPrimary, Saturated
from router.upstream import Pool


class Guard:
    """``asyncio.timeout(None)`` fired by hand, entered and left without a coroutine (issue 20: the
    two per attempt were a visible part of a request's cost). ``fire()`` cancels the task inside it;
    leaving, that cancellation becomes TimeoutError (as asyncio.timeout's expiry), unless the task
    was also cancelled from elsewhere (the client gone), which stays a CancelledError."""

    __slots__ = ("task", "cancelling", "fired", "entered")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.cancelling = 0
        self.fired = self.entered = False

    def __enter__(self) -> "Guard":
        # the task may be given (router/front.py knows its request's; current_task is Python in 3.11)
        self.task = task = self.task if self.task is not None else asyncio.current_task()
        self.cancelling = task.cancelling()
        self.entered = True
        return self

    def __exit__(self, et, exc, tb) -> None:
        self.entered = False
        if self.fired and self.task.uncancel() <= self.cancelling and et is asyncio.CancelledError:
            raise TimeoutError() from exc

    async def __aenter__(self) -> "Guard":  # as asyncio.timeout is used; the proxy uses ``with``
        return self.__enter__()

    async def __aexit__(self, et, exc, tb) -> None:
        self.__exit__(et, exc, tb)

    def fire(self) -> None:
        """Abort the task inside the guard (no-op before it is entered or after it is left)."""
        if self.entered and not self.fired:
            self.fired = True
            self.task.cancel()

    def expired(self) -> bool:
        return self.fired


class Attempt:
    """One upstream request in flight. Its guard fires only while armed: around a write to the
    client it is not, so an abort never lands between "bytes handed to the client" and "those
    tokens recorded as sent"; it is then noticed when the attempt re-arms."""

    __slots__ = ("guard", "armed", "aborted", "stalled", "last", "_watch")

    def __init__(self) -> None:
        self.guard = Guard()
        self.armed = True
        self.aborted = False
        self.stalled = False  # the stall watchdog fired (the abort is a stall, not a fence)
        self.last = 0.0  # monotonic time of the last upstream read (the relay writes it per read)
        self._watch: asyncio.TimerHandle | None = None

    def watch(self, stall_timeout: float) -> None:
        """Abort (as ``stalled``) once no read came for ``stall_timeout``: one timer per attempt,
        re-armed only when it fires, so the relay pays a float write per read, not a timer."""
        self.last = time.monotonic()
        self._watch = asyncio.get_running_loop().call_later(stall_timeout, self._check, stall_timeout)

    def unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _check(self, stall_timeout: float) -> None:
        idle = time.monotonic() - self.last
        if idle < stall_timeout:
            self._watch = asyncio.get_running_loop().call_later(stall_timeout - idle, self._check, stall_timeout)
            return
        self._watch = None
        self.stalled = True
        self.abort()

    def abort(self) -> None:
        self.aborted = True
        if self.armed:
            self.guard.fire()

    def disarm(self) -> None:
        self.armed = False

    def rearm(self) -> bool:
        """Arm again; False when an abort came in meanwhile (the caller stops this attempt)."""
        self.armed = True
        return not self.aborted


class Gate:
    """At most ``limit`` requests in flight to one instance; up to ``queue_size`` more wait here, first
    come first served, instead of piling connections onto the engine's listen backlog (where a full
    backlog turns into connect timeouts that look like a dead engine)."""

    def __init__(self, limit: int, queue_size: int) -> None:
        self.limit = limit
        self.queue_size = queue_size
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_enter(self) -> bool:
        """Take a slot if one is free and nobody waits (no await: the common case)."""
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        return False

    async def enter(self, name: str, deadline: float) -> None:
        """Take a slot, waiting until ``deadline`` (monotonic); Saturated when the queue is full or
        the deadline passes. The caller must ``leave()`` once its request is over."""
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.queue_size:
            raise Saturated(name, f"{self.active} requests in flight (the cap) and {len(self._waiters)} "
                            "waiting for one (the queue is full)")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await fut  # leave() hands its slot over directly: ``active`` already counts us
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self.leave()  # handed a slot just as we gave up (timeout, client gone): pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            if isinstance(exc, TimeoutError):
                raise Saturated(name, f"no upstream slot free within the queue deadline "
                                f"({self.active} in flight)") from None
            raise

    def leave(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():  # skip waiters that gave up
                fut.set_result(None)
                return
        self.active -= 1
        assert self.active >= 0, "upstream gate: more leaves than enters"

    def release_all(self) -> None:
        """Fenced: let every waiter through now; each finds the instance fenced and goes elsewhere."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self.active += 1
                fut.set_result(None)


class Instance:
    def __init__(self, service: str, name: str, url: str, role: str, pid: int | None,
                 max_upstream: int = 128, upstream_queue_size: int = 1024) -> None:
        self.service = service
        self.name = name
        self.url = url.rstrip("/")
        self.role = role
        self.pid = pid
        self.last_transition = states.initial(role)
        self.ready = False  # verdict of the last probe (or passive observation)
        self.ever_ready = False  # until then failed probes mean "starting", not "failed"
        self.suspect = False  # a proxied request failed; a confirm probe is on its way
        self.failures = 0  # consecutive failures, probes and passive observations together
        self.fenced = False  # never serves again under this registration
        self.generation = 0  # bumped on re-registration: late results of the old one are dropped
        self.probe_latency: float | None = None
        self.cut_leak: bool | None = None  # vLLM: leaks a prompt cut inside a character (adapters/vllm_check.py)
        self.probe_path = "/ready"  # its engine kind's liveness path (set by Router.add_instance)
        self.last_ok: float | None = None  # monotonic time of the last good response or chunk
        self.inflight = 0
        self.attempts: set[Attempt] = set()  # upstream requests in flight
        self.idle = asyncio.Event()
        self.idle.set()
        self.gate = Gate(max_upstream, upstream_queue_size)
        self.slow_kept = False  # failing slow with no standby to take over: kept serving (logged once)
        self._session: Pool | None = None

    def session(self, connect_timeout: float) -> Pool:
        """The pool for this instance (created on first use); the gate keeps its connections at
        ``gate.limit``, the pool's limit is only a second fence."""
        if self._session is None or self._session.closed:
            self._session = Pool(self.url, self.gate.limit, connect_timeout)
        return self._session

    async def close_session(self) -> None:
        """Close the pool: in-flight requests to this instance fail at once (fencing, shutdown)."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def abort_inflight(self) -> int:
        """Make every request in flight to this instance fail now (they retry or migrate)."""
        for attempt in self.attempts:
            attempt.abort()
        return len(self.attempts)

    def begin(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def end(self) -> None:
        self.inflight -= 1
        assert self.inflight >= 0, f"{self.name}: in-flight count went negative"
        if self.inflight == 0:
            self.idle.set()

    def mark_ok(self) -> None:
        self.last_ok = time.monotonic()

    @property
    def serving_ready(self) -> bool:
        """Ready as an operator means it: its last probe passed *and* its role is one that serves.

        ``ready`` alone is the last probe's verdict, which a stopped or preempted instance keeps.
        """
        return self.ready and self.role in states.WATCHED and not self.fenced

    def as_json(self) -> dict:
        return {"name": self.name, "service": self.service, "role": self.role, "url": self.url,
                "pid": self.pid, "ready": self.serving_ready, "suspect": self.suspect,
                "inflight": self.inflight, "fenced": self.fenced,
                "probe_latency_ms": None if self.probe_latency is None else round(self.probe_latency * 1e3, 2),
                "cut_leak": self.cut_leak,
                "last_transition": self.last_transition.as_json()}


class Recovery:
    """One request between a failed attempt and its next good byte (a retry's answer, a migrated
    stream's next event). The service counts them: a failover has settled when none is left."""

    __slots__ = ("service", "active")

    def __init__(self, service: "Service") -> None:
        self.service = service
        self.active = False

    def begin(self) -> None:
        if not self.active:
            self.active = True
            self.service.recovering += 1
            self.service.settled.clear()

    def end(self) -> None:
        if self.active:
            self.active = False
            self.service.recovering -= 1
            if not self.service.recovering:
                self.service.settled.set()


class Service:
    """One served model: a primary, standbys, and the requests waiting while there is no primary."""

    def __init__(self, name: str, queue_size: int) -> None:
        self.name = name
        self.recovering = 0  # requests that lost an attempt and have not had a good byte since
        self.settled = asyncio.Event()  # set while recovering == 0
        self.settled.set()
        self.instances: dict[str, Instance] = {}
        self.primary: Instance | None = None
        self.queue_size = queue_size
        self.waiting = 0
        self.closing = False
        self.held: str | None = None  # why routing is held (a cluster router that lost etcd)
        self.lock = asyncio.Lock()  # serialises planned switchovers and drains
        self._available = asyncio.Event()
        self.adapter = None  # its engine kind's migration (router/adapters); None: our engine's

    @property
    def engine(self) -> str:
        return "failover" if self.adapter is None else self.adapter.name

    def routable(self) -> Instance | None:
        p = self.primary
        if p is not None and self.held is None and p.role in states.ROUTABLE and p.ready and not p.suspect and not p.fenced:
            return p
        return None

    def refresh(self) -> None:
        """Re-derive the 'a primary is ready' event after any change of role, readiness, suspicion."""
        if self.routable() is not None or self.closing:
            self._available.set()
        else:
            self._available.clear()

    def standbys(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == states.STANDBY]

    async def acquire(self, deadline: float) -> Instance:
        """The ready primary, waiting (bounded queue, until ``deadline``, monotonic) while none is."""
        inst = self.routable()
        if inst is not None:
            return inst
        if self.waiting >= self.queue_size:
            raise NoPrimary(self.name, "queue full")
        self.waiting += 1
        try:
            while True:
                if self.closing:
                    raise NoPrimary(self.name, "router shutting down")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NoPrimary(self.name, "no primary became ready before the queue deadline")
                try:
                    async with asyncio.timeout(remaining):
                        await self._available.wait()
                except TimeoutError:
                    continue
                inst = self.routable()
                if inst is not None:
                    return inst
                # Woken by a change that did not yield a primary (e.g. shutdown): loop to re-check
                # without spinning on a set event.
                if not self.closing:
                    self._available.clear()
        finally:
            self.waiting -= 1

    def as_json(self) -> dict:
        return {"name": self.name, "primary": self.primary.name if self.primary else None,
                "ready": self.routable() is not None, "queued": self.waiting, "held": self.held,
                "instances": [i.as_json() for i in self.instances.values()]}
