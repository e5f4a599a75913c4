"""The Kubernetes Lease backend, against a small stand-in for the API server.

No Kubernetes API server runs here; the stand-in below follows the documented semantics of
coordination.k8s.io/v1 Leases that the backend relies on (create answers 409 AlreadyExists for an
existing name; replace answers 409 Conflict when metadata.resourceVersion is not the stored one;
every write bumps resourceVersion). What is tested is the backend's request building and its
compare-and-swap logic, through the same role store the etcd path uses; not a real API server.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone

import pytest
import pytest_asyncio
from aiohttp import web

from k8s_standin import StandIn

from failover_common.etcd import EtcdError, EtcdUnavailable
from failover_common.k8s_lease import RECORD, KubeLeases, expired, lease_name
from failover_common.ports import free_port
from router.roles import Claims, EtcdRoles

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def api(tmp_path):
    stand_in = StandIn()
    runner = web.AppRunner(stand_in.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    token = tmp_path / "token"
    token.write_text("sekrit\n")
    leases = KubeLeases(f"http://127.0.0.1:{port}", "failover", token_file=token)
    yield stand_in, leases
    await leases.close()
    await runner.cleanup()


async def test_one_of_many_creators_wins_and_replace_needs_the_current_resource_version(api):
    stand_in, leases = api
    key = "/failover/prod/primary/chat"
    values = [json.dumps({"instance": f"chat-0@n{i}"}) for i in range(6)]
    results = await asyncio.gather(*(leases.swap(key, 0, v) for v in values))
    winners = [r for r in results if r.ok]
    assert len(winners) == 1
    lease = stand_in.leases[("failover", lease_name(key))]
    assert lease_name(key) == "failover-prod-primary-chat"
    won = json.loads(lease["metadata"]["annotations"][RECORD])["instance"]
    assert lease["spec"]["holderIdentity"] == won
    assert all(json.loads(r.current.value)["instance"] == won for r in results if not r.ok)
    rv = winners[0].revision
    assert str(rv) == lease["metadata"]["resourceVersion"]
    stale = await leases.swap(key, rv - 1, json.dumps({"instance": "late"}))
    assert not stale.ok and stale.revision == rv
    fresh = await leases.swap(key, rv, json.dumps({"instance": "chat-0@n9"}))
    assert fresh.ok and fresh.revision > rv
    put = [r for r in stand_in.requests if r[0] == "PUT"][-1]
    assert put[1].endswith("/namespaces/failover/leases/failover-prod-primary-chat")
    assert put[2]["metadata"]["resourceVersion"] == str(rv) and put[3] == "Bearer sekrit"
    assert put[2]["apiVersion"] == "coordination.k8s.io/v1" and put[2]["kind"] == "Lease"


async def test_two_role_stores_claiming_the_same_failure_promote_exactly_one(api):
    _, leases = api
    switched, followed = [], []
    stores = []
    for rid in ("r1", "r2"):
        roles = EtcdRoles(leases, "prod", rid)  # the role store only needs swap() of its backend
        roles.claims = Claims(switch=lambda s, n, r, rev, rid=rid: switched.append((rid, n, rev)),
                              follow=lambda s, n, rev, rid=rid: followed.append((rid, n, rev)),
                              gone=lambda s, n: True)
        stores.append(roles)
    stores[0].claim("chat", "chat-0@a", "test", None)
    stores[1].claim("chat", "chat-0@b", "test", None)
    await asyncio.gather(*stores[0]._tasks, *stores[1]._tasks)
    assert len(switched) == 1, switched
    winner = switched[0]
    assert [f[1] for f in followed] == [winner[1]]  # the loser follows the winner
    assert followed[0][2] == winner[2]  # at the winner's resourceVersion, the fencing token


async def test_heartbeat_leases_expire_by_their_renew_time(api):
    _, leases = api
    key = "/failover/prod/nodes/gpu-1"
    rv1 = await leases.renew(key, json.dumps({"node": "gpu-1"}), 5)
    rv2 = await leases.renew(key, json.dumps({"node": "gpu-1"}), 5)
    assert rv2 > rv1
    status, doc = await leases.request("GET", leases.path(lease_name(key)))
    assert status == 200 and not expired(doc)
    assert expired(doc, datetime.now(timezone.utc) + timedelta(seconds=6))


async def test_bad_token_and_no_server_are_told_apart(api, tmp_path):
    _, leases = api
    leases.token_file.write_text("wrong")
    with pytest.raises(EtcdError, match="Role"):
        await leases.swap("/failover/x/primary/y", 0, "{}")
    gone = KubeLeases(f"http://127.0.0.1:{free_port()}", "failover", timeout=0.5)
    try:
        with pytest.raises(EtcdUnavailable):
            await gone.get("/failover/x/primary/y")
    finally:
        await gone.close()


async def test_the_lease_store_drops_keys_whose_heartbeat_expired_and_its_watch_says_so(api):
    from failover_common.etcd import LeaseLost
    from failover_common.k8s_store import KubeStore

    _, leases = api
    store = KubeStore(leases, poll=0.1)
    lease = await store.grant(1)
    await store.put("/failover/default/nodes/a", '{"node": "a"}', lease)
    await store.put("/failover/default/primary/chat", '{"instance": "chat-0@a"}')  # no owner
    kvs, _ = await store.range("/failover/default/", prefix=True)
    assert sorted(kv.key for kv in kvs) == ["/failover/default/nodes/a", "/failover/default/primary/chat"]
    assert next(kv for kv in kvs if kv.key.endswith("/a")).lease == lease
    assert await store.keepalive(lease) == 1
    watch = store.watch("/failover/default/", prefix=True)
    seen = []
    async with asyncio.timeout(5):
        async for events in watch:  # nothing renews the heartbeat: its keys go after 1 s
            seen += [(e.kind, e.kv.key) for e in events]
            if seen:
                break
    await watch.aclose()
    assert seen == [("delete", "/failover/default/nodes/a")]
    with pytest.raises(LeaseLost):
        await store.keepalive(lease)
    with pytest.raises(LeaseLost):
        await store.put("/failover/default/nodes/a", "{}", lease)
    assert [kv.key for kv in (await store.range("/failover/default/", prefix=True))[0]] == \
        ["/failover/default/primary/chat"]
