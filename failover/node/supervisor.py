"""The supervisor: one asyncio process (no CUDA) that runs a node and heals it.

It starts the cache daemon and the zygote, launches every configured instance slot, registers the
ready ones with the in-process router, and from then on reacts: an engine's exit reaches the router
the instant its pidfd turns readable (``router.instance_exited``), and the slot is relaunched (the one
relaunch trigger, always through the restart policy), mapped from the same resident weights, and
registered again as a standby. A hung engine the router fences ends the same way: its exit is a
failure, counted like a crash, so an engine that keeps hanging backs off and ends in ``failed``; so
is a replacement that fails to start, unless the cache daemon was to blame (``CacheDaemon.excuses``). The
router asks for fencing and operator preemptions through ``failover.node.bridge.NodeLauncher``.

Ownership: the supervisor is a child subreaper; it owns (and reaps) every process of the node, and
the run dir's files (``failover.node.run_dir``). ``stop()`` leaves none of them behind.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Callable

import aiohttp
import structlog

from failover.cluster.node import NodeCluster
from failover.config.schema import Config, ServiceConfig
from failover.coserve.coserver import Coserver, NodeHooks
from failover.coserve.job import DONE, ResumeRefused
from failover.coserve.status import BatchCollector, report
from failover.procs import slots
from failover.node.bridge import NodeLauncher, NodeRouter, router_config
from failover.node.daemon import CacheDaemon
from failover.config.kv import standby_bytes
from failover.node.engine_kinds import kind_of, needs_cache, needs_zygote
from failover.node.engines import EngineStarter
from failover.node.kv_pools import PoolSizer
from failover.node import status_view
from failover.node.metrics import SupervisorCollector
from failover.node.run_dir import RunDir
from failover.procs.slots import Slot
from failover.procs import child as processes
from failover.procs import launch
from failover.procs.child import Child, ChildFailed
from failover.procs.liveness import Watchdog
from failover.procs.restart import CrashLoop, RestartPolicy
from failover_common import cpus
from failover_common.proc import become_subreaper
from failover_common.tasks import Tasks
from router import states
from router.errors import AdminError

log = structlog.get_logger(__name__)


class Supervisor:
    def __init__(self, config: Config, *, child_output=None,
                 progress: Callable[[str], None] | None = None, batch_bar: bool = False) -> None:
        self.config = config
        self.sup = config.supervisor
        self.progress = progress or (lambda text: None)
        self.services: dict[str, ServiceConfig] = {s.name: s for s in config.service}
        self.slots: dict[str, Slot] = {
            name: Slot(svc.name, name, port, host=config.engine_host)
            for svc in config.service for name, port in zip(svc.slot_names(), svc.ports)}
        self.failed: dict[str, str] = {}  # service -> why it was given up
        self.policy = RestartPolicy(self.sup)
        self.run_dir = RunDir(config)
        self.daemon = CacheDaemon(config, stdout=child_output, progress=self.progress)
        self.zygote = launch.Zygote(on_exit=self._zygote_exited, stdout=child_output, device=config.model.device,
                                    reply_timeout=self.sup.ping_timeout)
        # exits are seen through pidfds; these see the hung ones (SIGSTOP, a wedged loop)
        self.watchdogs = [
            Watchdog("daemon_hung", self.daemon.pingable, self.daemon.ping,
                     interval=self.sup.ping_interval, timeout=self.sup.ping_timeout),
            Watchdog("zygote_hung", lambda: self.zygote.child if self.zygote.ready else None, self.zygote.ping,
                     interval=self.sup.ping_interval, timeout=self.sup.ping_timeout)]
        self.engines = EngineStarter(config, self.zygote, child_output=child_output, progress=self.progress)
        self.pools = PoolSizer(config.engine_token_path, lambda: self.engines.session, self._make_room,
                               config.model.device)
        launcher = NodeLauncher(fence=self.fence, is_batch=self.is_batch, preempt=self.preempt, resume=self.resume)
        self.cluster = NodeCluster(config, self.slots) if config.cluster else None  # roles in etcd
        self.router = NodeRouter(router_config(config), launcher, describe=self._describe,
                                 before_resume=self._before_resume, retire=self._retire,
                                 roles=self.cluster.roles if self.cluster else None)
        self.cluster and self.cluster.attach(self.router)
        self.router.watch_roles(self._role_changed)
        self.kv_grown: dict[str, float] = {}  # instance -> ms from its promotion to its full pool
        # batch services: their runners and when they get out of the way
        self.coserve = Coserver(config, self.slots, NodeHooks(spawn=self.background, fail_service=self.fail_service,
                                                              release=self.release, progress=self.progress),
                                self.router)
        self.batch_bar = batch_bar  # a progress bar of the batch services (a terminal)
        if self.coserve.jobs:
            self.router.metrics.registry.register(BatchCollector(self.coserve))
        self.router.metrics.registry.register(SupervisorCollector(self.daemon, self.zygote, self.slots, self.failed,
                                                                  self.watchdogs, list(self.services)))
        self.stopping = False
        self.serving = False  # set once the first start() is through: from then on exits are healed
        self.started_at = time.monotonic()
        self._bg = Tasks()
        self.placement: dict[str, str] | None = None  # router.cpus: the router's CPUs and the engines'

    # -- start -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Daemon and zygote (concurrently), then every slot, then the router. Raises on failure."""
        self.run_dir.prepare()
        if self.config.router.cpus:  # the router on its own cores, everything we start on the others
            self.placement = cpus.place_node(self.config.router.cpus)
        become_subreaper()
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self._reap_orphans)
        self.engines.session = aiohttp.ClientSession()
        daemon, zygote = needs_cache(self.config), needs_zygote(self.config)
        if daemon or zygote:
            what = " and ".join(w for w, on in (("the cache daemon", daemon), ("the zygote", zygote)) if on)
            self.progress(f"starting {what} ({self.config.model.path})")
            await asyncio.gather(*([self.daemon.start()] if daemon else []), *([self._start_zygote()] if zygote else []))
        if not daemon:  # vLLM services with weights = "disk" only: nothing maps the daemon's weights
            log.info("daemon_not_needed", engines=sorted({s.engine for s in self.config.service}))
        self.coserve.open()  # batch files first: a batch that cannot write its output never starts
        launching = [slot for slot in self.slots.values() if not slot.hold]
        self.progress(f"launching {len(launching)} engine(s)")
        firsts = {svc.slot_names()[0] for svc in self.config.service}  # registered as primaries below
        await asyncio.gather(*(self._launch(slot, "initial", primary=slot.name in firsts) for slot in launching))
        lost = [s.name for s in launching if s.state != slots.RUNNING]
        if lost:  # one became ready and then died while the others were still starting
            raise ChildFailed(f"{', '.join(lost)} exited during startup; see the engine log above")
        for svc in self.config.service:
            for i, name in enumerate(svc.slot_names()):
                if not self.slots[name].hold:
                    first = i == 0 and self.cluster is None  # in a cluster etcd names the primary
                    self._register(self.slots[name], states.PRIMARY if first else states.STANDBY)
        await self.router.start()
        self.cluster and self.cluster.start()
        self.serving = True
        for dog in self.watchdogs:
            self.background(dog.run(), dog.event)
        self.coserve.start()
        if self.batch_bar and self.coserve.jobs:
            self.background(report(self.coserve, self.progress), "batch-progress")
        self.progress(f"serving on {self.config.router_url} (services: {', '.join(self.services)})")

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

    async def _launch(self, slot: Slot, reason: str, *, primary: bool = False) -> None:
        await self.engines.launch(slot, self.services[slot.service], reason,
                                  on_exit=lambda child: self._exited(slot, child), primary=primary)

    def _register(self, slot: Slot, role: str = states.STANDBY) -> None:
        """Tell the router about a ready slot (new, relaunched, or resumed in place)."""
        svc = self.services[slot.service]
        probe = kind_of(svc).probe_path if svc.command is None else svc.ready_path
        self.router.register(slot.service, slot.name, slot.url, role, slot.pid, engine=svc.engine, probe_path=probe)

    # -- exits and relaunches --------------------------------------------------------------------
    def _exited(self, slot: Slot, child: Child) -> None:
        """The instant an engine process is gone (pidfd): tell the router, then maybe relaunch."""
        if child is not slot.child:
            return  # a previous generation of this slot
        slot.evicted_at = child.exited_at
        means = slot.exit_means()
        slot.change(slots.EXITED if means == slots.FAIL else slots.STOPPED, "process exited",
                    returncode=child.returncode)
        if self.router.knows(slot.name) and not self.stopping:
            self.router.instance_exited(slot.name, child.returncode)
        if means != slots.HOLD:
            self._relaunch(slot, failure=means == slots.FAIL)

    def _relaunch(self, slot: Slot, *, failure: bool) -> None:
        """The one relaunch trigger: the restart policy says how soon (a failure counts toward the
        crash loop and backs off; a planned restart starts at once), or that the service failed."""
        if self.stopping or not self.serving or slot.hold or slot.service in self.failed:
            return
        if slot.task is not None and not slot.task.done():
            return  # a replacement under way counts its own failed start (once) and starts again
        try:
            delay = self.policy.next_delay(slot.service, failure=failure)
        except CrashLoop as e:
            self.fail_service(slot.service, str(e))
            return
        slot.task = asyncio.ensure_future(self._replace(slot, delay))
        slot.task.add_done_callback(lambda t: setattr(slot, "task", None) if slot.task is t else None)

    async def _replace(self, slot: Slot, delay: float) -> None:
        await slot.backoff(delay)
        evicted = slot.evicted_at or time.monotonic()
        svc = self.services[slot.service]
        if svc.kind == "online":
            # the requests the failover broke resume on the new primary first: the replacement's
            # start (imports, warm-up) competes with them for the same cores (docs/router.md)
            if self.router.knows_service(slot.service):
                await self.router.failover_settled(slot.service)
            await self.coserve.make_room(svc)  # it may need a batch engine's memory
        failed_starts, uses_cache = 0, needs_cache(self.config, svc)
        while True:
            if uses_cache and not self.daemon.ready:
                self.progress(f"{slot.name}: waiting for the cache daemon to be back")
                await self.daemon.wait_healthy(self.sup.ping_interval, self.sup.ping_timeout)
            generation = self.daemon.generation
            try:
                await self._launch(slot, "replacement")
                break
            except (ChildFailed, OSError, launch.ZygoteError) as e:
                if uses_cache and await self.daemon.excuses(generation, f"{slot.name} failed to start: {e}"):
                    continue  # the daemon's failure, not the engine's: not counted
                failed_starts += 1
                try:  # the same policy as a crash: counted, backed off, or the service is failed
                    delay = self.policy.record_exit(slot.service, why=f"{slot.name} failed to start: {e}",
                                                    failed_starts=failed_starts)
                except CrashLoop as crash_loop:
                    self.fail_service(slot.service, str(crash_loop))
                    return
            await slot.backoff(delay)
        assert slot.ready_at is not None
        slot.last_relaunch_s = slot.ready_at - evicted
        log.info("relaunched", slot=slot.name, relaunch_ms=round(slot.last_relaunch_s * 1e3, 1),
                 ready_ms=round((slot.ready_at - (slot.launched_at or evicted)) * 1e3, 1),
                 weights_source=slot.ready_info.get("weights_source"), launch=self.sup.launch)
        self._register(slot, states.STANDBY)

    # -- KV pools follow the roles (failover.node.kv_pools) ---------------------------------------
    def _role_changed(self, inst, old: str, new: str, reason: str) -> None:
        slot, svc = self.slots.get(inst.name), self.services.get(inst.service)
        if slot is None or svc is None or svc.kind != "online" or svc.command is not None or self.stopping \
                or not kind_of(svc).resizable_kv:
            return
        if old == states.PRIMARY and new in (states.RELAUNCHING, states.STOPPED):
            self.pools.primary_failed(slot)  # its memory is what the promoted instance grows into
        if new == states.PRIMARY and (slot.kv_bytes or 0) < svc.kv_memory_bytes:
            self.kv_grown.pop(inst.name, None)
            self.pools.want(slot, svc.kv_memory_bytes, f"promoted: {reason}",
                            done=lambda elapsed: self._pool_grown(inst.service, inst.name, elapsed),
                            after_failure=reason not in ("promoted: planned", "promoted: drain"))
        elif new == states.STANDBY and old in (states.PRIMARY, states.DRAINING) and slot.pid is not None:
            self.pools.want(slot, standby_bytes(svc, self.config.model), f"back to standby: {reason}")

    def _pool_grown(self, service: str, instance: str, elapsed: float) -> None:
        """The promoted instance holds its full pool: the time goes into the failover's record
        (status' ``last_failover``; the growth may end before or after the router writes it)."""
        self.kv_grown[instance] = round(elapsed * 1e3, 1)
        log.info("promoted_pool_grown", service=service, instance=instance, kv_grown_ms=round(elapsed * 1e3, 1),
                 kv_bytes=self.slots[instance].kv_bytes)

    async def _make_room(self, service: str) -> None:
        await self.coserve.make_room(self.services[service])

    def fail_service(self, service: str, why: str) -> None:
        """Give ``service`` up, loudly: its slots are not replaced until an operator resumes it."""
        if self.failed.get(service) == why:
            return
        self.failed[service] = why
        log.error("service_failed", service=service, why=why,
                  hint=f"fix the cause, then `failover resume {service}` (or restart `failover up`)")
        self.progress(f"SERVICE FAILED: {service}: {why}")
        for slot in self.slots.values():
            if slot.service != service:
                continue
            if slot.state in slots.GIVE_UP:
                slot.change(slots.FATAL, "service failed")
            if slot.task is not None and slot.task is not asyncio.current_task():
                slot.task.cancel()

    def _zygote_exited(self, child: Child) -> None:
        if self.stopping:
            return
        log.error("zygote_died", pid=child.pid, returncode=child.returncode,
                  consequence="running engines are unaffected; restarting the zygote")
        self.background(self._start_zygote(), "zygote-restart")

    def background(self, coro, name: str) -> None:
        self._bg.spawn(coro, name)

    # -- what the router asks (through NodeLauncher) ---------------------------------------------
    def is_batch(self, service: str) -> bool:
        return self.coserve.is_batch(service)

    async def fence(self, name: str) -> None:
        """The router's verdict: this engine failed (hung, broken). Its exit relaunches it (counted)."""
        slot = self.slots.get(name)
        if slot is not None:
            await slot.stop("fenced by the router", self.sup.stop_timeout, then=slots.FAIL)

    async def preempt(self, service: str) -> None:
        if self.coserve.is_batch(service):  # short deadline, memory verified, timings logged
            await self.coserve.evict(service)
            return
        stops = []
        for slot in self.slots.values():
            if slot.service != service:
                continue
            slot.hold = True
            if slot.task is not None:
                slot.task.cancel()  # a launch under way stops its own process (or never starts one)
            stops.append(slot.stop("preempted", self.sup.stop_timeout))
        await asyncio.gather(*stops)

    async def resume(self, service: str) -> None:
        if self.coserve.is_batch(service):
            self.coserve.resumed(service)
            if self.coserve.holds(service):  # done, failed on its files, or preempted again meanwhile
                return
        self.release(service)

    def release(self, service: str) -> None:
        """``service`` may run again (an operator's resume, a batch's load or memory resume): its
        failure is forgotten, its slots no longer held, and the ones without a process start."""
        if self.failed.pop(service, None) is not None:
            self.policy.forget(service)
            log.warning("service_resumed_after_failure", service=service)
        for slot in self.slots.values():
            if slot.service == service:
                slot.hold = False
                if slot.state == slots.FATAL:
                    slot.state = slots.STOPPED  # FATAL -> STOPPED only here: an operator's decision
                    log.info("slot_state", slot=slot.name, old=slots.FATAL, new=slots.STOPPED, reason="resume")
                if slot.state in slots.DOWN:
                    self._relaunch(slot, failure=False)

    # -- the node's side of its router's admin API (NodeRouter) ----------------------------------
    def _retire(self, name: str) -> bool:
        """After an operator's drain: stop the process; its exit brings the slot back as a standby."""
        slot = self.slots.get(name)
        if slot is None:
            return False
        self.background(slot.stop("drained", self.sup.stop_timeout, then=slots.RECYCLE), f"retire-{name}")
        return True

    async def _before_resume(self, service: str) -> dict | None:
        """A failed batch service first opens its files again: still unusable, the resume is refused
        (409, with the reason) instead of answering ok and changing nothing."""
        if not self.coserve.is_batch(service):
            return None
        try:
            self.coserve.retry(service)
        except ResumeRefused as e:
            raise AdminError(409, str(e), "resume_refused") from None
        if not self.router.knows_service(service):  # failed before its engine ever registered
            await self.resume(service)
            return {"service": service, "preempted": False, "message": "relaunching its engine"}
        job = self.coserve.jobs[service]
        if job.state == DONE:
            return {"service": service, "preempted": False,
                    "message": f"batch {service} is done ({job.runner.progress.done} results in "
                               f"{job.svc.batch.output}); nothing to resume"}
        return None

    def _describe(self, doc: dict) -> dict:
        return status_view.describe(self, doc)

    def status(self) -> dict:
        return status_view.node_status(self)

    # -- stop ------------------------------------------------------------------------------------
    async def stop(self) -> None:
        """Ordered shutdown; each step bounded by its timeout, nothing left behind."""
        self.stopping = True
        self.engines.cold = True
        if self.cluster is not None:  # 0. leave the cluster: its peers fail this node's primary over now
            await self.cluster.leave()
        # 1. No more replacements or restarts.
        tasks = [s.task for s in self.slots.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, self._bg.stop(), return_exceptions=True)
        await self.pools.stop()
        self.coserve.close()  # the batch runners are stopped: their result files
        # 2. The router stops taking requests and lets in-flight ones finish (its shutdown_timeout).
        await self.router.stop()
        # 3. Engines: SIGTERM (they drain), SIGKILL after stop_timeout.
        await asyncio.gather(*(s.stop("shutdown", self.sup.stop_timeout) for s in self.slots.values()))
        # 4. The zygote (EOF on its socket), then the daemon (it removes its socket and ready file).
        await self.zygote.stop(self.sup.stop_timeout)
        await self.daemon.stop()
        if self.engines.session is not None:
            await self.engines.session.close()
        asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)
        self._reap_orphans()
        # A managed node owns its run dir (also one a crashed run left); an external daemon lives there.
        self.run_dir.clean(owns_dir=self.daemon.managed)
        self.cluster and await self.cluster.close()
        log.info("supervisor_stopped")
