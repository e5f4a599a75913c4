"""bench/vs_haproxy.py's router side: two engines, the router and a launcher that replaces a fenced
engine by a fresh standby (what the supervisor does), in a process of their own or the bench's.

    python bench/router_side.py --model DIR --logs DIR --port P --token FILE [--loop uvloop]

prints ``ready PID`` once serving, and stops (router, then engines) on SIGTERM or when its parent dies.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines import EngineProc, free_port  # noqa: E402
from failover.procs import priority  # noqa: E402
from failover_common import cpus  # noqa: E402
from failover_common.tasks import Tasks  # noqa: E402


async def replacement(e: EngineProc, nice: int) -> None:
    """Wait for a replacement engine to be ready, ``nice`` below ours meanwhile (0: as is), as the
    supervisor starts a standby (``supervisor.standby_nice``, failover.procs.priority)."""
    pgid = priority.lower(e.pid, nice)[0] if nice else None
    await e.wait_ready()
    if pgid is not None:
        priority.restore(pgid)


async def start_router(model: Path, logs: Path, port: int, token: Path, nice: int = 0):
    """Two engines, a router in front of them and a launcher that replaces a fenced one by a fresh
    standby (what the supervisor does). Returns (router, engines)."""
    from router.app import Router
    from router.config import RouterConfig

    engines: dict[str, EngineProc] = {}

    class BenchLauncher:
        """request_standby starts the engine and returns, as the launcher contract asks (router/launcher.py):
        the call is bounded by fence_timeout, and an engine's start can take longer (a cold machine's
        torch import). It is registered once ready, by a task of its own."""

        def __init__(self) -> None:
            self.pending = Tasks()

        async def request_standby(self, service: str) -> None:
            e = EngineProc(model, log_dir=logs)
            name = f"e{e.port}"
            engines[name] = e
            self.pending.spawn(self._register_when_ready(service, name, e), f"standby-{name}")

        async def _register_when_ready(self, service: str, name: str, e: EngineProc) -> None:
            await replacement(e, nice)
            router.add_instance(service, name, e.url, "standby", e.pid)

        async def fence(self, name: str) -> None:
            engines[name].kill()

        async def preempt(self, service: str) -> None: ...
        async def resume(self, service: str) -> None: ...

    router = Router(RouterConfig(port=port, admin_token_file=token), BenchLauncher())
    first = [EngineProc(model, log_dir=logs) for _ in range(2)]
    await asyncio.gather(*(e.wait_ready() for e in first))
    for e, role in zip(first, ("primary", "standby")):
        engines[f"e{e.port}"] = e
        router.add_instance("default", f"e{e.port}", e.url, role, e.pid)
    await router.start()
    return router, engines


async def start_pool(model: Path, logs: Path, port: int, token: Path, nice: int, workers: int, loop: str,
                     log_level: str = "warning"):
    """``workers`` router processes on ``port`` (failover.procs.router_pool) and the same launcher's
    work: when the workers' shared primary key moves, the old primary's engine is killed and
    forgotten and a fresh standby is started and registered. The in-process router asks for the
    replacement once the failover settled (<= replace_settle_timeout); here it waits SETTLE_S."""
    from failover.procs.router_pool import RouterPool

    engines: dict[str, EngineProc] = {}
    first = [EngineProc(model, log_dir=logs) for _ in range(2)]
    await asyncio.gather(*(e.wait_ready() for e in first))
    pool = RouterPool(["--port", str(port), "--admin-token-file", str(token), "--loop", loop,
                       "--log-level", log_level], workers)
    for e in first:
        engines[f"e{e.port}"] = e
        pool.put_instance("default", f"e{e.port}", e.url, pid=e.pid)
    pool.seed_primary("default", f"e{first[0].port}")
    current = {"default": f"e{first[0].port}"}
    tasks = Tasks()

    async def replace(service: str) -> None:
        await asyncio.sleep(SETTLE_S)
        e = EngineProc(model, log_dir=logs)
        engines[f"e{e.port}"] = e
        await replacement(e, nice)
        pool.put_instance(service, f"e{e.port}", e.url, pid=e.pid)

    def moved(service: str, instance: str | None) -> None:
        old, current[service] = current.get(service), instance
        if old is None or old == instance or old not in engines:
            return
        engines[old].kill()  # the fence: every worker follows the key, none routes to it again
        pool.remove_instance(service, old)
        tasks.spawn(replace(service), f"replace-{old}")

    pool.on_primary(moved)
    await pool.start()
    return pool, engines, tasks


SETTLE_S = 0.25


async def stop_router(router, engines: dict) -> None:
    await router.launcher.pending.stop()
    await router.stop()
    for e in engines.values():
        e.kill()


async def router_child(args) -> int:
    """The router phase's router, in this process, until SIGTERM."""
    from failover_common.logs import configure_logging
    from failover_common.proc import die_with_parent

    die_with_parent(signal.SIGTERM)
    configure_logging(args.log_level, process="vs-haproxy-router")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    if args.workers > 1:
        pool, engines, tasks = await start_pool(Path(args.model), Path(args.logs), args.port, Path(args.token),
                                                args.nice_replacement, args.workers, args.loop,
                                                args.log_level)
        print(f"ready {os.getpid()} {' '.join(map(str, pool.pids()))}", flush=True)
        await stop.wait()
        await tasks.stop()
        await pool.stop()
        for e in engines.values():
            e.kill()
        return 0
    router, engines = await start_router(Path(args.model), Path(args.logs), args.port, Path(args.token),
                                         args.nice_replacement)
    from failover_common import gc_pauses

    gc_pauses.freeze()  # as `failover router` and `failover up` do once started
    print(f"ready {os.getpid()}", flush=True)
    await stop.wait()
    await stop_router(router, engines)
    return 0


class RouterSide:
    """The router under test, in a child process (default) or in this one; status from its admin API."""

    def __init__(self, model: Path, logs: Path, loop: str, args, workers: int = 1) -> None:
        self.model, self.logs, self.loop, self.workers = model, logs, loop, workers
        self.in_process, self.profile, self.nice = args.in_process, args.profile, args.nice_replacement
        self.log_level = args.router_log_level
        self.proxy_cpus = getattr(args, "proxy_cpus", "")  # the router process on these CPUs, its engines on the rest
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = logs / f"admin-token-{self.port}"
        self.token.write_text(secrets.token_hex(16))
        self.token.chmod(0o600)
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.inproc = None

    async def __aenter__(self) -> RouterSide:
        if self.in_process:
            self.inproc = await start_router(self.model, self.logs, self.port, self.token, self.nice)
            return self
        cmd = [sys.executable, str(Path(__file__).resolve()), "--model", str(self.model),
               "--logs", str(self.logs), "--port", str(self.port), "--token", str(self.token), "--loop", self.loop,
               "--nice-replacement", str(self.nice), "--workers", str(self.workers),
               "--log-level", self.log_level, "--engine-threads", str(EngineProc.cpu_threads),
               "--proxy-cpus", self.proxy_cpus]
        if self.profile is not None:
            self.profile.mkdir(parents=True, exist_ok=True)
            out = self.profile / f"router-{self.loop}.txt"
            spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
            if spy is None:
                raise RuntimeError("--profile needs py-spy: pip install py-spy")
            cmd = [spy, "record", "-f", "raw", "-r", "250", "-o", str(out), "--", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
        line = ""
        while not line.startswith("ready "):  # py-spy says things on the same stdout first
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 180)
            if not line:
                raise RuntimeError(f"router child exited with {self.proc.wait()} before it was ready")
        pids = [int(p) for p in line.split()[1:]]
        self.pid = pids[0] if len(pids) == 1 else pids  # the router, or the pool's parent and its workers
        return self

    async def __aexit__(self, *exc) -> None:
        if self.inproc is not None:
            await stop_router(*self.inproc)
            return
        os.kill(self.pid if isinstance(self.pid, int) else self.pid[0], signal.SIGTERM)
        await asyncio.to_thread(self.proc.communicate, None, 60)

    async def status(self, s: aiohttp.ClientSession, full: bool = False) -> dict:
        """The service's status, or with ``full`` the whole answer (``last_failover`` too)."""
        if self.inproc is not None:
            st = self.inproc[0].status()
        elif full and self.workers > 1:  # only the worker whose claim won records the failover: ask several
            st = await self._newest_record()
        else:
            async with s.get(self.url + "/admin/status",
                             headers={"Authorization": f"Bearer {self.token.read_text()}"}) as r:
                r.raise_for_status()
                st = await r.json()
        return st if full else st["services"][0]


    async def _newest_record(self) -> dict:
        """The status of the worker holding the newest ``last_failover``, over fresh connections
        (each may land on another worker)."""
        best, best_at = None, -1.0
        for _ in range(4 * self.workers):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                    s.get(self.url + "/admin/status", headers={"Authorization": f"Bearer {self.token.read_text()}"}) as r:
                r.raise_for_status()
                st = await r.json()
            at = (st["last_failover"].get("default") or {}).get("at", 0.0)
            if best is None or at > best_at:
                best, best_at = st, at
        return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--logs", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--loop", default="auto", choices=("auto", "uvloop", "asyncio"))
    p.add_argument("--nice-replacement", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning"))
    p.add_argument("--engine-threads", type=int, default=0, help="each engine's --cpu-threads (0: torch's)")
    p.add_argument("--proxy-cpus", default="", help="this process (the router) on these CPUs, the engines on the rest")
    from router import evloop
    args = p.parse_args()
    EngineProc.cpu_threads = args.engine_threads  # this process starts the router phase's engines
    if args.proxy_cpus:
        mine, EngineProc.cpus = cpus.split(args.proxy_cpus)
        cpus.pin_self(mine)  # its workers (--workers) start from here and take it too
    return evloop.run(router_child(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
