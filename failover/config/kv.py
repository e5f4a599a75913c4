"""KV pool budgets: the primary's, a standby's, and the smallest pool an engine will take.

A standby serves nothing until it is promoted, so it starts with a small pool
(``standby_kv_memory``, default 1/16 of ``kv_memory``) and the supervisor grows it to ``kv_memory``
once it is primary (``failover.node.kv_pools``). The engine refuses a pool that cannot hold one
sequence of its longest context (it must always be able to finish its oldest sequence), so that is
the floor here too, with the engine's own model config and block arithmetic (``engine.config``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from cache_daemon.layout import resolve_dtype
from engine.config import KV_BLOCK_SIZE, ModelConfig as EngineModel, kv_block_bytes

STANDBY_SHARE = 16  # default standby pool: kv_memory / 16


@lru_cache(maxsize=8)
def _model(path: str, dtype: str) -> tuple[EngineModel, str]:
    """The checkpoint's shapes and its resolved compute dtype, read once per process."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return EngineModel.from_dir(Path(path)), resolve_dtype(dtype, raw)


def min_pool_bytes(model_path: str, dtype: str, tp: int, max_model_len: int | None) -> int:
    """Bytes (per rank) of the smallest pool the engine accepts: one sequence of its longest context."""
    m, compute = _model(model_path, dtype)
    context = min(m.context_len, max_model_len) if max_model_len else m.context_len
    blocks = -(-context // KV_BLOCK_SIZE)
    return blocks * kv_block_bytes(m.num_layers, max(m.num_kv_heads // tp, 1), m.head_dim, KV_BLOCK_SIZE, compute)


def standby_bytes(svc, model) -> int:
    """A standby's pool: ``standby_kv_memory`` if set, else kv_memory/16 but never below the floor."""
    if svc.standby_kv_memory is not None:
        return svc.standby_kv_memory_bytes
    floor = min_pool_bytes(model.path, model.dtype, model.tp, svc.max_model_len)
    return min(svc.kv_memory_bytes, max(svc.kv_memory_bytes // STANDBY_SHARE, floor))
