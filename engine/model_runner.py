"""Runs the model for one scheduled step on every rank of the tensor-parallel group.

Rank 0 (the HTTP server's process) plans a step and broadcasts it; ranks 1..N-1 loop on
``worker_loop`` and run the same step, so the all-reduces inside the model pair up and every rank's
KV cache holds the same positions. Every rank ends a step with the same logits; only rank 0 samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import AttentionBatch, KVCache
from engine.model import CausalLM

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """prefill: ``tokens`` holds each row's whole sequence (positions 0..len-1; rows are padded on the
    right to the longest). decode: one token per row at ``positions``. stop: the group shuts down."""

    kind: str  # "prefill" | "decode" | "grow" (slots[0] = new slot count) | "stop"
    slots: tuple[int, ...] = ()
    tokens: tuple = ()  # prefill: tuple of tuples of ids; decode: one id per row
    positions: tuple[int, ...] = ()


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg, self.model_cfg = cfg, model_cfg
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        self.dtype = getattr(torch, cfg.dtype)
        self.max_len = min(cfg.max_model_len or model_cfg.context_len, model_cfg.context_len)
        self.model = CausalLM.from_weights(model_cfg, weights, tp=cfg.tp, fp8=cfg.transform == "fp8-block",
                                           max_len=self.max_len, device=self.device)
        self.kv = KVCache.from_budget(cfg.kv_memory, cfg.max_batch, model_cfg.num_layers,
                                      model_cfg.num_kv_heads // cfg.tp, self.max_len, model_cfg.head_dim,
                                      self.dtype, self.device)
        log.info("kv_cache_allocated", slots=self.kv.num_slots, max_len=self.max_len, bytes=self.kv.nbytes)

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
        if plan.kind == "grow":
            self.kv.grow(plan.slots[0])
            log.info("kv_cache_grown", slots=self.kv.num_slots, bytes=self.kv.nbytes)
            return None
        dev = self.device
        slots = torch.tensor(plan.slots, dtype=torch.long, device=dev)
        if plan.kind == "prefill":
            # right padding is harmless: causal attention keeps real positions off the pad, and the
            # pad's KV (past each row's end) is overwritten by decode before anything attends to it
            lens = [len(t) for t in plan.tokens]
            longest = max(lens)
            tokens = torch.tensor([list(t) + [0] * (longest - len(t)) for t in plan.tokens], dtype=torch.long,
                                  device=dev)
            positions = torch.arange(longest, device=dev).unsqueeze(0).expand(len(lens), -1)
            hidden = self.model(tokens, self.kv, AttentionBatch(slots, positions, prefill=True))
            last = torch.tensor(lens, device=dev) - 1
            return self.model.logits(hidden[torch.arange(len(lens), device=dev), last])
        tokens = torch.tensor(plan.tokens, dtype=torch.long, device=dev).unsqueeze(1)
        pos = torch.tensor(plan.positions, dtype=torch.long, device=dev)
        hidden = self.model(tokens, self.kv, self._decode_batch(slots, pos, plan))
        return self.model.logits(hidden[:, -1])

    def _decode_batch(self, slots: torch.Tensor, pos: torch.Tensor, plan: StepPlan) -> AttentionBatch:
        n = max(plan.positions) + 1
        mask = None
        if min(plan.positions) + 1 != n:  # ragged contexts: mask each row's tail
            mask = (torch.arange(n, device=self.device) < (pos + 1).unsqueeze(1)).view(len(plan.slots), 1, 1, n)
        first = plan.slots[0]
        contiguous = plan.slots == tuple(range(first, first + len(plan.slots)))
        return AttentionBatch(slots, pos.unsqueeze(1), prefill=False, context_len=n, mask=mask,
                              slot_range=(first, first + len(plan.slots)) if contiguous else None)

    def all_logits(self, token_ids: list[int], slot: int = 0) -> torch.Tensor:
        """Logits of every position of one prompt (for parity checks); [T, V] float32."""
        with torch.inference_mode():
            tokens = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            positions = torch.arange(len(token_ids), device=self.device).unsqueeze(0)
            batch = AttentionBatch(torch.tensor([slot], device=self.device), positions, prefill=True)
            return self.model.logits(self.model(tokens, self.kv, batch))[0]
