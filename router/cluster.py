"""A router's link to the cluster: what it reads from etcd and what it writes there.

- One watch on the cluster's prefix (after a full read; a broken stream is read again whole and
  watched from there): primary keys go to EtcdRoles (hence the Follower); for a peer router
  (``directory``) the instance records add, re-register and drop instances, and the node records
  say which nodes are alive. An instance record that disappears (its node's lease expired: the node
  died or froze past its TTL) is a failure of that instance.
- The router's own record under its lease: its URL and the primaries it sees, for ``failover status``.
- A frozen etcd member: every call has a deadline (the client tries the next member), and a watch
  that stays silent ``progress_timeout`` is checked on its member and moved to another one.
- Contact: every successful call or event. Without contact for ``stale_after`` seconds the router
  stops routing (the last known primary was kept until then); it never promotes meanwhile, as a
  claim needs etcd to answer. Contact back: a full read, then routing again.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import structlog

from failover_common.etcd import KV, Etcd, EtcdError, EtcdUnavailable, LeaseLost
from router import states
from router.peering import Follower
from router.roles import Claims, EtcdRoles

log = structlog.get_logger(__name__)


class ClusterView:
    def __init__(self, router, etcd: Etcd, roles: EtcdRoles, *, directory: bool, ttl: int,
                 stale_after: float | None = None, url: str | None = None) -> None:
        self.router, self.etcd, self.roles = router, etcd, roles
        self.directory = directory
        self.ttl = ttl
        self.stale_after = stale_after if stale_after is not None else float(ttl)
        self.url = url
        # a silent watch is checked this often (a frozen member keeps its stream open): well inside
        # stale_after, so a frozen member costs a reconnect, never held routing
        self.progress_timeout = max(0.2, min(1.0, self.stale_after / 4))
        self.instances: dict[str, dict] = {}  # cluster id -> record (peer routers)
        self.nodes: dict[str, dict] = {}
        self.routers: dict[str, dict] = {}
        self.last_contact = time.monotonic()
        self.held = False
        self.revision = 0
        self.extra: dict = {}  # more fields of this router's record (a worker's metrics_url)
        self._tasks: list[asyncio.Task] = []
        self._lease = 0

    @property
    def prefix(self) -> str:
        return self.roles.prefix

    def start(self) -> None:
        for coro, name in ((self._watch(), "etcd-watch"), (self._keepalive(), "etcd-lease"),
                           (self._staleness(), "etcd-staleness")):
            task = asyncio.ensure_future(coro)
            task.set_name(name)
            self._tasks.append(task)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.roles.stop()
        if self._lease:
            try:
                await self.etcd.revoke(self._lease)  # peers see this router gone at once
            except EtcdError as exc:
                log.warning("etcd_revoke_failed", error=str(exc))

    def contact(self) -> None:
        self.last_contact = time.monotonic()
        if self.held:
            self.held = False
            log.warning("etcd_contact_back", hint="routing again to the primaries etcd names")
            self._hold(None)

    # -- reading ----------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            try:
                kvs, rev = await self.etcd.range(self.prefix, prefix=True)
                self.contact()
                self._load(kvs, rev)
                async for events in self.etcd.watch(self.prefix, prefix=True, start_revision=rev + 1,
                                                    progress_timeout=self.progress_timeout):
                    self.contact()
                    for ev in events:
                        self.revision = max(self.revision, ev.kv.mod_revision)
                        self._apply(ev.kv.key, None if ev.kind == "delete" else ev.kv)
            except EtcdUnavailable as exc:
                log.warning("etcd_watch_broken", error=str(exc))
                await asyncio.sleep(0.1)
            except EtcdError as exc:
                log.error("etcd_watch_failed", error=str(exc))
                await asyncio.sleep(0.5)

    def _load(self, kvs: list[KV], rev: int) -> None:
        """A full read: apply every key (nodes and instances before primaries), and treat what we
        knew and no longer see as deleted."""
        self.revision = rev
        present = {kv.key: kv for kv in kvs}
        known = [f"{self.prefix}instances/{r['service']}/{i}" for i, r in self.instances.items()]
        known += [self.roles.primary_key(s) for s in self.roles.holders]
        for key in known:
            if key not in present:
                self._apply(key, None)
        order = {"nodes": 0, "routers": 0, "instances": 1, "primary": 2}
        for kv in sorted(kvs, key=lambda kv: order.get(self._kind(kv.key)[0], 3)):
            self._apply(kv.key, kv)

    def _kind(self, key: str) -> tuple[str, str]:
        kind, _, rest = key[len(self.prefix):].partition("/")
        return kind, rest

    def _apply(self, key: str, kv: KV | None) -> None:
        kind, rest = self._kind(key)
        doc = kv.json() if kv is not None else None
        if kind == "primary":
            self.roles.seen(rest, kv.value if kv else None, kv.mod_revision if kv else 0)
        elif kind == "nodes":
            self._table(self.nodes, rest, doc)
            self.roles.nodes_alive = set(self.nodes)
        elif kind == "routers":
            self._table(self.routers, rest, doc)
        elif kind == "instances":
            service, _, ident = rest.partition("/")
            if not self.directory:  # a node router only shows the others' records
                self._table(self.instances, ident, None if doc is None else dict(doc, service=service))
            elif doc is None:
                self._instance_gone(service, ident)
            else:
                self._instance_put(service, ident, doc)

    @staticmethod
    def _table(table: dict, name: str, doc: dict | None) -> None:
        if doc is None:
            table.pop(name, None)
        else:
            table[name] = doc

    def _instance_put(self, service: str, ident: str, rec: dict) -> None:
        url = rec.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            log.error("bad_instance_record", instance=ident, record=rec)
            return
        before = self.instances.get(ident)
        rec = dict(rec, service=service)
        self.instances[ident] = rec
        inst = self.router._find(ident)
        serving = rec.get("role") in (states.PRIMARY, states.STANDBY) and rec.get("pid") is not None
        fresh = before is None or before.get("pid") != rec.get("pid") or before.get("url") != url
        kind = {k: rec[k] for k in ("engine", "probe_path") if isinstance(rec.get(k), str)}  # absent: ours
        if inst is None:
            self.router.add_instance(service, ident, url, states.STANDBY, pid=rec.get("pid"), **kind)
        elif serving and fresh and (inst.fenced or inst.role in states.OUT_OF_SERVICE):
            self.router.add_instance(service, ident, url, states.STANDBY, pid=rec.get("pid"), **kind)  # relaunched
        else:
            return
        holder = self.roles.holders.get(service)
        if holder is not None and holder.instance == ident and self.roles.claims is not None:
            self.roles.claims.follow(service, ident, holder.revision)

    def _instance_gone(self, service: str, ident: str) -> None:
        self.instances.pop(ident, None)
        inst = self.router._find(ident)
        if inst is None:
            return
        svc = self.router.services[inst.service]
        log.warning("instance_record_gone", instance=ident, role=inst.role,
                    why="its node deregistered it or its lease expired")
        if svc.primary is inst and not inst.fenced:
            self.router.promoter.fail(inst, "lease_lost")
        self.router.remove_instance(ident)

    # -- writing ----------------------------------------------------------------------------------
    def record(self) -> dict:
        seen = {s: {"primary": h.instance, "revision": h.revision} for s, h in self.roles.holders.items()}
        routed = {name: (svc.routable().name if svc.routable() else None)
                  for name, svc in self.router.services.items()}
        return {"id": self.roles.router_id, "url": self.url, "node": self.roles.node, "pid": os.getpid(), "seen": seen,
                "routing": routed, "held": self.held, "at": time.time(), **self.extra}

    async def _keepalive(self) -> None:
        key = f"{self.prefix}routers/{self.roles.router_id}"
        interval = max(0.1, self.ttl / 4)
        while True:
            try:
                if not self._lease:
                    self._lease = await self.etcd.grant(self.ttl)
                else:
                    await self.etcd.keepalive(self._lease)
                await self.etcd.put(key, json.dumps(self.record()), self._lease)
                self.contact()
            except LeaseLost:
                log.warning("router_lease_lost", hint="registering again")
                self._lease = 0
                continue
            except EtcdUnavailable as exc:
                log.warning("etcd_unreachable", error=str(exc))
            except EtcdError as exc:
                log.error("etcd_keepalive_failed", error=str(exc))
            await asyncio.sleep(interval)

    async def _staleness(self) -> None:
        while True:
            await asyncio.sleep(min(0.1, self.stale_after / 4))
            quiet = time.monotonic() - self.last_contact
            if not self.held and quiet > self.stale_after:
                self.held = True
                log.error("etcd_lost_routing_held", quiet_s=round(quiet, 2), stale_after_s=self.stale_after,
                          why="the primary may have changed without us; nothing is promoted while "
                              "etcd cannot be written")
                self._hold(f"etcd unreachable for {quiet:.1f} s")

    def _hold(self, why: str | None) -> None:
        for svc in self.router.services.values():
            svc.held = why
            svc.refresh()

    def serves(self, svc) -> bool:
        """This router's /ready for a service: it routes now, or a failover is under way and a
        ready standby will take the requests (they wait in the queue meanwhile). A front that marks
        a router down on one failed check would otherwise mark every router down at once during a
        failover and refuse connections it could have queued."""
        if self.held:
            return False
        if svc.routable() is not None:
            return True
        return any(i.ready and not i.fenced and not i.suspect for i in svc.standbys())

    def as_json(self) -> dict:
        return {"router": self.roles.router_id, "node": self.roles.node, "directory": self.directory,
                "etcd": self.etcd.endpoints, "contact_age_s": round(time.monotonic() - self.last_contact, 3),
                "held": self.held, "revision": self.revision, "lease_ttl_s": self.ttl,
                "nodes": self.nodes, "routers": self.routers, "instances": self.instances,
                **self.roles.as_json()}


def join(router, etcd: Etcd, roles: EtcdRoles, *, directory: bool, ttl: int,
         stale_after: float | None = None, url: str | None = None) -> ClusterView:
    """Wire ``router`` (built with ``roles``) to the cluster; ``view.start()`` once the router runs."""
    assert router.promoter.roles is roles, "build the Router with roles=roles"
    follower = Follower(router.services, router.promoter, directory=directory)
    roles.claims = Claims(switch=follower.switch, follow=follower.follow, gone=follower.gone)
    router.cluster = view = ClusterView(router, etcd, roles, directory=directory, ttl=ttl,
                                        stale_after=stale_after, url=url)
    roles.fingerprint_of = lambda ident: (view.instances.get(ident) or {}).get("fingerprint")
    return view
