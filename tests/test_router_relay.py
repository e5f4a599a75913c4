"""The lean relay (issue 20): a stream's bytes reach the client exactly as the engine sent them.

A recording TCP tap sits between the router and a real engine, so the comparison is with the bytes
the engine wrote for this very request (its ``id`` and ``created`` are per request), de-chunked.
"""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest

from conftest import free_port
from router_helpers import counter, one_engine, running_router, tolerant

@pytest.fixture(scope="module")
def engine(tiny_model):
    with one_engine(tiny_model) as e:
        yield e


@contextlib.asynccontextmanager
async def tap(target_port: int):
    """A TCP relay to 127.0.0.1:target_port that records what the engine sends, per connection."""
    port, recorded, writers = free_port(), [], set()

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, into: bytearray | None) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                if into is not None:
                    into += data
                dst.write(data)
                await dst.drain()
        dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        writers.add(up_writer)
        got = bytearray()
        recorded.append(got)
        await asyncio.gather(pipe(reader, up_writer, None), pipe(up_reader, writer, got))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", recorded
    finally:
        server.close()
        for w in writers:  # the pipes then see EOF and end; the handlers with them
            w.close()
        for w in writers:
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()
        await server.wait_closed()


def sse_bodies(raw: bytes) -> list[bytes]:
    """The bodies of the text/event-stream responses in one connection's server-to-client bytes."""
    out, pos = [], 0
    while pos < len(raw):
        end = raw.index(b"\r\n\r\n", pos)
        head = raw[pos:end].decode("latin-1").lower()
        pos = end + 4
        if "transfer-encoding: chunked" in head:
            body = bytearray()
            while (eol := raw.find(b"\r\n", pos)) >= 0:  # a connection cut mid-response just ends
                size = int(raw[pos:eol].split(b";")[0], 16)
                pos = eol + 2
                if size == 0:
                    pos = raw.index(b"\r\n", pos) + 2
                    break
                body += raw[pos:pos + size]
                pos += size + 2
            else:
                pos = len(raw)
        else:
            length = int(next(line.split(":")[1] for line in head.split("\r\n") if line.startswith("content-length")))
            body, pos = raw[pos:pos + length], pos + length
        if "text/event-stream" in head:
            out.append(bytes(body))
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("chat", [False, True])
async def test_a_streams_bytes_reach_the_client_exactly_as_the_engine_sent_them(engine, chat):
    async with tap(engine.port) as (url, recorded):
        async with running_router(tolerant(), primary=url) as router:
            c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
            kw = {"model": "tiny", "max_tokens": 24, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
            if chat:
                make = c.chat.completions.with_streaming_response.create(
                    messages=[{"role": "user", "content": "one two three four"}], **kw)
            else:
                make = c.completions.with_streaming_response.create(prompt="one two three four", **kw)
            async with make as resp:
                assert resp.headers["content-type"] == "text/event-stream"
                got = b"".join([chunk async for chunk in resp.iter_bytes()])
            await c.close()
            lane = counter(router, "failover_router_stream_reads_total", way="lane")
            parsed = counter(router, "failover_router_stream_reads_total", way="parsed")
    sent = [body for raw in recorded for body in sse_bodies(bytes(raw))]
    assert len(sent) == 1, f"expected one stream through the tap, saw {len(sent)}"
    assert got.count(b"\n\n") > 5 and got.endswith(b"data: [DONE]\n\n")  # a real stream, many events
    assert got == sent[0]
    # the engine frames an event as the lane's shape: its reads went by the lane, but the first
    # (the head with it) and the last (the end in one write), unless the box made two reads one
    assert lane >= 1 and parsed >= 2, (lane, parsed)


def test_the_event_loop_is_uvloop_when_installed_and_asyncio_on_request():
    import asyncio as aio
    import importlib.util

    from router import evloop

    async def which() -> str:
        return type(aio.get_running_loop()).__module__

    assert evloop.run(which(), "asyncio").startswith("asyncio")
    has_uvloop = importlib.util.find_spec("uvloop") is not None
    assert evloop.run(which(), "auto").startswith("uvloop" if has_uvloop else "asyncio")
    assert evloop.name("auto") == ("uvloop" if has_uvloop else "asyncio")
    with pytest.raises(ValueError, match="event loop must be one of"):
        evloop.factory("trio")


def big_stream_app(events: int, size: int, progress: dict):
    """An engine stand-in whose stream is far larger than the sockets' buffers: ``events`` events of
    ``size`` bytes of text each, ids on every choice; ``progress["sent"]`` counts its writes."""
    import json

    from aiohttp import web

    from router_helpers import _ready

    async def completions(request: web.Request) -> web.StreamResponse:
        n = min(events, int((await request.json()).get("max_tokens", events)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        out = bytearray()
        for i in range(n):
            ev = {"id": "cmpl-big", "object": "text_completion", "created": 1, "model": "tiny",
                  "choices": [{"index": 0, "text": "x" * size, "token_ids": [i],
                               "finish_reason": "length" if i == n - 1 else None}]}
            data = b"data: " + json.dumps(ev).encode() + b"\n\n"
            out += data
            await resp.write(data)
            progress["sent"] = i + 1
        out += b"data: [DONE]\n\n"
        await resp.write(b"data: [DONE]\n\n")
        progress["bytes"] = bytes(out)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.add_routes([web.get("/ready", _ready), web.post("/v1/completions", completions)])
    return app


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    raw = bytearray()
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        data = await asyncio.wait_for(reader.read(1 << 20), 10)
        assert data, "the router closed the connection before the stream's end"
        raw += data
    return bytes(raw)


def stream_request(max_tokens: int) -> bytes:
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": %d, "stream": true}' % max_tokens
    return (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body))


@pytest.mark.asyncio
@pytest.mark.parametrize("pooled", [False, True], ids=["task-path", "no-task"])
async def test_a_client_that_stops_reading_holds_the_engine_back_and_then_gets_every_byte(pooled):
    """Backpressure through the relay: while the client reads nothing, the router stops reading the
    engine (which then cannot write on); once it reads, it gets the engine's bytes exactly. Pooled:
    a short stream first, so the big one finds an idle upstream connection and goes the task-less
    way (router/stream_now.py), where the drain is a callback."""
    from router_helpers import serve_app, wait_for

    events, progress = 4000, {"sent": 0}
    async with serve_app(big_stream_app(events, 4000, progress), free_port()) as url:
        async with running_router(tolerant(), primary=url) as router:
            await wait_for(lambda: router.services["tiny"].routable() is not None, what="primary ready")
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            if pooled:
                writer.write(stream_request(2))
                assert len(sse_bodies(await read_chunked(reader))[0]) == len(progress["bytes"])
                progress["sent"] = 0
            writer.write(stream_request(events))
            await writer.drain()
            await asyncio.sleep(1.0)  # reading nothing
            held = progress["sent"]
            assert 0 < held < events, f"the engine wrote {held} of {events} events while the client read nothing"
            raw = await read_chunked(reader)
            writer.close()
    got = sse_bodies(raw)
    assert got == [progress["bytes"]]
