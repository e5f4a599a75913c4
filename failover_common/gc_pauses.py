"""The garbage collector's pauses: the heap a process built at start frozen out of its reach, and
every collection timed.

A full (generation 2) collection walks every object the collector tracks, holding the GIL
throughout: every thread of the process stops. An engine process tracks about 200,000 objects
once torch and the tokenizer are imported, and one full collection of them took 83 ms on the 2-core
VM (the router's process: about 45,000 objects, 12 ms). Under load, with requests allocating,
such collections come every few seconds, and for that long an engine answers no probe and sends
no token: from outside, every stream silent and a probe unanswered, which is what the router's hang
verdict looks for (router/health.py).

``freeze()`` (``gc.freeze``, after one last collection) moves what exists into the permanent
generation once the process has started: later collections walk only what was made since (the
requests, their sequences and buffers), and a frozen object is never collected, which is right for
modules, the model and the tokenizer that live as long as the process.

``GcPauses`` times every collection through ``gc.callbacks``. The callback only adds to plain
numbers (a lock there could deadlock: a collection may start inside any allocation, a metrics
render's included); the metrics are read from them at scrape time (``collect``), and a pause past
``slow_s`` is kept for the owner and ``notify`` is called, which logs it outside the callback (``watch``).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

SLOW_S = 0.02  # a collection longer than this is reported one by one


def freeze() -> int:
    """Collect once, then freeze every object left; returns how many are frozen now. The
    environment's ``FAILOVER_GC_FREEZE=0`` turns it off (nothing frozen, 0), in every process of a
    node: an operator's way back, and an A/B's."""
    if os.environ.get("FAILOVER_GC_FREEZE", "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Times this process's collections (one per process: ``install`` once, ``remove`` at the end).

    ``notify()``, if given, is called from the callback after a slow pause, and must be safe there
    (``loop.call_soon_threadsafe`` of something that calls ``take_slow``): it may run on any thread,
    inside any allocation."""

    def __init__(self, prefix: str, slow_s: float = SLOW_S, notify: Callable[[], None] | None = None) -> None:
        self.prefix, self.slow_s, self.notify = prefix, slow_s, notify
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self.slow: deque[dict] = deque(maxlen=64)  # (generation, ms, collected) of slow pauses not yet taken
        self._t0 = 0.0

    def install(self) -> "GcPauses":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        g = info["generation"]
        self.count[g] += 1
        self.seconds[g] += took
        if took > self.longest[g]:
            self.longest[g] = took
        if took > self.slow_s:
            self.slow.append({"generation": g, "ms": round(took * 1e3, 1), "collected": info["collected"]})
            if self.notify is not None:
                try:
                    self.notify()
                except Exception:  # noqa: BLE001 - never out of a gc callback (the loop may be closed)
                    pass

    def take_slow(self) -> list[dict]:
        """The slow pauses since the last call, oldest first (for the owner's log)."""
        out = []
        while self.slow:
            out.append(self.slow.popleft())
        return out

    # prometheus_client's custom collector protocol: read at scrape time, no lock in the callback
    def describe(self) -> Iterator:
        return iter(())

    def collect(self) -> Iterator:
        p = self.prefix
        n = CounterMetricFamily(p + "gc_collections", "Garbage collections, by generation", labels=["generation"])
        s = CounterMetricFamily(p + "gc_pause_seconds", "Time spent in garbage collections (the GIL held: "
                                "every thread stopped), by generation", labels=["generation"])
        m = GaugeMetricFamily(p + "gc_pause_max_seconds", "The longest garbage collection so far, by generation",
                              labels=["generation"])
        for g in range(3):
            n.add_metric([str(g)], self.count[g])
            s.add_metric([str(g)], self.seconds[g])
            m.add_metric([str(g)], self.longest[g])
        frozen = GaugeMetricFamily(p + "gc_frozen_objects", "Objects frozen out of the collector's reach "
                                   "after start (gc.freeze)", value=gc.get_freeze_count())
        return iter((n, s, m, frozen))


def watch(registry, prefix: str, loop: asyncio.AbstractEventLoop, log, slow_s: float = SLOW_S,
          install: bool = True) -> GcPauses:
    """A process's entry point: time every collection from now on (``install`` False: from its
    ``install()``, after ``freeze`` say, whose own collection is a start's, not a pause of serving),
    export the figures in ``registry`` (names from ``prefix``), and log each slow pause as
    ``gc_pause`` on ``loop``."""
    def log_slow() -> None:
        for pause in pauses.take_slow():
            log.warning("gc_pause", **pause)

    pauses = GcPauses(prefix, slow_s, notify=lambda: loop.call_soon_threadsafe(log_slow))
    registry.register(pauses)
    if install:
        pauses.install()
    return pauses


def started(registry, prefix: str, loop: asyncio.AbstractEventLoop, log) -> GcPauses:
    """A server that has just started (``failover router``, ``failover up``): freeze what its start
    built, then ``watch`` every collection from now on (the freeze's own is a start's, not a pause)."""
    freeze()
    return watch(registry, prefix, loop, log)
