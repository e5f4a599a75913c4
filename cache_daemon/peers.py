"""Who may talk to the daemon: the peer's uid from SO_PEERCRED, checked against a policy."""

from __future__ import annotations

import socket
import struct

_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process that connected ``sock`` (as of its connect)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def peer_allowed(uid: int, *, daemon_uid: int, allow_uids: frozenset[int] = frozenset()) -> bool:
    """Same uid as the daemon, or explicitly allowed. Root gets no exception: list uid 0 to allow it."""
    return uid == daemon_uid or uid in allow_uids
