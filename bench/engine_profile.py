"""Where one CUDA engine's device memory and decode step time go (in process, no HTTP).

    python3 bench/engine_profile.py --model DIR                 # bf16, batches 1 and 16

Memory: the device's used bytes (``cudaMemGetInfo``) after each stage of an engine's start (CUDA
context, weights copied in, model + KV pool, warm-up, each decode graph captured), with torch's
allocator (reserved) beside it; what the driver holds beyond torch's allocator is context, module
code (cuBLAS, Triton) and graph executables. Run it alone on the GPU: the figures are device-wide.

Decode: each batch's step as the kernels the device ran (torch profiler over eager steps), grouped
by kernel, per step, beside the CUDA graph's replay time of the same step.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def used_mib() -> float:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def stage(rows: list, name: str) -> None:
    import torch

    rows.append((name, used_mib(), torch.cuda.memory_reserved() / 2**20))


def build(a, rows: list):
    import torch
    from dataclasses import replace

    from cache_daemon.checkpoint import load_shards
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner
    from engine.tokenizer import Tokenizer

    stage(rows, "before CUDA")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    stage(rows, "CUDA context")
    from engine.fusion import pack_onto

    # as the engine's --weights disk lays them out: each layer's q/k/v and gate/up in one allocation
    weights = pack_onto(load_shards(a.model, dtype=getattr(torch, a.dtype)), torch.device("cuda"))
    stage(rows, "weights on the device")
    cfg = EngineConfig(model=a.model, weights="disk", device="cuda", dtype=a.dtype, max_batch=a.max_batch,
                       kv_memory=int(a.kv_gib * 2**30), max_model_len=a.prompt_len + a.context + 16)
    runner = ModelRunner(replace(cfg), ModelConfig.from_dir(a.model), weights)
    engine = LLMEngine(runner, Tokenizer(a.model), ())
    stage(rows, f"model + KV pool ({runner.kv.nbytes / 2**30:.2f} GiB)")
    engine.warmup()
    stage(rows, "warm-up (1 prefill + 1 decode)")
    while runner.graphs_pending:
        bucket = runner.decoder.pending[0]
        engine.capture_graph()
        stage(rows, f"graph bucket {bucket}")
    return engine, runner


def fill(engine, b: int, a) -> None:
    """``b`` sequences at context ~prompt + context/2, left running (max_tokens large)."""
    from engine.sampling import SamplingParams
    from engine.sequence import Sequence

    for i in range(b):
        engine.add(Sequence(f"p{b}-{i}-{time.monotonic_ns()}", [3 + (7 * i + j) % 400 for j in range(a.prompt_len)],
                            SamplingParams(temperature=0.0, max_tokens=a.context, ignore_eos=True), 0))
    for _ in range(a.context // 2):
        engine.step()


def profile_batch(engine, runner, b: int, a) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fill(engine, b, a)
    dec = runner.decoder
    bucket = dec.bucket(b)
    steps = 10
    with torch.inference_mode():
        dec._forward(bucket)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            dec._forward(bucket)
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t0) / steps * 1e3
        graph = dec.graphs.get(bucket)
        replay_ms = None
        if graph is not None:
            t0 = time.perf_counter()
            for _ in range(steps):
                graph[0].replay()
            torch.cuda.synchronize()
            replay_ms = (time.perf_counter() - t0) / steps * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec._forward(bucket)
            torch.cuda.synchronize()
    by_kernel: dict = defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA":  # the kernels themselves, not the ops that launched them
            k = by_kernel[ev.key[:90]]
            k[0] += ev.self_device_time_total / steps / 1e3  # us -> ms per step
            k[1] += ev.count / steps
    while engine.has_work():
        engine.step()
    return {"eager_ms": eager_ms, "replay_ms": replay_ms, "kernels": by_kernel}


def profile_prefill(runner, rows: int, tokens: int, a) -> dict:
    """A prefill of ``rows`` prompts of ``tokens`` tokens (the migrated streams a promoted standby
    takes over): wall time per forward, its kernels' device time, and where the host time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.model_runner import StepPlan

    per = -(-tokens // runner.kv.block_size)
    plan = StepPlan("prefill", tuple(tuple(3 + (r + j) % 300 for j in range(tokens)) for r in range(rows)),
                    block_tables=tuple(tuple(range(r * per, (r + 1) * per)) for r in range(rows)))
    runner.run(plan)
    torch.cuda.synchronize()
    steps = 5
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.run(plan)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.run(plan)
        torch.cuda.synchronize()
    device, host = 0.0, []
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA":
            device += ev.self_device_time_total / steps / 1e3
        else:
            host.append((ev.self_cpu_time_total / steps / 1e3, ev.count / steps, ev.key[:70]))
    return {"wall_ms": wall_ms, "device_ms": device, "host": sorted(host, reverse=True)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kv-gib", type=float, default=4.0)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--context", type=int, default=128, help="decode steps before profiling: context/2")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--memory-only", action="store_true", help="only the memory by stage (no profiling)")
    a = p.parse_args()
    import torch

    print(f"# bench/engine_profile.py {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}Z "
          f"{platform.node()} {torch.cuda.get_device_name(0)} torch {torch.__version__}; command: "
          f"{' '.join([sys.executable, *sys.argv])}")
    rows: list = []
    engine, runner = build(a, rows)
    print("\ndevice memory by stage (MiB; 'driver' = used - torch reserved: context, modules, graph executables)")
    last = rows[0][1]
    for name, used, reserved in rows:
        print(f"  {name:<36} used {used:9.0f} (+{used - last:7.0f})   torch reserved {reserved:9.0f}   "
              f"driver {used - reserved:7.0f}")
        last = used
    if a.memory_only:
        return 0
    for rows, tokens in ((1, 40), (16, 16)):
        r = profile_prefill(runner, rows, tokens, a)
        print(f"\nprefill {rows} x {tokens} tokens: {r['wall_ms']:.2f} ms a forward (wall, synchronized), kernels' "
              f"device time {r['device_ms']:.2f} ms; host time by op (self, per forward):")
        for ms, count, name in r["host"][:a.top]:
            print(f"  {ms:7.3f} ms  {count:5.0f}x  {name}")
    for b in [int(x) for x in a.batches.split(",")]:
        r = profile_batch(engine, runner, b, a)
        total = sum(v[0] for v in r["kernels"].values())
        replay = "-" if r["replay_ms"] is None else f"{r['replay_ms']:.3f}"
        print(f"\nbatch {b}: eager step {r['eager_ms']:.3f} ms, graph replay {replay} ms, kernels' device time "
              f"{total:.3f} ms per step ({sum(v[1] for v in r['kernels'].values()):.0f} kernels)")
        for name, (ms, count) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][0])[:a.top]:
            print(f"  {ms:7.3f} ms  {count:5.0f}x  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
