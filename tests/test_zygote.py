"""The zygote forks engines that belong to the supervisor: exit seen at once, zygote death harmless."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from failover_common.proc import pid_alive, stat_fields

TESTS = Path(__file__).resolve().parent


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid) or _zombie(pid):
            return True
        time.sleep(0.02)
    return False


def _zombie(pid: int) -> bool:
    try:
        return stat_fields(f"/proc/{pid}/stat")[0] == b"Z"
    except FileNotFoundError:
        return True


def test_fork_exit_observed_zygote_death_survived_supervisor_death_cleans_up(procs):
    harness = procs.python(str(TESTS / "supervisor_helpers.py"), "zygote-scenario",
                           stdout=__import__("subprocess").PIPE, env={"PYTHONPATH": str(TESTS)})
    with harness.stdout:
        line = harness.stdout.readline()
    assert line, f"harness died: rc={harness.wait(5)}"
    out = json.loads(line)
    # the forked child is the supervisor's (re-parented through the double fork), named, and its
    # exit code comes back through the pidfd watch and waitpid
    assert out["quick_ppid"] == out["supervisor_pid"]
    assert out["quick_comm"] == "fo-quick"
    assert out["quick_rc"] == 3
    assert out["quick_runtime_s"] < 5.0  # it slept 0.2 s: the exit was not found by slow polling
    # killing the zygote costs no running engine; the next fork restarts it
    assert out["long_alive_after_zygote_kill"] is True
    assert out["zygote_restarts"] == 1 and out["zygote2_pid"] != out["zygote_pid"]
    assert out["again_rc"] == 5
    # a SIGKILLed supervisor takes its engine and its zygote along (PR_SET_PDEATHSIG)
    os.kill(harness.pid, signal.SIGKILL)
    harness.wait(5)
    assert wait_gone(out["long_pid"]), "engine outlived its supervisor"
    assert wait_gone(out["zygote2_pid"]), "zygote outlived its supervisor"
