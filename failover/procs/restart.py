"""Backoff and the restart policy: how soon a process starts again, and when a service is given up.

``Backoff`` is the one backoff of the node: 0 before the first retry, then ``initial * 2**(n-1)``
capped at ``max`` for the n-th, optionally jittered. It serves as tenacity's ``wait`` (it reads the
real ``RetryCallState.attempt_number``), so a retry loop may be a ``tenacity.AsyncRetrying`` (the
cache daemon's restarts).

``RestartPolicy`` is the one restart policy of every engine exit that is a failure: a crash, a hang
the router fenced, and a replacement that failed to start (a launch error, an exit before /ready).
Each is counted per service; the first replacement after a quiet spell starts at once (that is the
point of a hot standby); each further failure within ``crash_loop_window`` waits longer (jittered, so
the services of many nodes that failed together do not retry in step); ``crash_loop_exits`` of them,
or ``restart_attempts`` failed starts of one replacement in a row, mark the service failed until an
operator's resume (:meth:`forget`). A planned recycle (an operator's drain) counts nothing, and
neither does a start that failed while the cache daemon was down, frozen or being replaced: that is
the daemon's failure (the supervisor waits for it and starts again), not the engine's.
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


RESTART_JITTER = 0.2


class RestartPolicy:
    def __init__(self, cfg: SupervisorConfig, *, jitter: float = RESTART_JITTER) -> None:
        self.cfg = cfg
        self.backoff = Backoff(cfg.backoff_initial, cfg.backoff_max, jitter=jitter)
        self._exits: dict[str, deque[float]] = {}

    def next_delay(self, service: str, *, failure: bool, now: float | None = None) -> float:
        """The delay before a slot of ``service`` starts again. A ``failure`` (crash, fenced hang)
        is counted and may raise CrashLoop; a planned restart starts at once and counts nothing."""
        return self.record_exit(service, now) if failure else 0.0

    def record_exit(self, service: str, now: float | None = None, *, why: str = "",
                    failed_starts: int = 0) -> float:
        """Count an unplanned exit (``why``: what it was, for the reason a CrashLoop gives);
        return the delay before its replacement. ``failed_starts``: how many starts of the current
        replacement have failed in a row, this one included. Raises CrashLoop."""
        now = time.monotonic() if now is None else now
        exits = self._exits.setdefault(service, deque())
        exits.append(now)
        while exits and now - exits[0] > self.cfg.crash_loop_window:
            exits.popleft()
        last = f"; the last: {why}" if why else ""
        hint = f"see the engine log above, then `failover resume {service}`"
        if len(exits) >= self.cfg.crash_loop_exits:
            raise CrashLoop(f"service {service!r} exited {len(exits)} times within "
                            f"{self.cfg.crash_loop_window:.0f} s{last}; not restarting it ({hint})")
        if failed_starts >= self.cfg.restart_attempts:
            raise CrashLoop(f"service {service!r}: {failed_starts} replacements in a row failed to start{last}; "
                            f"not restarting it ({hint})")
        return self.backoff.delay(len(exits) - 1)

    def forget(self, service: str) -> None:
        self._exits.pop(service, None)
