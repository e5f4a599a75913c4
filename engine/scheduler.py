"""Continuous batching over paged KV: sequences wait, are admitted when the pool has blocks for
their tokens, prefilled, then decoded together, each growing block by block; they join and leave the
running batch between decode steps.

When a running sequence needs a block and none is free, the youngest running sequence is preempted:
its blocks are freed and it goes back to the head of the queue, to be prefilled again later with its
prompt and every token generated so far (recompute). Nothing is re-sent to its client: its text and
sampling state live on, keyed by its position (``engine.sampling``), so it continues where it was.

A pool normally holds at least one sequence of the longest context, so the oldest sequence can always
finish. A standby's pool may be smaller (``--kv-min-memory``): a sequence that outgrows it is then
preempted like any other, and waits at the head of the queue (the ones behind it too: first come,
first served) until the pool is grown; the engine idles meanwhile (``LLMEngine.blocked``).

The scheduler is owned by the engine thread; nothing here is thread-safe by itself.
"""

from __future__ import annotations

import bisect
from collections import deque
from itertools import count

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status

__all__ = ["Scheduler", "Sequence", "Status"]  # Sequence and Status live in engine.sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_len: int, eos_ids: tuple[int, ...]) -> None:
        self.blocks = blocks
        self.max_batch, self.max_len = max_batch, max_len
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # ascending order (oldest first)
        self.preemptions = 0
        self._order = count()

    def add(self, seq: Sequence) -> None:
        assert seq.length < self.max_len, "the server checks prompt length before admitting"
        seq.order = next(self._order)
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

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """This step's (prefill, decode) sequences: prefill = every running sequence with tokens
        still to prefill (admitted now or earlier, oldest first; the engine may take a chunk of each). Decode goes first: every running sequence gets
        the block its next token needs, preempting the youngest when the pool is out of blocks;
        only a step that preempted nothing admits waiting sequences (else they would be preempted
        again at once)."""
        decode, preempted = self._reserve_decode()
        if not preempted:
            self._admit()
        return [s for s in self.running if s.pending], decode

    def _reserve_decode(self) -> tuple[list[Sequence], bool]:
        batch, queue, preempted = [], list(self.running), False
        while queue:
            seq = queue.pop(0)
            if seq.pending:  # still prefilling: its blocks were all taken at admission
                continue
            while not self.blocks.can_append(seq):
                preempted = True
                if not queue:  # seq is the youngest left: it waits, the older ones go on
                    self._preempt(seq)
                    break
                self._preempt(queue.pop())
            else:
                self.blocks.may_append(seq)
                batch.append(seq)
        return batch, preempted

    def _admit(self) -> list[Sequence]:
        """Move waiting sequences, first come first served, into the running batch while the pool
        has blocks for all their tokens; they are prefilled this step."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch and self.blocks.can_allocate(self.waiting[0]):
            seq = self.waiting.popleft()
            # room to grow into consecutive ids: the blocks of its prompt and every token it may draw
            self.blocks.allocate(seq, upto=min(self.max_len, len(seq.prompt_ids) + seq.params.max_tokens))
            seq.status, seq.pending = Status.RUNNING, seq.length
            bisect.insort(self.running, seq, key=lambda s: s.order)
            admitted.append(seq)
        return admitted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        # waiting sequences all arrived after running ones, and victims go youngest first: the
        # queue stays in arrival order
        self.waiting.appendleft(seq)

    def append(self, seq: Sequence, token: int) -> None:
        """Record a generated token and finish the sequence on a stop id, max_tokens or full context.
        A token is drawn only once a sequence's prefill is done: nothing of it is pending any more."""
        seq.output_ids.append(token)
        seq.pending = 0
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
            self.blocks.free(seq)
