"""Liveness: a long-lived helper (the cache daemon, the zygote) is pinged, not only watched for exit.

A pidfd only tells that a process ended; a SIGSTOPped or wedged one stays "alive" forever and the next
relaunch hangs on it. ``Watchdog`` pings one process every ``interval`` s, each ping with what is left
of ``timeout`` since its last answer as its deadline; one that has not answered for ``timeout`` s is
hung: it is logged (``EVENT`` with ``silent_s``) and its whole process group is
SIGKILLed. Its pidfd then fires, so the owner's usual exit path restarts it: one restart path for
crashes and hangs.

Ownership: the watchdog owns no process; ``target()`` names the current generation (None while there
is none worth pinging: not started, loading, restarting), and its owner reaps and restarts it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Awaitable, Callable

import structlog

from failover.procs.child import Child

log = structlog.get_logger(__name__)
MIN_PING_S = 0.05  # the shortest ping deadline (a last try when the silence is nearly timeout)


def kill_tree(child: Child) -> None:
    """SIGKILL ``child``'s process group (each helper leads its own session), then ``child`` itself.
    A stopped process takes SIGKILL too; no SIGCONT is needed."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.send(signal.SIGKILL)


class Watchdog:
    def __init__(self, event: str, target: Callable[[], Child | None],
                 ping: Callable[[float], Awaitable[bool]], *, interval: float, timeout: float) -> None:
        self.event, self.target, self.ping = event, target, ping
        self.interval, self.timeout = interval, timeout
        self.hangs = 0

    async def run(self) -> None:
        """Until cancelled. A new generation gets ``timeout`` s of grace from the moment it is seen."""
        watched: Child | None = None
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            child = self.target()
            if child is None or not child.alive:
                watched = None
                continue
            if child is not watched:
                watched, last_ok = child, time.monotonic()
            # the ping may take what is left of ``timeout`` since the last answer: a process silent
            # that long is hung, whatever the ping's cadence (a frozen one is noticed <= timeout
            # after its last answer, not timeout + interval); a healthy one, answering every
            # interval, always has >= timeout - interval for it
            budget = max(self.timeout - (time.monotonic() - last_ok), MIN_PING_S)
            try:
                ok = await asyncio.wait_for(self.ping(budget), budget + 1.0)
            except asyncio.TimeoutError:
                ok = False
            now = time.monotonic()
            if ok:
                last_ok = now
            elif now - last_ok >= self.timeout and child.alive and child is self.target():
                self.hangs += 1
                log.error(self.event, pid=child.pid, silent_s=round(now - last_ok, 3),
                          consequence="SIGKILL of its process group; it is restarted like one that exited")
                kill_tree(child)
                watched = None
