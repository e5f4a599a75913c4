"""A launcher call that never returns holds nothing: the router cancels it after ``fence_timeout``,
says so with a hint at the launcher's contract, and keeps serving on the promoted standby. The
bench's first launchers awaited an engine's readiness inside ``request_standby`` and were cut so,
silently to whoever wrote them (issue 20)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import structlog

from router.config import RouterConfig
from router_helpers import KillLauncher, client, kill, running_router, start_engines, wait_for

pytestmark = pytest.mark.asyncio


class HangingLauncher(KillLauncher):
    """``request_standby`` waits for an engine that never gets ready, as a launcher must not."""

    def __init__(self, engines) -> None:
        super().__init__(engines)
        self.cancelled_after: list[float] = []

    async def request_standby(self, service: str) -> None:
        await super().request_standby(service)
        t0 = time.monotonic()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled_after.append(time.monotonic() - t0)
            raise


async def test_a_launcher_call_that_hangs_is_cancelled_logged_and_serving_goes_on(procs, tiny_model):
    engines = start_engines(procs, tiny_model, ["eng-a", "eng-b"])
    a, b = engines
    launcher = HangingLauncher(engines)
    config = RouterConfig(port=0, fence_timeout=0.5, probe_timeout=1.0, failure_threshold=3)
    with structlog.testing.capture_logs() as logs:
        async with running_router(config, launcher, primary=a, standbys=[b]) as router:
            kill(a.proc, signal.SIGKILL)
            a.proc.wait(5)
            router.instance_exited("eng-a", a.proc.returncode)
            await wait_for(lambda: launcher.cancelled_after, timeout=30, what="the hung call's cancel")
            c = client(router)
            answer = await c.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
            await c.close()
            assert answer.choices[0].text, answer
            assert router.services["tiny"].primary.name == "eng-b"
    assert launcher.standby_requests == ["tiny"]
    assert 0.4 <= launcher.cancelled_after[0] < 5.0, launcher.cancelled_after
    timeouts = [e for e in logs if e["event"] == "launcher_timeout"]
    assert [(e["action"], e["target"]) for e in timeouts] == [("request_standby", "tiny")], timeouts
    assert "under way" in timeouts[0]["hint"]
