"""Helpers for the cache daemon tests: start/stop a real daemon, run attach in child processes,
speak raw frames, and check that nothing (process, socket, memfd) is left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import subprocess
import sys
import time
from pathlib import Path

from cache_daemon import framing
from cache_daemon.protocol import PROTOCOL_VERSION, Hello

CHILD = str(Path(__file__).with_name("cache_child.py"))
READY_TIMEOUT_S = 60


def start_daemon(procs, model: Path, run_dir: Path, *args: str, wait: bool = True, **popen) -> subprocess.Popen:
    """A real daemon process; ``popen`` goes to Popen (e.g. ``preexec_fn`` to lower an rlimit)."""
    proc = procs.python("-m", "cache_daemon", "--model", str(model), "--run-dir", str(run_dir),
                        "--log-level", "warning", *args, stderr=subprocess.PIPE, text=True, **popen)
    if wait:
        wait_ready(proc, run_dir)
    return proc


def wait_ready(proc: subprocess.Popen, run_dir: Path) -> dict:
    ready = run_dir / "daemon.ready"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready.exists():
            content = json.loads(ready.read_text())
            if content["pid"] == proc.pid:  # not a stale file of a killed daemon
                return content
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited {proc.returncode}: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("daemon not ready in time")


def stop_daemon(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> tuple[int, str]:
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err

@contextlib.contextmanager
def running_daemon(model: Path, *args: str):
    """A module-scoped daemon for ``model`` in its own run dir: yields its socket; stops and cleans up."""
    from conftest import Procs

    run_dir = Path(tempfile.mkdtemp(prefix="fo-", dir="/tmp"))
    procs = Procs()
    try:
        proc = start_daemon(procs, model, run_dir, *args)
        yield run_dir / "daemon.sock"
        stop_daemon(proc)
    finally:
        procs.stop_all()
        shutil.rmtree(run_dir, ignore_errors=True)



def child(procs, mode: str, sock: Path, model: Path, *, tp: int = 1, ranks=(0,), dtype: str = "float32",
          transform: str = "none", device: str = "cpu", **kw) -> subprocess.Popen:
    args = [CHILD, mode, str(sock), str(model), dtype, str(tp), ",".join(map(str, ranks)), transform, device]
    return procs.python(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE,
                        text=True, **kw)


def raw_connect(sock_path: Path, *, hello: bool = True, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(sock_path))
    if hello:
        framing.send_frame(s, Hello(PROTOCOL_VERSION, "test"))
        framing.recv_frame(s)
    return s


def arena_fds(pid: int | str = "self") -> list[str]:
    """The memfd arenas a process holds open (fds, not mappings)."""
    out = []
    base = Path(f"/proc/{pid}/fd")
    for fd in base.iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:
            continue
        if "failover-arena" in target:
            out.append(target)
    return out


def arena_mappings(pid: int | str = "self") -> list[str]:
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "failover-arena" in line]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie child of ours counts as gone once reaped by its Popen
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def python() -> str:
    return sys.executable
