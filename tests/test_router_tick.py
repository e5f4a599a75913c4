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
    # slows it to IDLE_S, an idle router's few wake-ups. Read from the rhythm each tick chose (its
    # next timer's interval), not from the gaps, which a loaded machine stretches.
    monkeypatch.setattr(looplag, "LINGER_S", 0.3)
    lag, busy, chosen = LoopLag(), [True], []  # (tick time, interval chosen by that tick)
    loop = asyncio.get_running_loop()

    def on_tick(now: float) -> bool:
        loop.call_soon(lambda: chosen.append((now, lag._interval)))  # after _tick has chosen
        was, busy[0] = busy[0], False  # busy once, then nothing in flight
        return was

    lag.on_tick = on_tick
    lag.start()
    try:
        await wait_for(lambda: sum(1 for _, i in chosen if i == IDLE_S) >= 2, timeout=5, what="two idle ticks")
    finally:
        await lag.stop()
    busy_at, first = chosen[0]
    assert first == FAST_S  # the busy tick
    rhythms = [i for _, i in chosen[1:]]
    k = rhythms.index(IDLE_S)
    assert k >= 1 and set(rhythms[:k]) == {TICK_S} and set(rhythms[k:]) == {IDLE_S}
    assert all(t - busy_at < looplag.LINGER_S for t, _ in chosen[1:k + 1])  # lingered for LINGER_S
    assert chosen[k + 1][0] - busy_at >= looplag.LINGER_S  # then idled


async def test_a_request_wakes_an_idle_tick_and_a_block_after_it_is_measured_in_full():
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
        time.sleep(0.15)  # noqa: ASYNC251 - the loop blocks right after the wake: measured in full,
        # against the woken tick's time (against the idle one's, most of it would hide in IDLE_S)
        await wait_for(lambda: len(ticks) > n, timeout=1, what="the woken tick")
        assert lag.lag_since(woke) >= 0.12
        pending = lag._handle
        lag.wake()  # lingering now (the wake began it): nothing moves
        assert lag._handle is pending and lag._interval == TICK_S
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
