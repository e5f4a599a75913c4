"""``failover demo``: a whole node on CPU, a kill -9 of the primary under load, and the figures.

It writes a tiny model to a temp dir, brings up the cache daemon, the zygote, a primary and a hot
standby and the router (the same Supervisor that ``failover up`` runs), sends traffic, kills the
primary (``--faults N``: N times, each once the node is whole again), and prints a timeline plus one
``key=value`` line per figure (for scripts), then shuts down and checks that nothing was left behind.
Exit 0 when no request failed and the node ended clean. The figures are first the clients' own, from
the kill (failover_common.client_figures: first token to any client, the worst in-flight client's wait
for its next token, the longest stall inside a stream; p50/p99/max over the faults), then the
router's record beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from failover_common.logs import configure_logging
from failover.config.schema import parse_config
from failover_common.client_figures import fault_figures, line, requests_summary, summarize
from failover_common.ports import free_ports
from failover_common.proc import running


def free_port_pair() -> int:
    """A free port whose successor is free too (a primary and a standby)."""
    return free_ports(2)


@dataclass(slots=True)
class Request:
    """One request as its client saw it (a failover_common.client_figures record)."""
    start: float
    stream: bool
    end: float = 0.0
    ok: bool = False
    tokens: list[float] = field(default_factory=list)  # when each token event of a stream arrived


@dataclass
class Traffic:
    url: str
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    records: list[Request] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = {"model": "chat", "prompt": f"client {i} says hello #{n}", "max_tokens": 16,
                    "temperature": 0, "stream": n % 2 == 0}
            rec = Request(start=time.monotonic(), stream=body["stream"])
            try:
                async with session.post(self.url + "/v1/completions", json=body) as resp:
                    text = await (self._stream(resp, rec) if rec.stream else resp.text())
                    good = resp.status == 200 and ("[DONE]" in text if rec.stream else '"choices"' in text)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                good, text = False, f"{type(e).__name__}: {e}"
            rec.end, rec.ok = time.monotonic(), good
            self.records.append(rec)
            if good:
                self.ok += 1
            else:
                self.failed += 1
                self.errors.append(text[:200])

    @staticmethod
    async def _stream(resp: aiohttp.ClientResponse, rec: Request) -> str:
        events = []
        async for raw in resp.content:
            event = raw.decode(errors="replace").strip()
            if event.startswith("data:") and event != "data: [DONE]":
                rec.tokens.append(time.monotonic())
            events.append(event)
        return "\n".join(events)


class Timeline:
    """Events in time order: printed at once while nothing is pending, else held until ``flush``."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.held: list[tuple[float, str]] = []
        self.holding = False

    def at(self, when: float, text: str) -> None:
        self.held.append((when, text))
        if not self.holding:
            self.flush()

    def now(self, text: str) -> None:
        self.at(time.monotonic(), text)

    def flush(self) -> None:
        for when, text in sorted(self.held):
            print(f"  t={when - self.t0:7.3f}s  {text}", flush=True)
        self.held.clear()


def node_config(workdir: Path, model: Path, launch: str, *, kills: int = 1) -> dict:
    """The demo node. ``kills`` > 1: the drill's kill -9s, spaced by --settle, are independent faults,
    not a crash loop: the crash-loop window is shorter than their spacing, so each replacement starts
    at once (as after a quiet spell) instead of backing off."""
    router_port = free_port_pair()
    engine_port = free_port_pair()
    while engine_port in (router_port, router_port + 1) or engine_port + 1 == router_port:
        engine_port = free_port_pair()
    return {
        "run_dir": str(workdir / "run"),
        "model": {"path": str(model), "dtype": "float32", "device": "cpu"},
        "router": {"port": router_port, "probe_interval": 0.2, "probe_timeout": 1.0, "probe_threshold": 2},
        "supervisor": {"launch": launch, "log_level": "warning", "stop_timeout": 5.0, "drain_timeout": 5.0,
                       **({"crash_loop_window": 0.5} if kills > 1 else {})},
        "service": [{"name": "chat", "standbys": 1, "kv_memory": "16MiB", "max_batch": 8, "port": engine_port}],
    }


async def run(args: argparse.Namespace, workdir: Path) -> int:
    from failover.node.supervisor import Supervisor
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    tl = Timeline()
    model = write_checkpoint(workdir / "model", TinySpec(layers=2, hidden=64))
    tl.now(f"tiny model written to {model}")
    config = parse_config(node_config(workdir, model, args.launch, kills=args.faults), source="demo")
    log_file = open(workdir / "node.log", "wb")
    sup = Supervisor(config, child_output=log_file)
    try:
        await sup.start()
        tl.at(time.monotonic(), f"node serving at {config.router_url}: daemon pid {sup.daemon.child.pid}, "
              f"zygote pid {sup.zygote.child.pid if sup.zygote.alive else '-'}, "
              + ", ".join(f"{s.name} pid {s.pid} ({s.ready_info.get('weights_source')})" for s in sup.slots.values()))
        return await drill(args, sup, config, tl)
    finally:
        t_stop = time.monotonic()
        pids = [c.pid for c in (sup.daemon.child, sup.zygote.child, *(s.child for s in sup.slots.values())) if c]
        await sup.stop()
        log_file.close()
        left = [p for p in pids if running(p)]
        run_left = config.run_path.exists()
        tl.now(f"shut down in {time.monotonic() - t_stop:.2f} s; processes left: {len(left)}; "
               f"run dir left: {'yes' if run_left else 'no'}")
        print(f"leftover_processes={len(left)}")
        print(f"leftover_run_dir={int(run_left)}")
        if left or run_left:
            print("failover demo: the node did not end clean", file=sys.stderr)
            os._exit(1)


async def drill(args: argparse.Namespace, sup, config, tl: Timeline) -> int:
    traffic = Traffic(config.router_url)
    timeout = aiohttp.ClientTimeout(total=60)
    rounds = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.ensure_future(traffic.client(session, i)) for i in range(args.clients)]
        await asyncio.sleep(args.warmup)
        tl.now(f"traffic: {args.clients} clients, {traffic.ok} requests done so far")
        for i in range(args.faults):
            if i:
                await asyncio.sleep(args.settle)
            rounds.append(await kill_primary(sup, config, tl, verbose=i == 0))
            if i:
                kill_at, fo, sv = rounds[-1]
                tl.now(f"fault {i + 1}/{args.faults}: kill -9 {fo['old']} -> {fo['new']}; router's blackout "
                       f"{fo['blackout_ms']:.1f} ms; relaunched in {sv['relaunch_ms']:.0f} ms")
        await asyncio.sleep(args.after)
        traffic.stop.set()
        await asyncio.gather(*clients)
        tl.now(f"traffic stopped: {traffic.ok + traffic.failed} requests, {traffic.failed} failed")
    kill_at, fo, sv = rounds[0]
    client = summarize(fault_figures(traffic.records, [r[0] for r in rounds]))
    whole = requests_summary(traffic.records)
    print()
    print(line("kill -9 of the primary", client))
    print("figures (client_*: what the clients saw from the kill, p99 over the faults; the rest: the "
          "router's and the supervisor's record of the first fault):")
    for key in ("first_token_ms", "worst_wait_ms", "longest_stall_ms"):
        print(f"client_{key}={client[key]['p99']}")
    print(f"faults={len(rounds)}")
    print(f"broken_streams={whole['broken_streams']}")
    print(f"blackout_ms={fo['blackout_ms']:.1f}")
    print(f"detect_ms={fo['detect_ms']:.1f}")
    print(f"switch_ms={fo['switch_ms']:.3f}")
    print(f"exit_seen_ms={sv['exit_seen_ms']:.1f}")
    print(f"relaunch_ms={sv['relaunch_ms']:.1f}")
    print(f"relaunch_launch={config.supervisor.launch}")
    print(f"relaunch_weights_source={sv['weights_source']}")
    print(f"requests={traffic.ok + traffic.failed}")
    print(f"failed={traffic.failed}")
    for err in traffic.errors[:5]:
        print(f"  failed request: {err}", file=sys.stderr)
    return 0 if traffic.failed == 0 else 1


async def kill_primary(sup, config, tl: Timeline, *, verbose: bool) -> tuple[float, dict, dict]:
    """kill -9 the primary; back once it is relaunched as a ready standby. Returns the kill's
    monotonic time, the router's failover record and the supervisor's (``verbose``: a timeline)."""
    router = sup.router
    victim = router.services["chat"].primary
    slot = sup.slots[victim.name]
    before = router.promoter.last_failover.get("chat")
    tl.holding = True  # the failover's events are measured out of order; print them sorted
    kill_at, kill_wall = time.monotonic(), time.time()
    os.kill(slot.pid, signal.SIGKILL)
    if verbose:
        tl.at(kill_at, f"kill -9 {victim.name} (pid {slot.child.pid}), the primary")
    await _until(lambda: not slot.child.alive, 10)
    new_primary, switch_seen = router.services["chat"].primary, time.monotonic()
    await _until(lambda: router.promoter.last_failover.get("chat") is not before, 20)
    fo = router.promoter.last_failover["chat"]
    await _until(lambda: slot.state == "running" and slot.last_relaunch_s is not None
                 and slot.ready_at and slot.ready_at > kill_at, 60)
    await _until(lambda: any(i.ready for i in router.services["chat"].standbys()), 20)
    if verbose:
        tl.at(slot.evicted_at, f"supervisor sees the exit (pidfd): {(slot.evicted_at - kill_at) * 1e3:.1f} ms after the kill")
        tl.at(switch_seen, f"router switched to {new_primary.name if new_primary else '?'}")
        tl.at(kill_at + (fo["at"] - kill_wall), f"first good answer from {fo['new']}: blackout "
              f"{fo['blackout_ms']:.1f} ms (old primary's last good answer to the new one's first)")
        tl.at(slot.ready_at, f"{victim.name} relaunched through the {config.supervisor.launch} and ready as standby "
              f"(pid {slot.pid}, weights {slot.ready_info.get('weights_source')}): "
              f"{slot.last_relaunch_s * 1e3:.1f} ms after the kill")
    tl.holding = False
    tl.flush()
    return kill_at, fo, {"exit_seen_ms": (slot.evicted_at - kill_at) * 1e3, "relaunch_ms": slot.last_relaunch_s * 1e3,
                         "weights_source": slot.ready_info.get("weights_source")}


async def _until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the demo waited too long; see the node log")
        await asyncio.sleep(0.005)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="failover demo", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (half of the requests stream)")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds of traffic before the kill")
    p.add_argument("--after", type=float, default=1.0, help="seconds of traffic after the replacement is ready")
    p.add_argument("--faults", type=int, default=1, help="kill -9s of the primary, each once the node is whole "
                   "again (20: client figures as p50/p99/max)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds of traffic between a relaunch and the next kill")
    p.add_argument("--launch", choices=["zygote", "spawn"], default="zygote")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (model, node.log)")
    a = p.parse_args(argv)
    if a.faults < 1:
        p.error("--faults must be at least 1")
    configure_logging("error", process="demo")
    workdir = Path(tempfile.mkdtemp(prefix="fo-demo-", dir="/tmp"))
    where = "kept after the run" if a.keep else "deleted when the demo ends; --keep keeps it"
    print(f"failover demo: one node on CPU (log: {workdir / 'node.log'}, {where})")
    try:
        return asyncio.run(run(a, workdir))
    except KeyboardInterrupt:
        return 130
    finally:
        if a.keep:
            print(f"failover demo: kept {workdir} (model, node.log)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
