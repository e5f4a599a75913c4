"""Backoff and the restart policy: how soon a process starts again, and when a service is given up.

``Backoff`` is the one backoff of the node: 0 before the first retry, then ``initial * 2**(n-1)``
capped at ``max`` for the n-th, optionally jittered. It serves as tenacity's ``wait`` (it reads the
real ``RetryCallState.attempt_number``), so every retry loop is a ``tenacity.AsyncRetrying``: the
retries of one replacement that fails to start, and the cache daemon's restarts.

``RestartPolicy`` counts unplanned exits per service: the first replacement after a quiet spell starts
at once (that is the point of a hot standby); each further exit within ``crash_loop_window`` waits
longer; ``crash_loop_exits`` of them mark the service failed. A crash and a hang the router fenced
both count; a planned recycle (an operator's drain) does not.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

import tenacity

from failover.config.schema import SupervisorConfig


class CrashLoop(Exception):
    """A service exited too often too fast; it is marked failed and not restarted."""


@dataclass(frozen=True, slots=True)
class Backoff:
    initial: float
    max: float
    jitter: float = 0.0  # each delay is scaled by a random factor in [1 - jitter, 1 + jitter]

    def delay(self, n: int) -> float:
        """Seconds to wait before the n-th retry (0 for n <= 0)."""
        if n <= 0:
            return 0.0
        base = min(self.initial * 2 ** min(n - 1, 62), self.max)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else base

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        """tenacity's ``wait``: the delay after attempt ``attempt_number`` failed."""
        return self.delay(retry_state.attempt_number)


class RestartPolicy:
    def __init__(self, cfg: SupervisorConfig) -> None:
        self.cfg = cfg
        self.backoff = Backoff(cfg.backoff_initial, cfg.backoff_max)
        self._exits: dict[str, deque[float]] = {}

    def next_delay(self, service: str, *, failure: bool, now: float | None = None) -> float:
        """The delay before a slot of ``service`` starts again. A ``failure`` (crash, fenced hang)
        is counted and may raise CrashLoop; a planned restart starts at once and counts nothing."""
        return self.record_exit(service, now) if failure else 0.0

    def record_exit(self, service: str, now: float | None = None) -> float:
        """Count an unplanned exit; return the delay before its replacement. Raises CrashLoop."""
        now = time.monotonic() if now is None else now
        exits = self._exits.setdefault(service, deque())
        exits.append(now)
        while exits and now - exits[0] > self.cfg.crash_loop_window:
            exits.popleft()
        if len(exits) >= self.cfg.crash_loop_exits:
            raise CrashLoop(f"service {service!r} exited {len(exits)} times within "
                            f"{self.cfg.crash_loop_window:.0f} s; not restarting it (see the engine log above, "
                            f"then `failover resume {service}`)")
        return self.backoff.delay(len(exits) - 1)

    def retrying(self) -> tenacity.AsyncRetrying:
        """Retries of one replacement that fails to start (launch error, exit before ready)."""
        return tenacity.AsyncRetrying(stop=tenacity.stop_after_attempt(self.cfg.restart_attempts),
                                      wait=self.backoff, reraise=True)

    def forget(self, service: str) -> None:
        self._exits.pop(service, None)
