"""Generation in process: continuous batching, seeded sampling, resume, stops, aborts, sampling and
detokenizer units."""

from __future__ import annotations

import pytest
import torch

from engine.detokenizer import IncrementalText
from engine.sampling import Draw, SamplingParams, position_seed, sample, top_p_filter
from engine_helpers import build_llm_engine, make_seq, run_engine

PROMPTS = [[5, 17, 42, 99], [3, 250, 7, 11, 300, 64, 128], [9], [200, 201, 202, 203, 204, 205, 206, 207, 208]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return build_llm_engine(tiny_model, max_batch=8)


def test_requests_joining_mid_run_match_running_alone(engine):
    alone = {}
    for i, p in enumerate(PROMPTS):
        alone |= run_engine(engine, [make_seq(f"r{i}", p, max_tokens=12, ignore_eos=True)])
    seqs = [make_seq(f"r{i}", p, max_tokens=12, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    together = run_engine(engine, seqs[:1], join_at={2: seqs[1:3], 5: seqs[3:]})
    assert {k: v[0] for k, v in together.items()} == {k: v[0] for k, v in alone.items()}
    assert all(len(v[0]) == 12 and v[2] == "length" for v in together.values())


def test_prefill_of_ragged_prompts_together_matches_alone(engine):
    alone = {}
    for i, p in enumerate(PROMPTS):
        alone |= run_engine(engine, [make_seq(f"r{i}", p, max_tokens=6, ignore_eos=True)])
    together = run_engine(engine, [make_seq(f"r{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    assert {k: v[0] for k, v in together.items()} == {k: v[0] for k, v in alone.items()}


def test_more_requests_than_the_batch_wait_for_room(tiny_model):
    small = build_llm_engine(tiny_model, max_batch=2)
    seqs = [make_seq(f"r{i}", p, max_tokens=5, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    out = run_engine(small, seqs)
    assert all(len(v[0]) == 5 for v in out.values())
    assert small.scheduler.blocks.num_used == 0


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine):
    def run(seed):
        seq = make_seq("s", PROMPTS[1], seed=seed, temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True)
        return run_engine(engine, [seq])["s"][0]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_resume_continues_exactly_like_an_uninterrupted_run(engine, cut):
    params = dict(seed=1234, temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True)
    full = run_engine(engine, [make_seq("a", PROMPTS[0], **params)])["a"]
    resumed = run_engine(engine, [make_seq("b", PROMPTS[0], resume=full[0][:cut], **params)])["b"]
    assert full[0][:cut] + resumed[0] == full[0]
    assert full[1].endswith(resumed[1]) and len(resumed[0]) == 16 - cut


def test_stop_string_ends_the_completion_before_it(engine):
    ids, text, _ = run_engine(engine, [make_seq("g", PROMPTS[1], max_tokens=20, ignore_eos=True)])["g"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "the random model produced whitespace; pick another prompt"
    ids2, text2, reason = run_engine(engine, [make_seq("h", PROMPTS[1], max_tokens=20, ignore_eos=True,
                                                      stop=(stop,))])["h"]
    assert reason == "stop"
    assert text2 == text[:text.find(stop)]


def test_stop_token_ids_and_eos(engine):
    ids, _, _ = run_engine(engine, [make_seq("g", PROMPTS[2], max_tokens=10, ignore_eos=True)])["g"]
    out = run_engine(engine, [make_seq("h", PROMPTS[2], max_tokens=10, stop_token_ids=(ids[3],))])["h"]
    assert out[0] == ids[:ids.index(ids[3]) + 1] and out[2] == "stop"


def test_abort_frees_the_blocks(engine):
    seq = make_seq("x", PROMPTS[0], max_tokens=50, ignore_eos=True)
    engine.add(seq)
    engine.step()
    engine.step()
    assert engine.scheduler.blocks.num_used == 1
    engine.abort("x")
    assert not engine.has_work() and engine.scheduler.blocks.num_free == engine.runner.kv.num_blocks
    assert seq.finish_reason == "abort"


def test_context_full_finishes_with_length(tiny_model):
    small = build_llm_engine(tiny_model, max_model_len=12)
    ids, _, reason = run_engine(small, [make_seq("c", PROMPTS[0], max_tokens=100, ignore_eos=True)])["c"]
    assert reason == "length" and len(PROMPTS[0]) + len(ids) == 12


# --- units -----------------------------------------------------------------------------------------
def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.allclose(top_p_filter(probs, 0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(top_p_filter(probs, 0.81), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_draws_are_keyed_by_seed_and_position_not_by_history():
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0)
    a = sample(logits, [Draw(p, 5, 10), Draw(p, 5, 11), Draw(p, 6, 10)])
    b = sample(logits[[1]], [Draw(p, 5, 11)])
    assert a[1] == b[0]
    assert position_seed(5, 10) != position_seed(5, 11) != position_seed(6, 10)
    greedy = sample(logits, [Draw(SamplingParams(temperature=0.0), 0, 0)] * 3)
    assert greedy == logits.argmax(-1).tolist()


def test_incremental_text_holds_back_partial_stops_with_their_ids():
    vocab = {1: "hel", 2: "lo ", 3: "wor", 4: "ld", 5: "!"}
    text = IncrementalText(lambda ids: "".join(vocab[i] for i in ids), stop=("world",))
    assert (text.add([1], False).text, text.add([2], False).text) == ("hel", "lo ")
    held = text.add([3], False)
    assert held.text == "" and held.token_ids == []  # "wor" may start "world"
    done = text.add([4], False)
    assert done.stopped and done.text == "" and done.token_ids == [3, 4]


def test_incremental_text_releases_a_false_alarm_and_skips_resumed_text():
    vocab = {1: "ab", 2: "c", 3: "xyz"}
    text = IncrementalText(lambda ids: "".join(vocab[i] for i in ids), stop=("cd",), resume_ids=[1])
    assert text.add([2], False).text == ""
    out = text.add([3], False)
    assert out.text == "cxyz" and out.token_ids == [2, 3]


def test_incremental_text_waits_for_complete_utf8():
    pieces = {1: b"\xe2\x82", 2: b"\xac", 3: b"x"}
    text = IncrementalText(lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", "replace"))
    assert text.add([1], False).token_ids == []
    out = text.add([2], False)
    assert out.text == "\u20ac" and out.token_ids == [1, 2]
