"""CPU decode attention of a ragged batch on each row's own view of the pool: no copy.

A batch whose rows' blocks are consecutive ids (what the block manager's runways give every
sequence) but not equally spaced (rows that joined at different times, with different prompts and
``max_tokens``) has no single strided view (``engine.kv_arena.equally_spaced``). Each row alone has
one: its positions 0 .. p lie in the pool's (k or v, layer) plane at stride ``kv_heads * head_dim``
from its first block's first position, the view reaching across chunks because they are views of one
reserved range (``engine.kv_arena``). So decode runs one SDPA per row on its own view, its own
context length (no mask), instead of copying every row's blocks into contiguous K/V first.

Measured through ``KVPool.attend`` (16 rows of 3/4 .. 5/4 of the context, 4 kv heads x 4 queries,
dim 64, fp32, one layer, the 2-core VM): per-row views vs the gather + one SDPA, ms a layer: 2.30 vs
4.35 at ~512 positions, 0.97 vs 1.50 at ~256, 0.56 vs 0.60 at ~128, 0.46 vs 0.39 at ~64, 0.42 vs 0.39
at ~16. With short contexts the copy is small and the per-row calls' overhead is not: below
``MIN_POSITIONS`` positions a row on average the batch is gathered as before.

A row whose blocks are not consecutive (a runway's tail taken by another sequence when nothing else
was free) copies its own blocks (one ``index_select`` over the plane) and attends alone; the rest of
its batch keeps its views. When more than half the rows are such, the batch is gathered as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_POSITIONS = 96  # average context a row below which the gather (+ one SDPA) is cheaper (measured: 64 vs 128)


Row = tuple[int | torch.Tensor, int]  # (first block id, or the row's block ids; context length)


def consecutive_rows(tables, positions, block_size: int) -> tuple[Row, ...] | None:
    """Each row as (first block id, context length) when its blocks up to its position are
    consecutive ids, else as (its block ids, context length); None when more than half the rows are
    not consecutive or the rows average fewer than ``MIN_POSITIONS`` positions."""
    if sum(positions) + len(positions) < MIN_POSITIONS * len(positions):
        return None
    rows, scattered = [], 0
    for table, p in zip(tables, positions):
        first, width = table[0], p // block_size + 1
        if table[width - 1] - first != width - 1 or any(b != first + i for i, b in enumerate(table[:width])):
            rows.append((torch.tensor(table[:width], dtype=torch.long), p + 1))
            scattered += 1
        else:
            rows.append((first, p + 1))
    return None if 2 * scattered > len(rows) else tuple(rows)


def attend_rows(plane: torch.Tensor, q: torch.Tensor, rows: tuple[Row, ...]) -> torch.Tensor:
    """``plane``: one layer of the reserved range, [2 (k, v), blocks, block_size, kv_heads, head_dim];
    q [B, kv_heads, G, D] (a kv head's G query heads as G queries) -> [B, kv_heads, G, D]."""
    which, block, pos, head = plane.stride()[:4]
    hkv, d = plane.shape[3:]
    base = plane.storage_offset()
    outs = []
    for r, (first, n) in enumerate(rows):
        if isinstance(first, int):
            kv = plane.as_strided((2, 1, hkv, n, d), (which, block, head, pos, 1), base + first * block)
        else:  # not consecutive: this row's blocks copied, [2, blocks, block_size, kv_heads, head_dim]
            kv = plane.index_select(1, first).view(2, 1, -1, hkv, d)[:, :, :n].transpose(2, 3)
        outs.append(F.scaled_dot_product_attention(q[r:r + 1], kv[0], kv[1]))
    return torch.cat(outs)
