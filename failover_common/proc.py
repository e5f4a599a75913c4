"""Process helpers: prctl(2) (the parent-death signal, the process name, the subreaper) and liveness.

The one copy of PR_SET_PDEATHSIG (the supervisor's children, the zygote's engines, the daemon's
loader, the engine's tensor-parallel ranks). The kernel ties the parent-death signal to the *thread*
that forked: call :func:`die_with_parent` in a child forked from the main thread (a ``preexec_fn``,
or right after ``os.fork``), never from a worker thread's child.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def prctl(option: int, arg: int | bytes) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` when our parent dies; exit at once if it already has
    (``expected_parent`` is no longer our parent: it died before the prctl took effect)."""
    prctl(PR_SET_PDEATHSIG, int(sig))
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def set_process_name(name: str) -> None:
    """Name the process for ps/top (``comm``, 15 bytes)."""
    prctl(PR_SET_NAME, name.encode()[:15])


def become_subreaper() -> None:
    """Orphaned descendants (the zygote's double-forked engines) are re-parented to this process."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def stat_fields(path: str) -> list[bytes]:
    """A /proc stat file's fields after the command name: [0] is stat(5)'s field 3 (the state)."""
    with open(path, "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def has_capability(bit: int) -> bool:
    """Whether this process holds capability ``bit`` (capabilities(7)) in its effective set."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie: its exit leaves no process to reap."""
    try:
        return stat_fields(f"/proc/{pid}/stat")[0] not in (b"Z", b"X")
    except OSError:  # gone (ENOENT, ESRCH)
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as alive; another user's process too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
