"""The tensor-parallel group: rank 0 (the server) starts ranks 1..N-1 as child processes.

Each worker is ``python -m engine.cli <same options> --tp-rank R --dist-init tcp://127.0.0.1:P``;
it dies with rank 0 (PR_SET_PDEATHSIG, tied to the main thread that spawns it) and is ended
SIGTERM-then-SIGKILL when rank 0 stops. Collectives: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
from datetime import timedelta

import structlog

from engine.config import EngineConfig
from failover_common.proc import die_with_parent

log = structlog.get_logger(__name__)


def spawn_workers(argv: list[str], cfg: EngineConfig) -> list[subprocess.Popen]:
    """Start ranks 1..tp-1 with this process's own options; call from the main thread."""
    workers = []
    for rank in range(1, cfg.tp):
        args = [sys.executable, "-m", "engine.cli", *argv, "--tp-rank", str(rank), "--dist-init", cfg.dist_init]
        workers.append(subprocess.Popen(args, preexec_fn=functools.partial(die_with_parent, signal.SIGKILL)))
        log.info("tp_worker_started", rank=rank, pid=workers[-1].pid)
    return workers


def stop_workers(workers: list[subprocess.Popen], timeout: float = 5.0) -> None:
    for proc in workers:
        if proc.poll() is None:
            proc.terminate()
    for proc in workers:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def init_group(cfg: EngineConfig) -> None:
    """Join the group (blocks until every rank has joined). No-op for tp == 1."""
    if cfg.tp == 1:
        return
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if cfg.device == "cuda":
        torch.cuda.set_device(cfg.tp_rank)
        backend = "nccl"
    dist.init_process_group(backend, init_method=cfg.dist_init, rank=cfg.tp_rank, world_size=cfg.tp,
                            timeout=timedelta(seconds=120))
    log.info("tp_group_joined", rank=cfg.tp_rank, size=cfg.tp, backend=backend)


def leave_group(cfg: EngineConfig) -> None:
    if cfg.tp > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
