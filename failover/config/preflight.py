"""Checks of the machine before `failover up` starts anything: model files and their tensor-parallel
split, free memory for the KV budgets, free ports, the router's CPUs, the batch files, the run dir,
and that a vLLM service's interpreter has vLLM and failover's plugin (failover.config.vllm_python).

Only `failover up` runs them (admin commands load the config without touching the machine); every
problem is reported at once, each naming its key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cache_daemon import owned
from cache_daemon.layout import undivided_by_tp
from failover.config.kv import block_bytes, min_pool_bytes, standby_bytes
from failover.config import vllm_python
from failover.config.schema import BatchConfig, Config, ConfigError, ModelConfig
from failover.procs import memory
from failover_common import cpus
from failover_common.ports import port_is_free
from failover_common.proc import pid_alive


def preflight(config: Config) -> None:
    """Check the machine before anything starts: model files, tp split, free ports, run dir."""
    problems = _check_model(config.model)
    if not problems:
        problems += _check_kv_floors(config)
    if not problems:
        problems += _check_memory(config)
    ports = [("router.port", config.router.host, config.router.port)]
    for i, svc in enumerate(config.service):
        ports += [(f"service[{i}] ({svc.name})", config.engine_host, p) for p in svc.ports]
    for key, host, port in ports:
        if not port_is_free(port, host):
            problems.append(f"{key}: port {port} is in use on {host}; stop what holds it or choose another port")
    if config.router.cpus:
        try:
            cpus.split(config.router.cpus)
        except ValueError as e:
            problems.append(f"router.cpus: {e}")
    problems += vllm_python.check(config)
    for i, svc in enumerate(config.service):
        if svc.batch is not None:
            problems += _check_batch_files(f"service[{i}].batch", svc.batch)
    run = config.run_path
    try:  # a symlink or another user's dir is refused here, before anything is created in it
        owned.check_private_dir(run)
    except (owned.UntrustedPath, OSError) as e:
        problems.append(f"run_dir: {e}")
        run_ok = False
    else:
        run_ok = True
    if run_ok and (other := _live_supervisor(run)) is not None:
        problems.append(f"run_dir: `failover up` (pid {other}) is already running with {run}; "
                        "stop it, or use another run_dir")
    if problems:
        raise ConfigError(config.source, problems)


def _check_batch_files(key: str, batch: BatchConfig) -> list[str]:
    """The input must be readable and the output appendable: refused before any work is done."""
    problems = []
    src = Path(batch.input)
    if not src.exists():
        problems.append(f"{key}.input: {src} does not exist; give a JSONL file or a folder of *.jsonl files")
    elif src.is_dir() and not any(p.suffix == ".jsonl" for p in src.iterdir()):
        problems.append(f"{key}.input: folder {src} holds no *.jsonl file")
    out = Path(batch.output)
    if out.exists() or out.is_symlink():
        if not out.is_symlink() and not out.is_file():
            problems.append(f"{key}.output: {out} is not a regular file; give a file path for the results")
            return problems
        try:  # ours, not a symlink, nobody else may write it (owned.py); then: can we append?
            owned.check_private_file(out, mode=batch.output_mode, what="batch output")
            os.close(os.open(out, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW))
        except owned.UntrustedPath as e:
            problems.append(f"{key}.output: {e}")
        except OSError as e:
            problems.append(f"{key}.output: cannot write {out}: {e.strerror}; fix its permissions or choose another path")
        return problems
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        problems.append(f"{key}.output: cannot create {out}: {parent} is not a writable directory; "
                        "fix its permissions or choose another path")
    return problems


def _check_kv_floors(config: Config) -> list[str]:
    """A primary's pool must hold one sequence of the longest context, or its engine refuses to
    start; a standby's at least one block (a sequence that outgrows it waits for its growth)."""
    problems, m = [], config.model
    for i, svc in enumerate(config.service):
        if svc.command is not None:  # an external engine sizes its own cache
            continue
        floor = min_pool_bytes(m.path, m.dtype, m.tp, svc.max_model_len)
        if svc.kv_memory_bytes < floor:
            problems.append(f"service[{i}].kv_memory: {svc.kv_memory!r} holds no sequence of the model's "
                            f"longest context; the minimum is {floor} bytes ({_mib(floor)}) per rank; raise "
                            "it, or lower service.max_model_len")
        block = block_bytes(m.path, m.dtype, m.tp)
        if svc.standby_kv_memory is not None and svc.standby_kv_memory_bytes < block:
            problems.append(f"service[{i}].standby_kv_memory: {svc.standby_kv_memory!r} is less than one KV "
                            f"block; the minimum is {block} bytes ({_mib(block)}) per rank")
    return problems


def _check_memory(config: Config) -> list[str]:
    """One copy of the weights plus every pool (primaries, standbys' small pools, batch engines)
    must fit in free memory."""
    parts = []
    for svc in config.service:
        parts.append((f"{svc.name} primary", svc.kv_memory_bytes))
        if svc.standbys:
            parts.append((f"{svc.name} {svc.standbys} standby(s)", svc.standbys * standby_bytes(svc, config.model)))
    kv = sum(size for _, size in parts)
    weights = sum(f.stat().st_size for f in Path(config.model.path).glob("*.safetensors"))
    if config.model.device == "cpu":
        free, where = memory.free_bytes("cpu"), "MemAvailable in /proc/meminfo"
    else:
        weights //= config.model.tp
        free, where = memory.free_bytes("cuda"), "free memory of the emptiest GPU (nvidia-smi)"
    if free is None or kv + weights <= free:
        return []
    gib = 1 << 30
    shares = ", ".join(f"{name} {size / gib:.2f}" for name, size in parts)
    return [f"service[*].kv_memory: the instances' KV budgets ({kv / gib:.2f} GiB: {shares}) plus the "
            f"weights ({weights / gib:.2f} GiB) exceed {where} ({free / gib:.2f} GiB) by "
            f"{(kv + weights - free) / gib:.2f} GiB; lower kv_memory, standby_kv_memory or standbys"]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _live_supervisor(run: Path) -> int | None:
    """The pid in RUN_DIR/supervisor.pid when that process is a live `failover up`; a stale file
    (its process dead, or the pid reused by another program since a kill -9) is removed."""
    pid_file = run / "supervisor.pid"
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if not pid_alive(pid) or not _is_supervisor(pid):
        pid_file.unlink(missing_ok=True)
        return None
    return pid


def _is_supervisor(pid: int) -> bool:
    """Whether ``pid`` runs `failover up` (``python -m failover up ...`` or the ``failover`` script).
    A command line we may not read (another user's, hidepid) counts as one: refuse rather than race."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except FileNotFoundError:
        return False
    except PermissionError:
        return True
    return "up" in args and any(os.path.basename(a) == "failover" for a in args)


def _check_model(model: ModelConfig) -> list[str]:
    path = Path(model.path)
    if not path.is_dir():
        return [f"model.path: {model.path!r} does not exist; create a checkpoint there "
                f"(e.g. `failover tiny-model {model.path}`) or point to a Hugging Face model directory"]
    if not (path / "config.json").is_file():
        return [f"model.path: {model.path!r} has no config.json; point to a Hugging Face model directory"]
    try:
        hf = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        return [f"model.path: {path / 'config.json'} is not valid JSON: {e}"]
    return [f"model.tp: {model.tp} does not divide {field} = {value} of the model; use a tp that divides it"
            for field, value in undivided_by_tp(hf, model.tp)]
