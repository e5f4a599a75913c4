"""How the supervisor starts engine processes: a fork of the zygote (fast) or a cold spawn (fallback).

``Zygote`` owns the zygote process and the socketpair to it. Fork requests are answered in order, one
at a time; if the zygote dies, the next request restarts it (and the supervisor restarts it at once,
so the next request does not pay for ``import torch``). ``spawn_cold`` runs ``python -m failover
engine ...`` in a fresh interpreter: the comparison path in bench/relaunch.py, and the fallback when
the zygote cannot be started.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from typing import Callable

import structlog

from failover.procs import child as processes
from failover.procs.child import Child
from failover.procs.zygote import MAX_FRAME, Failed, Fork, Forked, Hello, Ping, Pong, decode, encode
from failover_common import frames

log = structlog.get_logger(__name__)


class ZygoteError(RuntimeError):
    pass


class Zygote:
    """The supervisor's handle on its zygote; ``fork()`` returns a watched ``Child``."""

    def __init__(self, *, preload: str = "torch,engine.cli,engine.serve,cache_daemon.client", env: dict[str, str] | None = None,
                 parent_pid: int | None = None, on_exit: Callable[[Child], None] | None = None,
                 stdout=None, device: str = "cpu", reply_timeout: float = 30.0) -> None:
        self.preload, self.env, self.stdout, self.device = preload, env, stdout, device
        # a fork or a ping is answered in milliseconds: a zygote silent this long is hung
        self.reply_timeout = reply_timeout
        self.parent_pid = os.getpid() if parent_pid is None else parent_pid
        self.on_exit = on_exit
        self.child: Child | None = None
        self.hello: Hello | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._ids = 0
        self.restarts = -1

    @property
    def alive(self) -> bool:
        return self.child is not None and self.child.alive

    @property
    def ready(self) -> bool:
        """Alive and past its Hello: a fork now is not stuck behind a (re)start's imports."""
        return self.alive and self.hello is not None

    async def start(self, timeout: float = 120.0) -> Hello:
        """Start the zygote and wait for its Hello (it has imported torch and the engine)."""
        self.hello = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            args = [sys.executable, "-m", "failover.procs.zygote", "--fd", str(theirs.fileno()),
                    "--preload", self.preload, "--device", self.device]
            self.child = processes.spawn("zygote", args, env=self.env, on_exit=self._exited,
                                         pass_fds=(theirs.fileno(),), stdout=self.stdout)
        finally:
            theirs.close()
        self.restarts += 1
        self._reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        try:
            msg = await asyncio.wait_for(self._read(), timeout)
        except (asyncio.TimeoutError, frames.FrameError) as e:
            await self.stop()
            raise ZygoteError(f"the zygote did not come up ({type(e).__name__}); see its log above") from None
        assert isinstance(msg, Hello), msg
        self.hello = msg
        log.info("zygote_ready", pid=msg.pid, import_s=round(msg.import_s, 3), preload=msg.preload)
        return msg

    def _exited(self, child: Child) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.on_exit is not None:
            self.on_exit(child)

    async def _read(self):
        assert self._reader is not None
        return decode(await frames.read_stream(self._reader, max_size=MAX_FRAME))

    async def ensure(self) -> None:
        """Start the zygote unless it runs (after a crash: at once, so forks stay fast)."""
        async with self._lock:
            if not self.alive:
                await self.start()

    async def fork(self, name: str, argv: list[str], *, target: str = "engine.cli:main",
                   env: dict[str, str] | None = None,
                   on_exit: Callable[[Child], None] | None = None, timeout: float | None = None) -> Child:
        """Fork ``target(argv)`` as ``name``; the returned Child is watched from this instant.
        No answer within ``timeout`` (default ``reply_timeout``): the zygote is killed, ZygoteError."""
        timeout = self.reply_timeout if timeout is None else timeout
        async with self._lock:
            if not self.alive:
                await self.start()
            self._ids += 1
            req = Fork(id=self._ids, name=name, argv=argv, target=target, parent_pid=self.parent_pid,
                       env=env or {})
            assert self._writer is not None
            t0 = time.perf_counter()
            try:
                self._writer.write(encode(req))
                await self._writer.drain()
                reply = await asyncio.wait_for(self._read(), timeout)
            except (ConnectionError, frames.FrameError, asyncio.TimeoutError) as e:
                self._resync()
                raise ZygoteError(f"the zygote failed while forking {name}: {type(e).__name__}") from None
            if isinstance(reply, Failed):
                raise ZygoteError(f"the zygote could not fork {name}: {reply.message}")
            if not isinstance(reply, Forked) or reply.id != req.id:
                self._resync()
                raise ZygoteError(f"the zygote answered {reply!r} to fork #{req.id}")
        log.info("process_forked", process_name=name, pid=reply.pid, fork_ms=round((time.perf_counter() - t0) * 1e3, 2))
        return processes.watch(name, reply.pid, on_exit=on_exit)

    async def ping(self, timeout: float) -> bool:
        """True when the zygote answers a Ping within ``timeout`` (or is busy with a fork, which has
        its own deadline); False when it is silent or its socket is gone."""
        if self._lock.locked() or not self.ready:
            return True
        async with self._lock:
            if self._writer is None:
                return False
            self._ids += 1
            try:
                self._writer.write(encode(Ping(id=self._ids)))
                await self._writer.drain()
                reply = await asyncio.wait_for(self._read(), timeout)
            except (ConnectionError, frames.FrameError, asyncio.TimeoutError):
                return False  # the stream is out of step now: the caller kills the zygote
            return isinstance(reply, Pong) and reply.id == self._ids

    def _resync(self) -> None:
        """A late or missing answer leaves the stream out of step: kill it; the next fork restarts it."""
        if self.child is not None:
            self.child.send(signal.SIGKILL)

    async def stop(self, timeout: float = 5.0) -> None:
        if self._writer is not None:
            self._writer.close()  # EOF: the zygote leaves its loop and exits 0
            self._writer = None
        if self.child is not None:
            try:
                await self.child.wait(timeout)
            except asyncio.TimeoutError:
                await self.child.stop(timeout)


def spawn_cold(name: str, argv: list[str], *, env: dict[str, str] | None = None,
               on_exit: Callable[[Child], None] | None = None, stdout=None) -> Child:
    """A fresh interpreter running ``failover engine ARGV`` (pays for ``import torch``)."""
    args = [sys.executable, "-m", "failover", "engine", *argv]
    return processes.spawn(name, args, env=env, on_exit=on_exit, stdout=stdout)
