"""The router's check of a vLLM for the prompt leak of a stream continued inside a character
(router/adapters/vllm_check.py), against a real vLLM without failover's plugin: ``VLLM_PLUGINS=""``
makes vLLM load none, as a stock vLLM runs when an operator puts it behind the standalone router.
test_vllm_router.py checks the same against a vLLM with the plugin (no leak)."""

from __future__ import annotations

import pytest
import structlog

from failover_common.ports import free_port
from router_helpers import wait_for
from test_vllm_router import SPLIT_PROMPT, _ids_of, _router_behind, _stream, _text_of, _undisturbed
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


@needs_vllm
@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_check_of_a_stock_vllm_says_what_a_stream_migrated_inside_a_character_then_shows(stock_vllm):
    with structlog.testing.capture_logs() as logs:
        async for router, c, breaker in _router_behind(stock_vllm, Breaker(stock_vllm.port)):
            svc = router.services["tiny"]
            await wait_for(lambda: all(i.cut_leak is not None for i in svc.instances.values()), 60, "the cut checks")
            verdicts = {i["name"]: i["cut_leak"] for i in router.status()["services"][0]["instances"]}
            # what a client then gets: one stream cut right after an event that ends inside a character
            _, _, chunks = await _undisturbed(stock_vllm, False, SPLIT_PROMPT, extra_body={"return_token_ids": True})
            inside = [k for k, ch in enumerate(chunks, 1) if _ids_of(ch) and not _text_of(ch, False)]
            assert inside, "no event ends inside a character: the test would show nothing"
            cuts = breaker.cuts
            breaker.arm(inside[0])
            text, _, _ = await _stream(c, False, SPLIT_PROMPT)
            assert breaker.cuts == cuts + 1
    leaked = SPLIT_PROMPT in text
    assert verdicts == {"cut": leaked, "direct": leaked}, text
    assert leaked, "a stock vLLM no longer leaks (vllm-project/vllm#48853 fixed?): failover_vllm.detokenizer can go"
    warned = sorted(e["instance"] for e in logs if e["event"] == "vllm_leaks_prompt_on_cut")
    assert warned == ["cut", "direct"]
