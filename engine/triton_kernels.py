"""Triton kernels of the CUDA path: paged-KV store (with RoPE in a decode step) and decode attention,
RMSNorm (with the residual add), SwiGLU's ``silu(gate) * up``, and RoPE. ``engine.fused`` calls them (and holds the torch
reference of each, used on CPU); nothing else imports this module.

The paged KV is a list of chunk tensors (``engine.kv_cache``). A kernel reaches any block of any
chunk through one base pointer, the pool's ``anchor`` (a tensor of the KV dtype that lives as long
as the pool), plus an element offset per (k or v, layer, block) from ``KVPool.offsets``: chunks come
and go with a resize, the anchor and the offsets tensor stay, so a captured CUDA graph stays valid.

Elementwise kernels round where torch's eager ops round (each bf16 op's result), so the fused path
computes what the eager one does, up to the order of a reduction's sum.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["layer"])
def store_kv_kernel(k_ptr, v_ptr, anchor_ptr, offsets_ptr, slots_ptr, layer, stride_k, stride_v,
                    off_which, off_layer, BS: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr,
                    ALIGN: tl.constexpr):
    """One program per token: write its k and v (``HD`` = kv_heads * head_dim values) at its slot;
    a slot < 0 (a padded row) writes nothing. The slot's offset is a multiple of ``ALIGN`` elements
    (see ``_tile_bases``)."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        block = slot // BS
        within = (slot % BS) * HD
        base = offsets_ptr + layer * off_layer + block
        k_dst = tl.multiple_of(tl.load(base) + within, ALIGN)
        v_dst = tl.multiple_of(tl.load(base + off_which) + within, ALIGN)
        for start in range(0, HD, BLOCK):
            i = start + tl.arange(0, BLOCK)
            m = i < HD
            tl.store(anchor_ptr + k_dst + i, tl.load(k_ptr + t * stride_k + i, mask=m), mask=m)
            tl.store(anchor_ptr + v_dst + i, tl.load(v_ptr + t * stride_v + i, mask=m), mask=m)


@triton.jit
def _row_queries(q_ptr, stride_qb, stride_qh, b, kvh, GROUP: tl.constexpr, D: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row ``b``'s ``GROUP`` query heads of kv head ``kvh``, [BLOCK_H, BLOCK_D] (zeros past GROUP and
    D), with their head ids and the masks: what both decode kernels start from."""
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    hmask, dmask = hs < GROUP, ds < D
    heads = kvh * GROUP + hs
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + ds[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    return q, heads, ds, hmask, dmask


@triton.jit
def _tile_bases(k_offsets, off_which, tables_ptr, stride_tw, stride_tb, b, kvh, start, hi, H_KV: tl.constexpr,
                D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_N: tl.constexpr, ALIGN: tl.constexpr):
    """Element offsets (from the anchor) of kv head ``kvh``'s K and V at positions ``start ..
    start + BLOCK_N - 1`` of row ``b``, [BLOCK_N] each. The tile covers ``BLOCK_N // PAGE_N`` blocks
    (``PAGE_N`` = min(BS, BLOCK_N) positions of each): one table entry and one offset per block, not
    per position. Each offset is a multiple of ``ALIGN`` elements (16 bytes: the pool's chunks are
    allocated aligned and a head's row is a multiple of 16 bytes), which lets the K/V loads be 16-byte
    vectors; a block past ``hi`` reads block 0's offset (masked out by the caller)."""
    NB: tl.constexpr = BLOCK_N // PAGE_N
    page = start // BS + tl.arange(0, NB)
    pmask = page * BS < hi
    block = tl.load(tables_ptr + page * stride_tw + b * stride_tb, mask=pmask, other=0)
    first = (start % BS) * (H_KV * D) + kvh * D  # nonzero position in the block only when BS > BLOCK_N
    k0 = tl.load(k_offsets + block, mask=pmask, other=0) + first
    v0 = tl.load(k_offsets + off_which + block, mask=pmask, other=0) + first
    if PAGE_N == 1:  # blocks of one position (a reshape of [BLOCK_N, 1] lost the alignment hint)
        k_at, v_at = k0, v0
    else:
        within = tl.arange(0, PAGE_N) * (H_KV * D)
        k_at = tl.reshape(k0[:, None] + within[None, :], [BLOCK_N])
        v_at = tl.reshape(v0[:, None] + within[None, :], [BLOCK_N])
    return tl.multiple_of(k_at, ALIGN), tl.multiple_of(v_at, ALIGN)


@triton.jit
def _attend_span(q, anchor_ptr, k_offsets, off_which, tables_ptr, stride_tw, stride_tb, b, kvh, ds, dmask,
                 lo, hi, step, sm_scale, H_KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_N: tl.constexpr,
                 ALIGN: tl.constexpr, IEEE: tl.constexpr):
    """Row ``b``'s queries ``q`` [BLOCK_H, BLOCK_D] of kv head ``kvh`` against its positions in
    tiles of ``BLOCK_N`` starting at ``lo``, ``lo + step``, ... below ``hi`` (``lo`` and ``step``
    multiples of ``BLOCK_N``), read in place through ``tables[:, b]``: the unnormalised output and the
    online softmax's (max, sum), in fp32. Both decode kernels are this loop. ``PAGE_N`` 0: a block
    size that is not a power of two, whose tiles look each position's block up on its own."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, step):
        pos = start + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        if PAGE_N > 0:
            k_at, v_at = _tile_bases(k_offsets, off_which, tables_ptr, stride_tw, stride_tb, b, kvh, start, hi,
                                     H_KV, D, BS, BLOCK_N, PAGE_N, ALIGN)
        else:
            block = tl.load(tables_ptr + (pos // BS) * stride_tw + b * stride_tb, mask=pmask, other=0)
            within = (pos % BS) * (H_KV * D) + kvh * D
            k_at = tl.multiple_of(tl.load(k_offsets + block, mask=pmask, other=0) + within, ALIGN)
            v_at = tl.multiple_of(tl.load(k_offsets + off_which + block, mask=pmask, other=0) + within, ALIGN)
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(anchor_ptr + k_at[:, None] + ds[None, :], mask=kv_mask, other=0.0)
        v = tl.load(anchor_ptr + v_at[:, None] + ds[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(pmask[None, :], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["layer"])
def paged_decode_kernel(q_ptr, o_ptr, anchor_ptr, offsets_ptr, tables_ptr, lens_ptr, layer, sm_scale,
                        stride_qb, stride_qh, stride_ob, stride_oh, stride_tw, stride_tb, off_which, off_layer,
                        H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        PAGE_N: tl.constexpr, ALIGN: tl.constexpr, IEEE: tl.constexpr):
    """One program per (row, kv head): the row's ``GROUP`` query heads against its ``lens[row]``
    positions, read in place from the blocks of ``tables[:, row]``; online softmax in fp32.
    A row of length 0 (padding) gets zeros."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    q, heads, ds, hmask, dmask = _row_queries(q_ptr, stride_qb, stride_qh, b, kvh, GROUP, D, BLOCK_H, BLOCK_D)
    acc, m_i, l_i = _attend_span(q, anchor_ptr, offsets_ptr + layer * off_layer, off_which, tables_ptr,
                                 stride_tw, stride_tb, b, kvh, ds, dmask, 0, n, BLOCK_N, sm_scale,
                                 H_KV, D, BS, BLOCK_H, BLOCK_D, BLOCK_N, PAGE_N, ALIGN, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + ds[None, :],
             out.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, n, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: ``res = x + r`` (if given, rounded to x's dtype), then
    ``w * (res * rsqrt(mean(res^2) + eps)).to(dtype)``."""
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + row * stride_x + i, mask=m, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + i, mask=m, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + i, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n
    y = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + i, mask=m, other=0.0)
    tl.store(out_ptr + row * stride_o + i, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(g_ptr + row * stride_g + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + i, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + i, (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotated(x_ptr, cos_ptr, sin_ptr, i, m, HALF: tl.constexpr, dt: tl.constexpr):
    """One head's ``x * cos + rotate_half(x) * sin`` (``x_ptr`` its first element, ``cos_ptr`` /
    ``sin_ptr`` its position's table rows) as its two halves, rounded where torch's eager ops round:
    cos/sin to x's dtype, then each product and the sum."""
    x1 = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + i, mask=m, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + i, mask=m, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + i, mask=m, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + i, mask=m, other=0.0).to(dt).to(tl.float32)
    lo = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    hi = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    return lo.to(dt), hi.to(dt)


@triton.jit
def rope_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token, head): ``_rotated``."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    p = tl.load(pos_ptr + t)
    lo, hi = _rotated(x_ptr + t * stride_xt + h * stride_xh, cos_ptr + p * stride_c, sin_ptr + p * stride_c, i, m,
                      HALF, out_ptr.dtype.element_ty)
    base = out_ptr + t * stride_ot + h * stride_oh
    tl.store(base + i, lo, mask=m)
    tl.store(base + HALF + i, hi, mask=m)


@triton.jit(do_not_specialize=["layer"])
def rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, anchor_ptr, offsets_ptr, slots_ptr, pos_ptr, cos_ptr,
                         sin_ptr, layer, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                         stride_oh, stride_c, off_which, off_layer, H: tl.constexpr, H_KV: tl.constexpr,
                         D: tl.constexpr, BS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                         ALIGN: tl.constexpr):
    """A decode step's RoPE and K/V store in one launch (``rope_kernel`` twice and ``store_kv_kernel``
    were three a layer): one program per (token, head of q then of k): a q head rotated into
    ``q_out``; a k head rotated straight into the pool at the token's slot, with the same head of v
    copied beside it (a slot < 0, a padded row, writes nothing to the pool)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    p = tl.load(pos_ptr + t)
    dt = q_out_ptr.dtype.element_ty
    if h < H:
        lo, hi = _rotated(q_ptr + t * stride_qt + h * stride_qh, cos_ptr + p * stride_c, sin_ptr + p * stride_c, i, m,
                          HALF, dt)
        base = q_out_ptr + t * stride_ot + h * stride_oh
        tl.store(base + i, lo, mask=m)
        tl.store(base + HALF + i, hi, mask=m)
    else:
        slot = tl.load(slots_ptr + t)
        if slot >= 0:
            j = h - H
            lo, hi = _rotated(k_ptr + t * stride_kt + j * stride_kh, cos_ptr + p * stride_c, sin_ptr + p * stride_c,
                              i, m, HALF, dt)
            within = (slot % BS) * (H_KV * D) + j * D
            at = offsets_ptr + layer * off_layer + slot // BS
            k_dst = anchor_ptr + tl.multiple_of(tl.load(at) + within, ALIGN)
            v_dst = anchor_ptr + tl.multiple_of(tl.load(at + off_which) + within, ALIGN)
            tl.store(k_dst + i, lo, mask=m)
            tl.store(k_dst + HALF + i, hi, mask=m)
            v_src = v_ptr + t * stride_vt + j * stride_vh
            tl.store(v_dst + i, tl.load(v_src + i, mask=m), mask=m)
            tl.store(v_dst + HALF + i, tl.load(v_src + HALF + i, mask=m), mask=m)


@triton.jit(do_not_specialize=["layer"])
def paged_decode_split_kernel(q_ptr, part_ptr, ml_ptr, anchor_ptr, offsets_ptr, tables_ptr, lens_ptr, layer,
                              sm_scale, stride_qb, stride_qh, stride_tw, stride_tb, off_which, off_layer,
                              H: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                              BS: tl.constexpr, NSPLIT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr, PAGE_N: tl.constexpr, ALIGN: tl.constexpr,
                              IEEE: tl.constexpr):
    """``paged_decode_kernel`` split along the context (flash-decoding): ``NSPLIT`` programs per
    (row, kv head), so a short batch still fills the GPU. Program ``sp`` takes the row's spans of
    ``SPLIT`` positions ``sp``, ``sp + NSPLIT``, ... (a long context takes a few spans per program
    rather than more programs, most of which would find nothing to do), and writes their
    unnormalised output [GROUP, D] and the (max, sum) of their softmax to ``part``/``ml``
    [B, H, NSPLIT, ...]; ``paged_decode_combine_kernel`` merges them. A program past the row's
    length writes nothing."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    lo = sp * SPLIT
    if lo < n:
        q, heads, ds, hmask, dmask = _row_queries(q_ptr, stride_qb, stride_qh, b, kvh, GROUP, D, BLOCK_H, BLOCK_D)
        acc, m_i, l_i = _attend_span(q, anchor_ptr, offsets_ptr + layer * off_layer, off_which, tables_ptr,
                                     stride_tw, stride_tb, b, kvh, ds, dmask, lo, n, NSPLIT * SPLIT, sm_scale,
                                     H_KV, D, BS, BLOCK_H, BLOCK_D, SPLIT, PAGE_N, ALIGN, IEEE)
        row = (b * H + heads) * NSPLIT + sp  # [BLOCK_H]
        tl.store(part_ptr + row[:, None] * D + ds[None, :], acc, mask=hmask[:, None] & dmask[None, :])
        tl.store(ml_ptr + row * 2, m_i, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask)


@triton.jit
def paged_decode_combine_kernel(part_ptr, ml_ptr, lens_ptr, o_ptr, stride_ob, stride_oh, H: tl.constexpr,
                                D: tl.constexpr, NSPLIT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr,
                                BLOCK_D: tl.constexpr):
    """One program per (row, query head): the split programs' outputs merged by their softmax
    weights; a row of length 0 (padding) gets zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    spans = tl.minimum((n + SPLIT - 1) // SPLIT, NSPLIT)  # the programs that wrote
    ss = tl.arange(0, BLOCK_S)
    ds = tl.arange(0, BLOCK_D)
    smask, dmask = ss < spans, ds < D
    row = (b * H + h) * NSPLIT + ss
    m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(smask, tl.exp(m - top), 0.0)
    part = tl.load(part_ptr + row[:, None] * D + ds[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    num = tl.sum(part * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + ds, out.to(o_ptr.dtype.element_ty), mask=dmask)
