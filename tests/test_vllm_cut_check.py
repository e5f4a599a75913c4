"""A stock vLLM behind the router: its check for the prompt leak of a stream continued inside a
character (router/adapters/vllm_check.py), and how the router then continues such a stream
(router/cut.py). ``VLLM_PLUGINS=""`` makes vLLM load no plugin, so it runs as a stock vLLM does when
an operator puts it behind the standalone router. test_vllm_router.py has the same vLLM with
failover's plugin: no leak, and every cut continues exactly."""

from __future__ import annotations

import openai
import pytest
import structlog

from failover.cmd.admin import render_table
from failover_common.ports import free_port
from test_vllm_router import MAX_TOKENS, SPLIT_PROMPT, _ids_of, _router_behind, _stream, _text_of, _undisturbed
from vllm_helpers import HAVE_VLLM, Breaker, VllmServer, needs_vllm, vllm_checkpoint


@pytest.fixture(scope="module")
def stock_vllm(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip(needs_vllm.kwargs["reason"])
    d = tmp_path_factory.mktemp("stock-vllm")
    server = VllmServer(vllm_checkpoint(d / "model"), free_port(), d / "vllm.log", env={"VLLM_PLUGINS": ""})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def _continuation_text(vllm, prompt_ids: list[int]) -> str:
    """What vLLM answers the prompt a migration at that cut would send it, asked directly."""
    c = openai.AsyncOpenAI(base_url=vllm.url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        out = await c.completions.create(model="tiny", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].text
    finally:
        await c.close()


@needs_vllm
@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_stock_vllm_is_found_leaking_and_a_cut_inside_a_character_never_brings_the_prompt(stock_vllm):
    with structlog.testing.capture_logs() as logs:
        async for router, c, breaker in _router_behind(stock_vllm, Breaker(stock_vllm.port)):
            verdicts = {i["name"]: i["cut_leak"] for i in router.status()["services"][0]["instances"]}
            shown = [line for line in render_table(router.status()).splitlines() if "leaks a prompt cut" in line]
            want_text, _, chunks = await _undisturbed(stock_vllm, False, SPLIT_PROMPT, extra_body={"return_token_ids": True})
            inside = [k for k, ch in enumerate(chunks, 1) if _ids_of(ch) and not _text_of(ch, False)]
            clean = [k for k, ch in enumerate(chunks[:-2], 1) if len(_ids_of(ch)) == 1 and _text_of(ch, False)]
            assert inside and clean, "the stream has no cut of each kind: the test would show nothing"
            sent = [i for ch in chunks[:inside[0]] for i in _ids_of(ch)]
            leaked = SPLIT_PROMPT in await _continuation_text(stock_vllm, chunks[0].choices[0].model_extra["prompt_token_ids"] + sent)

            breaker.arm(inside[0])  # a cut inside a character: continued from before its held-back ids
            text, _, _ = await _stream(c, False, SPLIT_PROMPT)
            assert breaker.cuts == 1 and text == want_text

            breaker.arm(inside[0])  # the same cut for a client that has the ids: an error, not the prompt
            got = ""
            with pytest.raises(openai.APIError, match="inside a character"):
                s = await c.completions.create(model="tiny", prompt=SPLIT_PROMPT, max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True, extra_body={"return_token_ids": True})
                async for chunk in s:
                    got += _text_of(chunk, False)
            assert want_text.startswith(got) and SPLIT_PROMPT not in got

            breaker.arm(clean[0])  # a cut after an event that ended a character: continued as it is
            text, _, _ = await _stream(c, False, SPLIT_PROMPT)
            assert breaker.cuts == 3 and text == want_text
    assert verdicts == {"cut": leaked, "direct": leaked}
    assert leaked, "a stock vLLM no longer leaks (vllm-project/vllm#48853 fixed?): failover_vllm.detokenizer can go"
    warned = sorted(e["instance"] for e in logs if e["event"] == "vllm_leaks_prompt_on_cut")
    assert warned == ["cut", "direct"]
    assert sorted(line.split(":")[0] for line in shown) == ["cut", "direct"]  # failover status says it too
