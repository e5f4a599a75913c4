"""failover.procs.tree: a process tree watched and ended as one, and what it leaves in /dev/shm removed.

The tree is real (tests/tree_child.py: multiprocessing with the spawn context, a resource tracker,
shared-memory segments and semaphores, as vLLM's server makes them), started and watched as the
supervisor does it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from failover.procs import child as processes
from failover.procs.tree import TreeChild, group_members, mapped_shm, private_tmp, spawn_tree
from failover_common.proc import become_subreaper

HERE = Path(__file__).resolve().parent


def _shm() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(("psm_", "sem.mp-"))}


async def _start(out: Path, run_dir: Path) -> TreeChild:
    with open(out, "wb") as f:
        child = spawn_tree("tree", [sys.executable, str(HERE / "tree_child.py")], run_dir=run_dir,
                           env=dict(os.environ), stdout=f)
    deadline = time.monotonic() + 60
    while b"ready" not in out.read_bytes():
        assert child.alive and time.monotonic() < deadline, out.read_text()
        await asyncio.sleep(0.05)
    child.scan()
    return child


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["kill -9 of the leader", "stop (TERM, then KILL)"])
async def test_a_process_tree_ends_as_one_and_leaves_no_shared_memory(tmp_path, run_dir, how):
    become_subreaper()  # as the supervisor: the orphaned members are re-parented to us
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGCHLD, processes.reap_orphans)
    before = _shm()
    try:
        child = await _start(tmp_path / "out", run_dir)
        assert child.tmpdir == run_dir / "tree.tmp" and child.tmpdir.stat().st_mode & 0o777 == 0o700
        left_in_tmp = sorted(p.name for p in child.tmpdir.iterdir())
        assert len(left_in_tmp) == 4 and sum(n.endswith(".sock") for n in left_in_tmp) == 2, left_in_tmp
        members = group_members(child.pid)
        assert len(members) >= 4, members  # leader, tracker, two workers
        mapped = set().union(*(mapped_shm(p) for p in members))
        assert any("psm_" in f for f in mapped), mapped
        t0 = time.monotonic()
        if how.startswith("kill"):
            os.kill(child.pid, signal.SIGKILL)
            await child.wait(15)
        else:
            await child.stop(0.5)
        elapsed = time.monotonic() - t0
        assert not child.alive
        assert group_members(child.pgid) == [], "a process of the tree outlived it"
        assert _shm() - before == set(), f"left in /dev/shm: {_shm() - before}"
        assert not child.tmpdir.exists() and child.tmp_removed == 4, f"the tree's temp dir: {left_in_tmp}"
        assert elapsed < 5.0, f"the tree took {elapsed:.1f} s to end"
    finally:
        if "child" in locals() and child.alive:  # a failed assertion: end it as the supervisor would,
            child.send(signal.SIGKILL)  # the tracker spared, so its shared memory is removed too
            await asyncio.wait([asyncio.ensure_future(child.wait())], timeout=15)
        loop.remove_signal_handler(signal.SIGCHLD)
        for p in group_members(child.pgid) if "child" in locals() else []:
            os.kill(p, signal.SIGKILL)


def test_a_tree_temp_dir_is_in_the_run_dir_when_a_socket_path_in_it_fits(run_dir):
    stale = run_dir / "chat-0.tmp"
    stale.mkdir()
    (stale / "old.sock").write_bytes(b"")  # a dead predecessor's, its supervisor SIGKILLed
    fresh = private_tmp(run_dir, "chat-0")
    assert fresh == stale and list(fresh.iterdir()) == [] and fresh.stat().st_mode & 0o777 == 0o700
    deep = run_dir / ("d" * 60)
    deep.mkdir()
    elsewhere = private_tmp(deep, "chat-0")
    try:
        assert elsewhere.parent == Path(tempfile.gettempdir()) and elsewhere.name.startswith("failover-chat-0-")
        assert len(f"{elsewhere}/{uuid.uuid4()}".encode()) <= 107  # vLLM's ZMQ ipc path fits sun_path
        assert elsewhere.stat().st_mode & 0o777 == 0o700
    finally:
        elsewhere.rmdir()


@pytest.mark.asyncio
async def test_a_tree_given_a_temp_dir_of_the_operators_keeps_it(tmp_path, run_dir):
    become_subreaper()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGCHLD, processes.reap_orphans)
    theirs = run_dir / "theirs"
    theirs.mkdir()
    try:
        with open(tmp_path / "out", "wb") as f:
            child = spawn_tree("tree", [sys.executable, str(HERE / "tree_child.py")], run_dir=run_dir,
                               env=dict(os.environ, TMPDIR=str(theirs)), own_tmp=False, stdout=f)
        deadline = time.monotonic() + 60
        while b"ready" not in (tmp_path / "out").read_bytes():
            assert child.alive and time.monotonic() < deadline
            await asyncio.sleep(0.05)
        child.scan()
        assert child.tmpdir is None and not (run_dir / "tree.tmp").exists()
        assert len(list(theirs.iterdir())) == 4
        await child.stop(0.5)
        assert len(list(theirs.iterdir())) == 4, "the operator's temp dir was emptied"
    finally:
        if child.alive:
            child.send(signal.SIGKILL)
            await asyncio.wait([asyncio.ensure_future(child.wait())], timeout=15)
        loop.remove_signal_handler(signal.SIGCHLD)
