"""The node's side of the cluster: its lease, its records, and its router following etcd.

``NodeCluster`` is built by the supervisor when the config has a ``[cluster]`` table:

- the node router decides through ``EtcdRoles`` (a claim is a compare-and-swap in etcd) and follows
  the primary keys (``router.cluster.ClusterView``, without the directory: a node router knows its
  own instances only). An instance that loses the primary key is fenced by the router's usual path:
  no more requests, in-flight ones aborted, and the supervisor's ``fence`` kills the engine if it still
  runs; its exit relaunches it locally as a standby, against the node's own resident weights.
- the registration: a lease of ``ttl`` seconds kept alive every ``ttl/4``; under it the node record
  (heartbeat time, supervisor pid, router URL) and one record per instance slot (URL, role, readiness,
  pid, the model fingerprint), rewritten when they change. A node that dies or freezes past the TTL
  loses them all at once; the peer routers then fail its primary over. A node that finds its lease
  gone (it was frozen) registers again under a new one; its instances come back as standbys.

Ownership: it owns its etcd client (closed in ``close()``) and its lease (revoked in ``leave()``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import structlog

from failover.cluster.fingerprint import fingerprint
from failover.config.schema import ClusterConfig, Config
from failover.procs.slots import Slot
from failover_common.etcd import Etcd, EtcdError, EtcdUnavailable, LeaseLost
from failover_common.k8s_store import KubeStore, in_cluster_defaults
from router.cluster import ClusterView, join
from router.roles import EtcdRoles, cluster_prefix, instance_id

log = structlog.get_logger(__name__)


def make_store(c: ClusterConfig, env) -> Etcd | KubeStore:
    """The node's store: etcd, or Kubernetes Leases (``backend = "k8s"``; in a pod the API server
    and the service account come from ``env`` and its files). Each call's deadline, per member, is
    ttl/4 (0.2 - 1 s): a frozen member costs that much, well inside the TTL."""
    deadline = max(0.2, min(1.0, c.ttl / 4))
    if c.backend == "k8s":
        api, token, ca = in_cluster_defaults(c.api, Path(c.token_file) if c.token_file else None,
                                             Path(c.ca_file) if c.ca_file else None, env)
        return KubeStore.connect(api, c.namespace, c.name, token_file=token, ca_file=ca, timeout=deadline,
                                 poll=max(0.1, c.ttl / 8))
    return Etcd(c.etcd, timeout=deadline)


class NodeCluster:
    def __init__(self, config: Config, slots: dict[str, Slot]) -> None:
        assert config.cluster is not None
        self.config, self.c, self.slots = config, config.cluster, slots
        self.etcd = make_store(self.c, os.environ)
        self.roles = EtcdRoles(self.etcd, self.c.name, router_id=f"node-{self.c.node}", node=self.c.node)
        self.prefix = cluster_prefix(self.c.name)
        self.view: ClusterView | None = None
        self.router = None
        self.lease = 0
        self.registered_at: float | None = None  # wall clock of the current lease's grant
        self.registrations = 0
        self.published: dict[str, str] = {}  # key -> value last written under the current lease
        self.changed = asyncio.Event()
        m = config.model
        self.fingerprint = fingerprint(m.path, dtype=m.dtype, tp=m.tp, transform=m.transform, device=m.device)
        self._task: asyncio.Task | None = None
        self._full_at = 0.0

    def attach(self, router) -> None:
        """``router`` was built with ``roles=self.roles``; follow etcd and republish on role changes."""
        self.router = router
        self.view = join(router, self.etcd, self.roles, directory=False, ttl=self.c.ttl,
                         url=self.config.router_url)
        router.watch_roles(lambda *_: self.changed.set())

    def start(self) -> None:
        assert self.view is not None, "attach() first"
        self.view.start()
        self._task = asyncio.ensure_future(self._register())
        self._task.set_name("etcd-register")

    # -- records --------------------------------------------------------------------------------
    def node_record(self) -> dict:
        return {"node": self.c.node, "host": self.c.host, "router": self.config.router_url,
                "supervisor_pid": os.getpid(), "registered_at": self.registered_at,
                "registrations": self.registrations, "ttl": self.c.ttl, "at": time.time()}

    def instance_record(self, slot: Slot) -> dict:
        inst = self.router._find(slot.name) if self.router is not None else None
        return {"service": slot.service, "slot": slot.name, "node": self.c.node, "url": slot.url,
                "role": inst.role if inst is not None else "starting",
                "ready": bool(inst is not None and inst.serving_ready),
                "pid": inst.pid if inst is not None and inst.role in ("primary", "standby") else None,
                "state": slot.state, "fingerprint": self.fingerprint["key"]}

    def instance_key(self, slot: Slot) -> str:
        return f"{self.prefix}instances/{slot.service}/{instance_id(slot.name, self.c.node)}"

    async def _publish(self) -> None:
        if time.monotonic() - self._full_at > self.c.ttl:
            # every record again once per TTL: a write that a frozen member received, timed out
            # here and applied after it thawed cannot leave an older record in place for longer
            self.published, self._full_at = {}, time.monotonic()
        node_key = f"{self.prefix}nodes/{self.c.node}"
        await self.etcd.put(node_key, json.dumps({**self.node_record(), "fingerprint": self.fingerprint}),
                            self.lease)
        for slot in self.slots.values():
            key, value = self.instance_key(slot), json.dumps(self.instance_record(slot), sort_keys=True)
            if self.published.get(key) != value:
                await self.etcd.put(key, value, self.lease)
                self.published[key] = value

    async def _register(self) -> None:
        interval = max(0.1, self.c.ttl / 4)
        while True:
            self.changed.clear()
            try:
                if not self.lease:
                    self.lease = await self.etcd.grant(self.c.ttl)
                    self.registered_at, self.published = time.time(), {}
                    self.registrations += 1
                    log.info("node_registered", node=self.c.node, lease=f"{self.lease:x}", ttl_s=self.c.ttl,
                             registrations=self.registrations)
                else:
                    await self.etcd.keepalive(self.lease)
                await self._publish()
            except LeaseLost:
                log.error("node_lease_lost", node=self.c.node,
                          why="silent past the TTL (frozen, or cut off from etcd): the cluster dropped "
                              "this node's instances; registering again, they come back as standbys")
                self.lease = 0
                continue
            except EtcdUnavailable as exc:
                log.warning("etcd_unreachable", node=self.c.node, error=str(exc))
            except EtcdError as exc:
                log.error("etcd_register_failed", node=self.c.node, error=str(exc))
            try:
                await asyncio.wait_for(self.changed.wait(), interval)
            except TimeoutError:
                pass

    # -- leaving --------------------------------------------------------------------------------
    async def leave(self) -> None:
        """Clean shutdown, first step: revoke the lease, so the peers fail this node's primary over
        now (its in-flight streams migrate) instead of after the TTL."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.lease:
            try:
                await self.etcd.revoke(self.lease)
                log.info("node_left", node=self.c.node)
            except EtcdError as exc:
                log.warning("node_leave_failed", node=self.c.node, error=str(exc),
                            consequence=f"peers drop this node after its TTL ({self.c.ttl} s)")
            self.lease = 0

    async def close(self) -> None:
        await self.etcd.close()

    def status(self) -> dict:
        return {"node": self.c.node, "lease": f"{self.lease:x}" if self.lease else None,
                "registered_at": self.registered_at, "registrations": self.registrations,
                "etcd": list(self.etcd.endpoints), "fingerprint": self.fingerprint}
