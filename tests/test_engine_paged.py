"""Paged KV with the real model (tiny random Llama, fp32): attention through block tables equals
transformers' contiguous attention, a preempted sequence resumes with the output it would have had,
and a pool grown and shrunk between steps changes no output. On CPU; the ``cuda`` cases run the same
on a GPU (``python3 -m pytest -q tests/test_engine_paged.py -m cuda``, skipped elsewhere)."""

from __future__ import annotations

import random

import pytest
import torch

from cache_daemon.checkpoint import load_shards
from engine.model_runner import StepPlan
from engine_helpers import build_llm_engine, build_runner, hf_logits, make_seq, run_engine

ATOL = 1e-4
PROMPTS = [[5, 17, 42, 99, 3], [3, 250, 7, 11, 300, 64, 128, 9, 1, 2, 77, 31], [9],
           [200, 201, 202, 203, 204, 205, 206, 207, 208]]
BLOCK = 4
MAX_LEN = 64  # 16 blocks of 4: the smallest pool holds one such context
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 16 * 4  # k+v, 2 layers, 2 kv heads, 4 positions, 16 dims, fp32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# the GPU's fp32 kernels differ from transformers' CPU ones in the last bits (see test_engine_cuda)
TOLERANCE = {"cpu": ATOL, "cuda": 2e-3}


def device_kw(model, device: str) -> dict:
    if device == "cpu":
        return {}
    return {"device": device, "weights": {k: v.cuda() for k, v in load_shards(model, dtype=torch.float32).items()}}


def small_engine(tiny_model, blocks: int, max_batch: int = 4, device: str = "cpu"):
    return build_llm_engine(tiny_model, max_model_len=MAX_LEN, kv_block_size=BLOCK, max_batch=max_batch,
                            kv_memory=blocks * BLOCK_BYTES, **device_kw(tiny_model, device))


@pytest.fixture(scope="module")
def unpreempted(tiny_model):
    """Each request on its own in a pool with room for everything: the reference, per device."""
    cache = {}

    def get(device: str) -> dict:
        if device not in cache:
            engine = small_engine(tiny_model, blocks=64, device=device)
            out = {}
            for seq in requests():
                out |= run_engine(engine, [seq])
            assert engine.scheduler.preemptions == 0
            cache[device] = out
        return cache[device]

    return get


def requests():
    greedy = [make_seq(f"g{i}", p, max_tokens=24, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    seeded = make_seq("s", PROMPTS[1], seed=99, temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True)
    return [*greedy, seeded]


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_batch_through_scattered_blocks_matches_transformers(tiny_model, device):
    runner = build_runner(tiny_model, max_model_len=MAX_LEN, kv_block_size=BLOCK, max_batch=4,
                          **device_kw(tiny_model, device))
    runner.kv.resize((9, 7, 13, 11))  # four chunks of uneven sizes: a row's blocks span several
    new = 7
    ids = list(range(runner.kv.num_blocks))
    random.Random(0).shuffle(ids)
    tables = []
    for p in PROMPTS:
        n = -(-(len(p) + new) // BLOCK)
        tables.append(tuple(ids[:n]))
        del ids[:n]
    logits = [runner.run(StepPlan("prefill", tuple(map(tuple, PROMPTS)), block_tables=tuple(tables)))]
    seqs = [list(p) for p in PROMPTS]
    for _ in range(new):
        for s, token in zip(seqs, logits[-1].argmax(-1).tolist()):
            s.append(token)
        plan = StepPlan("decode", tuple(s[-1] for s in seqs), tuple(len(s) - 1 for s in seqs), tuple(tables))
        logits.append(runner.run(plan))
    ours = torch.stack(logits, dim=1).cpu()  # [B, new + 1, V]: prefill's last position, then each decode
    for row, (prompt, s) in enumerate(zip(PROMPTS, seqs)):
        ref = hf_logits(tiny_model, s)[len(prompt) - 1:]
        assert (ours[row] - ref).abs().max().item() <= TOLERANCE[device]
        assert ref.argmax(-1).tolist()[:-1] == s[len(prompt):]  # greedy tokens identical


@pytest.mark.parametrize("device", DEVICES)
def test_preempted_sequences_resume_with_the_unpreempted_output(tiny_model, unpreempted, device):
    # the smallest pool: one full context
    engine = small_engine(tiny_model, blocks=MAX_LEN // BLOCK, max_batch=5, device=device)
    seqs = requests()
    out = run_engine(engine, seqs)
    assert engine.scheduler.preemptions >= 3 and seqs[-1].preemptions >= 1  # the seeded one too
    # the token ids and text each client got, concatenated: no gap, no repeat, same draws
    assert out == unpreempted(device)
    assert engine.scheduler.blocks.num_used == 0


@pytest.mark.parametrize("device", DEVICES)
def test_pool_grown_and_shrunk_between_steps_changes_no_output(tiny_model, unpreempted, device):
    engine = small_engine(tiny_model, blocks=16, device=device)
    kv, seqs = engine.runner.kv, requests()
    first = [c.data_ptr() for c in kv.chunks]
    for seq in seqs:
        engine.add(seq)
    results, reached = {}, {}
    for step in range(500):
        if step == 2:
            reached["grow"] = engine.resize_kv(64 * BLOCK_BYTES)
            assert [c.data_ptr() for c in kv.chunks[:len(first)]] == first  # nothing moved
        if step == 9:
            used_top = engine.scheduler.blocks.num_blocks - engine.scheduler.blocks.free_tail()
            reached["shrink"] = engine.resize_kv(16 * BLOCK_BYTES)
            assert used_top <= reached["shrink"].blocks_total < 64
        for out in engine.step():
            ids, text, _ = results.get(out.seq_id, ([], "", None))
            results[out.seq_id] = (ids + out.token_ids, text + out.text, out.finish_reason)
        if not engine.has_work():
            break
    assert results == unpreempted(device)
    assert reached["grow"].blocks_total == 64 and reached["grow"].bytes == 64 * BLOCK_BYTES
    # idle, the pool shrinks all the way; it never goes below one full context nor past max_batch's
    assert engine.resize_kv(1).blocks_total == 16 and kv.num_blocks == 16
    assert engine.resize_kv(1 << 30).blocks_total == 64
    assert engine.resize_kv(40 * BLOCK_BYTES).bytes == 40 * BLOCK_BYTES


@pytest.mark.parametrize("device", DEVICES)
def test_a_standby_pool_below_one_context_holds_what_outgrows_it_until_it_grows(tiny_model, unpreempted, device):
    # a standby's pool: 4 blocks (16 positions) against a 64-token context, floor 4 blocks
    engine = build_llm_engine(tiny_model, max_model_len=MAX_LEN, kv_block_size=BLOCK, max_batch=4,
                              kv_memory=4 * BLOCK_BYTES, kv_min_memory=4 * BLOCK_BYTES, **device_kw(tiny_model, device))
    assert engine.runner.kv.num_blocks == 4
    seqs = requests()
    for seq in seqs:
        engine.add(seq)
    results: dict[str, tuple] = {}

    def step() -> None:
        for out in engine.step():
            ids, text, _ = results.get(out.seq_id, ([], "", None))
            results[out.seq_id] = (ids + out.token_ids, text + out.text, out.finish_reason)

    for _ in range(200):  # nothing of 29+ tokens fits in 16 positions: everything ends up waiting
        step()
        if engine.blocked():
            break
    assert engine.blocked() and not engine.scheduler.running and engine.scheduler.waiting
    assert engine.scheduler.preemptions >= 1
    assert all(r[2] is None for r in results.values())  # nothing finished, nothing failed
    stuck = engine.scheduler.preemptions
    for _ in range(5):  # blocked steps change nothing
        step()
    assert engine.scheduler.preemptions == stuck and engine.blocked()
    assert engine.resize_kv(64 * BLOCK_BYTES).blocks_total == 64  # the promotion's growth
    for _ in range(2000):
        step()
        if not engine.has_work():
            break
    assert results == unpreempted(device)  # every client's ids and text: no gap, no repeat
    # the floor is the standby's pool now, not one full context
    assert engine.resize_kv(1).blocks_total == 4


def test_a_floor_below_one_block_or_above_the_budget_is_refused(tiny_model):
    from engine.config import ConfigError
    from engine.kv_cache import KVBudgetError

    with pytest.raises(KVBudgetError, match="less than one KV block"):
        build_llm_engine(tiny_model, max_model_len=MAX_LEN, kv_block_size=BLOCK, kv_memory=4 * BLOCK_BYTES,
                         kv_min_memory=BLOCK_BYTES - 1)
    with pytest.raises(ConfigError, match="--kv-min-memory must be positive and at most --kv-memory"):
        build_llm_engine(tiny_model, max_model_len=MAX_LEN, kv_block_size=BLOCK, kv_memory=4 * BLOCK_BYTES,
                         kv_min_memory=5 * BLOCK_BYTES)


def test_a_batch_admitted_together_decodes_on_a_view_of_its_runways_as_transformers_does(tiny_model):
    """CPU: sequences admitted in one step each get a runway of consecutive blocks, so their decode
    attends on one strided view of the pool (no gather); ragged prompts, the same max_tokens."""
    engine = small_engine(tiny_model, blocks=64)
    kv, seen = engine.runner.kv, []
    decode_batch = kv.decode_batch

    def spy(tables, positions):
        batch = decode_batch(tables, positions)
        seen.append(batch.strided)
        return batch

    kv.decode_batch = spy
    prompts = [PROMPTS[1], PROMPTS[1][::-1], PROMPTS[3] + [1]]  # ragged: 12, 12, 10 tokens
    seqs = [make_seq(f"v{i}", p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)]
    out = run_engine(engine, seqs)
    # 24 tokens a row at most (6 blocks): rows 6 blocks apart; the 10-token row's runway is 6 too
    assert seen and all(s is not None and s[1] == 6 for s in seen[:10]), seen
    for p, s in zip(prompts, seqs):
        ref = hf_logits(tiny_model, p + out[s.id][0])[len(p) - 1:-1]
        assert ref.argmax(-1).tolist() == out[s.id][0]  # greedy tokens identical


def test_a_ragged_batch_on_each_rows_own_view_equals_the_gather_and_transformers(tiny_model, monkeypatch):
    """CPU: rows of consecutive blocks at unequal spacing (rows that joined at different times) decode
    on each row's own view of the pool (``engine.kv_rows``, no copy): the logits equal the gather
    path's and transformers', the greedy tokens are identical."""
    from engine import kv_cache, kv_rows

    monkeypatch.setattr(kv_rows, "MIN_POSITIONS", 0)  # the tiny contexts are below the speed floor
    new, starts = 7, (7, 14, 0, 27)  # rows cross the chunk ends 9, 16 and 29
    tables = tuple(tuple(range(s, s + -(-(len(p) + new) // BLOCK))) for s, p in zip(starts, PROMPTS))

    def decode(gather: bool):
        runner = build_runner(tiny_model, max_model_len=MAX_LEN, kv_block_size=BLOCK, max_batch=4)
        runner.kv.resize((9, 7, 13, 11))
        seen, decode_batch = [], runner.kv.decode_batch
        runner.kv.decode_batch = lambda *a: seen.append(decode_batch(*a)) or seen[-1]
        logits = [runner.run(StepPlan("prefill", tuple(map(tuple, PROMPTS)), block_tables=tables))]
        seqs = [list(p) for p in PROMPTS]
        for _ in range(new):
            for s, token in zip(seqs, logits[-1].argmax(-1).tolist()):
                s.append(token)
            plan = StepPlan("decode", tuple(s[-1] for s in seqs), tuple(len(s) - 1 for s in seqs), tables)
            logits.append(runner.run(plan))
        assert all((b.own is None) == gather and b.strided is None for b in seen) and len(seen) == new
        return torch.stack(logits, dim=1), seqs

    own, seqs = decode(gather=False)
    with monkeypatch.context() as m:
        m.setattr(kv_cache, "consecutive_rows", lambda *a: None)
        gathered, _ = decode(gather=True)
    torch.testing.assert_close(own, gathered, atol=1e-5, rtol=1e-5)
    for row, (prompt, s) in enumerate(zip(PROMPTS, seqs)):
        ref = hf_logits(tiny_model, s)[len(prompt) - 1:]
        assert (own[row] - ref).abs().max().item() <= ATOL
        assert ref.argmax(-1).tolist()[:-1] == s[len(prompt):]  # greedy tokens identical


def test_rows_joining_at_different_steps_decode_on_their_own_views_as_transformers_does(tiny_model, monkeypatch):
    """CPU engine: sequences that join at different steps with different ``max_tokens`` get runways
    of different lengths, so no single strided view: they decode on their own views."""
    from engine import kv_rows

    monkeypatch.setattr(kv_rows, "MIN_POSITIONS", 0)
    engine = small_engine(tiny_model, blocks=64)
    kv, seen = engine.runner.kv, []
    decode_batch = kv.decode_batch
    kv.decode_batch = lambda *a: seen.append(decode_batch(*a)) or seen[-1]
    seqs = [make_seq(f"j{i}", p, max_tokens=8 + 5 * i, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    out = run_engine(engine, seqs[:2], join_at={2: seqs[2:3], 5: seqs[3:]})
    assert sum(b.own is not None and len(b.own) >= 3 for b in seen) >= 5, [(b.own, b.strided) for b in seen]
    for p, s in zip(PROMPTS, seqs):
        ref = hf_logits(tiny_model, p + out[s.id][0])[len(p) - 1:-1]
        assert ref.argmax(-1).tolist() == out[s.id][0]  # greedy tokens identical


def test_a_row_whose_runway_tail_was_taken_attends_on_its_own_copy_as_transformers_does(tiny_model, monkeypatch):
    """CPU engine, a pool too small for every runway: a later sequence takes the tail of the first
    one's runway, so the first one's table stops being consecutive; that row copies its own blocks
    while the others keep their views, and every greedy token equals transformers'."""
    from engine import kv_rows

    monkeypatch.setattr(kv_rows, "MIN_POSITIONS", 0)
    engine = small_engine(tiny_model, blocks=20)
    kv, seen = engine.runner.kv, []
    decode_batch = kv.decode_batch
    kv.decode_batch = lambda *a: seen.append(decode_batch(*a)) or seen[-1]
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0]]
    seqs = [make_seq(f"t{i}", p, max_tokens=n, ignore_eos=True) for i, (p, n) in enumerate(zip(prompts, (40, 20, 20)))]
    out = run_engine(engine, seqs[:1], join_at={2: seqs[1:2], 4: seqs[2:]})
    mixed = [b.own for b in seen if b.own and any(not isinstance(f, int) for f, _ in b.own)
             and any(isinstance(f, int) for f, _ in b.own)]
    assert mixed, [(b.own, b.strided) for b in seen]
    for p, s in zip(prompts, seqs):
        ref = hf_logits(tiny_model, p + out[s.id][0])[len(p) - 1:-1]
        assert ref.argmax(-1).tolist() == out[s.id][0]
