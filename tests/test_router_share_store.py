"""The workers' role store (router/share_store.py) through its real Unix socket and client."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest

from failover_common.etcd import LeaseLost
from router.share_client import ShareClient
from router.share_store import ShareServer, ShareStore


def run(coro):
    return asyncio.run(coro)


async def served(run_dir):
    server = ShareServer(ShareStore(), run_dir / "roles.sock")
    await server.start()
    return server


def test_of_two_claims_against_one_revision_exactly_one_wins_and_the_loser_sees_the_winner(run_dir):
    async def go():
        server = await served(run_dir)
        a, b = ShareClient(server.path), ShareClient(server.path)
        try:
            first = await a.swap("/p/primary/s", 0, '{"instance": "x"}')
            assert first.ok
            ra, rb = await asyncio.gather(a.swap("/p/primary/s", first.revision, '{"instance": "y"}'),
                                          b.swap("/p/primary/s", first.revision, '{"instance": "z"}'))
            assert sorted([ra.ok, rb.ok]) == [False, True]
            loser = ra if not ra.ok else rb
            winner = "y" if ra.ok else "z"
            assert loser.current.json()["instance"] == winner
            assert (await b.get("/p/primary/s")).json()["instance"] == winner
        finally:
            await a.close()
            await b.close()
            await server.stop()
        assert not server.path.exists()
    run(go())


def test_a_watch_sees_what_came_after_its_read_and_a_lapsed_lease_takes_its_keys(run_dir):
    async def go():
        server = await served(run_dir)
        c = ShareClient(server.path)
        try:
            lease = await c.grant(1)  # the store's TTL is in seconds, like etcd's
            await c.put("/p/routers/w1", "{}", lease)
            _, rev = await c.range("/p/", prefix=True)
            await c.put("/p/instances/s/a", '{"url": "http://127.0.0.1:1"}')  # after the read
            seen = []
            async for events in c.watch("/p/", prefix=True, start_revision=rev + 1, progress_timeout=0.2):
                seen += [(e.kind, e.kv.key) for e in events]
                if ("delete", "/p/routers/w1") in seen:
                    break
            assert seen[0] == ("put", "/p/instances/s/a")  # from the backlog: nothing lost in between
            with pytest.raises(LeaseLost):
                await c.keepalive(lease)
            with pytest.raises(LeaseLost):
                await c.put("/p/routers/w1", "{}", lease)
        finally:
            await c.close()
            await server.stop()
    run(go())


def test_the_socket_is_private_and_a_shared_directory_is_refused(run_dir, tmp_path):
    async def go():
        server = await served(run_dir)
        mode = stat.S_IMODE(os.stat(server.path).st_mode)
        await server.stop()
        assert mode == 0o600
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        os.chmod(shared, 0o755)
        with pytest.raises(PermissionError, match="0700"):
            await ShareServer(ShareStore(), shared / "roles.sock").start()
    run(go())


def test_a_line_that_is_not_json_closes_that_connection_only(run_dir):
    async def go():
        server = await served(run_dir)
        good = ShareClient(server.path)
        try:
            reader, writer = await asyncio.open_unix_connection(str(server.path))
            writer.write(b"not json\n")
            assert await reader.read() == b""  # closed on it
            writer.close()
            reader, writer = await asyncio.open_unix_connection(str(server.path))
            writer.write(b'{"id": 1, "op": "drop_everything"}\n')
            assert b"unknown op" in await reader.readline()
            writer.close()
            assert await good.put("/p/k", "v") > 0  # everyone else is served
        finally:
            await good.close()
            await server.stop()
    run(go())
