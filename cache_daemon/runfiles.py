"""The daemon's run directory: a 0700 dir with a 0600 socket and a ready file written atomically.

At start a socket left by a dead daemon is removed (with its ready file); a socket on which a live
daemon answers is refused unless ``force``. At exit both files are removed.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import structlog

from . import owned
from .errors import CacheError

log = structlog.get_logger(__name__)


class DaemonRunning(CacheError):
    """Another daemon is live on this run dir's socket."""


def prepare_run_dir(run_dir: Path) -> None:
    """A 0700 dir of ours; a symlink, a foreign owner or one others may write is refused (owned.py)."""
    owned.private_dir(run_dir)


def socket_is_live(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError as e:  # e.g. a timeout: someone holds it, count it as live
            log.warning("socket_probe_inconclusive", socket=str(path), error=str(e))
            return True
        return True


def claim(socket_path: Path, ready_path: Path, *, force: bool) -> None:
    """Remove what a dead daemon left; refuse a live one unless ``force``."""
    if socket_path.exists() or socket_path.is_symlink():
        if socket_is_live(socket_path):
            if not force:
                raise DaemonRunning(f"a daemon is already serving {socket_path}: stop it, "
                                    "use another --run-dir, or pass --force to take the socket over")
            log.warning("live_socket_taken_over", socket=str(socket_path))
        else:
            log.info("stale_socket_removed", socket=str(socket_path))
        socket_path.unlink()
    if ready_path.exists():
        log.info("stale_ready_file_removed", path=str(ready_path))
        ready_path.unlink()


def bind(socket_path: Path) -> tuple[socket.socket, int]:
    """A listening, non-blocking socket that is 0600 from the moment it exists, and its inode."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(socket_path))
    finally:
        os.umask(old)
    os.chmod(socket_path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock, socket_path.stat().st_ino


def write_ready(ready_path: Path, *, socket_path: Path, fingerprints: list[dict]) -> None:
    tmp = ready_path.with_name(ready_path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "socket": str(socket_path), "fingerprints": fingerprints}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ready_path)


def remove(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def remove_ours(socket_path: Path, socket_inode: int, ready_path: Path) -> None:
    """Remove the socket and ready file at exit unless a daemon started with --force replaced them."""
    try:
        if socket_path.stat().st_ino != socket_inode:
            log.info("socket_taken_over_not_removed", socket=str(socket_path))
            return
    except FileNotFoundError:
        pass
    remove(socket_path, ready_path)
