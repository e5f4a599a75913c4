"""Weight transforms applied after sharding: ``none`` and block-wise FP8 (``fp8-block``).

fp8-block: each 2-D linear weight (q/k/v/o/gate/up/down) becomes float8_e4m3fn in 128x128 blocks
(edge blocks partial) with a float32 tensor ``<name>_scale_inv`` of shape (ceil(rows/128),
ceil(cols/128)); dequantization is ``w.float() * scale`` per block. Per element the error is at most
``|w| / 16 + scale / 512`` (3 mantissa bits, and half the smallest subnormal step).
The bytes are a pure function of the input on CPU, so the loader and the engine's disk path agree.
"""

from __future__ import annotations

import math
import re

# Bump a version when a transform's output bytes change: it is part of the fingerprint.
TRANSFORM_VERSIONS = {"none": 1, "fp8-block": 1}
BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = "float8_e4m3fn"
_LINEAR = re.compile(r"\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


def scale_name(name: str) -> str:
    return name + "_scale_inv"


def quantizes(transform: str, name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``transform`` turns this tensor into FP8 (else it is kept in the model dtype)."""
    return transform == "fp8-block" and len(shape) == 2 and bool(_LINEAR.search(name))


def output_specs(transform: str, name: str, dtype: str, shape: tuple[int, ...]):
    """``[(name, dtype, shape, attrs), ...]`` this tensor becomes; metadata only, no data touched."""
    if not quantizes(transform, name, shape):
        return [(name, dtype, shape, {})]
    rows, cols = shape
    attrs = {"transform": "fp8-block", "block": [BLOCK, BLOCK], "scale": scale_name(name)}
    scales = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    return [(name, FP8_DTYPE, shape, attrs), (scale_name(name), "float32", scales, {})]


def apply(transform: str, name: str, tensor):
    """``[(name, tensor), ...]`` in the order of :func:`output_specs`."""
    if not quantizes(transform, name, tuple(tensor.shape)):
        return [(name, tensor)]
    q, scale = quantize_fp8_block(tensor)
    return [(name, q), (scale_name(name), scale)]


def quantize_fp8_block(w, block: int = BLOCK):
    """(rows, cols) tensor -> (float8_e4m3fn (rows, cols), float32 scales (ceil(r/b), ceil(c/b)))."""
    import torch
    import torch.nn.functional as F

    rows, cols = w.shape
    rb, cb = math.ceil(rows / block), math.ceil(cols / block)
    padded = F.pad(w.float(), (0, cb * block - cols, 0, rb * block - rows))
    blocks = padded.view(rb, block, cb, block)  # (rb, block, cb, block)
    amax = blocks.abs().amax(dim=(1, 3))  # (rb, cb)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(rb * block, cb * block)[:rows, :cols].contiguous()
    return q, scale.contiguous()


def dequantize_fp8_block(q, scale, block: int = BLOCK):
    """Inverse of :func:`quantize_fp8_block` up to its rounding error; returns float32."""
    rows, cols = q.shape
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.float() * full


def error_bound(w, scale, block: int = BLOCK):
    """Per-element bound on ``|dequantize(quantize(w)) - w|`` (see the module docstring)."""
    rows, cols = w.shape
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return w.float().abs() / 16 + full / 512
