"""The daemon's accept loop under an fd limit: running out of fds is a pause, never the end.

The issue's repro: ``prlimit --nofile=64:64 failover daemon``, 100 clients connect at once, then
leave. accept() fails with EMFILE while they are there; before the fix the accept task died of it,
silently, and the daemon (still alive, still "ready") never accepted again.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import time

from cache_daemon import framing
from cache_daemon.protocol import PROTOCOL_VERSION, Hello, Ping, Pong, Welcome
from cache_daemon_helpers import start_daemon, stop_daemon

FD_LIMIT = 64
CLIENTS = 100


def _low_fd_limit() -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _wait_fds(pid: int, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(os.listdir(f"/proc/{pid}/fd")) < count:
        assert time.monotonic() < deadline, f"the daemon never reached {count} open fds"
        time.sleep(0.02)


def _ping(path, nonce: int) -> object:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10.0)  # the backlog holds us until the daemon accepts: bounded, not forever
        s.connect(str(path))
        framing.send_frame(s, Hello(PROTOCOL_VERSION, "test"))
        welcome, _ = framing.recv_frame(s)
        assert isinstance(welcome, Welcome), welcome
        framing.send_frame(s, Ping(nonce))
        return framing.recv_frame(s)[0]


def test_daemon_keeps_accepting_after_running_out_of_fds(procs, run_dir, tiny_model):
    proc = start_daemon(procs, tiny_model, run_dir, preexec_fn=_low_fd_limit)
    sock_path = run_dir / "daemon.sock"
    clients = []
    try:
        for _ in range(CLIENTS):  # more than the daemon has fds for: it runs out while they wait
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock_path))
            clients.append(s)
        _wait_fds(proc.pid, FD_LIMIT)  # it took all it could and its accept() now fails with EMFILE
        time.sleep(0.3)  # several failed retries: still one log line for the burst
    finally:
        for s in clients:
            s.close()
    assert _ping(sock_path, 42) == Pong(42)
    assert _ping(sock_path, 43) == Pong(43)
    rc, err = stop_daemon(proc)
    assert rc == 0, err
    events = [json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")]
    # logged once for the burst (not once per failed retry), and its end
    assert events.count("accept_starved") == 1, err
    assert events.count("accept_recovered") == 1, err
