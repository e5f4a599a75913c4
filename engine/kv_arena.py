"""The CPU KV pool's memory: one reserved range of addresses for the largest pool it may become,
its chunks views of it (``engine.kv_cache.KVPool``).

Why: a view of consecutive blocks then spans chunks, so decode attends on the pool in place
(``Arena.rows``, for tables that ``equally_spaced`` finds) whichever chunks a batch's blocks lie in. The range is mapped ``MAP_NORESERVE``:
it costs address space, not memory. A page is committed when a chunk is zeroed and handed back to
the kernel (``MADV_DONTNEED``) when the chunk is dropped, so the process holds what the pool holds,
as with a tensor per chunk; nothing in use moves. Where the kernel refuses the range (strict
overcommit), ``reserve`` returns None and the pool keeps a tensor per chunk.
"""

from __future__ import annotations

import math
import mmap

import structlog
import torch

log = structlog.get_logger(__name__)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11's mmap lacks the name


class Arena:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """``shape``: [2 (k, v), layers, max_blocks, block_size, kv_heads, head_dim]."""
        elem = torch.empty((), dtype=dtype).element_size()
        self.planes, self.max_blocks = shape[0] * shape[1], shape[2]
        self.block_bytes = math.prod(shape[3:]) * elem  # one block of one (k or v, layer) plane
        self._map = mmap.mmap(-1, self.planes * self.max_blocks * self.block_bytes,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.tensor = torch.frombuffer(self._map, dtype=dtype).view(shape)

    @classmethod
    def reserve(cls, shape: tuple[int, ...], dtype: torch.dtype) -> Arena | None:
        try:
            return cls(shape, dtype)
        except OSError as e:
            log.warning("kv_arena_refused", error=str(e), blocks=shape[2])
            return None

    def chunk(self, first: int, blocks: int) -> torch.Tensor:
        """Blocks ``first .. first + blocks - 1`` as a zeroed chunk, [2, layers, blocks, ...].
        Raises RuntimeError, touching nothing, when the kernel has less memory available than the
        chunk needs: a page of the reserved range is only committed when written, so without this
        check a grow past the free memory would meet the OOM killer instead of an error (a failed
        grow must leave the engine serving with the pool it had)."""
        if not 0 <= first and first + blocks <= self.max_blocks:
            raise ValueError(f"blocks {first}..{first + blocks - 1} lie past the reserved {self.max_blocks}")
        need, free = self.planes * blocks * self.block_bytes, available_bytes()
        if free is not None and need > free:
            raise RuntimeError(f"cannot grow the KV pool by {need} bytes ({blocks} blocks): the kernel has "
                               f"{free} bytes available (MemAvailable)")
        view = self.tensor[:, :, first:first + blocks]
        view.zero_()
        return view

    def release(self, first: int, end: int) -> None:
        """Hand the pages of blocks ``first .. end - 1`` back to the kernel (they read as zeros
        after; a page shared with a block outside the range is kept)."""
        page = mmap.PAGESIZE
        for plane in range(self.planes):
            base = plane * self.max_blocks * self.block_bytes
            a = -(-(base + first * self.block_bytes) // page) * page
            b = (base + end * self.block_bytes) // page * page
            if b > a:
                self._map.madvise(mmap.MADV_DONTNEED, a, b - a)

    def rows(self, layer: int, first: int, spacing: int, rows: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [rows, kv_heads, positions, head_dim] of row r = the blocks from ``first + r *
        spacing``: views, no copy (in a plane a block's positions follow the last block's)."""
        plane = self.tensor[:, layer]  # [2, blocks, block_size, kv_heads, head_dim]
        which, block, _, hkv, d = plane.stride()[:2] + plane.shape[2:]
        kv = plane.as_strided((2, rows, hkv, positions, d), (which, spacing * block, d, hkv * d, 1),
                              plane.storage_offset() + first * block)
        return kv[0], kv[1]


def available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), or None where
    there is none (not Linux)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def equally_spaced(tables, width: int, end: int) -> tuple[int, int] | None:
    """(first id, spacing) when row r's table (up to ``width`` blocks) is the consecutive ids from
    ``first + r * spacing``, spacing > 0, and ``width`` blocks from the last row's first lie below
    ``end`` (a short row's view runs on into blocks it does not own: masked, and finite, chunks being
    zeroed); else None."""
    first = tables[0][0]
    spacing = tables[1][0] - first if len(tables) > 1 else 1
    if spacing <= 0 or tables[-1][0] + width > end:
        return None
    for r, t in enumerate(tables):
        start = first + r * spacing
        if tuple(t[:width]) != tuple(range(start, start + min(len(t), width))):
            return None
    return first, spacing
