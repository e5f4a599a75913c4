"""``failover engine``: serve one model over the OpenAI API, weights mapped from the daemon or read
from disk.

Safe to call in a freshly forked child of a process that imported ``engine`` and torch (the
zygote): threads, the event loop and CUDA are all created here, after the fork.
Exit codes: 0 after a clean drain, 1 on a runtime failure (weights, bind, engine), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import signal
import sys
from pathlib import Path

import structlog
import torch  # loaded already by engine.serve below; named here for --cpu-threads

from cache_daemon.layout import resolve_dtype as resolve_checkpoint_dtype, undivided_by_tp
from cache_daemon.settings import SOCKET_NAME, default_run_dir
from engine.admin_auth import read_token
from engine.config import DTYPES, KV_BLOCK_SIZE, TRANSFORMS, WEIGHT_SOURCES, ConfigError, EngineConfig, ModelConfig
# Imported here, not in main(): a zygote that imports engine.cli then pays for torch, aiohttp and the
# model code once, before it forks. Importing them starts no thread, event loop or CUDA context.
from engine.serve import serve
from engine.worker import run_worker
from failover_common.logs import configure_logging
from failover_common.ports import free_port  # the tp rendezvous port: below the ephemeral range
from failover_common.sizes import parse_size

log = structlog.get_logger(__name__)


def parse_bytes(text: str) -> int:
    """``1073741824``, ``256MiB``, ``1.5GB`` -> bytes (failover_common.sizes: KiB binary, KB decimal)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="failover engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    p.add_argument("--weights", choices=WEIGHT_SOURCES, default="auto",
                   help="cache: map from the daemon or fail; disk: read safetensors; auto: cache when "
                        "the daemon socket exists, else disk")
    p.add_argument("--socket", type=Path, default=None,
                   help=f"the cache daemon's socket (default: {default_run_dir() / SOCKET_NAME})")
    p.add_argument("--host", default="127.0.0.1",
                   help="listen address (default: %(default)s; the port has an admin endpoint)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ranks 1.. run as child processes)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="compute dtype; auto: the checkpoint's torch_dtype (must match the daemon's)")
    p.add_argument("--transform", choices=TRANSFORMS, default="none", help="weight transform (fp8-block)")
    p.add_argument("--kv-memory", type=parse_bytes, default=256 << 20,
                   help="KV cache budget per rank: bytes, or with a unit (256MiB, 1GiB; KB/MB/GB are decimal)")
    p.add_argument("--kv-min-memory", type=parse_bytes, default=None,
                   help="smallest pool per rank this engine starts with or shrinks to (default: one sequence "
                        "of the longest context). Below that a sequence that outgrows the pool waits until the "
                        "pool grows: a standby's small pool, grown when it is promoted")
    p.add_argument("--kv-block-size", type=int, default=KV_BLOCK_SIZE, help="positions per KV cache block")
    p.add_argument("--max-batch", type=int, default=16, help="most sequences decoded together")
    p.add_argument("--warmup-batch", type=int, default=1,
                   help="sequences in one warm-up wave run to the end before /ready")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="CUDA: let attention use cuDNN (faster steady decode, but each new shape's first "
                        "use is slow: a promoted standby's first requests pay it)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens prefilled per step while other sequences decode (0: whole prompts)")
    p.add_argument("--graph-tokens", type=int, default=256,
                   help="CUDA graphs: a step of at most this many rows (prompt tokens being prefilled plus "
                        "decoding sequences) runs as one graph replay, so short prompts and migrated streams "
                        "are prefilled without Python's per-kernel launch cost; 0: prefill eagerly")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default, one per core); engines computing at once "
                        "on one node should not ask for more than its cores together")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="CUDA: decode eagerly, capture no graphs (they are captured after /ready otherwise)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + completion tokens")
    p.add_argument("--served-model-name", default="", help="the model id clients send (default: dir name)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to finish in-flight requests after SIGTERM")
    p.add_argument("--max-body-bytes", type=parse_bytes, default=4 << 20, help="request body size cap")
    p.add_argument("--admin-token-file", type=Path, default=None,
                   help="0600 file with the bearer token for POST /admin/kv (without it: 403)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dist-init", default="", help=argparse.SUPPRESS)
    return p


def _hf_config(model: Path) -> dict:
    try:
        return json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def resolve_dtype(model: Path, dtype: str) -> str:
    return resolve_checkpoint_dtype(dtype, _hf_config(model))  # the daemon resolves auto there too


def make_config(args: argparse.Namespace) -> EngineConfig:
    dist_init = args.dist_init or (f"tcp://127.0.0.1:{free_port()}" if args.tp > 1 else "")
    return EngineConfig(
        model=args.model, weights=args.weights, socket=args.socket or default_run_dir() / SOCKET_NAME, host=args.host, port=args.port,
        tp=args.tp, tp_rank=args.tp_rank, dist_init=dist_init, device=args.device,
        dtype=resolve_dtype(args.model, args.dtype), transform=args.transform, kv_memory=args.kv_memory,
        kv_min_memory=args.kv_min_memory, kv_block_size=args.kv_block_size,
        max_batch=args.max_batch, max_model_len=args.max_model_len, served_model_name=args.served_model_name,
        drain_timeout=args.drain_timeout, max_body_bytes=args.max_body_bytes,
        admin_token_file=args.admin_token_file, warmup_batch=args.warmup_batch,
        cudnn_attention=args.cudnn_attention, cuda_graphs=args.cuda_graphs,
        prefill_chunk=args.prefill_chunk, graph_tokens=args.graph_tokens, cpu_threads=args.cpu_threads,
    )


def preload(device: str) -> None:
    """What a zygote can do for its engines before it forks (no CUDA context, no thread)."""
    if device == "cuda":
        from engine import fused

        fused.preload()


def prepare(argv: list[str]) -> bool:
    """In a zygote that has just forked ``main(argv)``: prepare what the next engines of this model
    inherit (``engine.prepared``: tokenizer, meta-device model; no compute, no thread, no CUDA).
    Bad options are left to the forked engine to report. True when something new was prepared."""
    from engine import prepared

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text: the engine prints its own
            args = build_parser().parse_args(argv)
        model_cfg = ModelConfig.from_dir(args.model)
    except (SystemExit, ConfigError):
        return False
    return prepared.prepare(args.model, model_cfg, tp=args.tp, fp8=args.transform == "fp8-block")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = make_config(args)
        token = read_token(cfg.admin_token_file) if cfg.admin_token_file and cfg.tp_rank == 0 else None
        model_cfg = ModelConfig.from_dir(cfg.model)
        if undivided := undivided_by_tp(_hf_config(cfg.model), cfg.tp):
            raise ConfigError(f"--tp {cfg.tp} must divide " + " and ".join(f"{k} ({v})" for k, v in undivided))
    except ConfigError as e:
        print(f"failover engine: {e}", file=sys.stderr)
        return 2
    process = "engine" if cfg.tp_rank == 0 else f"engine-rank{cfg.tp_rank}"
    configure_logging(args.log_level, process=process)
    if cfg.cpu_threads:  # before any op: the pool is sized at the first parallel region
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.tp_rank > 0:
        return run_worker(cfg, model_cfg)
    try:  # ranks > 0 get the same options plus their rank
        return asyncio.run(serve(cfg, model_cfg, list(argv), token))
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main(sys.argv[1:]))
