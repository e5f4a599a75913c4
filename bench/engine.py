"""Benchmark of the reference engine: time-to-ready with weights mapped from the cache daemon vs read
from disk, and decode throughput against transformers' ``generate`` on the same model and machine.

    python3 bench/engine.py                      # CPU, a >= 1 GiB fp32 checkpoint
    python3 bench/engine.py --device cuda --size-gib 8 --dtype bfloat16
    python3 bench/engine.py --device cuda --shape llama3-8b --tp 2 --skip-ready   # + tp=2 vs tp=1 decode

Time-to-ready is measured from spawning ``failover engine`` to the first 200 from ``/ready`` (so it
includes the interpreter and ``import torch``, which the supervisor's zygote removes); the engine's
own ``weights_seconds`` and ``startup_seconds`` (from its /ready body) are printed beside it. Disk
runs are measured warm (checkpoint in the page cache) and cold (pages dropped with
``posix_fadvise(DONTNEED)`` first). On CPU a safetensors load is itself a mapping of the page cache and
the engine prefaults both sources (MADV_POPULATE_READ), so cache and disk differ little there; the
copy that the cache saves is the host-to-device one on CUDA. Decode tokens/s are measured in process for both engines as
``B * (T - 1) / time from the first generated token to the last`` (median of 3), i.e. without the
prefill; transformers' first token is timed through ``generate``'s streamer hook.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hostinfo import cpu_model  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="checkpoint dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size to reach (>= 1 for the target)")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint dir (default: a temp dir, removed after)")
    p.add_argument("--runs", type=int, default=3, help="time-to-ready runs per source (median reported)")
    p.add_argument("--shape", choices=["sized", "llama3-8b"], default="sized",
                   help="sized: hidden 1024, layers to reach --size-gib; llama3-8b: Llama-3-8B's shapes "
                        "(32 layers, hidden 4096, 8 kv heads, vocab 128256; ~15 GiB bf16)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--ttft-prompt-len", type=int, default=1024, help="prompt of the time-to-first-token figure")
    p.add_argument("--ttft-batch", type=int, default=8, help="prompts together in the second TTFT figure")
    p.add_argument("--kv-gib", type=int, default=16, help="KV pool of the in-process engine")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    p.add_argument("--separate-projections", action="store_true",
                   help="one GEMM per q/k/v and gate/up projection (weights copied one by one), to compare "
                        "with the fused default (engine.fusion)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-ready", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="N > 1: also decode through a --tp N server against a "
                   "--tp 1 one (bench/engine_tp.py; CUDA: one GPU per rank, CPU: gloo)")
    p.add_argument("--tp-batches", default="1,32", help="batches of the --tp comparison")
    return p.parse_args(argv)


def make_spec(size_gib: float, dtype: str, shape: str = "sized"):
    from failover.tools.tiny_model import TinySpec, tensor_shapes

    if shape == "llama3-8b":
        return TinySpec(arch="llama", hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                        layers=32, max_positions=4096, dtype=dtype, shards=4)

    base = dict(arch="llama", hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=32000,
                max_positions=1024, dtype=dtype, shards=4)
    elem = 4 if dtype == "float32" else 2
    numels = _numels(tensor_shapes(TinySpec(layers=1, **base)))
    per_layer = sum(v for k, v in numels.items() if ".layers." in k)
    fixed = sum(v for k, v in numels.items() if ".layers." not in k)
    layers = max(1, -(-(int(size_gib * (1 << 30)) // elem - fixed) // per_layer))
    return TinySpec(layers=layers, **base)


def _numels(shapes):
    out = {}
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        out[name] = n
    return out


def checkpoint_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def drop_page_cache(model: Path) -> None:
    for f in model.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def free_port() -> int:
    from failover_common.ports import free_port as pick

    return pick()


def get_ready(port: int):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def engine_cmd(model: Path, args, source: str, socket: Path | None, port: int) -> list[str]:
    cmd = ["--model", str(model), "--port", str(port), "--weights", source, "--device", args.device,
           "--kv-memory", "64MiB" if args.device == "cpu" else "4GiB", "--max-batch", "4"]
    return cmd + (["--socket", str(socket)] if socket else [])


def wait_ready(port: int, alive) -> dict:
    while True:
        if not alive():
            raise SystemExit("the engine exited before it was ready; see the bench log")
        body = get_ready(port)
        if body and body.get("ready"):
            return body
        time.sleep(0.005)


def time_to_ready(model: Path, args, source: str, socket: Path | None, log: Path) -> dict:
    """A cold start: a new interpreter runs ``failover engine``."""
    port = free_port()
    cmd = [sys.executable, "-m", "failover", "engine", *engine_cmd(model, args, source, socket, port)]
    with open(log, "ab") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        try:
            body = wait_ready(port, lambda: proc.poll() is None)
            return {"ready_s": time.perf_counter() - start, "weights_s": body["weights_seconds"],
                    "startup_s": body["startup_seconds"]}
        finally:
            proc.terminate()
            proc.wait(30)


def time_to_ready_forked(model: Path, args, source: str, socket: Path | None, log: Path) -> dict:
    """The supervisor's path: fork a process that already imported engine.cli (and torch), call main."""
    import signal

    import engine.cli  # noqa: F401 - the zygote's preload; starts no thread, loop or CUDA

    port = free_port()
    argv = engine_cmd(model, args, source, socket, port)
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 2)
        os._exit(engine.cli.main(argv))

    def alive() -> bool:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)

    try:
        body = wait_ready(port, alive)
        return {"ready_s": time.perf_counter() - start, "weights_s": body["weights_seconds"],
                "startup_s": body["startup_seconds"]}
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)


def start_daemon(model: Path, args, run_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cache_daemon", "--model", str(model), "--run-dir", str(run_dir),
           "--device", args.device, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
    start = time.perf_counter()
    while not (run_dir / "daemon.ready").exists():
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited {proc.returncode}; see {log}")
        time.sleep(0.05)
    print(f"daemon loaded the checkpoint in {time.perf_counter() - start:.2f} s (once per node)")
    return proc


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def bench_ready(model: Path, args, work: Path) -> dict:
    log = work / "bench-engine.log"
    run_dir = Path(tempfile.mkdtemp(prefix="fo-bench-", dir="/tmp"))
    os.chmod(run_dir, 0o700)
    daemon = start_daemon(model, args, run_dir, log)
    results = {}
    try:
        sock = run_dir / "daemon.sock"
        plans = [("cache", "cache", sock, False), ("disk (warm page cache)", "disk", None, False),
                 ("disk (cold: pages dropped)", "disk", None, True)]
        for how, fn in (("new process", time_to_ready), ("forked, pre-imported", time_to_ready_forked)):
            for label, source, socket, cold in plans:
                runs = []
                for _ in range(args.runs):
                    if cold:
                        drop_page_cache(model)
                    runs.append(fn(model, args, source, socket, log))
                results[(how, label)] = {k: median([r[k] for r in runs]) for k in runs[0]}
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def gpu_name() -> str:
    """From nvidia-smi: this process must not create a CUDA context before it forks engines."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{out[0]} (x{len(out)})" if out else "unknown"


def machine(args) -> str:
    cpu = cpu_model()
    import torch

    gpu = f", GPU {gpu_name()}" if args.device == "cuda" else ""
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads){gpu}, Python {platform.python_version()}, load avg {load}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    from failover.tools.tiny_model import write_checkpoint

    work = args.dir or Path(tempfile.mkdtemp(prefix="fo-bench-engine-"))
    spec = make_spec(args.size_gib, args.dtype, args.shape)
    model = work / "model"
    if not (model / "config.json").exists():
        t = time.perf_counter()
        write_checkpoint(model, spec)
        print(f"wrote checkpoint in {time.perf_counter() - t:.1f} s")
    size = checkpoint_bytes(model)
    print(f"# command: {' '.join([sys.executable, *sys.argv])}")
    print(f"# bench/engine.py  {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"machine: {machine(args)}")
    print(f"model: llama, {spec.layers} layers, hidden {spec.hidden}, vocab {spec.vocab}, {args.dtype}, "
          f"{size / (1 << 30):.2f} GiB in {spec.shards} files; device {args.device}")
    try:
        if not args.skip_ready:
            ready = bench_ready(model, args, work)
            print(f"\ntime to ready (median of {args.runs}): spawn or fork -> /ready 200; 'weights' = map or read;"
                  f" 'in-process startup' = port open -> ready, incl. warm-up")
            for (how, label), r in ready.items():
                print(f"  {how:<21} {label:<27} ready {r['ready_s']:7.3f} s   weights {r['weights_s']:7.3f} s   "
                      f"in-process startup {r['startup_s']:7.3f} s")
            if args.device == "cpu":
                print("  (cpu: both sources end as mappings of resident pages; 'weights' includes prefaulting them)")
            for how in ("new process", "forked, pre-imported"):
                c = ready[(how, "cache")]
                for label in ("disk (warm page cache)", "disk (cold: pages dropped)"):
                    d = ready[(how, label)]
                    print(f"  ratio {how}, {label} / cache: ready {d['ready_s'] / c['ready_s']:.2f}x, "
                          f"weights {d['weights_s'] / c['weights_s']:.1f}x")
        if not args.skip_decode:
            from engine_decode import bench_decode, print_decode

            print_decode(bench_decode(model, args), args)
        if args.tp > 1:
            from engine_tp import bench_tp_decode, print_tp_decode

            print_tp_decode(bench_tp_decode(model, args, work), args)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
