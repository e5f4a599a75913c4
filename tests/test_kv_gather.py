"""The CPU decode attention of the paged pool (``KVPool.attend``: a strided view of the pool when the
rows' blocks are consecutive and equally spaced, each row's own view when they are consecutive at
unequal spacing (``engine.kv_rows``), else the gather of each row's blocks, by runs of
consecutive ids or by index; then SDPA with a kv head's G query heads as G queries) equals SDPA with
``enable_gqa`` on each row's own contiguous K/V: ragged lengths ending inside and on block boundaries,
GQA group 4, tables inside one chunk, across chunks, and scattered. The chunks are views of one
reserved range that a dropped chunk's pages go back from; a shrink never drops a used block."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine import kv_rows
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


def check(pool: KVPool, tables, positions, *, runs: bool, strided: bool = False, own: bool = False) -> None:
    batch = pool.decode_batch(tables, positions)
    assert (batch.runs is not None) == runs and (batch.strided is not None) == strided
    assert (batch.own is not None) == own
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
    tables = ((0, 1, 2, 30), (3, 4, 5, 6, 31), (7, 8, 32), (9, 10, 11, 12, 13, 33))  # unequal spacing
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
    tables = (*tables[:3], (20, 21, 22, 23, 24))  # no longer equally spaced: no view
    batch = pool.decode_batch(tables, (19,) * 4)
    assert batch.mask is None and batch.strided is None and batch.runs == ((0, 0, 15), (0, 20, 5))
    check(pool, tables, (19,) * 4, runs=True)


@pytest.mark.parametrize("chunks", [(40,), (9, 13, 18)])
def test_equally_spaced_rows_of_consecutive_blocks_attend_on_a_view_across_chunks(chunks):
    pool = pool_with_chunks(chunks)
    # what the block manager's runways give: row r at 2 + 9r, grown into its runway; ragged lengths,
    # the short rows' views running on into the next row's blocks (masked); rows cross chunk ends
    tables = tuple(tuple(range(2 + 9 * r, 2 + 9 * r + n)) for r, n in enumerate((5, 3, 7, 1)))
    check(pool, tables, (19, 10, 25, 0), runs=False, strided=True)
    assert pool.decode_batch(tables[:1], (19,)).strided == (2, 1)  # one row: a view too


@pytest.mark.parametrize("chunks", [(40,), (9, 13, 18)])
def test_consecutive_rows_at_unequal_spacing_attend_on_their_own_views(chunks, monkeypatch):
    pool = pool_with_chunks(chunks)
    # what runways give rows that joined at different times: each row consecutive ids, rows in no
    # order and unequally spaced, crossing chunk ends (9, 22); a row's table may hold blocks past its
    # position (grown ahead), and its last block may be one position in
    tables = ((20, 21, 22, 23, 24, 25, 26), (0, 1, 2, 3, 4), (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18),
              (30, 31, 32, 33, 34, 35, 36, 37, 38))
    positions = (27, 16, 55, 33)
    batch = pool.decode_batch(tables, positions)
    assert batch.own is None and batch.strided is None  # 34 positions a row: below the floor, gathered
    check(pool, tables, positions, runs=batch.runs is not None)
    monkeypatch.setattr(kv_rows, "MIN_POSITIONS", 16)
    check(pool, tables, positions, runs=False, own=True)
    assert pool.decode_batch(tables, positions).own == ((20, 28), (0, 17), (5, 56), (30, 34))
    # a row with one block out of order (a runway's tail taken): that row copies its blocks alone
    broken = (*tables[:3], (30, 31, 39, 33, 34, 35, 36, 37, 38))
    check(pool, broken, positions, runs=False, own=True)
    assert [isinstance(first, int) for first, _ in pool.decode_batch(broken, positions).own] == [True] * 3 + [False]
    # more than half the rows out of order: the whole batch is gathered
    worse = ((20, 21, 27, 23, 24, 25, 26), (0, 2, 1, 3, 4), tables[2], broken[3])
    check(pool, worse, positions, runs=pool.decode_batch(worse, positions).runs is not None)


def test_chunks_are_views_of_one_range_and_a_dropped_chunk_gives_its_pages_back():
    layers, blocks = 4, 512  # 4 * 2 * 512 blocks of 4 KiB: 16 MiB a chunk
    pool = KVPool(layers, 4, 64, 4, torch.float32, "cpu", min_blocks=1, max_blocks=2 * blocks)
    pool.resize((blocks, blocks))
    a, b = pool.chunks
    assert b.data_ptr() - a.data_ptr() == blocks * a.stride(2) * a.element_size()  # one block id space
    b.fill_(1.0)
    before = rss()
    pool.resize((blocks,))
    assert before - rss() >= 0.9 * b.nbytes
    pool.resize((blocks, blocks))
    assert not pool.chunks[1].any() and rss() >= before - 0.1 * b.nbytes  # zeroed again, committed again


def test_a_shrink_keeps_every_chunk_that_holds_a_used_block():
    pool = pool_with_chunks((4, 4, 4, 4, 12, 12, 12))
    bpb = pool.bytes_per_block
    # blocks up to 19 used (inside the first 12-block chunk): that chunk stays, the two above go
    assert pool.plan_resize(16 * bpb, free_tail=52 - 20) == (4, 4, 4, 4, 12)
    assert pool.plan_resize(16 * bpb, free_tail=52 - 16) == (4, 4, 4, 4)
    assert pool.plan_resize(22 * bpb, free_tail=52 - 16) == (4, 4, 4, 4, 6)  # a smaller free one instead


def test_a_grow_past_the_available_memory_fails_with_an_error_and_keeps_the_pool():
    from engine.kv_arena import available_bytes

    layers, bs, per_block = 4, 4, 2 * 4 * 4 * 4 * 64 * 4  # bytes of one block id over k, v and layers
    free = available_bytes()
    blocks = free // per_block + 1024  # a chunk more than the machine has, reserved but not touched
    pool = KVPool(layers, 4, 64, bs, torch.float32, "cpu", min_blocks=1, max_blocks=blocks + 8)
    pool.resize((8,))
    pool.chunks[0].fill_(2.0)
    before = rss()
    with pytest.raises(RuntimeError, match="cannot grow the KV pool by .* bytes available"):
        pool.resize((8, blocks))
    assert [c.shape[2] for c in pool.chunks] == [8] and pool.num_blocks == 8 and (pool.chunks[0] == 2.0).all()
    assert rss() - before < 64 << 20  # nothing of the refused chunk was committed
    pool.resize((8, 8))  # and a grow that fits still works
    assert pool.num_blocks == 16 and not pool.chunks[1].any()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
