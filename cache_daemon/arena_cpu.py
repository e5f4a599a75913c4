"""CPU arenas: one sealed memfd per rank, mapped ``PROT_READ`` by every importer.

Lifetime: the loader creates and fills the memfd, drops its writable mapping, seals it against
writes and size changes (``F_SEAL_WRITE``: from then on nobody, not even the daemon, can map it
writable) and sends the fd to the daemon. The daemon holds the fd; a client maps it read-only and
closes its fd at once (the mapping keeps the memory). The memory is freed when the last fd and the
last mapping are gone. A write through a mapped tensor is a SIGSEGV in the writer only.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings

from .errors import ArenaError

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class CpuArenaWriter:
    """A fresh memfd of ``size`` bytes, writable until :meth:`seal`. Owned by the loader."""

    def __init__(self, size: int, label: str) -> None:
        import torch

        self.size = size
        self.fd = os.memfd_create(f"failover-arena:{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(self.fd)
            raise ArenaError(f"cannot create a {size}-byte memfd arena: {e}") from e
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def write(self, offset: int, tensor) -> None:
        import torch

        src = tensor.reshape(-1).view(torch.uint8)
        self._bytes[offset:offset + src.numel()].copy_(src)

    def seal(self) -> int:
        """Unmap, seal, and hand over the fd (the caller now owns it)."""
        del self._bytes  # the last view of the buffer: the map can close now
        self._map.close()
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CpuMapping:
    """A read-only shared mapping of one arena fd; :meth:`flat` is a uint8 tensor over all of it."""

    def __init__(self, fd: int, size: int) -> None:
        import torch

        try:
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            raise ArenaError(f"cannot map the {size}-byte arena read-only: {e}") from e
        with warnings.catch_warnings():
            # The buffer is read-only on purpose: a write must fault, not be allowed.
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            self._flat = torch.frombuffer(self._map, dtype=torch.uint8)

    def flat(self):
        return self._flat

    def close(self) -> bool:
        """Unmap if no tensor views it any more; else leave it to the last view (returns False)."""
        self._flat = None
        try:
            self._map.close()
        except BufferError:
            return False
        return True
