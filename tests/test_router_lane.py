"""The relay's lane (router/sse.py, router/stream.py ``_lane``): the common stream read, one chunk of
one event, goes to the client as it came and is inspected only when its ids are needed.

What must hold: the lane takes only reads that httptools would have read as exactly that event
(else the client could get bytes the engine did not mean); httptools stays at a chunk's boundary
across the reads it does not see; a break after lane reads (past ``HELD_MAX`` too) continues the
stream exactly; garbage the lane sent is found when a break needs the ids, and then the stream ends
with an in-band error, never a wrong continuation.
"""

from __future__ import annotations

import asyncio
import json

import httptools
import openai
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import free_port
from router.sse import event_data, one_event
from router.stream import HELD_MAX
from router_helpers import (_ready, client, complete, counter, one_engine, running_router, serve_app, serve_raw,
                            tolerant, wait_for)
from test_router_relay import read_chunked, sse_bodies, stream_request

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Reading:
    """httptools' reading of a chunked response: its body pieces, chunk ends, completion."""

    def __init__(self) -> None:
        self.body, self.chunks_done, self.complete = [], 0, False
        self.parser = httptools.HttpResponseParser(self)
        self.parser.feed_data(HEAD)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_chunk_complete(self) -> None:
        self.chunks_done += 1

    def on_message_complete(self) -> None:
        self.complete = True


def chunk(payload: bytes, size: bytes | None = None) -> bytes:
    return (size if size is not None else b"%x" % len(payload)) + b"\r\n" + payload + b"\r\n"


line = st.binary(min_size=1, max_size=300).filter(lambda b: b"\r" not in b and b"\n" not in b and b != b"[DONE]")


@given(line)
def test_one_chunk_of_one_event_takes_the_lane_and_httptools_reads_it_alike(text):
    data = chunk(b"data: " + text + b"\n\n")
    assert one_event(data) and event_data(data) == text
    r = _Reading()
    r.parser.feed_data(data)
    assert b"".join(r.body) == b"data: " + text + b"\n\n" and r.chunks_done == 1 and not r.complete


@settings(max_examples=400)
@given(st.one_of(st.binary(max_size=200),
                 st.builds(lambda t, junk, cut: chunk(b"data: " + t + b"\n\n")[:cut] + junk,
                           line, st.binary(max_size=6), st.integers(0, 400)),
                 st.builds(lambda t: chunk(b"data: " + t + b"\n\n"),  # CRs (alone, or before the blank line)
                           st.lists(st.sampled_from([b"a", b"\r", b"\r\n", b"{}"]), min_size=1).map(b"".join))))
def test_whatever_the_lane_takes_httptools_reads_as_exactly_one_whole_event(data):
    """Any bytes at all: the lane says yes only where the parser reads one complete chunk whose
    payload is one data event of one line, not [DONE], and stops at its end."""
    if not one_event(data):
        return
    r = _Reading()
    r.parser.feed_data(data)
    payload = b"".join(r.body)
    assert r.chunks_done == 1 and not r.complete
    assert payload.startswith(b"data: ") and payload.endswith(b"\n\n")
    text = payload[6:-2]
    assert b"\n" not in text and b"\r" not in text and text != b"[DONE]" and text == event_data(data)


LETTERED = b"data: " + b"x" * 18 + b"\n\n"  # 26 bytes: size "1a"


@pytest.mark.parametrize("data", [
    chunk(LETTERED, size=b"1A"),                             # uppercase hex
    chunk(b'data: {"a": 1}\n\n', size=b"010"),              # a leading zero
    chunk(b'data: {"a": 1}\n\n', size=b"10;x=1"),           # a chunk extension
    chunk(b'data: {"a": 1}\n\ndata: {"b": 2}\n\n'),         # two events
    chunk(b': keep-alive\n\n'),                              # a comment
    chunk(b'data: [DONE]\n\n'),                              # the end
    chunk(b'data: {"a": 1}\r\n\r\n'),                        # CRLF line ends
    chunk(b'data: {"a":\n1}\n\n'),                           # two lines
    chunk(b'id: 3\ndata: {"a": 1}\n\n'),                     # another field
    chunk(b'data: {"a": 1}\n\n')[:-1],                       # a partial chunk
    chunk(b'data: {"a": 1}\n\n') + b"0\r\n\r\n",             # the terminator with it
    chunk(b'data: {"a": 1}\n\n') * 2,                        # two chunks
    chunk(b'data: {"a": 1}\n'),                              # an event not ended
], ids=lambda d: repr(d[:24]))
def test_reads_of_any_other_shape_go_the_usual_way(data):
    assert not one_event(data)
    assert one_event(chunk(LETTERED))  # the same event, lowercase: the lane's


async def one_stream(port: int, max_tokens: int) -> bytes:
    """One stream request on a raw connection: the router's whole answer, as sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(stream_request(max_tokens))
        return await read_chunked(reader)
    finally:
        writer.close()
        await writer.wait_closed()


def staller(ids: list[int], garbage_at: int | None = None):
    """Streams one event per token id, one chunk each (aiohttp's writes: the lane's shape), then
    stalls; with ``garbage_at``, the event at that index is not JSON."""
    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, tok in enumerate(ids):
            ev = {"id": "cmpl-lane", "object": "text_completion", "created": 1, "model": "tiny",
                  "choices": [{"index": 0, "text": "", "token_ids": [tok], "finish_reason": None}]}
            data = b"{not json" if i == garbage_at else json.dumps(ev).encode()
            await resp.write(b"data: " + data + b"\n\n")
            await asyncio.sleep(0.002)  # one read each
        await asyncio.sleep(3600)
        return resp
    app = web.Application()
    app.add_routes([web.get("/ready", _ready), web.post("/v1/completions", completions)])
    return app


@pytest.fixture(scope="module")
def engine(tiny_model):
    with one_engine(tiny_model) as e:
        yield e


@pytest.mark.asyncio
async def test_a_long_stream_goes_by_the_lane_and_a_stall_after_it_migrates_exactly(engine):
    c = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    ref = await complete(c, "The quick brown fox", stream=False, max_tokens=64)
    await c.close()
    sent = HELD_MAX + 8  # past one settle of the held reads
    assert len(ref.token_ids) > sent, "the reference must be longer than what the staller sends"
    async with serve_app(staller(ref.token_ids[:sent]), free_port()) as url:
        async with running_router(tolerant(stall_timeout=2.0), primary=url, standbys=[engine]) as router:
            svc = router.services["tiny"]
            await wait_for(lambda: svc.routable() is not None and svc.instances["eng"].ready)
            c = client(router)
            out = await complete(c, "The quick brown fox", stream=True, max_tokens=64)
            await c.close()
            assert out.token_ids == ref.token_ids  # `sent` from the staller, the rest resumed on eng
            assert router.promoter.last_failover["tiny"]["reason"] == "stall"
            assert counter(router, "failover_router_migrations_total") == 1
            # the staller's events after the first read, and most of eng's, went by the lane
            assert counter(router, "failover_router_stream_reads_total", way="lane") >= sent - 2
            assert counter(router, "failover_router_stream_reads_total", way="parsed") >= 2


@pytest.mark.asyncio
async def test_garbage_the_lane_sent_makes_a_later_break_an_in_band_error_not_a_guess(engine):
    ids = list(range(100, 110))
    async with serve_app(staller(ids, garbage_at=4), free_port()) as url:
        async with running_router(tolerant(stall_timeout=1.0), primary=url, standbys=[engine]) as router:
            svc = router.services["tiny"]
            await wait_for(lambda: svc.routable() is not None and svc.instances["eng"].ready)
            raw = await one_stream(router.port, 20)
            assert counter(router, "failover_router_migrations_total") == 0
    assert b"data: {not json\n\n" in raw  # sent as the engine sent it, in order
    assert raw.count(b'"token_ids": [') == len(ids) - 1
    last = raw[raw.rindex(b"\r\ndata: ") + 2:]  # the last event (chunk framing between events)
    assert b"backend_failed" in last and b"not migratable (an event sent as it came is not one" in last


def split_engine(ev1: bytes, ev2: bytes, seen: dict):
    """A raw engine whose second chunk arrives in two reads, cut at an event's end, so that the
    second read looks like a lane chunk of its own (its first line the right size in hex) though
    it is the rest of a chunk that httptools is inside. ``seen["body"]``: its de-chunked body."""
    tail = b"data: " + ev2 + b"\n\n"
    payload = b"data: " + ev1 + b"\n\n" + b"%x\r\n" % len(tail) + tail  # a line "<hex>" is a field SSE ignores
    cut = len(b"data: " + ev1 + b"\n\n")
    first = b"data: " + ev1 + b"\n\n"
    done = b"data: [DONE]\n\n"
    seen["body"] = first + payload + done

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the router hung up (a probe's connection closed, the router stopped)
        finally:
            writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = next((int(v) for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:] if b":" in ln)
                           if k.strip().lower() == b"content-length"), 0)
            await reader.readexactly(length)
            if head.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
                             b'{"ready": true}')
                continue
            writer.write(HEAD + chunk(first))
            await asyncio.sleep(0.05)
            writer.write(b"%x\r\n" % len(payload) + payload[:cut])
            await asyncio.sleep(0.05)
            writer.write(payload[cut:] + b"\r\n")
            await asyncio.sleep(0.05)
            writer.write(chunk(done) + b"0\r\n\r\n")
            await writer.drain()
    return handle


@pytest.mark.asyncio
async def test_a_read_inside_a_chunk_is_never_taken_for_a_chunk_of_its_own():
    def ev(i: int) -> bytes:
        return json.dumps({"id": "cmpl-split", "choices": [{"index": 0, "text": "t", "token_ids": [i],
                                                            "finish_reason": None}]}).encode()
    seen: dict = {}
    async with serve_raw(split_engine(ev(1), ev(2), seen)) as url:
        async with running_router(tolerant(), primary=url) as router:
            await wait_for(lambda: router.services["tiny"].routable() is not None, what="primary ready")
            raw = await one_stream(router.port, 3)
    # the engine's body as httptools reads it, its CRLFs as LFs (the parse's one change)
    assert sse_bodies(raw) == [seen["body"].replace(b"\r\n", b"\n")]
