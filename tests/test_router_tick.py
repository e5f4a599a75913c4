"""The router's one background tick (router/looplag.py): the loop-lag timer, which also carries the
stall sampler (router/health.py), fast only while a primary has requests in flight."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from conftest import free_port
from router import looplag
from router.looplag import FAST_S, IDLE_S, TICK_S, LoopLag
from router_helpers import running_router, serve_app, tolerant, wait_for

pytestmark = pytest.mark.asyncio


async def test_the_tick_goes_fast_only_when_asked_and_still_measures_a_block():
    lag, fast, seen = LoopLag(), [False], []

    def on_tick(now: float) -> bool:
        seen.append(now)
        return fast[0]

    lag.on_tick = on_tick
    loop = asyncio.get_running_loop()
    lag.start()
    try:
        await wait_for(lambda: len(seen) >= 1, what="a slow tick")
        assert lag._handle.when() - loop.time() > FAST_S + 0.001  # asked for nothing: the idle rhythm
        fast[0] = True
        n = len(seen)
        await wait_for(lambda: len(seen) >= n + 1, what="a tick")
        assert lag._handle.when() - loop.time() <= FAST_S + 0.001
        t0 = time.monotonic()
        time.sleep(0.15)  # the loop blocked: measured at once, and by the next tick
        assert lag.lag_since(t0) >= 0.1
        n = len(seen)
        await wait_for(lambda: len(seen) >= n + 1, what="the tick after the block")
        assert lag.lag_since(t0) >= 0.1
    finally:
        await lag.stop()
    assert lag._handle is None and TICK_S > FAST_S


async def test_after_a_busy_tick_the_tick_lingers_at_its_steady_rhythm_then_idles(monkeypatch):
    # a tick that found nothing in flight, between two requests of a steady load, keeps TICK_S (the
    # stall sampler learns the streams' rhythm from its ticks); only LINGER_S without a busy tick
    # slows it to IDLE_S, an idle router's few wake-ups
    monkeypatch.setattr(looplag, "LINGER_S", 0.3)
    lag, busy, gaps = LoopLag(), [True], []
    last = [None]

    def on_tick(now: float) -> bool:
        if last[0] is not None:
            gaps.append((now - last[0], busy[0]))
        last[0] = now
        was, busy[0] = busy[0], False  # busy once, then nothing in flight
        return was

    lag.on_tick = on_tick
    lag.start()
    try:
        await wait_for(lambda: sum(1 for g, _ in gaps if g > (TICK_S + IDLE_S) / 2) >= 2, timeout=5,
                       what="two idle ticks")
    finally:
        await lag.stop()
    seen = [g for g, _ in gaps]
    assert seen[0] < TICK_S / 2 + FAST_S  # right after the busy tick: FAST_S
    lingering = [g for g in seen[1:] if g < (TICK_S + IDLE_S) / 2]
    idle = [g for g in seen[1:] if g >= (TICK_S + IDLE_S) / 2]
    assert len(lingering) >= 5 and all(g >= TICK_S * 0.9 for g in lingering)  # ~0.3 s at TICK_S
    assert all(g >= IDLE_S * 0.9 for g in idle)
    first_idle = seen.index(idle[0])
    assert all(g < (TICK_S + IDLE_S) / 2 for g in seen[1:first_idle])  # no idle tick within the linger


async def test_a_request_wakes_an_idle_tick_without_a_false_lag(monkeypatch):
    monkeypatch.setattr(looplag, "LINGER_S", 0.05)
    lag, ticks = LoopLag(), []
    lag.on_tick = lambda now: ticks.append(now) and False
    loop = asyncio.get_running_loop()
    lag.start()
    try:
        await wait_for(lambda: lag._handle.when() - loop.time() > TICK_S, timeout=3, what="the idle rhythm")
        lag.wake()  # a request begins
        woke = time.monotonic()
        assert lag._handle.when() - loop.time() <= FAST_S + 0.001
        n = len(ticks)
        await wait_for(lambda: len(ticks) > n, timeout=1, what="the woken tick")
        assert ticks[n] - woke < FAST_S + 0.05
        assert lag.lag_since(woke - 0.001) < 0.05  # the early tick is not read as a late one
        lag.wake()  # not idle now: nothing moves
        assert lag._handle.when() - loop.time() > FAST_S + 0.001
    finally:
        await lag.stop()


def slow_app(delay: float) -> web.Application:
    async def ready(_):
        return web.json_response({"ready": True})

    async def completions(_):
        await asyncio.sleep(delay)
        return web.json_response({"id": "c", "object": "text_completion", "created": 1, "model": "tiny",
                                  "choices": [{"index": 0, "text": "x", "token_ids": [1], "finish_reason": "length"}]})

    app = web.Application()
    app.add_routes([web.get("/ready", ready), web.post("/v1/completions", completions)])
    return app


async def test_the_sampler_rides_on_the_lag_timer_and_sleeps_while_nothing_is_in_flight():
    async with serve_app(slow_app(0.4), free_port()) as url:
        async with running_router(tolerant(), primary=url) as router:
            await wait_for(lambda: router.services["tiny"].routable() is not None, what="primary ready")
            names = {t.get_name() for t in asyncio.all_tasks()}
            assert "stream-stall" not in names and "loop-lag" not in names  # no task of their own
            sampler = router.lag.on_tick
            assert sampler == router.health._stall_tick
            answers: list[bool] = []

            def record(now: float) -> bool:
                busy = sampler(now)
                answers.append(busy)
                return busy

            router.lag.on_tick = record
            await asyncio.sleep(0.1)
            assert answers and not any(answers)  # idle: the 20 ms rhythm
            del answers[:]
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{router.port}/v1/completions",
                                  json={"model": "tiny", "prompt": "a", "max_tokens": 1}) as r:
                    assert r.status == 200 and (await r.json())["choices"][0]["token_ids"] == [1]
            assert any(answers)  # a request in flight: the fast rhythm
            await asyncio.sleep(0.1)
            assert not answers[-1]  # and back to sleep after it
            router.lag.on_tick = sampler
