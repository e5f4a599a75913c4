"""A standby's CPU priority (failover.procs.priority): lowered for its whole process group, every
thread and child of it and those started later, and given back; refused by the kernel without the
right, which ``why_not`` says beforehand."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from failover.procs import priority
from failover_common.proc import has_capability
from supervisor_helpers import REPO, alive, wait_until

# an "engine": a thread now, a child process in its group, one more thread on each line of stdin
ENGINE = textwrap.dedent("""
    import os, sys, threading, time
    def idle():
        time.sleep(600)
    threading.Thread(target=idle, daemon=True).start()
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    for line in sys.stdin:
        threading.Thread(target=idle, daemon=True).start()
        print("thread", flush=True)
""")


def engine(procs) -> tuple[subprocess.Popen, int]:
    p = procs.python("-c", ENGINE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild = int(p.stdout.readline())
    wait_until(lambda: len(priority.nice_of(p.pid)) == 2, 10, "the engine's second thread")
    return p, grandchild


def test_lower_reaches_every_thread_and_child_and_new_threads_and_restore_gives_all_back(procs):
    base = priority.base()
    p, grandchild = engine(procs)
    assert priority.nice_of(p.pid) == [base, base]

    pgid, _ = priority.lower(p.pid, 7)
    assert pgid == p.pid  # it leads its own group (its own session)
    low = min(19, base + 7)
    assert priority.nice_of(p.pid) == [low, low]
    assert priority.nice_of(grandchild) == [low]

    p.stdin.write("more\n")
    p.stdin.flush()
    assert p.stdout.readline() == "thread\n"
    assert priority.nice_of(p.pid) == [low, low, low]  # a thread started while low is low

    priority.restore(pgid)
    assert priority.nice_of(p.pid) == [base, base, base]
    assert priority.nice_of(grandchild) == [base]


def test_lowering_caps_at_19_and_refuses_our_own_group(procs):
    p, _ = engine(procs)
    priority.restore(priority.lower(p.pid, 19)[0])
    pgid, _ = priority.lower(p.pid, 40)
    assert set(priority.nice_of(p.pid)) == {19}
    priority.restore(pgid)
    with pytest.raises(ValueError, match="own process group"):
        priority.lower(os.getpid(), 5)


def test_a_gone_group_is_nothing_to_restore(procs):
    p, grandchild = engine(procs)
    pgid, _ = priority.lower(p.pid, 5)
    os.killpg(pgid, 9)
    p.wait(10)
    wait_until(lambda: not alive(grandchild), 10, "the group gone")
    priority.restore(pgid)  # no error: nobody left to give it back to


# Without CAP_SYS_NICE (dropped from the bounding set before exec: root keeps no more than it), with
# a given RLIMIT_NICE: lower a child by 5, try to give it back, print why_not() and what the kernel said.
UNPRIVILEGED = textwrap.dedent("""
    import json, os, resource, subprocess, sys
    from failover.procs import priority
    why = priority.why_not()
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        pgid, _ = priority.lower(child.pid, 5)
        low = priority.nice_of(child.pid)
        try:
            priority.restore(pgid)
            restored = "ok"
        except PermissionError:
            restored = "refused"
        after = priority.nice_of(child.pid)
    finally:
        child.kill()
        child.wait()
    print(json.dumps({"why": why, "soft": soft, "low": low, "restored": restored, "after": after}))
""")
PR_CAPBSET_DROP = 24
CAP_SETPCAP, CAP_SYS_RESOURCE = 8, 24


def unprivileged(nice_limit: tuple[int, int]) -> dict:
    import json
    import resource

    from failover_common.proc import prctl

    def drop() -> None:
        resource.setrlimit(resource.RLIMIT_NICE, nice_limit)
        prctl(PR_CAPBSET_DROP, priority.CAP_SYS_NICE)

    out = subprocess.run([sys.executable, "-c", UNPRIVILEGED], capture_output=True, text=True, timeout=60,
                         cwd=REPO, preexec_fn=drop)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def can_drop_caps() -> bool:
    return has_capability(CAP_SETPCAP)  # may drop from the bounding set


def can_raise_nice_limit(to: int) -> bool:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NICE)[1]
    return hard == resource.RLIM_INFINITY or hard >= to or has_capability(CAP_SYS_RESOURCE)


@pytest.mark.skipif(not can_drop_caps(), reason="dropping CAP_SYS_NICE needs CAP_SETPCAP")
def test_without_the_right_why_not_says_so_and_the_kernel_refuses_to_give_it_back():
    r = unprivileged((0, 0))
    assert r["why"] is not None and "CAP_SYS_NICE or RLIMIT_NICE >= 20" in r["why"], r
    low = min(19, priority.base() + 5)
    assert set(r["low"]) == {low}
    assert r["restored"] == "refused" and set(r["after"]) == {low}, r


@pytest.mark.skipif(not can_drop_caps() or not can_raise_nice_limit(20),
                    reason="needs CAP_SETPCAP, and a hard RLIMIT_NICE of 20 or CAP_SYS_RESOURCE to set one")
def test_a_hard_rlimit_nice_of_20_is_enough_why_not_raises_the_soft_one():
    r = unprivileged((0, 20))
    assert r["why"] is None and r["soft"] == 20, r
    assert r["restored"] == "ok" and set(r["after"]) == {priority.base()}, r
