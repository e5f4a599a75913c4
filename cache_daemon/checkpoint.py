"""Read, shard and transform a checkpoint for one tensor-parallel rank: the one implementation shared
by the loader (which packs the result into an arena) and the engine's ``--weights disk`` path.

Order per tensor: read the rank's slice from the file -> cast to ``dtype`` -> transform. The result
is a pure function of the files and the arguments, so a disk load and an attach are bitwise equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from . import transforms
from .fingerprint import dtype_name
from .layout import COLUMN, ROW, Checkpoint, open_checkpoint, shard_rule, shard_shape, validate

TIED_ALIAS = ("lm_head.weight", "model.embed_tokens.weight")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What one packed tensor will be, known from the headers before any data is read."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    attrs: dict = field(default_factory=dict)


def _target_dtype(source_dtype: str, dtype: str) -> str:
    return dtype if source_dtype in ("float32", "float16", "bfloat16", "float64") else source_dtype


def rank_specs(ckpt: Checkpoint, *, dtype, tp_size: int, tp_rank: int,
               transform: str = "none") -> tuple[list[TensorSpec], dict[str, str]]:
    """The tensors (in packing order) and aliases of one rank, from metadata alone."""
    dtype = dtype_name(dtype)
    specs = []
    for t in ckpt.tensors.values():
        shape = shard_shape(t.shape, shard_rule(t.name), tp_size)
        for name, dt, shp, attrs in transforms.output_specs(transform, t.name, _target_dtype(t.dtype, dtype), shape):
            specs.append(TensorSpec(name, dt, tuple(shp), attrs))
    aliases = dict([TIED_ALIAS]) if ckpt.tied else {}
    return specs, aliases


def iter_rank_tensors(ckpt: Checkpoint, *, dtype, tp_size: int, tp_rank: int,
                      transform: str = "none") -> Iterator[tuple[str, object]]:
    """Yield ``(name, cpu tensor)`` in the order of :func:`rank_specs`, one file open at a time."""
    import torch
    from safetensors import safe_open

    dtype = dtype_name(dtype)
    current, handle = None, None
    try:
        for t in ckpt.tensors.values():
            if t.file != current:
                if handle is not None:
                    handle.__exit__(None, None, None)
                handle = safe_open(str(t.file), framework="pt").__enter__()
                current = t.file
            rule = shard_rule(t.name)
            part = t.shape[0 if rule == COLUMN else -1] // tp_size
            piece = handle.get_slice(t.name)
            if rule == COLUMN:
                tensor = piece[tp_rank * part:(tp_rank + 1) * part]
            elif rule == ROW:
                tensor = piece[:, tp_rank * part:(tp_rank + 1) * part]
            else:
                tensor = handle.get_tensor(t.name)
            tensor = tensor.to(getattr(torch, _target_dtype(t.dtype, dtype))).contiguous()
            yield from transforms.apply(transform, t.name, tensor)
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)


def load_shards(model_dir, *, dtype, tp_size: int = 1, tp_rank: int = 0, transform: str = "none") -> dict:
    """Exactly the tensors the daemon packs for this rank, as CPU tensors (aliases share storage).

    Validates the checkpoint first and raises the specific ``CheckpointError`` on a contradiction.
    """
    ckpt = open_checkpoint(model_dir)
    validate(ckpt, tp_size)
    out = dict(iter_rank_tensors(ckpt, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank, transform=transform))
    for alias, target in rank_specs(ckpt, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank,
                                    transform=transform)[1].items():
        out[alias] = out[target]
    return out
