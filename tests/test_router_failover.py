"""Two real engines behind the router; the primary dies (SIGKILL) or hangs (SIGSTOP) under load."""

from __future__ import annotations

import asyncio
import signal

import pytest

from router import states
from router.config import RouterConfig
from router_helpers import (KillLauncher, client, counter, kill, reference, running_router, start_engines,
                            under_load, wait_for)

pytestmark = pytest.mark.asyncio


@pytest.fixture
def engines(procs, tiny_model):
    return start_engines(procs, tiny_model, ["eng-a", "eng-b"])


async def test_sigkill_primary_under_load_loses_nothing(engines):
    """No exit notice here: the router sees the crash itself (reset streams, refused connects)."""
    a, b = engines
    launcher = KillLauncher(engines)
    async with running_router(RouterConfig(port=0), launcher, primary=a, standbys=[b]) as router:
        c, ref, load = await under_load(router, 8)
        await load.until(8)
        await load.streaming(2)
        kill(a.proc, signal.SIGKILL)
        await wait_for(lambda: router.services["tiny"].primary is router.services["tiny"].instances["eng-b"],
                       what="promotion of eng-b")
        done = len(load.outcomes)
        await load.until(done + 12)
        await load.stop()
        await c.close()
        load.check(ref)
        inst = router.services["tiny"].instances
        assert inst["eng-a"].role == states.RELAUNCHING and inst["eng-a"].fenced
        assert inst["eng-b"].role == states.PRIMARY
        assert launcher.fenced == ["eng-a"] and launcher.standby_requests == ["tiny"]
        assert router.promoter.last_failover["tiny"]["new"] == "eng-b"
        assert any(o.stream for o in load.outcomes) and any(not o.stream for o in load.outcomes)
        # the kill caught streams under way (load.streaming), so some were migrated, not retried
        assert counter(router, "failover_router_migrations_total") >= 1


async def test_exit_notice_switches_before_any_request_fails(engines):
    """The supervisor's path: instance_exited() switches at once, even with no traffic to notice."""
    a, b = engines
    async with running_router(RouterConfig(port=0), KillLauncher(engines), primary=a, standbys=[b]) as router:
        svc = router.services["tiny"]
        await wait_for(lambda: svc.routable() is not None and svc.instances["eng-b"].ready, what="ready")
        kill(a.proc, signal.SIGKILL)
        a.proc.wait(5)
        router.instance_exited("eng-a", a.proc.returncode)
        assert svc.primary is svc.instances["eng-b"]  # synchronous: no await between notice and switch
        c = client(router)
        ref = await reference(c, prompts=["Hello, world!"])
        assert ref["Hello, world!"].token_ids
        await c.close()
        assert router.promoter.last_failover["tiny"]["reason"] == "exited"


@pytest.mark.parametrize("launcher_kind", ["supervised", "standalone"])
async def test_sigstop_primary_is_promoted_away_by_the_probe(engines, launcher_kind):
    """A hung primary accepts connections but answers nothing: only the active probe can tell.

    Standalone, nobody kills the hung engine: the requests stuck on it must still be aborted by
    the router's fencing and retried or migrated, and it is never routed to again.
    """
    a, b = engines
    launcher = KillLauncher(engines) if launcher_kind == "supervised" else None
    try:
        async with running_router(RouterConfig(port=0), launcher, primary=a, standbys=[b]) as router:
            c, ref, load = await under_load(router, 4)
            await load.until(4)
            svc = router.services["tiny"]
            await load.streaming(1)
            kill(a.proc, signal.SIGSTOP)
            # what the engine wrote before it froze reaches the clients; a stream still under way
            # after that can only go on elsewhere (CI once froze an engine that had sent a stream's
            # last tokens already: it finished with no migration)
            await asyncio.sleep(0.1)
            caught = len(load.midstream)
            await wait_for(lambda: svc.primary is svc.instances["eng-b"], timeout=10, what="promotion")
            done = len(load.outcomes)
            await load.until(done + 6)
            await load.stop()
            await c.close()
            load.check(ref)
            assert router.promoter.last_failover["tiny"]["reason"] in ("probe", "hang")  # hang: its streams stalled too
            if launcher is not None:
                assert launcher.fenced == ["eng-a"]
            else:
                assert a.proc.poll() is None  # still there, hung: only the router's fencing saved us
                assert svc.instances["eng-a"].role == states.STOPPED
            assert svc.instances["eng-a"].inflight == 0
            if caught:  # the stream caught by the hang went on elsewhere
                assert counter(router, "failover_router_migrations_total") >= 1
    finally:
        kill(a.proc, signal.SIGCONT)
        kill(a.proc, signal.SIGKILL)
