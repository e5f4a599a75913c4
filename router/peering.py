"""How a router follows the cluster's decisions (router/roles.py) with its own state machine.

Three callbacks, given to EtcdRoles as its ``Claims``:
- ``switch``: this router's claim won: the pointer swap, as on one node;
- ``follow``: etcd names a primary (another router's claim, or a read): the current primary, if
  another, is fenced (its in-flight requests abort and resume on the new one, as after a failure:
  streams migrate across nodes, since the new primary may be another node's engine; on a node,
  fencing also stops the engine, so a superseded primary never answers again) and the named one,
  when this router knows it as a standby, becomes the primary;
- ``gone``: whether a holder is dead as far as this router knows (only then may it be replaced).

A primary key written by an operator (``failover promote --to``, ``failover drain``: its reason is
in ``roles.PLANNED``) hands the old primary over instead: every router stops sending it new
requests (DRAINING) and lets its in-flight ones finish, then fences it (its node relaunches it as a
fresh standby). A router waits for its own in-flight requests (at most ``drain_timeout``); the
old primary's node router, which cannot see the peers' requests, waits the whole ``drain_timeout``
before it stops the engine; whatever still runs then migrates, as after a failure.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from router import states
from router.backend import Service
from router.promotion import Promoter
from router.roles import PLANNED

log = structlog.get_logger(__name__)


class Follower:
    def __init__(self, services: dict[str, Service], promoter: Promoter, *, directory: bool) -> None:
        self.services = services
        self.promoter = promoter
        self.directory = directory  # a peer router: it knows every live instance of the cluster
        self.tokens: dict[str, int] = {}  # service -> fencing token (revision) of its primary here

    def switch(self, service: str, name: str, reason: str, revision: int) -> None:
        svc = self.services.get(service)
        inst = svc.instances.get(name) if svc is not None else None
        if svc is None:
            return
        if inst is None or inst.fenced or inst.role != states.STANDBY:
            # won for an instance that failed meanwhile: it holds the key now, so claim past it
            log.warning("claimed_instance_gone", service=service, instance=name)
            self.promoter.promote_best(svc, "claimed instance gone", failed=name)
            return
        self._demote(svc, inst, "superseded", handover=reason in PLANNED)
        self.tokens[service] = revision
        self.promoter._switch(svc, inst, f"{reason} (revision {revision})")

    def follow(self, service: str, name: str | None, revision: int) -> None:
        svc = self.services.get(service)
        if svc is None:
            return
        inst = svc.instances.get(name) if name is not None else None
        if inst is not None and svc.primary is inst and inst.role == states.PRIMARY:
            self.tokens[service] = revision
            return
        holder = self.promoter.roles.holders.get(service)
        self._demote(svc, inst, f"etcd names {name or 'no instance'} (revision {revision})",
                     handover=holder is not None and holder.reason in PLANNED)
        if inst is None or inst.fenced or inst.role in states.OUT_OF_SERVICE:
            return  # unknown here, or out of service: followed again when it is (re-)registered
        if inst.role == states.DRAINING:
            self.promoter.set_role(inst, states.STANDBY, "etcd names it primary")
        if inst.role == states.STANDBY:
            self.tokens[service] = revision
            self.promoter._switch(svc, inst, f"etcd names it (revision {revision})")

    def gone(self, service: str, name: str | None) -> bool:
        svc = self.services.get(service)
        inst = svc.instances.get(name) if svc is not None and name is not None else None
        if inst is None:
            return self.directory
        return inst.fenced or inst.role in states.OUT_OF_SERVICE

    def _demote(self, svc: Service, keep, why: str, *, handover: bool = False) -> None:
        old = svc.primary
        if old is None or old is keep:
            return
        svc.primary = None  # taken out first: fail() then fences without promoting anyone
        if handover and old.role == states.PRIMARY and not old.fenced:
            log.info("primary_handed_over", service=svc.name, instance=old.name, why=why)
            self.promoter.set_role(old, states.DRAINING, f"handed over: {why}")
            svc.refresh()
            self.promoter.spawn(self._retire(old), f"retire-{old.name}")
            return
        log.warning("primary_superseded", service=svc.name, instance=old.name, why=why)
        self.promoter.fail(old, "superseded")

    async def _retire(self, old) -> None:
        """The handed-over primary: its in-flight requests here finish (on a node: the peers' too,
        within the grace), then it is fenced; an operator's drain may have stopped it first."""
        t0, grace = time.monotonic(), self.promoter.config.drain_timeout
        await self.promoter._wait_idle(old, grace)
        if not self.directory:
            await asyncio.sleep(max(0.0, grace - (time.monotonic() - t0)))
        if old.role == states.DRAINING and not old.fenced:
            self.promoter.fail(old, "handed over")
