"""GPUs named by UUID, not by CUDA ordinal: the key of device memory across processes.

An ordinal is a process's own numbering of the GPUs it sees. The daemon's loader may see every GPU of
the node (ordinal 3 = the fourth) while an engine in a pod sees only its own (ordinal 0), so an arena
records the UUID of the GPU its memory lives on (the ``GPU-...`` form that ``nvidia-smi -L`` and NVML
print) and every importer finds its own ordinal for that UUID.

``cuda.bindings`` is imported inside the functions; ``cuInit`` creates no context, but it is still
called only in processes that use CUDA anyway (the loader child, engines), never in the daemon.
"""

from __future__ import annotations

import os

from .errors import ArenaError


def format_uuid(raw: bytes) -> str:
    """16 raw bytes -> ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (nvidia-smi's spelling)."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID is 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def visible_uuids() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees, by ordinal (after CUDA_VISIBLE_DEVICES)."""
    from cuda.bindings import driver as cu

    def ck(result, what: str):
        err, *rest = result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise ArenaError(f"{what} failed: {err}")
        return rest[0] if rest else None

    ck(cu.cuInit(0), "cuInit")
    uuids = []
    for ordinal in range(ck(cu.cuDeviceGetCount(), "cuDeviceGetCount")):
        dev = ck(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        uuids.append(format_uuid(bytes(ck(cu.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes)))
    return tuple(uuids)


def ordinal_for(uuid: str, visible: tuple[str, ...]) -> int:
    """This process's ordinal of GPU ``uuid``; ArenaError naming what to fix when it is not visible."""
    want = uuid.lower()
    for ordinal, have in enumerate(visible):
        if have.lower() == want:
            return ordinal
    seen = ", ".join(visible) or "none"
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise ArenaError(f"the weights live on GPU {uuid}, which this process does not see (it sees: {seen}; "
                     f"CUDA_VISIBLE_DEVICES={cvd!r}); run the engine on that GPU, or have the daemon load "
                     "onto this one")
