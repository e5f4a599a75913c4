"""Which KV blocks are free and which sequence holds which: the bookkeeping side of the paged pool.

A sequence's ``block_table`` lists the ids of the blocks that hold its positions, in order: position
``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``. Block ids are
global across the pool's chunks (``engine.kv_cache.KVPool``); this module never touches a tensor.

Free blocks are handed out lowest id first, so the used blocks crowd the head of the pool and its
tail chunks stay free for as long as possible: that is what lets ``/admin/kv`` shrink a pool while
sequences run.

With ``runways`` (the CPU gather path: ``engine.kv_cache`` attends on a view of rows whose blocks are
consecutive, copying nothing), a sequence is placed at the lowest run of free ids that holds every
block it may come to need (``upto`` tokens: its prompt plus ``max_tokens``), or failing that the
lowest that holds what it needs now, and the rest of that run up to ``upto`` is its *runway*: held
back from other sequences so that it grows into the next id. A runway's blocks still count as free:
when no other block is left, a sequence takes the last block of the longest runway, so runways never
cause a preemption or hold back an admission, and a shrink may release them (they are not used).

Owned by the engine thread (through the scheduler); nothing here is thread-safe by itself.
"""

from __future__ import annotations

import heapq
from typing import Protocol


class HoldsBlocks(Protocol):
    length: int  # tokens in the sequence; all but the last have KV once it is running
    block_table: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, runways: bool = False) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.runways = runways
        self._free = list(range(num_blocks))  # a heap of the free ids outside runways: pop gives the lowest
        self._used: set[int] = set()
        self._runway: dict[int, int] = {}  # the id after a sequence's last block -> its runway's end

    @property
    def num_free(self) -> int:
        return len(self._free) + sum(end - first for first, end in self._runway.items())

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, seq: HoldsBlocks) -> bool:
        """Room for the KV of every token of ``seq`` (its prefill, a fresh or a recomputed one)."""
        return self.blocks_for(seq.length) <= self.num_free

    def allocate(self, seq: HoldsBlocks, upto: int = 0) -> None:
        """Blocks for every token of ``seq``; with runways consecutive ones, and a runway up to
        ``upto`` tokens, where the free ids allow (see the module doc)."""
        assert not seq.block_table, "a sequence is allocated once per admission"
        assert self.can_allocate(seq)
        n = self.blocks_for(seq.length)
        run = self._free_run(n, max(n, self.blocks_for(upto))) if self.runways else None
        if run is None:
            seq.block_table = [self._take() for _ in range(n)]
            return
        start, end = run
        self._free = [b for b in self._free if not start <= b < end]
        heapq.heapify(self._free)
        self._used.update(range(start, start + n))
        seq.block_table = list(range(start, start + n))
        if end > start + n:
            self._runway[start + n] = end

    def free(self, seq: HoldsBlocks) -> None:
        """Give back every block of ``seq`` (finished, aborted or preempted), and its runway."""
        if seq.block_table:
            first = seq.block_table[-1] + 1
            for block in range(first, self._runway.pop(first, first)):
                heapq.heappush(self._free, block)
        for block in seq.block_table:
            self._used.remove(block)
            heapq.heappush(self._free, block)
        seq.block_table = []

    def can_append(self, seq: HoldsBlocks) -> bool:
        """Room for the next decode step of ``seq``: it writes the KV of position ``length - 1``."""
        return not self._needs_block(seq) or self.num_free > 0

    def may_append(self, seq: HoldsBlocks) -> None:
        """Give ``seq`` the block its next decode step writes into, if its last block is full: the
        next block of its runway when it has one."""
        if not self._needs_block(seq):
            return
        first = seq.block_table[-1] + 1 if seq.block_table else -1
        end = self._runway.pop(first, None)
        if end is None:
            assert self.num_free, "call can_append first"
            seq.block_table.append(self._take())
            return
        self._used.add(first)
        seq.block_table.append(first)
        if first + 1 < end:
            self._runway[first + 1] = end

    def free_tail(self) -> int:
        """How many blocks at the top of the id space are free (the most a shrink can release)."""
        return self.num_blocks - (max(self._used) + 1 if self._used else 0)

    def resize(self, num_blocks: int) -> None:
        """Grow (new ids join the free set) or shrink (the ids released must all be free; runways
        are cut at the new end)."""
        assert num_blocks >= 1
        if num_blocks >= self.num_blocks:
            for block in range(self.num_blocks, num_blocks):
                heapq.heappush(self._free, block)
        else:
            assert self.num_blocks - num_blocks <= self.free_tail(), "shrinking past a used block"
            self._free = [b for b in self._free if b < num_blocks]
            heapq.heapify(self._free)
            self._runway = {first: min(end, num_blocks) for first, end in self._runway.items() if first < num_blocks}
        self.num_blocks = num_blocks

    def _free_run(self, need: int, want: int) -> tuple[int, int] | None:
        """(first id, end) in the lowest run of free ids outside runways that holds ``want`` blocks,
        else in the lowest that holds ``need`` (as much of ``want`` as it has); None if none does."""
        runs: list[list[int]] = []  # [first, end]
        for b in sorted(self._free):
            if runs and runs[-1][1] == b:
                runs[-1][1] += 1
            else:
                runs.append([b, b + 1])
        fits = [r for r in runs if r[1] - r[0] >= want] or [r for r in runs if r[1] - r[0] >= need]
        if not fits:
            return None
        first, end = fits[0]
        return first, min(end, first + want)

    def _needs_block(self, seq: HoldsBlocks) -> bool:
        return len(seq.block_table) * self.block_size < seq.length

    def _take(self) -> int:
        """The lowest free id outside runways, else the last block of the longest runway."""
        if self._free:
            block = heapq.heappop(self._free)
        else:
            first, end = max(self._runway.items(), key=lambda r: r[1] - r[0])
            block = end - 1
            if block == first:
                del self._runway[first]
            else:
                self._runway[first] = block
        self._used.add(block)
        return block
