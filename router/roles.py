"""Who decides a service's primary: the router alone (one node), or etcd for a whole cluster.

A :class:`RoleStore` is the seam between the Promoter's verdicts and the decision. ``LocalRoles``
decides at once (the one-node router: the switch stays a synchronous pointer swap). ``EtcdRoles``
asks etcd first: a promotion is one compare-and-swap of the service's primary key, comparing the mod
revision this router last saw, so of two routers that see the same failure exactly one wins; the
other learns the winner from the answer and follows it. The revision the winner wrote is the
fencing token: any holder named under an older revision is out. While etcd cannot be written,
nothing is promoted.

Keys, under ``/failover/<cluster>/``::

    nodes/<node>                       node record, under the node's lease
    instances/<service>/<slot>@<node>  url, role, ready, fingerprint, incarnation; node's lease
    primary/<service>                  {"instance": "<slot>@<node>", ...}; no lease, CAS only
    routers/<id>                       what that router saw; under the router's lease
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from failover_common.etcd import Etcd, EtcdError, EtcdUnavailable
from failover_common.tasks import Tasks

log = structlog.get_logger(__name__)


def cluster_prefix(cluster: str) -> str:
    return f"/failover/{cluster}/"


def instance_id(slot: str, node: str) -> str:
    return f"{slot}@{node}"


def node_of(instance: str) -> str | None:
    return instance.rpartition("@")[2] if "@" in instance else None


class RoleStore(Protocol):
    decides_locally: bool  # True: a promotion takes effect at once, without a round trip

    def claim(self, service: str, new: str, reason: str, failed: str | None) -> None:
        """Start making ``new`` the primary of ``service`` (``failed``: the primary that just failed)."""

    def rank(self, candidate: str, failed: str | None) -> int:
        """Order of preference among ready standbys, lower first."""

    def refusal(self, service: str, candidate: str) -> str | None:
        """Why ``candidate`` may not become the primary of ``service`` at all (None: it may)."""


class LocalRoles:
    """One router, one node: its own verdict is the decision."""

    decides_locally = True

    def claim(self, service: str, new: str, reason: str, failed: str | None) -> None:
        raise AssertionError("LocalRoles decides locally: the Promoter switches without claiming")

    def rank(self, candidate: str, failed: str | None) -> int:
        return 0

    def refusal(self, service: str, candidate: str) -> str | None:
        return None


# Reasons of a primary key written by an operator's command: the old primary is alive and is
# handed over (no new requests, its in-flight ones finish), not fenced at once.
PLANNED = frozenset({"planned", "drain"})


@dataclass(slots=True)
class Holder:
    instance: str | None  # cluster id of the primary, None when no key
    revision: int  # mod revision of the primary key (0: absent): what the next CAS compares
    by: str = ""  # the router that wrote it
    at: float = 0.0
    reason: str = ""  # why it was written (PLANNED: a handover)


@dataclass(slots=True)
class Claims:
    """What the Promoter gives EtcdRoles: how to find, follow and switch to instances by local name."""

    switch: Callable[[str, str, str, int], None]  # (service, local name, reason, revision): claim won
    follow: Callable[[str, str | None, int], None]  # (service, local name or None, revision): etcd says
    gone: Callable[[str, str | None], bool]  # (service, local name or None): is that holder dead to us?


@dataclass
class EtcdRoles:
    """The cluster's decisions through etcd. A node router (``node`` set) knows its own slots by
    slot name; a peer router uses cluster ids (``slot@node``) as names. Of its backend it only uses
    ``swap``: ``failover_common.k8s_lease.KubeLeases`` (Kubernetes Leases) serves as well."""

    etcd: Etcd
    cluster: str
    router_id: str
    node: str | None = None  # a node's router: its instances are named by slot alone
    holders: dict[str, Holder] = field(default_factory=dict)
    claims: Claims | None = None
    nodes_alive: set[str] = field(default_factory=set)  # from the node records (peer routers)
    promotions: list[dict] = field(default_factory=list)  # this router's won claims (status, tests)
    refused: int = 0  # claims not even tried: etcd could not be written
    # cluster id -> the model fingerprint key in its record (set by router.cluster.join)
    fingerprint_of: Callable[[str], str | None] | None = None
    reference: dict[str, str] = field(default_factory=dict)  # service -> its primary's fingerprint
    mismatched: dict[str, str] = field(default_factory=dict)  # instance -> why it is never promoted
    _busy: set[str] = field(default_factory=set)
    _tasks: Tasks = field(default_factory=Tasks)

    decides_locally = False

    @property
    def prefix(self) -> str:
        return cluster_prefix(self.cluster)

    def primary_key(self, service: str) -> str:
        return f"{self.prefix}primary/{service}"

    # -- names ----------------------------------------------------------------------------------
    def to_cluster(self, name: str) -> str:
        return instance_id(name, self.node) if self.node is not None else name

    def to_local(self, instance: str | None) -> str | None:
        """The router's name of cluster instance ``instance``; None when it is not one of ours."""
        if instance is None or self.node is None:
            return instance
        slot, _, node = instance.rpartition("@")
        return slot if node == self.node else None

    # -- what etcd says -------------------------------------------------------------------------
    def seen(self, service: str, value: str | None, revision: int) -> None:
        """The primary key of ``service`` as read or watched (None: deleted or absent)."""
        old = self.holders.get(service)
        if old is not None and revision and revision < old.revision:
            return  # a late echo of an older value
        doc = _json(value)
        holder = Holder(doc.get("instance") if value else None, revision, doc.get("by", ""), doc.get("at", 0.0),
                        str(doc.get("reason", "")))
        self.holders[service] = holder
        if self.claims is not None and (old is None or old.instance != holder.instance or value is None):
            self.claims.follow(service, self.to_local(holder.instance), revision)

    def rank(self, candidate: str, failed: str | None) -> int:
        """Another node's standby first when the failed primary's node is suspect; and every node
        whose lease is gone last (a peer router drops those instances anyway)."""
        cnode, fnode = node_of(self.to_cluster(candidate)), node_of(self.to_cluster(failed)) if failed else None
        if self.node is None and self.nodes_alive and cnode not in self.nodes_alive:
            return 2
        return 1 if fnode is not None and cnode == fnode else 0

    def refusal(self, service: str, candidate: str) -> str | None:
        """An instance whose model fingerprint (by content, failover/cluster/fingerprint.py) differs
        from the service's primary's is never promoted: its tokens would not continue the streams
        that migrate to it. The reference is the last primary whose record was seen (a dead node's
        record goes, its fingerprint stays). Unknown on either side: no verdict."""
        if self.fingerprint_of is None:
            return None
        holder = self.holders.get(service)
        if holder is not None and holder.instance is not None:
            ref = self.fingerprint_of(holder.instance)
            if ref and ref != "unknown":
                self.reference[service] = ref
        ref, ident = self.reference.get(service), self.to_cluster(candidate)
        mine = self.fingerprint_of(ident)
        if not ref or not mine or "unknown" in (ref, mine) or ref == mine:
            self.mismatched.pop(ident, None)
            return None
        why = f"model fingerprint {mine} differs from the primary's {ref} (another checkpoint, dtype, tp or transform)"
        if self.mismatched.get(ident) != why:
            self.mismatched[ident] = why
            log.error("promotion_refused_fingerprint", service=service, instance=ident, fingerprint=mine,
                      primary_fingerprint=ref, hint="serve the same checkpoint on every node of a service")
        return why

    # -- claims ---------------------------------------------------------------------------------
    def claim(self, service: str, new: str, reason: str, failed: str | None) -> None:
        if service in self._busy:
            return  # one claim at a time per service; the next verdict tries again
        self._busy.add(service)
        self._tasks.spawn(self._claim(service, new, reason, failed), f"claim-{service}")

    async def claim_planned(self, service: str, new: str, reason: str = "planned") -> bool:
        """An operator's switchover (``reason`` in PLANNED): replace the holder even though it is
        alive; every router then lets it finish its in-flight requests; True when won."""
        assert reason in PLANNED, reason
        while service in self._busy:
            await asyncio.sleep(0.01)
        self._busy.add(service)
        holder = self.holders.get(service) or Holder(None, 0)
        await self._claim(service, new, reason, self.to_local(holder.instance))
        return (self.holders.get(service) or Holder(None, 0)).instance == self.to_cluster(new)

    async def _claim(self, service: str, new: str, reason: str, failed: str | None) -> None:
        assert self.claims is not None, "EtcdRoles.claims is set by the Promoter"
        try:
            holder = self.holders.get(service) or Holder(None, 0)
            local = self.to_local(holder.instance)
            if holder.instance is not None and holder.instance != self.to_cluster(failed or "") \
                    and not self.claims.gone(service, local):
                self.claims.follow(service, local, holder.revision)  # a live primary: etcd's, not ours
                return
            if (why := self.refusal(service, new)) is not None:
                log.error("promotion_refused", service=service, candidate=new, reason=reason, why=why)
                return
            value = json.dumps({"instance": self.to_cluster(new), "by": self.router_id,
                                "reason": reason, "at": time.time(), "previous": holder.instance})
            t0 = time.monotonic()
            try:
                result = await self.etcd.swap(self.primary_key(service), holder.revision, value)
            except EtcdUnavailable as exc:
                self.refused += 1
                log.error("promotion_refused", service=service, candidate=new, reason=reason,
                          why="etcd cannot be written; never promote without it", error=str(exc))
                return
            except EtcdError as exc:
                log.error("promotion_failed", service=service, candidate=new, error=str(exc))
                return
            cas_ms = round((time.monotonic() - t0) * 1e3, 2)
            if result.ok:
                self.holders[service] = Holder(self.to_cluster(new), result.revision, self.router_id, time.time(),
                                               reason)
                self.promotions.append({"service": service, "instance": self.to_cluster(new),
                                        "previous": holder.instance, "revision": result.revision,
                                        "reason": reason, "at": time.time(), "cas_ms": cas_ms})
                log.info("promotion_won", service=service, instance=new, revision=result.revision,
                         previous=holder.instance, cas_ms=cas_ms)
                self.claims.switch(service, new, reason, result.revision)
            else:
                cur = result.current
                log.info("promotion_lost", service=service, candidate=new, cas_ms=cas_ms,
                         holder=cur.json().get("instance") if cur else None)
                self.seen(service, cur.value if cur else None, cur.mod_revision if cur else 0)
        finally:
            self._busy.discard(service)

    async def stop(self) -> None:
        await self._tasks.stop()

    def as_json(self) -> dict:
        return {"holders": {s: {"instance": h.instance, "revision": h.revision, "by": h.by, "at": h.at}
                            for s, h in self.holders.items()},
                "promotions": self.promotions[-10:], "refused": self.refused,
                "fingerprints": dict(self.reference), "not_promoted": dict(self.mismatched)}


def _json(value: str | None) -> dict:
    if not value:
        return {}
    try:
        doc = json.loads(value)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}
