"""Packing vLLM's layout for tensor parallelism: one packer process per rank, relayed to the daemon.

vLLM shards its parameters while it loads them (``ColumnParallelLinear`` / ``RowParallelLinear``
weight loaders read ``get_tensor_model_parallel_rank()``), so each rank's layout needs a process
that is that rank of a real tensor-parallel group, as in a vLLM instance: gloo on CPU, NCCL on CUDA
(vLLM's ``current_platform.dist_backend``). The daemon's loader child for ``--tp N`` (this module,
run by ``failover_vllm.pack``) therefore starts N children, ``python -m failover_vllm.pack ... --rank
R --dist-port P``, which rendezvous on ``tcp://127.0.0.1:P``, each load its shard with vLLM's own
loader and pack it into its own arena (one memfd or VMM allocation per rank, on ``cuda:R``).

Each rank talks to this process over a socketpair of its own, never to the daemon's channel (two
writers on one stream would interleave frames). This process forwards each ``Register`` with its fds
to the daemon and hands the daemon's ``Registered`` back, one rank at a time; progress frames are
summed over the ranks. A rank that fails (``LoadFailed``, or an exit before registering) ends the
others at once (SIGKILL: they may wait in the group's rendezvous forever) and fails the load with
that rank's reason. The ranks die with this process (PR_SET_PDEATHSIG), as it dies with the daemon.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading

import structlog

from cache_daemon import framing
from cache_daemon.errors import ProtocolError
from cache_daemon.protocol import MAX_FDS, LoadFailed, LoadProgress, Register

log = structlog.get_logger(__name__)
RANK_EXIT_TIMEOUT = 30.0  # after its registration, for a rank to tear its group down and exit


class RankFailed(RuntimeError):
    """A rank's packer failed; the message names the rank and its reason."""


def free_port() -> int:
    """A free loopback port: a tensor-parallel group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_argv(args: argparse.Namespace, rank: int, port: int, channel_fd: int) -> list[str]:
    return [sys.executable, "-m", "failover_vllm.pack", "--model", args.model, "--dtype", args.dtype,
            "--tp", str(args.tp), "--device", args.device, "--chunk-bytes", str(args.chunk_bytes),
            "--log-level", args.log_level, *(f"--engine-arg={a}" for a in args.engine_arg),
            "--rank", str(rank), "--dist-port", str(port), "--channel-fd", str(channel_fd),
            "--parent-pid", str(os.getpid())]


class Relay:
    """The frames of every rank, forwarded to the daemon's channel ``chan`` one at a time."""

    def __init__(self, chan: socket.socket, ranks: int) -> None:
        self.chan = chan
        self.lock = threading.Lock()  # one frame exchange with the daemon at a time
        self.progress = [(0, 0)] * ranks
        self.registered = [False] * ranks
        self.failure: str | None = None
        self.failed = threading.Event()

    def serve(self, rank: int, sock: socket.socket) -> None:
        """Relay rank ``rank``'s frames until it closes its end (it exited) or fails."""
        while True:
            try:
                msg, fds = framing.recv_frame(sock, max_fds=MAX_FDS)
            except (ProtocolError, OSError) as e:
                if not self.registered[rank]:
                    self.fail(rank, f"its packer exited before registering its arena ({e}; see its log)")
                return
            if isinstance(msg, LoadProgress):
                with self.lock:
                    self.progress[rank] = (msg.done, msg.total)
                    done, total = (sum(x) for x in zip(*self.progress))
                    framing.send_frame(self.chan, LoadProgress(done, total))
            elif isinstance(msg, Register) and len(fds) == msg.nfds:
                try:
                    with self.lock:
                        framing.send_frame(self.chan, msg, fds)
                        reply, _ = framing.recv_frame(self.chan)
                finally:
                    framing.close_fds(fds)
                framing.send_frame(sock, reply)
                self.registered[rank] = True
            elif isinstance(msg, LoadFailed):
                self.fail(rank, f"{msg.code}: {msg.message}")
                return
            else:
                framing.close_fds(fds)
                self.fail(rank, f"sent {type(msg).__name__} with {len(fds)} fds: a packer bug")
                return

    def fail(self, rank: int, why: str) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = f"rank {rank}: {why}"
        self.failed.set()


def pack_ranks(chan: socket.socket, args: argparse.Namespace) -> None:
    """Start one packer per rank, relay them to the daemon, wait for all; raises RankFailed."""
    port = free_port()
    relay = Relay(chan, args.tp)
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    try:
        for rank in range(args.tp):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with theirs:
                procs.append(subprocess.Popen(rank_argv(args, rank, port, theirs.fileno()),
                                              pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL))
            t = threading.Thread(target=_serve_and_close, args=(relay, rank, ours), name=f"rank-{rank}",
                                 daemon=True)
            t.start()
            threads.append(t)
        log.info("vllm_rank_packers_started", ranks=args.tp, pids=[p.pid for p in procs], dist_port=port)
        while not relay.failed.is_set() and any(t.is_alive() for t in threads):
            relay.failed.wait(0.1)
        if relay.failure is not None:
            raise RankFailed(relay.failure)
        for rank, p in enumerate(procs):
            rc = p.wait(RANK_EXIT_TIMEOUT)
            if rc != 0:
                raise RankFailed(f"rank {rank}: its packer exited with status {rc} after registering")
    finally:
        for p in procs:  # a failure: the others may wait in the group's rendezvous; never leave one behind
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
        for t in threads:
            t.join(5)


def _serve_and_close(relay: Relay, rank: int, sock: socket.socket) -> None:
    with sock:
        try:
            relay.serve(rank, sock)
        except (ProtocolError, OSError) as e:  # the daemon's channel (or the rank's, mid-reply) broke
            relay.fail(rank, f"relaying its frames failed: {e}")
