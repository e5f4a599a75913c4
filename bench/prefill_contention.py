"""What slows a CUDA engine's small prefill: idle, a neighbour's kill -9, or a neighbour's start.

    python3 bench/prefill_contention.py --layers 16 --idle 15      # H200: about 2 min with the checkpoint

A promoted standby's first prefill steps took ~100 ms in bench/gpu_e2e.py, against 40-50 ms for the
same steps on a warm engine. This bench times one in-process engine's 1x20-token prefill (the shape
of a migrated stream's re-prefill) under each suspect in turn, on Llama-3-8B shapes with ``--layers``
layers: after ``--idle`` s of idle (and with a keep-warm prefill every 1 s or 0.2 s); right after
``kill -9`` of a neighbour process holding 16 GiB and a busy matmul loop (the driver tearing down
its context); while a neighbour starts (a CUDA context, a 2 GiB allocation and matmuls, or only
``import torch``). Run it alone on the GPU: every figure is wall time of the step, synchronised.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HOLDER = ("import torch,sys; x=torch.empty(int(sys.argv[1])<<30, dtype=torch.uint8, device='cuda'); x.fill_(1); "
          "y=torch.randn(4096,4096,device='cuda'); torch.cuda.synchronize(); print('ready', flush=True)\n"
          "while True:\n    y=y@y; y=y/y.norm(); torch.cuda.synchronize()")
STARTERS = {"CUDA context": "import torch; torch.empty(1, device='cuda'); torch.cuda.synchronize()",
            "context + 2 GiB + matmuls": "import torch; x=torch.empty(2<<30, dtype=torch.uint8, device='cuda'); "
                                         "x.fill_(1); y=torch.randn(4096,4096,device='cuda'); [y@y for _ in range(50)]; "
                                         "torch.cuda.synchronize()",
            "import torch only": "import torch"}


class Prefill:
    """One engine (engine_profile's build) and a timed 1xN prefill on fixed blocks."""

    def __init__(self, model: Path, tokens: int) -> None:
        import engine_profile  # bench/ is on sys.path as this script's folder

        a = SimpleNamespace(model=model, dtype="bfloat16", max_batch=16, kv_gib=2.0, prompt_len=128, context=128)
        self.engine, self.runner = engine_profile.build(a, [])
        from engine.model_runner import StepPlan

        blocks = -(-tokens // self.runner.kv.block_size)
        self.plan = StepPlan("prefill", (tuple(3 + j % 300 for j in range(tokens)),),
                             block_tables=(tuple(range(blocks)),))

    def once(self) -> float:
        import torch

        torch.cuda.synchronize()
        t = time.perf_counter()
        self.runner.run(self.plan)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    def warm(self, n: int = 8) -> float:
        return sorted(self.once() for _ in range(n))[n // 2]


def fmt(xs) -> str:
    return ", ".join(f"{x:.1f}" for x in xs)


def idle_rounds(p: Prefill, idle: float) -> None:
    print(f"warm: median {p.warm():.1f} ms")
    time.sleep(idle)
    print(f"after {idle:.0f} s idle, 3 steps: {fmt(p.once() for _ in range(3))} ms (then warm {p.warm():.1f})")
    for every in (1.0, 0.2):
        end = time.monotonic() + idle
        while time.monotonic() < end:
            time.sleep(every)
            p.once()
        print(f"after {idle:.0f} s with a prefill every {every} s: {fmt(p.once() for _ in range(3))} ms")


def kill_rounds(p: Prefill, rounds: int) -> None:
    for _ in range(rounds):
        ch = subprocess.Popen([sys.executable, "-c", HOLDER, "16"], stdout=subprocess.PIPE, text=True)
        try:
            assert ch.stdout.readline().strip() == "ready", "the neighbour did not start"
            time.sleep(1.0)
            beside = p.warm()
            ch.send_signal(signal.SIGKILL)
            t0, steps, reaped = time.perf_counter(), [], None
            while time.perf_counter() - t0 < 0.3:
                ms = p.once()
                steps.append(ms)
                if reaped is None and ch.poll() is not None:
                    reaped = (time.perf_counter() - t0) * 1e3
        finally:
            ch.kill()
            ch.wait()
        print(f"neighbour (16 GiB, busy) kill -9: step {beside:.1f} ms beside it; reaped after {reaped or 0:.0f} ms; "
              f"steps in the 300 ms after the kill: median {sorted(steps)[len(steps) // 2]:.1f} max {max(steps):.1f} ms")
        time.sleep(1.0)


def start_rounds(p: Prefill, rounds: int) -> None:
    for name, code in list(STARTERS.items()) * rounds:
        warm = p.warm()
        ch = subprocess.Popen([sys.executable, "-c", code])
        t0, steps = time.perf_counter(), []
        try:
            while ch.poll() is None and time.perf_counter() - t0 < 10:
                steps.append(p.once())
        finally:
            ch.kill()
            ch.wait()
        s = sorted(steps) or [0.0]
        print(f"neighbour start ({name}, {(time.perf_counter() - t0) * 1e3:.0f} ms): warm {warm:.1f} ms; during it "
              f"median {s[len(s) // 2]:.1f} max {s[-1]:.1f} ms over {len(steps)} steps")
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/fo-prefill-contention"), help="checkpoint dir (kept)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--idle", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    model = a.dir / f"llama3-8b-{a.layers}l"
    if not (model / "config.json").exists():
        write_checkpoint(model, TinySpec(arch="llama", hidden=4096, heads=32, kv_heads=8, intermediate=14336,
                                         vocab=128256, layers=a.layers, max_positions=4096, dtype="bfloat16", shards=4))
    import torch

    print(f"# {' '.join([sys.executable, *sys.argv])}  {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; Llama-3-8B shapes x {a.layers} layers, "
          f"1x{a.tokens}-token prefill")
    p = Prefill(model, a.tokens)
    idle_rounds(p, a.idle)
    kill_rounds(p, a.rounds)
    start_rounds(p, a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
