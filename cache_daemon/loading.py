"""The daemon's side of a load: spawn the loader child, take each rank's arena fds, end the child.

The loader gets one end of a private socketpair (never the public socket), so registrations need no
peer check. The child dies with the daemon (PR_SET_PDEATHSIG, SIGKILL); a cancelled load (daemon
shutdown) terminates it, then kills it after ``STOP_TIMEOUT_S``. Its temp dir (``TMPDIR``) is its
own, removed after it: vLLM's tensor-parallel groups put ZMQ sockets there and never remove them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
from collections.abc import Callable

import structlog

from . import framing
from .errors import ProtocolError
from .protocol import MAX_FDS, LoadFailed, LoadProgress, Register, Registered
from .residents import Registry
from .settings import DaemonSettings

log = structlog.get_logger(__name__)
STOP_TIMEOUT_S = 5.0


def loader_cmd(s: DaemonSettings, channel_fd: int) -> list[str]:
    common = ["--model", str(s.model), "--dtype", s.dtype, "--tp", str(s.tp), "--device", s.device,
              "--chunk-bytes", str(s.chunk_bytes), "--channel-fd", str(channel_fd),
              "--parent-pid", str(os.getpid()), "--log-level", s.log_level]
    if s.engine == "vllm":  # vLLM's own loading, in the interpreter that has vllm (docs/vllm.md)
        return [s.engine_python or sys.executable, "-m", "failover_vllm.pack", *common,
                *(f"--engine-arg={arg}" for arg in s.engine_args)]
    return [sys.executable, "-m", "cache_daemon.loader", *common, "--transform", s.transform]


async def run_loader(s: DaemonSettings, registry: Registry,
                     on_progress: Callable[[int, int], None] = lambda done, total: None) -> str | None:
    """Load every rank into ``registry``; None on success, else why it failed (one line).
    ``on_progress(done, total)``: bytes packed so far, as the loader reports them."""
    with tempfile.TemporaryDirectory(prefix="failover-loader-", ignore_cleanup_errors=True) as tmp:
        return await _run(s, registry, on_progress, os.environ | {"TMPDIR": tmp})


async def _run(s: DaemonSettings, registry: Registry, on_progress: Callable[[int, int], None],
               env: dict[str, str]) -> str | None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = None
    try:
        proc = await asyncio.create_subprocess_exec(*loader_cmd(s, theirs.fileno()), pass_fds=(theirs.fileno(),),
                                                    stdin=asyncio.subprocess.DEVNULL, env=env)
        theirs.close()
        ours.setblocking(False)
        log.info("loader_started", pid=proc.pid)
        failure = await _receive_ranks(ours, registry, s.tp, on_progress)
        rc = await proc.wait()
        if failure is None and rc != 0:
            failure = f"loader exited with status {rc} after registering every rank"
        return failure
    finally:
        theirs.close()
        ours.close()
        if proc is not None and proc.returncode is None:
            await _end(proc)


async def _receive_ranks(chan: socket.socket, registry: Registry, ranks: int,
                         on_progress: Callable[[int, int], None]) -> str | None:
    while len(registry) < ranks:
        try:
            msg, fds = await framing.async_recv_frame(chan, max_fds=MAX_FDS)
        except ProtocolError as e:
            return f"loader channel broke: {e} (see the loader's log above)"
        if isinstance(msg, LoadFailed):
            return f"{msg.code}: {msg.message}"
        if isinstance(msg, LoadProgress) and not fds:
            on_progress(msg.done, msg.total)
            continue
        if not isinstance(msg, Register) or len(fds) != msg.nfds or msg.nfds != msg.manifest.nfds:
            framing.close_fds(fds)
            return f"loader sent {type(msg).__name__} with {len(fds)} fds: a loader bug"
        registry.add(msg.config, msg.manifest, fds)
        log.info("rank_registered", rank=msg.config.tp_rank, key=msg.config.key, bytes=msg.manifest.nbytes,
                 fds=len(fds))
        await framing.async_send_frame(chan, Registered())
    return None


async def _end(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
