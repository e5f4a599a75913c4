"""The supervisor: one asyncio process (no CUDA) that runs a node and heals it.

It starts the cache daemon and the zygote, launches every configured instance slot, registers the
ready ones with the in-process router, and from then on reacts: an engine's exit reaches the router
the instant its pidfd turns readable (``router.instance_exited``), and the slot is relaunched at once,
mapped from the same resident weights, and registered again as a standby. The router asks for
fencing, replacements and co-serving evictions through ``failover.node.bridge.NodeLauncher``.

Ownership: the supervisor is a child subreaper; it owns (and reaps) every process of the node. It
owns the run dir's pid file, the engines' admin token (``engine.token``: only it and the engines it
starts read it) and, when it generated it, the router's admin token; the daemon owns its socket and
ready file. ``stop()`` leaves none of them behind.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Callable

import aiohttp
import structlog

from cache_daemon import owned
from failover_common.proc import become_subreaper
from failover.procs import launch
from failover.procs import child as processes
from failover.node import slots
from failover.node.daemon import CacheDaemon
from failover.config.schema import Config, ServiceConfig
from failover.coserve.coserver import Coserver
from failover.coserve.status import BatchCollector, report
from failover.config.argv import engine_argv, external_argv
from failover.node.bridge import NodeLauncher, NodeRouter, router_config
from failover.procs.child import Child, ChildFailed
from failover.procs.restart import CrashLoop, RestartPolicy
from failover.node.slots import Slot
from router import states

log = structlog.get_logger(__name__)


class Supervisor:
    def __init__(self, config: Config, *, child_output=None,
                 progress: Callable[[str], None] | None = None, batch_bar: bool = False) -> None:
        self.config = config
        self.sup = config.supervisor
        self.child_output = child_output
        self.progress = progress or (lambda text: None)
        self.services: dict[str, ServiceConfig] = {s.name: s for s in config.service}
        self.slots: dict[str, Slot] = {
            name: Slot(svc.name, name, port)
            for svc in config.service for name, port in zip(svc.slot_names(), svc.ports)}
        self.failed: dict[str, str] = {}  # service -> why it was given up
        self.policy = RestartPolicy(self.sup)
        self.daemon = CacheDaemon(config, stdout=child_output, progress=self.progress)
        self.zygote = launch.Zygote(on_exit=self._zygote_exited, stdout=child_output, device=config.model.device)
        self.router = NodeRouter(router_config(config), NodeLauncher(self), self)
        self.coserve = Coserver(self)  # batch services: their runners and when they get out of the way
        self.batch_bar = batch_bar  # a progress bar of the batch services (a terminal)
        if self.coserve.jobs:
            self.router.metrics.registry.register(BatchCollector(self.coserve))
        self.stopping = False
        self.serving = False  # set once the first start() is through: from then on exits are healed
        self.started_at = time.monotonic()
        self._tasks: dict[str, asyncio.Task] = {}  # slot name -> its launch/replacement task
        self._bg: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None
        self._made_run_dir = False
        self._made_token = False

    # -- start -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Daemon and zygote (concurrently), then every slot, then the router. Raises on failure."""
        self._prepare_run_dir()
        become_subreaper()
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self._reap_orphans)
        self._session = aiohttp.ClientSession()
        self.progress(f"starting the cache daemon ({self.config.model.path}) and the zygote")
        await asyncio.gather(self.daemon.start(), self._start_zygote())
        self.coserve.open()  # batch files first: a batch that cannot write its output never starts
        launching = [slot for slot in self.slots.values() if not slot.hold]
        self.progress(f"launching {len(launching)} engine(s)")
        await asyncio.gather(*(self._launch(slot, "initial") for slot in launching))
        lost = [s.name for s in launching if s.state != slots.RUNNING]
        if lost:  # one became ready and then died while the others were still starting
            raise ChildFailed(f"{', '.join(lost)} exited during startup; see the engine log above")
        for svc in self.config.service:
            for i, name in enumerate(svc.slot_names()):
                if not self.slots[name].hold:
                    self._register(self.slots[name], states.PRIMARY if i == 0 else states.STANDBY)
        await self.router.start()
        self.serving = True
        self.coserve.start()
        if self.batch_bar and self.coserve.jobs:
            self.background(report(self.coserve, self.progress), "batch-progress")
        self.progress(f"serving on {self.config.router_url} (services: {', '.join(self.services)})")

    def _prepare_run_dir(self) -> None:
        run = self.config.run_path
        # mkdir, then checked on the opened fd: a symlink or another user's dir is refused, not chmodded
        self._made_run_dir = owned.private_dir(run)
        (run / "supervisor.pid").write_text(f"{os.getpid()}\n")
        # The default token (RUN_DIR/admin.token) is ours: fresh each run, removed at exit. A token
        # file named in the config is the operator's: used as is, created (and kept) only if missing.
        token = self.config.token_path
        if not self.config.router.admin_token_file or not token.exists():
            _write_token(token)
            self._made_token = not self.config.router.admin_token_file
            log.info("admin_token_written", path=str(token))
        # A second token, not the router's: the engines' admin endpoints (POST /admin/kv) take only
        # this one, so neither an engine nor a holder of the operator's token file gets the other's.
        _write_token(self.config.engine_token_path)

    async def _start_zygote(self) -> None:
        if self.sup.launch != "zygote":
            return
        try:
            await self.zygote.ensure()
        except (launch.ZygoteError, OSError) as e:  # the cold path still works, only slower
            log.error("zygote_unavailable", error=str(e), fallback="spawn")

    def _reap_orphans(self) -> None:
        for pid in processes.reap_orphans():
            log.info("orphan_reaped", pid=pid)

    # -- launching -------------------------------------------------------------------------------
    async def _launch(self, slot: Slot, reason: str) -> None:
        """Start ``slot``'s process and wait for its /ready; raises ChildFailed (process ended)."""
        svc = self.services[slot.service]
        slot.change(slots.STARTING, reason, launch=self.sup.launch, attempt=slot.launches + 1)
        slot.launches += 1
        slot.ready_at, slot.ready_info = None, {}
        on_exit = lambda child: self._exited(slot, child)  # noqa: E731
        try:
            child = await self._start_process(slot, svc, on_exit)
        except OSError:
            slot.change(slots.STOPPED, "launch failed")
            raise
        except asyncio.CancelledError:  # preempted or shut down before the process existed
            slot.change(slots.STOPPED, "launch cancelled")
            raise
        slot.child, slot.launched_at = child, time.monotonic()
        assert self._session is not None
        try:
            info = await processes.wait_http_ready(
                slot.url + svc.ready_path, child, self.sup.ready_timeout, self._session,
                progress=lambda s: self.progress(f"{slot.name}: waiting for /ready ({s:.0f} s)"))
        except (ChildFailed, asyncio.CancelledError):
            if child.alive:  # never became ready (or we gave up on it): end it
                slot.change(slots.STOPPING, "not ready")
                await child.stop(self.sup.stop_timeout)
            raise
        slot.ready_at, slot.ready_info = time.monotonic(), info
        slot.change(slots.RUNNING, "ready", pid=child.pid, weights_source=info.get("weights_source"),
                    ready_ms=round((slot.ready_at - slot.launched_at) * 1e3, 1))

    async def _start_process(self, slot: Slot, svc: ServiceConfig, on_exit) -> Child:
        if svc.command is not None:
            child = processes.spawn(slot.name, external_argv(self.config, svc, slot.name, slot.port),
                                    on_exit=on_exit, stdout=self.child_output)
        elif self.sup.launch == "zygote" and not self.stopping:
            try:
                child = await self.zygote.fork(slot.name, engine_argv(self.config, svc, slot.port), on_exit=on_exit)
            except launch.ZygoteError as e:
                log.error("zygote_fork_failed", slot=slot.name, error=str(e), fallback="spawn")
                child = launch.spawn_cold(slot.name, engine_argv(self.config, svc, slot.port),
                                          on_exit=on_exit, stdout=self.child_output)
        else:
            child = launch.spawn_cold(slot.name, engine_argv(self.config, svc, slot.port),
                                      on_exit=on_exit, stdout=self.child_output)
        return child

    def _register(self, slot: Slot, role: str = states.STANDBY) -> None:
        """Tell the router about a ready slot (new, relaunched, or resumed in place)."""
        svc = self.router.services.get(slot.service)
        inst = svc.instances.get(slot.name) if svc is not None else None
        if inst is None or inst.role in (states.RELAUNCHING, states.STOPPED, states.PREEMPTED):
            self.router.add_instance(slot.service, slot.name, slot.url, role, pid=slot.pid)
        else:  # the router already holds it as standby/primary (resume): only the pid changed
            inst.pid = slot.pid

    # -- exits and replacements ------------------------------------------------------------------
    def _exited(self, slot: Slot, child: Child) -> None:
        """The instant an engine process is gone (pidfd): tell the router, then replace it."""
        if child is not slot.child:
            return  # a previous generation of this slot
        slot.evicted_at = child.exited_at
        planned = slot.state == slots.STOPPING
        slot.change(slots.STOPPED if planned else slots.EXITED, "process exited", returncode=child.returncode)
        svc = self.router.services.get(slot.service)
        if svc is not None and slot.name in svc.instances and not self.stopping:
            self.router.instance_exited(slot.name, child.returncode)
        if planned or self.stopping or not self.serving or slot.hold or slot.service in self.failed:
            return
        try:
            delay = self.policy.record_exit(slot.service)
        except CrashLoop as e:
            self.fail_service(slot.service, str(e))
            return
        if slot.name not in self._tasks:  # a launch in progress handles its own failure
            self.replace(slot, delay)

    def replace(self, slot: Slot, delay: float = 0.0) -> None:
        """Start a replacement for ``slot`` (idempotent while one is under way)."""
        if self.stopping or slot.service in self.failed or slot.name in self._tasks:
            return
        task = asyncio.ensure_future(self._replace(slot, delay))
        self._tasks[slot.name] = task
        task.add_done_callback(lambda t: self._tasks.pop(slot.name, None))

    async def _replace(self, slot: Slot, delay: float) -> None:
        if delay > 0:
            slot.change(slots.BACKOFF, "backoff", delay_s=round(delay, 3))
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:  # preempted meanwhile: a later resume relaunches a STOPPED slot
                slot.change(slots.STOPPED, "backoff cancelled")
                raise
        evicted = slot.evicted_at or time.monotonic()
        svc = self.services[slot.service]
        if svc.kind == "online":  # a relaunch or a promotion's replacement may need a batch engine's memory
            await self.coserve.make_room(svc)
        try:
            async for attempt in self.policy.retrying():
                with attempt:
                    if not self.daemon.ready:
                        self.progress(f"{slot.name}: waiting for the cache daemon to be back")
                        await self.daemon.wait_ready()
                    await self._launch(slot, "replacement")
        except (ChildFailed, OSError, launch.ZygoteError) as e:
            self.fail_service(slot.service, f"{slot.name} could not be relaunched "
                                            f"({self.sup.restart_attempts} attempts): {e}")
            return
        assert slot.ready_at is not None
        slot.last_relaunch_s = slot.ready_at - evicted
        log.info("relaunched", slot=slot.name, relaunch_ms=round(slot.last_relaunch_s * 1e3, 1),
                 ready_ms=round((slot.ready_at - (slot.launched_at or evicted)) * 1e3, 1),
                 weights_source=slot.ready_info.get("weights_source"), launch=self.sup.launch)
        self._register(slot, states.STANDBY)

    def ensure_service(self, service: str) -> None:
        """Replace every slot of ``service`` that has no process and is not held back."""
        for slot in self.slots.values():
            if slot.service == service and not slot.hold and slot.state in (slots.STOPPED, slots.EXITED):
                self.replace(slot)

    def fail_service(self, service: str, why: str) -> None:
        """Give ``service`` up, loudly: its slots are not replaced until an operator resumes it."""
        if service in self.failed:
            return
        self.failed[service] = why
        log.error("service_failed", service=service, why=why,
                  hint=f"fix the cause, then `failover resume {service}` (or restart `failover up`)")
        self.progress(f"SERVICE FAILED: {service}: {why}")
        for slot in self.slots.values():
            if slot.service == service and slot.state in (slots.EXITED, slots.BACKOFF, slots.STOPPED):
                slot.change(slots.FATAL, "service failed")
            task = self._tasks.get(slot.name)
            if slot.service == service and task is not None and task is not asyncio.current_task():
                task.cancel()

    def _zygote_exited(self, child: Child) -> None:
        if self.stopping:
            return
        log.error("zygote_died", pid=child.pid, returncode=child.returncode,
                  consequence="running engines are unaffected; restarting the zygote")
        self.background(self._start_zygote(), "zygote-restart")

    def background(self, coro, name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -- what the router asks (through NodeLauncher) ---------------------------------------------
    async def fence(self, name: str) -> None:
        slot = self.slots.get(name)
        if slot is None or slot.child is None or not slot.child.alive:
            return
        if slot.state in (slots.RUNNING, slots.STARTING):
            slot.change(slots.STOPPING, "fenced by the router")
        await slot.child.stop(self.sup.stop_timeout)

    async def retire(self, name: str) -> None:
        """After an operator's drain: stop the process and bring the slot back as a fresh standby."""
        slot = self.slots[name]
        await self.fence(name)
        self.replace(slot)

    async def preempt(self, service: str) -> None:
        if self.coserve.is_batch(service):  # short deadline, memory verified, timings logged
            await self.coserve.evict(service)
            return
        stops = []
        for slot in self.slots.values():
            if slot.service != service:
                continue
            slot.hold = True
            task = self._tasks.get(slot.name)
            if task is not None:
                task.cancel()  # its launch moves the slot to STOPPING and stops the process itself
            if slot.child is not None and slot.child.alive:
                if slot.state in (slots.RUNNING, slots.STARTING) and task is None:
                    slot.change(slots.STOPPING, "preempted")
                stops.append(slot.child.stop(self.sup.stop_timeout))
        await asyncio.gather(*stops)

    async def resume(self, service: str) -> None:
        if self.coserve.is_batch(service):
            self.coserve.resumed(service)
            if self.coserve.holds(service):  # done, failed on its files, or preempted again meanwhile
                return
        if self.failed.pop(service, None) is not None:
            self.policy.forget(service)
            log.warning("service_resumed_after_failure", service=service)
        for slot in self.slots.values():
            if slot.service == service:
                slot.hold = False
                if slot.state == slots.FATAL:
                    slot.state = slots.STOPPED  # FATAL -> STOPPED only here: an operator's decision
                    log.info("slot_state", slot=slot.name, old=slots.FATAL, new=slots.STOPPED, reason="resume")
        self.ensure_service(service)

    # -- status ----------------------------------------------------------------------------------
    def status(self) -> dict:
        zyg = self.zygote
        return {
            "pid": os.getpid(), "uptime_s": round(time.monotonic() - self.started_at, 1),
            "launch": self.sup.launch,
            "daemon": {"managed": self.daemon.managed, "ready": self.daemon.ready,
                       "pid": self.daemon.child.pid if self.daemon.child and self.daemon.child.alive else None,
                       "restarts": self.daemon.restarts, "incidents": self.daemon.incidents[-5:]},
            "zygote": {"pid": zyg.child.pid if zyg.alive else None, "restarts": max(zyg.restarts, 0)},
            "failed": dict(self.failed),
            "slots": [slot.as_json() for slot in self.slots.values()],
            "batch": self.coserve.status(),
        }

    # -- stop ------------------------------------------------------------------------------------
    async def stop(self) -> None:
        """Ordered shutdown; each step bounded by its timeout, nothing left behind."""
        self.stopping = True
        # 1. No more replacements or restarts.
        for task in [*self._tasks.values(), *self._bg]:
            task.cancel()
        await asyncio.gather(*self._tasks.values(), *self._bg, return_exceptions=True)
        self.coserve.close()  # the batch runners are stopped: their result files
        # 2. The router stops taking requests and lets in-flight ones finish (its shutdown_timeout).
        await self.router.stop()
        # 3. Engines: SIGTERM (they drain), SIGKILL after stop_timeout.
        for slot in self.slots.values():
            if slot.child is not None and slot.child.alive and slot.state in (slots.RUNNING, slots.STARTING):
                slot.change(slots.STOPPING, "shutdown")
        await asyncio.gather(*(s.child.stop(self.sup.stop_timeout) for s in self.slots.values()
                               if s.child is not None and s.child.alive))
        # 4. The zygote (EOF on its socket), then the daemon (it removes its socket and ready file).
        await self.zygote.stop(self.sup.stop_timeout)
        await self.daemon.stop()
        if self._session is not None:
            await self._session.close()
        asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)
        self._reap_orphans()
        self._clean_run_dir()
        log.info("supervisor_stopped")

    def _clean_run_dir(self) -> None:
        run = self.config.run_path
        (run / "supervisor.pid").unlink(missing_ok=True)
        self.config.engine_token_path.unlink(missing_ok=True)
        if self._made_token:
            self.config.token_path.unlink(missing_ok=True)
        # A managed node owns its run dir (also one a crashed run left); an external daemon lives there.
        if self._made_run_dir or self.daemon.managed:
            try:
                run.rmdir()
            except OSError as e:  # not empty: someone else's files; say which
                left = sorted(p.name for p in Path(run).iterdir()) if run.exists() else []
                log.warning("run_dir_not_removed", run_dir=str(run), error=str(e), left=left)


def _write_token(path: Path) -> None:
    """A fresh random token in ``path``, created 0600 (never a file that was there before)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
