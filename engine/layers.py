"""Building blocks of the decoder: RMSNorm, rotary embeddings and tensor-parallel linear layers.

Weights are owned by whoever mapped or loaded them (possibly a read-only mapping shared with other
engines): nothing here writes to a weight or runs an in-place op on one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine import fused

FP8_BLOCK = 128


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)`` (one kernel on CUDA)."""
        out, summed = fused.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, summed)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict, max_positions: int) -> torch.Tensor:
    """Inverse frequencies of RoPE for the config's scaling type (default, linear, llama3, dynamic)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "dynamic":
        # NTK scaling fixed at the longest context the engine serves (transformers recomputes it per
        # sequence length; both agree for sequences within the original context).
        return inv_freq
    return inv_freq


def rope_tables(head_dim: int, theta: float, scaling: dict, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) float32 on the CPU, [max_len, head_dim]: the rotation of every position."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, max_len)
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
    return emb.cos(), emb.sin()


class Rotary(nn.Module):
    """cos/sin tables for every position up to ``max_len``, looked up per token."""

    def __init__(self, head_dim: int, theta: float, scaling: dict, max_len: int, device) -> None:
        super().__init__()
        cos, sin = rope_tables(head_dim, theta, scaling, max_len)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAt:
        # positions [B, T] -> what rotates q and k [B, T, H, head_dim] at those positions
        if fused.available(positions.device):
            return RopeAt(positions, self.cos, self.sin, None, None)
        return RopeAt(positions, self.cos, self.sin, self.cos[positions].unsqueeze(2).to(dtype),
                      self.sin[positions].unsqueeze(2).to(dtype))


class RopeAt:
    """One forward's rotation: on CPU cos/sin looked up once [B, T, 1, D]; on CUDA a fused kernel
    reads the tables per token."""

    __slots__ = ("positions", "cos_table", "sin_table", "cos", "sin")

    def __init__(self, positions, cos_table, sin_table, cos, sin) -> None:
        self.positions, self.cos_table, self.sin_table, self.cos, self.sin = positions, cos_table, sin_table, cos, sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cos is not None:
            return fused.apply_rope_ref(x, self.cos, self.sin)
        return fused.rope(x, self.positions, self.cos_table, self.sin_table)


apply_rope = fused.apply_rope_ref


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new dense tensor ``weight * scale`` per 128x128 block (edge blocks partial)."""
    rows, cols = weight.shape
    scale = scale_inv.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return (weight.to(torch.float32) * scale).to(dtype)


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` either dense or fp8-block (dequantized per use, never in place).

    Column-parallel use: this rank holds rows ``out_features`` of the full weight (the daemon's
    column split), so its output is this rank's slice and needs no communication.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, fp8: bool) -> None:
        super().__init__()
        dtype = torch.float8_e4m3fn if fp8 else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if fp8:
            blocks = (math.ceil(out_features / FP8_BLOCK), math.ceil(in_features / FP8_BLOCK))
            self.weight_scale_inv = nn.Parameter(torch.empty(blocks, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.fp8 = fp8

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fp8:
            return dequant_fp8_block(self.weight, self.weight_scale_inv, dtype)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(x.dtype), self.bias)


class RowParallelLinear(Linear):
    """This rank holds columns ``in_features`` of the full weight (the daemon's row split): partial
    sums are all-reduced across the group, then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fp8: bool, tp: int) -> None:
        super().__init__(in_features, out_features, bias, fp8)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.dense_weight(x.dtype))
        if self.tp > 1:
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias
