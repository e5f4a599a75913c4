"""The fingerprint of vLLM-layout weights: computed from a ``VllmConfig``, the same way by the daemon's
loader child (failover_vllm.pack) and by the model loader in every vLLM instance, so that any setting
that changes the bytes vLLM would load makes the instance refuse the daemon's arena, field by field.

It is the daemon's :class:`cache_daemon.fingerprint.CacheConfig` (model identity, dtype, tp/pp rank,
quantization, device, torch version) with ``engine = "vllm"``, vLLM's version, and the settings of
vLLM's model, parallel and quantization config that decide what its loading produces.
"""

from __future__ import annotations

import hashlib
import json

import msgspec

from cache_daemon.fingerprint import CacheConfig, dtype_name, make_config

# Layout of what failover_vllm.pack writes (which tensors, which kinds): bump when it changes.
PACK_VERSION = 1


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def engine_config(vllm_config) -> tuple[tuple[str, str], ...]:
    """vLLM's settings that decide the weights' bytes, as sorted (key, value) pairs."""
    m, p = vllm_config.model_config, vllm_config.parallel_config
    hf = m.hf_config.to_dict() if hasattr(m.hf_config, "to_dict") else dict(vars(m.hf_config))
    pairs = {
        "pack_version": PACK_VERSION,
        "architecture": ",".join(getattr(m, "architectures", None) or []),
        "dtype": dtype_name(m.dtype),
        "quantization": m.quantization or "none",
        "revision": m.revision or "",
        "hf_config": _hash(hf),
        "hf_overrides": _hash(m.hf_overrides or {}),
        "model_impl": str(getattr(m, "model_impl", "")),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "tensor_parallel_size": p.tensor_parallel_size,
        "pipeline_parallel_size": p.pipeline_parallel_size,
        "enable_expert_parallel": bool(getattr(p, "enable_expert_parallel", False)),
        "device": str(vllm_config.device_config.device_type),
    }
    return tuple(sorted((k, str(v)) for k, v in pairs.items()))


def vllm_cache_config(vllm_config, *, tp_rank: int, pp_rank: int = 0) -> CacheConfig:
    """The fingerprint of rank ``tp_rank`` (of ``pp_rank``) of the weights ``vllm_config`` loads."""
    import vllm

    m, p = vllm_config.model_config, vllm_config.parallel_config
    device = str(vllm_config.device_config.device_type)
    device = "cpu" if device == "cpu" else f"cuda:{_cuda_index()}"
    quant = m.quantization or "none"
    base = make_config(m.model, dtype=dtype_name(m.dtype), tp_size=p.tensor_parallel_size, tp_rank=tp_rank,
                       device=device)
    return msgspec.structs.replace(base, pp_size=p.pipeline_parallel_size, pp_rank=pp_rank,
                                   quant_method=quant if base.quant_method == "none" else base.quant_method,
                                   engine="vllm", engine_version=str(vllm.__version__),
                                   engine_config=engine_config(vllm_config))


def _cuda_index() -> int:
    import torch

    return torch.cuda.current_device()
