"""How late the router's own event loop runs: a timer that should fire every ``TICK_S``, and how
much later than that it did.

A probe that times out while the loop was stalled (a large JSON body parsed on the loop, a slow
log handler, a GC pause, the machine's other work) says nothing about the engine: the answer may
have been sitting in the socket. The health monitor asks ``lag_since(t0)`` before it counts a
timed-out probe, and discounts it when our loop, not the engine, was late.
"""

from __future__ import annotations

import asyncio
import collections
import time

TICK_S = 0.02
KEEP_S = 10.0  # history long enough for any probe window


class LoopLag:
    def __init__(self, on_sample=None) -> None:
        self._ticks: collections.deque[tuple[float, float]] = collections.deque(maxlen=int(KEEP_S / TICK_S))
        self._last = time.monotonic()
        self._task: asyncio.Task | None = None
        self._on_sample = on_sample  # called with each lateness (seconds), e.g. a histogram's observe

    def start(self) -> None:
        self._last = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            late = max(0.0, now - self._last - TICK_S)
            self._last = now
            self._ticks.append((now, late))
            if self._on_sample is not None:
                self._on_sample(late)

    def lag_since(self, t0: float) -> float:
        """The longest stall of the loop since ``t0`` (monotonic), seconds. Includes the stall under
        way now: right after a block, the timer may not have run yet, so the time since its last
        tick counts too."""
        worst = max(0.0, time.monotonic() - self._last - TICK_S)
        for at, late in reversed(self._ticks):
            if at < t0:
                break
            worst = max(worst, late)
        return worst
