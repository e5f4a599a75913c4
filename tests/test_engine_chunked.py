"""Chunked prefill: a prompt prefilled in pieces (each later piece attending to the KV its earlier
pieces left in the pool) equals the prompt prefilled at once, and while other sequences decode a
long prompt is prefilled ``prefill_chunk`` tokens a step, so they keep getting a token every step.
On CPU; the ``cuda`` cases run the same on a GPU (the fused path)."""

from __future__ import annotations

import pytest
import torch

from cache_daemon.checkpoint import load_shards
from engine.model_runner import StepPlan
from engine_helpers import build_llm_engine, build_runner, make_seq

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
TOLERANCE = {"cpu": 1e-5, "cuda": 2e-3}
PROMPT = [3, 250, 7, 11, 300, 64, 128, 9, 1, 2, 77, 31, 5, 17, 42, 99, 3, 8, 400, 23, 6]


def device_kw(model, device: str) -> dict:
    if device == "cpu":
        return {}
    return {"device": device, "weights": {k: v.cuda() for k, v in load_shards(model, dtype=torch.float32).items()}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cuts", [(5, 9), (1, 2, 3, 4, 10), (16,)])
def test_a_prompt_prefilled_in_chunks_equals_one_shot(tiny_model, device, cuts):
    runner = build_runner(tiny_model, max_model_len=64, kv_block_size=4, max_batch=2, **device_kw(tiny_model, device))
    table = (tuple(range(9, 1, -1)) + tuple(range(10, 20)),)  # blocks out of order
    whole = runner.run(StepPlan("prefill", (tuple(PROMPT),), block_tables=table))
    ref = [whole] + [runner.run(StepPlan("decode", (t,), (len(PROMPT) + i,), table)).clone()
                     for i, t in enumerate((4, 8, 15))]
    bounds = [0, *cuts, len(PROMPT)]
    for a, b in zip(bounds, bounds[1:]):  # the same blocks, overwritten chunk by chunk
        last = runner.run(StepPlan("prefill", (tuple(PROMPT[a:b]),), (a,), table))
    ours = [last] + [runner.run(StepPlan("decode", (t,), (len(PROMPT) + i,), table)).clone()
                     for i, t in enumerate((4, 8, 15))]
    for x, y in zip(ref, ours):
        assert (x - y).abs().max().item() <= TOLERANCE[device]
        assert x.argmax(-1).tolist() == y.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_a_long_prompt_joining_running_decodes_is_chunked_and_changes_no_output(tiny_model, device):
    def run(chunk: int):
        engine = build_llm_engine(tiny_model, max_model_len=128, kv_block_size=4, max_batch=4,
                                  prefill_chunk=chunk, **device_kw(tiny_model, device))
        first = [make_seq("a", [5, 17, 42], max_tokens=30, ignore_eos=True),
                 make_seq("b", [9, 8], max_tokens=30, ignore_eos=True, seed=7, temperature=0.9)]
        late = make_seq("long", PROMPT * 3, max_tokens=10, ignore_eos=True)
        for seq in first:
            engine.add(seq)
        engine.step()
        engine.add(late)
        steps, results = [], {}
        while engine.has_work():
            outs = engine.step()
            steps.append({o.seq_id for o in outs if o.new_tokens})
            for o in outs:
                ids, text, _ = results.get(o.seq_id, ([], "", None))
                results[o.seq_id] = (ids + o.token_ids, text + o.text, o.finish_reason)
        return results, steps

    one_shot, _ = run(0)
    chunked, steps = run(8)
    assert chunked == one_shot
    # 63 prompt tokens, 8 a step: its first token comes at the 8th step, and the two running
    # sequences got a token at every step before it
    first_long = next(i for i, ids in enumerate(steps) if "long" in ids)
    assert first_long == 7
    assert all({"a", "b"} <= ids for ids in steps[:first_long + 1])


def test_prefill_chunk_zero_prefills_whole_prompts_even_while_others_decode(tiny_model):
    engine = build_llm_engine(tiny_model, max_model_len=128, max_batch=4, prefill_chunk=0)
    engine.add(make_seq("a", [5, 6], max_tokens=8, ignore_eos=True))
    engine.step()
    engine.add(make_seq("long", PROMPT * 3, max_tokens=2, ignore_eos=True))
    assert {o.seq_id for o in engine.step()} == {"a", "long"}  # its first token in its first step
    while engine.has_work():
        engine.step()


def test_each_prefill_forward_is_delivered_before_the_next_one_runs(tiny_model):
    # a promoted standby's first step: many streams to prefill at once, in several forwards
    engine = build_llm_engine(tiny_model, max_model_len=128, max_batch=8)
    engine.prefill_tokens = 2 * len(PROMPT)  # two prompts per forward
    for i in range(5):
        engine.add(make_seq(f"s{i}", PROMPT, seed=i, max_tokens=4, ignore_eos=True))
    forwards, delivered = [], []
    run = engine.runner.run
    engine.runner.run = lambda plan: forwards.append(plan.kind) or run(plan)
    rest = engine.step(lambda outs: delivered.append((len(forwards), sorted(o.seq_id for o in outs))))
    assert forwards == ["prefill"] * 3 and rest == []
    assert [n for n, _ in delivered] == [1, 2, 3]  # each forward's first tokens before the next forward
    assert sorted(i for _, ids in delivered for i in ids) == [f"s{i}" for i in range(5)]
    # later steps: nothing pending to prefill, the decode's outputs come back as before
    assert sorted(o.seq_id for o in engine.step(lambda outs: delivered.append(outs))) == [f"s{i}" for i in range(5)]
    assert len(delivered) == 3
