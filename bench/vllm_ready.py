"""vLLM as failover runs it (engine = "vllm"): time to ready and weight memory per instance, with
the weights from failover's cache daemon (``weights = "cache"``, ``--load-format failover``) and from
disk (``weights = "disk"``, vLLM's own loader), printed side by side.

Generates a checkpoint (the shape of ``failover tiny-model`` with the dims given). For ``cache`` it
starts the cache daemon with ``--engine vllm`` (its loader child runs vLLM's own loading once and
packs the result) and prints that pack time; then, per mode, starts ``--instances`` vLLM OpenAI
servers one after the other (the earlier ones stay up) and prints per instance: launch -> /health
200, vLLM's own "model loading" seconds, the memory of its whole process tree from /proc/PID/smaps
(RSS, PSS, private, shared) and of the daemon's arena inside it (RSS vs PSS: shared pages count
1/N in PSS), plus what the model loader copied (buffers) and repacked (``--cpu-gemm prepack``).

    python bench/vllm_ready.py [--hidden 1024 --layers 8 --instances 2] [--weights both] [--device cpu] [--tp 2]

``--tp 2``: each instance is a tp-2 vLLM (two ``VLLM::Worker_TP<r>``, gloo on CPU) and the daemon packs
one arena per rank (failover_vllm.ranks: one packer process per rank).

Runs where ``import vllm`` works (docs/vllm.md, "Tests"). ``--device cuda`` runs the same on a GPU
(the daemon packs into CUDA VMM arenas; memory per process from nvidia-smi); it has NOT been run:
vLLM for CUDA does not install on the GPU machine this project has (FACTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # noqa: E402

from failover.procs.smaps import tree_memory as arena_memory  # noqa: E402
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


FLAGS = ["--max-model-len", "512", "--enforce-eager"]
REPO = str(Path(__file__).resolve().parent.parent)
# children import the plugin (failover_vllm) and the daemon from this checkout
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))


def start(model: Path, port: int, args, log, extra: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench", "--dtype", args.dtype,
            "--kv-cache-memory-bytes", str(256 << 20), "--tensor-parallel-size", str(args.tp), *FLAGS, *extra]
    # tp > 1 on CPU: as the supervisor starts vLLM (tp 1 keeps vLLM's default, as the earlier figures had it)
    env = ENV | ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if args.device == "cpu" and args.tp > 1 else {})
    if args.device == "cuda":
        argv += ["--gpu-memory-utilization", "0.3"]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)


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


def start_daemon(model: Path, run_dir: Path, args, log) -> tuple[subprocess.Popen, float]:
    """The cache daemon with vLLM's layout; returns it and the seconds to its ready file."""
    argv = [sys.executable, "-m", "cache_daemon", "--model", str(model), "--run-dir", str(run_dir),
            "--engine", "vllm", "--device", args.device, "--dtype", args.dtype, "--progress", "off", "--tp", str(args.tp),
            *(f"--engine-arg={f}" for f in FLAGS)]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=ENV)
    while not (run_dir / "daemon.ready").exists():
        if proc.poll() is not None or time.monotonic() - t0 > args.timeout:
            raise SystemExit(f"the cache daemon did not get ready (exit {proc.returncode}); see {log.name}")
        time.sleep(0.1)
    return proc, time.monotonic() - t0


def gpu_memory(pids) -> int:
    """Device bytes used by ``pids`` (nvidia-smi; the daemon's arena is counted in none of them)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    used = {int(p): int(m) << 20 for p, m in (line.split(",") for line in out.strip().splitlines() if line)}
    return sum(used.get(pid, 0) for pid in pids)


def loading_seconds(log_path: Path) -> str:
    """vLLM's own "Loading weights took N seconds" (its disk loader; on GPUs "Model loading took")."""
    for line in log_path.read_text(errors="replace").splitlines():
        for key in ("Model loading took", "Loading weights took"):
            if key in line:
                return line.split(key, 1)[1].strip()
    return "-"


def run_mode(mode: str, model: Path, d: Path, args, sock: Path | None, weights: int) -> None:
    procs = []
    try:
        for i in range(args.instances):
            port, log_path = free_port(), d / f"vllm-{mode}-{i}.log"
            report = d / f"{mode}-{i}.weights.json"
            extra = [] if mode == "disk" else [
                "--load-format", "failover", "--model-loader-extra-config",
                json.dumps({"socket": str(sock), "report": str(report), "cpu_gemm": args.cpu_gemm})]
            with open(log_path, "wb") as log:
                proc = start(model, port, args, log, extra)
            procs.append(proc)
            ready = wait_health(port, proc, args.timeout)
            time.sleep(1.0)  # settle
            pids = group_members(proc.pid)
            mem = tree_memory(proc.pid)
            arena = arena_memory(pids)["arena"]
            line = (f"{mode:5s} instance {i}: launch -> /health {ready:.1f} s (vLLM's loader: "
                    f"{loading_seconds(log_path)}); tree ({len(pids)} processes) rss {mem['rss'] / 2**20:.0f} MiB, "
                    f"pss {mem['pss'] / 2**20:.0f} MiB, private {mem['private'] / 2**20:.0f} MiB, "
                    f"shared {mem['shared'] / 2**20:.0f} MiB")
            if args.device == "cuda":
                line += f"; GPU memory of the tree {gpu_memory(pids) / 2**20:.0f} MiB"
            if mode == "disk":
                line += f"; weights: a private copy of {weights / 2**20:.1f} MiB (0 shared)"
            else:
                info = json.loads(report.read_text())
                line += (f"; arena in this tree: rss {arena['Rss'] / 2**20:.1f} MiB, pss {arena['Pss'] / 2**20:.1f} MiB, "
                         f"private {(arena['Private_Clean'] + arena['Private_Dirty']) / 2**20:.1f} MiB; loader: "
                         f"shared {info['shared_bytes'] / 2**20:.1f} MiB, copied {info['copied_bytes'] / 2**20:.2f} MiB, "
                         f"repacked {info['repacked_bytes'] / 2**20:.1f} MiB, mapped and built in {info['seconds']:.3f} s")
            print(line, flush=True)
    finally:
        for proc in procs:
            stop(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every instance (and of the daemon's arenas)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--weights", choices=("both", "cache", "disk"), default="both")
    p.add_argument("--cpu-gemm", choices=("shared", "prepack"), default="shared",
                   help="cache on CPU: arena weights as they are (shared) or vLLM's oneDNN pre-pack (a private copy)")
    args = p.parse_args()
    print(f"# bench/vllm_ready.py {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, device {args.device}, tp {args.tp}")
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as d:
        spec = TinySpec(hidden=args.hidden, layers=args.layers, heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256),
                        head_dim=64, intermediate=args.hidden * 3, vocab=32000, max_positions=1024)
        model = write_checkpoint(Path(d) / "model", spec)
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"checkpoint: {weights / 2**20:.1f} MiB safetensors (hidden {args.hidden}, {args.layers} layers)")
        modes = ["cache", "disk"] if args.weights == "both" else [args.weights]
        daemon, sock = None, None
        try:
            if "cache" in modes:
                run_dir = Path(d) / "run"
                run_dir.mkdir(mode=0o700)
                with open(Path(d) / "daemon.log", "wb") as log:
                    daemon, seconds = start_daemon(model, run_dir, args, log)
                sock = run_dir / "daemon.sock"
                print(f"cache daemon: vLLM's own loading packed into {args.tp} arena(s) in {seconds:.1f} s (once per node, "
                      "before any instance; includes the interpreter's and vLLM's imports)", flush=True)
            for mode in modes:
                run_mode(mode, model, Path(d), args, sock, weights)
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(30)


if __name__ == "__main__":
    main()
