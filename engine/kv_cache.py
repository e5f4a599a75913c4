"""The KV cache: one contiguous region per slot (sequence), sized from a memory budget.

Layout (per rank): ``k`` and ``v`` of shape [layers, slots, kv_heads_local, max_len, head_dim].
Per-slot contiguous rather than paged: a sequence owns a whole slot of ``max_len`` positions from
admission to finish, so the number of concurrent sequences is ``budget // bytes_per_slot`` (capped by
``--max-batch``). Simple and exact; the price is that a short sequence reserves a full context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVBudgetError(ValueError):
    """The KV memory budget cannot hold one sequence of the served context length."""


def bytes_per_slot(layers: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype) -> int:
    return 2 * layers * kv_heads * max_len * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class AttentionBatch:
    """Where this forward's tokens live in the cache.

    prefill: one sequence per row, tokens at positions 0..T-1 (shorter rows padded on the right).
    decode: one token per row at ``positions[:, 0]``.
    """

    slots: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B, T] long
    prefill: bool
    context_len: int = 0  # decode: longest context in the batch after this step
    mask: torch.Tensor | None = None  # decode: [B, 1, 1, context_len] bool, True where attended
    slot_range: tuple[int, int] | None = None  # decode: slots are exactly range(a, b) -> no gather


class KVCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device) -> None:
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = slots
        self.max_len = max_len
        self.bytes_per_slot = self.nbytes // slots

    @classmethod
    def from_budget(cls, budget: int, max_batch: int, layers: int, kv_heads: int, max_len: int,
                    head_dim: int, dtype: torch.dtype, device) -> KVCache:
        per_slot = bytes_per_slot(layers, kv_heads, head_dim, max_len, dtype)
        slots = min(max_batch, budget // per_slot)
        if slots < 1:
            raise KVBudgetError(f"--kv-memory {budget} bytes holds no sequence of {max_len} tokens "
                                f"(one needs {per_slot} bytes per rank); raise --kv-memory or lower "
                                f"--max-model-len")
        return cls(layers, slots, kv_heads, max_len, head_dim, dtype, device)

    def grow(self, slots: int) -> None:
        """More slots, existing ones kept in place (a standby taking over the memory a dead primary
        released). Peak memory is old + new pool while the running slots are copied over."""
        assert slots > self.num_slots
        # allocate both first: an out-of-memory error leaves the pool as it was
        new_k, new_v = (torch.zeros((t.shape[0], slots, *t.shape[2:]), dtype=t.dtype, device=t.device)
                        for t in (self.k, self.v))
        new_k[:, :self.num_slots] = self.k
        new_v[:, :self.num_slots] = self.v
        self.k, self.v = new_k, new_v
        self.num_slots = slots

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch: AttentionBatch) -> torch.Tensor:
        """Store this step's k/v and attend. q [B, H, T, D], k/v [B, Hkv, T, D] -> [B, H, T, D]."""
        kc, vc = self.k[layer], self.v[layer]
        if batch.prefill:
            t = q.shape[2]
            kc[batch.slots, :, :t] = k
            vc[batch.slots, :, :t] = v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        pos = batch.positions[:, 0]
        kc[batch.slots, :, pos] = k[:, :, 0]
        vc[batch.slots, :, pos] = v[:, :, 0]
        n = batch.context_len
        if batch.slot_range is not None:
            a, b = batch.slot_range
            keys, values = kc[a:b, :, :n], vc[a:b, :, :n]
        else:
            keys = kc[:, :, :n].index_select(0, batch.slots)
            values = vc[:, :, :n].index_select(0, batch.slots)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)
