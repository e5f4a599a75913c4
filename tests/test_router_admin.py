"""Admin API against a router over two real engines: token, names, planned promote and drain."""

from __future__ import annotations

import os

import aiohttp
import pytest

from conftest import Procs
from router import states
from router_helpers import (KillLauncher, client, counter, reference, running_router, start_engines,
                            tolerant, under_load, wait_for)

pytestmark = pytest.mark.asyncio
TOKEN = "test-admin-token"


@pytest.fixture(scope="module")
def engines(tiny_model):
    """Two engines for the whole module: these tests move roles around but never kill them."""
    procs = Procs()
    try:
        yield start_engines(procs, tiny_model, ["eng-a", "eng-b"])
    finally:
        procs.stop_all()


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "admin.token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o600)
    return tolerant(admin_token_file=path, queue_deadline=2.0)


async def admin(router, method: str, path: str, body: dict | None = None, token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as s:
        async with s.request(method, router.url + path, json=body, headers=headers) as r:
            return r.status, await r.json()


async def ready_pair(router):
    svc = router.services["tiny"]
    await wait_for(lambda: all(svc.instances[n].ready for n in ("eng-a", "eng-b")), what="both engines ready")


async def test_admin_token_is_enforced(engines, config):
    a, b = engines
    async with running_router(config, primary=a, standbys=[b]) as router:
        for method, path in [("GET", "/admin/status"), ("POST", "/admin/promote"), ("POST", "/admin/drain"),
                             ("POST", "/admin/preempt"), ("POST", "/admin/resume")]:
            for token in (None, "wrong", TOKEN + "x", ""):
                status, body = await admin(router, method, path, {"service": "tiny"}, token=token)
                assert status == 401 and body["error"]["type"] == "unauthorized", (method, path, token)
        assert router.services["tiny"].primary.name == "eng-a"  # nothing happened
        status, body = await admin(router, "GET", "/admin/status")
        assert status == 200
        (svc,) = body["services"]
        assert svc["name"] == "tiny" and svc["primary"] == "eng-a"
        roles = {i["name"]: (i["role"], i["pid"], i["url"]) for i in svc["instances"]}
        assert roles == {"eng-a": ("primary", a.proc.pid, a.url), "eng-b": ("standby", b.proc.pid, b.url)}
        assert set(svc["instances"][0]["last_transition"]) == {"from", "to", "reason", "at"}


async def test_admin_disabled_without_token_file(engines):
    a, b = engines
    async with running_router(tolerant(), primary=a, standbys=[b]) as router:
        status, body = await admin(router, "GET", "/admin/status")
        assert status == 403 and "--admin-token-file" in body["error"]["message"]


async def test_unknown_names_and_refusals(engines, config):
    a, b = engines
    async with running_router(config, primary=a, standbys=[b, "http://127.0.0.1:9"]) as router:
        await ready_pair(router)
        status, body = await admin(router, "POST", "/admin/drain", {"instance": "nope"})
        assert status == 404 and "unknown instance 'nope'" in body["error"]["message"]
        assert "eng-a" in body["error"]["message"] and "eng-b" in body["error"]["message"]
        status, body = await admin(router, "POST", "/admin/promote", {"service": "chat"})
        assert status == 404 and "known: ['tiny']" in body["error"]["message"]
        status, body = await admin(router, "POST", "/admin/promote", {"service": "tiny", "to": "eng-z"})
        assert status == 404 and "eng-z" in body["error"]["message"]
        # standby-1 points at a port nobody listens on: never ready, never promoted
        status, body = await admin(router, "POST", "/admin/promote", {"service": "tiny", "to": "standby-1"})
        assert status == 409 and "only a ready standby" in body["error"]["message"]
        status, body = await admin(router, "POST", "/admin/promote", {"service": "tiny", "to": "eng-a"})
        assert status == 409  # the primary is no standby
        status, body = await admin(router, "POST", "/admin/promote", {"service": "tiny", "bogus": 1})
        assert status == 400 and "bogus" in body["error"]["message"]
        status, body = await admin(router, "POST", "/admin/drain", {"instance": "eng-a", "timeout": -1})
        assert status == 400
        assert router.services["tiny"].primary.name == "eng-a"


async def test_planned_promote_and_drain_fail_no_request(engines, config):
    a, b = engines
    launcher = KillLauncher(engines)
    async with running_router(config, launcher, primary=a, standbys=[b]) as router:
        await ready_pair(router)
        c, ref, load = await under_load(router, 6)
        await load.streaming(2)
        status, body = await admin(router, "POST", "/admin/promote", {"service": "tiny"})
        assert status == 200 and body == {"service": "tiny", "primary": "eng-b", "previous": "eng-a",
                                          "drained": True}
        svc = router.services["tiny"]
        assert svc.instances["eng-a"].role == states.STANDBY  # drained, kept as the hot standby
        await load.until(len(load.outcomes) + 6)
        await load.streaming(2)
        status, body = await admin(router, "POST", "/admin/drain", {"instance": "eng-b", "timeout": 20})
        assert status == 200 and body["drained"] and body["role"] == "stopped"
        assert svc.primary.name == "eng-a"  # switched away before draining
        # a stopped instance is never shown ready, whatever its last probe said
        assert svc.instances["eng-b"].ready
        shown = {i["name"]: i for i in router.status()["services"][0]["instances"]}
        assert shown["eng-b"]["role"] == "stopped" and shown["eng-b"]["ready"] is False
        await load.until(len(load.outcomes) + 6)
        await load.stop()
        await c.close()
        load.check(ref)
        assert launcher.fenced == []  # planned operations never kill anything
        assert counter(router, "failover_router_failovers_total", reason="planned") == 2
        assert counter(router, "failover_router_migrations_total") == 0
        status, body = await admin(router, "POST", "/admin/drain", {"instance": "eng-b"})
        assert status == 409 and "stopped" in body["error"]["message"]


async def test_preempt_of_an_online_service_is_refused_unless_forced(engines, config):
    a, b = engines
    launcher = KillLauncher(engines)  # no batch service: "tiny" is online
    cfg = tolerant(admin_token_file=config.admin_token_file)
    async with running_router(cfg, launcher, primary=a, standbys=[b]) as router:
        await ready_pair(router)
        status, body = await admin(router, "POST", "/admin/preempt", {"service": "tiny"})
        assert status == 409 and "online service" in body["error"]["message"]
        assert "--force" in body["error"]["message"] and launcher.preempted == []
        assert router.services["tiny"].routable() is not None  # still serving
        status, body = await admin(router, "POST", "/admin/preempt", {"service": "tiny", "force": "yes"})
        assert status == 400 and "'force'" in body["error"]["message"]
        status, _ = await admin(router, "POST", "/admin/preempt", {"service": "tiny", "force": True})
        assert status == 200 and launcher.preempted == ["tiny"]
        assert {i.role for i in router.services["tiny"].instances.values()} == {states.PREEMPTED}


async def test_preempt_then_resume(engines, config, tmp_path):
    a, b = engines
    launcher = KillLauncher(engines, batch=frozenset({"tiny"}))
    cfg = tolerant(admin_token_file=config.admin_token_file, queue_deadline=0.3)
    async with running_router(cfg, launcher, primary=a, standbys=[b]) as router:
        await ready_pair(router)
        status, _ = await admin(router, "POST", "/admin/preempt", {"service": "tiny"})
        assert status == 200 and launcher.preempted == ["tiny"]
        assert {i.role for i in router.services["tiny"].instances.values()} == {states.PREEMPTED}
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/v1/completions",
                              json={"model": "tiny", "prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 503 and r.headers["Retry-After"].isdigit()
        status, _ = await admin(router, "POST", "/admin/resume", {"service": "tiny"})
        assert status == 200 and launcher.resumed == ["tiny"]
        c = client(router)
        out = await reference(c, prompts=["Hello, world!"])  # waits in the queue for the promotion
        await c.close()
        assert out["Hello, world!"].token_ids
        assert router.services["tiny"].primary is not None
