"""Decode throughput of the paged KV cache against the per-slot contiguous cache it replaced.

    python3 bench/paged_kv.py                          # CPU; baseline = the engine at git ref a6707d6
    python3 bench/paged_kv.py --device cuda --dtype bfloat16 --layers 16

The baseline is the same engine code at ``--baseline`` (default: the last commit before paging),
checked out into a temporary git worktree that is removed afterwards. Each measurement is a child
process (``--child``) with that tree first on ``sys.path``, so both variants run the same bench code
on the same checkpoint; variants alternate (A B A B ...) so that a change in machine load hits both.
Decode tokens/s = ``B * (new - 1) / time from the first generated token to the last`` (prefill
excluded), the best of 3 in each process and of ``--runs`` processes: on a machine shared with
other jobs, contention only ever slows a run down, so the fastest is the least disturbed figure.

``--ragged`` adds a ragged batch for each batch size > 1: prompts spread over 3/4 .. 5/4 of the
context, ``max_tokens`` differing, joining in 4 waves a step apart, so the paged pool's block tables
are runs of different lengths at unequal spacing (not the one strided view an even batch gets).
Ragged tokens/s = ``B * (new - 1) / time of new - 1 decode steps`` once every row is prefilled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE = "a6707d6"  # main before paged KV: one contiguous max_len region per slot
WAVES = 4  # a ragged batch joins in this many waves


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--layers", type=int, default=6, help="decoder layers of the llama checkpoint (hidden 1024)")
    p.add_argument("--prompt-lens", default="16,512", help="context before decoding (a longer one moves more KV)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--ragged", action="store_true", help="also a ragged batch per batch size > 1 (see above)")
    p.add_argument("--runs", type=int, default=3, help="child processes per variant")
    p.add_argument("--baseline", default=BASELINE, help="git ref of the contiguous-KV engine")
    p.add_argument("--baseline-dir", type=Path, default=None,
                   help="an extracted tree of the baseline instead of a git worktree (a copy without .git: "
                        "git archive REF | tar -x -C DIR)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one measurement (child process; the engine comes from whichever tree is first on sys.path) -----
def measure(args) -> dict:
    import torch

    from cache_daemon.checkpoint import load_shards
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner
    from engine.sampling import SamplingParams
    from engine.scheduler import Sequence
    from engine.tokenizer import Tokenizer

    batches = [int(b) for b in args.batches.split(",")]
    lens = [int(n) for n in args.prompt_lens.split(",")]
    cfg = EngineConfig(model=args.model, weights="disk", device=args.device, dtype=args.dtype,
                       max_batch=max(batches), kv_memory=16 << 30, max_model_len=max_len(args))
    weights = load_shards(args.model, dtype=getattr(torch, args.dtype))
    if args.device == "cuda":
        weights = {k: v.cuda() for k, v in weights.items()}
    engine = LLMEngine(ModelRunner(cfg, ModelConfig.from_dir(args.model), weights), Tokenizer(args.model), ())
    engine.warmup()
    gen = torch.Generator().manual_seed(0)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def decode_seconds(b: int, prompt_len: int, new: int) -> float:
        prompts = torch.randint(3, 500, (b, prompt_len), generator=gen).tolist()
        seqs = [Sequence(f"{b}-{i}-{time.monotonic_ns()}", p,
                         SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), 0)
                for i, p in enumerate(prompts)]
        for s in seqs:
            engine.add(s)
        engine.step()  # admits and prefills all of them, first token each
        sync()
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        sync()
        assert all(len(s.output_ids) == new for s in seqs)
        return time.perf_counter() - start

    def ragged_seconds(b: int, n: int, new: int) -> float:
        waves = min(WAVES, b)
        seqs = [Sequence(f"r{b}-{i}-{time.monotonic_ns()}",
                         torch.randint(3, 500, (n - n // 4 + i * (n // 2) // (b - 1),), generator=gen).tolist(),
                         SamplingParams(temperature=0.0, max_tokens=new + ragged_extra(b, n) + 3 * i, ignore_eos=True), 0)
                for i in range(b)]
        for w in range(waves):  # wave w: rows w, w + waves, ...; one step (its prefill) between waves
            for s in seqs[w::waves]:
                engine.add(s)
            engine.step()
        while not all(s.output_ids for s in seqs):  # prefills a chunk at a time while others decode
            engine.step()
        had = [len(s.output_ids) for s in seqs]
        assert all(h <= ragged_extra(b, n) for h in had), f"the prefill steps took more than their room: {had}"
        sync()
        start = time.perf_counter()
        for _ in range(new - 1):
            engine.step()
        sync()
        took = time.perf_counter() - start
        assert all(len(s.output_ids) == h + new - 1 for s, h in zip(seqs, had)), "a row left the batch"
        for s in seqs:
            engine.abort(s.id)
        while engine.has_work():
            engine.step()
        return took

    out = {}
    for n in lens:
        for b in batches:
            decode_seconds(b, n, 3)  # warm this shape
            t = min(decode_seconds(b, n, args.new_tokens) for _ in range(3))
            out[f"{n}/{b}"] = b * (args.new_tokens - 1) / t
            if args.ragged and b > 1:
                ragged_seconds(b, n, 3)
                t = min(ragged_seconds(b, n, args.new_tokens) for _ in range(3))
                out[f"{n}/{b}/ragged"] = b * (args.new_tokens - 1) / t
    return out


def max_len(args) -> int:
    """The served context: the longest prompt and its tokens (a ragged row's longer prompt and
    max_tokens, see ``ragged_seconds``)."""
    n, b = max(int(x) for x in args.prompt_lens.split(",")), max(int(x) for x in args.batches.split(","))
    return n + n // 4 + args.new_tokens + ragged_extra(b, n) + 3 * b + 8 if args.ragged else n + args.new_tokens + 8


def ragged_extra(b: int, n: int) -> int:
    """Tokens a ragged row may draw before the timed steps: one a step while the later waves prefill
    (at most 512 prompt tokens a step while others decode, the engine's default chunk)."""
    return b * (n + n // 4) // 256 + WAVES + 8


# --- the comparison (parent) ----------------------------------------------------------------------
def write_model(work: Path, layers: int, dtype: str, max_positions: int) -> Path:
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    spec = TinySpec(arch="llama", hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=32000,
                    layers=layers, max_positions=max_positions, dtype=dtype, shards=2)
    return write_checkpoint(work / "model", spec)


def run_child(tree: Path, model: Path, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", str(model),
           "--device", args.device, "--dtype", args.dtype, "--prompt-lens", args.prompt_lens,
           "--new-tokens", str(args.new_tokens), "--batches", args.batches, *(["--ragged"] if args.ragged else [])]
    rest = os.environ.get("PYTHONPATH", "")  # the tree under test first; what else was there after it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *[p for p in rest.split(os.pathsep)
                                                                      if p and Path(p).resolve() != REPO]])}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"child in {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.child:
        # the tree under test comes from PYTHONPATH; this script's own dir would shadow the engine
        # package with bench/engine.py
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
        try:  # the baseline tree predates the leaf package
            from failover_common.logs import configure_logging
        except ImportError:
            from cache_daemon.logs import configure_logging

        configure_logging("warning")
        print(json.dumps(measure(args)))
        return 0
    sys.path.insert(0, str(REPO))
    work = Path(tempfile.mkdtemp(prefix="fo-bench-paged-"))
    baseline = args.baseline_dir.resolve() if args.baseline_dir else work / "baseline"
    try:
        model = write_model(work, args.layers, args.dtype, 2 * max_len(args) + 64)
        if args.baseline_dir is None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), args.baseline],
                           check=True, capture_output=True)
        figures: dict[str, list[dict]] = {"contiguous": [], "paged": []}
        for _ in range(args.runs):
            figures["contiguous"].append(run_child(baseline, model, args))
            figures["paged"].append(run_child(REPO, model, args))
        load = "/".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"# bench/paged_kv.py: llama {args.layers} layers, hidden 1024, {args.dtype}, {args.device}; "
              f"{args.new_tokens} new tokens, greedy, prefill excluded; {os.cpu_count()} cores, load {load}")
        print(f"decode tokens/s, best of {args.runs} processes x 3 runs (contiguous = {args.baseline})")
        for key in figures["paged"][0]:
            n, b, *ragged = key.split("/")
            old, new = (max(r[key] for r in figures[v]) for v in ("contiguous", "paged"))
            spread = "  ".join(f"{v} " + "/".join(f"{r[key]:.1f}" for r in figures[v]) for v in figures)
            print(f"  context {n:>4}, batch {b:>3}{' ragged' if ragged else '       '}: contiguous {old:9.1f}   paged {new:9.1f}   "
                  f"paged/contiguous {new / old:.2f}x   (each process: {spread})")
    finally:
        if args.baseline_dir is None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
