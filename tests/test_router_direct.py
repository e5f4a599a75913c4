"""Whole answers served with no task (router/answer_now.py ``Direct``): each way out of one, against
scripted engines on real sockets. A whole answer goes the callback-only way once the instance has
an idle pooled connection, i.e. from the second request on; every test here warms the pool first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp import web

from conftest import free_port
from router_helpers import counter, running_router, serve_app, tolerant, wait_for
from test_router_front import post, read_response

pytestmark = pytest.mark.asyncio

BODY = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 1}).encode()


class Script:
    """An engine whose completions do what ``plan`` says, in turn (then "ok"): "ok", "reset" (the
    connection is dropped mid-request), "hang" (no answer until the client goes), "big" (a 3 MiB
    JSON answer), "503"/"400" (a JSON error with that status)."""

    def __init__(self, name: str, plan: list[str]) -> None:
        self.name, self.plan = name, list(plan)
        self.seen: list[str] = []
        self.gone = asyncio.Event()  # a hung request's client (the router) closed its connection
        self.hanging = asyncio.Event()
        self.big = json.dumps({"id": "c", "choices": [{"index": 0, "text": "y" * (3 << 20)}]}).encode()

    def app(self) -> web.Application:
        async def ready(_):
            return web.json_response({"ready": True})

        async def completions(request: web.Request) -> web.StreamResponse:
            await request.read()
            step = self.plan.pop(0) if self.plan else "ok"
            self.seen.append(step)
            if step == "reset":
                request.transport.abort()
                await asyncio.sleep(5)
            if step == "hang":
                self.hanging.set()
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.01)
                self.gone.set()
                return web.Response(status=499)
            if step in ("503", "400"):
                return web.json_response({"error": {"message": step}}, status=int(step))
            if step == "big":
                return web.Response(body=self.big, content_type="application/json")
            return web.json_response({"id": "c", "choices": [{"index": 0, "text": self.name}]})

        app = web.Application()
        app.add_routes([web.get("/ready", ready), web.post("/v1/completions", completions)])
        return app


@contextlib.asynccontextmanager
async def rig(primary: Script, standby: Script | None = None):
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(serve_app(primary.app(), free_port()))
        s = [await stack.enter_async_context(serve_app(standby.app(), free_port()))] if standby else []
        router = await stack.enter_async_context(running_router(tolerant(), primary=p, standbys=s))
        svc = router.services["tiny"]
        await wait_for(lambda: svc.routable() is not None and all(i.ready for i in svc.instances.values()))
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            writer.write(post("/v1/completions", BODY))  # warms the pool: the next ones go Direct
            status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body)["choices"][0]["text"] == primary.name
            yield router, reader, writer
        finally:
            writer.close()


def settled(router) -> bool:
    """Every instance's gate, in-flight count and the body budget back to nothing."""
    insts = router.services["tiny"].instances.values()
    return all(i.inflight == 0 and i.gate.active == 0 and not i.attempts for i in insts) and \
        router.proxy.bodies.buffered == 0


async def test_an_engine_that_drops_a_pooled_connection_mid_answer_gets_the_request_retried():
    primary, standby = Script("p", ["ok", "reset"]), Script("s", [])
    async with rig(primary, standby) as (router, reader, writer):
        writer.write(post("/v1/completions", BODY))
        status, headers, body = await read_response(reader)
        assert status == 200, body
        # counted once as a failure of the primary, then retried (wherever the primary is by then)
        assert primary.seen[:2] == ["ok", "reset"]
        assert counter(router, "failover_router_retries_total") == 1
        assert json.loads(body)["choices"][0]["text"] == headers["x-failover-instance"][0]
        writer.write(post("/v1/completions", BODY))  # the connection to the client is still good
        assert (await read_response(reader))[0] == 200
        await wait_for(lambda: settled(router), what="slots and budget released")


async def test_a_whole_answer_hung_on_a_fenced_primary_is_answered_by_the_standby():
    primary, standby = Script("p", ["ok", "hang"]), Script("s", [])
    async with rig(primary, standby) as (router, reader, writer):
        writer.write(post("/v1/completions", BODY))
        await asyncio.wait_for(primary.hanging.wait(), 10)
        router.instance_exited("primary-0", -9)  # the exit notice fences it: its requests are aborted
        status, headers, body = await read_response(reader)
        assert status == 200 and headers["x-failover-instance"] == "standby-0"
        assert json.loads(body)["choices"][0]["text"] == "s"
        await asyncio.wait_for(primary.gone.wait(), 10)  # its connection to the old primary was closed
        await wait_for(lambda: settled(router), what="slots and budget released")


async def test_a_client_that_hangs_up_on_a_whole_answer_closes_the_engines_request_and_frees_its_slot():
    primary = Script("p", ["ok", "hang"])
    async with rig(primary) as (router, reader, writer):
        writer.write(post("/v1/completions", BODY))
        await asyncio.wait_for(primary.hanging.wait(), 10)
        assert router.services["tiny"].instances["primary-0"].inflight == 1
        writer.close()
        await asyncio.wait_for(primary.gone.wait(), 10)
        await wait_for(lambda: settled(router), what="slots and budget released")
        assert counter(router, "failover_router_requests_total", code="client_gone") == 1
        assert counter(router, "failover_router_failovers_total") == 0


async def test_whole_answers_larger_than_the_read_buffer_arrive_whole_either_way():
    # the first (pool warm-up) goes the task path, the second Direct: both past HIGH_WATER (1 MiB),
    # where the task path's read() once waited forever on a socket it had paused
    primary = Script("p", ["big", "big"])
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(primary.app(), free_port()))
        router = await stack.enter_async_context(running_router(tolerant(), primary=url))
        await wait_for(lambda: router.services["tiny"].routable() is not None)
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port, limit=1 << 16)
        try:
            for _ in range(2):
                writer.write(post("/v1/completions", BODY))
                status, _, body = await read_response(reader)
                assert status == 200 and body == primary.big
        finally:
            writer.close()
        await wait_for(lambda: settled(router), what="slots and budget released")


async def test_a_stream_request_answered_whole_is_retried_on_503_and_gets_a_400_as_it_is():
    # the stream's task-less form with an answer that is not SSE: a whole answer, as Direct's
    primary = Script("p", ["ok", "503", "ok", "400"])
    stream = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 1, "stream": True}).encode()
    async with rig(primary) as (router, reader, writer):
        writer.write(post("/v1/completions", stream))
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "p"
        assert primary.seen == ["ok", "503", "ok"] and counter(router, "failover_router_retries_total") == 1
        writer.write(post("/v1/completions", stream))
        status, _, body = await read_response(reader)
        assert status == 400 and json.loads(body) == {"error": {"message": "400"}}
        assert counter(router, "failover_router_retries_total") == 1  # a 4xx is the client's, not retried
        await wait_for(lambda: settled(router), what="slots and budget released")
