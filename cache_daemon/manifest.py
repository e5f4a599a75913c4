"""The manifest: where every tensor of one rank lives inside its arena(s), and how to view it.

An arena is one memory object (a memfd, or a CUDA VMM range made of one or more chunks, each its own
fd). Tensors are views at 256-byte aligned offsets, so mapping a rank costs one import per chunk,
not one per tensor. Metadata a transform needs (block size, scale names) travels in ``attrs``.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

ALIGN = 256
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
            "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    arena: int  # index into Manifest.arenas
    offset: int  # bytes from the arena's start, a multiple of ALIGN
    nbytes: int
    attrs: dict[str, Any] = {}


class ArenaSpec(msgspec.Struct, frozen=True):
    kind: str  # "cpu" (memfd) | "cuda" (VMM)
    device_index: int  # the loader's CUDA ordinal of the GPU (its own numbering; 0 for cpu)
    size: int  # bytes, the sum of chunks
    chunks: tuple[int, ...]  # size of each physical chunk, one fd each, in order
    # The key of device memory: the GPU's UUID ("GPU-..."), which every process resolves to its own
    # ordinal (gpus.ordinal_for). "" for cpu.
    device_uuid: str = ""


class Manifest(msgspec.Struct, frozen=True):
    tensors: tuple[TensorEntry, ...]
    aliases: dict[str, str]  # alias name -> tensor name (tied weights: same bytes)
    arenas: tuple[ArenaSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.arenas)

    @property
    def nfds(self) -> int:
        return sum(len(a.chunks) for a in self.arenas)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


# Projections an engine may run as one GEMM each: placed back to back, in this order, so a view of
# the first member that spans all of them is their concatenation along the output rows (no copy).
_FUSABLE = re.compile(r"^(.*\.)(?:self_attn\.(q|k|v)|mlp\.(gate|up))_proj\.(weight|bias)$")
_MEMBER = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}


def packing_order(names: list[str]) -> list[int]:
    """Indices of ``names`` in the order they are placed: each layer's q/k/v projections together
    (q, k, v), and its gate/up projections together (gate, up), at the place of the group's first
    member; everything else where it is (the checkpoint's file order)."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    keys = []
    for i, name in enumerate(names):
        m = _FUSABLE.match(name)
        key = None if m is None else (m.group(1), "attn" if m.group(2) else "mlp", m.group(4))
        keys.append(key)
        if key is not None:
            groups.setdefault(key, []).append((_MEMBER[m.group(2) or m.group(3)], i))
    order, placed = [], set()
    for i, key in enumerate(keys):
        if key is None:
            order.append(i)
        elif key not in placed:
            placed.add(key)
            order.extend(j for _, j in sorted(groups[key]))
    return order


def plan(specs, *, arena: int = 0) -> tuple[list[TensorEntry], int]:
    """Pack ``specs`` (objects with name, dtype, shape, attrs), each ALIGN-aligned, in
    :func:`packing_order` (fusable projections adjacent; with sizes that are multiples of ALIGN,
    as every real model's are, with no padding between them).

    Returns the entries, in the order of ``specs`` (the loader fills them in that order), and the
    bytes the arena needs (at least 1).
    """
    specs = list(specs)
    entries: list[TensorEntry | None] = [None] * len(specs)
    offset = 0
    for i in packing_order([s.name for s in specs]):
        s = specs[i]
        count = 1
        for n in s.shape:
            count *= n
        nbytes = count * ITEMSIZE[s.dtype]
        entries[i] = TensorEntry(s.name, s.dtype, tuple(s.shape), contiguous_stride(tuple(s.shape)),
                                 arena, offset, nbytes, dict(s.attrs))
        offset = align(offset + nbytes)
    return entries, max(offset, 1)


def views(manifest: Manifest, arenas: list) -> dict:
    """name -> tensor for every entry and alias, given one flat uint8 tensor per arena (no copy).

    One ``as_strided`` per tensor over a per-dtype view of the whole arena: the cost of mapping a
    model is dominated by this loop, so it does nothing else.
    """
    import torch

    typed: dict[tuple[int, str], object] = {}
    out = {}
    for e in manifest.tensors:
        base = typed.get((e.arena, e.dtype))
        if base is None:
            base = typed[(e.arena, e.dtype)] = arenas[e.arena].view(getattr(torch, e.dtype))
        out[e.name] = base.as_strided(e.shape, e.stride, e.offset // ITEMSIZE[e.dtype])
    for alias, target in manifest.aliases.items():
        out[alias] = out[target]
    return out
