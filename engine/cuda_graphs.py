"""Decode on CUDA: static input buffers, batch-size buckets, and CUDA graphs captured per bucket.

A decode step of ``n`` rows runs as the smallest bucket (1, 2, 4, 8, 16, 32, ..., then
``max_batch``) that holds it, its extra rows padded (slot -1: nothing written; length 0: attention
gives zeros). Its inputs (token, position, slot, context length and block table of each row) are
written into one pinned host buffer and sent with one copy; greedy tokens are taken on the device
(argmax inside the step), and the caller copies them back once. So eager and graph steps run the
very same kernels on the very same shapes, and a captured graph is exact replay of the eager step.

Steps that prefill run the same way (``run`` with ``sample``): each prompt token being prefilled is
one more row (its token, position, slot and its sequence's block table), so a step of a few short
prompts (the streams a promoted standby takes over, a new request beside running ones) is one graph
replay instead of an eager forward, whose Python launches cost ~1 ms a layer on an H200. The
attention kernel reads each row's positions up to its own, the step's K/V stored first, which is
causal prefill. Buckets past ``max_batch`` (up to ``graph_tokens`` rows) exist for these steps only:
their logits are taken for the sampled rows alone (at most ``max_batch``: one per sequence), and
their attention runs one program per (row, kv head), without the split decode's per-span buffers.

Graphs are captured one bucket at a time, largest first (they share one memory pool, which the
largest sizes), by ``capture_next`` between two engine steps: the engine is ready, and serving,
before any graph exists; a bucket without its graph runs eagerly. The buffers and the pool's
``anchor``/``offsets`` (``engine.kv_cache``) never move, so a KV resize leaves every graph valid.

Owned by the engine thread (through ``ModelRunner``).
"""

from __future__ import annotations

import time

import structlog
import torch

from engine.kv_cache import AttentionBatch

log = structlog.get_logger(__name__)


def buckets_for(max_batch: int, rows: int = 0) -> tuple[int, ...]:
    """Powers of two up to ``max_batch``, then on to ``rows`` (the step graphs that prefill)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    b = 1 << max_batch.bit_length()
    while b < rows:
        sizes.append(b)
        b *= 2
    if rows > max_batch:
        sizes.append(rows)
    return tuple(sizes)


class DecodeGraphs:
    def __init__(self, model, kv, max_batch: int, max_len: int, device: torch.device, capture: bool,
                 rows: int = 0) -> None:
        self.model, self.kv, self.device, self.max_batch = model, kv, device, max_batch
        self.buckets = buckets_for(max_batch, rows if capture else 0)
        self.bmax, self.width = self.buckets[-1], -(-max_len // kv.block_size)
        self.eager_rows = False  # prefill steps eagerly through these buffers too (tests, comparisons)
        rows = 5 + self.width  # token, position, slot, length, sampled row, then the table's columns
        self.host = torch.zeros((rows, self.bmax), dtype=torch.long)
        if device.type == "cuda":  # a non-blocking copy needs page-locked memory
            self.host = self.host.pin_memory()
        self.host_np = self.host.numpy()  # the same memory, written with numpy (cheaper per call)
        self.dev = torch.zeros((rows, self.bmax), dtype=torch.long, device=device)
        self.tokens, self.positions, self.slots, self.lens = self.dev[0], self.dev[1], self.dev[2], self.dev[3]
        self.sampled = self.dev[4, :max_batch]  # the rows whose logits a bucket past max_batch takes
        self.tables = self.dev[5:]  # [width, bmax]: column b is row b's block table
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pending = list(reversed(self.buckets)) if capture else []
        self.pool = None
        # one side stream for every bucket's warm-up and capture: cuBLAS keeps a workspace per stream
        # (32 MiB on Hopper), so a new stream per bucket cost ~0.2 GiB per engine
        self.stream: torch.cuda.Stream | None = None
        self.capture_seconds = 0.0

    @property
    def live(self) -> bool:
        """Every bucket has its graph."""
        return len(self.graphs) == len(self.buckets)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def can_run(self, rows: int) -> bool:
        """A step of ``rows`` rows (prefill tokens + decode rows) has a bucket with its graph."""
        return rows <= self.bmax and (self.eager_rows or self.bucket(rows) in self.graphs)

    def run(self, tokens, positions, block_tables, sample=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of one token per row: (logits [n, V] float32, greedy ids [n]), for every row or,
        with ``sample`` (row indices, at most ``max_batch``), for those rows in that order; both
        views of buffers the next step overwrites. Rows of one sequence share its table object."""
        n = len(tokens)
        bucket = self.bucket(n)
        self._load(tokens, positions, block_tables, bucket, sample)
        if bucket in self.graphs:
            graph, logits, greedy = self.graphs[bucket]
            graph.replay()
        else:
            logits, greedy = self._forward(bucket)
        if sample is None:
            return logits[:n], greedy[:n]
        if bucket > self.max_batch:  # the graph took the sampled rows' logits itself
            return logits[:len(sample)], greedy[:len(sample)]
        rows = self.sampled[:len(sample)]  # sent with the step's inputs
        return logits.index_select(0, rows), greedy.index_select(0, rows)

    def _load(self, tokens, positions, block_tables, bucket: int, sample) -> None:
        bs, h = self.kv.block_size, self.host_np
        n = len(tokens)
        used = max(-(-(p + 1) // bs) for p in positions)
        h[:4, n:bucket] = 0  # padded rows: token 0 at position 0, no slot, length 0
        h[2, n:bucket] = -1
        h[0, :n] = tokens
        h[1, :n] = positions
        h[2, :n] = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)]
        h[3, :n] = h[1, :n] + 1
        if sample is not None:
            h[4, :self.max_batch] = 0
            h[4, :len(sample)] = sample
        start = 0  # each run of rows sharing one table (a prefill's tokens) is written at once
        for row in range(1, n + 1):
            if row == n or block_tables[row] is not block_tables[start]:
                table = block_tables[start]
                k = min(used, len(table))
                h[5:5 + k, start:row] = [[b] for b in table[:k]]  # broadcast over the run's columns
                start = row
        # one copy of the rows this step reads; the tables' unused cells stay whatever they were
        # (never read: each row reads only its length's blocks)
        self.dev[:5 + used].copy_(self.host[:5 + used], non_blocking=True)

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = bucket > self.max_batch  # a prefill step's bucket (see the module doc)
        batch = AttentionBatch(self.positions[:bucket].unsqueeze(1), False, (), slots=self.slots[:bucket],
                               tables=self.tables, lens=self.lens[:bucket], split=not rows)
        hidden = self.model(self.tokens[:bucket].unsqueeze(1), self.kv, batch)[:, -1]
        if rows:
            hidden = hidden.index_select(0, self.sampled)
        logits = self.model.logits(hidden)
        return logits, logits.argmax(-1)

    def capture_next(self) -> bool:
        """Capture the next bucket's graph (inputs padded: the capture's warm-up run writes no KV);
        False when there is nothing left to capture."""
        if not self.pending:
            return False
        bucket = self.pending.pop(0)
        start = time.perf_counter()
        self.host_np[:5] = 0
        self.host_np[2] = -1
        self.dev[:5].copy_(self.host[:5], non_blocking=True)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(bucket)  # warm-up outside the capture (cuBLAS handles, Triton binaries)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=side):
                logits, greedy = self._forward(bucket)
        except RuntimeError as e:  # e.g. out of memory: serve eagerly from here on, not crash
            log.warning("decode_graph_failed", bucket=bucket, error=str(e))
            self.pending = []
            return False
        self.graphs[bucket] = (graph, logits, greedy)
        took = time.perf_counter() - start
        self.capture_seconds += took
        log.info("decode_graph_captured", bucket=bucket, ms=round(took * 1e3, 1), left=len(self.pending))
        if self.live:
            # the warm-ups' activations sit in the allocator's cache: hand them back to the device
            # (a standby would hold them unused; the graphs' own pool stays)
            torch.cuda.empty_cache()
            log.info("cuda_graphs_live", buckets=list(self.buckets), seconds=round(self.capture_seconds, 3))
        return bool(self.pending)
