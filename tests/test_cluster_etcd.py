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


def test_a_frozen_member_moves_calls_and_the_watch_to_another_and_keeps_the_lease(etcd):
    """SIGSTOP of the member in use: its sockets stay open and silent. Every call has a deadline and
    the watch's silence is checked, so both move on; a lease kept alive meanwhile never expires."""
    async def main():
        c = Etcd(etcd.endpoints, timeout=0.3)
        seen: list[str] = []
        moved: list[float] = []

        async def watch():
            rev = (await c.range("/t/f/", prefix=True))[1]
            while True:
                try:
                    async for events in c.watch("/t/f/", prefix=True, start_revision=rev + 1, progress_timeout=0.3):
                        for ev in events:
                            seen.append(ev.kv.value)
                            rev = ev.kv.mod_revision
                except EtcdUnavailable:
                    moved.append(time.monotonic())
                    await asyncio.sleep(0.05)
        lease = await c.grant(2)
        task = asyncio.ensure_future(watch())
        frozen = etcd.index(c.endpoints[0])
        try:
            await asyncio.sleep(0.5)
            await c.put("/t/f/k", "before", lease)
            while "before" not in seen:
                await asyncio.sleep(0.02)
            etcd.freeze(frozen)
            t0 = time.monotonic()
            for _ in range(12):  # 3 s: past the TTL of 2 s, kept alive every 0.25 s
                await c.keepalive(lease)
                await asyncio.sleep(0.25)
            await c.put("/t/f/k", "during", lease)
            while "during" not in seen:
                assert time.monotonic() - t0 < 10, f"the watch stayed on the frozen member: {seen}"
                await asyncio.sleep(0.05)
            assert moved and moved[0] - t0 < 2.0, "the silent watch was not given up within its deadline"
            assert c.endpoints[-1] == etcd.endpoints[frozen], c.endpoints  # asked last from now on
            assert (await c.get("/t/f/k")).lease == lease, "the lease expired while one member froze"
            assert seen == ["before", "during"], seen
        finally:
            etcd.thaw(frozen)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await c.revoke(lease)
            await c.close()
            etcd.wait_healthy(members=[frozen])
    run(main())
