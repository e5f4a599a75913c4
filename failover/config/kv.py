"""KV pool budgets: the primary's, a standby's, and the smallest pool an engine will take.

A standby serves nothing until it is promoted, so it starts with a small pool
(``standby_kv_memory``, default 1/16 of ``kv_memory``) and the supervisor grows it to ``kv_memory``
once it is primary (``failover.node.kv_pools``). The primary's pool must hold one sequence of the
longest context (it must always be able to finish its oldest sequence); a standby's may be smaller,
down to one block: the engine is told so (``--kv-min-memory``), and a sequence that outgrows a small
pool waits for the growth. Sizes come from the engine's own model config and block arithmetic
(``engine.config``).
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


def block_bytes(model_path: str, dtype: str, tp: int) -> int:
    """Bytes (per rank) of one KV block: every layer's keys and values of ``KV_BLOCK_SIZE`` positions."""
    m, compute = _model(model_path, dtype)
    return kv_block_bytes(m.num_layers, max(m.num_kv_heads // tp, 1), m.head_dim, KV_BLOCK_SIZE, compute)


def min_pool_bytes(model_path: str, dtype: str, tp: int, max_model_len: int | None) -> int:
    """Bytes (per rank) of the smallest primary pool: one sequence of the longest context."""
    m, _ = _model(model_path, dtype)
    context = min(m.context_len, max_model_len) if max_model_len else m.context_len
    return -(-context // KV_BLOCK_SIZE) * block_bytes(model_path, dtype, tp)


def standby_bytes(svc, model) -> int:
    """A standby's pool: ``standby_kv_memory`` if set, else kv_memory/16, at least one block."""
    if svc.standby_kv_memory is not None:
        return svc.standby_kv_memory_bytes
    block = block_bytes(model.path, model.dtype, model.tp)
    return min(svc.kv_memory_bytes, max(svc.kv_memory_bytes // STANDBY_SHARE // block * block, block))
