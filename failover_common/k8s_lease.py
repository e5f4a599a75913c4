"""Kubernetes Lease backend: the cluster's primaries as coordination.k8s.io/v1 Lease objects, for
clusters without an etcd of their own (the API server's optimistic concurrency does the CAS).

A primary is the Lease ``failover-<cluster>-primary-<service>``: ``spec.holderIdentity`` names the
instance, the annotation ``failover.io/record`` carries the same JSON as the etcd key. A swap is a
create (expected revision 0: the Lease must not exist; 409 AlreadyExists otherwise) or a replace
carrying ``metadata.resourceVersion`` (409 Conflict when another writer got there first), so of two
routers with the same expectation exactly one wins, and the resourceVersion it wrote is the fencing
token. Node heartbeats are Leases too (``renew``): Kubernetes never deletes an expired Lease, so a
reader judges ``renewTime + leaseDurationSeconds`` itself (``expired``).

The API server's resourceVersion is opaque by contract; on every API server backed by etcd it is the
etcd revision, an integer, which is what :class:`SwapResult` carries (a non-integer one is refused).

Written against the Kubernetes API reference; no API server runs on the machine this project is
developed on, so it is tested against a small stand-in that follows the documented semantics
(tests/test_k8s_lease.py), not against a real API server.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

from failover_common.etcd import KV, EtcdError, EtcdUnavailable, SwapResult

RECORD = "failover.io/record"
KEY = "failover.io/key"  # the etcd-style key a Lease stands for (a name cannot hold '/' or '@')
CLUSTER = "failover.io/cluster"  # label: every Lease of one cluster, listed with one selector
OWNER = "failover.io/owner"  # annotation: the heartbeat Lease (k8s_store) a key lives under
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def lease_name(key: str) -> str:
    """``/failover/prod/primary/chat`` -> ``failover-prod-primary-chat`` (a DNS-1123 name)."""
    name = re.sub(r"[^a-z0-9-]+", "-", key.strip("/").lower()).strip("-")
    if not name or len(name) > 253:
        raise ValueError(f"no valid Lease name for key {key!r}")
    return name


def microtime(dt: datetime | None = None) -> str:
    """The MicroTime format of Lease times: RFC 3339 with microseconds, UTC."""
    return (dt or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def expired(lease: dict, now: datetime | None = None) -> bool:
    spec = lease.get("spec") or {}
    renew, duration = spec.get("renewTime"), spec.get("leaseDurationSeconds")
    if not renew or not duration:
        return True
    renewed = datetime.strptime(renew, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    return ((now or datetime.now(timezone.utc)) - renewed).total_seconds() > duration


class KubeLeases:
    """Leases in one namespace. ``token_file``: a service account token (re-read on every call, as
    projected tokens rotate); ``ca_file``: the API server's CA. Use :meth:`in_cluster` in a pod."""

    def __init__(self, api: str, namespace: str, *, token_file: Path | None = None, ca_file: Path | None = None,
                 timeout: float = 2.0, cluster: str = "default") -> None:
        self.api = api.rstrip("/")
        self.namespace = namespace
        self.cluster = cluster  # the CLUSTER label of every Lease written
        self.token_file, self.ca_file, self.timeout = token_file, ca_file, timeout
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def in_cluster(cls, host: str, port: str, **kw) -> KubeLeases:
        """In a pod: ``host``/``port`` from KUBERNETES_SERVICE_HOST/PORT (the caller reads them)."""
        namespace = (SA_DIR / "namespace").read_text().strip()
        return cls(f"https://{host}:{port}", namespace, token_file=SA_DIR / "token", ca_file=SA_DIR / "ca.crt", **kw)

    def path(self, name: str | None = None) -> str:
        base = f"{self.api}/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"
        return base if name is None else f"{base}/{name}"

    def headers(self) -> dict:
        h = {"Accept": "application/json", "Content-Type": "application/json"}
        if self.token_file is not None:
            h["Authorization"] = "Bearer " + self.token_file.read_text().strip()
        return h

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl = None
            if self.ca_file is not None:
                import ssl as ssl_mod

                ssl = ssl_mod.create_default_context(cafile=str(self.ca_file))
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl) if ssl else None)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
        try:
            async with asyncio.timeout(self.timeout):
                async with self.session().request(method, url, json=body, headers=self.headers()) as resp:
                    doc = await resp.json(content_type=None)
                    status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise EtcdUnavailable(f"kubernetes {method} {url}: {exc!r}") from None
        if status >= 500:
            raise EtcdUnavailable(f"kubernetes {method} {url}: {status} {doc}")
        if status in (401, 403):
            raise EtcdError(f"kubernetes {method} {url}: {status}: {(doc or {}).get('message')}; "
                            "check the service account's Role (deploy/k8s/cluster/routers.yaml)")
        return status, doc if isinstance(doc, dict) else {}

    # -- leases ---------------------------------------------------------------------------------
    async def get(self, key: str) -> KV | None:
        status, doc = await self.request("GET", self.path(lease_name(key)))
        if status == 404:
            return None
        if status != 200:
            raise EtcdError(f"kubernetes get lease {lease_name(key)}: {status} {doc.get('message')}")
        return self._kv(key, doc)

    def _kv(self, key: str, doc: dict) -> KV:
        meta = doc.get("metadata") or {}
        rv = meta.get("resourceVersion", "")
        if not str(rv).isdigit():
            raise EtcdError(f"lease {meta.get('name')}: resourceVersion {rv!r} is not an integer; this "
                            "backend needs an etcd-backed API server")
        annotations = meta.get("annotations") or {}
        stored = annotations.get(KEY, key)
        if stored != key:
            raise EtcdError(f"lease {meta.get('name')} holds key {stored!r}, not {key!r}: two keys map to one "
                            "Lease name; rename the slot or node")
        owner = annotations.get(OWNER, "")
        return KV(key, annotations.get(RECORD, ""), int(rv), int(rv), int(owner) if owner.isdigit() else 0)

    def body(self, key: str, value: str, *, resource_version: int | None = None,
             duration_s: int | None = None, owner: str | None = None) -> dict:
        holder = ""
        try:
            holder = str(json.loads(value).get("instance") or "")
        except (ValueError, AttributeError):
            pass
        annotations = {RECORD: value, KEY: key} | ({OWNER: owner} if owner else {})
        meta = {"name": lease_name(key), "namespace": self.namespace, "annotations": annotations,
                "labels": {"app.kubernetes.io/name": "failover", CLUSTER: self.cluster}}
        if resource_version is not None:
            meta["resourceVersion"] = str(resource_version)
        spec = {"holderIdentity": holder, "renewTime": microtime()}
        if duration_s is not None:
            spec["leaseDurationSeconds"] = duration_s
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    async def swap(self, key: str, expected_mod_revision: int, value: str) -> SwapResult:
        """As ``Etcd.swap``: write ``value`` if the Lease's resourceVersion still is the expected one
        (0: it must not exist). The loser gets the Lease as it is now."""
        if expected_mod_revision:
            status, doc = await self.request("PUT", self.path(lease_name(key)),
                                             self.body(key, value, resource_version=expected_mod_revision))
        else:
            status, doc = await self.request("POST", self.path(), self.body(key, value))
        if status in (200, 201):
            return SwapResult(True, self._kv(key, doc).mod_revision, None)
        if status in (404, 409):  # replaced or deleted meanwhile, or created by another writer
            current = await self.get(key)
            return SwapResult(False, current.mod_revision if current else 0, current)
        raise EtcdError(f"kubernetes swap {lease_name(key)}: {status} {doc.get('message')}")

    async def list(self) -> tuple[list[dict], int]:
        """Every Lease of this cluster (one label selector) and the list's resourceVersion."""
        status, doc = await self.request("GET", f"{self.path()}?labelSelector={CLUSTER}%3D{self.cluster}")
        if status != 200:
            raise EtcdError(f"kubernetes list leases: {status} {doc.get('message')}")
        rv = (doc.get("metadata") or {}).get("resourceVersion", "0")
        return list(doc.get("items") or []), int(rv) if str(rv).isdigit() else 0

    async def remove(self, name: str) -> None:
        status, doc = await self.request("DELETE", self.path(name))
        if status not in (200, 202, 404):
            raise EtcdError(f"kubernetes delete lease {name}: {status} {doc.get('message')}")

    async def upsert(self, key: str, value: str, *, duration_s: int | None = None, owner: str | None = None) -> int:
        """Create the Lease of ``key`` or replace it (whoever wrote it last); its new resourceVersion."""
        for _ in range(3):  # a conflict here is a concurrent writer between our read and our write
            current = await self.get(key)
            rv = None if current is None else current.mod_revision
            method, url = ("POST", self.path()) if rv is None else ("PUT", self.path(lease_name(key)))
            status, doc = await self.request(method, url, self.body(key, value, resource_version=rv,
                                                                    duration_s=duration_s, owner=owner))
            if status in (200, 201):
                return self._kv(key, doc).mod_revision
            if status != 409:
                raise EtcdError(f"kubernetes write {lease_name(key)}: {status} {doc.get('message')}")
        raise EtcdError(f"kubernetes write {lease_name(key)}: conflicting writers")

    async def renew(self, key: str, value: str, duration_s: int) -> int:
        """A heartbeat Lease (a node's): create it or renew it; returns its resourceVersion."""
        return await self.upsert(key, value, duration_s=duration_s)
