"""A router worker's client of the host's role store (``router/share_store.py``).

It has the calls of ``failover_common.etcd.Etcd`` that ``router/roles.py`` and ``router/cluster.py``
use (grant, keepalive, revoke, put, get, range, delete, swap, watch, close, ``endpoints``), with the
same results and errors, so a worker is a peer router of its host exactly as of an etcd cluster: a
promotion is a compare-and-swap, the others follow. A store that is gone (its owner stopped) is
``EtcdUnavailable``; the worker then holds routing after its lease TTL, as without etcd.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

from failover_common.etcd import KV, EtcdError, EtcdUnavailable, Event, LeaseLost, SwapResult
from router.share_store import MAX_LINE


def _kv(doc: dict) -> KV:
    return KV(doc["key"], doc.get("value", ""), int(doc.get("mod_revision", 0)), int(doc.get("create_revision", 0)),
              int(doc.get("lease", 0)), int(doc.get("version", 0)))


class ShareClient:
    def __init__(self, path: Path, *, timeout: float = 1.0) -> None:
        self.path, self.timeout = Path(path), timeout
        self.endpoints = [f"unix:{path}"]
        self._rw: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)

    async def close(self) -> None:
        if self._rw is not None:
            self._rw[1].close()
            self._rw = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.wait_for(asyncio.open_unix_connection(str(self.path), limit=MAX_LINE), self.timeout)
        except (OSError, TimeoutError) as exc:
            raise EtcdUnavailable(f"role store {self.path}: {exc!r}") from None

    async def call(self, op: str, **body) -> dict:
        """One request, one answer; calls are serialised on one connection (a handful a second)."""
        async with self._lock:
            if self._rw is None:
                self._rw = await self._open()
            reader, writer = self._rw
            rid = next(self._ids)
            try:
                writer.write(json.dumps({"id": rid, "op": op, **body}).encode() + b"\n")
                line = await asyncio.wait_for(reader.readline(), self.timeout)
                if not line:
                    raise ConnectionResetError("the role store closed the connection")
                doc = json.loads(line)
            except (OSError, TimeoutError, ValueError) as exc:
                writer.close()
                self._rw = None
                raise EtcdUnavailable(f"role store {self.path} {op}: {exc!r}") from None
        if doc.get("id") != rid:
            raise EtcdError(f"role store {op}: answer {doc.get('id')} for request {rid}")
        if "error" in doc:
            raise (LeaseLost if doc.get("code") == "lease_lost" else EtcdError)(f"role store {op}: {doc['error']}")
        return doc

    async def grant(self, ttl: int) -> int:
        return int((await self.call("grant", ttl=ttl))["lease"])

    async def keepalive(self, lease: int) -> int:
        ttl = (await self.call("keepalive", lease=lease))["ttl"]
        if ttl <= 0:
            raise LeaseLost(f"role store lease {lease} expired")
        return int(ttl)

    async def revoke(self, lease: int) -> None:
        await self.call("revoke", lease=lease)

    async def put(self, key: str, value: str, lease: int = 0) -> int:
        return int((await self.call("put", key=key, value=value, lease=lease))["revision"])

    async def get(self, key: str) -> KV | None:
        kvs, _ = await self.range(key)
        return kvs[0] if kvs else None

    async def range(self, key: str, *, prefix: bool = False) -> tuple[list[KV], int]:
        doc = await self.call("range", key=key, prefix=prefix)
        return [_kv(d) for d in doc["kvs"]], int(doc["revision"])

    async def delete(self, key: str, *, prefix: bool = False) -> None:
        await self.call("delete", key=key, prefix=prefix)

    async def swap(self, key: str, expected_mod_revision: int, value: str) -> SwapResult:
        doc = await self.call("swap", key=key, expected=expected_mod_revision, value=value)
        return SwapResult(bool(doc["ok"]), int(doc["revision"]), _kv(doc["current"]) if doc.get("current") else None)

    async def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0,
                    progress_timeout: float | None = None) -> AsyncIterator[list[Event]]:
        """Batches of events under ``key`` from ``start_revision`` on; EtcdUnavailable when the
        stream ends. A silent stream is only a quiet store: the owner is on this host, and the
        worker dies with it (PDEATHSIG), so no member check is needed; empty batches mark progress."""
        reader, writer = await self._open()
        try:
            writer.write(json.dumps({"op": "watch", "prefix": key,
                                     "start": start_revision}).encode() + b"\n")
            while True:
                try:
                    line = await asyncio.wait_for(reader.readline(), progress_timeout)
                except TimeoutError:
                    yield []
                    continue
                except (OSError, ValueError) as exc:
                    raise EtcdUnavailable(f"role store watch: {exc!r}") from None
                if not line:
                    raise EtcdUnavailable("role store watch: stream ended")
                events = [Event("delete" if e["type"] == "delete" else "put", _kv(e["kv"]))
                          for e in json.loads(line)["events"]]
                if events:
                    yield events
        finally:
            writer.close()
