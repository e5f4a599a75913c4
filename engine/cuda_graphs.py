"""Decode on CUDA: static input buffers, batch-size buckets, and CUDA graphs captured per bucket.

A decode step of ``n`` rows runs as the smallest bucket (1, 2, 4, 8, 16, 32, ..., then
``max_batch``) that holds it, its extra rows padded (slot -1: nothing written; length 0: attention
gives zeros). Its inputs (token, position, slot, context length and block table of each row) are
written into one pinned host buffer and sent with one copy; greedy tokens are taken on the device
(argmax inside the step), and the caller copies them back once. So eager and graph steps run the
very same kernels on the very same shapes, and a captured graph is exact replay of the eager step.

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


def buckets_for(max_batch: int) -> tuple[int, ...]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


class DecodeGraphs:
    def __init__(self, model, kv, max_batch: int, max_len: int, device: torch.device, capture: bool) -> None:
        self.model, self.kv, self.device = model, kv, device
        self.buckets = buckets_for(max_batch)
        self.bmax, self.width = self.buckets[-1], -(-max_len // kv.block_size)
        rows = 4 + self.width  # token, position, slot, length, then the table's columns
        self.host = torch.zeros((rows, self.bmax), dtype=torch.long)
        if device.type == "cuda":  # a non-blocking copy needs page-locked memory
            self.host = self.host.pin_memory()
        self.host_np = self.host.numpy()  # the same memory, written with numpy (cheaper per call)
        self.dev = torch.zeros((rows, self.bmax), dtype=torch.long, device=device)
        self.tokens, self.positions, self.slots, self.lens = self.dev[0], self.dev[1], self.dev[2], self.dev[3]
        self.tables = self.dev[4:]  # [width, bmax]: column b is row b's block table
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

    def run(self, tokens, positions, block_tables) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: (logits [n, V] float32, greedy ids [n]); both views of buffers the next
        step overwrites."""
        n = len(tokens)
        bucket = self.bucket(n)
        self._load(tokens, positions, block_tables, bucket)
        if bucket in self.graphs:
            graph, logits, greedy = self.graphs[bucket]
            graph.replay()
        else:
            logits, greedy = self._forward(bucket)
        return logits[:n], greedy[:n]

    def _load(self, tokens, positions, block_tables, bucket: int) -> None:
        bs, h = self.kv.block_size, self.host_np
        n = len(tokens)
        used = max(-(-(p + 1) // bs) for p in positions)
        h[:4, n:bucket] = 0  # padded rows: token 0 at position 0, no slot, length 0
        h[2, n:bucket] = -1
        h[0, :n] = tokens
        h[1, :n] = positions
        h[2, :n] = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)]
        h[3, :n] = h[1, :n] + 1
        for row, table in enumerate(block_tables):
            k = min(used, len(table))
            h[4:4 + k, row] = table[:k]
        # one copy of the rows this step reads; the tables' unused cells stay whatever they were
        # (never read: each row reads only its length's blocks)
        self.dev[:4 + used].copy_(self.host[:4 + used], non_blocking=True)

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = AttentionBatch(self.positions[:bucket].unsqueeze(1), False, (), slots=self.slots[:bucket],
                               tables=self.tables, lens=self.lens[:bucket])
        hidden = self.model(self.tokens[:bucket].unsqueeze(1), self.kv, batch)
        logits = self.model.logits(hidden[:, -1])
        return logits, logits.argmax(-1)

    def capture_next(self) -> bool:
        """Capture the next bucket's graph (inputs padded: the capture's warm-up run writes no KV);
        False when there is nothing left to capture."""
        if not self.pending:
            return False
        bucket = self.pending.pop(0)
        start = time.perf_counter()
        self.host_np[:4] = 0
        self.host_np[2] = -1
        self.dev[:4].copy_(self.host[:4], non_blocking=True)
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
