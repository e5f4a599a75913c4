"""How late the router's own event loop runs, and the router's one background tick.

A timer that should fire every ``TICK_S`` (``FAST_S`` while its ``on_tick`` asks for it), and how
much later than that it did. A probe that times out while the loop was stalled (a large JSON body
parsed on the loop, a slow log handler, a GC pause, the machine's other work) says nothing about the
engine: the answer may have been sitting in the socket. The health monitor asks ``lag_since(t0)``
before it counts a timed-out probe, and discounts it when our loop, not the engine, was late.

Issue 20: the stall sampler (router/health.py) rides on the same timer (``on_tick``), instead of a
task of its own waking every 10 ms: it asks for the fast tick only while a primary has requests in
flight, so an idle router wakes 10 times a second, not 150. The timer is a ``call_later`` chain, no
task and no coroutine to resume.

Three rhythms: ``FAST_S`` while a primary has requests in flight, ``TICK_S`` for ``LINGER_S`` after
that (the stall sampler learns a stream's rhythm from the reads it sees between ticks: a tick that
found no request in flight, between two requests of a steady load, must not slow it), and ``IDLE_S``
after a second with none. A request that begins while the tick idles calls ``wake``: the next tick
comes at ``FAST_S`` and the linger starts, so the first streams after a quiet spell are sampled as
before (a hang in them is judged by the rhythm the sampler saw). Lateness is measured, not counted
in ticks, so a block of the loop reads the same at any rhythm. Each wake-up of an idle process is
dear on a VM: an idle router in front of one instance took 17.5-18.0 ms of CPU a second at 50 ticks
a second, 5.0-8.0 ms at 10 (bench/router_micro.py --idle 8, 2-core VM).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

TICK_S = 0.02  # within LINGER_S of the last busy tick
IDLE_S = 0.1  # after that
LINGER_S = 1.0
FAST_S = 0.01  # while on_tick returns True (streams open: the stall sampler's rhythm)
KEEP_S = 10.0  # history long enough for any probe window


class LoopLag:
    def __init__(self, on_sample=None) -> None:
        self._ticks: collections.deque[tuple[float, float]] = collections.deque(maxlen=int(KEEP_S / FAST_S))
        self._last = time.monotonic()
        self._interval = TICK_S  # the one the pending timer was set for
        self._busy_at = 0.0  # the last tick whose on_tick asked for the fast rhythm
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_sample = on_sample  # called with each lateness (seconds), e.g. a histogram's observe
        # called with the tick's time (monotonic) after each sample; True: the next tick at FAST_S
        self.on_tick: Callable[[float], bool] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._last = time.monotonic()
        self._interval = TICK_S
        self._handle = self._loop.call_later(TICK_S, self._tick)

    async def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = time.monotonic()
        late = max(0.0, now - self._last - self._interval)
        self._last = now
        self._ticks.append((now, late))
        interval = TICK_S if now - self._busy_at < LINGER_S else IDLE_S
        try:
            if self._on_sample is not None:
                self._on_sample(late)
            if self.on_tick is not None and self.on_tick(now):
                interval, self._busy_at = FAST_S, now
        except Exception:  # the timer must go on: a verdict missed is better than none ever again
            log.exception("tick_failed")
        self._interval = interval
        self._handle = self._loop.call_later(interval, self._tick)

    def wake(self) -> None:
        """A request begins (router/proxy.py, router/stream_now.py): if the tick idles, bring it to
        ``FAST_S`` from now and linger from here. Nothing when it does not: one compare per request."""
        if self._interval != IDLE_S or self._handle is None:
            return
        now = time.monotonic()
        self._handle.cancel()
        self._busy_at = now
        self._interval = now - self._last + FAST_S  # the tick's lateness stays measured against this
        self._handle = self._loop.call_later(FAST_S, self._tick)

    def lag_since(self, t0: float) -> float:
        """The longest stall of the loop since ``t0`` (monotonic), seconds. Includes the stall under
        way now: right after a block, the timer may not have run yet, so the time since its last
        tick counts too."""
        worst = max(0.0, time.monotonic() - self._last - self._interval)
        for at, late in reversed(self._ticks):
            if at < t0:
                break
            worst = max(worst, late)
        return worst
