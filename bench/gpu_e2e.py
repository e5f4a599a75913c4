"""The whole stack on one CUDA GPU, on a checkpoint with a real architecture's shapes.

    python3 bench/gpu_e2e.py                       # Llama-3-8B shapes, 48 layers: ~21.4 GiB bf16
    python3 bench/gpu_e2e.py --layers 32 --dir /data/l8b   # the 8B itself (15 GiB), kept in /data/l8b

Generates a random-weight checkpoint (hidden 4096, 32 heads, 8 KV heads, intermediate 14336, vocab
128256) unless --dir already holds one, brings up a node (the same Supervisor as ``failover up``:
cache daemon, zygote, primary + hot standby, router, optionally a batch service), and measures:
daemon load time and GB/s; each engine's attach time; device memory of primary + standby (weights
must be counted once); crash failover blackout under load; zygote relaunch to ready; batch
preemption (trigger to process gone and its pid off the GPU); and the write fault of a read-only
mapping (the writer dies, the resident bytes do not change). Prints one report of key=value lines.

    python3 bench/gpu_e2e.py --layers 32 --batch-items 0 --faults 20   # 20 kill -9s: p50/p99/max
    python3 bench/gpu_e2e.py --device cpu --faults 20                  # the same on the tiny model
    python3 bench/gpu_e2e.py --tp 2 --layers 32 --batch-items 100      # tp=2 on two GPUs (bench/gpu_e2e_tp.py)

The failover figures are the clients' (bench/gpu_e2e_faults.py, bench/client_figures.py), from each
kill: p50/p99/max over ``--faults`` kills of the first token to any client, the worst in-flight
client's wait for its next token and the longest stall inside a stream, with failed and broken
counts; the router's own record beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from attach import write_model  # noqa: E402
from gpu_e2e_faults import failover_rounds, log_events  # noqa: E402
import gpu_e2e_tp as tp_figures  # noqa: E402

from failover_common.logs import configure_logging  # noqa: E402
from failover.config.schema import parse_config  # noqa: E402
from failover.cmd.demo import free_port_pair  # noqa: E402
from failover.tools.tiny_model import TinySpec, write_tokenizer  # noqa: E402

WRITER = r"""
import sys, torch
from cache_daemon.client import attach
from cache_daemon.fingerprint import make_config
w = attach(sys.argv[1], make_config(sys.argv[2], dtype=sys.argv[3], tp_size=int(sys.argv[5]), tp_rank=0, device=sys.argv[4]))
t = w.tensors["model.norm.weight"]
before = float(t.float().sum())
print("checksum", before, flush=True)
t.fill_(0.0)  # the mapping is PROT_READ: this must fault in this process only
if sys.argv[4] == "cuda":
    torch.cuda.synchronize()
print("WRITE WENT THROUGH", float(t.float().sum()), flush=True)
"""

READER = r"""
import sys
from cache_daemon.client import attach
from cache_daemon.fingerprint import make_config
w = attach(sys.argv[1], make_config(sys.argv[2], dtype=sys.argv[3], tp_size=int(sys.argv[5]), tp_rank=0, device=sys.argv[4]))
print("checksum", float(w.tensors["model.norm.weight"].float().sum()), flush=True)
"""


def nvsmi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_used_mib() -> int:
    return int(nvsmi("gpu=memory.used")[0][0]) if CUDA else 0


def rss_bytes(pid: int | None) -> int:
    """VmRSS of ``pid`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, TypeError):
        return 0


CUDA = True  # --device cpu runs the same steps on the tiny model (a smoke test of this script)
PNG: Path | None = None  # --png: the crash round's timeline


def make_checkpoint(d: Path, layers: int) -> int:
    spec = TinySpec(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, layers=layers,
                    dtype="bfloat16", max_positions=8192)
    nbytes, ntensors = write_model(d, spec, "cuda")
    write_tokenizer(d, 512)
    print(f"checkpoint_written dir={d} gib={nbytes / 2**30:.2f} tensors={ntensors}", flush=True)
    return nbytes


def cpus_of(pid: int) -> str:
    """The CPUs ``pid`` may run on, as the kernel writes them (or why not: a sandbox may not say)."""
    from failover_common import cpus
    try:
        return cpus.text(os.sched_getaffinity(pid))
    except OSError as e:
        return f"unknown ({e})"


def node_config(a, run: Path, model: Path, batch_in: Path | None):
    rport, eport = free_port_pair(), free_port_pair()
    while eport in (rport, rport + 1) or eport + 1 == rport:
        eport = free_port_pair()
    services = [{"name": "chat", "standbys": 1, "kv_memory": a.kv_memory, "port": eport, "priority": 100,
                 **({"cpu_threads": a.cpu_threads} if a.cpu_threads else {})}]
    if batch_in is not None:
        services.append({"name": "offline", "kind": "batch", "standbys": 0, "kv_memory": a.batch_kv_memory,
                         "priority": 10, "port": free_port_pair(),
                         "batch": {"input": str(batch_in), "output": str(batch_in.with_suffix(".out.jsonl"))}})
    return parse_config({
        "run_dir": str(run), "model": {"path": str(model), "dtype": a.dtype, "device": a.device, "tp": a.tp},
        "router": {"port": rport, "probe_interval": 0.1, "probe_timeout": 0.25,
                   **({"cpus": a.router_cpus} if a.router_cpus else {})},
        # the bench's kills, spaced by --settle, are independent faults, not a crash loop: the window
        # is shorter than their spacing, so each replacement starts at once instead of backing off
        "supervisor": {"launch": "zygote", "log_level": "info", "ready_timeout": 900.0,
                       **({"crash_loop_window": 0.5} if a.faults > 1 else {}),
                       "daemon_ready_timeout": 1800.0},
        "service": services,
    }, source="gpu-e2e")


async def measure(a, work: Path, model: Path, nbytes: int, report: dict) -> None:
    from failover.node.supervisor import Supervisor

    batch_in = None
    if a.batch_items:
        batch_in = work / "batch.jsonl"
        batch_in.write_text("".join(json.dumps({"id": f"b{i}", "prompt": [1 + i % 400, 7, 9, 11],
                                                "max_tokens": 64, "temperature": 0}) + "\n"
                                    for i in range(a.batch_items)))
    config = node_config(a, work / "run", model, batch_in)
    node_log = work / "node.log"
    base_mib = gpu_used_mib()
    base_per_gpu = tp_figures.gpu_used_per_gpu(nvsmi) if CUDA and a.tp > 1 else {}
    report["tp"] = a.tp
    with open(node_log, "wb") as out:
        sup = Supervisor(config, child_output=out)
        t0 = time.monotonic()
        try:
            await sup.start()
            report["node_up_s"] = round(time.monotonic() - t0, 2)
            if sup.placement:  # router.cpus, and what each process the node started runs on
                report["cpus"] = sup.placement | {f"{s.name}_cpus": cpus_of(s.pid) for s in sup.slots.values() if s.pid}
            loaded = log_events(node_log, "rank_loaded")
            if loaded:
                report["daemon_load_s"] = loaded[0].get("seconds")
                report["daemon_load_gbps"] = loaded[0].get("gbps")
            chat = [s for s in sup.slots.values() if s.service == "chat"]
            for s in chat:
                report[f"{s.name}_weights_source"] = s.ready_info.get("weights_source")
                report[f"{s.name}_attach_ms"] = round(1e3 * float(s.ready_info.get("weights_seconds") or 0), 1)
                report[f"{s.name}_launch_to_ready_ms"] = round(1e3 * (s.ready_at - s.launched_at), 1)
            await asyncio.sleep(1.0)
            report["weights_gib"] = round(nbytes / 2**30, 2)
            victim_ranks = tp_startup(a, sup, node_log, model, nbytes, base_per_gpu, report) if a.tp > 1 else []
            if not CUDA:  # each engine's resident memory (the mapped weights shared) and its KV pool
                for s in chat:
                    report[f"{s.name}_rss_mib"] = round(rss_bytes(s.pid) / 2**20, 1)
                    report[f"{s.name}_kv_pool_mib"] = round((s.kv_bytes or 0) / 2**20, 2)
            if CUDA and a.tp == 1:
                # Engines' own allocations (context, KV pool) are charged to their pids; the arenas
                # belong to no live process (the loader that made them exited; the daemon holds fds),
                # so whatever the node uses beyond the per-process sums is the resident weights.
                used = gpu_used_mib() - base_mib
                apps = nvsmi("compute-apps=pid,used_memory")
                per_process = sum(int(mib) for _, mib in apps)
                report["gpu_used_by_node_gib"] = round(used / 1024, 2)
                report["gpu_used_by_engine_processes_gib"] = round(per_process / 1024, 2)
                report["gpu_not_charged_to_a_process_gib"] = round((used - per_process) / 1024, 2)
                report["weights_counted_once"] = int((used - per_process) * 2**20 < 1.5 * nbytes)
                report["gpu_apps"] = ";".join("/".join(r) for r in apps)
                by_pid = {str(s.pid): s for s in sup.slots.values() if s.pid}
                for pid, mib in apps:  # each engine's share: its CUDA context plus its KV pool
                    s = by_pid.get(pid)
                    if s is not None:
                        report[f"{s.name}_gpu_gib"] = round(int(mib) / 1024, 2)
                        report[f"{s.name}_kv_pool_gib"] = round((s.kv_bytes or 0) / 2**30, 2)
                if not a.batch_items:  # the standby-memory target: weights once + primary KV + 3 GiB
                    kv = config.service[0].kv_memory_bytes
                    limit = nbytes + kv + 3 * 2**30
                    report["node_limit_gib"] = round(limit / 2**30, 2)
                    report["node_within_limit"] = int(used * 2**20 <= limit)
            await failover_rounds(sup, report, faults=a.faults, warmup=a.warmup, settle=a.settle, png=PNG)
            if victim_ranks:
                report["tp_first_victim_ranks_left"] = tp_figures.ranks_left(victim_ranks)
            if batch_in is not None:
                batch_ranks = tp_figures.ranks_of(next(s.pid for s in sup.slots.values() if s.service == "offline"))
                await preempt_round(sup, report, a)
                if a.tp > 1:
                    report["preempt_ranks"] = len(batch_ranks)
                    report["preempt_ranks_left"] = tp_figures.ranks_left(batch_ranks)
            write_fault(sup, model, report)
        finally:
            await sup.stop()


def tp_startup(a, sup, node_log: Path, model: Path, nbytes: int, base_per_gpu: dict, report: dict) -> list[int]:
    """--tp N: per-rank load and attach, each instance's ranks, memory per GPU (or per rank on CPU);
    returns the ranks of the primary, which the first crash round kills."""
    tp_figures.rank_loads(node_log, report)
    tp_figures.attach_per_rank(sup.config.run_path / "daemon.sock", model, a.dtype, a.device, a.tp, report)
    ranks = tp_figures.instance_ranks(sup, "chat", report, rss_bytes)
    if CUDA:
        tp_figures.node_memory_per_gpu(nvsmi, base_per_gpu, sup, nbytes, a.tp, report)
    return ranks.get(sup.router.services["chat"].routable().name, [])


async def preempt_round(sup, report: dict, a) -> None:
    await asyncio.sleep(a.batch_run)
    slot = next(s for s in sup.slots.values() if s.service == "offline")
    pid = slot.pid
    if pid is None or slot.state != "running":
        report["preempt"] = f"skipped: batch slot is {slot.state} (finished already?)"
        return
    t = time.monotonic()
    await sup.router.preempt("offline")
    while pid is not None and Path(f"/proc/{pid}").exists():
        await asyncio.sleep(0.001)
    gone = time.monotonic()
    while CUDA and any(r[0] == str(pid) for r in nvsmi("compute-apps=pid")):
        await asyncio.sleep(0.01)
    report["preempt_process_gone_ms"] = round(1e3 * (gone - t), 1)
    report["preempt_memory_free_ms"] = round(1e3 * (time.monotonic() - t), 1)
    t = time.monotonic()
    await sup.router.resume("offline")
    while not (slot.state == "running" and slot.ready_at and slot.ready_at > t):
        await asyncio.sleep(0.005)
        if time.monotonic() - t > 120:
            raise TimeoutError("the batch engine did not come back within 120 s")
    report["resume_to_ready_ms"] = round(1e3 * (slot.ready_at - t), 1)


def write_fault(sup, model: Path, report: dict) -> None:
    sock = str(sup.config.run_path / "daemon.sock")
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    args = [sock, str(model), sup.config.model.dtype, sup.config.model.device, str(sup.config.model.tp)]
    w = subprocess.run([sys.executable, "-c", WRITER, *args], capture_output=True, text=True, env=env)
    r = subprocess.run([sys.executable, "-c", READER, *args], capture_output=True, text=True, env=env)
    before = [line for line in w.stdout.splitlines() if line.startswith("checksum")]
    after = [line for line in r.stdout.splitlines() if line.startswith("checksum")]
    report["write_fault_writer_rc"] = w.returncode
    report["write_fault_went_through"] = int("WRITE WENT THROUGH" in w.stdout)
    report["write_fault_data_unchanged"] = int(bool(before) and before == after)
    report["write_fault_error"] = (w.stderr.strip().splitlines() or ["-"])[-1][:160]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="checkpoint dir (generated if it has no config.json)")
    p.add_argument("--layers", type=int, default=48, help="48: ~21.4 GiB; 32: the 8B's 15 GiB")
    p.add_argument("--kv-memory", default="16GiB")
    p.add_argument("--batch-kv-memory", default="8GiB")
    p.add_argument("--batch-items", type=int, default=None, help="0: no batch service (default: 400; 60 on cpu)")
    p.add_argument("--batch-run", type=float, default=5.0, help="seconds of batch work before the preemption")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke test on the tiny model")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per instance (one GPU each; "
                   "on CPU: gloo ranks, a plumbing check)")
    p.add_argument("--cpu-threads", type=int, default=0, metavar="N",
                   help="the chat service's service.cpu_threads (0: the supervisor's default)")
    p.add_argument("--router-cpus", default="", metavar="LIST",
                   help="router.cpus: the supervisor (here: this process, its router and the clients) on LIST, "
                        "every process the node starts on the other CPUs (default: the kernel's placement)")
    p.add_argument("--faults", type=int, default=1, help="kill -9s of the primary under load (20: p50/p99/max)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds of load between a round's ready standby and the next kill (2 on CUDA, 1 on CPU)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before the first kill (12 on CUDA, 2 on CPU)")
    p.add_argument("--save-log", type=Path, default=None, help="copy the node's log (every process) here")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"],
                   help="this process's log (its router, clients): info prints each migration and role change")
    p.add_argument("--png", type=Path, default=None, help="write a PNG timeline of the crash round here "
                   "(needs matplotlib: the [plots] extra)")
    a = p.parse_args()
    global CUDA, PNG
    PNG = a.png
    CUDA = a.device == "cuda"
    a.dtype = "bfloat16" if CUDA else "float32"
    if a.faults < 1:
        p.error("--faults must be at least 1")
    if a.tp < 1:
        p.error("--tp must be at least 1")
    a.settle = (2.0 if CUDA else 1.0) if a.settle is None else a.settle
    a.warmup = (12.0 if CUDA else 2.0) if a.warmup is None else a.warmup
    if not CUDA:
        a.kv_memory, a.batch_kv_memory = "32MiB", "32MiB"
    if a.batch_items is None:  # given explicitly, it is kept (a tp=2 CPU run needs a batch that outlasts the kills)
        a.batch_items = 60 if not CUDA else 400
    configure_logging(a.log_level, process="gpu-e2e")
    import torch  # no CUDA context here: it would be charged to this process and skew the memory figures

    gpu = nvsmi("gpu=name")[0][0] if CUDA else "cpu (smoke test)"
    print(f"# gpu_e2e  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}Z  {platform.node()}  "
          f"{gpu}  torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fo-gpu-") as tmp:
        work = Path(tmp)
        model = a.dir or work / "model"
        t = time.monotonic()
        if (model / "config.json").exists():
            nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        elif CUDA:
            nbytes = make_checkpoint(model, a.layers)
        else:
            from failover.tools.tiny_model import write_checkpoint

            write_checkpoint(model, TinySpec())
            nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"checkpoint_ready_s={time.monotonic() - t:.1f}", flush=True)
        report: dict = {}
        try:
            asyncio.run(measure(a, work, model, nbytes, report))
        finally:
            for k, v in report.items():
                print(f"{k}={v}")
            logs = work / "node.log"
            if logs.exists() and a.save_log is not None:
                shutil.copyfile(logs, a.save_log)
            if logs.exists():
                tail = logs.read_text(errors="replace").splitlines()[-15:]
                print("node.log tail:\n  " + "\n  ".join(tail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
