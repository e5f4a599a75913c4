"""N router workers on one port, and the role store they share (``failover router --workers N``).

One router process is one core at most; on a host with cores to spare, N processes listen on the same
host:port (``SO_REUSEPORT``: the kernel spreads new connections over them). They must agree on one
primary per service, so none is a decider of its own: each worker is a *peer router* of this
process's :class:`router.share_store.ShareStore`, exactly as peer routers of an etcd cluster are
(docs/cluster.md). A worker that sees the primary fail (its own probe, a reset, a refused connect)
claims its best standby with a compare-and-swap of the service's primary key; of several claims
only the first can win (the others compared an older revision), the losers and the workers that
saw nothing follow the key from their watch, and every worker fences whatever the key no longer
names. The instances are records in the store (this process writes them: the ``--backend`` and
``--standby`` at start, a launcher's replacements later), so every worker knows the same set.

This process owns: the store and its socket (0600, in a 0700 directory it creates and removes), the
workers (each spawned named, with PR_SET_PDEATHSIG, watched through a pidfd, restarted when it
dies, with a crash-loop limit), and their stop (SIGTERM, then SIGKILL after ``stop_timeout``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from failover.procs.child import Child, ChildFailed, spawn
from failover_common.tasks import Tasks
from router.roles import cluster_prefix
from router.share_store import ShareServer, ShareStore

log = structlog.get_logger(__name__)

CRASH_WINDOW_S, CRASH_LIMIT = 30.0, 5  # more deaths than this within the window: that worker is given up


class RouterPool:
    def __init__(self, worker_argv: list[str], workers: int, *, cluster: str = "default",
                 stop_timeout: float = 10.0, stdout=None) -> None:
        assert workers >= 1
        self.worker_argv, self.n, self.stop_timeout, self.stdout = worker_argv, workers, stop_timeout, stdout
        self.prefix = cluster_prefix(cluster)
        self.store = ShareStore()
        self.dir = Path(tempfile.mkdtemp(prefix="failover-router-"))  # 0700, ours
        self.socket = self.dir / "roles.sock"
        self.server = ShareServer(self.store, self.socket)
        self.children: dict[int, Child] = {}
        self.deaths: dict[int, list[float]] = {}
        self.restarts = 0
        self.given_up: set[int] = set()
        self.failed = asyncio.Event()  # every worker given up: the pool cannot serve
        self.stopping = False
        self._tasks = Tasks()

    # -- the records the workers follow ---------------------------------------------------------
    def put_instance(self, service: str, name: str, url: str, *, pid: int | None = None,
                     engine: str | None = None, probe_path: str | None = None) -> None:
        """Register (or re-register, relaunched) an instance with every worker; it starts as a standby."""
        rec = {"url": url, "role": "standby", "pid": pid}
        rec |= {k: v for k, v in (("engine", engine), ("probe_path", probe_path)) if v}
        self.store.put(f"{self.prefix}instances/{service}/{name}", json.dumps(rec))

    def remove_instance(self, service: str, name: str) -> None:
        self.store.delete(f"{self.prefix}instances/{service}/{name}")

    def seed_primary(self, service: str, name: str) -> None:
        """The first primary (only while the service has none: afterwards the workers decide)."""
        value = json.dumps({"instance": name, "by": "router-pool", "reason": "initial", "at": time.time()})
        if not self.store.swap(f"{self.prefix}primary/{service}", 0, value)["ok"]:
            raise ValueError(f"service {service!r} already has a primary")

    def primary(self, service: str) -> str | None:
        e = self.store.keys.get(f"{self.prefix}primary/{service}")
        return json.loads(e.value).get("instance") if e else None

    def on_primary(self, callback: Callable[[str, str | None], None]) -> None:
        """``callback(service, instance)`` each time a service's primary key is written."""
        key = f"{self.prefix}primary/"

        def watch(events: list[dict]) -> None:
            for e in events:
                k = e["kv"]["key"]
                if k.startswith(key):
                    doc = json.loads(e["kv"]["value"] or "{}")
                    callback(k[len(key):], doc.get("instance"))
        self.store.watchers.add(watch)

    def workers_seen(self) -> dict[str, dict]:
        """The workers' own records (under their leases): id -> url, pid, what each routes to."""
        rp = f"{self.prefix}routers/"
        return {k[len(rp):]: json.loads(e.value) for k, e in self.store.keys.items() if k.startswith(rp)}

    # -- workers --------------------------------------------------------------------------------
    async def start(self, ready_timeout: float = 60.0) -> None:
        """The store, then every worker; returns once each has written its record (it serves)."""
        await self.server.start()
        for k in range(1, self.n + 1):
            self._spawn(k)
        deadline = time.monotonic() + ready_timeout
        want = {f"worker-{k}" for k in self.children}
        while not want <= set(self.workers_seen()):
            if self.given_up or any(not c.alive for c in self.children.values()):
                raise ChildFailed("a router worker exited during startup; see its log above")
            if time.monotonic() > deadline:
                raise ChildFailed(f"router workers {sorted(want - set(self.workers_seen()))} not serving "
                                  f"after {ready_timeout:.0f} s")
            await asyncio.sleep(0.05)
        log.info("router_pool_ready", workers=self.n, pids=self.pids())

    def pids(self) -> list[int]:
        return [c.pid for c in self.children.values() if c.alive]

    def _spawn(self, k: int) -> None:
        argv = [sys.executable, "-m", "failover", "router", *self.worker_argv, "--share", str(self.socket),
                "--worker-id", str(k)]
        self.children[k] = spawn(f"router-worker-{k}", argv, on_exit=lambda child: self._exited(k, child),
                                 stdout=self.stdout)

    def _exited(self, k: int, child: Child) -> None:
        if self.stopping or self.children.get(k) is not child:
            return
        now = time.monotonic()
        deaths = self.deaths.setdefault(k, [])
        deaths[:] = [t for t in deaths if now - t < CRASH_WINDOW_S] + [now]
        if len(deaths) > CRASH_LIMIT:
            log.error("router_worker_given_up", worker=k, deaths=len(deaths), window_s=CRASH_WINDOW_S,
                      hint="see the worker's log; restart `failover router` once fixed")
            self.given_up.add(k)
            if len(self.given_up) == self.n:
                self.failed.set()
            return
        delay = min(5.0, 0.1 * 2 ** (len(deaths) - 1))
        log.warning("router_worker_died", worker=k, pid=child.pid, returncode=child.returncode,
                    restart_in_s=delay, consequence="its connections dropped; the other workers keep serving")
        self._tasks.spawn(self._respawn(k, delay), f"respawn-worker-{k}")

    async def _respawn(self, k: int, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self.stopping:
            self.restarts += 1
            self._spawn(k)

    async def stop(self) -> None:
        """Workers first (SIGTERM: each stops listening, lets its requests finish, leaves the
        store), SIGKILL past ``stop_timeout``; then the store, its socket and directory."""
        self.stopping = True
        await self._tasks.stop()
        await asyncio.gather(*(c.stop(self.stop_timeout) for c in self.children.values()))
        for c in self.children.values():
            c.close()
        await self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        log.info("router_pool_stopped", restarts=self.restarts)
