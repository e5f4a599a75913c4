"""Failure verdicts and what follows them: fencing, promotion, planned switchover, drain.

The switch itself is synchronous (no await between "the old primary is out" and "the standby is
in"), so in an asyncio process it is atomic: a request sees the old primary or the new one, never
a half-state. Everything slow (Launcher.fence, Launcher.request_standby, closing the old pool) runs
afterwards in background tasks.

Blackout of an unplanned failover = first good response (or stream chunk) of the new primary minus
the last good one of the old, so it is meaningful under load; it is observed once per failover.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from failover_common.tasks import Tasks

from router import states
from router.backend import Instance, Service
from router.config import RouterConfig
from router.errors import AdminError
from router.health import HANG, PROBE_TIMEOUT  # fail a primary only when a ready standby can take over
from router.launcher import Launcher
from router.metrics import Metrics
from router.roles import LocalRoles, RoleStore

log = structlog.get_logger(__name__)

HISTORY = 20  # completed failovers kept for the status page's timeline
# Passive failure kinds that fail a backend outright: it answered, but not as an engine does.
FATAL_KINDS = frozenset({"garbage", "stall"})
# Kinds that make it suspect and trigger a confirm probe.
SUSPECT_KINDS = frozenset({"connect", "reset", "unavailable"})
# A connect that timed out: the engine's backlog is full (overload), which is no sign of death.
SLOW_KINDS = frozenset({"slow"})


@dataclass(slots=True)
class PendingFailover:
    old: str
    reason: str
    last_ok: float  # monotonic: last good response of the old primary
    detected: float
    switched: float | None = None
    new: str | None = None


class Promoter:
    def __init__(self, config: RouterConfig, services: dict[str, Service], launcher: Launcher,
                 relaunches: bool, metrics: Metrics, confirm: Callable[[Instance], None],
                 roles: RoleStore | None = None) -> None:
        self.config = config
        self.roles = roles if roles is not None else LocalRoles()  # who decides (router/roles.py)
        self.services = services
        self.launcher = launcher
        self.relaunches = relaunches  # False: standalone, a fenced instance is stopped for good
        self.metrics = metrics
        self.confirm = confirm
        self.pending: dict[str, PendingFailover] = {}
        self.last_failover: dict[str, dict] = {}
        # (service, record) of completed failovers, oldest first
        self.history: collections.deque[tuple[str, dict]] = collections.deque(maxlen=HISTORY)
        self.tasks = Tasks()
        # called after every role change as (instance, old role, new role, reason); see Router.watch_roles
        self.role_listeners: list[Callable[[Instance, str, str, str], None]] = []

    # -- role bookkeeping ---------------------------------------------------------------------
    def set_role(self, inst: Instance, new: str, reason: str, **timings: float) -> None:
        old = inst.role
        states.change_role(inst, new, reason, **timings)
        self.metrics.set_role(inst.service, inst.name, new)
        for listener in self.role_listeners:
            listener(inst, old, new, reason)

    def set_ready(self, inst: Instance, ready: bool, why: str) -> None:
        if inst.ready != ready:
            inst.ready = ready
            self.metrics.set_up(inst.service, inst.name, ready)
            log.info("instance_ready" if ready else "instance_unready", service=inst.service,
                     instance=inst.name, role=inst.role, why=why)

    def spawn(self, coro: Awaitable, name: str) -> None:
        self.tasks.spawn(coro, name)

    # -- verdicts -----------------------------------------------------------------------------
    def on_probe(self, inst: Instance, generation: int, ok: bool, why: str, latency: float) -> None:
        if inst.generation != generation or inst.fenced:
            return
        service = self.services[inst.service]
        if ok:
            inst.probe_latency = latency
            inst.failures = 0
            inst.suspect = False
            inst.ever_ready = True
            self.set_ready(inst, True, why)
            service.refresh()
            if inst.slow_kept:
                inst.slow_kept = False
                log.info("instance_answers_again", service=inst.service, instance=inst.name, role=inst.role)
            if inst.role == states.STANDBY:
                primary = service.primary
                if primary is None:
                    self.promote_best(service, "standby_ready")
                elif self._never_came_up(primary):
                    self.fail(primary, "never_ready")
                elif primary.slow_kept:  # kept only for want of a standby: there is one now
                    self.fail(primary, "probe")
            return
        self._count_failure(inst, "probe", why)
        if inst.suspect and not inst.fenced:
            self.confirm(inst)  # keep confirming until the suspicion is settled either way

    def passive_failure(self, inst: Instance, generation: int, kind: str, detail: str) -> None:
        """A proxied request failed on ``inst`` (see errors.BackendFailed for the kinds)."""
        if inst.generation != generation or inst.fenced or inst.role not in states.WATCHED:
            return
        if kind in SLOW_KINDS:  # retried by the proxy; the probes decide whether it is hung
            log.debug("backend_slow_request", service=inst.service, instance=inst.name, detail=detail)
            return
        log.warning("backend_failed_request", service=inst.service, instance=inst.name, kind=kind,
                    detail=detail)
        if kind in FATAL_KINDS:
            self.fail(inst, kind)
        elif kind in SUSPECT_KINDS:
            self._count_failure(inst, kind, detail)
            if not inst.fenced:
                inst.suspect = True
                self.services[inst.service].refresh()
                self.confirm(inst)

    def _never_came_up(self, inst: Instance) -> bool:
        return not inst.ever_ready and inst.failures >= self.config.failure_threshold

    def _count_failure(self, inst: Instance, kind: str, why: str) -> None:
        inst.failures += 1
        if inst.failures < self.config.failure_threshold and why != HANG:  # HANG: two signals agreed
            return
        if not inst.ever_ready:
            # Still starting, as far as we know (a standalone router started before its engines):
            # a primary that never came up gives way only to a standby that did.
            if inst is self.services[inst.service].primary and self.best_standby(self.services[inst.service]):
                self.fail(inst, "never_ready")
            return
        if inst.role in states.SERVING:
            service = self.services[inst.service]
            if kind == "probe" and why in (PROBE_TIMEOUT, HANG) and self.best_standby(service, exclude=inst) is None:
                # Slow, perhaps hung, but nothing could serve instead: fencing it would turn a slow
                # service into none. Kept until it answers or a standby is ready (on_probe).
                if not inst.slow_kept:
                    inst.slow_kept = True
                    log.error("primary_slow_kept", service=inst.service, instance=inst.name,
                              failures=inst.failures, hint="no ready standby to fail over to; it is "
                              "failed as soon as one is ready, unless it answers again first")
                return
            self.fail(inst, "hang" if why == HANG else kind)
        else:  # a standby that does not answer is not promoted; it may come back by itself
            self.set_ready(inst, False, f"{kind}: {why}")
            inst.suspect = False

    def instance_exited(self, inst: Instance, returncode: int | None) -> None:
        inst.pid = None
        if inst.fenced or inst.role not in states.WATCHED:
            log.info("instance_exit_expected", service=inst.service, instance=inst.name,
                     role=inst.role, returncode=returncode)
            return
        self.fail(inst, "exited", launcher_fence=False)

    # -- unplanned failover -------------------------------------------------------------------
    def fail(self, inst: Instance, reason: str, *, launcher_fence: bool = True) -> None:
        """``inst`` failed: fence it, switch the service to its best standby, ask for a new one."""
        if inst.fenced:
            return
        service = self.services[inst.service]
        now = time.monotonic()
        was_primary = service.primary is inst
        inst.fenced = True
        inst.slow_kept = False
        aborted = inst.abort_inflight()
        inst.gate.release_all()  # requests queued for it go back and find the new primary
        if aborted:  # not settled: the aborted requests count themselves recovering on their next step
            service.settled.clear()
        self.set_ready(inst, False, reason)
        self.set_role(inst, states.RELAUNCHING if self.relaunches else states.STOPPED, f"failed: {reason}",
                      aborted=aborted)
        if was_primary:
            service.primary = None
            self.pending[service.name] = PendingFailover(inst.name, reason, inst.last_ok or now, now)
            self.metrics.failovers.labels(service.name, reason).inc()
            self.promote_best(service, reason, failed=inst.name)
        service.refresh()
        self.spawn(self._fence_and_replace(inst, launcher_fence), f"fence-{inst.name}")

    async def _fence_and_replace(self, inst: Instance, launcher_fence: bool) -> None:
        # Fence first, replace second: the replacement may need the memory the old one held.
        await inst.close_session()  # its requests were aborted in fail(); drop the pool
        if launcher_fence:
            await self._bounded(self.launcher.fence(inst.name), "fence", inst.name)
        if self.relaunches:
            await self.settled(self.services[inst.service])
            await self._bounded(self.launcher.request_standby(inst.service), "request_standby", inst.service)

    async def settled(self, service: Service) -> None:
        """Wait (at most ``replace_settle_timeout``) until the requests a failover broke have resumed
        on the new primary. A replacement's start (torch import, weights, warm-up) competes with the
        new primary for the same cores or GPU; started at once, it stalled the resumed requests for
        hundreds of ms (bench/failover.py on 2 cores: the worst in-flight client waited 471 ms p50
        instead of 54). With no primary to resume on, there is nothing to wait for."""
        if self.config.replace_settle_timeout <= 0 or service.routable() is None:
            return
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.config.replace_settle_timeout):
                await service.settled.wait()
        except TimeoutError:
            log.warning("failover_not_settled", service=service.name, recovering=service.recovering,
                        waited_s=self.config.replace_settle_timeout)
            return
        log.info("failover_settled", service=service.name, waited_ms=round((time.monotonic() - t0) * 1e3, 1))

    async def _bounded(self, coro: Awaitable, action: str, target: str) -> None:
        try:
            async with asyncio.timeout(self.config.fence_timeout):
                await coro
        except TimeoutError:
            log.error("launcher_timeout", action=action, target=target, timeout_s=self.config.fence_timeout,
                      hint="a launcher call returns once its action is under way (router/launcher.py)")
        except Exception as exc:  # noqa: BLE001 - a launcher bug must not take the router down
            log.error("launcher_failed", action=action, target=target, error=repr(exc))

    def best_standby(self, service: Service, exclude: Instance | None = None,
                     failed: str | None = None) -> Instance | None:
        ready = [i for i in service.standbys() if i.ready and not i.suspect and not i.fenced and i is not exclude
                 and self.roles.refusal(service.name, i.name) is None]
        if not ready:
            return None
        # The role store's preference first (in a cluster: away from a suspect node), then the
        # healthiest: fewest recent failures, then the quickest probe answer.
        return min(ready, key=lambda i: (self.roles.rank(i.name, failed), i.failures, i.probe_latency or 0.0))

    def promote_best(self, service: Service, reason: str, failed: str | None = None) -> Instance | None:
        """Switch to the best ready standby; with a cluster role store, claim it first (the switch
        follows the claim's answer, see router/peering.py) and return None."""
        new = self.best_standby(service, failed=failed)
        if new is None:
            log.error("no_ready_standby", service=service.name, reason=reason,
                      hint="requests wait up to the queue deadline for a standby to become ready")
            return None
        if not self.roles.decides_locally:
            self.roles.claim(service.name, new.name, reason, failed)
            return None
        self._switch(service, new, reason)
        return new

    def _switch(self, service: Service, new: Instance, reason: str) -> None:
        now = time.monotonic()
        pending = self.pending.get(service.name)
        timings = {}
        if pending is not None and pending.switched is None:
            pending.switched, pending.new = now, new.name
            timings = {"detect_ms": (pending.detected - pending.last_ok) * 1e3,
                       "switch_ms": (now - pending.detected) * 1e3}
        self.set_role(new, states.PRIMARY, f"promoted: {reason}", **timings)
        service.primary = new
        service.refresh()

    def note_ok(self, inst: Instance) -> None:
        """A good response or chunk came from ``inst`` (hot path: cheap unless a failover is open)."""
        inst.last_ok = now = time.monotonic()
        if not self.pending:
            return
        pending = self.pending.get(inst.service)
        if pending is None or pending.new != inst.name:
            return
        del self.pending[inst.service]
        blackout = now - pending.last_ok
        self.metrics.blackout.labels(inst.service).observe(blackout)
        self.last_failover[inst.service] = record = {
            "old": pending.old, "new": inst.name, "reason": pending.reason,
            "detect_ms": round((pending.detected - pending.last_ok) * 1e3, 2),
            "switch_ms": round((pending.switched - pending.detected) * 1e3, 2),
            "blackout_ms": round(blackout * 1e3, 2), "at": time.time(),
            # this process's monotonic clock, for benchmarks that line failovers up with their faults
            "monotonic": {"last_ok": pending.last_ok, "detected": pending.detected,
                          "switched": pending.switched, "first_ok": now}}
        self.history.append((inst.service, record))
        log.info("failover_complete", service=inst.service, **record)

    # -- planned operations -------------------------------------------------------------------
    async def switchover(self, service: Service, to: str | None) -> dict:
        """Planned promotion: switch first (no blackout), then let the old primary drain. In a
        cluster: a CAS in etcd; every router lets the old primary finish its in-flight requests."""
        if not self.roles.decides_locally:
            old, new = service.primary, self._pick_target(service, to)
            await self._claim_planned(service, new, "planned")
            return {"service": service.name, "primary": new.name, "previous": old.name if old else None}
        async with service.lock:
            old, new, t0 = service.primary, self._pick_target(service, to), time.monotonic()
            if old is not None:
                self.set_role(old, states.DRAINING, "planned switchover")
            self._switch(service, new, "planned")
            self.metrics.failovers.labels(service.name, "planned").inc()
            drained = True
            if old is not None:
                drained = await self._wait_idle(old)
                if old.role == states.DRAINING and not old.fenced:
                    self.set_role(old, states.STANDBY, "switchover done", drain_ms=(time.monotonic() - t0) * 1e3)
            return {"service": service.name, "primary": new.name,
                    "previous": old.name if old else None, "drained": drained}

    async def _claim_planned(self, service: Service, new: Instance, reason: str) -> None:
        if not await self.roles.claim_planned(service.name, new.name, reason) or service.primary is not new:
            raise AdminError(409, "etcd did not take the switchover: another router changed the primary "
                             "meanwhile, or etcd cannot be written", "cluster")

    def _pick_target(self, service: Service, to: str | None) -> Instance:
        if to is None:
            new = self.best_standby(service)
            if new is None:
                raise AdminError(409, f"service {service.name!r} has no ready standby to promote", "no_standby")
            return new
        new = service.instances.get(to)
        if new is None:
            raise AdminError(404, f"unknown instance {to!r} in service {service.name!r}; "
                             f"known: {sorted(service.instances)}", "not_found")
        if (why := self.roles.refusal(service.name, new.name)) is not None:
            raise AdminError(409, f"instance {to!r} may not be promoted: {why}", "fingerprint")
        if new.role != states.STANDBY or not new.ready or new.fenced:
            raise AdminError(409, f"instance {to!r} is {new.role} and {'ready' if new.ready else 'not ready'}; "
                             "only a ready standby can be promoted", "not_ready")
        return new

    async def drain(self, inst: Instance, timeout: float | None) -> dict:
        """Stop routing to ``inst`` (switching away first if it is the primary), wait, then stop it."""
        service = self.services[inst.service]
        async with service.lock:
            t0 = time.monotonic()
            if inst.role == states.PRIMARY:
                new = self.best_standby(service, exclude=inst)
                if new is None:
                    raise AdminError(409, f"{inst.name} is the primary of {service.name!r} and no ready "
                                     "standby can take over; add one or promote first", "no_standby")
                if not self.roles.decides_locally:  # a CAS; the Follower hands the old primary over
                    await self._claim_planned(service, new, "drain")
                else:
                    self.set_role(inst, states.DRAINING, "drain")
                    self._switch(service, new, "drain")
                self.metrics.failovers.labels(service.name, "planned").inc()
            elif inst.role == states.STANDBY:
                self.set_role(inst, states.DRAINING, "drain")
            elif inst.role != states.DRAINING:
                raise AdminError(409, f"{inst.name} is {inst.role}; only a primary or standby can be drained",
                                 "bad_state")
            drained = await self._wait_idle(inst, timeout)
            if inst.role == states.DRAINING:
                self.set_role(inst, states.STOPPED, "drained", drain_ms=(time.monotonic() - t0) * 1e3)
            return {"instance": inst.name, "role": inst.role, "drained": drained, "inflight": inst.inflight}

    async def _wait_idle(self, inst: Instance, timeout: float | None = None) -> bool:
        try:
            async with asyncio.timeout(timeout if timeout is not None else self.config.drain_timeout):
                await inst.idle.wait()
            return True
        except TimeoutError:
            log.warning("drain_timeout", instance=inst.name, inflight=inst.inflight)
            return False

    async def preempt(self, service: Service, *, evict: bool = True) -> dict:
        """Stop routing to ``service``; then (``evict``) the launcher evicts its engines. Without
        ``evict`` the launcher did (or does) that itself and only tells the router."""
        async with service.lock:
            for inst in service.instances.values():
                if inst.role in states.WATCHED:
                    self.set_role(inst, states.PREEMPTED, "preempt")
                    self.set_ready(inst, False, "preempted")
            service.primary = None
            service.refresh()
            if evict:
                await self._bounded(self.launcher.preempt(service.name), "preempt", service.name)
            return {"service": service.name, "preempted": True}

    async def resume(self, service: Service, watch: Callable[[Instance], None], *, relaunch: bool = True) -> dict:
        """``service`` comes back: (``relaunch``) the launcher starts its engines, then its preempted
        instances are standbys until a probe says ready."""
        async with service.lock:
            if relaunch:
                await self._bounded(self.launcher.resume(service.name), "resume", service.name)
            for inst in service.instances.values():
                if inst.role == states.PREEMPTED:
                    inst.generation += 1
                    inst.fenced = inst.suspect = inst.ever_ready = False  # its engine starts afresh
                    inst.failures = 0
                    self.set_role(inst, states.STANDBY, "resume")
                    watch(inst)  # the first ready probe promotes one of them
            return {"service": service.name, "preempted": False}
