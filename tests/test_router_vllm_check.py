"""The vLLM kind's check of a new instance (router/adapters/vllm_check.py) where no vLLM is: an
instance whose endpoints do not answer as vLLM's is left unjudged (``cut_leak`` null) and serves as
before, and a check that hangs never holds up the router's stop. The verdicts against real vLLMs are
in tests/test_vllm_cut_check.py and test_vllm_router.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
from aiohttp import web

from conftest import free_port
from router_helpers import running_router, serve_app, tolerant, wait_for


def _vllm_like(tokenize) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.post("/tokenize", tokenize)])
    return app


@pytest.mark.asyncio
async def test_an_instance_without_vllms_tokenizer_endpoints_is_left_unjudged():
    asked = []

    async def no_tokenize(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(status=404)

    async with serve_app(_vllm_like(no_tokenize), free_port()) as url:
        with structlog.testing.capture_logs() as logs:
            async with running_router(tolerant()) as router:
                router.add_instance("tiny", "a", url, "primary", engine="vllm")
                await wait_for(lambda: any(e["event"] == "vllm_cut_check_inconclusive" for e in logs), 10,
                               "the check's verdict")
                inst = router.services["tiny"].instances["a"]
                assert inst.cut_leak is None and inst.ready
                assert router.status()["services"][0]["instances"][0]["cut_leak"] is None
    assert asked == ["/tokenize"]
    assert not any(e["event"] == "vllm_leaks_prompt_on_cut" for e in logs)


@pytest.mark.asyncio
async def test_a_check_that_hangs_is_cancelled_by_the_routers_stop():
    hung = asyncio.Event()

    async def never(request: web.Request) -> web.Response:
        hung.set()
        await asyncio.sleep(3600)
        return web.Response(status=500)

    async with serve_app(_vllm_like(never), free_port()) as url:
        async with running_router(tolerant(shutdown_timeout=5.0)) as router:
            router.add_instance("tiny", "a", url, "primary", engine="vllm")
            await asyncio.wait_for(hung.wait(), 10)
            t0 = time.monotonic()
        took = time.monotonic() - t0
        assert len(router._checks) == 0
    assert took < 2.0, f"the stop waited {took:.1f} s for the check"


def test_failover_status_names_an_instance_whose_vllm_leaks_a_cut_prompt():
    from failover.cmd.admin import render_table

    inst = {"service": "chat", "role": "standby", "url": "http://127.0.0.1:1", "ready": True}
    doc = {"services": [{"name": "chat", "instances": [dict(inst, name="a", cut_leak=True),
                                                       dict(inst, name="b", cut_leak=False),
                                                       dict(inst, name="c", cut_leak=None)]}]}
    named = [line.split(":")[0] for line in render_table(doc).splitlines() if "leaks a prompt cut" in line]
    assert named == ["a"]
