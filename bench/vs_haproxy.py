"""Our router and HAProxy side by side: same engines, same load, same kill -9 schedule.

    python3 bench/vs_haproxy.py [--kills 10] [--interval 8] [--concurrency 4] [--loop uvloop --loop asyncio]
    python3 bench/vs_haproxy.py --profile DIR     # py-spy (pip install py-spy) on the router process

The router runs in a process of its own (as HAProxy does, and as in production), with the engines
it launches; `--in-process` puts it on the bench's own event loop instead, as before issue 20, where
the load generator's work and the router's serialise on one core. One router phase per `--loop`.

HAProxy comes from the distribution (`apt-get install haproxy`), or from another machine packed by
bench/haproxy_carry.sh (its binary and libraries, on PATH there); this script installs nothing. It is
configured as aggressively as it allows: primary as a normal server, standby as `backup`,
`check inter 100ms fall 1 rise 1`, `observe layer4 error-limit 1 on-error mark-down`, `retries 3`,
`option redispatch`, `retry-on all-retryable-errors`. In both phases a killed engine is replaced by a
fresh process at once (for HAProxy on the same port, as its configuration is static; for our router
as a new standby, registered when ready, which is what the supervisor does). In both, the replacement
starts `--nice-replacement` nice levels down and gets its priority back once ready, as the supervisor
starts a standby (`supervisor.standby_nice`, 10 by default).

Added latency (before the load and the kills): sequential one-token completions, direct to the
primary and through each proxy, interleaved one request at a time. In the router phase HAProxy is
started in front of the router's own engines for this measurement, so the router's and HAProxy's
added p50 printed below the table come from one sitting over the same engines; the table's HAProxy
column has its own phase's figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date, datetime, timezone
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hostinfo  # noqa: E402
from engines import EngineProc, free_port, on_cpus  # noqa: E402
from client_figures import line as client_line  # noqa: E402
from loadgen import CALM_S, Load, closed_loop, percentile, summary  # noqa: E402
from router_side import RouterSide, replacement  # noqa: E402
from failover.config.argv import share  # noqa: E402
from failover.config.schema import SupervisorConfig  # noqa: E402
from failover_common import cpus  # noqa: E402

HAPROXY_CFG = """
global
    maxconn 2000
defaults
    mode http
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    retries 3
    option redispatch
    retry-on all-retryable-errors
listen llm
    bind 127.0.0.1:{port}
    option httpchk GET /ready
    server primary 127.0.0.1:{p1} check inter 100ms fall 1 rise 1 observe layer4 error-limit 1 on-error mark-down
    server standby 127.0.0.1:{p2} check inter 100ms fall 1 rise 1 backup
"""


async def overhead(direct: str, proxied: dict[str, str], n: int) -> dict:
    """Sequential one-token completions, direct and through each proxy in ``proxied`` (name ->
    url), interleaved one at a time (so the box's drift hits them alike): each proxy's added
    latency. One client session per run, used for nothing else (the router's lean listener hands a
    connection that once carried another kind of request, such as /admin/status, to aiohttp)."""
    bases = {"direct": direct} | proxied
    lat: dict[str, list[float]] = {k: [] for k in bases}
    async with aiohttp.ClientSession() as s:
        async with s.get(direct + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
        order = list(bases.items())
        for i in range(len(order) * n):
            key, base = order[i % len(order)]
            t = time.perf_counter()
            async with s.post(base + "/v1/completions", json=body) as r:
                await r.read()
            lat[key].append(time.perf_counter() - t)
    d50, d99 = percentile(lat["direct"], 50), percentile(lat["direct"], 99)
    return {name: {"added_p50_ms": round((percentile(lat[name], 50) - d50) * 1e3, 2),
                   "added_p99_ms": round((percentile(lat[name], 99) - d99) * 1e3, 2)} for name in proxied}


def start_haproxy(logs: Path, p1: int, p2: int, cpus: frozenset[int] | None = None) -> tuple[subprocess.Popen, str]:
    """HAProxy (HAPROXY_CFG) in front of the engines on ports ``p1`` (primary) and ``p2``, on ``cpus``
    (None: the kernel's choice)."""
    port = free_port()
    cfg = logs / f"haproxy-{port}.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port, p1=p1, p2=p2))
    hap = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           preexec_fn=on_cpus(cpus))
    return hap, f"http://127.0.0.1:{port}"


def stop_haproxy(hap: subprocess.Popen) -> None:
    hap.send_signal(signal.SIGTERM)
    try:
        hap.wait(10)
    except subprocess.TimeoutExpired:
        hap.kill()
        hap.wait()


async def overhead_side_by_side(primary: str, standby: str, router: str, logs: Path, n: int,
                                cpus: frozenset[int] | None = None) -> dict:
    """The router's added latency and HAProxy's, interleaved over the router phase's own engines
    (HAProxy in front of them for this measurement only): the two proxies' figures from one
    sitting, where the separate phases' figures also carry the box's drift between them."""
    port = lambda url: int(url.rsplit(":", 1)[1])  # noqa: E731
    hap, url = start_haproxy(logs, port(primary), port(standby), cpus)
    try:
        await asyncio.sleep(1.0)  # its first checks
        both = await overhead(primary, {"router": router, "haproxy": url}, n)
    finally:
        stop_haproxy(hap)
    return both["router"] | {"haproxy_added_p50_ms": both["haproxy"]["added_p50_ms"],
                             "haproxy_added_p99_ms": both["haproxy"]["added_p99_ms"]}


async def resume_prefill(direct: str, n: int, resumed: int = 15) -> float:
    """What re-prefilling a migrated stream costs the new primary, direct to one engine: the next
    token of a stream resumed after ``resumed`` tokens (prompt + those re-prefilled) minus a fresh
    request's first token (prompt only), p50 ms. This bounds what pre-prefilling on the standby
    could save a migrated stream."""
    lat: dict[bool, list[float]] = {False: [], True: []}
    async with aiohttp.ClientSession() as s:
        async with s.get(direct + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        base = {"model": model, "prompt": "The primary engine fails", "temperature": 0.0}
        async with s.post(direct + "/v1/completions", json=base | {"max_tokens": resumed, "ignore_eos": True}) as r:
            ids = (await r.json())["choices"][0]["token_ids"][:resumed]
        for i in range(2 * n):
            res = i % 2 == 1
            body = base | ({"max_tokens": len(ids) + 1, "resume_token_ids": ids} if res else {"max_tokens": 1})
            t = time.perf_counter()
            async with s.post(direct + "/v1/completions", json=body) as r:
                await r.read()
            lat[res].append(time.perf_counter() - t)
    return round((percentile(lat[True], 50) - percentile(lat[False], 50)) * 1e3, 2)


async def engine_threads(s: aiohttp.ClientSession, url: str) -> int | None:
    """The torch threads an engine reports in /ready: what each phase's engines really run with."""
    async with s.get(url + "/ready") as r:
        return (await r.json()).get("cpu_threads")


def cpu_s(pid: int | list[int]) -> float:
    """User + system CPU seconds of process ``pid`` so far (its own, not its children's); of a
    list of pids (the router's workers and their parent), the sum."""
    total = 0.0
    for p in [pid] if isinstance(pid, int) else pid:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def where_stalled(outcomes, faults: list[float]) -> dict:
    """The run's longest gap inside one stream: how long, how long after the last fault it began,
    and whether its stream was in flight at that fault (a migrated or retried one) or began later."""
    best = (0.0, None, None)
    for o in outcomes:
        if not o.stream:
            continue
        ev = [o.start, *sorted(o.tokens), o.end]
        for a, b in zip(ev, ev[1:]):
            if b - a > best[0]:
                best = (b - a, a, o)
    gap, at, o = best
    before = [f for f in faults if f <= at] if at is not None else []
    if not before:
        return {"longest_stall_ms": round(gap * 1e3, 1), "after_fault_ms": None, "in_flight_at_fault": False}
    f = before[-1]
    at_utc = datetime.fromtimestamp(time.time() - (time.monotonic() - at), timezone.utc)
    return {"longest_stall_ms": round(gap * 1e3, 1), "after_fault_ms": round((at - f) * 1e3, 1),
            "in_flight_at_fault": o.start <= f < o.end, "began_utc": at_utc.strftime("%H:%M:%S.%f")[:-3]}


async def drive(load: Load, kills: int, interval: float, concurrency: int, kill_primary, pid: int | None) -> dict:
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(concurrency, stop))
    faults, t0 = [], time.monotonic()
    cpu0 = cpu_s(pid) if pid else None
    await asyncio.sleep(interval / 2)
    for _ in range(kills):
        faults.append(await kill_primary())
        await asyncio.sleep(interval)
    stop.set()
    await runner
    out = summary(load.outcomes, faults, time.monotonic() - t0)
    if cpu0 is not None:  # the proxy's own CPU per request of the load (probes and failovers included)
        out["proxy_cpu_ms_per_req"] = round((cpu_s(pid) - cpu0) * 1e3 / max(1, len(load.outcomes)), 3)
    return out | {"stall": where_stalled(load.outcomes, faults)}


async def phase_router(model: Path, args, logs: Path, loop: str, workers: int = 1) -> dict:
    async with RouterSide(model, logs, loop, args, workers) as side, aiohttp.ClientSession() as s:
        insts = (await side.status(s))["instances"]
        primary = next(i for i in insts if i["role"] == "primary")
        standby = next(i for i in insts if i["role"] == "standby")
        threads = {"engine_cpu_threads": await engine_threads(s, primary["url"])}
        ov = await overhead_side_by_side(primary["url"], standby["url"], side.url, logs, args.overhead_n,
                                         args.proxy_cpu_set)
        ov["resume_prefill_ms"] = await resume_prefill(primary["url"], max(10, args.overhead_n // 4))
        models = {"models_direct_rps": round(await closed_loop(primary["url"] + "/v1/models", 16, args.models_s)),
                  "models_rps": round(await closed_loop(side.url + "/v1/models", 16, args.models_s))}

        records: list[dict | None] = []  # the router's own record of each failover
        faults_done: list[int] = []
        faults: list[float] = []

        async def kill_primary() -> float:
            # as in the HAProxy phase, where the backup is never the one killed, a ready standby
            # must be there: the previous kill's replacement may still be starting
            if records or faults_done:
                records.append((await side.status(s, full=True))["last_failover"].get("default"))
            faults_done.append(1)
            while True:
                st = await side.status(s)
                prim = [i for i in st["instances"] if i["role"] == "primary" and i["ready"]]
                if prim and any(i["role"] == "standby" and i["ready"] for i in st["instances"]):
                    break
                await asyncio.sleep(0.05)
            t = time.monotonic()
            os.killpg(prim[0]["pid"], signal.SIGKILL)  # EngineProc starts each engine in its own group
            faults.append(t)
            return t

        load = Load(side.url, seed=args.seed)
        await load.learn_expected(s)
        pid = side.pid if not args.in_process else os.getpid()
        result = await drive(load, args.kills, args.interval, args.concurrency, kill_primary, pid)
        await asyncio.sleep(0.5)
        records.append((await side.status(s, full=True))["last_failover"].get("default"))
        threads["stream_reads_lane_share"] = await lane_share(s, side.url)
    return result | ov | models | threads | {"records": [r for r in records if r], "faults": faults}


async def lane_share(s: aiohttp.ClientSession, router_url: str) -> float | None:
    """The share of the streams' upstream reads that went by the relay's lane (router/sse.py), from
    the router's /metrics (None where it has no such counter: a router before 2026-12-04)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with s.get(router_url + "/metrics") as r:
        text = await r.text()
    ways = {"lane": 0.0, "parsed": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "failover_router_stream_reads_total":
                ways[sample.labels["way"]] += sample.value
    total = ways["lane"] + ways["parsed"]
    return round(ways["lane"] / total, 3) if total else None


async def cpu_phase(model: Path, args, logs: Path, loop: str) -> dict:
    """No faults: the router process's CPU per request for streams and for whole answers, and per
    SSE event (the streams' extra over whole answers, over the events a stream carries)."""
    out = {}
    async with RouterSide(model, logs, loop, args) as side, aiohttp.ClientSession() as s:
        for kind, ratio in (("stream", 1.0), ("whole", 0.0)):
            load = Load(side.url, seed=args.seed, stream_ratio=ratio)
            await load.learn_expected(s)
            stop = asyncio.Event()
            c0 = cpu_s(side.pid)
            runner = asyncio.create_task(load.run(args.concurrency, stop))
            await asyncio.sleep(args.cpu)
            stop.set()
            await runner
            n = len(load.outcomes)
            out[f"{kind}_cpu_ms_per_req"] = round((cpu_s(side.pid) - c0) * 1e3 / n, 3)
            if ratio:
                out["events_per_stream"] = round(sum(len(o.tokens) + 2 for o in load.outcomes) / n, 1)
        c0 = cpu_s(side.pid)
        rps = await closed_loop(side.url + "/v1/models", 16, args.models_s)
        out["models_cpu_ms_per_req"] = round((cpu_s(side.pid) - c0) * 1e3 / (rps * args.models_s), 3)
        out["models_rps"] = round(rps)
        out["stream_reads_lane_share"] = await lane_share(s, side.url)
    extra = out["stream_cpu_ms_per_req"] - out["whole_cpu_ms_per_req"]
    out["cpu_us_per_sse_event"] = round(extra * 1e3 / out["events_per_stream"], 1)
    return out


def breakdown(records: list[dict], faults: list[float]) -> str:
    """The router's record of each failover against the fault (one clock: CLOCK_MONOTONIC, both
    processes): kill -> detected, -> switched, -> the first event relayed from the new primary."""
    parts: dict[str, list[float]] = {"kill->detected": [], "detected->switched": [], "switched->first_ok": []}
    for rec in records:
        m = rec["monotonic"]
        before = [f for f in faults if f <= m["detected"]]
        if not before:
            continue
        parts["kill->detected"].append((m["detected"] - before[-1]) * 1e3)
        parts["detected->switched"].append((m["switched"] - m["detected"]) * 1e3)
        parts["switched->first_ok"].append((m["first_ok"] - m["switched"]) * 1e3)
    return "; ".join(f"{k} p50={percentile(v, 50):.1f} max={max(v, default=float('nan')):.1f} ms" for k, v in parts.items())


async def phase_haproxy(model: Path, args, logs: Path) -> dict:
    p1, p2 = free_port(), free_port()
    t0 = time.monotonic()
    servers = {"primary": EngineProc(model, p1, log_dir=logs), "standby": EngineProc(model, p2, log_dir=logs)}
    await asyncio.gather(*(e.wait_ready() for e in servers.values()))
    started = time.monotonic() - t0
    print(f"# HAProxy phase: its two engines started in {started:.1f} s"
          + (f"; --interval {args.interval:g} s is not longer: each kill waits for the last one's replacement"
             if started >= args.interval else ""), flush=True)
    hap, url = start_haproxy(logs, p1, p2, args.proxy_cpu_set)
    try:
        await asyncio.sleep(1.0)
        async with aiohttp.ClientSession() as s:
            threads = {"engine_cpu_threads": await engine_threads(s, servers["primary"].url)}
        ov = (await overhead(servers["primary"].url, {"haproxy": url}, args.overhead_n))["haproxy"]
        models = {"models_direct_rps": round(await closed_loop(servers["primary"].url + "/v1/models", 16, args.models_s)),
                  "models_rps": round(await closed_loop(url + "/v1/models", 16, args.models_s))}

        starting: list[asyncio.Task] = []  # the last kill's replacement

        async def kill_primary() -> float:
            # as in the router phase: the last kill's replacement serves again before the next kill,
            # so each kill is of a serving primary with a ready backup, even where an engine's start
            # outlasts --interval (a fresh 16-core GPU machine: over 8 s)
            if starting:
                await starting.pop()
            t = time.monotonic()
            servers["primary"].kill()
            servers["primary"] = e = EngineProc(model, p1, log_dir=logs)  # back on the port HAProxy knows
            starting.append(asyncio.create_task(replacement(e, args.nice_replacement)))
            return t

        load = Load(url, seed=args.seed)
        async with aiohttp.ClientSession() as s:
            await load.learn_expected(s)
        result = await drive(load, args.kills, args.interval, args.concurrency, kill_primary, hap.pid)
    finally:
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        stop_haproxy(hap)
        for e in servers.values():
            e.kill()
    return result | ov | models | threads


# (metric, target for router / haproxy, or for the router's own figure with "abs")
TARGETS = {"rps": (">=", 0.95), "latency_p50_ms": ("<=", 1.10), "latency_p99_ms": ("<=", 1.10),
           "added_p50_ms": ("abs<=", 0.15), "longest_stream_stall_ms": ("<=", 1.0),
           "failed": ("abs<=", 0), "broken_streams": ("abs<=", 0)}


def _verdict(key: str, a, b) -> str:
    if key not in TARGETS or not isinstance(a, (int, float)):
        return ""
    op, target = TARGETS[key]
    if op == "abs<=":
        return "ok" if a <= target else f"MISS (<= {target})"
    if not isinstance(b, (int, float)) or b <= 0:
        return ""
    r = a / b
    good = r >= target if op == ">=" else r <= target
    return "ok" if good else f"MISS ({op} {target})"


def print_report(ours: dict[str, dict], theirs: dict) -> None:
    keys = ["requests", "failed", "broken_streams", "blackout_p50_ms", "blackout_p99_ms", "longest_stream_stall_ms",
            "latency_p50_ms", "latency_p99_ms", "latency_p99_calm_ms", "added_p50_ms", "added_p99_ms", "rps", "models_rps",
            "models_direct_rps", "proxy_cpu_ms_per_req", "resume_prefill_ms", "engine_cpu_threads", "stream_reads_lane_share"]
    names = [f"router/{loop}" for loop in ours]
    print(f"{'metric':<26}" + "".join(f"{n:>16}" for n in names) + f"{'haproxy':>10}"
          + "".join(f"{'ratio ' + n.split('/')[1]:>16}{'target':>18}" for n in names))
    for k in keys:
        b = theirs.get(k)
        row = f"{k:<26}" + "".join(f"{r.get(k)!s:>16}" for r in ours.values()) + f"{b!s:>10}"
        for r in ours.values():
            a = r.get(k)
            ratio = f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else "-"
            row += f"{ratio:>16}{_verdict(k, a, b):>18}"
        print(row)
    print("ratio = router / haproxy; latency_p99_calm_ms: less the requests within 2 s after a kill; models_rps at 16 clients (router's models_direct_rps: its primary, direct)")
    for loop, r in ours.items():
        if "haproxy_added_p50_ms" in r:
            print(f"added latency ({loop}), router and HAProxy interleaved over the router phase's engines, one sitting: "
                  f"p50 {r['added_p50_ms']} / {r['haproxy_added_p50_ms']} ms, p99 {r['added_p99_ms']} / "
                  f"{r['haproxy_added_p99_ms']} ms (the table's haproxy column: its own phase)")
    for loop, r in ours.items():
        print(client_line(f"failover router ({loop})", r["client"]))
        recs = list({rec["at"]: rec for rec in r["records"]}.values())
        print(f"router's own record ({loop}) over {len(recs)} failovers: "
              + "; ".join(f"{k} p50={percentile([x[k] for x in recs], 50)} max={max((x[k] for x in recs), default=None)}"
                          for k in ("detect_ms", "switch_ms", "blackout_ms")))
        print(f"router's record vs the kill ({loop}): {breakdown(recs, r['faults'])}")
        print(f"failed_by_cause router ({loop}):", json.dumps(r["failed_by_cause"]), " longest stall:", json.dumps(r["stall"]))
    print(client_line("haproxy", theirs["client"]))
    print("failed_by_cause haproxy:", json.dumps(theirs["failed_by_cause"]), " longest stall:", json.dumps(theirs["stall"]))
    for name, r in [(f"router ({loop})", r) for loop, r in ours.items()] + [("haproxy", theirs)]:
        print(f"slowest 1 % {name} (near_fault: within {CALM_S:.0f} s after a kill):", json.dumps(r.get("tail", {})))


async def main_async(args) -> int:
    from failover_common.logs import configure_logging
    from failover.tools.tiny_model import TinySpec, write_checkpoint
    from router import evloop

    configure_logging("warning", process="vs-haproxy")

    if shutil.which("haproxy") is None:
        print("haproxy not found: install it from your distribution (e.g. apt-get install haproxy), or carry one "
              "packed by bench/haproxy_carry.sh and put its bin/ on PATH", file=sys.stderr)
        return 2
    loops = args.loop or ["auto"]
    if args.keep_logs is not None:  # the engines', HAProxy's and the token's files stay there
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(args.keep_logs)) if args.keep_logs is not None
          else tempfile.TemporaryDirectory(prefix="vs-haproxy-")) as tmp:
        tmp = Path(tmp)
        model = write_checkpoint(tmp / "model", TinySpec(layers=2, hidden=64))
        if args.cpu:
            print(f"# router CPU, no faults, {args.cpu:.0f} s per kind, concurrency {args.concurrency}, "
                  f"load average {os.getloadavg()[0]:.2f}")
            for loop in loops:
                print(evloop.name(loop), json.dumps(await cpu_phase(model, args, tmp, loop)))
            return 0
        version = subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout.split("\n")[0]
        where = "in the bench's process" if args.in_process else "own process"
        print(f"# vs_haproxy  {date.today()}  {platform.node()}  {hostinfo.cpus()}"
              f"  kills={args.kills} interval={args.interval}s concurrency={args.concurrency}  {version}"
              f"  router: {where}, loops {[evloop.name(k) for k in loops]} workers {args.router_workers}"
              f"  nice-replacement={args.nice_replacement} engine-threads={args.engine_threads or 'torch default'}"
              f"  proxy-cpus={args.proxy_cpus or 'kernel'}"
              f"  load average {os.getloadavg()[0]:.2f}")
        ours = {}
        for loop in loops:
            for n in args.router_workers:
                name = evloop.name(loop) if not args.in_process else "in-process"
                ours[name + (f" x{n}" if n > 1 else "")] = await phase_router(model, args, tmp, loop, n)
        theirs = await phase_haproxy(model, args, tmp)
        print(f"# load average after: {os.getloadavg()[0]:.2f}")
        print_report(ours, theirs)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--interval", type=float, default=8.0, help="seconds between kills (> engine start time)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--overhead-n", type=int, default=400,
                   help="sequential requests per side for the added latency (direct, router, HAProxy interleaved)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models-s", type=float, default=3.0, help="seconds of /v1/models at 16 clients, each way")
    p.add_argument("--loop", action="append", choices=("auto", "uvloop", "asyncio"),
                   help="the router's event loop; repeat for one router phase each (default: auto)")
    p.add_argument("--cpu", type=float, default=0.0, metavar="S",
                   help="only the router's CPU per request and per SSE event, S seconds per kind, no faults")
    p.add_argument("--nice-replacement", type=int, default=SupervisorConfig().standby_nice, metavar="N",
                   help="start each replacement engine (both phases) N nice levels below the bench until it "
                        "is ready, as the supervisor starts a standby (default: its supervisor.standby_nice, "
                        "%(default)s; 0: as is)")
    p.add_argument("--engine-threads", type=int, default=share(len(os.sched_getaffinity(0)), 1), metavar="N",
                   help="each engine's --cpu-threads, both phases (default: what the supervisor gives one "
                        "service's engine on this machine, %(default)s; 0: torch's default, one per core)")
    p.add_argument("--in-process", action="store_true", help="run the router on the bench's own loop")
    p.add_argument("--router-workers", type=int, action="append", metavar="N",
                   help="N router processes on the one port (failover router --workers; docs/router.md); "
                        "repeat for one router phase each, per --loop (default: 1)")
    p.add_argument("--router-log-level", default="warning", choices=("debug", "info", "warning"),
                   help="the router process's log level (its log goes to this bench's stderr)")
    p.add_argument("--keep-logs", type=Path, metavar="DIR",
                   help="write the engines' and HAProxy's logs (and the model) into DIR and keep them")
    p.add_argument("--profile", type=Path, help="py-spy the router process; raw stacks into DIR")
    p.add_argument("--proxy-cpus", default="", metavar="LIST",
                   help="both proxies (the router's process, HAProxy) on these CPUs, e.g. 0, and the engines on "
                        "the others, as router.cpus places a node (docs/operations.md); default: the kernel's choice")
    args = p.parse_args()
    args.router_workers = args.router_workers or [1]
    EngineProc.cpu_threads = args.engine_threads
    if args.in_process and args.router_workers != [1]:
        p.error("--router-workers runs worker processes: drop --in-process")
    if args.in_process and args.profile:
        p.error("--profile samples the router's own process: drop --in-process")
    args.proxy_cpu_set = None
    if args.proxy_cpus:
        if args.in_process:
            p.error("--proxy-cpus places the router's own process: drop --in-process")
        try:
            args.proxy_cpu_set, EngineProc.cpus = cpus.split(args.proxy_cpus)
        except ValueError as e:
            p.error(f"--proxy-cpus: {e}")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
