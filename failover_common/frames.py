"""The project's one frame codec: a 4-byte big-endian length, then that many body bytes.

Used by the cache daemon's protocol (with fds via SCM_RIGHTS) and by the zygote's socketpair. Bodies
are bytes here; each user encodes and decodes its own tagged union. Every reader caps the length it
accepts before it buffers a byte of the body. Errors are :class:`FrameError` with a ``code``:
``closed`` (EOF between frames), ``bad_frame`` (EOF mid-frame, an empty frame, surplus fds),
``too_large``, ``busy`` (a :class:`FrameBudget` is full).

Blocking helpers serve plain sockets; the ``async_`` ones serve an event loop on non-blocking sockets,
and :func:`read_stream` an ``asyncio.StreamReader``. Fds ride with the frame's first bytes; a
receiver that does not expect fds reads with no ancillary buffer, so any fds a peer pushes at it are
closed by the kernel.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import struct

HEADER = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that cannot be read or sent; ``code`` names the kind (see the module docstring)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def pack(body: bytes, max_size: int) -> bytes:
    """Header plus ``body``; refuses a body over ``max_size`` (the peer would refuse it)."""
    if len(body) > max_size:
        raise FrameError(f"message of {len(body)} bytes exceeds the {max_size}-byte frame cap", "too_large")
    return HEADER.pack(len(body)) + body


def check_length(n: int, max_size: int) -> None:
    if n == 0:
        raise FrameError("empty frame", "bad_frame")
    if n > max_size:
        raise FrameError(f"frame of {n} bytes exceeds the {max_size}-byte cap", "too_large")


def _take_fds(ancdata, flags: int, into: list[int]) -> None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
            into.extend(fds)
    if flags & socket.MSG_CTRUNC:
        close_fds(into)
        raise FrameError("more fds arrived than expected", "bad_frame")


def close_fds(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _recv_some(sock: socket.socket, n: int, max_fds: int, fds: list[int]) -> bytes:
    if not max_fds:
        return sock.recv(n)
    data, anc, flags, _ = sock.recvmsg(n, socket.CMSG_SPACE(max_fds * 4))
    _take_fds(anc, flags, fds)
    return data


def _truncated(got: int, want: int) -> FrameError:
    return FrameError(f"connection closed mid-frame ({got} of {want} bytes)" if got else
                      "connection closed", "bad_frame" if got else "closed")


# ---- blocking --------------------------------------------------------------------------------

def _recv_exact(sock, n: int, max_fds: int, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = _recv_some(sock, n - len(buf), max_fds if not buf else 0, fds)
        if not chunk:
            raise _truncated(len(buf), n)
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, *, max_size: int, max_fds: int = 0) -> tuple[bytes, list[int]]:
    """Read one frame: ``(body, fds)``. The caller owns the returned fds."""
    fds: list[int] = []
    try:
        (n,) = HEADER.unpack(_recv_exact(sock, HEADER.size, max_fds, fds))
        check_length(n, max_size)
        return _recv_exact(sock, n, 0, fds), fds
    except BaseException:
        close_fds(fds)
        raise


def send(sock: socket.socket, data: bytes, fds=()) -> None:
    """Write one packed frame; ``fds`` are duplicated into the peer (the caller still owns its copies)."""
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    sock.sendall(data)


# ---- asyncio (non-blocking sockets) ----------------------------------------------------------

async def _wait(sock: socket.socket, writable: bool) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    add(sock.fileno(), lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        remove(sock.fileno())


async def wait_readable(sock: socket.socket) -> None:
    """Until ``sock`` has bytes (or EOF) to read: a frame is starting."""
    await _wait(sock, writable=False)


class FrameBudget:
    """Bytes of frames being received, across every connection of one daemon, capped.

    A frame's whole announced length is reserved when its header arrives, before its body is
    buffered, and released when the frame is decoded or abandoned (closed, timed out, cancelled).
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0

    def reserve(self, n: int) -> None:
        if self.used + n > self.cap:
            raise FrameError(f"frame of {n} bytes refused: {self.used} bytes of other frames are being "
                                f"received (cap {self.cap}); retry later", "busy")
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0, "released more than reserved"


async def _async_recv_header(sock, max_fds: int, fds: list[int]) -> bytes:
    buf = b""
    while len(buf) < HEADER.size:
        try:
            chunk = _recv_some(sock, HEADER.size - len(buf), max_fds if not buf else 0, fds)
        except (BlockingIOError, InterruptedError):
            await _wait(sock, writable=False)
            continue
        if not chunk:
            raise _truncated(len(buf), HEADER.size)
        buf += chunk
    return buf


async def _async_recv_into(sock, buf: bytearray) -> None:
    # One buffer of the announced size, filled in place: no growth by reallocation and no copy,
    # so what a frame holds is exactly what it reserved, and it goes back at once when dropped.
    view, got = memoryview(buf), 0
    try:
        while got < len(buf):
            try:
                k = sock.recv_into(view[got:])
            except (BlockingIOError, InterruptedError):
                await _wait(sock, writable=False)
                continue
            if not k:
                raise _truncated(got, len(buf))
            got += k
    finally:
        view.release()


async def async_recv(sock: socket.socket, *, max_size: int, max_fds: int = 0,
                     budget: FrameBudget | None = None) -> tuple[bytearray, list[int]]:
    """Read one frame on a non-blocking socket: ``(body, fds)``; the caller owns the fds."""
    fds: list[int] = []
    try:
        (n,) = HEADER.unpack(await _async_recv_header(sock, max_fds, fds))
        check_length(n, max_size)
        if budget is not None:
            budget.reserve(n)
        try:
            body = bytearray(n)
            await _async_recv_into(sock, body)
            return body, fds
        finally:
            if budget is not None:
                budget.release(n)
    except BaseException:
        close_fds(fds)
        raise


async def async_send(sock: socket.socket, data: bytes, fds=()) -> None:
    """Write one packed frame on a non-blocking socket."""
    view = memoryview(data)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while view:
        try:
            sent = sock.sendmsg([view], anc) if anc else sock.send(view)
        except (BlockingIOError, InterruptedError):
            await _wait(sock, writable=True)
            continue
        view, anc = view[sent:], []


async def read_stream(reader: asyncio.StreamReader, *, max_size: int) -> bytes:
    """Read one frame from an asyncio stream (the supervisor's end of the zygote socketpair)."""
    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        raise _truncated(len(e.partial), HEADER.size) from None
    (n,) = HEADER.unpack(head)
    check_length(n, max_size)
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise _truncated(len(e.partial), n) from None
