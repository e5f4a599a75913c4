"""Fused projections: each layer's q/k/v as one GEMM, and its gate/up as one, without copying weights.

The cache daemon places a layer's q, k and v projections back to back in its arena (and gate, up),
``cache_daemon.manifest.packing_order``, so a view that starts at q's first row and spans all three
is exactly ``cat([q, k, v])``: read-only like its members, and no byte more of device memory. On
the H200 a decode step is one pass over the weights, and three GEMMs where there were seven per
layer end fewer kernels in their tails (``bench/engine.py``).

Weights read from disk onto a GPU are the engine's own: each group is copied into one tensor there
and its members become views of it, so the same path serves them. Anything else (weights not
adjacent, fp8 blocks dequantized per use, a CPU engine reading from disk) keeps one GEMM per
projection: same results, as before.
"""

from __future__ import annotations

import torch

ATTN = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


def spanning_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor ``cat(parts)`` (along dim 0) as a view of their shared storage, when they lie
    back to back in it (same dtype, device, trailing shape, contiguous); None otherwise."""
    first = parts[0]
    if any(p is None for p in parts):
        return None
    tail, base = tuple(first.shape[1:]), first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for p in parts:
        if (p.dtype != first.dtype or p.device != first.device or tuple(p.shape[1:]) != tail
                or not p.is_contiguous() or p.untyped_storage().data_ptr() != base or p.data_ptr() != end):
            return None
        end += p.nbytes
    rows = sum(p.shape[0] for p in parts)
    return torch.as_strided(first, (rows, *tail), first.stride(), first.storage_offset())


def group_names(weights: dict[str, torch.Tensor]) -> list[list[str]]:
    """The fusable groups present in ``weights`` (Hugging Face names), each in fusion order."""
    groups = []
    for name in weights:
        for members, module in ((ATTN, "self_attn"), (MLP, "mlp")):
            first = f".{module}.{members[0]}."
            if first in name:
                names = [name.replace(first, f".{module}.{m}.") for m in members]
                if all(n in weights for n in names):
                    groups.append(names)
    return groups


def pack_onto(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` (host) moved to ``device`` with each fusable group in one allocation, its members
    views of it, back to back (what the daemon's arena gives a mapped engine)."""
    out: dict[str, torch.Tensor] = {}
    for names in group_names(tensors):
        parts = [tensors[n] for n in names]
        if len({(p.dtype, tuple(p.shape[1:])) for p in parts}) != 1:
            continue
        whole = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                            device=device)
        row = 0
        for n, p in zip(names, parts):
            out[n] = whole[row:row + p.shape[0]]
            out[n].copy_(p)
            row += p.shape[0]
    return {name: out[name] if name in out else t.to(device) for name, t in tensors.items()}
