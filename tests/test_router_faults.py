"""Bad backends and bad clients: garbage, stalls, no primary, malformed and huge requests, disconnects."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import openai
import pytest

from conftest import free_port
from router import states
from router_helpers import (client, complete, counter, garbage_app, one_engine, raw_garbage_server, reference,
                            running_router, serve_app, stalling_app, tolerant, wait_for)

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def engine(tiny_model):
    with one_engine(tiny_model) as e:
        yield e


async def direct_reference(engine, prompts):
    c = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    try:
        return await reference(c, prompts)
    finally:
        await c.close()


async def post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
            return r.status, await r.read(), dict(r.headers)


@pytest.mark.parametrize("kind", ["not-json", "not-http"])
async def test_garbage_backend_is_failed_and_the_request_retried(engine, kind):
    port = free_port()
    ref = await direct_reference(engine, ["Hello, world!"])
    server = await raw_garbage_server(port) if kind == "not-http" else None
    async with (serve_app(garbage_app(), port) if server is None else _nothing()):
        async with running_router(tolerant(), primary=f"http://127.0.0.1:{port}",
                                  standbys=[engine]) as router:
            svc = router.services["tiny"]
            if kind == "not-json":  # /ready answers fine: only the request shows it is no engine
                await wait_for(lambda: svc.routable() is not None and svc.instances["eng"].ready)
            c = client(router)
            out = await complete(c, "Hello, world!", stream=False)
            await c.close()
            assert out.token_ids == ref["Hello, world!"].token_ids
            assert svc.primary.name == "eng" and svc.instances["primary-0"].role == states.STOPPED
            if kind == "not-json":
                assert router.promoter.last_failover["tiny"]["reason"] == "garbage"
    if server is not None:
        server.close()
        await server.wait_closed()


class _nothing:
    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        return False


async def test_backend_stalling_mid_stream_is_failed_and_the_stream_migrated(engine):
    ref = (await direct_reference(engine, ["The quick brown fox"]))["The quick brown fox"]
    port = free_port()
    async with serve_app(stalling_app(ref, sent=5), port) as url:
        # Not much shorter: the real engine must never pause this long between chunks, and a
        # loaded 2-core machine makes it pause for a good part of a second now and then.
        cfg = tolerant(stall_timeout=2.0)
        async with running_router(cfg, primary=url, standbys=[engine]) as router:
            svc = router.services["tiny"]
            await wait_for(lambda: svc.routable() is not None and svc.instances["eng"].ready)
            c = client(router)
            out = await complete(c, "The quick brown fox", stream=True)
            await c.close()
            assert out.token_ids == ref.token_ids  # 5 from the staller, the rest resumed on eng
            assert router.promoter.last_failover["tiny"]["reason"] == "stall"
            assert counter(router, "failover_router_migrations_total") == 1


async def test_no_primary_queues_then_503_with_retry_after(engine):
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = tolerant(queue_deadline=0.4, queue_size=2)
    async with running_router(cfg, primary=dead) as router:
        body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'
        url = router.url + "/v1/completions"
        results = await asyncio.gather(*(post(url, body) for _ in range(3)))
        statuses = sorted(r[0] for r in results)
        assert statuses == [503, 503, 503]
        for status, raw, headers in results:
            assert int(headers["Retry-After"]) >= 1 and b"no ready primary" in raw
        assert sum(b"queue full" in raw for _, raw, _ in results) == 1  # the third did not fit
    # a request that is waiting when a ready standby appears is served, not refused
    cfg = tolerant(queue_deadline=10.0)
    async with running_router(cfg, primary=dead) as router:
        url = router.url + "/v1/completions"
        waiting = asyncio.ensure_future(post(url, body))
        await wait_for(lambda: router.services["tiny"].waiting == 1, what="a queued request")
        router.add_instance("tiny", engine.name, engine.url, "standby", engine.proc.pid)
        status, raw, headers = await waiting
        assert status == 200 and headers["X-Failover-Instance"] == "eng"


async def test_malformed_requests_get_the_engines_own_4xx(engine):
    async with running_router(tolerant(), primary=engine) as router:
        await wait_for(lambda: router.services["tiny"].routable() is not None)
        for body in (b"{not json", b'{"model": "tiny"}', b'{"model": "tiny", "prompt": "x", "max_tokens": -3}',
                     b"[1, 2]"):
            direct = await post(engine.url + "/v1/completions", body)
            routed = await post(router.url + "/v1/completions", body)
            assert 400 <= direct[0] < 500
            assert routed[:2] == direct[:2], body
        assert router.services["tiny"].primary.name == "eng"  # a client's 4xx says nothing about the engine
        assert counter(router, "failover_router_retries_total") == 0


async def test_huge_body_is_capped(engine):
    async with running_router(tolerant(max_body_bytes=4096), primary=engine) as router:
        body = b'{"model": "tiny", "prompt": "' + b"x" * 10_000 + b'"}'
        status, raw, _ = await post(router.url + "/v1/completions", body)
        assert status == 413 and b"request_too_large" in raw
        c = client(router)
        assert (await complete(c, "Hello, world!", stream=False, max_tokens=4)).token_ids  # still serving
        await c.close()


async def test_client_disconnect_cancels_upstream(engine):
    async with running_router(tolerant(), primary=engine) as router:
        inst = router.services["tiny"].instances["eng"]
        await wait_for(lambda: router.services["tiny"].routable() is not None)
        body = b'{"model": "tiny", "prompt": "x", "max_tokens": 400, "stream": true}'
        for _ in range(3):
            async with aiohttp.ClientSession() as s:
                async with s.post(router.url + "/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 200
                    await r.content.readline()  # one event, then hang up
            await wait_for(lambda: inst.inflight == 0, timeout=5, what="the upstream request to end")
        assert counter(router, "failover_router_requests_total", code="client_gone") + \
            counter(router, "failover_router_requests_total", code="200") <= 3
        assert inst.role == states.PRIMARY and not inst.suspect


async def test_standalone_cli_router(engine, procs, tmp_path):
    """`failover router` alone in front of an engine it did not start: serves, stops on SIGTERM."""
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"
    proc = procs.python("-m", "failover", "router", "--backend", f"eng={engine.url}", "--standby", f"spare={dead}",
                        "--port", str(port), "--log-level", "warning", stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3,
                                                 "ignore_eos": True}) as r:  # random weights may end early
            assert r.status == 200 and r.headers["X-Failover-Instance"] == "eng"
            assert len((await r.json())["choices"][0]["token_ids"]) == 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


async def test_cli_refuses_bad_usage(tmp_path):
    async def run(*args):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "failover", "router", *args,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, err.decode()
    code, err = await run()
    assert code == 2 and "--backend" in err
    code, err = await run("--backend", "nourl")
    assert code == 2 and "NAME=http" in err
    code, err = await run("--backend", "a=http://127.0.0.1:1", "--standby", "a=http://127.0.0.1:2")
    assert code == 2 and "unique" in err
    code, err = await run("--backend", "a=http://127.0.0.1:1", "--max-upstream", "0")
    assert code == 2 and "max_upstream must be at least 1" in err
    token = tmp_path / "token"
    token.write_text("t\n")
    token.chmod(0o644)
    code, err = await run("--backend", "a=http://127.0.0.1:1", "--port", "0", "--admin-token-file", str(token))
    assert code == 1 and "chmod 600" in err
