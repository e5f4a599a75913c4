"""Co-serving benchmark: how fast a batch engine gets out of the way and comes back, and what it costs.

    python bench/preempt.py                                   # CPU, the tiny model
    python bench/preempt.py --device cuda --model /models/Qwen3-8B --dtype bfloat16 \\
        --kv-memory 20GiB --batch-kv-memory 20GiB --items 2000 --max-tokens 128 --concurrency 64

One node (the same Supervisor as ``failover up``: cache daemon, zygote, router) with an online service
``chat`` and a batch service ``offline`` on the same resident weights; the load trigger is off (the
preemptions are an operator's, through the router as the admin API does it). Phases:

1. online alone: the batch engine evicted; ``--clients`` closed-loop streaming clients on ``chat``
   for ``--phase`` s: TTFT p50/p99 (request sent -> first token event, through the router);
2. co-served: the batch engine back, same online load: TTFT again, and the batch's tokens/s;
3. preemptions: ``--rounds`` x (batch running ``--run`` s, preempt, ``--pause`` s, resume), same
   online load: per round trigger -> process gone -> memory verified free (CUDA: its pids gone from
   ``nvidia-smi --query-compute-apps``), and resume -> /ready -> first new batch result; the batch's
   tokens/s over the phase (wall clock, preempted time included) against phase 2's: throughput retained;
4. the batch runs to its end; its output must hold every input id exactly once (0 lost, 0 duplicated).

Prints the machine, the date, one line per round, and a summary of key=value lines.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostinfo import cpus  # noqa: E402
from failover_common.logs import configure_logging  # noqa: E402
from failover.config.schema import BatchConfig, parse_config  # noqa: E402
from failover.cmd.demo import free_port_pair  # noqa: E402


def machine() -> str:
    """Without torch.cuda: the bench process runs the supervisor, which must not hold a CUDA context."""
    gpu = "none"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        gpu = f"{out[0]} (x{len(out)})" if out else "none"
    import torch

    return (f"host={platform.node()} {cpus()} gpu=\"{gpu}\" "
            f"python={platform.python_version()} torch={torch.__version__} kernel={platform.release()} "
            f"loadavg={' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def write_input(path: Path, a: argparse.Namespace) -> list[str]:
    ids = [f"b{i}" for i in range(a.items)]
    with path.open("w") as f:
        for i, rid in enumerate(ids):
            f.write(json.dumps({"id": rid, "prompt": f"Item {i}: write a short story about the number {i}.",
                                "max_tokens": a.max_tokens, "temperature": 0}) + "\n")
    return ids


def threads(n: int | None) -> dict:
    return {} if n is None else {"cpu_threads": n}


def config_for(a: argparse.Namespace, workdir: Path, model: Path):
    ports = [free_port_pair() for _ in range(3)]
    return parse_config({
        "run_dir": str(workdir / "run"),
        "model": {"path": str(model), "dtype": a.dtype, "device": a.device, "tp": a.tp},
        "router": {"port": ports[0], "probe_interval": 0.2},
        "supervisor": {"log_level": "warning", "ready_timeout": 600.0},
        "service": [
            {"name": "chat", "kind": "online", "priority": 100, "standbys": a.standbys,
             "kv_memory": a.kv_memory, "port": ports[1], **threads(a.online_threads)},
            {"name": "offline", "kind": "batch", "priority": 10, "standbys": 0, "kv_memory": a.batch_kv_memory,
             "max_batch": a.concurrency, "port": ports[2], **threads(a.batch_threads),
             "batch": {"input": str(workdir / "in.jsonl"), "output": str(workdir / "out.jsonl"),
                       "concurrency": a.concurrency, "watch": [], "evict_timeout": a.evict_timeout,
                       "nice": a.batch_nice}},
        ],
    }, source="bench-preempt")


class Online:
    """Closed-loop streaming clients through the router; TTFT per request, failures counted."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.ttft: list[float] = []
        self.failed = 0
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        self._tasks = [asyncio.ensure_future(self._client(i)) for i in range(self.clients)]

    async def _client(self, i: int) -> None:
        n = 0
        while True:
            n += 1
            body = {"model": "chat", "prompt": f"client {i} request {n}", "max_tokens": self.max_tokens,
                    "temperature": 0, "stream": True}
            t0 = time.monotonic()
            first = None
            try:
                async with self.session.post(self.url + "/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        self.failed += 1
                        continue
                    async for line in resp.content:
                        if first is None and line.startswith(b"data: {"):
                            first = time.monotonic() - t0
                if first is not None:
                    self.ttft.append(first)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                self.failed += 1

    def take(self) -> list[float]:
        out, self.ttft = self.ttft, []
        return out

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.session.close()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.005)


async def run(a: argparse.Namespace, workdir: Path, model: Path) -> int:
    from failover.node.supervisor import Supervisor

    ids = write_input(workdir / "in.jsonl", a)
    config = config_for(a, workdir, model)
    log = open(workdir / "node.log", "wb")
    sup = Supervisor(config, child_output=log)
    job = sup.coserve.jobs["offline"]
    online = Online(config.router_url, a.clients, a.online_tokens)
    out: dict = {}
    try:
        t0 = time.monotonic()
        await sup.start()
        print(f"node up in {time.monotonic() - t0:.1f} s", flush=True)
        serving = lambda: job.slot.state == "running" and not job.slot.hold and job.state == "running"  # noqa: E731

        # 1. online alone (batch evicted)
        await sup.router.preempt("offline")
        online.start()
        await asyncio.sleep(a.phase)
        alone = online.take()

        # 2. co-served, no preemption
        await sup.router.resume("offline")
        await wait_for(serving, 600, "the batch engine back")
        await asyncio.sleep(1.0)  # let it fill its batch
        online.take()
        tok0, s0 = job.runner.progress.tokens, time.monotonic()
        await asyncio.sleep(a.phase)
        co_tps = (job.runner.progress.tokens - tok0) / (time.monotonic() - s0)
        co = online.take()

        # 3. preemptions under the same online load
        rounds = []
        tok0, s0 = job.runner.progress.tokens, time.monotonic()
        for i in range(a.rounds):
            await asyncio.sleep(a.run)
            if job.state == "done":
                print("the batch finished before all rounds; raise --items", flush=True)
                break
            await sup.router.preempt("offline")
            p = {"trigger_to_gone_ms": float("nan"), "killed": False} | dict(job.last_preempt)
            await asyncio.sleep(a.pause)
            resumed_at = time.monotonic()
            await sup.router.resume("offline")
            await wait_for(lambda: "first_result_ms" in job.last_resume or job.state == "done", 600,
                           "the first result after resume")
            r = dict(job.last_resume)
            rounds.append({"preempt": p, "resume": r})
            print(f"round {i + 1}: preempt trigger->gone {p['trigger_to_gone_ms']:.1f} ms, ->memory free "
                  f"{p['trigger_to_memory_free_ms']:.1f} ms (SIGKILL {'yes' if p['killed'] else 'no'}, "
                  f"{p['cut_off']} requests cut off); resume ->ready {r.get('ready_ms', float('nan')):.1f} ms, "
                  f"->first result {r.get('first_result_ms', float('nan')):.1f} ms "
                  f"(resume call {1e3 * (time.monotonic() - resumed_at):.0f} ms ago)", flush=True)
        pre_tps = (job.runner.progress.tokens - tok0) / (time.monotonic() - s0)
        preempting = online.take()
        await online.stop()

        # 4. the batch to its end; every id exactly once
        await wait_for(lambda: job.state == "done", a.finish_timeout, "the batch to finish")
        records = [json.loads(line) for line in (workdir / "out.jsonl").read_text().splitlines() if line.strip()]
        counts = Counter(r["id"] for r in records)
        out = {
            "rounds": rounds, "alone": alone, "co": co, "preempting": preempting, "co_tps": co_tps,
            "pre_tps": pre_tps, "lost": len(set(ids) - set(counts)), "duplicated": sum(c - 1 for c in counts.values()),
            "unknown": len(set(counts) - set(ids)), "errors": sum(r["error"] is not None or
                                                                  r["response"]["status_code"] != 200 for r in records),
            "online_failed": online.failed,
        }
    finally:
        if online._tasks:
            await online.stop()
        await sup.stop()
        log.close()
    summarize(a, out)
    return 0 if out["lost"] == 0 and out["duplicated"] == 0 and out["online_failed"] == 0 else 1


def summarize(a: argparse.Namespace, o: dict) -> None:
    ms = lambda xs: [1e3 * x for x in xs]  # noqa: E731
    pre_gone = [r["preempt"]["trigger_to_gone_ms"] for r in o["rounds"] if not r["preempt"].get("no_process")]
    pre_free = [r["preempt"]["trigger_to_memory_free_ms"] for r in o["rounds"]]
    ready = [r["resume"]["ready_ms"] for r in o["rounds"] if "ready_ms" in r["resume"]]
    first = [r["resume"]["first_result_ms"] for r in o["rounds"] if "first_result_ms" in r["resume"]]
    print("\nsummary:")
    print(f"rounds={len(o['rounds'])} evict_timeout_ms={a.evict_timeout * 1e3:.0f}")
    print(f"killed_rounds={sum(r['preempt']['killed'] for r in o['rounds'])}")
    for name, xs in (("preempt_to_gone_ms", pre_gone), ("preempt_to_memory_free_ms", pre_free),
                     ("resume_to_ready_ms", ready), ("resume_to_first_result_ms", first)):
        if xs:
            print(f"{name}_median={statistics.median(xs):.1f}")
            print(f"{name}_max={max(xs):.1f}")
    for name, xs in (("alone", o["alone"]), ("coserved", o["co"]), ("preempting", o["preempting"])):
        print(f"online_ttft_{name}_p50_ms={pct(ms(xs), 0.5):.1f}")
        print(f"online_ttft_{name}_p99_ms={pct(ms(xs), 0.99):.1f}")
        print(f"online_requests_{name}={len(xs)}")
    print(f"online_failed={o['online_failed']}")
    print(f"batch_tokens_per_s_uninterrupted={o['co_tps']:.1f}")
    print(f"batch_tokens_per_s_with_preemptions={o['pre_tps']:.1f}")
    print(f"batch_throughput_retained={o['pre_tps'] / o['co_tps'] if o['co_tps'] else float('nan'):.2f}")
    print(f"batch_lost={o['lost']}")
    print(f"batch_duplicated={o['duplicated']}")
    print(f"batch_unknown_ids={o['unknown']}")
    print(f"batch_error_records={o['errors']}")
    print(f"loadavg_end={' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="Hugging Face model dir (default: a tiny random model)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kv-memory", default="32MiB", help="KV budget of each online instance")
    p.add_argument("--batch-kv-memory", default="32MiB", help="KV budget of the batch engine")
    p.add_argument("--standbys", type=int, default=0, help="online standbys (CPU: 0 keeps the 2 cores for the rest)")
    p.add_argument("--items", type=int, default=300, help="batch requests")
    p.add_argument("--max-tokens", type=int, default=16, help="per batch request")
    p.add_argument("--concurrency", type=int, default=4, help="batch requests in flight (and its max_batch)")
    p.add_argument("--clients", type=int, default=2, help="closed-loop online streaming clients")
    p.add_argument("--online-tokens", type=int, default=16)
    p.add_argument("--phase", type=float, default=15.0, help="seconds of online load per TTFT phase")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--run", type=float, default=1.5, help="seconds the batch runs before each preemption")
    p.add_argument("--pause", type=float, default=0.5, help="seconds preempted in each round")
    p.add_argument("--batch-nice", type=int, default=BatchConfig(input="", output="").nice, metavar="N",
                   help="nice levels the batch engine runs below the node (default: batch.nice's; 0: as is)")
    p.add_argument("--online-threads", type=int, default=None, metavar="N",
                   help="cpu_threads of the online service (default: the node's share of the cores)")
    p.add_argument("--batch-threads", type=int, default=None, metavar="N",
                   help="cpu_threads of the batch service (default: the node's share of the cores)")
    p.add_argument("--evict-timeout", type=float, default=0.5, help="SIGTERM -> SIGKILL of the batch engine")
    p.add_argument("--finish-timeout", type=float, default=900.0)
    a = p.parse_args()
    configure_logging("error", process="bench")
    print(f"bench/preempt.py  date={datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(machine())
    print(f"model={a.model or 'tiny (random, 2 layers)'} device={a.device} dtype={a.dtype} tp={a.tp} "
          f"items={a.items} max_tokens={a.max_tokens} concurrency={a.concurrency} clients={a.clients} "
          f"rounds={a.rounds} phase={a.phase}s batch_nice={a.batch_nice} "
          f"online_threads={a.online_threads or 'default'} batch_threads={a.batch_threads or 'default'}")
    workdir = Path(tempfile.mkdtemp(prefix="fo-bench-", dir="/tmp"))
    try:
        from failover.tools.tiny_model import TinySpec, write_checkpoint

        model = Path(a.model) if a.model else write_checkpoint(workdir / "model", TinySpec())
        return asyncio.run(run(a, workdir, model))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
