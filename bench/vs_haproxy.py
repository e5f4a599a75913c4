"""Our router and HAProxy side by side: same engines, same load, same kill -9 schedule.

    python3 bench/vs_haproxy.py [--kills 10] [--interval 8] [--concurrency 4]

HAProxy comes from the distribution (`apt-get install haproxy`); this script installs nothing. It is
configured as aggressively as it allows: primary as a normal server, standby as `backup`,
`check inter 100ms fall 1 rise 1`, `observe layer4 error-limit 1 on-error mark-down`, `retries 3`,
`option redispatch`, `retry-on all-retryable-errors`. In both phases a killed engine is replaced by a
fresh process at once (for HAProxy on the same port, as its configuration is static; for our router
as a new standby, registered when ready, which is what the supervisor does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines import EngineProc, free_port  # noqa: E402
from client_figures import line as client_line  # noqa: E402
from loadgen import Load, percentile, summary  # noqa: E402

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


async def overhead(direct: str, proxied: str, n: int) -> dict:
    """Sequential one-token completions, direct vs through the proxy: the added latency."""
    lat: dict[str, list[float]] = {"direct": [], "proxied": []}
    async with aiohttp.ClientSession() as s:
        async with s.get(direct + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
        for i in range(2 * n):
            key, base = ("direct", direct) if i % 2 == 0 else ("proxied", proxied)
            t = time.perf_counter()
            async with s.post(base + "/v1/completions", json=body) as r:
                await r.read()
            lat[key].append(time.perf_counter() - t)
    d50, p50 = percentile(lat["direct"], 50), percentile(lat["proxied"], 50)
    d99, p99 = percentile(lat["direct"], 99), percentile(lat["proxied"], 99)
    return {"added_p50_ms": round((p50 - d50) * 1e3, 2), "added_p99_ms": round((p99 - d99) * 1e3, 2)}


async def drive(load: Load, kills: int, interval: float, concurrency: int, kill_primary) -> dict:
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(concurrency, stop))
    faults, t0 = [], time.monotonic()
    await asyncio.sleep(interval / 2)
    for _ in range(kills):
        faults.append(await kill_primary())
        await asyncio.sleep(interval)
    stop.set()
    await runner
    return summary(load.outcomes, faults, time.monotonic() - t0)


async def phase_router(model: Path, args, logs: Path) -> dict:
    from router.app import Router
    from router.config import RouterConfig

    engines: dict[str, EngineProc] = {}

    class BenchLauncher:
        async def request_standby(self, service: str) -> None:
            e = EngineProc(model, log_dir=logs)
            name = f"e{e.port}"
            engines[name] = e
            await e.wait_ready()
            router.add_instance(service, name, e.url, "standby", e.pid)

        async def fence(self, name: str) -> None:
            engines[name].kill()

        async def preempt(self, service: str) -> None: ...
        async def resume(self, service: str) -> None: ...

    router = Router(RouterConfig(port=free_port()), BenchLauncher())
    first = [EngineProc(model, log_dir=logs) for _ in range(2)]
    await asyncio.gather(*(e.wait_ready() for e in first))
    for e, role in zip(first, ("primary", "standby")):
        engines[f"e{e.port}"] = e
        router.add_instance("default", f"e{e.port}", e.url, role, e.pid)
    await router.start()
    try:
        ov = await overhead(first[0].url, router.url, args.overhead_n)

        async def kill_primary() -> float:
            svc = router.services["default"]
            # as in the HAProxy phase, where the backup is never the one killed, a ready standby
            # must be there: the previous kill's replacement may still be starting
            while svc.routable() is None or not any(i.ready for i in svc.standbys()):
                await asyncio.sleep(0.05)
            name = svc.routable().name
            t = time.monotonic()
            engines[name].signal(signal.SIGKILL)
            return t

        load = Load(router.url, seed=args.seed)
        async with aiohttp.ClientSession() as s:
            await load.learn_expected(s)
        result = await drive(load, args.kills, args.interval, args.concurrency, kill_primary)
    finally:
        await router.stop()
        for e in engines.values():
            e.kill()
    return result | ov


async def phase_haproxy(model: Path, args, logs: Path) -> dict:
    p1, p2, port = free_port(), free_port(), free_port()
    servers = {"primary": EngineProc(model, p1, log_dir=logs), "standby": EngineProc(model, p2, log_dir=logs)}
    await asyncio.gather(*(e.wait_ready() for e in servers.values()))
    cfg = logs / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port, p1=p1, p2=p2))
    hap = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.sleep(1.0)
        ov = await overhead(servers["primary"].url, url, args.overhead_n)

        async def kill_primary() -> float:
            t = time.monotonic()
            servers["primary"].kill()
            servers["primary"] = EngineProc(model, p1, log_dir=logs)  # back on the port HAProxy knows
            return t

        load = Load(url, seed=args.seed)
        async with aiohttp.ClientSession() as s:
            await load.learn_expected(s)
        result = await drive(load, args.kills, args.interval, args.concurrency, kill_primary)
    finally:
        hap.send_signal(signal.SIGTERM)
        hap.wait(10)
        for e in servers.values():
            e.kill()
    return result | ov


def print_report(ours: dict, theirs: dict) -> None:
    keys = ["requests", "failed", "broken_streams", "blackout_p50_ms", "blackout_p99_ms", "longest_stream_stall_ms",
            "latency_p50_ms", "latency_p99_ms", "added_p50_ms", "added_p99_ms", "rps"]
    print(f"{'metric':<26}{'failover router':>18}{'haproxy':>12}{'ratio':>10}")
    for k in keys:
        a, b = ours.get(k), theirs.get(k)
        ratio = f"{b / a:.1f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 else "-"
        print(f"{k:<26}{a!s:>18}{b!s:>12}{ratio:>10}")
    print(client_line("failover router", ours["client"]))
    print(client_line("haproxy", theirs["client"]))
    print("failed_by_cause  router:", json.dumps(ours["failed_by_cause"]), " haproxy:", json.dumps(theirs["failed_by_cause"]))


async def main_async(args) -> int:
    from failover_common.logs import configure_logging
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    configure_logging("warning", process="vs-haproxy")

    if shutil.which("haproxy") is None:
        print("haproxy not found: install it from your distribution (e.g. apt-get install haproxy)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="vs-haproxy-") as tmp:
        tmp = Path(tmp)
        model = write_checkpoint(tmp / "model", TinySpec(layers=2, hidden=64))
        version = subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout.split("\n")[0]
        print(f"# vs_haproxy  {date.today()}  {platform.node()}  {platform.processor() or platform.machine()}"
              f"  kills={args.kills} interval={args.interval}s concurrency={args.concurrency}  {version}")
        ours = await phase_router(model, args, tmp)
        theirs = await phase_haproxy(model, args, tmp)
        print_report(ours, theirs)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--interval", type=float, default=8.0, help="seconds between kills (> engine start time)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--overhead-n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
