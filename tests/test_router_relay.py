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
from router_helpers import one_engine, running_router, tolerant

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
    sent = [body for raw in recorded for body in sse_bodies(bytes(raw))]
    assert len(sent) == 1, f"expected one stream through the tap, saw {len(sent)}"
    assert got.count(b"\n\n") > 5 and got.endswith(b"data: [DONE]\n\n")  # a real stream, many events
    assert got == sent[0]


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
