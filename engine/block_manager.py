"""Which KV blocks are free and which sequence holds which: the bookkeeping side of the paged pool.

A sequence's ``block_table`` lists the ids of the blocks that hold its positions, in order: position
``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``. Block ids are
global across the pool's chunks (``engine.kv_cache.KVPool``); this module never touches a tensor.

Free blocks are handed out lowest id first, so the used blocks crowd the head of the pool and its
tail chunks stay free for as long as possible: that is what lets ``/admin/kv`` shrink a pool while
sequences run.

Owned by the engine thread (through the scheduler); nothing here is thread-safe by itself.
"""

from __future__ import annotations

import heapq
from typing import Protocol


class HoldsBlocks(Protocol):
    length: int  # tokens in the sequence; all but the last have KV once it is running
    block_table: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: pop gives the lowest free id
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, seq: HoldsBlocks) -> bool:
        """Room for the KV of every token of ``seq`` (its prefill, a fresh or a recomputed one)."""
        return self.blocks_for(seq.length) <= len(self._free)

    def allocate(self, seq: HoldsBlocks) -> None:
        assert not seq.block_table, "a sequence is allocated once per admission"
        assert self.can_allocate(seq)
        seq.block_table = [self._take() for _ in range(self.blocks_for(seq.length))]

    def free(self, seq: HoldsBlocks) -> None:
        """Give back every block of ``seq`` (finished, aborted or preempted)."""
        for block in seq.block_table:
            self._used.remove(block)
            heapq.heappush(self._free, block)
        seq.block_table = []

    def can_append(self, seq: HoldsBlocks) -> bool:
        """Room for the next decode step of ``seq``: it writes the KV of position ``length - 1``."""
        return not self._needs_block(seq) or bool(self._free)

    def may_append(self, seq: HoldsBlocks) -> None:
        """Give ``seq`` the block its next decode step writes into, if its last block is full."""
        if self._needs_block(seq):
            assert self._free, "call can_append first"
            seq.block_table.append(self._take())

    def free_tail(self) -> int:
        """How many blocks at the top of the id space are free (the most a shrink can release)."""
        return self.num_blocks - (max(self._used) + 1 if self._used else 0)

    def resize(self, num_blocks: int) -> None:
        """Grow (new ids join the free set) or shrink (the ids released must all be free)."""
        assert num_blocks >= 1
        if num_blocks >= self.num_blocks:
            for block in range(self.num_blocks, num_blocks):
                heapq.heappush(self._free, block)
        else:
            assert self.num_blocks - num_blocks <= self.free_tail(), "shrinking past a used block"
            self._free = [b for b in self._free if b < num_blocks]
            heapq.heapify(self._free)
        self.num_blocks = num_blocks

    def _needs_block(self, seq: HoldsBlocks) -> bool:
        return len(seq.block_table) * self.block_size < seq.length

    def _take(self) -> int:
        block = heapq.heappop(self._free)
        self._used.add(block)
        return block
