"""One request as the engine runs it: its tokens, its sampling, its place in the KV pool.

The engine builds it from a parsed request (:meth:`Sequence.from_request`); the HTTP handler never
does. The engine thread owns it from then on (the scheduler moves it between waiting, running and
finished; the block manager fills its block table).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from engine.sampling import SamplingParams, request_seed


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. ``resume_ids`` were generated for it elsewhere and count as completion tokens;
    ``output_ids`` are the tokens this engine generated."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    resume_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    block_table: list[int] = field(default_factory=list)  # owned by the block manager
    order: int = -1  # arrival order in the scheduler: the highest running one is preempted first
    preemptions: int = 0
    pending: int = 0  # tokens still to prefill in this admission (a chunked prefill spans steps)
    arrival: float = field(default_factory=time.monotonic)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.resume_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.resume_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return (self.output_ids or self.resume_ids or self.prompt_ids)[-1]

    @property
    def num_completion(self) -> int:
        return len(self.resume_ids) + len(self.output_ids)

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason

    @classmethod
    def from_request(cls, req) -> Sequence:
        """From a parsed request (``engine.protocol.GenerateRequest``): its id, prompt, sampling,
        and the tokens another instance already generated for it (a migrated stream)."""
        return cls(req.id, list(req.prompt_ids), req.params, request_seed(req.params), list(req.resume_ids))
