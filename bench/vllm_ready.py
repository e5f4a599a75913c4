"""vLLM as failover runs it (engine = "vllm"): time to ready and memory per instance, printed.

Starts ``--instances`` vLLM OpenAI servers one after the other on a generated checkpoint (the shape of
``failover tiny-model`` with the dims given), each as failover's supervisor starts it, and prints per
instance: launch -> /health 200, and the memory of its whole process tree from
/proc/PID/smaps_rollup (RSS, PSS, private and shared bytes) next to the checkpoint's size. Today every
vLLM instance loads its own weights from disk: the weights appear once per instance in ``private``.
(Weights from failover's cache daemon, shared between instances, are not built for vLLM: docs/vllm.md.)

    python bench/vllm_ready.py [--hidden 1024 --layers 8 --instances 2] [--device cpu]

Runs where ``import vllm`` works (docs/vllm.md, "Tests"). ``--device cuda`` runs the same on a GPU
(adds ``--gpu-memory-utilization``); it has not been run (vLLM for CUDA does not install on the GPU
machine this project has: FACTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from failover.procs.tree import group_members, is_tracker, mapped_shm, remove_shm  # noqa: E402
from failover.tools.tiny_model import TinySpec, write_checkpoint  # noqa: E402
from failover_common.ports import free_port  # noqa: E402


def tree_memory(pgid: int) -> dict[str, int]:
    """Summed smaps_rollup fields (bytes) of every process of group ``pgid``."""
    keys = {"Rss": "rss", "Pss": "pss", "Private_Clean": "private", "Private_Dirty": "private",
            "Shared_Clean": "shared", "Shared_Dirty": "shared"}
    total = dict.fromkeys(("rss", "pss", "private", "shared"), 0)
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    name, _, rest = line.partition(":")
                    if name in keys:
                        total[keys[name]] += int(rest.split()[0]) * 1024
        except OSError:
            continue
    return total


def start(model: Path, port: int, args, log) -> subprocess.Popen:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench", "--dtype", args.dtype,
            "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager"]
    if args.device == "cuda":
        argv += ["--gpu-memory-utilization", "0.3"]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def wait_health(port: int, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"vLLM not ready within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    shm: set[str] = set()
    for pid in group_members(proc.pid):
        shm |= mapped_shm(pid)
        if not is_tracker(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 5
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    remove_shm(shm)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    print(f"# bench/vllm_ready.py {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, device {args.device}")
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as d:
        spec = TinySpec(hidden=args.hidden, layers=args.layers, heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256),
                        head_dim=64, intermediate=args.hidden * 3, vocab=32000, max_positions=1024)
        model = write_checkpoint(Path(d) / "model", spec)
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"checkpoint: {weights / 2**20:.1f} MiB safetensors (hidden {args.hidden}, {args.layers} layers)")
        procs = []
        try:
            for i in range(args.instances):
                port = free_port()
                log = open(Path(d) / f"vllm-{i}.log", "wb")
                t0 = time.monotonic()
                proc = start(model, port, args, log)
                procs.append(proc)
                ready = wait_health(port, proc, args.timeout)
                time.sleep(1.0)  # settle
                mem = tree_memory(proc.pid)
                print(f"instance {i}: weights from disk, launch -> /health {ready:.1f} s; tree "
                      f"({len(group_members(proc.pid))} processes) rss {mem['rss'] / 2**20:.0f} MiB, "
                      f"pss {mem['pss'] / 2**20:.0f} MiB, private {mem['private'] / 2**20:.0f} MiB, "
                      f"shared {mem['shared'] / 2**20:.0f} MiB; weight bytes shared with other instances: 0 "
                      f"(private copy of {weights / 2**20:.1f} MiB)  [{time.monotonic() - t0:.1f} s]")
        finally:
            for proc in procs:
                stop(proc)


if __name__ == "__main__":
    main()
