"""Liveness: a frozen (SIGSTOPped) cache daemon or zygote is noticed by its ping, killed and replaced;
a daemon that lost the node's model (a forced evict) is noticed by the same ping and reloads it; a
failover meanwhile still ends with a ready standby and no failed request, and a start that failed
because of the daemon is not counted against the engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import msgspec
import pytest

from cache_daemon.client import evict, status
from cache_daemon.fingerprint import CacheConfig
from failover.procs.launch import Zygote, ZygoteError
from supervisor_helpers import Load, Node, alive, wait_until

HEAL_BOUND_S = 30.0  # kill -9 of the primary -> a ready standby again, on a slow 2-core box
PING = {"ping_interval": 0.25, "ping_timeout": 1.0, "stop_timeout": 2.0}


def _thaw(pid: int | None) -> None:
    """A test that failed half-way must not leave a stopped process behind for the cleanup."""
    if pid and alive(pid):
        os.kill(pid, signal.SIGCONT)


def test_a_frozen_zygote_answers_no_ping_and_a_fork_to_it_fails_within_its_reply_timeout():
    async def scenario() -> dict:
        zygote = Zygote(preload="", reply_timeout=1.0)
        await zygote.start()
        pid = zygote.child.pid
        out = {"ping_live": await zygote.ping(1.0)}
        os.kill(pid, signal.SIGSTOP)
        try:
            out["ping_frozen"] = await zygote.ping(0.5)
            t0 = time.monotonic()
            with pytest.raises(ZygoteError, match="TimeoutError"):
                await zygote.fork("fo-never", ["0"], target="supervisor_helpers:child_main")
            out["fork_s"] = time.monotonic() - t0
            await zygote.child.wait(5)  # the late answer put the stream out of step: it was killed
            out["alive_after"] = zygote.alive
        finally:
            _thaw(pid)
            await zygote.stop(2.0)
        return out

    out = asyncio.run(scenario())
    assert out["ping_live"] is True and out["ping_frozen"] is False
    assert out["fork_s"] < 3.0, out  # its reply timeout, not the old 30 s
    assert out["alive_after"] is False


def _fault_then_kill_primary(node: Node, helper: str, fault) -> tuple[int, float]:
    """``fault(pid of helper)`` (daemon or zygote), then kill -9 the primary under load; returns the
    helper's pid and the seconds from the kill to a ready standby again."""
    primary, standby = wait_until(node.serving_pair, 30, "a ready primary and standby")
    frozen = node.status()["supervisor"][helper]["pid"]
    load = Load(node.url, workers=2)
    load.start()
    try:
        wait_until(lambda: load.total() >= 3, 30, "some traffic")
        fault(frozen)
        os.kill(primary["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: (p := node.serving_pair()) and p[1]["name"] == primary["name"]
                   and p[1]["pid"] != primary["pid"], HEAL_BOUND_S, "a ready standby again")
        healed = time.monotonic() - t0
        seen = load.total()
        wait_until(lambda: load.total() >= seen + 3, 30, "traffic after the failover")
    finally:
        load.stop()
        _thaw(frozen)
    assert load.failures == [], load.failures[:5]
    return frozen, healed


def _freeze_then_kill_primary(node: Node, helper: str) -> tuple[int, float]:
    return _fault_then_kill_primary(node, helper, lambda pid: os.kill(pid, signal.SIGSTOP))


# a start that fails for the frozen daemon must not count: one counted failure more (the kill -9
# counts one) and the service would be failed
NOT_COUNTED = PING | {"crash_loop_exits": 2, "restart_attempts": 1, "crash_loop_window": 300.0}


def test_frozen_daemon_is_killed_and_replaced_and_a_primary_kill_still_heals(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir, supervisor=NOT_COUNTED)
    try:
        frozen, healed = _freeze_then_kill_primary(n, "daemon")
        assert healed < HEAL_BOUND_S
        wait_until(lambda: not alive(frozen), 10, "the frozen daemon killed")
        d = wait_until(lambda: (d := n.status()["supervisor"]["daemon"])["ready"] and d["pid"] != frozen and d,
                       30, "a new daemon ready")
        assert d["incidents"][-1]["returncode"] == -9
        assert '"event": "daemon_hung"' in n.log() and '"silent_s"' in n.log()
        assert "not restarting it" not in n.log() and not n.status()["supervisor"]["failed"]
    finally:
        n.stop()


def test_frozen_zygote_is_killed_and_replaced_and_a_primary_kill_still_heals(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir, supervisor=PING)
    try:
        frozen, healed = _freeze_then_kill_primary(n, "zygote")
        assert healed < HEAL_BOUND_S
        wait_until(lambda: not alive(frozen), 10, "the frozen zygote killed")
        wait_until(lambda: n.status()["supervisor"]["zygote"]["pid"] not in (None, frozen), 60, "a new zygote")
        assert '"event": "zygote_hung"' in n.log() or "the zygote failed while forking" in n.log()
        assert not n.status()["supervisor"]["failed"]
    finally:
        n.stop()


def _force_evict(node: Node) -> int:
    """What any same-uid client may do: evict the node's model with ``force`` (engines map it)."""
    ready = json.loads(node.config.daemon_ready_file.read_text())
    sock = node.config.daemon_socket
    return sum(evict(sock, msgspec.convert(fp, CacheConfig), force=True) for fp in ready["fingerprints"])


def test_a_forced_evict_is_noticed_and_reloaded_and_a_primary_kill_still_heals(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir, supervisor=NOT_COUNTED)
    try:
        before = status(n.config.daemon_socket).models
        assert before and all(m.attached for m in before)
        evicted: list[int] = []
        old, healed = _fault_then_kill_primary(n, "daemon", lambda pid: evicted.append(_force_evict(n)))
        assert evicted[0] == sum(m.nbytes for m in before)
        assert healed < HEAL_BOUND_S
        # the daemon that lost the model was restarted and holds it again, with the same keys
        d = wait_until(lambda: (d := n.status()["supervisor"]["daemon"])["ready"] and d["pid"] != old and d,
                       30, "a daemon holding the model again")
        assert {m.key for m in status(n.config.daemon_socket).models} == {m.key for m in before}
        assert "model not resident" in d["incidents"][-1]["reason"]
        assert '"event": "daemon_model_lost"' in n.log()
        assert "not restarting it" not in n.log() and not n.status()["supervisor"]["failed"]
    finally:
        n.stop()
