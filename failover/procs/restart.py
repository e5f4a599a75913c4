"""Restart policy: how soon a replacement starts, and when a service that keeps dying is given up.

The first replacement after a quiet spell starts at once (that is the point of a hot standby). Each
further exit within the crash-loop window waits longer (exponential, via tenacity's wait strategy);
``crash_loop_exits`` exits within ``crash_loop_window`` seconds mark the service failed.
"""

from __future__ import annotations

import time
from collections import deque

import tenacity

from failover.config.schema import SupervisorConfig


class CrashLoop(Exception):
    """A service exited too often too fast; it is marked failed and not restarted."""


class RestartPolicy:
    def __init__(self, cfg: SupervisorConfig) -> None:
        self.cfg = cfg
        self._exits: dict[str, deque[float]] = {}
        self._wait = tenacity.wait_exponential(multiplier=cfg.backoff_initial, max=cfg.backoff_max)

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
        return self.delay(len(exits) - 1)

    def delay(self, recent: int) -> float:
        """0 for the first exit; backoff_initial * 2**(n-1), capped, for the n-th one after it."""
        if recent <= 0:
            return 0.0
        return float(self._wait(_State(recent)))

    def retrying(self) -> tenacity.AsyncRetrying:
        """Retries of one replacement that fails to start (launch error, exit before ready)."""
        return tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.cfg.restart_attempts),
            wait=self._wait, reraise=True)

    def forget(self, service: str) -> None:
        self._exits.pop(service, None)


class _State:
    """The one field of tenacity's RetryCallState that its wait strategies read."""

    def __init__(self, attempt: int) -> None:
        self.attempt_number = attempt
