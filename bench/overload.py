"""Does an overloaded primary look dead? A node with the config's defaults, more clients step by step, no fault.

    python3 bench/overload.py                                   # bundled engine, tiny model, CPU
    python3 bench/overload.py --steps 8,64,256 --seconds 20 --max-tokens 96
    .venv-vllm/bin/python bench/overload.py --engine vllm         # vLLM as failover runs it (CPU)
    python3 bench/overload.py --device cuda                      # the GPU node: cache daemon arena, engines in client mode

One node, ``failover up`` as a real process (bench/chaos_node.py: cache daemon, zygote, primary +
standby, router), with the router's and the service's liveness settings left at their defaults (what
an operator gets). Each step runs ``concurrency`` closed-loop clients in this process
(bench/loadgen.py: greedy completions and chat, most of them streamed, every answer checked against
the reference text) for ``--seconds``. Nothing is killed or frozen, so every failover or engine
restart in a step is a false verdict on a slow engine, and every failed, broken or wrong request is
the overload's.

Printed per step: requests/s and tokens/s, failed / broken / wrong, latency p50/p99, the longest
pause inside a stream (the wait for its first token included), the primary's probe answer time
measured beside the router's own probes (a ``GET`` of its probe path every 50 ms from a process of
its own: what the router's verdicts see), and from the router's ``/metrics`` the failovers by reason,
the probes it discounted and the requests it answered 503.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chaos_node import SERVICE, Node, free_port_pair  # noqa: E402
from client_figures import percentile  # noqa: E402
from loadgen import Load  # noqa: E402

PROBE_PATH = {"bundled": "/ready", "vllm": "/health"}

PROBE_EVERY = 0.05
PROBE_GIVE_UP = 10.0  # a probe unanswered this long is recorded as this long
# vLLM's CPU backend needs a head size it has kernels for (tests/vllm_helpers.py)
VLLM_SPEC = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, max_positions=1024)
VLLM_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
# The side probe: its own process, so the load's clients in ours never delay its timing.
PROBER = """
import sys, time, urllib.request, select
url, every, give_up = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
while not select.select([sys.stdin], [], [], every)[0]:
    t = time.monotonic()
    try:
        urllib.request.urlopen(url, timeout=give_up).read()
    except OSError:
        pass
    print(round(time.monotonic() - t, 6), flush=True)
"""


class OverloadNode(Node):
    """``failover up`` (bench/chaos_node.py) with the router's and the service's liveness settings
    left at their defaults: what an operator's node does when it is overloaded."""

    engine = "bundled"
    device = "cpu"

    def write_config(self) -> Path:
        self.router_port = free_port_pair(set())
        self.engine_port = free_port_pair({self.router_port, self.router_port + 1})
        vllm = (f'engine = "vllm"\nengine_python = "{sys.executable}"\nengine_args = {json.dumps(VLLM_FLAGS)}\n'
                if self.engine == "vllm" else "")
        path = self.workdir / "node.toml"
        path.write_text(f"""run_dir = "{self.run_dir}"

[model]
path = "{self.model}"
dtype = "float32"
device = "{self.device}"

[router]
port = {self.router_port}

[supervisor]
log_level = "{self.log_level}"

[[service]]
name = "{SERVICE}"
standbys = 1
kv_memory = "{'256MiB' if self.engine == 'vllm' else '64MiB'}"
port = {self.engine_port}
{vllm}""")
        return path


def _ms(values: list[float], q: float) -> str:
    return f"{percentile([v * 1e3 for v in values], q):.0f}" if values else "-"


def _primary(status: dict) -> dict:
    svc = status["services"][0]
    return next(i for i in svc["instances"] if i["name"] == svc["primary"])


def _delta(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, int]:
    """Increases of the counters named ``prefix``..., by their label (``{reason=...}``)."""
    out = {}
    for key, v in after.items():
        if key.startswith(prefix) and int(v - before.get(key, 0.0)):
            out[key[len(prefix):].strip("{}").split("=")[-1] or "-"] = int(v - before.get(key, 0.0))
    return out


async def step(node: OverloadNode, s: aiohttp.ClientSession, base: Load, concurrency: int, a) -> dict:
    load = Load(node.url, max_tokens=base.max_tokens, stream_ratio=a.stream_ratio, seed=concurrency)
    load.model, load.expected = base.model, base.expected
    st, before = await node.status(s), await node.metrics(s)
    primary = _primary(st)
    pids = {i["name"]: i["pid"] for i in st["services"][0]["instances"]}
    prober = subprocess.Popen([sys.executable, "-c", PROBER, primary["url"] + PROBE_PATH[a.engine],
                               str(PROBE_EVERY), str(PROBE_GIVE_UP)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        stop = asyncio.Event()
        t0 = time.monotonic()
        runner = asyncio.create_task(load.run(concurrency, stop))
        await asyncio.sleep(a.seconds)
        stop.set()
        await runner
        elapsed = time.monotonic() - t0
    finally:
        out, _ = prober.communicate(input="stop\n", timeout=PROBE_GIVE_UP + 5)
    probes = [float(x) for x in out.split()]
    st2, after = await node.status(s), await node.metrics(s)
    outs = load.outcomes
    ok = [o for o in outs if o.ok]
    streams = [o for o in outs if o.stream]
    return {
        "concurrency": concurrency, "requests": len(outs), "rps": len(ok) / elapsed,
        "tokens_s": sum(len(o.tokens) for o in ok if o.stream) / elapsed,
        "failed": sum(1 for o in outs if not o.ok and not o.stream and "wrong" not in o.error),
        "broken": sum(1 for o in streams if not o.ok and "wrong" not in o.error),
        "wrong": sum(1 for o in outs if "wrong" in o.error),
        "errors": sorted({o.error for o in outs if o.error}),
        "p50": _ms([o.end - o.start for o in ok], 50), "p99": _ms([o.end - o.start for o in ok], 99),
        "gap_p99": _ms([o.max_gap for o in streams], 99), "gap_max": _ms([max((o.max_gap for o in streams), default=0)], 100),
        "probe_p50": _ms(probes, 50), "probe_p99": _ms(probes, 99), "probe_max": _ms(probes, 100),
        "failovers": _delta(before, after, "failover_router_failovers_total"),
        "discounted": sum(_delta(before, after, "failover_router_probes_discounted_total").values()),
        "saturated": sum(_delta(before, after, "failover_router_saturated_total").values()),
        "restarted": sorted(i["name"] for i in st2["services"][0]["instances"] if pids.get(i["name"]) != i["pid"]),
    }


def log_events(text: str) -> dict:
    """From the node's log: the collector's slow pauses (``gc_pause``, failover_common/gc_pauses.py)
    by process, with the longest, and the router's hang verdicts."""
    pauses: dict[str, list[float]] = {}
    hangs = 0
    for line in text.splitlines():
        if '"gc_pause"' not in line and '"hang_detected"' not in line:
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "gc_pause":
            pauses.setdefault(f"{ev.get('process')} gen{ev.get('generation')}", []).append(ev["ms"])
        elif ev.get("event") == "hang_detected":
            hangs += 1
    return {"hang_detected": hangs, "gc_pauses_over_20ms": {k: {"n": len(v), "max_ms": max(v)} for k, v in sorted(pauses.items())}}


def report(r: dict) -> str:
    fo = ", ".join(f"{k} {v}" for k, v in sorted(r["failovers"].items())) or "0"
    return (f"| {r['concurrency']} | {r['requests']} | {r['rps']:.1f} | {r['tokens_s']:.0f} | "
            f"{r['failed']} / {r['broken']} / {r['wrong']} | {r['p50']} / {r['p99']} | {r['gap_p99']} / {r['gap_max']} | "
            f"{r['probe_p50']} / {r['probe_p99']} / {r['probe_max']} | {fo} | {r['discounted']} | {r['saturated']} | "
            f"{', '.join(r['restarted']) or '-'} |")


async def run(a: argparse.Namespace, work: Path) -> int:
    from failover.config.schema import load_config
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    spec = TinySpec(**VLLM_SPEC) if a.engine == "vllm" else TinySpec()
    node = OverloadNode(workdir=work, model=write_checkpoint(work / "model", spec), run_dir=work / "run",
                        log_level="warning")
    node.engine, node.device = a.engine, a.device
    config = load_config(node.write_config())
    r, svc = config.router, config.service[0]
    print(f"# engine={a.engine} device={a.device} router: probe_interval={r.probe_interval}s probe_timeout={r.probe_timeout}s "
          f"probe_threshold={r.probe_threshold} hang_probe_timeout={r.hang_probe_timeout}s; service "
          f"max_batch={svc.max_batch}; max_tokens={a.max_tokens} stream_ratio={a.stream_ratio} "
          f"seconds/step={a.seconds}", flush=True)
    bad = 0
    try:
        t = time.monotonic()
        await node.start(timeout=600)
        async with aiohttp.ClientSession() as s:
            while not all(i["ready"] for i in (await node.status(s))["services"][0]["instances"]):
                await asyncio.sleep(0.5)
            print(f"# node ready (primary and standby) in {time.monotonic() - t:.1f} s", flush=True)
            base = Load(node.url, max_tokens=a.max_tokens)
            await base.learn_expected(s)
            print("| clients | requests | req/s | tokens/s | failed / broken / wrong | latency p50 / p99 ms "
                  "| longest pause in a stream p99 / max ms | probe answer p50 / p99 / max ms "
                  "| failovers (no fault) | probes discounted | 503 | engines restarted |")
            print("| --- " * 12 + "|")
            for c in a.steps:
                res = await step(node, s, base, c, a)
                print(report(res), flush=True)
                if res["errors"]:
                    print(f"#   errors at {c} clients: {'; '.join(res['errors'])}", flush=True)
                bad += sum(res["failovers"].values()) + res["failed"] + res["broken"] + res["wrong"]
                bad += len(res["restarted"])
                await asyncio.sleep(a.settle)
    finally:
        code = node.stop()
        if code is None:
            node.kill()
    print(f"# node stopped: exit {code} in {node.shutdown_s:.1f} s (the tail of its log follows on any failure)")
    print(f"# the node's own records: {json.dumps(log_events((work / 'node.log').read_text()))}")
    print(f"false_failovers_restarts_or_client_failures={bad}")
    if bad or code != 0:
        sys.stdout.write((work / "node.log").read_text()[-4000:])
    return 0 if code == 0 else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("bundled", "vllm"), default="bundled")
    p.add_argument("--device", default="cpu", help="the node's model.device: cpu, or cuda (the cache daemon's "
                   "arena and engines in client mode, as an operator's GPU node runs)")
    p.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")], default=[4, 16, 64, 128],
                   help="concurrent clients of each step, comma-separated")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each step")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream-ratio", type=float, default=0.8)
    p.add_argument("--settle", type=float, default=2.0, help="seconds between steps")
    a = p.parse_args()
    from failover_common.logs import configure_logging

    configure_logging("error", process="bench-overload")
    print(f"# bench/overload.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  "
          f"cores={os.cpu_count()}  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fo-overload-", dir="/tmp") as tmp:
        return asyncio.run(run(a, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
