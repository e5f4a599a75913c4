"""Peer routers deciding roles through a real etcd cluster, in front of real engines.

The instance records are written here the way a node writes them (failover/cluster/node.py), so
these tests need no supervisor: three engines stand for instances on nodes x, y and z.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from etcd_helpers import ETCD, EtcdCluster
from failover_common.etcd import Etcd
from router.app import Router
from router.cluster import join
from router.config import RouterConfig
from router.roles import EtcdRoles
from router_helpers import kill, start_engines, wait_for

pytestmark = [pytest.mark.asyncio,
              pytest.mark.skipif(ETCD is None, reason="needs etcd (apt-get install etcd-server)")]
PREFIX = "/failover/t/"


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(3) as cluster:
        yield cluster


@pytest.fixture
def engines(procs, tiny_model):
    return start_engines(procs, tiny_model, ["e-x", "e-y", "e-z"])


async def register(client: Etcd, engines, nodes=("x", "y", "z"), fingerprints=None, lease=0) -> int:
    lease = lease or await client.grant(30)
    for e, node, fp in zip(engines, nodes, fingerprints or [None] * len(nodes)):
        await client.put(f"{PREFIX}nodes/{node}", json.dumps({"node": node, "at": time.time()}), lease)
        rec = {"service": "tiny", "slot": "tiny-0", "node": node, "url": e.url, "role": "standby",
               "ready": True, "pid": e.proc.pid} | ({"fingerprint": fp} if fp else {})
        await client.put(f"{PREFIX}instances/tiny/tiny-0@{node}", json.dumps(rec), lease)
    return lease


@contextlib.asynccontextmanager
async def peer(endpoints, name: str, **kw):
    client = Etcd(endpoints)
    roles = EtcdRoles(client, "t", name)
    router = Router(RouterConfig(port=0, probe_interval=0.1, probe_timeout=1.0, failure_threshold=2,
                                 queue_deadline=20), roles=roles)
    view = join(router, client, roles, directory=True, ttl=kw.get("ttl", 2), stale_after=kw.get("stale_after"))
    await router.start()
    view.start()
    try:
        yield router
    finally:
        await router.stop()
        await client.close()


def routed(router: Router) -> str | None:
    svc = router.services.get("tiny")
    inst = svc.routable() if svc else None
    return inst.name if inst else None


async def test_two_routers_seeing_the_same_failure_promote_exactly_one(etcd, engines):
    client = Etcd(etcd.endpoints)
    await client.delete(PREFIX, prefix=True)
    lease = await register(client, engines)
    try:
        async with peer(etcd.endpoints, "r1") as r1, peer(etcd.endpoints, "r2") as r2:
            await wait_for(lambda: routed(r1) and routed(r1) == routed(r2), 20, "one primary for both")
            first = routed(r1)
            key = (await client.get(f"{PREFIX}primary/tiny"))
            assert key.version == 1 and json.loads(key.value)["instance"] == first
            # both routers fail the primary in the same loop turn: both claims go out with the same
            # expected revision, so etcd takes exactly one
            kill(next(e for e in engines if first.endswith("@" + e.name[-1])).proc)
            for r in (r1, r2):
                r.promoter.fail(r.services["tiny"].instances[first], "test")
            await wait_for(lambda: routed(r1) not in (None, first) and routed(r1) == routed(r2), 20,
                           "both routers on the new primary")
            key = await client.get(f"{PREFIX}primary/tiny")
            assert key.version == 2, "the primary key was written more than once for one failure"
            won = [p for r in (r1, r2) for p in r.cluster.roles.promotions if p["previous"] == first]
            assert len(won) == 1 and won[0]["instance"] == routed(r1) == json.loads(key.value)["instance"]
            assert won[0]["revision"] == key.mod_revision  # the fencing token is the key's revision
            # the loser fenced the old primary too: neither routes to it
            for r in (r1, r2):
                assert r.services["tiny"].instances[first].fenced
            # a planned switchover through one router: one more CAS, and the other router follows
            second = routed(r1)
            third = next(n for n in r1.services["tiny"].instances if n not in (first, second))
            await wait_for(lambda: r1.services["tiny"].instances[third].ready, 20, "the third standby ready")
            result = await r1.promote("tiny", to=third)
            assert result["primary"] == third and result["previous"] == second
            await wait_for(lambda: routed(r2) == third, 10, "the peer to follow the switchover")
            key = await client.get(f"{PREFIX}primary/tiny")
            assert key.version == 3 and json.loads(key.value)["instance"] == third
    finally:
        await client.revoke(lease)
        await client.close()


async def test_router_without_etcd_keeps_the_primary_for_a_bounded_time_and_never_promotes(engines):
    with EtcdCluster(1) as solo:
        client = Etcd(solo.endpoints)
        await register(client, engines[:2], nodes=("x", "y"))
        await client.close()
        async with peer(solo.endpoints, "r1", ttl=2, stale_after=2.0) as r1:
            await wait_for(lambda: routed(r1) is not None, 20, "a primary")
            primary = routed(r1)
            solo.kill(0)
            t_lost = time.monotonic()
            await asyncio.sleep(1.0)
            assert routed(r1) == primary, "the last known primary was dropped before the bound"
            # the primary dies while etcd cannot be written: nothing may be promoted
            kill(next(e for e in engines if primary.endswith("@" + e.name[-1])).proc)
            await wait_for(lambda: r1.cluster.roles.refused > 0, 10, "a refused promotion")
            assert routed(r1) is None
            await wait_for(lambda: r1.cluster.held, 5, "routing held")
            # the bound runs from the router's last answer from etcd: one etcd wrote before it died may
            # still be read just after the kill (CI saw 0.2 ms), but no failed call may count as contact
            assert time.monotonic() - r1.cluster.last_contact >= 2.0
            assert r1.cluster.last_contact <= t_lost + 0.05
            assert all(h.instance == primary for h in r1.cluster.roles.holders.values())
            # etcd back: the claim goes through and the standby serves
            solo.restart(0)
            await wait_for(lambda: routed(r1) not in (None, primary), 30, "promotion once etcd is back")
            assert not r1.cluster.held


async def test_a_standby_on_another_node_is_preferred_to_one_beside_the_failed_primary():
    roles = EtcdRoles(None, "t", "r1")  # ranking reads no store
    roles.nodes_alive = {"x", "y", "z"}
    assert roles.rank("chat-1@y", failed="chat-0@x") < roles.rank("chat-1@x", failed="chat-0@x")
    roles.nodes_alive = {"x", "y"}  # z's lease is gone: its instances come last
    assert roles.rank("chat-1@x", failed="chat-0@x") < roles.rank("chat-1@z", failed="chat-0@x")
    node_router = EtcdRoles(None, "t", "node-x", node="x")  # a node router names its slots alone
    assert node_router.to_cluster("chat-1") == "chat-1@x" and node_router.to_local("chat-0@y") is None


async def test_a_standby_serving_another_model_fingerprint_is_never_promoted(etcd, engines):
    from router.errors import AdminError

    client = Etcd(etcd.endpoints)
    await client.delete(PREFIX, prefix=True)
    lease = await register(client, engines[:1], nodes=("x",), fingerprints=["f-same"])
    try:
        async with peer(etcd.endpoints, "r1") as r1:
            await wait_for(lambda: routed(r1) == "tiny-0@x", 20, "x primary")
            await register(client, engines[1:3], nodes=("y", "z"), fingerprints=["f-other", "f-same"], lease=lease)
            svc = r1.services["tiny"]
            await wait_for(lambda: all(n in svc.instances and svc.instances[n].ready for n in ("tiny-0@y", "tiny-0@z")),
                           20, "y and z ready standbys")
            with pytest.raises(AdminError, match="fingerprint f-other differs"):
                await r1.promote("tiny", to="tiny-0@y")
            kill(engines[0].proc)  # y would rank as well as z: only z serves the same model
            await wait_for(lambda: routed(r1) == "tiny-0@z", 20, "z promoted, never y")
            kill(engines[2].proc)  # now only y is left, and it serves another model: no promotion
            await asyncio.sleep(1.5)
            assert routed(r1) is None and json.loads((await client.get(f"{PREFIX}primary/tiny")).value)[
                "instance"] == "tiny-0@z"
            status = r1.status()["cluster"]
            assert "differs from the primary's f-same" in status["not_promoted"]["tiny-0@y"], status
            assert status["fingerprints"] == {"tiny": "f-same"}
    finally:
        await client.revoke(lease)
        await client.close()
