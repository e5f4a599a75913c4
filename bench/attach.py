"""Benchmark: disk load vs. attach() from the cache daemon, on one generated checkpoint.

    python bench/attach.py                          # CPU: >= 1 GiB, >= 500 tensors
    python bench/attach.py --device cuda --gib 20   # GPU: >= 20 GiB, >= 1,000 tensors

Prints (a) ``load_shards`` to ready tensors (on the device) in this process and (b) ``attach()`` in a
fresh process against a running daemon, both times and their ratio, with machine and date. The
checkpoint was just written, so (a) reads from a warm page cache: the ratio is a lower bound of what
a cold disk gives. Not a test: nothing is asserted but correctness of a sample of tensors.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hostinfo import cpu_model  # noqa: E402
from failover.tools.tiny_model import TinySpec, hf_config, tensor_shapes  # noqa: E402

FILE_BYTES = 2 << 30  # bytes per safetensors file

def touch(tensors, device):
    """Read one byte of every 4 KiB page, so every page is resident and mapped in this process."""
    import torch

    for t in tensors.values():
        flat = t.reshape(-1).view(torch.uint8)
        if flat.numel():
            flat[::4096].sum()
    if device == "cuda":
        torch.cuda.synchronize()


CHILD = inspect.getsource(touch) + r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from cache_daemon import client, framing
from cache_daemon.fingerprint import make_config
from cache_daemon.manifest import views
from cache_daemon.protocol import MAX_FDS, Fetch, FetchReply
t_import = time.perf_counter() - t0
sock, model, dtype, device = sys.argv[1:5]
if device == "cuda":
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
client.preload(device)  # what a zygote does before it forks (imports only)
t_preload = time.perf_counter() - t1
t1 = time.perf_counter()
config = make_config(model, dtype=dtype, tp_size=1, tp_rank=0, device=device)
t2 = time.perf_counter()
w = client.attach(sock, config)
t3 = time.perf_counter()
ntensors = len(w.tensors)
touch(w.tensors, device)
t4 = time.perf_counter()
sample = {n: float(t.float().sum()) for n, t in list(w.tensors.items())[:: max(1, len(w.tensors) // 8)]}
w.close()
# the same steps again, in this now-warm process, one by one
s0 = time.perf_counter()
conn = client.Connection(sock)
s1 = time.perf_counter()
reply, fds = conn.request(Fetch(config), FetchReply, max_fds=MAX_FDS)
s2 = time.perf_counter()
maps = client._map(reply.manifest, fds)
framing.close_fds(fds)
s3 = time.perf_counter()
tensors = views(reply.manifest, [m.flat() for m in maps])
s4 = time.perf_counter()
del tensors
for m in maps:
    m.close()
conn.close()
print(json.dumps({"import_s": t_import, "preload_s": t_preload, "make_config_s": t2 - t1, "attach_s": t3 - t2,
                  "touch_s": t4 - t3, "tensors": ntensors, "sample": sample,
                  "warm_ms": {"connect_hello": 1e3 * (s1 - s0), "fetch": 1e3 * (s2 - s1), "map": 1e3 * (s3 - s2),
                              "views": 1e3 * (s4 - s3), "total": 1e3 * (s4 - s0)}}), flush=True)
"""


def spec_for(gib: float, min_tensors: int, dtype: str) -> TinySpec:
    """A Llama-shaped spec of about ``gib`` GiB with at least ``min_tensors`` tensors."""
    hidden, inter, heads, kv, vocab = (1024, 2816, 16, 8, 32000) if gib < 8 else (2560, 8192, 20, 4, 32000)
    spec = TinySpec(hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, vocab=vocab, layers=1,
                    dtype=dtype, max_positions=4096)
    per_layer = sum(math.prod(s) for n, s in tensor_shapes(spec).items() if ".layers.0." in n) * 2
    fixed = 2 * vocab * hidden * 2
    layers = max(math.ceil((gib * 2**30 - fixed) / per_layer), math.ceil((min_tensors - 3) / 9))
    return TinySpec(hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, vocab=vocab, layers=layers,
                    dtype=dtype, max_positions=4096)


def write_model(out: Path, spec: TinySpec, device: str) -> tuple[int, int]:
    """Write config.json and random tensors in ~2 GiB files with an index; (bytes, tensors)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(spec)
    dtype = getattr(torch, spec.dtype)
    groups, current, size = [], {}, 0
    for name, shape in shapes.items():
        current[name] = shape
        size += math.prod(shape) * 2
        if size >= FILE_BYTES:
            groups.append(current)
            current, size = {}, 0
    if current:
        groups.append(current)
    weight_map, total = {}, 0
    gen = torch.Generator(device=device).manual_seed(0)  # random numbers on the GPU when there is one: fast
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: torch.empty(s, dtype=dtype, device=device).uniform_(-0.05, 0.05, generator=gen).cpu()
                   for n, s in group.items()}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= {n: fname for n in group}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(hf_config(spec)))
    return total, len(shapes)


def evict_page_cache(model: Path) -> None:
    """Drop this checkpoint's pages from the page cache (POSIX_FADV_DONTNEED), for a cold read."""
    os.sync()
    for f in model.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_load(model: Path, dtype: str, device: str, cold: bool) -> tuple[float, dict]:
    """load_shards, then on cuda a copy to the GPU, on cpu a read of every page (safetensors maps the
    file lazily: without it the bytes would not be in memory yet)."""
    from cache_daemon.checkpoint import load_shards

    if cold:
        evict_page_cache(model)
    t0 = time.perf_counter()
    tensors = load_shards(model, dtype=dtype, tp_size=1, tp_rank=0)
    if device == "cuda":
        tensors = {n: t.to("cuda", non_blocking=False) for n, t in tensors.items()}
    touch(tensors, device)
    dt = time.perf_counter() - t0
    return dt, tensors


def machine(device: str) -> str:
    cpu = cpu_model()
    out = f"{platform.node()} | {os.cpu_count()} cores {cpu} | python {platform.python_version()}"
    import torch

    out += f" | torch {torch.__version__}"
    if device == "cuda":
        out += f" | {torch.cuda.get_device_name(0)}"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--gib", type=float, default=None, help="checkpoint size (default 1.1 cpu, 20.5 cuda)")
    p.add_argument("--min-tensors", type=int, default=None, help="default 500 cpu, 1000 cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--dir", type=Path, default=None, help="checkpoint dir (kept); default: a temp dir")
    p.add_argument("--attach-runs", type=int, default=3, help="fresh processes to time attach() in")
    a = p.parse_args()
    gib = a.gib or (1.1 if a.device == "cpu" else 20.5)
    min_tensors = a.min_tensors or (500 if a.device == "cpu" else 1000)
    tmp = Path(tempfile.mkdtemp(prefix="fo-bench-", dir="/tmp"))
    model = a.dir or tmp / "model"
    run_dir = tmp / "run"
    daemon = None
    try:
        print(f"# bench/attach.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
        print(f"# machine: {machine(a.device)}")
        spec = spec_for(gib, min_tensors, a.dtype)
        t0 = time.perf_counter()
        if (model / "config.json").exists():
            nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
            ntensors = len(tensor_shapes(spec))
        else:
            nbytes, ntensors = write_model(model, spec, a.device)
        print(f"# checkpoint: {nbytes / 2**30:.2f} GiB, {ntensors} tensors, {a.dtype}, {spec.layers} layers "
              f"(hidden {spec.hidden}, intermediate {spec.intermediate}); written in {time.perf_counter() - t0:.1f} s")

        # (b) first, so the daemon's load and (a) do not share the page cache twice in memory
        t0 = time.perf_counter()
        daemon = subprocess.Popen([sys.executable, "-m", "cache_daemon", "--model", str(model), "--device", a.device,
                                   "--dtype", a.dtype, "--run-dir", str(run_dir), "--log-level", "warning"],
                                  cwd=REPO, start_new_session=True)
        ready = run_dir / "daemon.ready"
        while not ready.exists():
            if daemon.poll() is not None:
                raise SystemExit(f"daemon exited with {daemon.returncode}")
            time.sleep(0.05)
        daemon_load = time.perf_counter() - t0
        print(f"daemon start to ready (loader: read + pack {nbytes / 2**30:.2f} GiB): {daemon_load:.2f} s")
        runs = []
        for _ in range(a.attach_runs):
            out = subprocess.run([sys.executable, "-c", CHILD, str(run_dir / "daemon.sock"), str(model), a.dtype,
                                  a.device], cwd=REPO, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out))
        attach_s = min(r["attach_s"] for r in runs)
        each = ", ".join(f"{r['attach_s'] * 1e3:.2f}" for r in runs)
        print(f"(b) attach() in a fresh process: {attach_s * 1e3:.2f} ms (best of {len(runs)}: "
              f"{each} ms; {runs[0]['tensors']} tensors; "
              f"make_config {runs[0]['make_config_s'] * 1e3:.1f} ms, import torch+client {runs[0]['import_s']:.2f} s, "
              f"preload {runs[0]['preload_s'] * 1e3:.0f} ms: not included)")
        warm = {k: round(min(r["warm_ms"][k] for r in runs), 2) for k in runs[0]["warm_ms"]}
        print(f"(b) again in the same (warm) process, step by step, ms: {warm}")

        touch_s = min(r["touch_s"] for r in runs)
        print(f"(b') attach() + first touch of every page: {(attach_s + touch_s) * 1e3:.1f} ms")
        results = {}
        for cold in (True, False):
            disk_s, tensors = disk_load(model, a.dtype, a.device, cold)
            label = "cold page cache (fadvise DONTNEED)" if cold else "warm page cache"
            results[label] = disk_s
            print(f"(a) disk load to ready tensors on {a.device}, {label}: {disk_s:.2f} s "
                  f"({nbytes / disk_s / 1e9:.2f} GB/s)")
            if cold:
                del tensors
        sample = runs[0]["sample"]
        ok = all(abs(float(tensors[n].float().sum()) - v) <= 1e-3 * max(1.0, abs(v)) for n, v in sample.items())
        del tensors
        print(f"sampled tensors equal between attach and disk: {ok}")
        for label, disk_s in results.items():
            print(f"ratio disk ({label}) / attach: {disk_s / attach_s:,.0f}x;  "
                  f"/ (attach + touch): {disk_s / (attach_s + touch_s):,.0f}x")
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
