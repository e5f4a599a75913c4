"""Relaunch benchmark: eviction of an engine to its replacement ready as a standby, zygote vs cold spawn.

    python bench/relaunch.py                          # CPU, the tiny model, 5 rounds per path
    python bench/relaunch.py --device cuda --model /models/Qwen3-8B --dtype bfloat16 --rounds 10

For each launch path it runs a whole node (the same Supervisor as ``failover up``: cache daemon,
zygote, a primary and a standby, router), then kill -9s the standby ``--rounds`` times and measures
kill -> the replacement's /ready, as the supervisor saw it. The replacement's /ready reports where
its weights came from (``weights_source``: cache = mapped from the daemon, not read from disk) and
how long that took. Prints the machine, the date, one line per round and a summary of key=value lines.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostinfo import cpus  # noqa: E402
from failover_common.logs import configure_logging  # noqa: E402
from failover.config.schema import parse_config  # noqa: E402
from failover.cmd.demo import free_port_pair  # noqa: E402


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"host={platform.node()} {cpus()} gpu=\"{gpu}\" "
            f"python={platform.python_version()} torch={torch.__version__} kernel={platform.release()} "
            f"loadavg={' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def config_for(a: argparse.Namespace, workdir: Path, model: Path, launch: str):
    router_port, engine_port = free_port_pair(), free_port_pair()
    while engine_port in (router_port, router_port + 1) or engine_port + 1 == router_port:
        engine_port = free_port_pair()
    return parse_config({
        "run_dir": str(workdir / f"run-{launch}"),
        "model": {"path": str(model), "dtype": a.dtype, "device": a.device, "tp": a.tp},
        "router": {"port": router_port, "probe_interval": 0.2},
        # log level info: the engines' start phases (engine_built), printed per round
        "supervisor": {"launch": launch, "log_level": "info", "ready_timeout": 600.0,
                       "crash_loop_exits": 1000, "crash_loop_window": 0.001},  # no backoff between rounds
        "service": [{"name": "chat", "standbys": 1, "kv_memory": a.kv_memory, "port": engine_port}],
    }, source=f"bench-{launch}")


async def graphs_live_ms(url: str, killed: float) -> float | None:
    """Kill -> the replacement's /ready reports every CUDA graph bucket captured (None: eager engine)."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        while time.monotonic() - killed < 120:
            async with http.get(f"{url}/ready") as r:
                body = await r.json()
            total = body.get("cuda_graph_buckets_total", 0)
            if not total:
                return None
            if body.get("cuda_graph_buckets") == total:
                return (time.monotonic() - killed) * 1e3
            await asyncio.sleep(0.002)
    raise TimeoutError(f"{url}: CUDA graphs not live 120 s after the kill")


def start_phases(node_log: Path, pid: int | None) -> str:
    """The engine's own record of its start (engine_built, warmup_first_steps), by pid."""
    import json

    found = {}
    for text in node_log.read_text(errors="replace").splitlines():
        for event in ("engine_built", "warmup_first_steps", "kv_cache_allocated", "listening"):
            if f'"{event}"' in text and "{" in text:
                try:
                    e = json.loads(text[text.index("{"):])
                except ValueError:
                    continue
                if event != "listening" or e.get("pid") == pid:
                    found[event] = e
    keep = ("before_ms", "context_ms", "weights_ms", "model_kv_ms", "model_ms", "skeleton_ms", "assign_ms",
            "rope_ms", "kv_ms", "buffers_ms", "tokenizer_ms", "prepared_model", "prepared_tokenizer", "warmup_ms",
            "total_ms", "prefill_ms", "decode_ms")
    return " ".join(f"{k}={v}" for e in found.values() for k, v in e.items() if k in keep) or "-"


async def bench_path(a: argparse.Namespace, workdir: Path, model: Path, launch: str) -> list[dict]:
    from failover.node.supervisor import Supervisor

    config = config_for(a, workdir, model, launch)
    log = open(workdir / f"node-{launch}.log", "wb")
    sup = Supervisor(config, child_output=log)
    rounds = []
    try:
        t0 = time.monotonic()
        await sup.start()
        print(f"[{launch}] node up in {time.monotonic() - t0:.2f} s", flush=True)
        for i in range(a.rounds):
            await asyncio.sleep(a.pause)
            standby = sup.router.services["chat"].standbys()[0]
            slot = sup.slots[standby.name]
            killed = time.monotonic()
            os.kill(slot.pid, signal.SIGKILL)
            while not (slot.state == "running" and slot.ready_at and slot.ready_at > killed):
                await asyncio.sleep(0.002)
                if time.monotonic() - killed > 600:
                    raise TimeoutError(f"{slot.name} was not relaunched within 600 s; see {log.name}")
            graphs_ms = await graphs_live_ms(slot.url, killed)
            r = {"round": i + 1, "launch": launch, "slot": slot.name, "graphs_live_ms": graphs_ms,
                 "relaunch_ms": (slot.ready_at - killed) * 1e3,
                 "exit_seen_ms": (slot.evicted_at - killed) * 1e3,
                 "launch_to_ready_ms": (slot.ready_at - slot.launched_at) * 1e3,
                 "weights_source": slot.ready_info.get("weights_source"),
                 "weights_ms": 1e3 * float(slot.ready_info.get("weights_seconds") or 0.0)}
            r["phases"] = start_phases(workdir / f"node-{launch}.log", slot.pid)
            rounds.append(r)
            print(f"[{launch}] round {i + 1}: relaunch_ms={r['relaunch_ms']:.1f} (exit seen "
                  f"{r['exit_seen_ms']:.1f} ms, launch->ready {r['launch_to_ready_ms']:.1f} ms, weights "
                  f"{r['weights_source']} in {r['weights_ms']:.1f} ms; CUDA graphs live "
                  f"{'-' if graphs_ms is None else f'{graphs_ms:.1f} ms'} after the kill)\n    its start: "
                  f"{r['phases']}", flush=True)
    finally:
        await sup.stop()
        log.close()
    return rounds


async def main_async(a: argparse.Namespace, workdir: Path) -> int:
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    model = Path(a.model) if a.model else write_checkpoint(workdir / "model", TinySpec())
    results = {launch: await bench_path(a, workdir, model, launch) for launch in a.paths.split(",")}
    print("\nsummary:")
    medians = {}
    for launch, rounds in results.items():
        ms = [r["relaunch_ms"] for r in rounds]
        medians[launch] = statistics.median(ms)
        sources = sorted({r["weights_source"] for r in rounds})
        print(f"{launch}_relaunch_ms_median={medians[launch]:.1f}")
        print(f"{launch}_relaunch_ms_min={min(ms):.1f}")
        print(f"{launch}_relaunch_ms_max={max(ms):.1f}")
        print(f"{launch}_weights_source={','.join(map(str, sources))}")
        print(f"{launch}_weights_ms_median={statistics.median(r['weights_ms'] for r in rounds):.1f}")
        graphs = [r["graphs_live_ms"] for r in rounds if r["graphs_live_ms"] is not None]
        if graphs:
            print(f"{launch}_graphs_live_ms_median={statistics.median(graphs):.1f}")
    if "zygote" in medians and "spawn" in medians:
        print(f"speedup_spawn_over_zygote={medians['spawn'] / medians['zygote']:.2f}")
    print(f"loadavg_end={' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    mapped = all(r["weights_source"] == "cache" for rs in results.values() for r in rs)
    print(f"weights_mapped_not_reloaded={int(mapped)}")
    return 0 if mapped else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="Hugging Face model dir (default: a tiny random model)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kv-memory", default="64MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pause", type=float, default=0.5, help="seconds between rounds")
    p.add_argument("--paths", default="zygote,spawn", help="launch paths to compare")
    p.add_argument("--save-log", type=Path, default=None, help="copy each path's node log into this dir")
    a = p.parse_args()
    configure_logging("error", process="bench")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"bench/relaunch.py  date={datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(machine())
    print(f"model={a.model or 'tiny (random, 2 layers)'} device={a.device} dtype={a.dtype} tp={a.tp} rounds={a.rounds}")
    workdir = Path(tempfile.mkdtemp(prefix="fo-bench-", dir="/tmp"))
    try:
        return asyncio.run(main_async(a, workdir))
    finally:
        if a.save_log is not None:
            a.save_log.mkdir(parents=True, exist_ok=True)
            for f in workdir.glob("node-*.log"):
                shutil.copyfile(f, a.save_log / f.name)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
