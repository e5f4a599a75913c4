"""The router's own cost per request, without torch: a stub engine, the router in front of it.

    python3 bench/router_micro.py [-n 2000] [--loop uvloop] [--events 16] [--gap 0.002 --kinds stream] [--idle 10]
                                  [--closed 16 --seconds 3] [--think 0.003 --kinds completion]
                                  [--haproxy] [--floor]

A stub upstream (an aiohttp app in its own process: ``/ready``, ``/v1/models``, ``/v1/completions``
whole or streamed with token ids, answered at once) stands in for the engine, so what differs between
"direct" and "through the router" is the router alone. Sequential requests, direct and proxied
interleaved, from one aiohttp client in this process (the same client both ways): the added latency
p50/p99 per kind, as bench/vs_haproxy.py measures it, and the router process's CPU per request
(/proc). Quick enough (seconds) to measure each change; bench/vs_haproxy.py is the real figure.
``--gap S`` spaces the stub's SSE events by S seconds, as an engine's tokens are: each event is then
one read and one write of the router's (back to back, they coalesce into a few reads), so the
stream's CPU per request minus a whole completion's is the router's cost per SSE event.
``--think S`` makes the stub spend S seconds of CPU before each completion, as an engine's forward
pass does: the router then comes back to cold caches, as in bench/vs_haproxy.py (0.003 gives that
bench's added latency; 0 the router's own floor). ``--haproxy`` measures HAProxy the same way in
front of the same stub; ``--floor`` bench/relay_floor.py, the least a relay in Python can do on the
same loop (whole messages by Content-Length, forwarded unchanged): what separates the router from it
is the router's own work, what separates it from HAProxy is the loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines import free_port  # noqa: E402
from loadgen import percentile  # noqa: E402
from vs_haproxy import cpu_s  # noqa: E402


def stub_app(events: int, gap: float = 0.0, think: float = 0.0):
    from aiohttp import web

    async def ready(_):
        return web.json_response({"ready": True})

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        n = min(int(body.get("max_tokens", 1)), events)
        if think > 0:  # an engine's forward pass: CPU busy, then the answer (the router sleeps meanwhile)
            end = time.perf_counter() + think
            while time.perf_counter() < end:
                pass
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "stub",
                                      "choices": [{"index": 0, "text": "x" * n, "token_ids": list(range(n)),
                                                   "finish_reason": "length"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            ev = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "stub",
                  "choices": [{"index": 0, "text": "x", "token_ids": [i],
                               "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            if gap:
                await asyncio.sleep(gap)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.add_routes([web.get("/ready", ready), web.get("/v1/models", models),
                    web.post("/v1/completions", completions)])
    return app


async def router_child(port: int, upstream: str, loop: str) -> None:
    from router.app import Router
    from router.config import RouterConfig

    router = Router(RouterConfig(port=port))
    router.add_instance("default", "stub", upstream, "primary")
    await router.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await router.stop()


def spawn(*args: str, profile: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, __file__, *args]
    if profile is not None:  # py-spy's raw stacks of the router (pip install py-spy)
        cmd = [str(Path(sys.executable).parent / "py-spy"), "record", "-f", "raw", "-r", "500", "-o", str(profile),
               *(["--native"] if os.environ.get("PYSPY_NATIVE") else []),
               "--", *cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    while (line := p.stdout.readline()) and line.strip() != "ready":
        pass
    if not line:
        raise RuntimeError(f"child {args} did not start")
    return p


async def measure(direct: str, proxied: str, n: int, router_pid: int, events: int,
                  only: list[str] | None = None) -> dict:
    kinds = {"completion": ("POST", "/v1/completions", {"model": "stub", "prompt": "Hi", "max_tokens": 1}),
             "stream": ("POST", "/v1/completions", {"model": "stub", "prompt": "Hi", "max_tokens": events,
                                                    "stream": True}),
             "models": ("GET", "/v1/models", None)}
    out = {}
    async with aiohttp.ClientSession() as s:
        for kind, (method, path, body) in kinds.items():
            if only and kind not in only:
                continue
            lat: dict[str, list[float]] = {"direct": [], "proxied": []}
            for i in range(20):  # warm both connections
                async with s.request(method, (direct, proxied)[i % 2] + path, json=body) as r:
                    await r.read()
            cpu = 0.0
            for i in range(2 * n):
                key, base = ("direct", direct) if i % 2 == 0 else ("proxied", proxied)
                c0 = cpu_s(router_pid) if key == "proxied" else 0.0
                t = time.perf_counter()
                async with s.request(method, base + path, json=body) as r:
                    await r.read()
                lat[key].append(time.perf_counter() - t)
                if key == "proxied":
                    cpu += cpu_s(router_pid) - c0
            d50, p50 = percentile(lat["direct"], 50), percentile(lat["proxied"], 50)
            d99, p99 = percentile(lat["direct"], 99), percentile(lat["proxied"], 99)
            out[kind] = {"direct_p50_ms": round(d50 * 1e3, 3), "added_p50_ms": round((p50 - d50) * 1e3, 3),
                         "added_p99_ms": round((p99 - d99) * 1e3, 3),
                         "router_cpu_ms_per_req": round(cpu * 1e3 / n, 3)}
    return out


async def closed_loop(direct: str, proxied: str, clients: int, seconds: float, router_pid: int, events: int,
                      only: list[str] | None = None) -> dict:
    """``clients`` closed-loop clients for ``seconds`` per kind, direct then through the router:
    requests/s each way and the router's CPU per proxied request (this client and the stub share
    the two cores, so req/s is the whole chain's; the router's CPU per request is its own)."""
    kinds = {"completion": ("POST", "/v1/completions", {"model": "stub", "prompt": "Hi", "max_tokens": 1}),
             "stream": ("POST", "/v1/completions", {"model": "stub", "prompt": "Hi", "max_tokens": events,
                                                    "stream": True}),
             "models": ("GET", "/v1/models", None)}
    out = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        for kind, (method, path, body) in kinds.items():
            if only and kind not in only:
                continue
            rates = {}
            for key, base in (("direct", direct), ("proxied", proxied)):
                done = 0
                stop = time.monotonic() + seconds

                async def client() -> None:
                    nonlocal done
                    while time.monotonic() < stop:
                        async with s.request(method, base + path, json=body) as r:
                            await r.read()
                        done += 1
                c0, t = cpu_s(router_pid), time.monotonic()
                await asyncio.gather(*(client() for _ in range(clients)))
                rates[key] = (done / (time.monotonic() - t), (cpu_s(router_pid) - c0) / max(done, 1))
            out[f"{kind}-c{clients}"] = {"direct_req_s": round(rates["direct"][0]), "proxied_req_s": round(rates["proxied"][0]),
                                         "ratio": round(rates["proxied"][0] / rates["direct"][0], 2),
                                         "router_cpu_ms_per_req": round(rates["proxied"][1] * 1e3, 3)}
    return out


async def with_haproxy(upstream: str, up_port: int, args) -> dict:
    """The same measure through HAProxy (from the distribution) in front of the same stub."""
    import tempfile
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="router-micro-") as tmp:
        cfg = Path(tmp) / "haproxy.cfg"
        cfg.write_text("global\n    maxconn 2000\ndefaults\n    mode http\n    timeout connect 1s\n"
                       "    timeout client 120s\n    timeout server 120s\n"
                       f"listen llm\n    bind 127.0.0.1:{port}\n    server s 127.0.0.1:{up_port}\n")
        hap = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            await asyncio.sleep(0.5)
            return await measure(upstream, f"http://127.0.0.1:{port}", args.n, hap.pid, args.events, args.kinds)
        finally:
            hap.terminate()
            hap.wait(10)


async def with_floor(upstream: str, up_port: int, args) -> dict:
    """The same measure through bench/relay_floor.py (the least a Python relay can do) on the
    router's loop, in front of the same stub."""
    port = free_port()
    loop = "asyncio" if args.loop == "asyncio" else "uvloop"
    relay = subprocess.Popen([sys.executable, str(Path(__file__).with_name("relay_floor.py")), str(up_port), str(port),
                              "--loop", loop], stdout=subprocess.PIPE, text=True)
    try:
        if relay.stdout.readline().strip() != "ready":
            raise RuntimeError("bench/relay_floor.py did not start")
        return await measure(upstream, f"http://127.0.0.1:{port}", args.n, relay.pid, args.events,
                             [k for k in (args.kinds or ["completion", "stream", "models"]) if k != "stream"])
    finally:
        relay.terminate()
        relay.wait(10)


async def main_async(args) -> int:
    up_port, r_port = free_port(), free_port()
    up = spawn("--child", "stub", "--port", str(up_port), "--events", str(args.events), "--gap", str(args.gap),
               "--think", str(args.think))
    upstream = f"http://127.0.0.1:{up_port}"
    router = spawn("--child", "router", "--port", str(r_port), "--upstream", upstream, "--loop", args.loop,
                   profile=args.profile)
    try:
        proxied = f"http://127.0.0.1:{r_port}"
        async with aiohttp.ClientSession() as s:
            for _ in range(100):  # the router's first probe
                async with s.get(proxied + "/ready") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.05)
        pid = router.pid if args.profile is None else int(subprocess.check_output(["pgrep", "-P", str(router.pid)]))
        res = {"router": await measure(upstream, proxied, args.n, pid, args.events, args.kinds)}
        if args.closed:  # throughput: closed-loop clients
            res["router"] |= await closed_loop(upstream, proxied, args.closed, args.seconds, pid, args.events, args.kinds)
        if args.idle:  # the router with nothing to serve: its probes and timers alone
            c0 = cpu_s(pid)
            await asyncio.sleep(args.idle)
            res["router"]["idle"] = {"cpu_ms_per_s": round((cpu_s(pid) - c0) * 1e3 / args.idle, 1)}
        if args.haproxy:
            res["haproxy"] = await with_haproxy(upstream, up_port, args)
        if args.floor:
            res["floor"] = await with_floor(upstream, up_port, args)
        print(f"# router_micro n={args.n} loop={args.loop} events={args.events} gap={args.gap} think={args.think} "
              f"load average {os.getloadavg()[0]:.2f}")
        for who, kinds in res.items():
            for kind, r in kinds.items():
                print(f"{who:<8} {kind:<12}", json.dumps(r))
    finally:
        if args.profile is not None:  # the router itself: py-spy writes its file when it exits
            os.kill(int(subprocess.check_output(["pgrep", "-P", str(router.pid)])), signal.SIGTERM)
        for p in (router, up):
            if args.profile is None or p is up:
                p.send_signal(signal.SIGTERM)
            p.wait(30)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=2000, help="requests per kind, each way")
    p.add_argument("--events", type=int, default=16, help="SSE events per streamed answer")
    p.add_argument("--idle", type=float, default=0.0, metavar="S",
                   help="then S seconds idle: the router's CPU per second with no request (probes, timers)")
    p.add_argument("--gap", type=float, default=0.0, help="seconds between the stub's SSE events")
    p.add_argument("--think", type=float, default=0.0, metavar="S",
                   help="the stub spends S seconds of CPU before each completion, as an engine's forward "
                        "pass does (bench/vs_haproxy.py's engines: ~0.003 a one-token completion)")
    p.add_argument("--kinds", action="append", choices=("completion", "stream", "models"),
                   help="only these kinds (repeatable; default all)")
    p.add_argument("--closed", type=int, default=0, metavar="C",
                   help="then C closed-loop clients per kind, direct and proxied: requests/s, router CPU per request")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per kind and way of --closed")
    p.add_argument("--loop", default="auto", choices=("auto", "uvloop", "asyncio"))
    p.add_argument("--haproxy", action="store_true", help="also through HAProxy, in front of the same stub")
    p.add_argument("--floor", action="store_true",
                   help="also through bench/relay_floor.py (a bare Python relay on the same loop; no streams)")
    p.add_argument("--profile", type=Path, help="py-spy the router; raw stacks into this file")
    p.add_argument("--child", choices=("stub", "router"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    args = p.parse_args()
    from router import evloop
    if args.child == "stub":
        from aiohttp import web
        from failover_common.proc import die_with_parent
        die_with_parent(signal.SIGTERM)
        web.run_app(stub_app(args.events, args.gap, args.think), host="127.0.0.1", port=args.port, print=lambda *_: print("ready", flush=True),
                    access_log=None)
        return 0
    if args.child == "router":
        from failover_common.logs import configure_logging
        from failover_common.proc import die_with_parent
        die_with_parent(signal.SIGTERM)
        configure_logging("warning", process="router-micro")
        return evloop.run(router_child(args.port, args.upstream, args.loop), args.loop) or 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
