"""What the router asks of whoever started the engines (the supervisor), and a null one.

The router never spawns or signals a process itself: it decides, the launcher acts. Every method
is awaited in the router's event loop as a background task, so a slow launcher delays nothing on
the request path; each call is bounded by ``RouterConfig.fence_timeout`` and its errors are logged.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import structlog

log = structlog.get_logger(__name__)


@runtime_checkable
class Launcher(Protocol):
    async def request_standby(self, service: str) -> None:
        """A standby of ``service`` was used up (promoted, or it died): start a replacement.

        Return once the start is under way, not when it is ready: the call is bounded by
        ``fence_timeout`` (an engine's start can take longer) and cancelled past it. The launcher
        registers the new engine when it is ready with ``Router.register(service, name, url,
        "standby", pid)``, under a new name or under the failed instance's name (which is then
        re-registered: its role goes relaunching -> standby). A launcher that relaunches on the
        fenced process's exit anyway (the node's, through its restart policy) does nothing here.
        """

    async def fence(self, name: str) -> None:
        """Stop instance ``name`` for good: SIGTERM, SIGKILL if it does not go within a deadline.

        Called after the router stopped routing to it and aborted its in-flight requests, so a
        half-alive engine can never answer a client again.
        """

    def is_batch(self, service: str) -> bool:
        """Whether ``service`` is a batch (co-served) service, the only kind an operator may preempt
        without ``force``: preempting an online service stops its primary and standbys."""

    async def preempt(self, service: str) -> None:
        """Co-serving: evict the engines of ``service`` (the router already stopped routing)."""

    async def resume(self, service: str) -> None:
        """Co-serving: bring ``service`` back; its instances are standbys until a probe says ready."""


class NullLauncher:
    """Standalone router: it did not start the engines, so fencing only means never routing again.

    ``warn=False`` (router workers 2..N of ``failover router --workers N``: every worker fences the
    same instance) logs these at debug level, so the operator is told once, by worker 1.

    ``cluster=True``: a peer router of a cluster (``failover router --etcd/--k8s-lease``). Nobody
    has to act on its behalf: the instance's own node follows the roles in the store (its router
    fences the engine that lost the primary key, its supervisor relaunches it as a standby), so
    these are an info line, ``left_to_node``, not a warning to stop something by hand."""

    def __init__(self, warn: bool = True, cluster: bool = False) -> None:
        self._log = log.warning if warn else log.debug
        self._cluster = cluster

    async def request_standby(self, service: str) -> None:
        if self._cluster:
            log.info("left_to_node", action="request_standby", service=service)
            return
        self._log("no_launcher", action="request_standby", service=service,
                  hint="standalone router: start a new standby and restart the router with it")

    async def fence(self, name: str) -> None:
        if self._cluster:
            log.info("left_to_node", action="fence", instance=name)
            return
        self._log("no_launcher", action="fence", instance=name,
                  hint="standalone router: the instance is no longer routed to; stop it yourself")

    def is_batch(self, service: str) -> bool:
        return False  # a standalone router serves online traffic only

    async def preempt(self, service: str) -> None:
        log.info("no_launcher", action="preempt", service=service)

    async def resume(self, service: str) -> None:
        log.info("no_launcher", action="resume", service=service)
