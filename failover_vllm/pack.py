"""The daemon's loader child for vLLM's layout: ``python -m failover_vllm.pack ...`` (spawned by
``cache_daemon.loading`` with ``--engine vllm``, under the interpreter that has vllm).

It runs vLLM's own loading in this process (vLLM's config from the same flags the instances get,
``DefaultModelLoader``: fused ``qkv_proj`` / ``gate_up_proj``, the rank's TP shard, then
``process_weights_after_loading`` with the CPU GEMM pre-pack left out, see failover_vllm.layout),
takes every tensor of the result (failover_vllm.layout.named_tensors), packs them into one arena
(memfd on CPU, CUDA VMM on GPU: cache_daemon.loader.ArenaWriter) and registers it with the daemon
under the vLLM fingerprint (failover_vllm.fingerprint). Then it exits; the arena outlives it.

With ``--tp N`` > 1 this process only starts and relays one packer per rank (failover_vllm.ranks):
vLLM shards while it loads, inside a real tensor-parallel group, so each rank is a process of its
own (``--rank R --dist-port P``), which runs :func:`pack` for its shard.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import structlog

from cache_daemon.loader import ArenaWriter, Progress, register, run_child
from cache_daemon.manifest import ITEMSIZE, Manifest, plan

from .ranks import free_port, pack_ranks

log = structlog.get_logger(__name__)


class PackError(RuntimeError):
    pass


class _Spec:
    __slots__ = ("name", "dtype", "shape", "attrs")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], kind: str) -> None:
        self.name, self.dtype, self.shape, self.attrs = name, dtype, shape, {"kind": kind}


def vllm_config(model: str, dtype: str, tp: int, device: str, engine_args: list[str]):
    """vLLM's config as an instance with these flags builds it (unknown server-only flags ignored)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns, _unknown = parser.parse_known_args(["--model", model, "--dtype", dtype,
                                            "--tensor-parallel-size", str(tp), *engine_args])
    ns.load_format = "auto"  # this process reads the checkpoint: vLLM's own loading
    return EngineArgs.from_cli_args(ns).create_engine_config()


def load_model(vc, device: str, rank: int, port: int):
    """vLLM's model, loaded from disk by vLLM as rank ``rank`` of an instance would: this process is
    that rank of a tensor-parallel group of ``vc``'s size, rendezvousing on ``port``."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    from .layout import cpu_gemm

    tp = vc.parallel_config.tensor_parallel_size
    if device == "cpu":
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()  # as vLLM's CPU worker does: no accelerator calls
        # vLLM's CPU tp group names its shared-memory all-reduce after this (cpu_worker does the same)
        os.environ["VLLM_DIST_IDENT"] = f"failover-pack-{port}"
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    with set_current_vllm_config(vc):
        init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}", rank, current_platform.dist_backend)
        ensure_model_parallel_initialized(tp, 1)
        with cpu_gemm("shared"):  # the arena holds the unpacked weights (failover_vllm.layout)
            return get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=vc.model_config)


def _leave_group() -> None:
    """Tear the tensor-parallel group down (its gloo sockets, vLLM's CPU shared-memory all-reduce)."""
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def pack(chan: socket.socket, args: argparse.Namespace) -> None:
    from .fingerprint import vllm_cache_config
    from .layout import named_tensors

    t0 = time.perf_counter()
    rank = args.rank or 0
    vc = vllm_config(args.model, args.dtype, args.tp, args.device, args.engine_arg)
    model = load_model(vc, args.device, rank, args.dist_port or free_port())
    loaded_s = time.perf_counter() - t0
    tensors, aliases = named_tensors(model)
    specs = []
    for name, kind, t in tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in ITEMSIZE:
            raise PackError(f"{name} is {dtype}, which the arena format cannot hold yet")
        specs.append(_Spec(name, dtype, tuple(t.shape), kind))
    entries, size = plan(specs)
    kinds: dict[str, int] = {}
    for _n, kind, t in tensors:
        kinds[kind] = kinds.get(kind, 0) + t.nbytes
    config = vllm_cache_config(vc, tp_rank=rank)
    progress = Progress(chan, size)
    index = 0 if args.device == "cpu" else _cuda_index()
    arena = ArenaWriter(size, args.device, index, args.chunk_bytes, f"vllm-{config.key}-r{rank}")
    try:
        for (name, _kind, t), entry in zip(tensors, entries, strict=True):
            arena.write(entry.offset, t.contiguous())
            progress.add(entry.nbytes)
        progress.add(size - sum(e.nbytes for e in entries), force=True)
        register(chan, config, Manifest(tuple(entries), aliases, (arena.spec,)), arena)
    finally:
        arena.close()
        del model, tensors
        _leave_group()
    log.info("vllm_rank_packed", rank=rank, key=config.key, tensors=len(entries), aliases=len(aliases),
             bytes=size, bytes_by_kind=kinds, vllm_load_s=round(loaded_s, 3),
             seconds=round(time.perf_counter() - t0, 3))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m failover_vllm.pack")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--chunk-bytes", type=int, default=0)
    p.add_argument("--channel-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--engine-arg", action="append", default=[])
    p.add_argument("--rank", type=int, default=None, help="this process packs one rank (of --tp ranks)")
    p.add_argument("--dist-port", type=int, default=0, help="with --rank: the tp group's rendezvous port")
    return p.parse_args(argv)


def _cuda_index() -> int:
    import torch

    return torch.cuda.current_device()


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def load(chan: socket.socket) -> None:
        if args.rank is not None and not 0 <= args.rank < args.tp:
            raise PackError(f"--rank {args.rank} is not one of the {args.tp} ranks")
        if args.tp > 1 and args.rank is None:
            pack_ranks(chan, args)  # one process per rank, each running pack() below
        else:
            pack(chan, args)

    # any failure of vLLM's loading is this load's failure, reported to the daemon
    name = "vllm-loader" if args.rank is None else f"vllm-loader-r{args.rank}"
    return run_child(args, name, load, (Exception,), event="vllm_pack_failed", traceback=True)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
