"""KV pool budgets: the primary's, a standby's, and the smallest pool an engine will take.

A standby serves nothing until it is promoted, so it starts with a small pool
(``standby_kv_memory``, default 1/16 of ``kv_memory``) and the supervisor grows it to ``kv_memory``
once it is primary (``failover.node.kv_pools``). The engine refuses a pool that cannot hold one
sequence of its longest context (it must always be able to finish its oldest sequence), so that is
the floor here too, computed from the checkpoint's config.json the same way the engine does.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from cache_daemon.layout import resolve_dtype
from engine.config import ModelConfig as EngineModel

BLOCK_TOKENS = 16  # the engine's KV block (engine.kv_cache.DEFAULT_BLOCK_SIZE)
STANDBY_SHARE = 16  # default standby pool: kv_memory / 16
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@lru_cache(maxsize=8)
def _model(path: str) -> EngineModel:
    return EngineModel.from_dir(Path(path))


def min_pool_bytes(model_path: str, dtype: str, tp: int, max_model_len: int | None) -> int:
    """Bytes (per rank) of the smallest pool the engine accepts: one sequence of its longest context."""
    m = _model(model_path)
    context = min(m.context_len, max_model_len) if max_model_len else m.context_len
    blocks = -(-context // BLOCK_TOKENS)
    raw = json.loads((Path(model_path) / "config.json").read_text())
    element = _ELEMENT_BYTES.get(resolve_dtype(dtype, raw), 4)
    per_block = 2 * m.num_layers * max(m.num_kv_heads // tp, 1) * BLOCK_TOKENS * m.head_dim * element
    return blocks * per_block


def standby_bytes(svc, model) -> int:
    """A standby's pool: ``standby_kv_memory`` if set, else kv_memory/16 but never below the floor."""
    if svc.standby_kv_memory is not None:
        return svc.standby_kv_memory_bytes
    floor = min_pool_bytes(model.path, model.dtype, model.tp, svc.max_model_len)
    return min(svc.kv_memory_bytes, max(svc.kv_memory_bytes // STANDBY_SHARE, floor))
