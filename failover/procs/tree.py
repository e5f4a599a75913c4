"""A managed engine that is a process tree (vLLM: API server, ``VLLM::EngineCore``, ``VLLM::Worker``,
multiprocessing's resource tracker), watched and ended as one unit.

The leader is started in its own session (``spawn``: ``start_new_session``), so its process group id
is its pid and every child it starts inherits that group unless it calls setsid itself. A
``TreeChild`` is a ``Child`` whose SIGKILL reaches the whole group (SIGTERM goes to the leader,
which shuts its children down in order), and whose exit is the exit of the *last* process of the
group:

- the leader's pidfd turns readable (a crash, ``kill -9``, a stop): every process left in the group
  gets SIGKILL at once (the unit is dead, a headless EngineCore must not keep the memory), except
  multiprocessing's resource tracker: once the others are gone it reads EOF and unlinks every
  semaphore and shared-memory segment they registered (also those of processes that exited long
  ago, which nothing maps any more), then exits; it is killed too after ``TRACKER_GRACE``;
- the group is polled through /proc until no live (non-zombie) process is left in it; the members
  are re-parented to the supervisor (a child subreaper) and reaped by its SIGCHLD handler;
- the POSIX shared-memory files the tree had mapped (``/dev/shm/psm_*`` from multiprocessing's
  ``SharedMemory``, ``/dev/shm/sem.mp-*`` named semaphores) are unlinked: a killed tree never does
  it itself (about 400 MB for a small vLLM model on CPU). They are found in each member's
  ``/proc/PID/maps``: recorded whenever the tree is scanned (``scan()``, at ready) and once more at
  the leader's exit, with the survivors stopped (SIGSTOP) so they cannot map or unlink anything in
  between;
- the tree's private temp dir (``spawn_tree``: ``TMPDIR``, as systemd's ``PrivateTmp``) is removed
  with what it holds: vLLM leaves its ZMQ sockets and a ``vllm_dist_*`` file store in the temp dir
  on every start, and a killed tree never removes them;
- only then does the ``Child`` count as exited (``alive`` False, ``wait()`` returns, ``on_exit``
  runs): the slot's memory is free, a relaunch may start.

A process group id cannot be reused while any member (zombies too) exists, so a ``killpg`` sent
while the last scan found members cannot reach another group.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import structlog

from failover.procs import child as processes
from failover.procs.child import Child
from failover_common.proc import stat_fields

log = structlog.get_logger(__name__)

SHM_DIR = "/dev/shm/"
GROUP_GONE_TIMEOUT = 10.0  # SIGKILLed processes leave in milliseconds; one in D state may take longer
TRACKER_GRACE = 3.0  # for multiprocessing's resource tracker to clean up after the others
POLL = 0.005
UNIX_PATH_MAX = 107  # sun_path's bytes, less its NUL
SOCKET_NAME = 36  # what a tree names a socket in its temp dir: vLLM's ZMQ ipc paths are a uuid4


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is ``pgid``, from /proc/PID/stat."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(f"/proc/{entry}/stat")
        except OSError:
            continue
        # fields[0] is the state, fields[2] the process group (stat(5): fields 3 and 5)
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def is_tracker(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker (it cleans up after its peers)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def mapped_shm(pid: int) -> set[str]:
    """The /dev/shm files process ``pid`` maps or holds open."""
    paths: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                i = line.find(SHM_DIR)
                if i >= 0:
                    paths.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(SHM_DIR):
                paths.add(target.removesuffix(" (deleted)"))
    except OSError:
        pass
    return paths


def private_tmp(run_dir: Path, name: str) -> Path:
    """A new, empty 0700 temp dir for the tree ``name``: ``run_dir/NAME.tmp`` (a dead predecessor's
    removed first) when a socket path in it fits AF_UNIX's limit, else one made in the system's."""
    path = Path(run_dir) / f"{name}.tmp"
    if len(f"{path}/".encode()) + SOCKET_NAME > UNIX_PATH_MAX:
        return Path(tempfile.mkdtemp(prefix=f"failover-{name}-"))
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)
    return path


def spawn_tree(name: str, args: list[str], *, run_dir: Path, env: dict[str, str], own_tmp: bool = True,
               **kwargs) -> TreeChild:
    """``processes.spawn`` of a TreeChild whose temp dir (``TMPDIR``, over any in ``env``) is its
    own, removed with it; ``own_tmp`` False: ``env``'s, left as it is (an operator's choice)."""
    if not own_tmp:
        return processes.spawn(name, args, env=env, cls=TreeChild, **kwargs)
    tmp = private_tmp(run_dir, name)
    try:
        child = processes.spawn(name, args, env=env | {"TMPDIR": str(tmp)}, cls=TreeChild, **kwargs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    assert isinstance(child, TreeChild)
    child.tmpdir = tmp  # its end is a task of the loop (_reap_group): it cannot come before this line
    return child


class TreeChild(Child):
    """A process group led by ``pid``, as one Child (see the module docstring)."""

    def __init__(self, name: str, pid: int, **kwargs) -> None:
        self.pgid = pid
        self.shm: set[str] = set()
        self.leader_exited_at: float | None = None
        self.members_killed = 0
        self.shm_removed: list[str] = []
        self.tmpdir: Path | None = None  # spawn_tree's: removed once the tree is gone
        self.tmp_removed = 0  # files and dirs in it then
        super().__init__(name, pid, **kwargs)

    def send(self, sig: int) -> None:
        """SIGTERM/SIGINT to the leader, which stops its own children in order (vLLM's shutdown;
        whatever is left when it exits is killed then); SIGKILL to every process of the group but
        the resource tracker, which cleans up after the others (see the module docstring); any
        other signal (SIGSTOP, SIGCONT) to the whole group."""
        if not self.alive:
            return
        if sig == signal.SIGKILL:
            self._kill_members()
            return
        if self.leader_exited_at is not None:
            return  # the leader is reaped (its pid may be reused); the rest is being killed
        try:
            if sig in (signal.SIGTERM, signal.SIGINT):
                os.kill(self.pid, sig)
            else:
                os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_members(self) -> int:
        """Stop every process of the group but the tracker, note the files they map, kill them."""
        members = [p for p in group_members(self.pgid) if not is_tracker(p)]
        _kill(members, signal.SIGSTOP)  # nothing maps, forks or unlinks while we look
        for pid in members:
            self.shm |= mapped_shm(pid)
        _kill(members, signal.SIGKILL)
        return len(members)

    def scan(self) -> None:
        """Record the shared-memory files the tree maps now (cheap: /proc of its few members)."""
        for pid in group_members(self.pgid):
            self.shm |= mapped_shm(pid)

    def _leader_exited(self) -> None:
        """The leader is gone: stop the survivors, note what they map, kill them, wait, clean up."""
        self.leader_exited_at = time.monotonic()
        self.members_killed = self._kill_members()
        self._loop.create_task(self._reap_group(), name=f"tree-{self.name}")

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def _reap_group(self) -> None:
        now = time.monotonic()
        grace, deadline = now + TRACKER_GRACE, now + GROUP_GONE_TIMEOUT
        while (left := group_members(self.pgid)) and time.monotonic() < deadline:
            if time.monotonic() > grace:
                self._signal_group(signal.SIGKILL)
            else:  # the tracker may finish its cleanup; anything else (a late fork) dies now
                _kill([p for p in left if not is_tracker(p)], signal.SIGKILL)
            await asyncio.sleep(POLL)
        if left:
            log.error("process_tree_not_gone", process_name=self.name, pgid=self.pgid, pids=left,
                      hint="a process of the tree is stuck in the kernel (D state); its memory is not free yet")
        self.shm_removed = remove_shm(self.shm)
        if self.tmpdir is not None and not left:  # a stuck member may still use it
            self.tmp_removed = remove_tree(self.tmpdir)
        assert self.leader_exited_at is not None
        log.info("process_tree_gone", process_name=self.name, pgid=self.pgid, members_killed=self.members_killed,
                 shm_removed=len(self.shm_removed), tmp_removed=self.tmp_removed, after_leader_ms=round((time.monotonic() - self.leader_exited_at) * 1e3, 1))
        self._finish()


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def remove_shm(paths: set[str]) -> list[str]:
    """Unlink ``paths`` (the dead tree's /dev/shm files); returns those removed."""
    removed = []
    for path in sorted(paths):
        if not path.startswith(SHM_DIR) or "/" in path[len(SHM_DIR):]:
            continue  # only plain files of /dev/shm
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("shm_not_removed", path=path, error=str(e))
            continue
        removed.append(path)
    return removed


def remove_tree(path: Path) -> int:
    """Remove the directory ``path`` and all it holds; returns how many entries it held."""
    count = sum(len(dirs) + len(files) for _, dirs, files in os.walk(path))
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        log.warning("tmp_not_removed", path=str(path), hint="remove it by hand; nothing of the tree uses it")
    return count
