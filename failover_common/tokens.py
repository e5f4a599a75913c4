"""Bearer tokens: the file they live in, and the constant-time check of a request's header.

:func:`read_token` refuses a file that anyone but this user (or root) could have written or that
another user can read; the router's admin token and the engines' token use this one check.
"""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path


class TokenFileError(ValueError):
    """The token file is missing, empty, readable by others or owned by another user."""


def read_token(path: Path) -> bytes:
    """The bearer token in ``path``, refused unless only this user (or root) could have written it
    and no other user can read it.

    Accepted: a regular file owned by this user or by root, mode 0600/0400; or, as Kubernetes mounts
    a Secret with ``fsGroup``, owned by root, group one of this process's groups, mode 0440. The checks
    run on the opened file (fstat), so a path swapped between check and read gains nothing.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise TokenFileError(f"token file {path} does not exist; create it with a random token "
                             "and chmod 600") from exc
    except PermissionError as exc:
        raise TokenFileError(f"cannot read token file {path} as uid {os.geteuid()}: make it owned "
                             "by that user (chmod 600), or on Kubernetes mount the Secret with "
                             "defaultMode 0440 and the pod's fsGroup") from exc
    with os.fdopen(fd, "rb") as f:
        _check_token_file(path, os.fstat(f.fileno()))
        token = f.read(4096).strip()
    if not token:
        raise TokenFileError(f"token file {path} is empty; put a random token in it")
    return token


def _check_token_file(path: Path, st: os.stat_result) -> None:
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(f"token file {path} is not a regular file")
    if st.st_uid not in (me, 0):
        raise TokenFileError(f"token file {path} is owned by uid {st.st_uid}, not by uid {me} that "
                             f"runs the router (or root): that user chose the token; run: chown {me} {path}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IRWXO:
        raise TokenFileError(f"token file {path} is readable by others (mode {mode:o}); "
                             f"run: chmod 600 {path}")
    if mode & stat.S_IRWXG:
        ours = {os.getegid(), *os.getgroups()}
        secret_mount = st.st_uid == 0 and mode & stat.S_IRWXG == stat.S_IRGRP and st.st_gid in ours
        if not secret_mount:
            raise TokenFileError(f"token file {path} is open to group {st.st_gid} (mode {mode:o}); "
                                 f"run: chmod 600 {path} (group-read 0440 is accepted only for a root-owned "
                                 "file of one of the router's groups, as a Kubernetes Secret with fsGroup)")


def bearer_matches(authorization: str, token: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (constant-time compare)."""
    given = authorization[7:].strip().encode() if authorization[:7].lower() == "bearer " else b""
    return hmac.compare_digest(given, token)
