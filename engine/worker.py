"""Ranks 1..N-1 of a tensor-parallel engine: join the group, get this rank's weights, then run the
steps rank 0 broadcasts until it says stop. No HTTP, no event loop."""

from __future__ import annotations

import signal

import structlog

from engine.config import EngineConfig, ModelConfig
from engine.distributed import init_group, leave_group
from engine.model_runner import ModelRunner
from engine.weights import load_weights

log = structlog.get_logger(__name__)


def run_worker(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    # rank 0 decides when the group stops; a terminal's Ctrl-C must not kill a rank mid-collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_group(cfg)
    if cfg.device == "cuda":
        import torch

        torch.cuda.set_device(cfg.tp_rank)
    weights = load_weights(cfg)
    runner = ModelRunner(cfg, model_cfg, weights.tensors)
    log.info("tp_worker_ready", rank=cfg.tp_rank)
    try:
        runner.worker_loop()
    except RuntimeError as e:  # rank 0 went away mid-collective: nothing left to serve
        log.warning("tp_worker_group_broken", rank=cfg.tp_rank, error=str(e))
        return 1
    finally:
        del runner
    leave_group(cfg)
    return 0
