"""Runs the model for one scheduled step on every rank of the tensor-parallel group.

Rank 0 (the HTTP server's process) plans a step and broadcasts it; ranks 1..N-1 loop on
``worker_loop`` and run the same step, so the all-reduces inside the model pair up and every rank's
KV cache holds the same positions. Every rank ends a step with the same logits; only rank 0 samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from engine import prepared
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVPool
from engine.layers import Rotary
from engine.model import CausalLM

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """prefill: ``tokens`` holds each row's tokens from position ``positions[row]`` on (default 0;
    rows are padded on the right to the longest; a row past 0 is a later chunk of a chunked prefill
    and runs alone). decode: one token per row at ``positions``. Each row's KV lives in the
    blocks of its ``block_tables`` row. rows: like decode, but rows may be prompt tokens being
    prefilled (a sequence's rows in position order, sharing its table), and the logits returned are
    those of ``sample_rows`` (CUDA step graphs, ``engine.cuda_graphs``). resize: the pool becomes
    ``chunks`` (block counts, see ``KVPool.plan_resize``). stop: the group shuts down."""

    kind: str  # "prefill" | "decode" | "rows" | "resize" | "capture" (the next CUDA graph) | "stop"
    tokens: tuple = ()  # prefill: tuple of tuples of ids; decode, rows: one id per row
    positions: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    chunks: tuple[int, ...] = ()
    sample_rows: tuple[int, ...] = ()


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        self.dtype = getattr(torch, cfg.dtype)
        if cfg.device == "cuda":
            # cuDNN's attention builds a plan per new shape: on an H200 a fresh engine's first wave
            # of 16 took 5.1 s, the next 0.5 s (bench/first_wave.py), which a promoted standby
            # paid after every failover. Flash / memory-efficient attention have no such start.
            torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
        self.max_len = model_cfg.served_len(cfg.max_model_len)
        t0 = time.perf_counter()
        # the module tree comes from the zygote when it prepared this model (engine.prepared)
        model, had_skeleton = prepared.skeleton(cfg.model, model_cfg, cfg.tp, cfg.transform == "fp8-block")
        t_skeleton = time.perf_counter()
        model.assign(weights)
        fused_layers = model.fuse()
        t_assign = time.perf_counter()
        model.rotary = Rotary(model_cfg.head_dim, model_cfg.rope_theta, model_cfg.rope_scaling, self.max_len,
                              self.device)
        self.model: CausalLM = model.eval()
        t_model = time.perf_counter()
        self.kv = KVPool.from_budget(cfg.kv_memory, floor=cfg.kv_min_memory, max_batch=cfg.max_batch, max_len=self.max_len,
                                     block_size=cfg.kv_block_size, layers=model_cfg.num_layers,
                                     kv_heads=model_cfg.num_kv_heads // cfg.tp, head_dim=model_cfg.head_dim,
                                     dtype=self.dtype, device=self.device)
        t_kv = time.perf_counter()
        # CUDA: decode through static buffers and batch buckets (engine.cuda_graphs), graphs captured
        # after the engine is ready (tp == 1: a captured all-reduce would need every rank in step)
        self.decoder = None
        if self.kv.fused:
            self.decoder = DecodeGraphs(self.model, self.kv, cfg.max_batch, self.max_len, self.device,
                                        capture=cfg.cuda_graphs and cfg.tp == 1, rows=cfg.graph_tokens)
        self.greedy: torch.Tensor | None = None  # the last decode's argmax ids, on the device
        log.info("kv_cache_allocated", blocks=self.kv.num_blocks, block_size=self.kv.block_size,
                 chunks=len(self.kv.chunks), max_len=self.max_len, bytes=self.kv.nbytes,
                 model_ms=_ms(t0, t_model), skeleton_ms=_ms(t0, t_skeleton), assign_ms=_ms(t_skeleton, t_assign),
                 rope_ms=_ms(t_assign, t_model), kv_ms=_ms(t_model, t_kv), buffers_ms=_ms(t_kv, time.perf_counter()),
                 prepared_model=had_skeleton, fused_qkv_layers=fused_layers[0], fused_gate_up_layers=fused_layers[1])

    @property
    def graphs_pending(self) -> bool:
        return self.decoder is not None and bool(self.decoder.pending)

    @property
    def graph_rows(self) -> int:
        """Rows of the largest step graph (0: none)."""
        return 0 if self.decoder is None else self.decoder.bmax

    def can_run_rows(self, rows: int) -> bool:
        """A step of ``rows`` rows (prompt tokens + decoding sequences) can run as one step graph."""
        return self.decoder is not None and self.cfg.tp == 1 and self.decoder.can_run(rows)

    @property
    def graphs_captured(self) -> int:
        return 0 if self.decoder is None else len(self.decoder.graphs)

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Rank 0: share the plan with the group, then execute it. Returns last-token logits [B, V]."""
        if self.cfg.tp > 1:
            dist.broadcast_object_list([plan], src=0)
        return None if plan.kind == "stop" else self.execute(plan)

    def worker_loop(self) -> None:
        """Ranks > 0: execute rank 0's plans until it says stop (or the group breaks)."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0].kind == "stop":
                return
            self.execute(box[0])

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        if plan.kind == "resize":
            start = time.perf_counter()
            self.kv.resize(plan.chunks)
            log.info("kv_cache_resized", blocks=self.kv.num_blocks, chunks=len(self.kv.chunks),
                     bytes=self.kv.nbytes, ms=round((time.perf_counter() - start) * 1e3, 1))
            return None
        if plan.kind == "capture":
            self.decoder.capture_next()
            return None
        dev = self.device
        self.greedy = None
        if plan.kind == "prefill":
            # right padding is harmless: causal attention keeps real positions off the pad, and the
            # pad's K/V is never written to the pool
            lens = [len(t) for t in plan.tokens]
            longest = max(lens)
            tokens = torch.tensor([list(t) + [0] * (longest - len(t)) for t in plan.tokens], dtype=torch.long,
                                  device=dev)
            hidden = self.model(tokens, self.kv, self.kv.prefill_batch(plan.block_tables, lens, plan.positions))
            last = torch.tensor(lens, device=dev) - 1
            return self.model.logits(hidden[torch.arange(len(lens), device=dev), last])
        if self.decoder is not None:
            sample = plan.sample_rows if plan.kind == "rows" else None
            logits, self.greedy = self.decoder.run(plan.tokens, plan.positions, plan.block_tables, sample)
            return logits
        tokens = torch.tensor(plan.tokens, dtype=torch.long, device=dev).unsqueeze(1)
        hidden = self.model(tokens, self.kv, self.kv.decode_batch(plan.block_tables, plan.positions))
        return self.model.logits(hidden[:, -1])

    def all_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits of every position of one prompt (for parity checks), written to the pool's first
        blocks (use on an idle runner); [T, V] float32."""
        with torch.inference_mode():
            tokens = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            table = tuple(range(-(-len(token_ids) // self.kv.block_size)))
            batch = self.kv.prefill_batch((table,), [len(token_ids)])
            return self.model.logits(self.model(tokens, self.kv, batch))[0]


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1e3, 1)
