"""A batch job: one ``kind = "batch"`` service's record, with its states as an explicit table.

    WAITING   -> RUNNING      its engine serves and is not held back
    WAITING | RUNNING -> PREEMPTED   evicted (operator, load or memory)
    PREEMPTED -> PREEMPTED    evicted again while between processes
    PREEMPTED -> WAITING      resumed: running again once its engine serves
    *         -> DONE         every input line has a result (also found at open)
    *         -> FAILED       its files cannot be used (at open, or a result that cannot be written)
    FAILED    -> WAITING      ``failover resume``: its files are opened again

Every change goes through :meth:`BatchJob.change`, which asserts the table and logs one event.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import structlog

from failover.config.schema import ServiceConfig
from failover.coserve.batch_io import ResultLog
from failover.coserve.policy import CoservePolicy
from failover.coserve.runner import BatchRunner
from failover.procs.slots import Slot

log = structlog.get_logger(__name__)

WAITING, RUNNING, PREEMPTED, DONE, FAILED = "waiting", "running", "preempted", "done", "failed"
ENDED = frozenset({DONE, FAILED})  # nothing to run, nothing to evict

ALLOWED: dict[str, frozenset[str]] = {
    WAITING: frozenset({RUNNING, PREEMPTED, DONE, FAILED}),
    RUNNING: frozenset({PREEMPTED, DONE, FAILED}),
    PREEMPTED: frozenset({PREEMPTED, WAITING, DONE, FAILED}),
    DONE: frozenset(),
    FAILED: frozenset({WAITING}),
}


class ResumeRefused(Exception):
    """``failover resume`` of a failed batch whose files are still unusable; the message says why."""


@dataclass(slots=True)
class BatchJob:
    svc: ServiceConfig
    slot: Slot
    policy: CoservePolicy
    watch: list[str]
    state: str = WAITING
    results: ResultLog | None = None
    runner: BatchRunner | None = None
    why: str = ""
    preemptions: int = 0
    preempted_for: collections.Counter = field(default_factory=collections.Counter)  # reason -> evictions
    resumes: int = 0
    last_preempt: dict = field(default_factory=dict)
    last_resume: dict = field(default_factory=dict)
    resume_at: float | None = None  # monotonic: the resume that has not yet produced a result
    evicting: asyncio.Future | None = None  # set while an eviction runs; memory-triggered callers await it

    @property
    def name(self) -> str:
        return self.svc.name

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def change(self, new: str, reason: str) -> None:
        old = self.state
        assert new in ALLOWED[old], f"batch {self.name}: {old} -> {new} is not allowed"
        self.state = new
        if new != old:
            log.info("batch_state", service=self.name, old=old, new=new, reason=reason)

    def progress(self) -> dict:
        snap = self.runner.progress.snapshot() if self.runner is not None else {}
        return {"state": self.state, "why": self.why or None, "preempted_by": self.policy.reason or None,
                "preemptions": self.preemptions, "resumes": self.resumes,
                "last_preempt": self.last_preempt or None, "last_resume": self.last_resume or None,
                "output": self.svc.batch.output if self.svc.batch else None, **snap}
