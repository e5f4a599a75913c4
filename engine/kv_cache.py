"""The paged KV pool: fixed-size blocks of positions, held in a list of chunk tensors.

Layout (per rank): chunk ``c`` is one tensor [2 (k, v), layers, blocks_c, block_size, kv_heads_local,
head_dim]; block ids are global, chunk ``c`` holding ids ``starts[c] .. starts[c] + blocks_c - 1``,
and a slot is one position of one block, ``block * block_size + offset``.
Which sequence holds which block is the block manager's business (``engine.block_manager``); the
pool only stores K/V where a step's block tables say.

Why chunks: growing appends chunks and shrinking drops free chunks at the tail, so neither copies a
block that is in use (a standby takes over a dead primary's memory with its sequences running, and
gives memory back to a batch engine later). Each allocation is split into ``CHUNKS_PER_ALLOCATION``
chunks so that a shrink can release part of it.

Attention: prefill attends to its own fresh K/V (there is no prefix reuse) and only writes the
cache. Decode on CUDA (``fused``) reads the blocks in place: one Triton kernel per layer rotates q
and k and stores k/v at their slots, another attends through the block tables (``engine.fused``),
reaching every chunk from one base pointer (``anchor``) plus an element offset per (k or v, layer, block)
(``offsets``, rewritten at each resize; the anchor and the offsets tensor never move, so CUDA graphs
captured over them stay valid). Decode on CPU attends, with no copy, on one strided view of the
pool when the rows' blocks are consecutive and equally spaced (``strided``, ``engine.kv_arena``), on
each row's own view when they are consecutive but not equally spaced (a ragged batch: ``own``,
``engine.kv_rows``); else it gathers each row's blocks into contiguous K/V and runs SDPA on them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from engine import fused
from engine.config import KV_BLOCK_SIZE, kv_block_bytes
from engine.kv_arena import Arena, equally_spaced
from engine.kv_gather import gather
from engine.kv_rows import attend_rows, consecutive_rows

log = structlog.get_logger(__name__)
DEFAULT_BLOCK_SIZE = KV_BLOCK_SIZE
CHUNKS_PER_ALLOCATION = 4
MAX_RUNS_FLOOR = 16  # a CPU gather copies run by run while it has at most this many, or a quarter of its blocks
# (chunk, rows of the step's flat index list or None for all rows in order, ids inside the chunk)
Part = tuple[int, torch.Tensor | None, torch.Tensor]


class KVBudgetError(ValueError):
    """The KV memory budget cannot hold one sequence of the served context length."""


def bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return kv_block_bytes(layers, kv_heads, head_dim, block_size, str(dtype).removeprefix("torch."))


@dataclass
class AttentionBatch:
    """Where this forward's tokens live in the pool; built by ``KVPool.prefill_batch`` /
    ``decode_batch`` once per step and read by every layer.

    prefill: one sequence per row, tokens at positions 0..T-1 (shorter rows padded on the right; the
    pad is never written). decode: one token per row at ``positions[:, 0]``.
    """

    positions: torch.Tensor  # [B, T] long
    prefill: bool
    writes: tuple[Part, ...]  # the step's real tokens (rows of the flat [B*T] list) -> slots
    reads: tuple[Part, ...] = ()  # decode: entries of the flat [B, table_blocks] tables -> blocks
    # CPU: the same flat tables as (chunk, first local id, blocks) runs of consecutive ids, in order
    # (one copy per run; None when the tables are too fragmented for that to pay, see ``_runs``)
    runs: tuple[tuple[int, int, int], ...] | None = None
    table_blocks: int = 0  # decode: blocks per row in the gathered K/V
    context_len: int = 0  # decode: longest context in the batch after this step
    mask: torch.Tensor | None = None  # decode: [B, 1, 1, context_len] bool, True where attended
    # the fused (CUDA) path: where each token's k/v goes, [B*T] global slots (< 0: padding, not
    # written); decode: block tables [width, >= B] (column b = row b) and context lengths [B]
    slots: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    split: bool = True  # fused decode: split along the context (False: one program per row, kv head)
    # CPU decode with no gather: (first id, spacing): row r's blocks are the ``table_blocks``
    # consecutive ids from ``first + r * spacing`` (``kv_arena.equally_spaced``)
    strided: tuple[int, int] | None = None
    own: tuple[tuple[int | torch.Tensor, int], ...] | None = None  # or one view a row (kv_rows)

    @property
    def rotating(self) -> bool:  # a fused (CUDA) decode: ``KVPool.attend_rotating`` takes q/k before RoPE
        return self.slots is not None and not self.prefill


class KVPool:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device, *, min_blocks: int, max_blocks: int) -> None:
        self.layers, self.kv_heads, self.head_dim, self.block_size = layers, kv_heads, head_dim, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.bytes_per_block = bytes_per_block(layers, kv_heads, head_dim, block_size, dtype)
        self.min_blocks, self.max_blocks = min_blocks, max_blocks  # the floor .. max_batch full contexts
        self.chunks: list[torch.Tensor] = []
        self.starts: list[int] = []
        self.fused = fused.available(self.device)
        # CPU: the gathered K and V, reused (fresh pages per layer cost 2-3x the gather at 16 x 512)
        self._scratch: torch.Tensor | None = None  # flat; K then V, see engine.kv_gather
        # CPU: every chunk a view of one reserved range (engine.kv_arena), so one view spans chunks
        # (not for the fused kernels, the Triton interpreter's on CPU: they read blocks in place)
        self._arena = None if self.device.type != "cpu" or self.fused else Arena.reserve(
            (2, layers, max_blocks, block_size, kv_heads, head_dim), dtype)
        if self.fused:  # see the module doc: what the kernels address the chunks through
            self.anchor = torch.empty(64, dtype=dtype, device=self.device)
            self.offsets = torch.zeros((2, layers, max_blocks), dtype=torch.long, device=self.device)

    @classmethod
    def from_budget(cls, budget: int, *, floor: int | None = None, max_batch: int, max_len: int,
                    block_size: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device) -> KVPool:
        """A pool of ``budget`` bytes (per rank), at most ``max_batch`` sequences of ``max_len`` tokens
        (more could never be used), and never below ``floor`` bytes, by default one sequence of
        ``max_len`` tokens (so the oldest sequence can always finish). A smaller floor (a standby's
        pool, at least one block) lets a sequence outgrow the pool: it then waits, preempted, until
        the pool is grown (``engine.scheduler``)."""
        per_seq = -(-max_len // block_size)
        block = bytes_per_block(layers, kv_heads, head_dim, block_size, dtype)
        min_blocks = per_seq if floor is None else floor // block
        if min_blocks < 1:
            raise KVBudgetError(f"--kv-min-memory {floor} bytes is less than one KV block "
                                f"({block} bytes per rank)")
        pool = cls(layers, kv_heads, head_dim, block_size, dtype, device, min_blocks=min(min_blocks, max_batch * per_seq),
                   max_blocks=max_batch * per_seq)
        blocks = min(pool.max_blocks, budget // pool.bytes_per_block)
        if blocks < pool.min_blocks:
            if floor is None:
                raise KVBudgetError(f"--kv-memory {budget} bytes holds no sequence of {max_len} tokens "
                                    f"(one needs {per_seq * pool.bytes_per_block} bytes per rank); raise "
                                    f"--kv-memory or lower --max-model-len")
            raise KVBudgetError(f"--kv-memory {budget} bytes is below --kv-min-memory {floor} "
                                f"({pool.min_blocks} blocks of {pool.bytes_per_block} bytes per rank)")
        pool.resize(_split(blocks))
        return pool

    @property
    def num_blocks(self) -> int:
        return sum(self.chunk_blocks)

    @property
    def chunk_blocks(self) -> tuple[int, ...]:
        return tuple(c.shape[2] for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    # --- grow and shrink -----------------------------------------------------------------------
    def plan_resize(self, budget: int, free_tail: int) -> tuple[int, ...]:
        """The chunk sizes that bring the pool as close to ``budget`` bytes as it may go, given that
        the top ``free_tail`` blocks are free: grow by new chunks; shrink by dropping tail chunks that
        are wholly free, the last one dropped replaced by a smaller one if that overshoots."""
        target = max(self.min_blocks, min(self.max_blocks, budget // self.bytes_per_block))
        chunks, total = list(self.chunk_blocks), self.num_blocks
        if target > total:
            return (*chunks, *_split(target - total))
        used_top = total - free_tail  # below this a used block would go
        keep = max(target, used_top)
        while chunks and total > keep and total - chunks[-1] >= used_top:  # (a dropped chunk's blocks are lost)
            total -= chunks.pop()
        if total < keep:
            chunks.append(keep - total)
        return tuple(chunks)

    def resize(self, chunks: tuple[int, ...]) -> None:
        """Make the chunk list ``chunks`` (from ``plan_resize``; every rank applies the same one):
        chunks that stay are kept in place, the others dropped, new ones appended (zeroed on the gather
        path, where garbage in a block would reach attention through a masked NaN). A grow drops
        nothing and allocates before appending, so an out-of-memory error leaves the pool as it was;
        a shrink frees before it allocates its (smaller) replacement chunk, so it never needs more
        memory than it had."""
        self._scratch = None  # sized by the batches seen: a shrunk (standby) pool gives it back
        keep = 0
        while keep < min(len(chunks), len(self.chunks)) and chunks[keep] == self.chunks[keep].shape[2]:
            keep += 1
        dropped = len(self.chunks) > keep
        if dropped and self._arena is not None:
            self._arena.release(self.starts[keep], self.num_blocks)
        del self.chunks[keep:], self.starts[keep:]
        if dropped and self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the memory back to the driver, not just to torch's cache
        shape = (2, self.layers, 0, self.block_size, self.kv_heads, self.head_dim)
        # the fused kernels never load a position past a row's length (masked loads), so their
        # chunks need no zeroing: that memset was a GPU-wide pass over every GiB a promotion adds
        make = torch.empty if self.fused else torch.zeros
        new, at = [], self.num_blocks
        for n in chunks[keep:]:
            new.append(self._arena.chunk(at, n) if self._arena is not None else
                       make(shape[:2] + (n,) + shape[3:], dtype=self.dtype, device=self.device))
            at += n
        for chunk in new:
            self.starts.append(self.num_blocks)
            self.chunks.append(chunk)
        if self.fused:
            self._write_offsets()

    def _write_offsets(self) -> None:
        """``offsets[which, layer, block]``: elements from the anchor to that block's first position."""
        elem, per_block = self.anchor.element_size(), self.block_size * self.kv_heads * self.head_dim
        for start, chunk in zip(self.starts, self.chunks):
            n = chunk.shape[2]
            gap = chunk.data_ptr() - self.anchor.data_ptr()
            # the kernels load and store K/V rows as 16-byte vectors (engine.fused._align)
            assert gap % 16 == 0, "chunks are allocated 16-byte aligned"
            which_layer = torch.arange(2 * self.layers).view(2, self.layers, 1)
            local = (which_layer * n + torch.arange(n).view(1, 1, n)) * per_block + gap // elem
            self.offsets[:, :, start:start + n].copy_(local)

    # --- a step's index ------------------------------------------------------------------------
    def prefill_batch(self, tables: tuple[tuple[int, ...], ...], lens: list[int],
                      starts: tuple[int, ...] = ()) -> AttentionBatch:
        """Row r's tokens at positions ``starts[r] .. starts[r] + lens[r] - 1`` (default start 0). A
        row that starts past 0 (a later chunk of a chunked prefill) goes alone: it attends to its
        positions before ``start``, read from the pool, and to its own fresh K/V."""
        longest, bs = max(lens), self.block_size
        start = starts[0] if starts else 0
        assert start == 0 or len(lens) == 1, "a prefill chunk past position 0 runs alone"
        positions = (start + torch.arange(longest, device=self.device)).unsqueeze(0).expand(len(lens), -1)
        slots = [table[p // bs] * bs + p % bs for table, n in zip(tables, lens) for p in range(start, start + n)]
        rows = None if min(lens) == longest else [r * longest + p for r, n in enumerate(lens) for p in range(n)]
        prefix = {}
        if start:
            width = -(-start // bs)
            ids = list(tables[0][:width])
            prefix = dict(reads=self._by_chunk(ids, None, 1), runs=self._runs(ids), table_blocks=width,
                          context_len=start)
        if self.fused:
            padded = [table[p // bs] * bs + p % bs if p < start + n else -1 for table, n in zip(tables, lens)
                      for p in range(start, start + longest)]
            return AttentionBatch(positions, True, (), slots=torch.tensor(padded, dtype=torch.long).to(self.device),
                                  **prefix)
        return AttentionBatch(positions, True, self._by_chunk(slots, rows, bs), **prefix)

    def decode_batch(self, tables: tuple[tuple[int, ...], ...], positions: tuple[int, ...]) -> AttentionBatch:
        bs, dev = self.block_size, self.device
        n = max(positions) + 1
        width = -(-n // bs)
        flat = [b for t in tables for b in (*t[:width], *self._pad(t[:width], width))]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        mask = None
        if min(positions) + 1 != n:  # ragged contexts: mask each row's tail
            mask = (torch.arange(n, device=dev) < (pos + 1).unsqueeze(1)).view(len(positions), 1, 1, n)
        strided = None if self._arena is None else equally_spaced(tables, width, self.num_blocks)
        if strided is not None:
            return AttentionBatch(pos.unsqueeze(1), False, self._by_chunk(slots, None, bs), table_blocks=width,
                                  context_len=n, mask=mask, strided=strided)
        own = None if self._arena is None else consecutive_rows(tables, positions, bs)
        if own is not None:
            return AttentionBatch(pos.unsqueeze(1), False, self._by_chunk(slots, None, bs), own=own)
        return AttentionBatch(pos.unsqueeze(1), False, self._by_chunk(slots, None, bs),
                              self._by_chunk(flat, None, 1), None if self.fused else self._runs(flat),
                              width, n, mask)

    def _pad(self, table, width: int) -> tuple[int, ...]:
        """Blocks that fill a short row up to ``width``: any real block will do (it is masked; every
        block holds finite values, chunks being zeroed on the gather path). The ids after the row's last
        block when they lie in its chunk (the gather's run of that block goes on), else its first block
        (staying in the row's chunk keeps the gather to as few chunks as possible)."""
        pad, last = width - len(table), table[-1]
        if last + pad < self._chunk_end(self._chunk_of(last)):
            return tuple(range(last + 1, last + 1 + pad))
        return (table[0],) * pad

    def _runs(self, ids: list[int]) -> tuple[tuple[int, int, int], ...] | None:
        """``ids`` as runs of consecutive ids inside one chunk: (chunk, first local id, length). None
        when there are many short runs (a fragmented pool): a copy per run then costs more in calls
        than the per-chunk index gather (two copies of each block when the ids span chunks)."""
        if self.fused or not ids:
            return None
        runs: list[list[int]] = []
        end = -1  # the global id after the current run's last, within its chunk
        for i in ids:
            if i == end:
                runs[-1][2] += 1
                end += 1
                if end == self._chunk_end(runs[-1][0]):
                    end = -1  # a run never crosses into the next chunk
                continue
            c = self._chunk_of(i)
            runs.append([c, i - self.starts[c], 1])
            end = i + 1 if i + 1 < self._chunk_end(c) else -1
        if len(runs) > max(MAX_RUNS_FLOOR, len(ids) // 4):
            return None
        return tuple(tuple(r) for r in runs)

    def _chunk_of(self, block: int) -> int:
        """The chunk that holds global block id ``block``."""
        return bisect.bisect_right(self.starts, block) - 1

    def _chunk_end(self, c: int) -> int:
        """The global block id after chunk ``c``'s last."""
        return self.starts[c] + self.chunks[c].shape[2]

    def _by_chunk(self, ids: list[int], rows: list[int] | None, unit: int) -> tuple[Part, ...]:
        """Split global ``ids`` (blocks for unit 1, slots for unit block_size) by chunk."""
        def t(xs):
            return None if xs is None else torch.tensor(xs, dtype=torch.long, device=self.device)

        if len(self.chunks) == 1:
            return ((0, t(rows), t(ids)),)
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for n, i in enumerate(ids):
            c = self._chunk_of(i // unit)
            where, local = groups.setdefault(c, ([], []))
            where.append(n if rows is None else rows[n])
            local.append(i - self.starts[c] * unit)
        if len(groups) == 1 and rows is None:
            (c, (_, local)), = groups.items()
            return ((c, None, t(local)),)
        return tuple((c, t(where), t(local)) for c, (where, local) in groups.items())

    # --- attention -----------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch: AttentionBatch) -> torch.Tensor:
        """Store this step's k/v and attend. q [B, H, T, D], k/v [B, Hkv, T, D] -> [B, H, T, D]."""
        b, hkv, t, d = k.shape
        if batch.slots is not None:
            fused.store_kv(self, layer, k.transpose(1, 2).reshape(b * t, hkv, d),
                           v.transpose(1, 2).reshape(b * t, hkv, d), batch.slots)
            if batch.prefill:
                return self._prefill_attention(layer, q, k, v, batch)
            attend = fused.paged_decode if batch.split else fused.paged_decode_unsplit
            return attend(self, layer, q[:, :, 0], batch.tables, batch.lens).unsqueeze(2)
        for which, new in ((0, k), (1, v)):
            tokens = new.transpose(1, 2).reshape(b * t, hkv, d)  # [B*T, Hkv, D]
            for c, rows, local in batch.writes:
                dst = self.chunks[c][which, layer].view(-1, hkv, d)
                dst.index_copy_(0, local, tokens if rows is None else tokens.index_select(0, rows))
        if batch.prefill:
            return self._prefill_attention(layer, q, k, v, batch)
        g = q.shape[1] // hkv
        if batch.own:  # one token per row (decode)
            return attend_rows(self._arena.tensor[:, layer], q.reshape(b, hkv, g, d), batch.own).view(b, hkv * g, 1, d)
        if batch.strided:
            keys, values = self._arena.rows(layer, *batch.strided, b, batch.context_len)
        else:
            keys, values = gather(self, layer, batch)
        if t != 1:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)
        # one token per row: the G query heads sharing a kv head attend as G queries of that head, so
        # SDPA runs without its GQA path (which costs ~1.5x at 16 x 512 on CPU); row mask [B, 1, 1, S]
        o = F.scaled_dot_product_attention(q.reshape(b, hkv, g, d), keys, values, attn_mask=batch.mask)
        return o.view(b, hkv * g, 1, d)

    def attend_rotating(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope,
                        batch: AttentionBatch) -> torch.Tensor:
        """``attend`` of a fused decode step whose q/k are not rotated yet, rotation and K/V store in
        one kernel. q [B, 1, H, D], k/v [B, 1, Hkv, D] -> [B, H, 1, D]."""
        b, t, h, d = q.shape
        assert t == 1, "a decode step has one token per row"
        q = fused.rope_store_kv(self, layer, q.reshape(b, h, d), k.reshape(b, -1, d), v.reshape(b, -1, d),
                                rope.positions.reshape(b), rope.cos_table, rope.sin_table, batch.slots)
        attend = fused.paged_decode if batch.split else fused.paged_decode_unsplit
        return attend(self, layer, q, batch.tables, batch.lens).unsqueeze(2)

    def _prefill_attention(self, layer: int, q, k, v, batch: AttentionBatch) -> torch.Tensor:
        """Causal attention of a prefill's fresh q/k/v; a chunk past position 0 (one row) also
        attends to the ``context_len`` positions before it, gathered from the pool."""
        if not batch.context_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        start, t = batch.context_len, q.shape[2]
        old_k, old_v = gather(self, layer, batch)
        keys, values = torch.cat((old_k, k), dim=2), torch.cat((old_v, v), dim=2)
        # query i sits at position start + i and sees keys 0 .. start + i
        mask = torch.arange(start + t, device=q.device) <= start + torch.arange(t, device=q.device).unsqueeze(1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def _split(blocks: int, parts: int = CHUNKS_PER_ALLOCATION) -> tuple[int, ...]:
    q, r = divmod(blocks, parts)
    return tuple(n for n in [q + 1] * r + [q] * (parts - r) if n)
