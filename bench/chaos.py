"""Chaos soak: a whole node (``failover up``) under mixed load while a seeded schedule breaks it.

    python3 bench/chaos.py --duration 600 --fault-rate 12 --seed 1 --json chaos.json
    python3 bench/chaos.py --duration 300 --only kill:primary,freeze:primary --min-primary-faults 20

The node is a real ``failover up`` process (a generated tiny model, a generated config, a private run
dir). Load: bench/loadgen.Load's raw aiohttp clients and official-``openai``-SDK clients, completions
and chat, streamed and not, every answer compared with the greedy answer of an uninterrupted run;
plus clients that walk away mid-stream on purpose. Faults (``random.Random(seed)``): SIGKILL, or
SIGSTOP + SIGCONT after 0.5-3 s, of the primary, the standby, the zygote, the cache daemon (and a
batch engine when the supervisor runs ``kind = "batch"`` services); garbage on the daemon's socket
and the admin API. Before each fault the node must be whole again (ready primary and standby, every
slot running, daemon ready, zygote up); the time that takes is the fault's recovery.

Report (printed; ``--json PATH`` writes it too): requests sent and failed (by client and cause, and
by the fault just before), streams migrated (the router's ``failover_router_migrations_total``),
p50/p99 latency of requests overlapping [fault, fault + 2 s] vs the others, the client-seen blackout
of every primary fault (bench/client_figures: first token to any client, the worst in-flight
client's wait, the longest stall inside a stream), the daemon's resident bytes after every daemon
restart vs its baseline, and after a clean shutdown: leftover processes, run-dir files, memfds and
arena mappings. Exit 0 when nothing failed and nothing leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import chaos_faults as cf  # noqa: E402
import chaos_report  # noqa: E402
from chaos_clients import Quitters, SdkClients  # noqa: E402
from chaos_node import REPO, SERVICE, Node, default_starter, leftovers, wait_gone  # noqa: E402
from loadgen import Load  # noqa: E402
import timeline_png  # noqa: E402

@dataclass
class Options:
    duration: float = 600.0
    fault_rate: float = 12.0  # per minute
    seed: int = 1
    concurrency: int = 6
    json_path: Path | None = None
    batch: str = "auto"  # auto | on | off
    log_level: str = "warning"
    warmup: float = 3.0  # calm seconds before the first fault
    keep: bool = False
    only: tuple[str, ...] = ()  # restrict the fault kinds (debugging one class of fault)
    min_faults: int = 0  # go on past the duration (up to twice it) until this many faults were injected
    min_primary_faults: int = 0  # ... and this many of them hit the primary (the client figures' p99)
    png: Path | None = None  # a PNG timeline of the clients' tokens with the primary faults marked


def batch_supported() -> bool:
    """Does the supervisor run ``kind = "batch"`` services yet (issue 6)? Its source tells."""
    text = (REPO / "failover" / "node" / "supervisor.py").read_text()
    return any(name in text for name in ("Coserver", "batch_runner", "BatchRunner"))


@dataclass
class Soak:
    opts: Options
    node: Node
    session: aiohttp.ClientSession
    faults: list[cf.Fault] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    daemon_checks: list[dict] = field(default_factory=list)
    baseline_bytes: int = 0
    arena_keys: set[str] = field(default_factory=set)
    daemon_pid: int | None = None
    t0: float = 0.0

    # -- the daemon's accounting -------------------------------------------------------------------
    async def daemon_bytes(self) -> tuple[int, int, int, set[str]]:
        from cache_daemon.client import status

        st = await asyncio.to_thread(status, str(self.node.socket), timeout=5.0)
        return st.pid, sum(m.nbytes for m in st.models), st.clients - st.attached, {m.key for m in st.models}

    async def check_daemon(self, why: str, fault: cf.Fault | None = None) -> None:
        """The daemon's resident bytes vs the baseline. Called when the supervisor says it is ready,
        so a daemon that does not answer then is a problem of its own (and is waited for)."""
        from cache_daemon.errors import CacheError

        t0 = time.monotonic()
        while True:
            try:
                pid, nbytes, idle, keys = await self.daemon_bytes()
                break
            except CacheError as e:
                if time.monotonic() - t0 > 60.0:
                    raise
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.1)
        if time.monotonic() - t0 > 0.5 and fault is not None:
            fault.problems.append(f"the supervisor said the daemon was ready {time.monotonic() - t0:.1f} s "
                                  f"before it answered ({last})")
        self.arena_keys |= keys
        ok = nbytes == self.baseline_bytes
        self.daemon_checks.append({"why": why, "pid": pid, "bytes": nbytes, "ok": ok,
                                   "idle_connections": idle - 1})  # minus our own status connection
        self.daemon_pid = pid

    # -- waiting for the node to be whole ----------------------------------------------------------
    async def wait_whole(self, timeout: float = 90.0) -> dict | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                doc = await self.node.status(self.session)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                doc = None
            if doc is not None and cf.whole(doc):
                return doc
            await asyncio.sleep(0.1)
        return None

    async def settle(self, fault: cf.Fault) -> None:
        """Until the node is whole after ``fault`` (a killed pid must be gone from it first)."""
        await asyncio.sleep(0.3)
        while True:
            doc = await self.wait_whole()
            if doc is None:
                fault.problems.append("the node was not whole again within 90 s")
                return
            if fault.kind.startswith("kill:") and fault.pid == cf.target_pid(doc, fault.target):
                await asyncio.sleep(0.1)  # the exit notice has not reached the status yet
                continue
            fault.recovered_s = time.monotonic() - fault.at
            last = doc.get("last_failover", {}).get(SERVICE)
            if fault.target == "primary" and last and last["monotonic"]["detected"] >= fault.at:
                # the router's own view of this failover (its monotonic clock is the machine's, as ours)
                fault.detail["router"] = {k: last.get(k) for k in ("old", "new", "reason", "blackout_ms",
                                                                  "detect_ms", "switch_ms") if k in last}
                fault.detail["router_monotonic"] = last["monotonic"]  # the PNG's detect/switch/first-ok marks
            if doc["supervisor"]["daemon"]["pid"] != self.daemon_pid:
                await self.check_daemon(f"after {fault.kind} (t={fault.at - self.t0:.1f}s)", fault)
            return

    # -- one fault ---------------------------------------------------------------------------------
    async def inject(self, kind: str, schedule: cf.Schedule) -> cf.Fault | None:
        doc = await self.node.status(self.session)
        fault = cf.Fault(kind=kind, at=0.0)
        how, target = kind.split(":", 1)
        if how in ("kill", "freeze"):
            fault.pid = cf.target_pid(doc, target)
            fault.pause_s = schedule.pause() if how == "freeze" else 0.0
            if fault.pid is None:
                self.skipped.append(f"{kind}: no {target} process in the status")
                return None
            fault.at = time.monotonic()
            self.faults.append(fault)
            await cf.signal_fault(fault, self.node.marker)
        elif target == "daemon":
            fault.at = time.monotonic()
            self.faults.append(fault)
            for variant in schedule.shuffled(cf.DAEMON_VARIANTS):
                try:
                    fault.detail[variant] = await asyncio.to_thread(
                        cf.daemon_garbage, str(self.node.socket), variant, schedule.rng)
                except OSError as e:
                    fault.detail[variant] = f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.2)
            pid_before = self.daemon_pid
            await self.check_daemon(f"after {kind} (t={fault.at - self.t0:.1f}s)")
            if self.daemon_pid != pid_before:
                fault.problems.append(f"the daemon changed pid ({pid_before} -> {self.daemon_pid})")
            if not self.daemon_checks[-1]["ok"]:
                fault.problems.append("daemon accounting moved")
        else:
            fault.at = time.monotonic()
            self.faults.append(fault)
            for variant in schedule.shuffled(cf.ADMIN_VARIANTS):
                got, ok = await cf.admin_garbage(self.session, self.node.url, self.node.token, variant,
                                                 schedule.rng)
                fault.detail[variant] = got
                if not ok:
                    fault.problems.append(f"{variant}: got {got}")
        return fault

    async def faults_loop(self, schedule: cf.Schedule, until: float) -> None:
        await asyncio.sleep(self.opts.warmup)
        next_at = time.monotonic()
        while True:
            next_at += schedule.gap()
            kind = schedule.kind()
            primary = sum(1 for f in self.faults if f.target == "primary")
            enough = len(self.faults) >= self.opts.min_faults and primary >= self.opts.min_primary_faults
            if next_at >= until and (enough or next_at >= until + self.opts.duration):
                return
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            fault = await self.inject(kind, schedule)
            if fault is not None:
                await self.settle(fault)


# -- the run -------------------------------------------------------------------------------------
async def soak(opts: Options, *, workdir: Path, model: Path | None = None, run_dir: Path | None = None,
               starter=default_starter) -> dict:
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    model = model or write_checkpoint(workdir / "model", TinySpec())
    use_batch = opts.batch == "on" or (opts.batch == "auto" and batch_supported())
    batch = None
    if use_batch:
        (workdir / "batch.jsonl").write_text("".join(
            json.dumps({"id": f"b{i}", "prompt": f"batch item {i}", "max_tokens": 16, "temperature": 0}) + "\n"
            for i in range(20000)))
        batch = {"input": str(workdir / "batch.jsonl"), "output": str(workdir / "batch.out.jsonl")}
    node = Node(workdir, model, run_dir or workdir / "run", log_level=opts.log_level, batch=batch, starter=starter)
    t_start = time.monotonic()
    try:
        await node.start()
        startup_s = time.monotonic() - t_start
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            s = Soak(opts, node, session)
            _, s.baseline_bytes, _, s.arena_keys = await s.daemon_bytes()
            await s.check_daemon("baseline")
            report = await drive(s, use_batch)
            report["startup_s"] = round(startup_s, 2)
        node.stop()
        left_pids = await asyncio.to_thread(wait_gone, node.marker)
        report["shutdown"] = {"exit_code": node.exit_code, "seconds": round(node.shutdown_s or 0, 2),
                              **leftovers(node, s.arena_keys), "left_pids": left_pids}
    finally:
        node.kill()  # a no-op after a clean shutdown
    report["batch"] = batch_results(Path(batch["output"])) if batch else None
    sd = report["shutdown"]
    report["clean"] = (sd["exit_code"] == 0 and not sd["processes"] and not sd["run_dir_files"]
                       and not sd["memfds"] and not sd["arena_mappings"])
    report["passed"] = (report["clean"] and report["requests"]["failed"] == 0 and report["quiesce"]["ok"]
                        and all(c["ok"] for c in report["daemon"]["checks"]) and not report["faults"]["problems"]
                        and not (report["batch"] or {}).get("duplicates"))
    return report


def batch_results(path: Path) -> dict:
    """The batch's result file: every request id at most once, however often its engine died."""
    ids: dict[str, int] = {}
    errors = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        ids[record["id"]] = ids.get(record["id"], 0) + 1
        errors += record.get("error") is not None
    return {"done": len(ids), "duplicates": sum(n - 1 for n in ids.values()), "errors": errors}


async def drive(s: Soak, use_batch: bool) -> dict:
    opts, node = s.opts, s.node
    load = Load(node.url, max_tokens=16, seed=opts.seed)
    await load.learn_expected(s.session)
    n_quit = max(1, opts.concurrency // 6)
    n_sdk = max(1, opts.concurrency // 3)
    n_raw = max(1, opts.concurrency - n_quit - n_sdk)
    sdk = SdkClients(load, seed=opts.seed)
    quitters = Quitters(node.url, load.model, seed=opts.seed)
    stop = asyncio.Event()
    metrics0 = await node.metrics(s.session)
    s.t0 = time.monotonic()
    until = s.t0 + opts.duration
    clients = [asyncio.ensure_future(load.run(n_raw, stop)), asyncio.ensure_future(sdk.run(n_sdk, stop)),
               asyncio.ensure_future(quitters.run(n_quit, stop))]
    schedule = cf.Schedule(opts.seed, opts.fault_rate, use_batch, opts.only)
    try:
        await s.faults_loop(schedule, until)
        await asyncio.sleep(max(0.0, until - time.monotonic()) + 1.0)  # the last fault's aftermath
    finally:
        stop.set()
        await asyncio.gather(*clients)
    elapsed = time.monotonic() - s.t0
    if opts.png is not None:
        primary = [f for f in s.faults if f.target == "primary"]
        marks = [dict(f.detail.get("router_monotonic") or {},
                      relaunched=None if f.recovered_s is None else f.at + f.recovered_s) for f in primary]
        timeline_png.write(opts.png, load.outcomes + sdk.outcomes, [f.at for f in primary], marks,
                           title="bench/chaos.py: faults of the primary (relaunched = the node whole again)")
    quiesce = await wait_quiet(s)
    await s.check_daemon("end of the run")
    metrics = await node.metrics(s.session)
    return chaos_report.build(s, load, sdk, quitters, metrics0, metrics, quiesce, elapsed, use_batch)


async def wait_quiet(s: Soak, timeout: float = 20.0) -> dict:
    """After the load: the router holds no request, no engine runs one, the daemon holds no stray
    connection (a quitter's or a garbage sender's would show here)."""
    deadline = time.monotonic() + timeout
    while True:
        doc = await s.wait_whole(30.0)
        info: dict = {"router_inflight": None, "router_queued": None, "engine_running": {}, "ok": False}
        if doc is not None:
            svc = cf.service_doc(doc)
            info["router_inflight"] = sum(i["inflight"] for i in svc["instances"])
            info["router_queued"] = svc["queued"]
            for inst in svc["instances"]:
                try:
                    async with s.session.get(inst["url"] + "/metrics") as r:
                        text = await r.text()
                    info["engine_running"][inst["name"]] = sum(
                        float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith("failover_engine_num_requests_running"))
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    info["engine_running"][inst["name"]] = type(e).__name__
            info["ok"] = (info["router_inflight"] == 0 and info["router_queued"] == 0
                          and all(v == 0 for v in info["engine_running"].values()))
        if info["ok"] or time.monotonic() > deadline:
            info["waited_s"] = round(timeout - (deadline - time.monotonic()), 2)
            return info
        await asyncio.sleep(0.2)


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load and faults")
    p.add_argument("--fault-rate", type=float, default=12.0, help="faults per minute (mean)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=6, help="clients: 1/6 quitters, 1/3 openai SDK, the rest raw aiohttp")
    p.add_argument("--json", type=Path, dest="json_path", help="write the report here too")
    p.add_argument("--batch", choices=["auto", "on", "off"], default="auto",
                   help="a batch service and its faults (auto: when the supervisor supports kind=batch)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--warmup", type=float, default=3.0, help="calm seconds before the first fault")
    p.add_argument("--min-faults", type=int, default=0,
                   help="go on past --duration (at most twice it) until this many faults were injected")
    p.add_argument("--min-primary-faults", type=int, default=0,
                   help="go on past --duration (at most twice it) until this many faults hit the primary "
                   "(20: the client figures' p50/p99/max over 20 faults)")
    p.add_argument("--png", type=Path, default=None, help="write a PNG timeline (clients' tokens, faults of the "
                   "primary marked; needs matplotlib: the [plots] extra)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (model, config, node.log)")
    p.add_argument("--only", default="", help="comma-separated fault kinds, e.g. kill:daemon,freeze:primary "
                   f"(default: all of {', '.join(cf.KINDS + cf.BATCH_KINDS)})")
    a = p.parse_args(argv)
    only = tuple(k for k in a.only.split(",") if k)
    unknown = [k for k in only if k not in cf.KINDS + cf.BATCH_KINDS]
    if unknown:
        p.error(f"unknown fault kind(s) {unknown}")
    return Options(**(vars(a) | {"only": only}))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="fo-chaos-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    print(f"chaos soak: work dir {workdir} (node log: {workdir / 'node.log'})", flush=True)
    report = None
    try:
        report = asyncio.run(soak(opts, workdir=workdir))
        print(chaos_report.render(report), flush=True)
        if opts.json_path:
            opts.json_path.write_text(json.dumps(report, indent=2) + "\n")
        return 0 if report["passed"] else 1
    finally:
        if not opts.keep and report is not None and report["passed"]:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"chaos soak: kept {workdir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
