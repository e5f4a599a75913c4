"""The CUDA decode path (engine.cuda_graphs, engine.fused): graph replay equals the eager step for
every batch bucket, bf16 greedy text is the same with and without graphs, and an engine that
captures its graphs after /ready loses no request served meanwhile. Marked ``cuda`` (run on a GPU
machine: ``python3 -m pytest tests/test_engine_graphs.py -q``).

The CPU case runs the same fused path through Triton's interpreter where Triton is installed
(skipped otherwise): kernels, padding to buckets and block addressing equal the reference path.
"""

from __future__ import annotations

import concurrent.futures
import random

import pytest
import torch

from cache_daemon.checkpoint import load_shards
from conftest import free_port
from engine.model_runner import StepPlan
from engine_helpers import build_llm_engine, build_runner, get, make_seq, run_engine, start_engine
import triton_interp

PROMPTS = [[5, 17, 42, 99, 3], [3, 250, 7, 11, 300, 64, 128, 9, 1, 2, 77, 31], [9],
           [200, 201, 202, 203, 204, 205, 206, 207, 208], [1, 2, 3], [44] * 20, [7, 8], [300, 301, 302, 303]]


def cuda_weights(model, dtype):
    return {k: v.cuda() for k, v in load_shards(model, dtype=dtype).items()}


def decode_logits(runner, rows: int, steps: int = 4) -> list[torch.Tensor]:
    """Prefill ``rows`` prompts into scattered blocks, then ``steps`` greedy decode steps."""
    ids = list(range(runner.kv.num_blocks))
    random.Random(rows).shuffle(ids)
    prompts = [list(PROMPTS[i % len(PROMPTS)]) for i in range(rows)]
    tables = []
    for p in prompts:
        n = -(-(len(p) + steps + 1) // runner.kv.block_size)
        tables.append(tuple(ids[:n]))
        del ids[:n]
    out = [runner.run(StepPlan("prefill", tuple(map(tuple, prompts)), block_tables=tuple(tables)))]
    for _ in range(steps):
        for s, t in zip(prompts, out[-1].argmax(-1).tolist()):
            s.append(t)
        plan = StepPlan("decode", tuple(s[-1] for s in prompts), tuple(len(s) - 1 for s in prompts), tuple(tables))
        out.append(runner.run(plan).clone())
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_for_every_bucket(tiny_model, dtype):
    runner = build_runner(tiny_model, weights=cuda_weights(tiny_model, getattr(torch, dtype)), device="cuda",
                          dtype=dtype, max_batch=8, kv_block_size=4, max_model_len=64, kv_memory=1 << 22,
                          graph_tokens=0)
    graphs = runner.decoder
    assert graphs.buckets == (1, 2, 4, 8) and not graphs.graphs
    eager = {rows: decode_logits(runner, rows) for rows in (1, 2, 3, 4, 5, 8)}
    while runner.graphs_pending:
        runner.run(StepPlan("capture"))
    assert graphs.live
    for rows, ref in eager.items():
        replayed = decode_logits(runner, rows)
        for a, b in zip(ref, replayed):
            assert torch.equal(a, b), (rows, (a - b).abs().max().item())


@pytest.mark.cuda
def test_bf16_greedy_text_is_the_same_with_and_without_graphs(tiny_model):
    def run(graphs: bool):
        engine = build_llm_engine(tiny_model, weights=cuda_weights(tiny_model, torch.bfloat16), device="cuda",
                                  dtype="bfloat16", max_batch=8, cuda_graphs=graphs, graph_tokens=0)
        while engine.capture_graph():
            pass
        assert engine.runner.graphs_captured == (4 if graphs else 0)
        seqs = [make_seq(f"r{i}", p, max_tokens=32, ignore_eos=True) for i, p in enumerate(PROMPTS[:6])]
        late = [make_seq("late", PROMPTS[6], max_tokens=20, ignore_eos=True)]
        return run_engine(engine, seqs, join_at={5: late})

    assert run(True) == run(False)


@pytest.mark.cuda
def test_serving_while_graphs_are_captured_loses_no_request(tiny_model, procs):
    import openai

    port = free_port()
    proc = start_engine(procs, tiny_model, port, "--device", "cuda", "--max-batch", "64", "--served-model-name", "m")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    def one(i: int):
        return client.completions.create(model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24,
                                         temperature=0, extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(96)))
    assert all(r.usage.completion_tokens == 24 for r in results)
    by_prompt: dict[int, set] = {}
    for i, r in enumerate(results):
        by_prompt.setdefault(i % len(PROMPTS), set()).add(tuple(r.choices[0].token_ids))
    assert all(len(outs) == 1 for outs in by_prompt.values())  # eager and replayed steps agree
    log = proc.log_path.read_text()
    assert '"cuda_graphs_live"' in log
    status, body = get(port, "/metrics")
    # 1, 2, ..., 64 for decode, then 128 and 256 for steps that prefill (--graph-tokens 256)
    assert status == 200 and 'failover_engine_cuda_graph_buckets{model_name="m"} 9.0' in body
    assert get(port, "/ready")[1]["cuda_graph_buckets"] == 9


INTERPRETED = """
import sys
import triton_interp
triton_interp.allow_loaded_scalar_bounds()

from engine import fused
from engine_helpers import build_runner
from test_engine_graphs import decode_logits
ref = decode_logits(build_runner(sys.argv[1], max_batch=4, kv_block_size=4, max_model_len=64), 3)
fused.available = lambda device: True
runner = build_runner(sys.argv[1], max_batch=4, kv_block_size=4, max_model_len=64)
assert runner.decoder is not None and runner.kv.fused
print(max((a - b).abs().max().item() for a, b in zip(ref, decode_logits(runner, 3))))
"""


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_path_equals_the_reference_through_the_triton_interpreter(tmp_path, arch):
    pytest.importorskip("triton")
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    spec = {"qwen3": TinySpec(arch="qwen3", tie=True), "mistral": TinySpec(arch="mistral", head_dim=32)}
    tiny_model = write_checkpoint(tmp_path / arch, spec.get(arch, TinySpec(arch=arch)))
    assert float(triton_interp.run(INTERPRETED, str(tiny_model))) <= 1e-4
