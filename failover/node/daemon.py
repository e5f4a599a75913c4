"""The supervisor's handle on the cache daemon: start it, wait for its ready file, restart it.

Engines do not need the daemon once they have mapped their weights, so a dead daemon is an
incident (logged, restarted with backoff), not an outage. Only new engines wait for it to be back.
Its liveness ping is a Status: a daemon that answers but no longer holds the node's model (a client
evicted it with ``force``) is an incident too: a managed one is restarted, which loads it again.
With ``supervisor.daemon = "external"`` (systemd unit, Kubernetes DaemonSet) someone else runs it and
the supervisor only waits for its ready file.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from typing import Callable

import msgspec
import structlog
import tenacity

from cache_daemon import client
from cache_daemon.errors import CacheError
from cache_daemon.fingerprint import CacheConfig
from failover.procs import child as processes
from failover.config.schema import Config
from failover.config.argv import daemon_argv
from failover.procs.child import Child, ChildFailed
from failover.procs.restart import Backoff
from failover.node import load_watch

log = structlog.get_logger(__name__)
DAEMON_JITTER = 0.2  # daemons of many nodes that died together (shared storage) do not retry in step


def _log_failed_restart(state: tenacity.RetryCallState) -> None:
    log.error("daemon_restart_failed", attempt=state.attempt_number, error=str(state.outcome.exception()),
              retry_in_s=round(state.next_action.sleep, 3))


class CacheDaemon:
    def __init__(self, config: Config, *, stdout=None, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.stdout = stdout
        self.progress = progress or (lambda text: None)
        self.child: Child | None = None
        self.ready_info: dict = {}
        self.restarts = 0
        self.incidents: list[dict] = []
        self.stopping = False
        self.generation = 0  # one more at every ready: a launch can tell that the daemon was replaced
        self._ready = asyncio.Event()
        self._restart_task: asyncio.Task | None = None
        self._reload: asyncio.Task | None = None  # stopping a daemon that lost the model, to load it again
        self._lost: frozenset[str] = frozenset()  # keys of the model found missing (logged once per loss)

    @property
    def managed(self) -> bool:
        return self.config.supervisor.daemon == "managed"

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def start(self) -> dict:
        """Start the daemon (when managed) and wait until its ready file says every rank is loaded."""
        cfg = self.config
        if self.managed:
            cfg.daemon_ready_file.unlink(missing_ok=True)  # a SIGKILLed daemon's: not this one's readiness
            args = [sys.executable, "-m", "cache_daemon", *daemon_argv(cfg)]
            # SIGTERM at our death: the daemon removes its socket and ready file on the way out
            self.child = processes.spawn("cache-daemon", args, on_exit=self._exited, stdout=self.stdout,
                                         deathsig=signal.SIGTERM)
        t0 = time.monotonic()
        if self.child is None:
            self.ready_info = await self._wait_external(cfg.supervisor.daemon_ready_timeout)
        else:
            async with load_watch.shown(cfg.daemon_socket, "cache daemon loading") as bar:
                elapsed = lambda s: self.progress(f"cache daemon loading {cfg.model.path} ({s:.0f} s)")
                self.ready_info = await processes.wait_ready_file(
                    cfg.daemon_ready_file, self.child, cfg.supervisor.daemon_ready_timeout,
                    progress=None if bar.mode == "bar" else elapsed)  # a bar says more, on its own line
        self._lost = frozenset()
        self.generation += 1
        self._ready.set()
        log.info("daemon_ready", seconds=round(time.monotonic() - t0, 3), socket=str(cfg.daemon_socket),
                 pid=self.ready_info.get("pid"))
        return self.ready_info

    def pingable(self) -> Child | None:
        """The process the liveness watchdog pings: a managed daemon once ready (not while loading)."""
        return self.child if self.managed and self.ready else None

    @property
    def model_keys(self) -> frozenset[str]:
        """The keys (one per rank) of the model the daemon said it holds when it became ready."""
        return frozenset(msgspec.convert(fp, CacheConfig).key for fp in self.ready_info.get("fingerprints") or ())

    async def ping(self, timeout: float) -> bool:
        """True when the daemon answers Hello and Status on its socket within ``timeout`` s each
        (blocking socket calls, so off the event loop). An answer without the node's model starts
        its reload (:meth:`_model_lost`); the daemon is alive all the same."""
        return (await self._check(timeout)) is not None

    async def healthy(self, timeout: float) -> bool:
        """Ready, answering, and holding the node's model: a launch that failed now is not its fault."""
        return self.ready and await self._check(timeout) is True and self.ready

    async def _check(self, timeout: float) -> bool | None:
        """None: no answer; else whether the daemon holds every rank of the node's model."""
        try:
            st = await asyncio.to_thread(client.status, self.config.daemon_socket, timeout=timeout)
        except (CacheError, OSError):
            return None
        missing = self.model_keys - {m.key for m in st.models}
        if not missing:
            self._lost = frozenset()
        elif not st.loading and self.ready:
            self._model_lost(missing, st.pid)
        return not missing

    async def excuses(self, generation: int, failure: str) -> bool:
        """Is the daemon to blame for ``failure``, a launch begun at ``generation`` that failed?
        It is when it was replaced since, or is not healthy now (down, frozen, restarting, without
        the model): then this waits until it is healthy again and says so; the launch is not the
        engine's fault and the caller starts it again without counting it."""
        sup = self.config.supervisor
        if generation == self.generation and await self.healthy(sup.ping_timeout):
            return False
        log.warning("launch_failed_daemon_unhealthy", failure=failure,
                    consequence="not counted against the engine; starting again once the cache daemon is back")
        self.progress(f"{failure}; waiting for the cache daemon to be back")
        await self.wait_healthy(sup.ping_interval, sup.ping_timeout)
        return True

    async def wait_healthy(self, interval: float, timeout: float) -> None:
        """Until :meth:`healthy` (a frozen daemon is killed by its watchdog meanwhile, a reload ends)."""
        while True:
            await self._ready.wait()
            if await self.healthy(timeout):
                return
            await asyncio.sleep(interval)

    def _model_lost(self, missing: frozenset[str], pid: int) -> None:
        """The daemon answers but holds none (or not all) of the model: something evicted it. Engines
        keep their mappings; new ones could not attach. A managed daemon is stopped, and its exit
        path starts it again, which loads the model; an external one is only reported."""
        if missing == self._lost:
            return
        self._lost = missing
        incident = {"at": time.time(), "pid": pid, "reason": f"model not resident ({len(missing)} rank(s) "
                    "missing: evicted by a client?)", "returncode": None}
        self.incidents.append(incident)
        if not self.managed:
            log.error("daemon_model_lost", **incident, hint="load the model into the external daemon again "
                      "(restart its unit); relaunches wait for it")
            return
        self._ready.clear()  # replacements wait for the reload instead of failing against it
        log.error("daemon_model_lost", **incident, consequence="restarting the daemon, which loads it again")
        if self.child is not None and (self._reload is None or self._reload.done()):
            self._reload = asyncio.ensure_future(self.child.stop(self.config.supervisor.stop_timeout))

    async def _wait_external(self, timeout: float) -> dict:
        path = self.config.daemon_ready_file
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise ChildFailed(f"no cache daemon ready file at {path} after {timeout:.0f} s: "
                                  "is the failover-daemon unit (or DaemonSet) running with this run dir?")
            self.progress(f"waiting for the external cache daemon ({path})")
            await asyncio.sleep(1.0)
        return json.loads(path.read_text())

    async def wait_ready(self) -> None:
        await self._ready.wait()

    def _exited(self, child: Child) -> None:
        self._ready.clear()
        if self.stopping:
            return
        if self._reload is not None and child is self.child:  # stopped by _model_lost: already an incident
            self._reload = None
            log.warning("daemon_reloading", pid=child.pid, returncode=child.returncode)
        else:
            incident = {"at": time.time(), "returncode": child.returncode, "pid": child.pid}
            self.incidents.append(incident)
            log.error("daemon_died", **incident,
                      consequence="engines keep serving on their mappings; restarting the daemon")
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        """Start it again at once, then with growing, jittered delays (restart.Backoff) until it
        comes up; a daemon that cannot start is logged on every try."""
        sup = self.config.supervisor
        retrying = tenacity.AsyncRetrying(
            wait=Backoff(sup.backoff_initial, sup.backoff_max, jitter=DAEMON_JITTER),
            retry=tenacity.retry_if_exception_type(ChildFailed), before_sleep=_log_failed_restart)
        async for attempt in retrying:
            with attempt:
                if self.stopping:
                    return
                self.restarts += 1
                try:
                    await self.start()
                except ChildFailed:
                    if self.child is not None and self.child.alive:  # hung while loading: end it first
                        await self.child.stop(sup.stop_timeout)
                    raise
        log.warning("daemon_restarted", restarts=self.restarts)

    async def stop(self) -> None:
        self.stopping = True
        if self._reload is not None:
            await asyncio.gather(self._reload, return_exceptions=True)
        if self._restart_task is not None:
            self._restart_task.cancel()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        if self.child is not None:
            await self.child.stop(self.config.supervisor.stop_timeout)
