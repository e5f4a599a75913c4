"""Where a rank's weights come from: mapped from the cache daemon, or read from disk.

Both paths produce the same dict (``cache_daemon.checkpoint.load_shards`` is the one shard/transform
implementation, used by the daemon's loader and by ``--weights disk``), so outputs are identical.

Ownership: with ``cache`` the tensors are read-only views into the daemon's arenas; ``LoadedWeights``
keeps the ``MappedWeights`` handle alive for the life of the engine (it is never closed while the
model holds the tensors; the process exit unmaps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from engine.config import EngineConfig

log = structlog.get_logger(__name__)


class WeightsError(RuntimeError):
    """Weights could not be obtained from the requested source; the message says why and what to do."""


@dataclass
class LoadedWeights:
    tensors: dict[str, torch.Tensor]
    source: str  # "cache" or "disk"
    seconds: float
    handle: object = field(default=None, repr=False)  # MappedWeights for "cache": keeps the mapping


def load_weights(cfg: EngineConfig) -> LoadedWeights:
    source = resolve_source(cfg)
    start = time.perf_counter()
    handle = None
    if source == "cache":
        try:
            handle = _attach(cfg)
            tensors = handle.tensors
        except _FallBack as e:
            log.warning("weights_source_auto", chosen="disk", socket=str(cfg.socket),
                        reason=f"daemon not listening ({e}): loading from disk")
            source = "disk"
    if source == "disk":
        tensors = _from_disk(cfg)
    if cfg.device == "cpu":
        prefault(tensors.values())
    seconds = time.perf_counter() - start
    log.info("weights_loaded", source=source, seconds=round(seconds, 4), tensors=len(tensors),
             rank=cfg.tp_rank, bytes=sum(t.nbytes for t in tensors.values()))
    return LoadedWeights(tensors, source, seconds, handle)


MADV_POPULATE_READ = 22  # Linux 5.14+
PAGE = 4096


def prefault(tensors) -> None:
    """Map every page of the weights now, in one madvise per contiguous range, instead of one page
    fault at a time during the first forward. Read-only (it never writes a page); a kernel without
    MADV_POPULATE_READ leaves it to the faults. On disk this is also where a lazily mapped
    safetensors file is actually read, so the load time is the real one."""
    import ctypes

    spans = sorted((t.data_ptr() & ~(PAGE - 1), t.data_ptr() + t.nbytes) for t in tensors if t.nbytes)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for lo, hi in merged:
        if madvise(lo, hi - lo, MADV_POPULATE_READ) != 0:
            log.debug("prefault_unavailable", errno=ctypes.get_errno())
            return


def resolve_source(cfg: EngineConfig) -> str:
    if cfg.weights != "auto":
        return cfg.weights
    if cfg.socket is not None and Path(cfg.socket).is_socket():
        log.warning("weights_source_auto", chosen="cache", socket=str(cfg.socket))
        return "cache"
    log.warning("weights_source_auto", chosen="disk", socket=str(cfg.socket),
                reason="no daemon socket: loading from disk (slow start, no sharing)")
    return "disk"


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _from_disk(cfg: EngineConfig) -> dict[str, torch.Tensor]:
    from cache_daemon.checkpoint import load_shards

    tensors = load_shards(Path(cfg.model), dtype=_torch_dtype(cfg.dtype), tp_size=cfg.tp,
                          tp_rank=cfg.tp_rank, transform=cfg.transform)
    if cfg.device == "cuda":
        from engine.fusion import pack_onto

        # each layer's q/k/v (and gate/up) in one allocation, as the daemon's arena lays them out
        tensors = pack_onto(tensors, torch.device("cuda", torch.cuda.current_device()))
    return tensors


def _attach(cfg: EngineConfig):
    from cache_daemon import client, fingerprint
    from cache_daemon.errors import CacheError, DaemonUnavailable, FingerprintMismatch

    config = fingerprint.make_config(Path(cfg.model), dtype=cfg.dtype, tp_size=cfg.tp, tp_rank=cfg.tp_rank,
                                     transform=cfg.transform, device=cfg.device)
    try:
        return client.attach(str(cfg.socket), config)
    except DaemonUnavailable as e:
        if cfg.weights == "auto":
            raise _FallBack(str(e)) from e
        raise WeightsError(f"no cache daemon at {cfg.socket}: {e}; start one with `failover daemon` "
                           f"or use --weights disk") from e
    except FingerprintMismatch as e:
        raise WeightsError("the daemon holds a different build of this model: " + "; ".join(e.diff)
                           + "; restart the daemon for this model/options or use --weights disk") from e
    except CacheError as e:
        raise WeightsError(f"cache daemon at {cfg.socket} refused the weights: {e}") from e


class _FallBack(Exception):
    """auto mode: the socket exists but nothing listens; the caller falls back to disk."""
