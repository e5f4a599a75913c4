"""A one-host role store for N router workers on one port: etcd's few calls, in memory, on a Unix socket.

Several router processes behind one ``SO_REUSEPORT`` listener must agree on one primary per
service. They already know how when the decisions live in etcd (``router/roles.py``: a promotion is
a compare-and-swap of the primary key; ``router/peering.py``: every other router follows the key and
fences whatever it no longer names; ``router/cluster.py``: one watch). This module is that store
for one host, without etcd: the process that starts the workers (``failover router --workers N``)
holds a :class:`ShareStore` and serves it on a Unix socket (0600 in a 0700 directory, the peer's uid
checked with SO_PEERCRED); each worker reaches it with ``router.share_client.ShareClient``, a drop-in
for ``failover_common.etcd.Etcd``. Keys, revisions, leases, CAS and prefix watches behave as etcd's:
one revision counter, a key's ``mod_revision`` is the fencing token, a lease's keys go when it expires.

Wire: one JSON object per line. A request ``{"id", "op", ...}`` gets ``{"id", ...}`` or ``{"id",
"error", "code"}``; ``{"op": "watch", "prefix", "start"}`` turns its connection into a stream of
``{"events": [...]}`` lines. A line over ``MAX_LINE`` or an unknown op closes that connection only.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from failover_common.peercred import peer_credentials

log = structlog.get_logger(__name__)

MAX_LINE = 1 << 20
HISTORY = 4096  # events kept for a watch that starts from an older revision


@dataclass(slots=True)
class Entry:
    value: str
    mod_revision: int
    create_revision: int
    lease: int
    version: int

    def doc(self, key: str) -> dict:
        return {"key": key, "value": self.value, "mod_revision": self.mod_revision,
                "create_revision": self.create_revision, "lease": self.lease, "version": self.version}


@dataclass
class ShareStore:
    """The keys. Synchronous: every call runs on the owner's loop, so each is atomic."""

    revision: int = 0
    keys: dict[str, Entry] = field(default_factory=dict)
    leases: dict[int, tuple[float, float]] = field(default_factory=dict)  # id -> (ttl, deadline)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    watchers: set[Callable[[list[dict]], None]] = field(default_factory=set)
    _next_lease: int = 0

    def _emit(self, events: list[dict]) -> None:
        if not events:
            return
        self.history.extend(events)
        for w in list(self.watchers):
            w(events)

    def put(self, key: str, value: str, lease: int = 0) -> int:
        if lease and lease not in self.leases:
            raise KeyError(f"lease {lease} not found")
        self.revision += 1
        old = self.keys.get(key)
        e = Entry(value, self.revision, old.create_revision if old else self.revision, lease,
                  (old.version if old else 0) + 1)
        self.keys[key] = e
        self._emit([{"type": "put", "kv": e.doc(key)}])
        return self.revision

    def delete(self, key: str, *, prefix: bool = False) -> None:
        gone = [k for k in self.keys if (k.startswith(key) if prefix else k == key)]
        if not gone:
            return
        self.revision += 1
        events = []
        for k in gone:
            self.keys.pop(k)
            events.append({"type": "delete", "kv": {"key": k, "value": "", "mod_revision": self.revision,
                                                    "create_revision": 0, "lease": 0, "version": 0}})
        self._emit(events)

    def range(self, key: str, *, prefix: bool = False) -> list[dict]:
        return [e.doc(k) for k, e in sorted(self.keys.items()) if (k.startswith(key) if prefix else k == key)]

    def swap(self, key: str, expected: int, value: str) -> dict:
        """etcd's txn as ``Etcd.swap`` sends it: put if the mod revision is ``expected`` (0: absent)."""
        cur = self.keys.get(key)
        if (cur.mod_revision if cur else 0) != expected:
            return {"ok": False, "revision": self.revision, "current": cur.doc(key) if cur else None}
        return {"ok": True, "revision": self.put(key, value), "current": None}

    def grant(self, ttl: float) -> int:
        self._next_lease += 1
        self.leases[self._next_lease] = (ttl, time.monotonic() + ttl)
        return self._next_lease

    def keepalive(self, lease: int) -> float:
        if lease not in self.leases:
            return 0
        ttl, _ = self.leases[lease]
        self.leases[lease] = (ttl, time.monotonic() + ttl)
        return ttl

    def revoke(self, lease: int) -> None:
        if self.leases.pop(lease, None) is None:
            return
        gone = [k for k, e in self.keys.items() if e.lease == lease]
        for k in gone:
            self.delete(k)

    def expire(self) -> None:
        now = time.monotonic()
        for lease in [i for i, (_, deadline) in self.leases.items() if deadline < now]:
            log.warning("share_lease_expired", lease=lease)
            self.revoke(lease)

    def since(self, prefix: str, start: int) -> list[dict]:
        return [e for e in self.history if e["kv"]["mod_revision"] >= start and e["kv"]["key"].startswith(prefix)]


class ShareServer:
    """Serves ``store`` on ``path`` (created 0600; its directory must be 0700 and ours)."""

    def __init__(self, store: ShareStore, path: Path) -> None:
        self.store, self.path = store, path
        self._server: asyncio.base_events.Server | None = None
        self._expiry: asyncio.Task | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        st = self.path.parent.stat()
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise PermissionError(f"{self.path.parent} must be a 0700 directory of ours (chmod 700)")
        self.path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, str(self.path), limit=MAX_LINE)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._expiry = asyncio.ensure_future(self._expire())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):
                w.close()
            await self._server.wait_closed()
        self.path.unlink(missing_ok=True)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self.store.expire()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is None or peer_credentials(sock)[1] != os.getuid():
            log.warning("share_peer_refused", why="another uid")
            writer.close()
            return
        self._conns.add(writer)
        try:
            while line := await reader.readline():
                req = json.loads(line)
                if req.get("op") == "watch":
                    await self._watch(req, writer)
                    return
                writer.write(json.dumps(self._answer(req)).encode() + b"\n")
        except ConnectionError:
            pass  # a worker that stopped or died: its lease expires, its records go
        except (ValueError, asyncio.LimitOverrunError) as exc:
            log.warning("share_connection_dropped", error=repr(exc), why="not a request of the role store")
        finally:
            self._conns.discard(writer)
            writer.close()

    def _answer(self, req: dict) -> dict:
        s, rid, op = self.store, req.get("id"), req.get("op")
        try:
            if op == "put":
                return {"id": rid, "revision": s.put(req["key"], req["value"], int(req.get("lease", 0)))}
            if op == "range":
                return {"id": rid, "kvs": s.range(req["key"], prefix=bool(req.get("prefix"))), "revision": s.revision}
            if op == "delete":
                s.delete(req["key"], prefix=bool(req.get("prefix")))
                return {"id": rid, "revision": s.revision}
            if op == "swap":
                return {"id": rid, **s.swap(req["key"], int(req["expected"]), req["value"])}
            if op == "grant":
                return {"id": rid, "lease": s.grant(float(req["ttl"]))}
            if op == "keepalive":
                return {"id": rid, "ttl": s.keepalive(int(req["lease"]))}
            if op == "revoke":
                s.revoke(int(req["lease"]))
                return {"id": rid}
        except KeyError as exc:
            return {"id": rid, "error": str(exc), "code": "lease_lost" if "lease" in str(exc) else "bad_request"}
        return {"id": rid, "error": f"unknown op {op!r}", "code": "bad_request"}

    async def _watch(self, req: dict, writer: asyncio.StreamWriter) -> None:
        prefix, start = str(req.get("prefix", "")), int(req.get("start", 0))
        queue: asyncio.Queue[list[dict]] = asyncio.Queue()

        def push(events: list[dict]) -> None:
            mine = [e for e in events if e["kv"]["key"].startswith(prefix)]
            if mine:
                queue.put_nowait(mine)

        self.store.watchers.add(push)  # first: nothing written between the backlog and the stream is lost
        try:
            if start and (backlog := self.store.since(prefix, start)):
                queue.put_nowait(backlog)
            writer.write(b'{"events": []}\n')  # the watch is registered: the client may go on
            while True:
                events = await queue.get()
                writer.write(json.dumps({"events": events}).encode() + b"\n")
                await writer.drain()
        finally:
            self.store.watchers.discard(push)
