"""Continuous batching: sequences wait, are admitted into a free KV slot, prefilled, then decoded
together; they join and leave the running batch between decode steps.

The scheduler is owned by the engine thread; nothing here is thread-safe by itself.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from engine.sampling import SamplingParams


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
    slot: int = -1
    arrival: float = field(default_factory=time.monotonic)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.resume_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.resume_ids) + len(self.output_ids)

    @property
    def num_completion(self) -> int:
        return len(self.resume_ids) + len(self.output_ids)

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason


class Scheduler:
    def __init__(self, num_slots: int, max_len: int, eos_ids: tuple[int, ...]) -> None:
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot
        self.max_len = max_len
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        assert seq.length < self.max_len, "the server checks prompt length before admitting"
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> Sequence | None:
        for seq in self.waiting:
            if seq.id == seq_id:
                self.waiting.remove(seq)
                seq.finish("abort")
                return seq
        for seq in self.running:
            if seq.id == seq_id:
                seq.finish("abort")
                self._release(seq)
                return seq
        return None

    def add_slots(self, slots: range) -> None:
        self.free_slots = sorted([*self.free_slots, *slots], reverse=True)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots; they are prefilled this step."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot, seq.status = self.free_slots.pop(), Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def decode_batch(self, exclude: list[Sequence]) -> list[Sequence]:
        skip = set(map(id, exclude))
        return sorted((s for s in self.running if id(s) not in skip), key=lambda s: s.slot)

    def append(self, seq: Sequence, token: int) -> None:
        """Record a generated token and finish the sequence on a stop id, max_tokens or full context."""
        seq.output_ids.append(token)
        p = seq.params
        if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            seq.finish("stop")
        elif seq.num_completion >= p.max_tokens or seq.length >= self.max_len:
            seq.finish("length")
        if seq.status is Status.FINISHED:
            self._release(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a running sequence for a reason found outside (a stop string)."""
        if seq.status is not Status.FINISHED:
            seq.finish(reason)
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            self.free_slots.sort(reverse=True)
