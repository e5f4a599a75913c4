"""A pool resize waits for the step that serves what arrived with it: a promoted standby is asked to
grow as the streams it takes over arrive, and that growth (GiBs of KV) must not come before their
first tokens. An idle engine applies a resize on its own after ``RESIZE_QUIET_S``.

Real engine thread, real tiny model on CPU; the order is read from the engine thread's own reports
(``on_step``: one after each step, one after each resize).
"""

from __future__ import annotations

import asyncio
import time

from engine.async_engine import RESIZE_QUIET_S, AsyncEngine
from engine.protocol import GenerateRequest
from engine.sampling import SamplingParams
from engine_helpers import build_llm_engine


def _request(prompt: list[int], tokens: int) -> GenerateRequest:
    return GenerateRequest(prompt_ids=prompt, resume_ids=[], stream=True, include_usage=False, chat=False,
                           params=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))


def test_a_resize_asked_with_a_request_comes_after_the_step_that_serves_it(tiny_model):
    reports: list[tuple[int, int]] = []  # (running sequences, pool bytes), in the engine thread's order

    async def main():
        engine = AsyncEngine(lambda: build_llm_engine(tiny_model, kv_memory=256 << 10, max_batch=4),
                             on_step=lambda running, waiting, kv: reports.append((running, kv.bytes)))
        engine.start()
        try:
            # both are queued while the engine is still being built: its first drain sees both
            gen = engine.generate(_request([5, 17, 42, 99], 3))
            first = asyncio.ensure_future(gen.__anext__())
            grown = asyncio.ensure_future(engine.resize_kv(1 << 20))
            await engine.wait_ready()
            small = engine.engine.runner.kv.nbytes if not grown.done() else None
            out = await first
            usage = await grown
            async for _ in gen:
                pass
            return small, out, usage
        finally:
            engine.stop()

    small, out, usage = asyncio.run(main())
    assert out.token_ids  # the request got its first token
    assert usage.bytes > (small or 0)
    sizes = [b for _, b in reports]
    first_step = next(i for i, (running, _) in enumerate(reports) if running)
    assert sizes[first_step] == sizes[0], "the first step ran on the pool as it was"
    assert usage.bytes in sizes[first_step + 1:], "the growth came after it"


def test_an_idle_engine_applies_a_resize_after_the_quiet_time(tiny_model):
    async def main():
        engine = AsyncEngine(lambda: build_llm_engine(tiny_model, kv_memory=256 << 10, max_batch=4))
        engine.start()
        try:
            await engine.wait_ready()
            before = engine.kv_usage.bytes
            t = time.monotonic()
            usage = await asyncio.wait_for(engine.resize_kv(1 << 20), 10)
            return before, usage, time.monotonic() - t
        finally:
            engine.stop()

    before, usage, took = asyncio.run(main())
    assert usage.bytes > before
    assert took >= RESIZE_QUIET_S * 0.9
