"""After a failover the replacement is asked for only once the requests it broke have resumed: a
starting engine competes with the new primary for the same cores (or GPU), and started at once it
stalled exactly the clients the failover had just interrupted (bench/failover.py, issue 15)."""

from __future__ import annotations

import signal

import pytest

from router.config import RouterConfig
from router_helpers import KillLauncher, counter, kill, running_router, start_engines, under_load, wait_for

pytestmark = pytest.mark.asyncio


class SettleLauncher(KillLauncher):
    """Records, at each request_standby, how many requests were still recovering from the failover."""

    def __init__(self, engines) -> None:
        super().__init__(engines)
        self.router = None
        self.recovering_at_request: list[int] = []

    async def request_standby(self, service: str) -> None:
        self.recovering_at_request.append(self.router.services[service].recovering)
        await super().request_standby(service)


async def test_the_replacement_is_requested_after_the_broken_requests_resumed(procs, tiny_model):
    engines = start_engines(procs, tiny_model, ["eng-a", "eng-b"])
    a, b = engines
    launcher = SettleLauncher(engines)
    # a generous bound, so that on a loaded machine the wait ends by settling, not by the timeout
    config = RouterConfig(port=0, replace_settle_timeout=60.0)
    async with running_router(config, launcher, primary=a, standbys=[b]) as router:
        launcher.router = router
        svc = router.services["tiny"]
        c, ref, load = await under_load(router, 8)
        await load.until(8)
        await load.streaming(2)
        kill(a.proc, signal.SIGKILL)
        a.proc.wait(5)
        router.instance_exited("eng-a", a.proc.returncode)  # the supervisor's exit notice
        await wait_for(lambda: launcher.standby_requests, timeout=60, what="request_standby")
        done = len(load.outcomes)
        await load.until(done + 8)
        await load.stop()
        await c.close()
        load.check(ref)
        broken = counter(router, "failover_router_migrations_total") + counter(router, "failover_router_retries_total")
        assert broken >= 1  # the kill did interrupt requests ...
        assert launcher.recovering_at_request == [0]  # ... and all of them had resumed first
        assert svc.recovering == 0
