"""The etcd client and the cluster role store against a real 3-member etcd cluster on loopback."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from etcd_helpers import ETCD, EtcdCluster
from failover_common.etcd import Etcd, EtcdUnavailable, LeaseLost

pytestmark = pytest.mark.skipif(ETCD is None, reason="needs etcd (apt-get install etcd-server)")


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(3) as cluster:
        yield cluster


def run(coro):
    return asyncio.run(coro)


def test_swap_lets_exactly_one_of_many_writers_win(etcd):
    async def main():
        clients = [Etcd(etcd.endpoints[i % 3:] + etcd.endpoints[:i % 3]) for i in range(8)]
        try:
            results = await asyncio.gather(*(c.swap("/t/swap", 0, f"w{i}") for i, c in enumerate(clients)))
            winners = [i for i, r in enumerate(results) if r.ok]
            assert len(winners) == 1, results
            won = f"w{winners[0]}"
            assert all(r.current is not None and r.current.value == won for r in results if not r.ok)
            kv = await clients[0].get("/t/swap")
            assert kv.value == won and kv.version == 1 and kv.mod_revision == results[winners[0]].revision
            # the next swap must name that revision (the fencing token): a stale one loses
            stale = await clients[1].swap("/t/swap", kv.mod_revision - 1, "late")
            assert not stale.ok and stale.current.value == won
            fresh = await clients[1].swap("/t/swap", kv.mod_revision, "next")
            assert fresh.ok and (await clients[2].get("/t/swap")).value == "next"
        finally:
            for c in clients:
                await c.close()
    run(main())


def test_lease_expiry_drops_its_keys_and_keepalive_says_so(etcd):
    async def main():
        c = Etcd(etcd.endpoints)
        try:
            lease = await c.grant(1)
            await c.put("/t/leased/a", "1", lease)
            assert await c.keepalive(lease) >= 1
            deadline = time.monotonic() + 10
            while await c.get("/t/leased/a") is not None:
                assert time.monotonic() < deadline, "a lease of 1 s kept its key for 10 s"
                await asyncio.sleep(0.1)
            with pytest.raises(LeaseLost):
                await c.keepalive(lease)
            with pytest.raises(LeaseLost):
                await c.put("/t/leased/b", "1", lease)
        finally:
            await c.close()
    run(main())


def test_kill_of_one_member_keeps_reads_writes_and_the_watch_going(etcd):
    async def main():
        c = Etcd(etcd.endpoints)  # the first endpoint answers first: it is the one killed
        seen: list[str] = []

        async def watch():
            rev = 0
            while True:
                try:
                    kvs, rev = await c.range("/t/w/", prefix=True) if not rev else ([], rev)
                    async for events in c.watch("/t/w/", prefix=True, start_revision=rev + 1):
                        for ev in events:
                            seen.append(ev.kv.value)
                            rev = ev.kv.mod_revision
                except EtcdUnavailable:
                    await asyncio.sleep(0.05)
        task = asyncio.ensure_future(watch())
        try:
            await asyncio.sleep(0.3)
            await c.put("/t/w/k", "before")
            await asyncio.sleep(0.3)
            etcd.kill(0)
            t0 = time.monotonic()
            await c.put("/t/w/k", "after")  # another member answers
            assert (await c.get("/t/w/k")).value == "after"
            while "after" not in seen:
                assert time.monotonic() - t0 < 10, f"watch never resumed: {seen}"
                await asyncio.sleep(0.05)
            assert seen == ["before", "after"], seen  # nothing lost, nothing twice
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await c.close()
            etcd.restart(0)
            etcd.wait_healthy(members=[0])
    run(main())


def test_no_endpoint_is_unavailable_not_a_refusal():
    async def main():
        from failover_common.ports import free_port

        c = Etcd([f"127.0.0.1:{free_port()}"], timeout=0.5)
        try:
            with pytest.raises(EtcdUnavailable):
                await c.swap("/t/x", 0, json.dumps({"instance": "a"}))
        finally:
            await c.close()
    run(main())
