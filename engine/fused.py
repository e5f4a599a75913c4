"""Fused ops of the CUDA path, each beside the torch reference it must equal.

On a CUDA tensor (with Triton importable) each op is one Triton kernel (``engine.triton_kernels``);
elsewhere it is the reference below, so the CPU path computes exactly what it did before. Every op
writes a new tensor: nothing here writes to a weight or to an input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from engine import triton_kernels as tk
except ImportError:  # a CPU-only install: the references are the only path
    tk = None


def available(device: torch.device) -> bool:
    return tk is not None and device.type == "cuda"


def preload() -> None:
    """The CUDA-free part of Triton's first launch, for a zygote to pay once before it forks: the
    hash of Triton's own install (``triton_key``: it reads all of libtriton, ~0.5 GB, in every new
    process), the ptxas version checks (a subprocess each), each kernel's source hash and the Gluon
    modules the first launch imports (~150 ms on the H200's host, where site-packages keeps no
    bytecode). Touches no CUDA (no driver, no device query), so the forks stay clean; what it caches
    they inherit."""
    if tk is None:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # Triton < 3.3 kept it in the compiler
        from triton.compiler.compiler import triton_key
    triton_key()
    try:
        from triton import knobs

        for tool in ("ptxas", "ptxas_blackwell"):
            getattr(knobs.nvidia, tool, None)  # resolved once: NvidiaTool.from_path runs `ptxas --version`
        from triton.backends.nvidia.compiler import get_ptxas_version
        for arch in (80, 90, 100):
            get_ptxas_version(arch)
    except (ImportError, AttributeError, TypeError, RuntimeError, OSError):
        pass  # another Triton layout: the first launch pays for these instead
    for kernel in kernels():
        kernel.cache_key  # noqa: B018 - a property that hashes the kernel's source and dependencies
    try:  # the first launch's argument specialization imports Gluon (~150 ms on the H200's host)
        import triton.experimental.gluon  # noqa: F401
    except ImportError:  # a Triton without Gluon
        pass


def kernels() -> list:
    """Every ``@triton.jit`` kernel of ``engine.triton_kernels`` that is launched (not the helpers
    they inline): the list is found, not written, so a kernel added later is preloaded too (the
    split decode's two were missing from a hand-written one, and every engine hashed them in its
    warm-up)."""
    from triton.runtime.jit import JITFunction

    return [k for name, k in vars(tk).items() if isinstance(k, JITFunction) and name.endswith("_kernel")]


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


# --- RMSNorm, with the residual add before it ------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; without ``residual``: ``(norm(x), x)``."""
    if not (available(x.device) and weight.dtype == x.dtype):
        if residual is not None:
            x = x + residual
        return rms_norm_ref(x, weight, eps), x
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(-1, n) if residual is not None else x2
    tk.rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0),
                                       res_out.stride(0), n, eps, HAS_RESIDUAL=residual is not None,
                                       BLOCK=_pow2(n), num_warps=4 if n <= 4096 else 8)
    return out.view(x.shape), res_out.view(x.shape)


# --- SwiGLU --------------------------------------------------------------------------------------
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not available(gate.device):
        return F.silu(gate) * up
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty_like(g2)
    block = min(1024, _pow2(n))
    tk.silu_mul_kernel[(g2.shape[0], -(-n // block))](g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n,
                                                       BLOCK=block)
    return out.view(gate.shape)


# --- RoPE ----------------------------------------------------------------------------------------
def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D], positions [B, T]; the tables are float32 [max_len, D] (``engine.layers.Rotary``)."""
    if not available(x.device):
        cos = cos_table[positions].unsqueeze(2).to(x.dtype)
        sin = sin_table[positions].unsqueeze(2).to(x.dtype)
        return apply_rope_ref(x, cos, sin)
    b, t, h, d = x.shape
    x3 = x.reshape(b * t, h, d)
    out = torch.empty((b * t, h, d), dtype=x.dtype, device=x.device)
    pos = positions.reshape(-1)
    tk.rope_kernel[(b * t, h)](x3, out, pos, cos_table, sin_table, x3.stride(0), x3.stride(1), out.stride(0),
                               out.stride(1), cos_table.stride(0), HALF=d // 2, BLOCK=_pow2(d // 2))
    return out.view(b, t, h, d)


def rope_store_kv(kv, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_table: torch.Tensor, sin_table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A decode step's ``rope`` of q and k and ``store_kv`` of the rotated k and v, in one kernel:
    q [N, H, D], k/v [N, Hkv, D] (each head's D contiguous), positions and slots [N] -> rotated q
    [N, H, D]; the rotated k is written to the pool only. Computes what the three calls compute."""
    n, h, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
    tk.rope_store_kv_kernel[(n, h + hkv)](
        q, k, v, out, kv.anchor, kv.offsets, slots, positions, cos_table, sin_table, layer, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), cos_table.stride(0),
        kv.offsets.stride(0), kv.offsets.stride(1), H=h, H_KV=hkv, D=d, BS=kv.block_size, HALF=d // 2,
        BLOCK=_pow2(d // 2), ALIGN=_align(kv), num_warps=1 if d <= 128 else 2)
    return out


# --- the paged KV: store and decode attention ------------------------------------------------------
def _align(kv) -> int:
    """Elements in 16 bytes when every K/V row a kernel reads starts 16-byte aligned (the chunks are,
    ``KVPool._write_offsets`` checks it, so a head's row is when its bytes are a multiple of 16): the
    hint that lets a kernel load and store the gathered rows as 16-byte vectors (a load of unknown
    alignment is one element per instruction; the decode kernel also spilled registers then)."""
    elem = kv.anchor.element_size()
    return 16 // elem if (kv.head_dim * elem) % 16 == 0 else 1


def _page_n(kv, block_n: int) -> int:
    """Positions of one block in a decode tile of ``block_n`` (0: a block size that is not a power of
    two, whose tiles look each position's block up alone)."""
    bs = kv.block_size
    return min(bs, block_n) if bs & (bs - 1) == 0 else 0


def store_kv(kv, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [N, Hkv, D] (rows contiguous) into the pool at ``slots`` [N] (global slot ids; < 0: skip)."""
    n, hkv, d = k.shape
    hd = hkv * d
    tk.store_kv_kernel[(n,)](k, v, kv.anchor, kv.offsets, slots, layer, k.stride(0), v.stride(0),
                             kv.offsets.stride(0), kv.offsets.stride(1), BS=kv.block_size, HD=hd,
                             BLOCK=min(1024, _pow2(hd)), ALIGN=_align(kv))


DECODE_SPLIT = 64  # positions per span of the split decode (one tile for head_dim <= 128)
DECODE_PROGRAMS = 1024  # the split decode's programs to aim for: a few per SM (~5 fit on an H200's)


def decode_programs(batch: int, kv_heads: int, spans: int) -> int:
    """Split programs per (row, kv head): enough that ``batch`` rows make ~``DECODE_PROGRAMS`` in
    all, at most the ``spans`` the tables address. Fixed per batch size (a CUDA graph's launch), so
    a row longer than that many spans gives each program a few."""
    return max(1, min(spans, -(-DECODE_PROGRAMS // (batch * kv_heads))))


def paged_decode(kv, layer: int, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] (one token per row) attends to each row's ``lens[b]`` positions, read in place
    through ``tables`` [width, >= B] (block ids, column b = row b) -> [B, H, D].

    Split along the context (``decode_programs`` programs per row and kv head, each taking every
    so many spans of ``DECODE_SPLIT`` positions; one launch covers any length the tables address, as
    a CUDA graph needs), then the programs' parts merged: one program per (row, kv head) left a batch
    of one row with 8 programs on a GPU of 132 SMs, and one per span of the widest table launched
    thousands that found nothing to do."""
    b, h, d = q.shape
    group = h // kv.kv_heads
    out = torch.empty_like(q)
    split = DECODE_SPLIT if d <= 128 else DECODE_SPLIT // 2
    nsplit = decode_programs(b, kv.kv_heads, -(-tables.shape[0] * kv.block_size // split))
    part = torch.empty((b, h, nsplit, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((b, h, nsplit, 2), dtype=torch.float32, device=q.device)
    tk.paged_decode_split_kernel[(b, kv.kv_heads, nsplit)](
        q, part, ml, kv.anchor, kv.offsets, tables, lens, layer, d ** -0.5,
        q.stride(0), q.stride(1), tables.stride(0), tables.stride(1), kv.offsets.stride(0), kv.offsets.stride(1),
        H=h, H_KV=kv.kv_heads, GROUP=group, D=d, BS=kv.block_size, NSPLIT=nsplit, SPLIT=split,
        BLOCK_H=_pow2(group, 16), BLOCK_D=_pow2(d, 16), PAGE_N=_page_n(kv, split), ALIGN=_align(kv),
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    tk.paged_decode_combine_kernel[(b, h)](part, ml, lens, out, out.stride(0), out.stride(1), H=h, D=d,
                                           NSPLIT=nsplit, SPLIT=split, BLOCK_S=_pow2(nsplit),
                                           BLOCK_D=_pow2(d, 16), num_warps=4)
    return out


def paged_decode_unsplit(kv, layer: int, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """One program per (row, kv head): the step graphs' prefill rows (``paged_decode``'s per-program
    parts would cost ~1 MiB a row there), and the kernel ``paged_decode`` replaced."""
    b, h, d = q.shape
    group = h // kv.kv_heads
    out = torch.empty_like(q)
    block_n = 64 if d <= 128 else 32
    tk.paged_decode_kernel[(b, kv.kv_heads)](
        q, out, kv.anchor, kv.offsets, tables, lens, layer, d ** -0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0), tables.stride(1),
        kv.offsets.stride(0), kv.offsets.stride(1),
        H_KV=kv.kv_heads, GROUP=group, D=d, BS=kv.block_size, BLOCK_H=_pow2(group, 16), BLOCK_D=_pow2(d, 16),
        BLOCK_N=block_n, PAGE_N=_page_n(kv, block_n), ALIGN=_align(kv), IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2)
    return out
