"""How a router follows the cluster's decisions (router/roles.py) with its own state machine.

Three callbacks, given to EtcdRoles as its ``Claims``:
- ``switch``: this router's claim won: the pointer swap, as on one node;
- ``follow``: etcd names a primary (another router's claim, or a read): the current primary, if
  another, is fenced (its in-flight requests abort and resume on the new one, as after a failure:
  streams migrate across nodes, since the new primary may be another node's engine; on a node,
  fencing also stops the engine, so a superseded primary never answers again) and the named one,
  when this router knows it as a standby, becomes the primary;
- ``gone``: whether a holder is dead as far as this router knows (only then may it be replaced).
"""

from __future__ import annotations

import structlog

from router import states
from router.backend import Service
from router.promotion import Promoter

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
        self._demote(svc, inst, "superseded")
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
        self._demote(svc, inst, f"etcd names {name or 'no instance'} (revision {revision})")
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

    def _demote(self, svc: Service, keep, why: str) -> None:
        old = svc.primary
        if old is None or old is keep:
            return
        svc.primary = None  # taken out first: fail() then fences without promoting anyone
        log.warning("primary_superseded", service=svc.name, instance=old.name, why=why)
        self.promoter.fail(old, "superseded")
