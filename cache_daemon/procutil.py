"""Small process helpers shared by the daemon and its loader child."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, expected_parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit at once if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the prctl took effect


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
