"""``failover daemon`` / ``python -m cache_daemon``: parse options, validate the checkpoint, serve.

The checkpoint is validated here, from its headers, before anything is spawned: a missing shard, a
dtype or shape that contradicts config.json, or a tp size that does not divide the heads ends the
command at once with exit status 2 and one line that says what is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import structlog

from .errors import CacheError, CheckpointError
from .layout import COMPUTE_DTYPES, open_checkpoint, resolve_dtype, validate
from failover_common.logs import configure_logging
from failover_common.proc import die_with_parent
from .settings import DaemonSettings, default_run_dir
from .transforms import TRANSFORM_VERSIONS

log = structlog.get_logger(__name__)
DTYPES = ["auto", *COMPUTE_DTYPES]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="failover daemon", description="Run the per-node weight cache daemon.")
    p.add_argument("--model", required=True, type=Path, help="Hugging Face checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: one arena per rank")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: config.json's torch_dtype")
    p.add_argument("--transform", choices=sorted(TRANSFORM_VERSIONS), default="none")
    p.add_argument("--run-dir", type=Path, default=default_run_dir(),
                   help=f"0700 dir for daemon.sock and daemon.ready (default {default_run_dir()})")
    p.add_argument("--force", action="store_true", help="take the socket over from a live daemon")
    p.add_argument("--client-timeout", type=float, default=10.0,
                   help="seconds a connected client may stay silent before it has attached")
    p.add_argument("--frame-timeout", type=float, default=5.0,
                   help="seconds a frame may take from its first byte to its last (also after attach)")
    p.add_argument("--max-buffered-mib", type=int, default=256,
                   help="MiB of partly received frames held for all clients together; a frame that would "
                        "pass it closes its connection")
    p.add_argument("--allow-uid", type=int, action="append", default=[],
                   help="also serve this uid (repeatable); the daemon's own uid is always served")
    p.add_argument("--chunk-mib", type=int, default=0, help="CUDA: physical chunk size in MiB (0: one chunk)")
    p.add_argument("--die-with-parent", action="store_true", help="exit (SIGTERM) when the parent process dies")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--progress", default="auto", choices=["auto", "bar", "events", "off"],
                   help="the load's progress: a bar on stderr (bar), load_progress log events (events), "
                        "none (off); auto: a bar on a terminal, events otherwise")
    p.add_argument("--engine", choices=["failover", "vllm"], default="failover",
                   help="whose layout to pack: failover (the bundled engine) or vllm (vLLM's own loading, "
                        "mapped by `--load-format failover`; docs/vllm.md)")
    p.add_argument("--engine-python", default="", help="vllm: the interpreter that has vllm installed")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="vllm: one of vLLM's engine flags that decide the weights (repeatable, e.g. "
                        "--engine-arg=--quantization=fp8)")
    return p.parse_args(argv)


def build_settings(a: argparse.Namespace) -> DaemonSettings:
    """Validate the checkpoint for this tp size and resolve ``--dtype auto``."""
    ckpt = open_checkpoint(a.model)
    if a.engine == "failover":  # vLLM checks its own architectures when it loads (failover_vllm.pack)
        validate(ckpt, a.tp)
    # vLLM resolves "auto" itself (failover_vllm.pack, as its instances do): the fingerprint has the result
    dtype = a.dtype if a.engine == "vllm" else resolve_dtype(a.dtype, ckpt.config)
    # absolute(), not resolve(): a run dir that is a symlink is refused (owned.py), never followed
    return DaemonSettings(model=ckpt.path, dtype=dtype, tp=a.tp, device=a.device, transform=a.transform,
                          run_dir=a.run_dir.absolute(), force=a.force, client_timeout=a.client_timeout,
                          frame_timeout=a.frame_timeout, max_buffered=a.max_buffered_mib << 20,
                          allow_uids=frozenset(a.allow_uid), chunk_bytes=a.chunk_mib << 20,
                          die_with_parent=a.die_with_parent, log_level=a.log_level, progress=a.progress,
                          engine=a.engine, engine_python=a.engine_python, engine_args=tuple(a.engine_arg))


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    configure_logging(a.log_level, process="cache-daemon")
    try:
        settings = build_settings(a)
    except (CheckpointError, ValueError) as e:
        print(f"failover daemon: {e}", file=sys.stderr)
        return 2
    if settings.die_with_parent:
        die_with_parent(signal.SIGTERM)
    from .server import Daemon

    daemon = Daemon(settings)
    try:
        code = asyncio.run(daemon.run())
    except CacheError as e:
        print(f"failover daemon: {e}", file=sys.stderr)
        return 1
    if daemon.failure:
        print(f"failover daemon: load failed: {daemon.failure}", file=sys.stderr)
    return code
