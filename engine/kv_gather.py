"""Each row's blocks copied into contiguous K/V: CPU decode's fallback (rows whose blocks are
neither one strided view nor each its own, see ``engine.kv_cache``) and, on any device, a prefill
chunk's earlier positions. By runs of consecutive ids where the batch has few, else by index."""

from __future__ import annotations

import torch


def gather_buffer(pool, count: int) -> torch.Tensor:
    """[2 (k, v), count blocks] to gather into: on CPU a view of a buffer kept for the next layer
    and step (grown when needed; zeroed once, so that its unused part is finite), else a new tensor."""
    shape = (2, count, pool.block_size, pool.kv_heads, pool.head_dim)
    if pool.device.type != "cpu":
        return torch.empty(shape, dtype=pool.dtype, device=pool.device)
    numel = 2 * count * pool.block_size * pool.kv_heads * pool.head_dim
    if pool._scratch is None or pool._scratch.numel() < numel:
        pool._scratch = torch.zeros(numel, dtype=pool.dtype, device=pool.device)
    return pool._scratch[:numel].view(shape)

def gather(pool, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's blocks as contiguous positions: K and V, each [B, Hkv, context_len, D]."""
    parts = batch.reads
    count = sum(len(local) for _, _, local in parts)
    blocks = gather_buffer(pool, count)
    if batch.runs is not None and len(batch.runs) == 1:
        c, first, n = batch.runs[0]
        blocks.copy_(pool.chunks[c][:, layer, first:first + n])
    elif batch.runs is not None:  # one copy of each block, k and v together
        torch.cat([pool.chunks[c][:, layer, first:first + n] for c, first, n in batch.runs], dim=1, out=blocks)
    elif len(parts) == 1 and parts[0][1] is None:
        c, _, local = parts[0]
        for which in (0, 1):
            torch.index_select(pool.chunks[c][which, layer], 0, local, out=blocks[which])
    else:
        for which in (0, 1):
            for c, rows, local in parts:
                blocks[which].index_copy_(0, rows, pool.chunks[c][which, layer].index_select(0, local))
    seqs = count // batch.table_blocks
    flat = blocks.view(2, seqs, batch.table_blocks * pool.block_size, pool.kv_heads, pool.head_dim)
    flat = flat[:, :, :batch.context_len].transpose(2, 3)
    return flat[0], flat[1]
