"""``attach()``: map a resident model's weights from the daemon, zero-copy and read-only.

Usable from any PyTorch program::

    from cache_daemon.client import attach
    from cache_daemon.fingerprint import make_config
    config = make_config(model_dir, dtype="bfloat16", tp_size=1, tp_rank=0, device="cuda")
    with attach("/tmp/failover-0/daemon.sock", config) as weights:
        model.load_views(weights.tensors)   # name -> read-only tensor on the config's device

Ownership: the returned tensors are views into memory that no process may write; a write through one
faults (SIGSEGV on CPU, an illegal-address error on CUDA) in the writer alone. The mapping outlives the
daemon. ``close()`` unmaps: call it only after every tensor has been dropped.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import structlog

from . import framing
from .errors import (AccessDenied, CacheError, DaemonUnavailable, FingerprintMismatch, NotResident,
                     ProtocolError)
from .fingerprint import CacheConfig
from .manifest import ArenaSpec, Manifest, views
from .protocol import (MAX_FDS, PROTOCOL_VERSION, Error, Evict, Evicted, Fetch, FetchReply, Hello, Ping,
                       Pong, Query, QueryReply, Status, StatusReply, Welcome)

log = structlog.get_logger(__name__)


class Connection:
    """One blocking conversation with the daemon (Hello done on open). Owns its socket."""

    def __init__(self, socket_path, *, timeout: float = 10.0, client: str = "") -> None:
        path = str(socket_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            self.sock.close()
            raise DaemonUnavailable(f"no cache daemon at {path} ({e.strerror}): start `failover daemon` "
                                    "or load weights from disk") from None
        except PermissionError:
            self.sock.close()
            raise AccessDenied(f"no permission to connect to {path}: run as the daemon's user") from None
        except OSError as e:
            self.sock.close()
            raise DaemonUnavailable(f"cannot reach the cache daemon at {path}: {e}") from None
        try:
            self.welcome = self.request(Hello(PROTOCOL_VERSION, client or f"pid {os.getpid()}"), Welcome)
        except BaseException:
            self.sock.close()
            raise

    def request(self, msg, expect: type, *, max_fds: int = 0):
        """Send ``msg``; return the reply (or ``(reply, fds)`` when ``max_fds``), errors raised typed."""
        try:
            try:
                framing.send_frame(self.sock, msg)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon may have refused us and closed already: its reason is still readable
            reply, fds = framing.recv_frame(self.sock, max_fds=max_fds)
        except TimeoutError:
            raise ProtocolError("the cache daemon did not answer in time", "timeout") from None
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ProtocolError(f"the cache daemon closed the connection ({e})", "closed") from None
        if isinstance(reply, Error):
            framing.close_fds(fds)
            raise _error(reply)
        if not isinstance(reply, expect):
            framing.close_fds(fds)
            raise ProtocolError(f"expected {expect.__name__}, the daemon sent {type(reply).__name__}", "unexpected")
        return (reply, fds) if max_fds else reply

    def close(self) -> None:
        self.sock.close()


def _error(e: Error) -> CacheError:
    if e.code == "not_resident":
        return NotResident(e.message)
    if e.code == "mismatch":
        return FingerprintMismatch(e.message, e.diff)
    if e.code == "forbidden":
        return AccessDenied(e.message)
    return ProtocolError(f"cache daemon: {e.message}", e.code)


class MappedWeights:
    """The tensors of one rank mapped from the daemon. Holds the mapping(s) and the connection
    (which counts as an attached client in the daemon's status until :meth:`close`)."""

    def __init__(self, manifest: Manifest, mappings: list, conn: Connection) -> None:
        self.manifest = manifest
        self._mappings = mappings
        self._conn = conn
        self.tensors: dict = views(manifest, [m.flat() for m in mappings])

    def close(self) -> None:
        """Unmap. Every tensor the caller took from :attr:`tensors` must be gone by now."""
        self.tensors = {}
        for m in self._mappings:
            if m.close() is False:
                log.warning("mapping_still_referenced",
                            detail="tensors of this mapping are still alive: it is unmapped when the last goes")
        self._mappings = []
        self._conn.close()

    def __enter__(self) -> MappedWeights:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def local_ordinal(arena: ArenaSpec, visible: tuple[str, ...] | None = None) -> int:
    """This process's CUDA ordinal of the GPU that holds ``arena`` (found by its UUID).

    ``visible`` is this process's GPUs by ordinal (default: asked of the driver).
    """
    if not arena.device_uuid:  # a manifest from before UUID keys: the loader's ordinal
        return arena.device_index
    from .gpus import ordinal_for, visible_uuids

    return ordinal_for(arena.device_uuid, visible_uuids() if visible is None else visible)


def _map(manifest: Manifest, fds: list[int]) -> list:
    mappings, at = [], 0
    try:
        for arena in manifest.arenas:
            mine = fds[at:at + len(arena.chunks)]
            at += len(arena.chunks)
            if arena.kind == "cpu":
                from .arena_cpu import CpuMapping

                mappings.append(CpuMapping(mine[0], arena.size))
            else:
                from .arena_cuda import CudaArena

                mappings.append(CudaArena.import_fds(mine, arena.chunks, local_ordinal(arena)))
    except BaseException:
        for m in mappings:
            m.close()
        raise
    return mappings


def attach(socket_path, config: CacheConfig, *, timeout: float = 10.0) -> MappedWeights:
    """Map the weights the daemon at ``socket_path`` holds for exactly ``config``.

    Raises DaemonUnavailable (no socket / no listener: fall back to disk), FingerprintMismatch (with
    ``.diff``), NotResident, AccessDenied or ProtocolError -- all CacheError.
    """
    conn = Connection(socket_path, timeout=timeout)
    try:
        reply, fds = conn.request(Fetch(config), FetchReply, max_fds=MAX_FDS)
        try:
            if len(fds) != reply.nfds or reply.nfds != reply.manifest.nfds:
                raise ProtocolError(f"fetch reply carried {len(fds)} fds, expected {reply.manifest.nfds}", "bad_frame")
            mappings = _map(reply.manifest, fds)
        finally:
            framing.close_fds(fds)  # the mappings keep the memory
        return MappedWeights(reply.manifest, mappings, conn)
    except BaseException:
        conn.close()
        raise


def preload(device: str = "cpu") -> None:
    """Import now what :func:`attach` needs for ``device`` (torch; on CUDA the driver bindings), so
    the first attach does not pay for it: call it in a zygote before it forks. On CUDA it loads the
    driver library and resolves its symbols (``cuDriverGetVersion``), but calls no ``cuInit``:
    no CUDA context, no thread."""
    import torch  # noqa: F401

    from . import arena_cpu  # noqa: F401

    if device.startswith("cuda"):
        from . import arena_cuda

        arena_cuda.driver_version()


def query(socket_path, config: CacheConfig, *, timeout: float = 10.0) -> QueryReply:
    """Whether ``config`` is resident (raises like :func:`attach` when not), without mapping it."""
    conn = Connection(socket_path, timeout=timeout)
    try:
        return conn.request(Query(config), QueryReply)
    finally:
        conn.close()


def evict(socket_path, config: CacheConfig, *, force: bool = False, timeout: float = 10.0) -> int:
    """Make the daemon drop ``config``'s arena; returns its bytes. Clients that mapped it keep their
    mapping (the memory is freed when the last of them unmaps). While any client maps it the daemon
    refuses (ProtocolError code ``in_use``) unless ``force``."""
    conn = Connection(socket_path, timeout=timeout)
    try:
        return conn.request(Evict(config, force), Evicted).nbytes
    finally:
        conn.close()


def status(socket_path, *, timeout: float = 10.0) -> StatusReply:
    conn = Connection(socket_path, timeout=timeout)
    try:
        return conn.request(Status(), StatusReply)
    finally:
        conn.close()


def ping(socket_path, *, timeout: float = 2.0) -> bool:
    """True when a daemon answers on ``socket_path``."""
    try:
        conn = Connection(socket_path, timeout=timeout)
    except CacheError:
        return False
    try:
        return isinstance(conn.request(Ping(1), Pong), Pong)
    finally:
        conn.close()


def socket_exists(socket_path) -> bool:
    return Path(socket_path).is_socket()
