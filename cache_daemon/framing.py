"""The daemon protocol's frames: ``protocol`` messages in the one frame codec (``failover_common.frames``).

Blocking helpers serve the client and the loader; the ``async_`` ones serve the daemon's event loop
on non-blocking sockets. Every codec error reaches callers as a :class:`ProtocolError` with the
codec's code (``closed``, ``bad_frame``, ``too_large``, ``busy``).
"""

from __future__ import annotations

import socket

from failover_common import frames
from failover_common.frames import FrameBudget, FrameError, close_fds, wait_readable  # noqa: F401 (the daemon's names)

from . import protocol
from .errors import ProtocolError


def encode_frame(msg) -> bytes:
    try:
        return frames.pack(protocol.encode(msg), protocol.MAX_FRAME)
    except FrameError as e:
        raise ProtocolError(str(e), e.code) from None


def _decoded(body, fds: list[int]):
    try:
        return protocol.decode(body), fds
    except BaseException:
        close_fds(fds)
        raise


def recv_frame(sock: socket.socket, *, max_fds: int = 0, max_size: int = protocol.MAX_FRAME):
    """Read one message: ``(message, fds)``. The caller owns the returned fds."""
    try:
        body, fds = frames.recv(sock, max_size=max_size, max_fds=max_fds)
    except FrameError as e:
        raise ProtocolError(str(e), e.code) from None
    return _decoded(body, fds)


def send_frame(sock: socket.socket, msg, fds=()) -> None:
    """Write one message; ``fds`` are duplicated into the peer (the caller still owns its copies)."""
    frames.send(sock, encode_frame(msg), fds)


async def async_recv_frame(sock: socket.socket, *, max_fds: int = 0, max_size: int = protocol.MAX_FRAME,
                           budget: FrameBudget | None = None):
    try:
        body, fds = await frames.async_recv(sock, max_size=max_size, max_fds=max_fds, budget=budget)
    except FrameError as e:
        raise ProtocolError(str(e), e.code) from None
    return _decoded(body, fds)


async def async_send_frame(sock: socket.socket, msg, fds=()) -> None:
    await frames.async_send(sock, encode_frame(msg), fds)
