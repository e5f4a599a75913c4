"""The command lines of the processes the supervisor starts, built from the node config in one place."""

from __future__ import annotations

import os
import sys

from failover.config.schema import Config, ServiceConfig
from failover_common import cpus


def daemon_argv(config: Config) -> list[str]:
    """``failover daemon`` options for this node's model (run as ``python -m cache_daemon``)."""
    m = config.model
    argv = ["--model", m.path, "--run-dir", config.run_dir, "--tp", str(m.tp), "--device", m.device,
            "--dtype", m.dtype, "--transform", m.transform, "--log-level", config.supervisor.log_level,
            "--progress", "off"]  # the supervisor shows the load's progress (failover.node.load_watch)
    vllm = next((s for s in config.service if s.engine == "vllm" and s.weights == "cache"), None)
    if vllm is not None:  # vLLM's own loading, packed for `--load-format failover` (docs/vllm.md)
        argv += ["--engine", "vllm", "--engine-python", vllm.engine_python or sys.executable,
                 *(f"--engine-arg={arg}" for arg in vllm.engine_args)]
        if vllm.max_model_len:
            argv.append(f"--engine-arg=--max-model-len={vllm.max_model_len}")
    return argv


def engine_argv(config: Config, svc: ServiceConfig, port: int, kv_bytes: int,
                kv_floor: int | None = None) -> list[str]:
    """``failover engine`` options for one instance: weights mapped from the daemon, never read;
    a KV pool of ``kv_bytes`` (a primary's or a standby's budget) that never goes below ``kv_floor``
    (a standby's budget, which may be less than one full context; None: the engine's default)."""
    m = config.model
    cap = ["--max-model-len", str(svc.max_model_len)] if svc.max_model_len else []
    if kv_floor is not None:
        cap += ["--kv-min-memory", str(kv_floor)]
    threads = cpu_threads(config, svc)
    if threads:
        cap += ["--cpu-threads", str(threads)]
    return [*cap, "--model", m.path, "--weights", "cache", "--socket", str(config.daemon_socket),
            "--host", config.engine_host, "--port", str(port), "--tp", str(m.tp), "--device", m.device,
            "--dtype", m.dtype, "--transform", m.transform, "--kv-memory", str(kv_bytes),
            "--max-batch", str(svc.max_batch), "--served-model-name", svc.name,
            # a batch engine is evicted, not drained: its runner re-sends whatever was cut off
            "--drain-timeout", "0" if svc.kind == "batch" else str(config.supervisor.drain_timeout),
            "--admin-token-file", str(config.engine_token_path),
            "--log-level", config.supervisor.log_level]


def cpu_threads(config: Config, svc: ServiceConfig) -> int:
    """Torch threads for each process of ``svc``'s engines (0: torch's default, one per core).

    ``service.cpu_threads`` when set. Else, on CPU, ``share`` of the cores the engines may run on
    among the engine processes that compute at once: each service's primary or batch engine, one per
    rank (standbys wait idle). Every engine at torch's default would ask for all the cores: then a
    step's threads wait at each op's barrier for one another's turn (docs/operations.md, "CPU
    threads"). With ``router.cpus`` the engines' cores are the others, all theirs: the router's are
    kept already. On CUDA torch's default stays: the host threads there mostly wait for the GPU."""
    if svc.cpu_threads is not None:
        return svc.cpu_threads
    if config.model.device != "cpu":
        return 0
    busy = config.model.tp * len(config.service)
    engines = cpus.placed()
    if engines is not None:
        return max(1, len(engines) // busy)
    return share(len(os.sched_getaffinity(0)), busy)


def share(cores: int, busy: int) -> int:
    """Threads for each of ``busy`` computing engine processes on ``cores``: one core is kept for
    the rest of the node (the router, the supervisor, a standby starting or warming up), the others
    shared out, at least one each. An engine whose threads fill every core has a step's op wait at
    its barrier whenever any other process runs (docs/operations.md, "CPU threads")."""
    return max(1, (cores - 1) // busy)


def external_argv(config: Config, svc: ServiceConfig, name: str, port: int) -> list[str]:
    """An external engine's command template (``service.command``) filled in."""
    assert svc.command is not None
    m = config.model
    values = {"model": m.path, "host": config.engine_host, "port": port, "name": name, "service": svc.name,
              "socket": config.daemon_socket, "tp": m.tp, "dtype": m.dtype, "device": m.device,
              "transform": m.transform, "kv_memory": svc.kv_memory_bytes, "run_dir": config.run_dir}
    return [part.format(**values) for part in svc.command]
