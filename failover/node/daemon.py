"""The supervisor's handle on the cache daemon: start it, wait for its ready file, restart it.

Engines do not need the daemon once they have mapped their weights, so a dead daemon is an
incident (logged, restarted with backoff), not an outage. Only new engines wait for it to be back.
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

import structlog
import tenacity

from cache_daemon import client
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
        self._ready = asyncio.Event()
        self._restart_task: asyncio.Task | None = None

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
        self._ready.set()
        log.info("daemon_ready", seconds=round(time.monotonic() - t0, 3), socket=str(cfg.daemon_socket),
                 pid=self.ready_info.get("pid"))
        return self.ready_info

    def pingable(self) -> Child | None:
        """The process the liveness watchdog pings: a managed daemon once ready (not while loading)."""
        return self.child if self.managed and self.ready else None

    async def ping(self, timeout: float) -> bool:
        """True when the daemon answers Hello and Ping on its socket within ``timeout`` s each
        (blocking socket calls, so off the event loop)."""
        return await asyncio.to_thread(client.ping, self.config.daemon_socket, timeout=timeout)

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
        if self._restart_task is not None:
            self._restart_task.cancel()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        if self.child is not None:
            await self.child.stop(self.config.supervisor.stop_timeout)
