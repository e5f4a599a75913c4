"""The router's lean listener (router/front.py) and upstream pool (router/upstream.py) against a real
engine, over raw sockets: what it serves itself, what it hands to aiohttp on the same connection,
and that upstream connections are reused rather than opened per request."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from router.front import BODY_WAIT
from router_helpers import one_engine, running_router, tolerant, wait_for

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def engine(tiny_model):
    with one_engine(tiny_model) as e:
        yield e


def completion(max_tokens: int = 2) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0}).encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length body (what both listeners send for these)."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head[1:] if line)}
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def test_one_connection_mixes_lean_and_aiohttp_requests(engine):
    async with running_router(tolerant(), primary=engine) as router:
        await wait_for(lambda: router.services["tiny"].routable() is not None)
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            writer.write(post("/v1/completions", completion()))  # plain: served by the lean listener
            status, headers, body = await read_response(reader)
            assert status == 200 and headers["x-failover-instance"] == "eng", body
            assert "server" not in headers  # aiohttp would have named itself
            assert json.loads(body)["choices"][0]["token_ids"]
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # not a forward path: aiohttp's
            status, headers, body = await read_response(reader)
            assert status == 200 and json.loads(body) == {"alive": True}
            assert headers["server"].startswith("Python/")  # aiohttp answered it
            writer.write(post("/v1/completions", completion()))  # the connection stays aiohttp's, and works
            status, headers, body = await read_response(reader)
            assert status == 200 and json.loads(body)["choices"][0]["token_ids"], body
        finally:
            writer.close()


async def test_a_body_that_trickles_is_served_either_way(engine):
    async with running_router(tolerant(), primary=engine) as router:
        await wait_for(lambda: router.services["tiny"].routable() is not None)
        for pause in (0.02, BODY_WAIT + 0.3):  # within the lean listener's wait, then past it (aiohttp's)
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            try:
                raw = post("/v1/completions", completion())
                writer.write(raw[:-10])
                await asyncio.sleep(pause)
                writer.write(raw[-10:])
                status, headers, body = await read_response(reader)
                assert status == 200, body
                assert ("server" in headers) == (pause > BODY_WAIT), (pause, headers)
            finally:
                writer.close()


async def test_upstream_connections_are_pooled_and_a_pipelined_pair_is_answered_in_order(engine):
    async with running_router(tolerant(), primary=engine) as router:
        await wait_for(lambda: router.services["tiny"].routable() is not None)
        inst = router.services["tiny"].instances["eng"]
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            for _ in range(5):
                writer.write(post("/v1/completions", completion()))
                assert (await read_response(reader))[0] == 200
            pool = inst._session
            assert len(pool._idle) + len(pool._busy) == 1  # sequential requests: one engine connection
            writer.write(post("/v1/completions", completion(1)) + post("/v1/completions", completion(3)))
            first, second = await read_response(reader), await read_response(reader)
            assert len(json.loads(first[2])["choices"][0]["token_ids"]) == 1
            assert len(json.loads(second[2])["choices"][0]["token_ids"]) == 3
            writer.write(post("/v1/completions", completion(), "Connection: close\r\n"))
            status, headers, _ = await read_response(reader)
            assert status == 200 and headers["connection"] == "close"
            assert await asyncio.wait_for(reader.read(), 5) == b""  # and closed
        finally:
            writer.close()


def echo_app():
    """Answers a completion with the request headers it got, as JSON, and headers of its own;
    ``"max_tokens": 0`` gets a 400 (an engine's error must come back as it is)."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers]
        status = 400 if body.get("max_tokens") == 0 else 200
        return web.Response(status=status, body=json.dumps({"headers": seen}).encode(),
                            content_type="application/json", headers={"X-Engine": "echo"})

    async def ready(_request):
        return web.json_response({"ready": True})

    app = web.Application()
    app.add_routes([web.get("/ready", ready), web.post("/v1/completions", completions)])
    return app


async def test_a_whole_answer_is_the_engines_bytes_and_the_clients_end_to_end_headers_reach_it():
    from router_helpers import counter, serve_app
    from conftest import free_port

    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(echo_app(), free_port()))
        router = await stack.enter_async_context(running_router(tolerant(), primary=url))
        await wait_for(lambda: router.services["tiny"].routable() is not None)
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            for max_tokens, code in ((2, 200), (0, 400)):
                writer.write(post("/v1/completions", completion(max_tokens),
                                  "X-Trace: t-1\r\nAuthorization: Bearer k\r\nTE: trailers\r\nAccept-Encoding: gzip\r\n"))
                status, headers, body = await read_response(reader)
                assert status == code, body
                seen = {k.lower(): v for k, v in json.loads(body)["headers"]}
                # the engine's own bytes, unchanged (the echo's JSON is what it sent)
                assert json.loads(body)["headers"] and body.startswith(b'{"headers": ')
                assert seen["x-trace"] == "t-1" and seen["authorization"] == "Bearer k"
                assert "te" not in seen and seen["accept-encoding"] == "identity"
                assert seen["host"] == url.split("//", 1)[1]
                assert seen["content-length"] == str(len(completion(max_tokens)))
                assert headers["x-engine"] == "echo" and headers["content-type"].startswith("application/json")
                assert headers["x-failover-instance"] == "primary-0" and "server" not in headers
                assert headers["date"]  # the router's own, the engine's is dropped
            assert counter(router, "failover_router_requests_total", code="200") == 1
            assert counter(router, "failover_router_requests_total", code="400") == 1
        finally:
            writer.close()


async def test_obs_text_is_served_lean_and_a_head_outside_the_subset_goes_to_aiohttp():
    """router/heads.py's subset: a value with obs-text is plain (its bytes reach the engine as
    sent); an HTTP/1.0 request or a field name that is not a token is aiohttp's to answer."""
    from router_helpers import serve_app
    from conftest import free_port

    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(serve_app(echo_app(), free_port()))
        router = await stack.enter_async_context(running_router(tolerant(), primary=url))
        await wait_for(lambda: router.services["tiny"].routable() is not None)
        body = completion()
        cases = [
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Name: caf\xe9\r\n", 200, False),
            (b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nX-Name: plain\r\n", 200, True),
            (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX@Name: odd\r\n", 400, True),
        ]
        for head, code, by_aiohttp in cases:
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            try:
                writer.write(head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
                status, headers, answer = await read_response(reader)
                assert status == code, (head, answer)
                assert ("server" in headers) is by_aiohttp, (head, headers)
                if code == 200:
                    seen = dict(json.loads(answer)["headers"])
                    assert seen["X-Name"] == head.split(b"X-Name: ")[1].split(b"\r\n")[0].decode("latin-1")
            finally:
                writer.close()
