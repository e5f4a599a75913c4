"""CUDA arenas: VMM allocations shared as POSIX fds, mapped read-only by importers.

An arena is one reserved virtual range with one or more physical chunks (``cuMemCreate`` with the
POSIX-fd handle type, granularity-rounded) mapped back to back, so tensors are plain views of one
range. Lifetime: the loader creates, fills and exports the chunks (one fd each), sends the fds to the
daemon (which holds them with no CUDA context: the memory stays allocated while any fd or mapping
lives) and releases its own mapping. An importer maps the chunks with ``CU_MEM_ACCESS_FLAGS_PROT_READ``:
a write is an illegal-address error in the writer, never a change to the shared bytes.

``cuda.bindings`` and torch are imported inside the functions, so CPU machines never need them.
"""

from __future__ import annotations

import os

from .errors import ArenaError


def _cu():
    from cuda.bindings import driver

    return driver


def driver_version() -> int:
    """Load and resolve the driver bindings without initialising CUDA (safe before a fork)."""
    cu = _cu()
    return int(_ck(cu.cuDriverGetVersion(), "cuDriverGetVersion"))


def _ck(result, what: str):
    cu = _cu()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ArenaError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else (rest or None)


def _fd_type():
    return _cu().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _prop(device: int):
    cu = _cu()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = _fd_type()
    return prop


def _ensure_context(device: int) -> None:
    """Make torch's primary context of ``device`` exist (the driver calls run in it)."""
    import torch

    with torch.cuda.device(device):
        torch.zeros(1, device=f"cuda:{device}")


def granularity(device: int) -> int:
    cu = _cu()
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_ck(cu.cuMemGetAllocationGranularity(_prop(device), flag), "cuMemGetAllocationGranularity"))


def chunk_sizes(size: int, device: int, chunk_bytes: int = 0) -> tuple[int, ...]:
    """Split ``size`` (rounded up to the granularity) into chunks of at most ``chunk_bytes``."""
    g = granularity(device)
    total = max(g, (size + g - 1) // g * g)
    step = total if chunk_bytes <= 0 else max(g, chunk_bytes // g * g)
    return tuple(min(step, total - at) for at in range(0, total, step))


class _Cai:
    """Exposes a device range through ``__cuda_array_interface__`` and keeps its arena alive."""

    def __init__(self, arena: CudaArena) -> None:
        self.arena = arena
        self.__cuda_array_interface__ = {"shape": (arena.size,), "typestr": "|u1",
                                         "data": (int(arena.ptr), False), "version": 3}


class CudaArena:
    """One reserved VA range with its chunks mapped; RW for the loader, RO for importers."""

    def __init__(self, device: int, chunks: tuple[int, ...], handles: list, writable: bool) -> None:
        cu = _cu()
        self.device, self.chunks, self.handles = device, chunks, handles
        self.size = sum(chunks)
        self.ptr = None
        with _device(device):
            self.ptr = _ck(cu.cuMemAddressReserve(self.size, 0, 0, 0), "cuMemAddressReserve")
            at = 0
            try:
                for h, n in zip(handles, chunks):
                    _ck(cu.cuMemMap(int(self.ptr) + at, n, 0, h, 0), "cuMemMap")
                    at += n
                acc = cu.CUmemAccessDesc()
                acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                acc.location.id = device
                acc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable
                             else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
                _ck(cu.cuMemSetAccess(self.ptr, self.size, [acc], 1), "cuMemSetAccess")
            except ArenaError:
                self._unmap(at)
                raise
        self._mapped = self.size

    @classmethod
    def create(cls, size: int, device: int, chunk_bytes: int = 0) -> CudaArena:
        """Allocate a writable arena of at least ``size`` bytes on ``device`` (creates a CUDA context)."""
        _ensure_context(device)
        cu = _cu()
        chunks = chunk_sizes(size, device, chunk_bytes)
        handles = []
        with _device(device):
            try:
                for n in chunks:
                    handles.append(_ck(cu.cuMemCreate(n, _prop(device), 0), f"cuMemCreate({n} bytes)"))
            except ArenaError:
                for h in handles:
                    cu.cuMemRelease(h)
                raise
        return cls(device, chunks, handles, writable=True)

    @classmethod
    def import_fds(cls, fds: list[int], chunks: tuple[int, ...], device: int) -> CudaArena:
        """Map the chunks behind ``fds`` read-only; the caller may close the fds afterwards."""
        _ensure_context(device)
        cu = _cu()
        handles = []
        with _device(device):
            try:
                for fd in fds:
                    handles.append(_ck(cu.cuMemImportFromShareableHandle(fd, _fd_type()),
                                       "cuMemImportFromShareableHandle"))
            except ArenaError:
                for h in handles:
                    cu.cuMemRelease(h)
                raise
        return cls(device, chunks, handles, writable=False)

    def export_fds(self) -> list[int]:
        """One new fd per chunk; the caller owns (and must close) them."""
        cu = _cu()
        return [int(_ck(cu.cuMemExportToShareableHandle(h, _fd_type(), 0), "cuMemExportToShareableHandle"))
                for h in self.handles]

    def flat(self):
        """A flat uint8 torch tensor over the whole range (no copy; it keeps this arena referenced)."""
        import torch

        return torch.as_tensor(_Cai(self), device=f"cuda:{self.device}")

    def _unmap(self, mapped: int) -> None:
        cu = _cu()
        if self.ptr is None:
            return
        if mapped:
            cu.cuMemUnmap(self.ptr, mapped)
        for h in self.handles:
            cu.cuMemRelease(h)
        cu.cuMemAddressFree(self.ptr, self.size)
        self.ptr, self.handles = None, []

    def close(self) -> None:
        """Unmap and release: only after every tensor over this range is gone and work has finished."""
        import torch

        if self.ptr is not None:
            torch.cuda.synchronize(self.device)
            with _device(self.device):
                self._unmap(self._mapped)


class _device:
    """Context manager: make torch's context of ``device`` current for the driver calls inside."""

    def __init__(self, device: int) -> None:
        self.device = device

    def __enter__(self):
        import torch

        self._ctx = torch.cuda.device(self.device)
        self._ctx.__enter__()

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
