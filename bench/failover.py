"""Failover benchmark of the router: crash and hang of the primary under steady load, and overhead.

    python bench/failover.py                                  # CPU, tiny model: 20 kills, 5 hangs
    python bench/failover.py --kills 5 --hangs 2 --overhead-n 100 --rps-seconds 3   # quick look

Crash phase: the router runs in this process the way the supervisor runs it (a Launcher that fences
by SIGKILL and starts a fresh engine as the replacement standby, registered once ready; each
engine's exit reaches ``Router.instance_exited`` through a pidfd, as in the supervisor), with
closed-loop clients (bench/loadgen.py: completions and chat, streamed and not, every answer checked
against the greedy answer of an uninterrupted run). Each round waits for a ready standby, lets the
load settle, then kill -9s the primary. ``--no-exit-notice`` leaves detection to the router alone
(failed requests and probes), as in standalone use. Hang phase: the same with SIGSTOP; only the
active probe can see it. Overhead phase: a standalone ``failover router`` process in front of one
engine, direct vs through it, sequential latency and closed-loop requests/s.

Per fault, beside those figures: the cores this bench's processes (router, clients, engines) and
all other processes used around it (bench/cpu_share.py), to tell a stall of ours from a shared box.

Blackout, client side (bench/client_figures.py, from each request's own timestamps): per fault, the
fault to the first token or answer any client received after it, the worst in-flight client's wait
for its next token, and the longest stall inside a stream in flight at the fault; p50/p99/max over
the faults. Router side, printed beside it: last good response (or stream chunk) of the old primary
to the first good one of the new (recorded by the router per failover).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostinfo import cpus  # noqa: E402
from engines import EngineProc, free_port  # noqa: E402
from client_figures import fault_figures, line as client_line, stall_span, summarize  # noqa: E402
from cpu_share import CpuSampler  # noqa: E402
from failover_common.tasks import Tasks  # noqa: E402
import timeline_png  # noqa: E402
from loadgen import Load, percentile, summary  # noqa: E402

SERVICE = "default"


def machine() -> str:
    import torch

    return (f"host={platform.node()} {cpus()} python={platform.python_version()} "
            f"torch={torch.__version__} kernel={platform.release()}")


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 1)


class BenchLauncher:
    """The supervisor's part, reduced: fence = SIGKILL, replacement = a fresh engine, exits via pidfd."""

    def __init__(self, model: Path, logs: Path, exit_notice: bool, replace_delay: float) -> None:
        self.model, self.logs, self.exit_notice = model, logs, exit_notice
        self.replace_delay = replace_delay
        self.router = None
        self.engines: dict[str, EngineProc] = {}
        self.replacements: list[float] = []  # when each replacement standby's start began (monotonic)
        self.pending = Tasks()  # replacements not ready yet

    def start(self) -> EngineProc:
        e = EngineProc(self.model, log_dir=self.logs)
        self.engines[f"e{e.port}"] = e
        return e

    def register(self, e: EngineProc, role: str) -> None:
        name = f"e{e.port}"
        self.router.add_instance(SERVICE, name, e.url, role, e.pid)
        if self.exit_notice:
            fd = os.pidfd_open(e.pid)
            loop = asyncio.get_running_loop()

            def exited() -> None:
                loop.remove_reader(fd)
                os.close(fd)
                self.router.instance_exited(name, e.proc.wait())
            loop.add_reader(fd, exited)

    async def request_standby(self, service: str) -> None:
        # On 2 CPU cores a starting engine (torch import, weights) competes with the new primary;
        # --replace-delay keeps that cost out of the failover window, to see the router's own part.
        await asyncio.sleep(self.replace_delay)
        self.replacements.append(time.monotonic())
        e = self.start()  # registered once ready, by a task: this call is bounded by fence_timeout
        self.pending.spawn(self._register_when_ready(e), f"standby-e{e.port}")

    async def _register_when_ready(self, e: EngineProc) -> None:
        await e.wait_ready()
        self.register(e, "standby")

    async def fence(self, name: str) -> None:
        await asyncio.to_thread(self.engines[name].kill)

    async def preempt(self, service: str) -> None: ...

    async def resume(self, service: str) -> None: ...

    def stop_all(self) -> None:
        for e in self.engines.values():
            if e.proc.poll() is None:
                e.kill()


async def fault_phase(model: Path, logs: Path, args: argparse.Namespace, sig: int, rounds: int) -> dict:
    from router.app import Router
    from router.config import RouterConfig

    launcher = BenchLauncher(model, logs, exit_notice=args.exit_notice, replace_delay=args.replace_delay)
    router = Router(RouterConfig(port=free_port(), probe_interval=args.probe_interval,
                                 probe_timeout=args.probe_timeout), launcher)
    launcher.router = router
    first = [launcher.start() for _ in range(2)]
    await asyncio.gather(*(e.wait_ready() for e in first))
    for e, role in zip(first, ("primary", "standby")):
        launcher.register(e, role)
    await router.start()
    svc = router.services[SERVICE]
    records, faults = [], []
    try:
        load = Load(router.url, max_tokens=args.max_tokens, seed=args.seed)
        async with aiohttp.ClientSession() as s:
            await load.learn_expected(s)
        stop = asyncio.Event()
        runner = asyncio.create_task(load.run(args.concurrency, stop))
        cpu = CpuSampler(lambda: [os.getpid(), *(e.pid for e in launcher.engines.values())])
        sampler = asyncio.create_task(cpu.run(stop))
        t_start = time.monotonic()
        for i in range(rounds):
            while svc.routable() is None or launcher_pending(svc):
                await asyncio.sleep(0.01)  # the replacement of the previous round is not ready yet
            if records and "relaunched" not in records[-1]:
                records[-1]["relaunched"] = time.monotonic()  # (to the 10 ms poll) for the PNG's mark
            await asyncio.sleep(args.settle)
            victim = svc.primary
            before = router.promoter.last_failover.get(SERVICE)
            faults.append(time.monotonic())
            os.kill(victim.pid, sig)
            deadline = time.monotonic() + 30
            while router.promoter.last_failover.get(SERVICE) is before and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            rec = router.promoter.last_failover.get(SERVICE)
            if rec is before:
                print(f"  round {i + 1}: no completed failover within 30 s", flush=True)
                continue
            mono = rec["monotonic"]
            rec = rec | {"kill_to_detect_ms": (mono["detected"] - faults[-1]) * 1e3,
                         "kill_to_first_ok_ms": (mono["first_ok"] - faults[-1]) * 1e3}
            records.append(rec)
            print(f"  round {i + 1:2d}: {victim.name} -> {rec['new']}  reason={rec['reason']:<7} "
                  f"kill->detect={rec['kill_to_detect_ms']:6.1f} ms  switch={rec['switch_ms']:4.2f} ms  "
                  f"kill->first good={rec['kill_to_first_ok_ms']:6.1f} ms  "
                  f"blackout={rec['blackout_ms']:6.1f} ms", flush=True)
        await asyncio.sleep(args.settle)
        if records and "relaunched" not in records[-1] and svc.routable() is not None and not launcher_pending(svc):
            records[-1]["relaunched"] = None  # ready some time in the settle: not marked rather than mis-marked
        stop.set()
        await asyncio.gather(runner, sampler)
        result = summary(load.outcomes, faults, time.monotonic() - t_start)
        result["per_fault"] = per_fault(load.outcomes, faults, cpu, args.cpu_window, launcher.replacements)
        quiet = [f for f in faults if (cpu.window(f - args.cpu_window, f + args.cpu_window)["others"] or 0.0)
                 < args.quiet_cores]
        result["quiet"] = summarize(fault_figures(load.outcomes, quiet)) | {"cores": args.quiet_cores}
        if args.dump:
            dump = {"faults": faults, "router": records, "outcomes": [dataclasses.asdict(o) for o in load.outcomes]}
            Path(f"{args.dump}.{signal.Signals(sig).name}.json").write_text(json.dumps(dump))
        if args.png:
            png = Path(args.png).with_suffix(f".{signal.Signals(sig).name}.png")
            timeline_png.write(png, load.outcomes, faults, timeline_png.marks_from_router(records),
                               title=f"bench/failover.py: {signal.Signals(sig).name} of the primary")
            print(f"  timeline: {png}", flush=True)
    finally:
        await launcher.pending.stop()
        await router.stop()
        launcher.stop_all()
    blackout = [r["blackout_ms"] / 1e3 for r in records]
    detect = [r["kill_to_detect_ms"] / 1e3 for r in records]
    recover = [r["kill_to_first_ok_ms"] / 1e3 for r in records]
    m = router.metrics
    result |= {"failovers": len(records), "router_blackout_p50_ms": ms(blackout, 50),
               "router_blackout_p99_ms": ms(blackout, 99), "router_blackout_max_ms": ms(blackout, 100),
               "detect_p50_ms": ms(detect, 50), "detect_p99_ms": ms(detect, 99),
               "recover_p50_ms": ms(recover, 50), "recover_p99_ms": ms(recover, 99),
               "migrated_streams": int(m.migrations.labels(SERVICE)._value.get()),
               "retried_requests": int(m.retries.labels(SERVICE)._value.get())}
    return result


def per_fault(outcomes, faults: list[float], cpu: CpuSampler, window: float, starts: list[float]) -> list[str]:
    """One line per fault: what the clients saw, where the longest stream stall lay and when the
    replacement's start began (ms from the fault), and who had the CPU from ``window`` s before the
    fault to ``window`` s after (this bench's processes vs the rest of the machine)."""
    rows = []
    for i, f in enumerate(fault_figures(outcomes, faults)):
        c = cpu.window(f.fault - window, f.fault + window)
        spans = [stall_span(o, f.fault) for o in outcomes if o.stream and o.start <= f.fault < o.end]
        a, b = max(spans, key=lambda ab: ab[1] - ab[0], default=(f.fault, f.fault))
        start = min((t for t in starts if t > f.fault), default=None)
        def ms(v):
            return "-" if v is None else f"{v:6.1f}"
        rows.append(f"  fault {i + 1:2d}: first token {ms(f.first_token_ms)} ms, worst wait {ms(f.worst_wait_ms)} ms, "
                    f"stream stall {ms(f.longest_stall_ms)} ms (+{(a - f.fault) * 1e3:.0f}..+{(b - f.fault) * 1e3:.0f}), "
                    f"replacement started +{ms(None if start is None else (start - f.fault) * 1e3).strip()}, "
                    f"failed {f.failed}/{f.inflight}; cores used +-{window:g} s: this bench {c['ours']}, "
                    f"other processes {c['others']}")
    return rows


def launcher_pending(svc) -> bool:
    """True until the service has a ready standby again (the last round's replacement)."""
    return not any(i.ready for i in svc.standbys())


async def timed(s: aiohttp.ClientSession, method: str, url: str, body: dict | None) -> float:
    t = time.perf_counter()
    async with s.request(method, url, json=body) as r:
        await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - t


async def closed_loop(url: str, method: str, body: dict | None, concurrency: int, seconds: float) -> float:
    done = 0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                async with s.request(method, url, json=body) as r:
                    await r.read()
                done += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / seconds


async def overhead_phase(model: Path, logs: Path, args: argparse.Namespace) -> dict:
    engine = EngineProc(model, log_dir=logs)
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "failover", "router", "--backend", f"e0={engine.url}",
                               "--port", str(port), "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    proxied = f"http://127.0.0.1:{port}"
    try:
        await engine.wait_ready()
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(proxied + "/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            async with s.get(engine.url + "/v1/models") as r:
                model_id = (await r.json())["data"][0]["id"]
            one = {"model": model_id, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
            out = {}
            for label, method, path, body in (("models", "GET", "/v1/models", None),
                                              ("completion1", "POST", "/v1/completions", one)):
                lat = {"direct": [], "router": []}
                for i in range(2 * args.overhead_n):  # interleaved, so drift hits both alike
                    key, base = ("direct", engine.url) if i % 2 == 0 else ("router", proxied)
                    lat[key].append(await timed(s, method, base + path, body))
                out[label] = {
                    "direct_p50_ms": ms(lat["direct"], 50), "router_p50_ms": ms(lat["router"], 50),
                    "added_p50_ms": round((percentile(lat["router"], 50) - percentile(lat["direct"], 50)) * 1e3, 2),
                    "added_p99_ms": round((percentile(lat["router"], 99) - percentile(lat["direct"], 99)) * 1e3, 2)}
        for label, method, path, body, conc in (("models", "GET", "/v1/models", None, 16),
                                                ("completion1", "POST", "/v1/completions", one, 8)):
            direct = await closed_loop(engine.url + path, method, body, conc, args.rps_seconds)
            routed = await closed_loop(proxied + path, method, body, conc, args.rps_seconds)
            out[label] |= {"concurrency": conc, "direct_rps": round(direct, 1), "router_rps": round(routed, 1)}
        return out
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(5)
        engine.kill()


def report(name: str, r: dict) -> None:
    print(f"{name}: failovers={r['failovers']} requests={r['requests']} failed={r['failed']} "
          f"broken_streams={r['broken_streams']} migrated_streams={r['migrated_streams']} "
          f"retried_requests={r['retried_requests']}")
    print(f"{name}: router blackout p50={r['router_blackout_p50_ms']} ms p99={r['router_blackout_p99_ms']} ms "
          f"max={r['router_blackout_max_ms']} ms (last good of old primary -> first good of new)")
    print(f"{name}: fault -> detected p50={r['detect_p50_ms']} ms p99={r['detect_p99_ms']} ms; "
          f"fault -> first good response of the new primary p50={r['recover_p50_ms']} ms "
          f"p99={r['recover_p99_ms']} ms")
    print(client_line(name, r["client"]))
    print("\n".join(r["per_fault"]))
    print(client_line(f"{name}, only the faults where other processes used < {r['quiet']['cores']:g} cores", r["quiet"]))
    print(f"{name}: longest stall inside any stream of the run={r['longest_stream_stall_ms']} ms; "
          f"latency p50={r['latency_p50_ms']} ms p99={r['latency_p99_ms']} ms")
    if r["failed_by_cause"]:
        print(f"{name}: failed by cause {r['failed_by_cause']}")


async def main_async(args: argparse.Namespace) -> int:
    from failover_common.logs import configure_logging
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    configure_logging("warning", process="bench-failover")
    print(f"# bench/failover.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  {machine()}")
    print(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other work on this machine "
          "shares its cores)")
    print(f"# kills={args.kills} hangs={args.hangs} concurrency={args.concurrency} max_tokens={args.max_tokens} "
          f"settle={args.settle}s replace_delay={args.replace_delay}s exit_notice={args.exit_notice} "
          f"probe={args.probe_interval}s/{args.probe_timeout}s x2 (router defaults: 0.1s/0.25s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        tmp = Path(tmp)
        model = write_checkpoint(tmp / "model", TinySpec())
        if args.kills:
            print("crash (kill -9 of the primary):", flush=True)
            report("crash", await fault_phase(model, tmp, args, signal.SIGKILL, args.kills))
        if args.hangs:
            print("hang (SIGSTOP of the primary):", flush=True)
            report("hang", await fault_phase(model, tmp, args, signal.SIGSTOP, args.hangs))
        if args.overhead_n:
            ov = await overhead_phase(model, tmp, args)
            for label, r in ov.items():
                print(f"overhead {label}: added p50={r['added_p50_ms']} ms p99={r['added_p99_ms']} ms "
                      f"(direct p50={r['direct_p50_ms']} ms, router p50={r['router_p50_ms']} ms); "
                      f"requests/s at concurrency {r['concurrency']}: direct={r['direct_rps']} "
                      f"router={r['router_rps']}")
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--hangs", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--settle", type=float, default=1.0, help="steady load before each fault, seconds")
    p.add_argument("--replace-delay", type=float, default=0.0,
                   help="seconds before the replacement standby is started (default: at once, as the supervisor)")
    p.add_argument("--no-exit-notice", dest="exit_notice", action="store_false",
                   help="no process-exit notice: the router detects crashes by itself")
    p.add_argument("--overhead-n", type=int, default=300, help="sequential requests per side (0: skip)")
    p.add_argument("--rps-seconds", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-interval", type=float, default=0.1, help="the router's (default: its default)")
    p.add_argument("--probe-timeout", type=float, default=0.25, help="the router's (default: its default)")
    p.add_argument("--cpu-window", type=float, default=0.5,
                   help="seconds each side of a fault over which the per-fault CPU use is given")
    p.add_argument("--quiet-cores", type=float, default=0.2, help="a fault is 'quiet' when the machine's other "
                   "processes used fewer cores than this around it (the figures are printed for those too)")
    p.add_argument("--dump", metavar="PREFIX", help="write faults, the router's records and every client "
                   "record to PREFIX.SIGKILL.json / PREFIX.SIGSTOP.json")
    p.add_argument("--png", metavar="PATH", help="write a PNG timeline per phase to PATH with .SIGKILL/.SIGSTOP "
                   "before its suffix (needs matplotlib: the [plots] extra)")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
