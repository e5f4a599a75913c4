"""The router's stop ends, even when one of its steps does not: the step is logged as stuck with
every task still pending, and the rest of the stop goes on (the listener closed, the port free)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import structlog
from aiohttp import web

from conftest import free_port
from router_helpers import _ready, running_router, serve_app, tolerant


@pytest.mark.asyncio
async def test_a_stuck_stop_step_is_logged_and_the_stop_still_ends():
    app = web.Application()
    app.router.add_get("/ready", _ready)
    forever = asyncio.Event()

    async def stuck_health_stop() -> None:
        while not forever.is_set():  # ignores its cancel, as the step that held the suite's stop 300 s
            try:
                await forever.wait()
            except asyncio.CancelledError:
                continue

    async with serve_app(app, free_port()) as url:
        with structlog.testing.capture_logs() as logs:
            async with running_router(tolerant(shutdown_timeout=0.3), primary=url) as router:
                port = router.port
                router.health.stop = stuck_health_stop
                t0 = time.monotonic()
            took = time.monotonic() - t0
    stuck = [e for e in logs if e["event"] == "router_stop_step_stuck"]
    assert len(stuck) == 1 and stuck[0]["step"] == "health", logs
    assert any("stuck_health_stop" in p for p in stuck[0]["pending"]), stuck[0]["pending"]
    assert took < 3.0, f"the stop took {took:.1f} s"
    assert any(e["event"] == "router_stopped" for e in logs)
    with socket.socket() as s:  # the listener is closed: its port binds again
        s.bind(("127.0.0.1", port))
    forever.set()  # the stuck step may end now
    await asyncio.sleep(0)
