"""``failover demo``: a whole node on CPU, a kill -9 of the primary under load, and the figures.

It writes a tiny model to a temp dir, brings up the cache daemon, the zygote, a primary and a hot
standby and the router (the same Supervisor that ``failover up`` runs), sends traffic, kills the
primary, and prints a timeline plus one ``key=value`` line per figure (for scripts), then shuts down
and checks that nothing was left behind. Exit 0 when no request failed and the node ended clean.
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
from failover_common.ports import free_ports


def free_port_pair() -> int:
    """A free port whose successor is free too (a primary and a standby)."""
    return free_ports(2)


@dataclass
class Traffic:
    url: str
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = {"model": "chat", "prompt": f"client {i} says hello #{n}", "max_tokens": 16,
                    "temperature": 0, "stream": n % 2 == 0}
            try:
                async with session.post(self.url + "/v1/completions", json=body) as resp:
                    text = await resp.text()
                    good = resp.status == 200 and ("[DONE]" in text if body["stream"] else '"choices"' in text)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                good, text = False, f"{type(e).__name__}: {e}"
            if good:
                self.ok += 1
            else:
                self.failed += 1
                self.errors.append(text[:200])


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


def node_config(workdir: Path, model: Path, launch: str) -> dict:
    router_port = free_port_pair()
    engine_port = free_port_pair()
    while engine_port in (router_port, router_port + 1) or engine_port + 1 == router_port:
        engine_port = free_port_pair()
    return {
        "run_dir": str(workdir / "run"),
        "model": {"path": str(model), "dtype": "float32", "device": "cpu"},
        "router": {"port": router_port, "probe_interval": 0.2, "probe_timeout": 1.0, "probe_threshold": 2},
        "supervisor": {"launch": launch, "log_level": "warning", "stop_timeout": 5.0, "drain_timeout": 5.0},
        "service": [{"name": "chat", "standbys": 1, "kv_memory": "16MiB", "max_batch": 8, "port": engine_port}],
    }


async def run(args: argparse.Namespace, workdir: Path) -> int:
    from failover.node.supervisor import Supervisor
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    tl = Timeline()
    model = write_checkpoint(workdir / "model", TinySpec(layers=2, hidden=64))
    tl.now(f"tiny model written to {model}")
    config = parse_config(node_config(workdir, model, args.launch), source="demo")
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
        left = [p for p in pids if _alive(p)]
        run_left = config.run_path.exists()
        tl.now(f"shut down in {time.monotonic() - t_stop:.2f} s; processes left: {len(left)}; "
               f"run dir left: {'yes' if run_left else 'no'}")
        print(f"leftover_processes={len(left)}")
        print(f"leftover_run_dir={int(run_left)}")
        if left or run_left:
            print("failover demo: the node did not end clean", file=sys.stderr)
            os._exit(1)


async def drill(args: argparse.Namespace, sup, config, tl: Timeline) -> int:
    router = sup.router
    traffic = Traffic(config.router_url)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.ensure_future(traffic.client(session, i)) for i in range(args.clients)]
        await asyncio.sleep(args.warmup)
        tl.now(f"traffic: {args.clients} clients, {traffic.ok} requests done so far")
        victim = router.services["chat"].primary
        slot = sup.slots[victim.name]
        before = len(router.promoter.last_failover)
        tl.holding = True  # the failover's events are measured out of order; print them sorted
        kill_at, kill_wall = time.monotonic(), time.time()
        os.kill(slot.pid, signal.SIGKILL)
        tl.at(kill_at, f"kill -9 {victim.name} (pid {slot.child.pid}), the primary")
        await _until(lambda: not slot.child.alive, 10)
        tl.at(slot.evicted_at, f"supervisor sees the exit (pidfd): {(slot.evicted_at - kill_at) * 1e3:.1f} ms after the kill")
        new_primary = router.services["chat"].primary
        tl.now(f"router switched to {new_primary.name if new_primary else '?'}")
        await _until(lambda: len(router.promoter.last_failover) > before or "chat" in router.promoter.last_failover, 20)
        fo = router.promoter.last_failover["chat"]
        tl.at(kill_at + (fo["at"] - kill_wall), f"first good answer from {fo['new']}: blackout "
              f"{fo['blackout_ms']:.1f} ms (old primary's last good answer to the new one's first)")
        await _until(lambda: slot.state == "running" and slot.last_relaunch_s is not None
                     and slot.ready_at and slot.ready_at > kill_at, 60)
        tl.at(slot.ready_at, f"{victim.name} relaunched through the {config.supervisor.launch} and ready as standby "
              f"(pid {slot.pid}, weights {slot.ready_info.get('weights_source')}): "
              f"{slot.last_relaunch_s * 1e3:.1f} ms after the kill")
        tl.holding = False
        tl.flush()
        await asyncio.sleep(args.after)
        traffic.stop.set()
        await asyncio.gather(*clients)
        tl.now(f"traffic stopped: {traffic.ok + traffic.failed} requests, {traffic.failed} failed")
    print()
    print("figures:")
    print(f"blackout_ms={fo['blackout_ms']:.1f}")
    print(f"detect_ms={fo['detect_ms']:.1f}")
    print(f"switch_ms={fo['switch_ms']:.3f}")
    print(f"exit_seen_ms={(slot.evicted_at - kill_at) * 1e3:.1f}")
    print(f"relaunch_ms={slot.last_relaunch_s * 1e3:.1f}")
    print(f"relaunch_launch={config.supervisor.launch}")
    print(f"relaunch_weights_source={slot.ready_info.get('weights_source')}")
    print(f"requests={traffic.ok + traffic.failed}")
    print(f"failed={traffic.failed}")
    for err in traffic.errors[:5]:
        print(f"  failed request: {err}", file=sys.stderr)
    return 0 if traffic.failed == 0 else 1


async def _until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the demo waited too long; see the node log")
        await asyncio.sleep(0.005)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="failover demo", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (half of the requests stream)")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds of traffic before the kill")
    p.add_argument("--after", type=float, default=1.0, help="seconds of traffic after the replacement is ready")
    p.add_argument("--launch", choices=["zygote", "spawn"], default="zygote")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (model, node.log)")
    a = p.parse_args(argv)
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
