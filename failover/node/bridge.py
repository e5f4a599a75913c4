"""The router as the supervisor runs it: the Launcher it calls, and a status that tells the whole node.

``NodeLauncher`` is the supervisor's side of ``router.launcher.Launcher``: the router decides, the
supervisor acts. Each call returns quickly (the router bounds it by ``fence_timeout``); a replacement
is started in the background and registers itself once ready.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from failover.config.schema import Config
from failover.coserve.coserver import DONE, ResumeRefused
from router.app import Router
from router.config import RouterConfig
from router.errors import AdminError

if TYPE_CHECKING:
    from failover.node.supervisor import Supervisor


def router_config(config: Config) -> RouterConfig:
    r, sup = config.router, config.supervisor
    return RouterConfig(host=r.host, port=r.port, admin_token_file=config.token_path,
                        probe_interval=r.probe_interval, probe_timeout=r.probe_timeout,
                        failure_threshold=r.probe_threshold, queue_deadline=r.queue_timeout,
                        max_body_bytes=r.max_body_bytes, max_buffered_bytes=r.max_buffered_bytes,
                        body_timeout=r.body_timeout,
                        drain_timeout=sup.drain_timeout, fence_timeout=sup.stop_timeout + 5.0,
                        shutdown_timeout=sup.drain_timeout)


class NodeLauncher:
    def __init__(self, supervisor: "Supervisor") -> None:
        self.supervisor = supervisor

    async def request_standby(self, service: str) -> None:
        self.supervisor.ensure_service(service)

    async def fence(self, name: str) -> None:
        await self.supervisor.fence(name)

    def is_batch(self, service: str) -> bool:
        return self.supervisor.coserve.is_batch(service)

    async def preempt(self, service: str) -> None:
        await self.supervisor.preempt(service)

    async def resume(self, service: str) -> None:
        await self.supervisor.resume(service)


class NodeRouter(Router):
    """Router plus the supervisor's view: per-instance uptime and weight source, slots, daemon, zygote."""

    def __init__(self, config: RouterConfig, launcher: NodeLauncher, supervisor: "Supervisor") -> None:
        super().__init__(config, launcher)
        self.supervisor = supervisor

    def status(self) -> dict:
        doc = super().status()
        now = time.monotonic()
        slots = self.supervisor.slots
        for svc in doc["services"]:
            if svc["name"] in self.supervisor.failed:
                svc["state"] = "failed: " + self.supervisor.failed[svc["name"]]
            if svc["name"] in self.supervisor.coserve.jobs:
                svc["batch"] = self.supervisor.coserve.jobs[svc["name"]].progress()
            for inst in svc["instances"]:
                slot = slots.get(inst["name"])
                if slot is not None and slot.pid is not None and slot.launched_at is not None:
                    inst["uptime_s"] = round(now - slot.launched_at, 1)
                    inst["weights_source"] = slot.ready_info.get("weights_source")
        doc["supervisor"] = self.supervisor.status()
        return doc

    async def resume(self, service: str) -> dict:
        """A failed batch service first opens its files again: still unusable, the resume is refused
        (409, with the reason) instead of answering ok and changing nothing."""
        coserve = self.supervisor.coserve
        if coserve.is_batch(service):
            try:
                coserve.retry(service)
            except ResumeRefused as e:
                raise AdminError(409, str(e), "resume_refused") from None
            if service not in self.services:  # failed before its engine ever registered
                await self.supervisor.resume(service)
                return {"service": service, "preempted": False, "message": "relaunching its engine"}
            job = coserve.jobs[service]
            if job.state == DONE:
                return {"service": service, "preempted": False,
                        "message": f"batch {service} is done ({job.runner.progress.done} results in "
                                   f"{job.svc.batch.output}); nothing to resume"}
        return await super().resume(service)

    async def drain(self, instance: str, timeout: float | None = None) -> dict:
        """Drain, then recycle: the drained process is stopped and comes back as a fresh standby."""
        result = await super().drain(instance, timeout)
        if instance in self.supervisor.slots:
            self.supervisor.background(self.supervisor.retire(instance), f"retire-{instance}")
            result["relaunch"] = "the drained instance restarts as a fresh standby"
        return result
