"""Rank 0's life: open the port, build the engine on its thread, serve, drain on SIGTERM, exit.

Shutdown, in order (each step bounded):
1. stop admitting: ``/ready`` and new requests get 503;
2. wait up to ``--drain-timeout`` for in-flight requests to finish;
3. close the listener and cancel handlers still running (1 s);
4. stop the engine thread (it tells ranks > 0 to stop) and end the worker processes (5 s, then kill).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import structlog
import torch
from aiohttp import web

from engine import prepared
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, ModelConfig
from engine.distributed import init_group, spawn_workers, stop_workers
from engine.llm_engine import LLMEngine
from engine.metrics import PREFIX, EngineMetrics
from engine.model_runner import ModelRunner
from engine.protocol import ServingContext
from engine.server import EngineServer
from engine.weights import LoadedWeights, load_weights
from failover_common import gc_pauses

log = structlog.get_logger(__name__)


def build_engine(cfg: EngineConfig, model_cfg: ModelConfig, keep: dict, started: float | None = None) -> LLMEngine:
    """Join the TP group, get the weights, allocate KV, warm up. Runs on the engine thread.
    ``started``: when the process began serving (perf_counter), for the log."""
    t0 = time.perf_counter()
    init_group(cfg)
    if cfg.device == "cuda":
        import torch

        torch.cuda.set_device(cfg.tp_rank)
        torch.cuda.init()  # the context now, so the phases below are timed apart from it
    t_context = time.perf_counter()
    weights: LoadedWeights = load_weights(cfg)
    keep["weights"] = weights  # the mapping must outlive the model
    t_weights = time.perf_counter()
    runner = ModelRunner(cfg, model_cfg, weights.tensors)
    t_model_kv = time.perf_counter()
    tokenizer, had_tokenizer = prepared.tokenizer(cfg.model)  # from the zygote when it prepared this model
    engine = LLMEngine(runner, tokenizer, model_cfg.eos_token_ids + tokenizer.eos_token_ids)
    t_runner = time.perf_counter()
    engine.warmup(cfg.warmup_batch)
    t_warm = time.perf_counter()
    # where a start goes (bench/relaunch.py prints these per round); before_ms: the process's own
    # start before the build (the listener, the engine thread)
    log.info("engine_built", before_ms=_ms(started, t0) if started is not None else None,
             context_ms=_ms(t0, t_context), weights_ms=_ms(t_context, t_weights),
             model_kv_ms=_ms(t_weights, t_model_kv), tokenizer_ms=_ms(t_model_kv, t_runner),
             prepared_tokenizer=had_tokenizer, warmup_ms=_ms(t_runner, t_warm), total_ms=_ms(t0, t_warm))
    return engine


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1e3, 1)


async def serve(cfg: EngineConfig, model_cfg: ModelConfig, argv: list[str],
                admin_token: bytes | None = None) -> int:
    started, started_perf = time.monotonic(), time.perf_counter()
    loop = asyncio.get_running_loop()
    stop, outcome = asyncio.Event(), {"code": 0}

    def fail(reason: str) -> None:
        print(f"failover engine: {reason}", file=sys.stderr, flush=True)
        outcome["code"] = 1
        stop.set()

    metrics = EngineMetrics(cfg.model_name)
    pauses = gc_pauses.watch(metrics.registry, PREFIX, loop, log, install=False)  # once ready (below)
    keep: dict = {}
    engine = AsyncEngine(lambda: build_engine(cfg, model_cfg, keep, started_perf), on_step=metrics.set_queue,
                         on_fatal=lambda e: loop.call_soon(fail, f"the engine failed: {e}"),
                         on_graphs=metrics.set_graphs)
    server = EngineServer(cfg, engine, metrics, admin_token)
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
    except OSError as e:
        await runner.cleanup()
        print(f"failover engine: cannot listen on {cfg.host}:{cfg.port}: {e}; pick another --port",
              file=sys.stderr)
        return 1
    log.info("listening", host=cfg.host, port=cfg.port, pid=os.getpid(), model=str(cfg.model))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    workers = spawn_workers(argv, cfg) if cfg.tp > 1 else []
    engine.start()
    ready_task = asyncio.create_task(_await_ready(cfg, engine, server, keep, started, fail, pauses))
    watch_task = asyncio.create_task(_watch_workers(workers, fail))
    await stop.wait()
    watch_task.cancel()

    if server.state == "ready" and outcome["code"] == 0:  # 1-2: stop admitting, let in-flight finish
        await server.drain(cfg.drain_timeout)
    ready_task.cancel()
    await runner.cleanup()  # 3
    await loop.run_in_executor(None, engine.stop)  # 4
    stop_workers(workers)
    pauses.remove()
    log.info("stopped", code=outcome["code"])
    return outcome["code"]


async def _watch_workers(workers, fail) -> None:
    """A rank that exits on its own breaks the group: end this engine too (the supervisor relaunches)."""
    while workers:
        for rank, proc in enumerate(workers, start=1):
            if proc.poll() is not None:
                fail(f"tensor-parallel rank {rank} exited with code {proc.returncode}; see its log")
                return
        await asyncio.sleep(0.2)


async def _await_ready(cfg, engine: AsyncEngine, server: EngineServer, keep: dict, started: float, fail,
                       pauses: gc_pauses.GcPauses) -> None:
    try:
        built = await engine.wait_ready()
    except Exception as e:  # noqa: BLE001 - any build failure ends the process with its reason
        log.error("engine_build_failed", error=str(e), kind=type(e).__name__)
        fail(str(e))
        return
    weights = keep["weights"]
    ctx = ServingContext(cfg.model_name, built.tokenizer, built.max_len, built.runner.model_cfg.vocab_size)
    frozen = gc_pauses.freeze()  # before the first request: what start built is never walked again
    pauses.install()  # every collection from now on is a pause of serving
    server.set_ready(ctx, {
        "model": cfg.model_name, "weights_source": weights.source, "weights_seconds": round(weights.seconds, 4),
        "startup_seconds": round(time.monotonic() - started, 3), "max_model_len": built.max_len, "tp": cfg.tp,
        "device": cfg.device, "dtype": cfg.dtype, "pid": os.getpid(), "cpu_threads": torch.get_num_threads(),
        "gc_frozen_objects": frozen,
    })
    server.metrics.weights_seconds.labels(cfg.model_name, weights.source).set(weights.seconds)
