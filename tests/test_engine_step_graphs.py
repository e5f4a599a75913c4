"""Steps that prefill through the decode buffers (``engine.cuda_graphs``, ``--graph-tokens``): each
prompt token one row, so a step of short prompts and running decodes is one graph replay.

CPU: the fused path through Triton's interpreter (skipped where Triton is not installed), with the
row steps run eagerly: prefill logits equal the reference prefill's, in a bucket below ``max_batch``
(the split decode kernel, every row's logits) and past it (one program per row and kv head, the
sampled rows' logits only); a whole engine run with late joiners and chunked prefill gives the
reference engine's tokens and text. CUDA (marked): a row step's graph replay equals its eager run,
and an engine serving with step graphs gives the tokens of one without graphs.
"""

from __future__ import annotations

import pytest
import torch

from engine.model_runner import StepPlan
from engine_helpers import build_llm_engine, build_runner, make_seq, run_engine
import triton_interp

PROMPTS = [[5, 17, 42, 99, 3], [3, 250, 7, 11, 300, 64, 128, 9, 1, 2, 77, 31], [9],
           [200, 201, 202, 203, 204, 205, 206, 207, 208]]
KW = dict(max_batch=4, kv_block_size=4, max_model_len=64, graph_tokens=32)


def prefill_plans(prompts: list[list[int]], block_size: int):
    """(the reference prefill plan, the same prompts as one row step) over disjoint tables."""
    tables, first = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append(tuple(range(first + n - 1, first - 1, -1)))  # scattered: reversed ids
        first += n
    tokens, positions, rows, table_rows = [], [], [], []
    for p, t in zip(prompts, tables):
        tokens += p
        positions += range(len(p))
        table_rows += [t] * len(p)
        rows.append(len(tokens) - 1)
    ref = StepPlan("prefill", tuple(map(tuple, prompts)), block_tables=tuple(tables))
    step = StepPlan("rows", tuple(tokens), tuple(positions), tuple(table_rows), sample_rows=tuple(rows))
    return ref, step


def engine_run(engine, scenario: str = "joins") -> dict:
    """joins: late joiners beside decodes, a long prompt in chunks, one sequence sampled; overflow: 48 prompt tokens at
    once (past the 32-row graph, within twice it: cut to fit); long: 72 at once (prefilled eagerly)."""
    if scenario != "joins":
        count = 4 if scenario == "overflow" else 6
        seqs = [make_seq(f"o{i}", [(13 * i + j) % 500 + 3 for j in range(12)], max_tokens=4, ignore_eos=True)
                for i in range(count)]
        return run_engine(engine, seqs)
    seqs = [make_seq(f"r{i}", p, max_tokens=6, ignore_eos=True, **({"temperature": 0.9} if i == 1 else {}))
            for i, p in enumerate(PROMPTS[:3])]  # r1 sampled: its logits row, drawn by (seed, position)
    late = {2: [make_seq("late", PROMPTS[3], max_tokens=5, ignore_eos=True)],
            4: [make_seq("long", [11 + i for i in range(30)], max_tokens=3, ignore_eos=True)]}
    return run_engine(engine, seqs, join_at=late)


INTERPRETED = """
import sys
import triton_interp
triton_interp.allow_loaded_scalar_bounds()

from engine import fused
from engine_helpers import build_llm_engine, build_runner
from test_engine_step_graphs import KW, PROMPTS, engine_run, prefill_plans

model, kind = sys.argv[1], sys.argv[2]
if kind == "logits":
    reference = build_runner(model, **KW)
    fused.available = lambda device: True
    runner = build_runner(model, **KW)
    runner.decoder.eager_rows = True
    assert runner.kv.fused and runner.decoder.buckets == (1, 2, 4, 8, 16, 32)
    worst = 0.0
    for prompts in (PROMPTS[:1], [PROMPTS[0][:2], PROMPTS[2]], PROMPTS):  # 5, 3 and 27 rows
        ref, step = prefill_plans(prompts, runner.kv.block_size)
        assert runner.can_run_rows(len(step.tokens))
        a, b = reference.run(ref), runner.run(step)
        assert a.shape == b.shape, (a.shape, b.shape)
        worst = max(worst, (a - b).abs().max().item())
    print(worst)
else:
    scenarios = ("joins", "overflow", "long")
    kw = dict(KW, max_batch=8)
    reference = [engine_run(build_llm_engine(model, prefill_chunk=8, **kw), s) for s in scenarios]
    fused.available = lambda device: True
    kinds = []
    for scenario, ref in zip(scenarios, reference):
        engine = build_llm_engine(model, prefill_chunk=8, **kw)
        engine.runner.decoder.eager_rows = True
        seen, run = [], engine.runner.run
        engine.runner.run = lambda plan: seen.append(plan.kind) or run(plan)  # what each step ran
        assert engine_run(engine, scenario) == ref, scenario
        assert seen.count("rows") == engine.row_steps
        kinds.append(f"{seen.count('rows')}/{seen.count('prefill')}")
    print(",".join(kinds))
"""


def _interpreted(tmp_path, kind: str) -> str:
    pytest.importorskip("triton")
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    return triton_interp.run(INTERPRETED, str(write_checkpoint(tmp_path / "m", TinySpec())), kind)


def test_row_step_prefill_logits_equal_the_reference_through_the_triton_interpreter(tmp_path):
    assert float(_interpreted(tmp_path, "logits")) <= 1e-4


def test_engine_with_row_steps_gives_the_reference_tokens_through_the_triton_interpreter(tmp_path):
    # row steps / eager prefill forwards. joins: every step that prefilled is a row step (the first,
    # the join beside decodes, the long prompt's chunks of 8 beside decodes and its rest); overflow:
    # 48 rows cut to the 32-row graph, the rest in 8-token chunks beside the 2 decoding sequences;
    # long: 72 rows at once, past twice the graph: one eager forward, then decode steps only
    joins, overflow, long = (tuple(map(int, k.split("/"))) for k in _interpreted(tmp_path, "engine").split(","))
    assert joins[0] >= 6 and joins[1] == 0
    assert overflow == (3, 0)
    assert long == (0, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_step_graph_replay_equals_its_eager_run(tiny_model, dtype):
    from test_engine_graphs import cuda_weights

    runner = build_runner(tiny_model, weights=cuda_weights(tiny_model, getattr(torch, dtype)), device="cuda",
                          dtype=dtype, **KW)
    steps = [prefill_plans(p, runner.kv.block_size)[1] for p in (PROMPTS[:1], PROMPTS[:2], PROMPTS)]
    runner.decoder.eager_rows = True
    eager = [runner.run(s).clone() for s in steps]
    runner.decoder.eager_rows = False
    while runner.graphs_pending:
        runner.run(StepPlan("capture"))
    for step, ref in zip(steps, eager):
        assert runner.decoder.bucket(len(step.tokens)) in runner.decoder.graphs
        assert torch.equal(runner.run(step), ref)


@pytest.mark.cuda
def test_engine_with_step_graphs_gives_the_tokens_of_one_without(tiny_model):
    from test_engine_graphs import cuda_weights

    def run(graphs: bool):
        engine = build_llm_engine(tiny_model, weights=cuda_weights(tiny_model, torch.float32), device="cuda",
                                  prefill_chunk=8, cuda_graphs=graphs, **KW)
        while engine.capture_graph():
            pass
        return engine_run(engine), engine.row_steps

    (with_graphs, rows), (without, none) = run(True), run(False)
    assert with_graphs == without and rows == 6 and none == 0
