"""A small etcd v3 client over its JSON gateway (HTTP + JSON, aiohttp): leases, keys, one
compare-and-swap transaction, and streaming watches.

Why not a client library: the maintained Python etcd3 clients talk gRPC (a C extension and a
protobuf pin each) or are unmaintained; the gateway ships in every etcd since 3.3 (Debian's
etcd-server 3.4 serves it at ``/v3/``), and the handful of calls below is all the cluster needs.

Every call tries the endpoints in turn (the last one that answered first) and raises
:class:`EtcdUnavailable` when none answers within the call's timeout, so a caller can tell "etcd
said no" (a failed compare) from "etcd could not be asked" (never promote then).

Keys and values are str (UTF-8); int64 fields travel as JSON strings, as the gateway writes them.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp


class EtcdError(Exception):
    """etcd answered with an error (a bad request, an unknown lease)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered: the caller must assume nothing about the cluster's state."""


class LeaseLost(EtcdError):
    """The lease expired (or was revoked): every key under it is gone."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str | None) -> str:
    return base64.b64decode(text).decode() if text else ""


def prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with ``prefix`` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return raw.decode()


@dataclass(frozen=True, slots=True)
class KV:
    key: str
    value: str
    mod_revision: int
    create_revision: int
    lease: int
    version: int = 0  # writes since the key was created

    @classmethod
    def parse(cls, raw: dict) -> KV:
        return cls(_unb64(raw.get("key")), _unb64(raw.get("value")), int(raw.get("mod_revision", 0)),
                   int(raw.get("create_revision", 0)), int(raw.get("lease", 0)), int(raw.get("version", 0)))

    def json(self) -> dict:
        try:
            doc = json.loads(self.value)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # "put" or "delete"
    kv: KV


@dataclass(frozen=True, slots=True)
class SwapResult:
    ok: bool  # the compare held and the new value is written
    revision: int  # ok: the new value's mod revision (the fencing token); else the store's revision
    current: KV | None  # not ok: the key as it is now (None: absent)


def normalize_endpoints(endpoints: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for ep in endpoints:
        ep = ep.strip().rstrip("/")
        if not ep.startswith(("http://", "https://")):
            ep = "http://" + ep
        out.append(ep)
    if not out:
        raise ValueError("etcd: give at least one endpoint, e.g. http://127.0.0.1:2379")
    return tuple(out)


class Etcd:
    """One client for the whole process; call ``close()`` at the end (it owns its aiohttp session)."""

    def __init__(self, endpoints: list[str] | tuple[str, ...], *, timeout: float = 1.0) -> None:
        self.endpoints = list(normalize_endpoints(endpoints))
        self.timeout = timeout  # the deadline of every call, per endpoint tried
        self.timeouts = 0  # calls that hit it (a frozen or cut-off member); see NodeCluster._publish
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers."""
        errors = []
        for ep in list(self.endpoints):
            try:
                async with asyncio.timeout(timeout or self.timeout):
                    async with self.session().post(f"{ep}/v3/{path}", json=body) as resp:
                        doc = await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
                errors.append(f"{ep}: {exc!r}")
                self.timeouts += isinstance(exc, TimeoutError)
                continue
            if ep != self.endpoints[0]:  # remember who answered
                self.endpoints.remove(ep)
                self.endpoints.insert(0, ep)
            if not isinstance(doc, dict):
                raise EtcdError(f"etcd {path}: unexpected answer {doc!r}")
            if "error" in doc or "code" in doc and doc.get("code"):
                if _is_unavailable(doc):
                    errors.append(f"{ep}: {doc.get('message') or doc.get('error')}")
                    continue
                raise EtcdError(f"etcd {path}: {doc.get('message') or doc.get('error')}")
            return doc
        raise EtcdUnavailable(f"etcd {path}: no endpoint answered: " + "; ".join(errors))

    # -- leases -------------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        doc = await self.call("lease/grant", {"TTL": ttl})
        return int(doc["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease`` once; returns its TTL. LeaseLost when it expired meanwhile."""
        doc = await self.call("lease/keepalive", {"ID": lease})
        result = doc.get("result", doc)
        ttl = int(result.get("TTL", 0))
        if ttl <= 0:
            raise LeaseLost(f"etcd lease {lease:x} expired")
        return ttl

    async def revoke(self, lease: int) -> None:
        try:
            await self.call("lease/revoke", {"ID": lease})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    # -- keys ---------------------------------------------------------------------------------
    async def put(self, key: str, value: str, lease: int = 0) -> int:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        try:
            doc = await self.call("kv/put", body)
        except EtcdError as exc:
            if "lease not found" in str(exc):
                raise LeaseLost(str(exc)) from None
            raise
        return int(doc["header"]["revision"])

    async def get(self, key: str) -> KV | None:
        kvs, _ = await self.range(key)
        return kvs[0] if kvs else None

    async def range(self, key: str, *, prefix: bool = False) -> tuple[list[KV], int]:
        """The keys (``prefix``: every key under it) and the store revision they were read at."""
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        doc = await self.call("kv/range", body)
        return [KV.parse(kv) for kv in doc.get("kvs", [])], int(doc["header"]["revision"])

    async def delete(self, key: str, *, prefix: bool = False) -> None:
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        await self.call("kv/deleterange", body)

    async def swap(self, key: str, expected_mod_revision: int, value: str) -> SwapResult:
        """Write ``value`` if ``key``'s mod revision still is ``expected_mod_revision`` (0: the key
        must be absent). One transaction, so of two callers with the same expectation exactly one
        succeeds; the loser gets the key as it is now."""
        if expected_mod_revision:
            compare = {"key": _b64(key), "target": "MOD", "result": "EQUAL",
                       "mod_revision": str(expected_mod_revision)}
        else:
            compare = {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        doc = await self.call("kv/txn", {
            "compare": [compare],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            "failure": [{"request_range": {"key": _b64(key)}}]})
        revision = int(doc["header"]["revision"])
        if doc.get("succeeded"):
            return SwapResult(True, revision, None)
        kvs = ((doc.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
        return SwapResult(False, revision, KV.parse(kvs[0]) if kvs else None)

    # -- watch --------------------------------------------------------------------------------
    async def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0,
                    progress_timeout: float | None = None) -> AsyncIterator[list[Event]]:
        """Yield batches of events on ``key`` (or under it) from ``start_revision`` on, forever.

        Raises EtcdUnavailable when the stream breaks (a member that dies closes it). A member that
        is frozen (SIGSTOP, a hung disk) or cut off from the quorum keeps the stream open and
        silent, so with ``progress_timeout`` a silence that long is checked: one linearizable read
        on the same member (it needs the quorum, so a partitioned member fails it too) within the
        call deadline. It answers: the watch is alive, an empty batch is yielded (progress, for the
        caller's liveness clock). It does not: the member goes to the back of the endpoint list and
        EtcdUnavailable is raised, so the caller re-reads and watches again from the revision it has
        seen, on another member. etcd's own ``progress_notify`` is asked for too, but its interval is
        a server flag (10 min by default), so it cannot be the deadline."""
        create = {"key": _b64(key), "progress_notify": True}
        if prefix:
            create["range_end"] = _b64(prefix_end(key))
        if start_revision:
            create["start_revision"] = str(start_revision)
        errors = []
        for ep in list(self.endpoints):
            try:
                resp = await asyncio.wait_for(
                    self.session().post(f"{ep}/v3/watch", json={"create_request": create},
                                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout)),
                    self.timeout)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                errors.append(f"{ep}: {exc!r}")
                self.demote(ep)
                continue
            async with resp:
                # one read at a time, never cancelled midway (a cancelled readline loses the part of
                # a line it had consumed): a silence leaves it pending while the member is checked
                pending: asyncio.Future | None = None
                try:
                    while True:
                        if pending is None:
                            pending = asyncio.ensure_future(resp.content.readline())
                        done, _ = await asyncio.wait({pending}, timeout=progress_timeout)
                        if not done:
                            if await self.answers(ep, key):
                                yield []
                                continue
                            self.demote(ep)
                            raise EtcdUnavailable(f"etcd watch on {ep}: silent for {progress_timeout} s and "
                                                  "the member does not answer (frozen or cut off)")
                        line, pending = pending.result(), None
                        if not line:
                            raise EtcdUnavailable(f"etcd watch on {ep}: stream ended")
                        doc = json.loads(line)
                        result = doc.get("result") or {}
                        if "error" in doc or result.get("canceled"):
                            raise EtcdUnavailable(f"etcd watch on {ep}: {doc.get('error') or result}")
                        events = [Event("delete" if e.get("type") == "DELETE" else "put", KV.parse(e["kv"]))
                                  for e in result.get("events", [])]
                        if events:
                            yield events
                except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
                    raise EtcdUnavailable(f"etcd watch on {ep}: {exc!r}") from None
                finally:
                    if pending is not None and not pending.done():
                        pending.cancel()
                        await asyncio.gather(pending, return_exceptions=True)
        raise EtcdUnavailable("etcd watch: no endpoint answered: " + "; ".join(errors))

    async def answers(self, ep: str, key: str) -> bool:
        """Whether member ``ep`` serves a linearizable read (count only) within the call deadline."""
        try:
            async with asyncio.timeout(self.timeout):
                async with self.session().post(f"{ep}/v3/kv/range",
                                               json={"key": _b64(key), "count_only": True}) as resp:
                    doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError):
            return False
        return isinstance(doc, dict) and "header" in doc and not _is_unavailable(doc)

    def demote(self, ep: str) -> None:
        """``ep`` failed a call: try it last from now on (a frozen member is not asked first again)."""
        if ep in self.endpoints and len(self.endpoints) > 1:
            self.endpoints.remove(ep)
            self.endpoints.append(ep)


def _is_unavailable(doc: dict) -> bool:
    # gRPC codes: 14 UNAVAILABLE, 4 DEADLINE_EXCEEDED; "etcdserver: no leader", "too many requests"
    text = str(doc.get("message") or doc.get("error") or "")
    return doc.get("code") in (1, 4, 14) or any(
        part in text for part in ("no leader", "timed out", "connection is closing", "leader changed"))
