"""The cluster's store on Kubernetes Lease objects, in the shape of :class:`failover_common.etcd.Etcd`
(grant / keepalive / revoke / put / get / range / delete / swap / watch), so that a router
(``failover router --k8s-lease NAMESPACE``) and a node (``[cluster] backend = "k8s"``) run on a
cluster without an etcd of their own, through the same ``ClusterView`` and ``EtcdRoles``.

How the etcd notions map onto Leases (``failover_common.k8s_lease`` writes them):
- a key is one Lease (name from the key, the key itself in an annotation, the value in another),
  labelled with the cluster's name so that one LIST reads them all;
- the primary key is changed only by ``swap``: a create, or a replace carrying the
  ``resourceVersion`` last seen (409 otherwise), whose new resourceVersion is the fencing token;
- an etcd lease is a heartbeat Lease (``/failover-leases/<cluster>/<id>``, ``leaseDurationSeconds``
  = the TTL, ``renewTime`` renewed by ``keepalive``); a key put under it names it as its owner.
  Kubernetes never deletes an expired Lease: a reader drops every key whose owner is missing or
  expired (``renewTime + leaseDurationSeconds`` by the reader's clock, as Kubernetes' own leader
  election does: the clocks must agree to well within the TTL);
- the watch is a bounded poll: one LIST every ``poll`` seconds, diffed with the last one, so an
  owner's expiry is seen as deletes. A Kubernetes watch would bring other writers' changes sooner,
  but expiry raises no event at all (nothing writes), so readers must look at the clock anyway;
  and a writer's own claim is answered at once by its ``swap``. The cost is one LIST of the
  cluster's Leases (a few dozen small objects) per router and per node every ``poll``.

Written against the Kubernetes API reference; no API server runs where this project is developed,
so it is tested against a stand-in that follows the documented semantics (tests/k8s_standin.py).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from failover_common.etcd import KV, EtcdError, Event, LeaseLost, SwapResult
from failover_common.k8s_lease import KEY, OWNER, RECORD, SA_DIR, KubeLeases, expired, lease_name


def in_cluster_defaults(api: str | None, token_file: Path | None, ca_file: Path | None,
                        env: dict) -> tuple[str, Path | None, Path | None]:
    """What a pod uses when not told: the API server from KUBERNETES_SERVICE_HOST/PORT (``env``),
    the service account's token and CA. ValueError when no API server is known."""
    if api is None:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("no Kubernetes API server: give its URL (--k8s-api / cluster.api), or run in a pod")
        api = f"https://{host}:{port}"
    if token_file is None and (SA_DIR / "token").exists():
        token_file = SA_DIR / "token"
    if ca_file is None and api.startswith("https://") and (SA_DIR / "ca.crt").exists():
        ca_file = SA_DIR / "ca.crt"
    return api, token_file, ca_file


class KubeStore:
    """One per process; ``close()`` at the end. ``endpoints`` is the API server (for status)."""

    def __init__(self, leases: KubeLeases, *, poll: float = 0.25) -> None:
        self.leases = leases
        self.poll = poll
        self.endpoints = [leases.api]
        self.timeout = leases.timeout
        self.timeouts = 0
        self._snapshot: dict[str, dict[str, KV]] = {}  # prefix -> its keys at the last range()
        self._renewed: dict[int, tuple[float, int]] = {}  # our heartbeats: id -> (monotonic, ttl)

    @classmethod
    def connect(cls, api: str, namespace: str, cluster: str, *, token_file: Path | None = None,
                ca_file: Path | None = None, timeout: float = 1.0, poll: float = 0.25) -> KubeStore:
        return cls(KubeLeases(api, namespace, token_file=token_file, ca_file=ca_file, timeout=timeout,
                              cluster=cluster), poll=poll)

    async def close(self) -> None:
        await self.leases.close()

    def heartbeat_key(self, lease: int) -> str:
        return f"/failover-leases/{self.leases.cluster}/{lease}"

    # -- leases ---------------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        lease = secrets.randbits(62) | 1
        await self.leases.upsert(self.heartbeat_key(lease), json.dumps({"ttl": ttl}), duration_s=ttl)
        self._renewed[lease] = (time.monotonic(), ttl)
        return lease

    async def keepalive(self, lease: int) -> int:
        status, doc = await self.leases.request("GET", self.leases.path(lease_name(self.heartbeat_key(lease))))
        if status == 404 or status == 200 and expired(doc):
            self._renewed.pop(lease, None)
            raise LeaseLost(f"heartbeat Lease {lease:x} expired or was removed")
        if status != 200:
            raise EtcdError(f"kubernetes get heartbeat {lease:x}: {status} {doc.get('message')}")
        ttl = int((doc.get("spec") or {}).get("leaseDurationSeconds") or 0)
        rv = (doc.get("metadata") or {}).get("resourceVersion")
        body = self.leases.body(self.heartbeat_key(lease), json.dumps({"ttl": ttl}),
                                resource_version=int(rv), duration_s=ttl)
        status, doc = await self.leases.request("PUT", self.leases.path(lease_name(self.heartbeat_key(lease))), body)
        if status == 409:  # another writer renewed it: still alive
            return ttl
        if status != 200:
            raise EtcdError(f"kubernetes renew heartbeat {lease:x}: {status} {doc.get('message')}")
        self._renewed[lease] = (time.monotonic(), ttl)
        return ttl

    async def revoke(self, lease: int) -> None:
        """The heartbeat and every key under it, now (a clean stop: peers see the node gone at once)."""
        self._renewed.pop(lease, None)
        items, _ = await self.leases.list()
        for item in items:
            annotations = (item.get("metadata") or {}).get("annotations") or {}
            if annotations.get(OWNER) == str(lease):
                await self.leases.remove(item["metadata"]["name"])
        await self.leases.remove(lease_name(self.heartbeat_key(lease)))

    # -- keys -----------------------------------------------------------------------------------
    async def put(self, key: str, value: str, lease: int = 0) -> int:
        if lease:
            renewed = self._renewed.get(lease)
            if renewed is None or time.monotonic() - renewed[0] > renewed[1]:
                raise LeaseLost(f"heartbeat Lease {lease:x} is not renewed within its duration")
        return await self.leases.upsert(key, value, owner=str(lease) if lease else None)

    async def get(self, key: str) -> KV | None:
        kvs, _ = await self.range(key)
        return kvs[0] if kvs else None

    async def range(self, key: str, *, prefix: bool = False) -> tuple[list[KV], int]:
        """The live keys (``prefix``: every key under it) and the list's resourceVersion."""
        items, rv = await self.leases.list()
        alive = {}
        for item in items:
            annotations = (item.get("metadata") or {}).get("annotations") or {}
            name = annotations.get(KEY, "")
            if name.startswith("/failover-leases/"):
                alive[name.rpartition("/")[2]] = not expired(item)
        out = []
        for item in items:
            meta = item.get("metadata") or {}
            annotations = meta.get("annotations") or {}
            name, owner = annotations.get(KEY, ""), annotations.get(OWNER, "")
            if not (name.startswith(key) if prefix else name == key) or name.startswith("/failover-leases/"):
                continue
            if owner and not alive.get(owner, False):
                continue  # its owner expired or was revoked: as etcd would have deleted it
            mod = int(meta.get("resourceVersion", 0))
            out.append(KV(name, annotations.get(RECORD, ""), mod, mod, int(owner) if owner.isdigit() else 0))
        if prefix:
            self._snapshot[key] = {kv.key: kv for kv in out}
        return out, rv

    async def delete(self, key: str, *, prefix: bool = False) -> None:
        for kv in (await self.range(key, prefix=prefix))[0]:
            await self.leases.remove(lease_name(kv.key))

    async def swap(self, key: str, expected_mod_revision: int, value: str) -> SwapResult:
        return await self.leases.swap(key, expected_mod_revision, value)

    # -- watch ----------------------------------------------------------------------------------
    async def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0,
                    progress_timeout: float | None = None) -> AsyncIterator[list[Event]]:
        """A bounded poll (see the module's docstring), diffed from the caller's last ``range``
        of ``key``; yields an empty batch when nothing changed (progress). EtcdUnavailable from a
        failed LIST ends it, as a broken etcd watch does."""
        assert prefix, "KubeStore watches prefixes only (what ClusterView asks for)"
        last = self._snapshot.get(key, {})
        while True:
            await asyncio.sleep(self.poll)
            now = {kv.key: kv for kv in (await self.range(key, prefix=True))[0]}
            events = [Event("delete", KV(k, "", 0, 0, 0)) for k in last if k not in now]
            events += sorted((Event("put", kv) for k, kv in now.items()
                              if k not in last or last[k].mod_revision != kv.mod_revision),
                             key=lambda e: e.kv.mod_revision)  # in write order, as etcd's watch
            last = now
            yield events
