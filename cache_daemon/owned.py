"""Paths we own and trust: run dirs and result files that may sit where other users write (``/tmp``).

A machine may run with ``fs.protected_symlinks=0`` and ``fs.protected_regular=0``, so a name in a
shared directory may be a symlink or a file that another user planted before we got there. A path
counts as ours when it is not a symlink, is owned by our effective uid, is what we expect (a
directory, or a regular file with one link) and grants nobody else more than ``allowed`` (never
write). Checks are made with ``O_NOFOLLOW`` and ``fstat`` on the opened fd, so the answer is about the
object we then use, not about a name that could be swapped in between. Root gets no exception: a
file another uid owns is refused as root too.

Used by the cache daemon and the supervisor for the run dir, and by the batch service for its output.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import CacheError

GROUP_OTHER_WRITE = 0o022


class UntrustedPath(CacheError):
    """A path that another user may have planted or may change; the message says what to do."""


def _check(fd: int, path: Path, *, what: str, directory: bool, allowed: int) -> os.stat_result:
    st = os.fstat(fd)
    uid = os.geteuid()
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise UntrustedPath(f"{what} {path} is not a {'directory' if directory else 'regular file'}; "
                            "remove it or choose another path")
    if st.st_uid != uid:
        raise UntrustedPath(f"{what} {path} belongs to uid {st.st_uid}, not to us (uid {uid}): another user "
                            "may have planted it; remove it or choose another path")
    if not directory and st.st_nlink != 1:
        raise UntrustedPath(f"{what} {path} has {st.st_nlink} hard links: it may be another file under a "
                            "planted name; remove it or choose another path")
    mode = stat.S_IMODE(st.st_mode)
    if mode & GROUP_OTHER_WRITE:
        raise UntrustedPath(f"{what} {path} is writable by group or others (mode {mode:04o}): another user "
                            f"could have changed it; check it, then `chmod go-w {path}`, or remove it")
    if mode & 0o077 & ~allowed:
        raise UntrustedPath(f"{what} {path} is readable by more users than allowed (mode {mode:04o}, allowed "
                            f"{allowed:04o}): check it, then `chmod {allowed:o} {path}`, or remove it")
    return st


def _open(path: Path, flags: int, what: str, mode: int = 0o600) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        # O_NOFOLLOW on a symlink: ELOOP, or ENOTDIR when O_DIRECTORY is asked for too
        if e.errno == errno.ELOOP or e.errno == errno.ENOTDIR and os.path.islink(path):
            raise UntrustedPath(f"{what} {path} is a symbolic link: another user may have planted it; "
                                "remove it or choose another path") from None
        raise


def private_dir(path: Path, *, what: str = "run dir") -> bool:
    """Make sure ``path`` is a 0700 directory of ours; returns whether it was created now.

    A directory of ours that others may read is tightened to 0700; one that others may write, a
    symlink or a foreign owner is refused (its contents may have been planted).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # never follows a symlink in the last component: EEXIST
        created = True
    except FileExistsError:
        created = False
    try:
        fd = _open(path, os.O_RDONLY | os.O_DIRECTORY, what)
    except NotADirectoryError:
        raise UntrustedPath(f"{what} {path} exists and is not a directory; remove it or choose another path") from None
    try:
        st = _check(fd, path, what=what, directory=True, allowed=0o055)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # ours and not writable by others: only tightened
    finally:
        os.close(fd)
    return created


def check_private_dir(path: Path, *, what: str = "run dir") -> None:
    """Refuse an existing ``path`` that ``private_dir`` would refuse (nothing is created or changed)."""
    try:
        fd = _open(path, os.O_RDONLY | os.O_DIRECTORY, what)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise UntrustedPath(f"{what} {path} exists and is not a directory; remove it or choose another path") from None
    try:
        _check(fd, path, what=what, directory=True, allowed=0o055)
    finally:
        os.close(fd)


def open_private_file(path: Path, flags: int, *, mode: int = 0o600, what: str = "file") -> tuple[int, bool]:
    """Open (creating it with ``mode`` when missing) a regular file of ours: ``(fd, created)``.

    The caller owns the fd. An existing file must not grant group/others more than ``mode`` does.
    """
    assert not mode & GROUP_OTHER_WRITE, "checked where the mode is configured"
    flags &= ~(os.O_CREAT | os.O_EXCL)
    for _ in range(3):  # a file removed between the two opens: try again
        try:
            fd = _open(path, flags | os.O_CREAT | os.O_EXCL, what, mode)
            os.fchmod(fd, mode)  # the umask may have taken bits the config asked for
            return fd, True
        except FileExistsError:
            pass
        try:
            fd = _open(path, flags | os.O_NONBLOCK, what)  # O_NONBLOCK: a planted FIFO must not hang us
        except FileNotFoundError:
            continue
        try:
            _check(fd, path, what=what, directory=False, allowed=mode)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd, False
    raise UntrustedPath(f"{what} {path} keeps appearing and disappearing; is someone else using it?")


def check_private_file(path: Path, *, mode: int = 0o600, what: str = "file") -> None:
    """Refuse an existing ``path`` that ``open_private_file`` would refuse; a missing one passes."""
    try:
        fd = _open(path, os.O_RDONLY | os.O_NONBLOCK, what)
    except FileNotFoundError:
        return
    try:
        _check(fd, path, what=what, directory=False, allowed=mode)
    finally:
        os.close(fd)
