"""The router as a node runs it: the Launcher it calls, and the node's additions to its admin API.

``NodeLauncher`` is the node's side of ``router.launcher.Launcher``: the router decides, the
supervisor acts; it is built from the supervisor's methods, one per call. Each call returns quickly
(the router bounds it by ``fence_timeout``). ``NodeRouter`` adds what only the node knows: the
status of its slots, daemon and zygote; a drained instance recycled as a fresh standby; a failed
batch opening its files again before a resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from failover.config.schema import Config
from router.app import Router
from router.config import RouterConfig


def router_config(config: Config) -> RouterConfig:
    r, sup = config.router, config.supervisor
    return RouterConfig(host=r.host, port=r.port, admin_token_file=config.token_path,
                        probe_interval=r.probe_interval, probe_timeout=r.probe_timeout,
                        failure_threshold=r.probe_threshold, queue_deadline=r.queue_timeout,
                        max_body_bytes=r.max_body_bytes, max_buffered_bytes=r.max_buffered_bytes,
                        body_timeout=r.body_timeout, max_upstream=r.max_upstream,
                        upstream_queue_size=r.upstream_queue_size, loop_lag_tolerance=r.loop_lag_tolerance,
                        replace_settle_timeout=r.replace_settle_timeout, hang_probe_timeout=r.hang_probe_timeout,
                        drain_timeout=sup.drain_timeout, fence_timeout=sup.stop_timeout + 5.0,
                        shutdown_timeout=sup.drain_timeout)


async def _relaunched_on_exit(service: str) -> None:
    """A node relaunches a failed instance when its process exits (through the restart policy), and
    every fence ends in an exit: nothing more to do when the router asks for a replacement."""


@dataclass(frozen=True, slots=True)
class NodeLauncher:
    """router.launcher.Launcher for a node: each call is one of the supervisor's methods."""

    fence: Callable[[str], Awaitable[None]]
    is_batch: Callable[[str], bool]
    preempt: Callable[[str], Awaitable[None]]
    resume: Callable[[str], Awaitable[None]]
    request_standby: Callable[[str], Awaitable[None]] = _relaunched_on_exit


class NodeRouter(Router):
    """Router plus the node's view. ``describe(doc)`` adds the node's status to the router's;
    ``before_resume(service)`` may answer a resume itself (a failed batch; raises AdminError when
    refused); ``retire(instance)`` recycles a drained instance, False when it is not the node's."""

    def __init__(self, config: RouterConfig, launcher: NodeLauncher, *, describe: Callable[[dict], dict],
                 before_resume: Callable[[str], Awaitable[dict | None]],
                 retire: Callable[[str], bool], roles=None) -> None:
        super().__init__(config, launcher, roles)
        self._describe, self._before_resume, self._retire = describe, before_resume, retire

    def status(self) -> dict:
        return self._describe(super().status())

    async def resume(self, service: str) -> dict:
        answer = await self._before_resume(service)
        return answer if answer is not None else await super().resume(service)

    async def drain(self, instance: str, timeout: float | None = None) -> dict:
        """Drain, then recycle: the drained process is stopped and comes back as a fresh standby."""
        result = await super().drain(instance, timeout)
        if self._retire(instance):
            result["relaunch"] = "the drained instance restarts as a fresh standby"
        return result
