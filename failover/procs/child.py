"""Named child processes: started deliberately, watched through a pidfd, ended TERM-then-KILL.

Lifetime contract: the supervisor is a child subreaper (``become_subreaper``), so every process it
starts, and every engine the zygote double-forks for it, ends up as its child. A ``Child`` owns one
pidfd; exit is seen the instant the process dies (the pidfd turns readable in the event loop), and the
supervisor reaps it with ``waitpid``. Every child carries PR_SET_PDEATHSIG, so a SIGKILLed supervisor
leaves no orphan behind.

``Popen`` with ``preexec_fn`` must run on the event loop's (main) thread: the kernel ties the
parent-death signal to the *thread* that forked, so a child forked from a worker thread would be
killed when that thread ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import aiohttp
import structlog

from failover_common import cpus
from failover_common.proc import die_with_parent

log = structlog.get_logger(__name__)


class ChildFailed(RuntimeError):
    """A child exited, or never became ready, while we waited for it."""


class Child:
    """One named process and the instant notice of its exit.

    ``on_exit(child)`` runs in the event loop as soon as the process dies (after it is reaped, when
    it is ours). The pidfd is closed then; ``returncode`` follows subprocess's convention (negative:
    killed by that signal; None: not our child, so not reaped here).
    """

    def __init__(self, name: str, pid: int, *, popen: subprocess.Popen | None = None,
                 on_exit: Callable[["Child"], None] | None = None) -> None:
        self.name, self.pid, self.popen = name, pid, popen
        self.started = time.monotonic()
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # gone before we looked: reap and report on the next turn
            self._pidfd = None
            self._loop.call_soon(self._exited)
        else:
            self._loop.add_reader(self._pidfd, self._exited)

    @property
    def alive(self) -> bool:
        return not self._done.done()

    def _exited(self) -> None:
        if self._done.done():
            return
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self.returncode = reap(self.pid)
        if self.popen is not None:  # keeps Popen from waiting on (or warning about) a reaped pid
            self.popen.returncode = self.returncode
        self._leader_exited()

    def _leader_exited(self) -> None:
        """The process itself is gone (reaped); a process tree waits for the rest of it here
        (failover.procs.tree), then calls ``_finish``."""
        self._finish()

    def _finish(self) -> None:
        self.exited_at = time.monotonic()
        self._done.set_result(self.returncode)
        log.info("process_exited", process_name=self.name, pid=self.pid, returncode=self.returncode,
                 uptime_s=round(self.exited_at - self.started, 3))
        if self._on_exit is not None:
            self._on_exit(self)

    async def wait(self, timeout: float | None = None) -> int | None:
        return await asyncio.wait_for(asyncio.shield(self._done), timeout)

    def send(self, sig: int) -> None:
        if self.alive:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    async def stop(self, timeout: float, sig: int = signal.SIGTERM) -> int | None:
        """SIGTERM, then SIGKILL once ``timeout`` passes; returns the exit code."""
        if not self.alive:
            return self.returncode
        self.send(sig)
        try:
            return await self.wait(timeout)
        except asyncio.TimeoutError:
            log.warning("process_kill", process_name=self.name, pid=self.pid, after_s=timeout)
            self.send(signal.SIGKILL)
            return await self.wait(10.0)

    def close(self) -> None:
        """Stop watching (for shutdown paths that already know the process is gone)."""
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None


def reap(pid: int) -> int | None:
    """Collect the exit status of our child ``pid``; None when it is not our child."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status)


_WATCHED: set[int] = set()  # pids a Child watches


def reap_orphans() -> list[int]:
    """Collect exited descendants re-parented to us that nobody watches (call on SIGCHLD)."""
    reaped = []
    while True:
        try:
            # WNOWAIT first: a watched child is left for its Child to reap with its status
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None:
            return reaped
        if info.si_pid in _WATCHED:  # its Child reaps it, with its status, on its pidfd turn
            return reaped
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:  # another waiter (a subprocess.run, say) took it in between
            continue
        reaped.append(info.si_pid)


def spawn(name: str, args: list[str], *, on_exit: Callable[[Child], None] | None = None,
          env: dict[str, str] | None = None, stdout=None, stderr=None,
          deathsig: int = signal.SIGKILL, pass_fds: tuple[int, ...] = (), cls: type[Child] = Child) -> Child:
    """Start ``args`` as a named child in its own session, with PR_SET_PDEATHSIG (``cls``: a
    ``failover.procs.tree.TreeChild`` watches the whole process group). It runs on a node's
    engine CPUs (``cpus.place_node``), set in the child before exec, while it has one thread."""
    children = cpus.placed()

    def preexec() -> None:  # runs in the child between fork and exec
        die_with_parent(deathsig)
        if children is not None:
            os.sched_setaffinity(0, children)

    stderr = stdout if stderr is None else stderr  # a log file given for output takes both streams
    popen = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                             start_new_session=True, preexec_fn=preexec, close_fds=True,
                             pass_fds=pass_fds)
    log.info("process_started", process_name=name, pid=popen.pid, argv=" ".join(args[:6]))
    return watch(name, popen.pid, popen=popen, on_exit=on_exit, cls=cls)


def watch(name: str, pid: int, *, popen: subprocess.Popen | None = None,
          on_exit: Callable[[Child], None] | None = None, cls: type[Child] = Child) -> Child:
    _WATCHED.add(pid)

    def forget(child: Child) -> None:
        _WATCHED.discard(child.pid)
        if on_exit is not None:
            on_exit(child)

    return cls(name, pid, popen=popen, on_exit=forget)


async def wait_ready_file(path: Path, child: Child, timeout: float,
                          progress: Callable[[float], None] | None = None) -> dict:
    """Wait until ``path`` (a JSON ready file written atomically by ``child``, naming its ``pid``)
    exists; return it. A file that names another pid is a dead predecessor's: not ready yet."""
    deadline = time.monotonic() + timeout
    next_note = time.monotonic() + 5.0
    while True:
        try:
            info = json.loads(path.read_text())
            if info.get("pid", child.pid) == child.pid:
                return info
        except FileNotFoundError:
            pass
        except json.JSONDecodeError:  # a writer that is not atomic: try again
            pass
        if not child.alive:
            raise ChildFailed(f"{child.name} exited with code {child.returncode} before writing {path}")
        now = time.monotonic()
        if now > deadline:
            raise ChildFailed(f"{child.name} did not write {path} within {timeout:.0f} s")
        if progress is not None and now >= next_note:
            progress(now - (deadline - timeout))
            next_note = now + 5.0
        await asyncio.sleep(0.02)


async def wait_http_ready(url: str, child: Child | None, timeout: float,
                          session: aiohttp.ClientSession,
                          progress: Callable[[float], None] | None = None) -> dict:
    """Poll ``url`` (an engine's /ready) until it answers 200; fail at once if ``child`` exits."""
    start = time.monotonic()
    next_note = start + 5.0
    probe = aiohttp.ClientTimeout(total=2.0)
    while True:
        if child is not None and not child.alive:
            raise ChildFailed(f"{child.name} exited with code {child.returncode} before it was ready")
        try:
            async with session.get(url, timeout=probe) as resp:
                if resp.status == 200:
                    try:
                        return await resp.json(content_type=None)
                    except (aiohttp.ContentTypeError, json.JSONDecodeError):
                        return {}
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        now = time.monotonic()
        if now - start > timeout:
            raise ChildFailed(f"{url} was not ready within {timeout:.0f} s")
        if progress is not None and now >= next_note:
            progress(now - start)
            next_note = now + 5.0
        await asyncio.sleep(0.01)

