"""The CPU decode attention of the paged pool (``KVPool.attend``: the gather of each row's blocks, by
runs of consecutive ids or by index, then SDPA with a kv head's G query heads as G queries) equals
SDPA with ``enable_gqa`` on each row's own contiguous K/V: ragged lengths ending inside and on block
boundaries, GQA group 4, tables inside one chunk, across chunks, and scattered."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.kv_cache import KVPool

LAYERS, KV_HEADS, HEADS, DIM, BS = 2, 2, 8, 16, 4


def pool_with_chunks(chunks: tuple[int, ...]) -> KVPool:
    pool = KVPool(LAYERS, KV_HEADS, DIM, BS, torch.float32, "cpu", min_blocks=1, max_blocks=sum(chunks))
    pool.resize(chunks)
    gen = torch.Generator().manual_seed(1)
    for chunk in pool.chunks:
        chunk.copy_(torch.randn(chunk.shape, generator=gen))
    return pool


def contiguous(pool: KVPool, which: int, layer: int, table, n: int) -> torch.Tensor:
    """Row's positions 0..n-1 read block by block: [Hkv, n, D]."""
    blocks = []
    for b in table:
        c = max(i for i, s in enumerate(pool.starts) if s <= b)
        blocks.append(pool.chunks[c][which, layer, b - pool.starts[c]])
    return torch.cat(blocks)[:n].transpose(0, 1)


def check(pool: KVPool, tables, positions, *, runs: bool) -> None:
    batch = pool.decode_batch(tables, positions)
    assert (batch.runs is not None) == runs
    gen = torch.Generator().manual_seed(2)
    b = len(tables)
    for layer in range(LAYERS):
        q = torch.randn(b, 1, HEADS, DIM, generator=gen).transpose(1, 2)  # [B, H, 1, D] as the model has it
        k, v = (torch.randn(b, 1, KV_HEADS, DIM, generator=gen).transpose(1, 2) for _ in range(2))
        got = pool.attend(layer, q, k, v, batch)
        for r, (table, p) in enumerate(zip(tables, positions)):
            keys, values = (contiguous(pool, w, layer, table, p + 1) for w in (0, 1))
            assert torch.equal(keys[:, p], k[r, :, 0]) and torch.equal(values[:, p], v[r, :, 0])
            want = F.scaled_dot_product_attention(q[r:r + 1], keys[None], values[None], enable_gqa=True)
            torch.testing.assert_close(got[r:r + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks", [(40,), (9, 13, 18)])
def test_ragged_rows_of_consecutive_blocks_gathered_by_runs(chunks):
    pool = pool_with_chunks(chunks)
    # rows of consecutive ids (as lowest-first allocation gives them) plus a grown last block each;
    # lengths end mid-block, on a block's last position and at a block's first
    tables = ((0, 1, 2, 30), (3, 4, 5, 6, 31), (7, 8, 32), (9, 10, 11, 12, 13, 33))
    positions = (13, 19, 8, 23)  # contexts 14, 20 (5 full blocks), 9 (one into the 3rd), 24
    check(pool, tables, positions, runs=True)


def test_scattered_blocks_across_chunks_fall_back_to_the_index_gather():
    pool = pool_with_chunks((9, 13, 18))
    ids = list(range(40))
    random.Random(3).shuffle(ids)
    lens = [15, 4, 21, 9, 17, 1, 12, 20]
    tables, at = [], 0
    for n in lens:
        tables.append(tuple(ids[at:at + -(-n // BS)]))
        at += -(-n // BS)
    check(pool, tuple(tables), tuple(n - 1 for n in lens), runs=False)


def test_equal_lengths_need_no_mask_and_one_run_copies_the_whole_batch():
    pool = pool_with_chunks((40,))
    tables = tuple(tuple(range(5 * r, 5 * r + 5)) for r in range(4))
    batch = pool.decode_batch(tables, (19,) * 4)
    assert batch.mask is None and batch.runs == ((0, 0, 20),)
    check(pool, tables, (19,) * 4, runs=True)
