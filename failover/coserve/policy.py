"""When a batch service must get out of the way, and when it may come back.

Pure decision logic, fed by the supervisor with the online service's load and by operator commands;
it owns no process. Preemption is immediate on any trigger; resumption needs the pressure to stay
below a lower threshold for a hold time (hysteresis), so a load that hovers at the threshold does not
evict and re-fork the batch engine over and over. An operator's preempt holds until an operator's
resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Decision(str, Enum):
    NONE = "none"
    PREEMPT = "preempt"
    RESUME = "resume"


@dataclass(frozen=True, slots=True)
class PressurePolicy:
    """Thresholds on the online service; ``high`` preempts, staying under ``low`` for ``hold_s`` resumes."""

    queue_high: int = 8
    queue_low: int = 2
    ttft_high_s: float = 1.0
    ttft_low_s: float = 0.25
    hold_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.queue_low < self.queue_high:
            raise ValueError("need 0 <= queue_low < queue_high")
        if not 0 <= self.ttft_low_s < self.ttft_high_s:
            raise ValueError("need 0 <= ttft_low_s < ttft_high_s")
        if self.hold_s < 0:
            raise ValueError("hold_s must be >= 0")


class CoservePolicy:
    """Tracks one batch service: running or preempted, and why."""

    def __init__(self, policy: PressurePolicy) -> None:
        self.policy = policy
        self.preempted = False
        self.reason = ""
        self._calm_since: float | None = None

    def operator_preempt(self) -> Decision:
        return self._preempt("operator")

    def operator_resume(self, now: float) -> Decision:
        if not self.preempted:
            return Decision.NONE
        self.preempted, self.reason, self._calm_since = False, "", None
        return Decision.RESUME

    def memory_needed(self) -> Decision:
        """A promotion or a standby relaunch needs the memory the batch engine holds."""
        return self._preempt("memory")

    def observe(self, now: float, *, queue_depth: int, ttft_s: float | None) -> Decision:
        """Feed one sample of the online service's load; returns what to do now."""
        p = self.policy
        ttft = ttft_s or 0.0
        if queue_depth >= p.queue_high or ttft >= p.ttft_high_s:
            self._calm_since = None
            return self._preempt("load")
        if not self.preempted or self.reason == "operator":
            return Decision.NONE
        if queue_depth > p.queue_low or ttft > p.ttft_low_s:
            self._calm_since = None
            return Decision.NONE
        if self._calm_since is None:
            self._calm_since = now
        if now - self._calm_since >= p.hold_s:
            self.preempted, self.reason, self._calm_since = False, "", None
            return Decision.RESUME
        return Decision.NONE

    def _preempt(self, reason: str) -> Decision:
        if self.preempted:
            if reason == "operator":
                self.reason = reason  # an operator's preempt outlives the load that caused the first
            return Decision.NONE
        self.preempted, self.reason, self._calm_since = True, reason, None
        return Decision.PREEMPT
