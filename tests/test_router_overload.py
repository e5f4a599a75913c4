"""Overload is not death: a burst of requests, or a stall of the router's own event loop, must
never make the router fence a healthy engine (issue 15's red-team findings).

Real engines behind an in-process router with the standalone defaults (probe 0.25 s, threshold 2);
the KillLauncher records every fence, so ``launcher.fenced == []`` is the claim.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from router import states
from router.config import RouterConfig
from router_helpers import (KillLauncher, client, counter, kill, reference, running_router, start_engines,
                            wait_for)

pytestmark = pytest.mark.asyncio

BURST = 2000  # the red-team figure; ~10-20 s on a 2-core machine with two tiny engines
BURST_CLIENT = str(Path(__file__).with_name("burst_client.py"))


@pytest.fixture
def engines(procs, tiny_model):
    return start_engines(procs, tiny_model, ["eng-a", "eng-b"])


async def _both_ready(router) -> None:
    svc = router.services["tiny"]
    await wait_for(lambda: svc.routable() is not None and svc.instances["eng-b"].serving_ready,
                   timeout=20, what="primary and standby ready")


def _roles(router) -> dict[str, str]:
    return {name: inst.role for name, inst in router.services["tiny"].instances.items()}


async def test_a_burst_of_2000_requests_fences_no_engine(engines, procs):
    a, b = engines
    launcher = KillLauncher(engines)
    async with running_router(RouterConfig(port=0), launcher, primary=a, standbys=[b]) as router:
        await _both_ready(router)
        burst = procs.python(BURST_CLIENT, router.url, str(BURST), "4", stdout=subprocess.PIPE, text=True)
        out, _ = await asyncio.to_thread(burst.communicate, timeout=180)
        result = json.loads(out)
        statuses = result["statuses"]
        assert launcher.fenced == [], f"a healthy engine was fenced: {launcher.fenced}; {result}"
        assert _roles(router) == {"eng-a": states.PRIMARY, "eng-b": states.STANDBY}, result
        assert counter(router, "failover_router_failovers_total") == 0, result
        # every request completed or was told to come back later, and when
        assert set(statuses) <= {"200", "503"}, result
        assert sum(statuses.values()) == BURST and statuses.get("200", 0) > 0, result
        assert result["no_retry_after"] == 0, result
        print(f"burst of {BURST}: {statuses}, saturated={counter(router, 'failover_router_saturated_total')}")
        # and the service is still whole afterwards
        c = client(router)
        assert (await reference(c, prompts=["Hello, world!"]))["Hello, world!"].token_ids
        await c.close()


async def test_a_one_second_stall_of_the_routers_loop_fences_nothing(engines):
    """Two probes of each instance in flight, then the loop blocks 1 s (as aiohttp's on-loop inflate
    of a 1 MB gzip body did): every one of them times out, on our clock, not the engines'."""
    a, b = engines
    launcher = KillLauncher(engines)
    async with running_router(RouterConfig(port=0), launcher, primary=a, standbys=[b]) as router:
        await _both_ready(router)
        insts = router.services["tiny"].instances
        for _ in range(3):
            for inst in (insts["eng-a"], insts["eng-b"]) * 2:  # failure_threshold (2) probes each
                router.health.confirm(inst)
            await asyncio.sleep(0)  # they start: their timeouts run from now
            time.sleep(1.0)  # noqa: ASYNC251 - the point: the router's own loop stalls 1 s
            await asyncio.sleep(1.0)  # their verdicts arrive; healthy engines answer the next probes
        assert launcher.fenced == []
        assert _roles(router) == {"eng-a": states.PRIMARY, "eng-b": states.STANDBY}
        assert counter(router, "failover_router_failovers_total") == 0
        assert counter(router, "failover_router_probes_discounted_total") >= 4  # they did time out
        c = client(router)
        assert (await reference(c, prompts=["Hello, world!"]))["Hello, world!"].token_ids
        await c.close()


async def test_the_last_ready_instance_is_not_fenced_for_being_slow_until_a_standby_is_ready(engines):
    """A primary whose probes time out (SIGSTOP: slow or hung, nobody can tell yet) with no standby
    is kept: fencing it would leave nothing. Once a standby is ready, it is failed over at once."""
    a, b = engines
    launcher = KillLauncher(engines)
    async with running_router(RouterConfig(port=0), launcher, primary=a) as router:
        svc = router.services["tiny"]
        await wait_for(lambda: svc.routable() is not None, timeout=20, what="primary ready")
        kill(a.proc, signal.SIGSTOP)
        try:
            await wait_for(lambda: svc.instances["eng-a"].failures >= 4, timeout=10, what="probe timeouts")
            assert launcher.fenced == [] and svc.instances["eng-a"].role == states.PRIMARY
            router.add_instance("tiny", b.name, b.url, "standby", b.proc.pid)
            await wait_for(lambda: svc.primary is svc.instances["eng-b"], timeout=10, what="failover to eng-b")
            assert launcher.fenced == ["eng-a"]
        finally:
            kill(a.proc, signal.SIGCONT)
        c = client(router)
        assert (await reference(c, prompts=["Hello, world!"]))["Hello, world!"].token_ids
        await c.close()
