"""The peer of a connected Unix socket, from SO_PEERCRED (every socket of ours checks its uid)."""

from __future__ import annotations

import socket
import struct

_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process that connected ``sock`` (as of its connect)."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
