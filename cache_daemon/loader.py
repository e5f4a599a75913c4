"""The loader child: ``python -m cache_daemon.loader ...``, spawned by the daemon.

For each rank: read + shard + transform (``checkpoint.iter_rank_tensors``), pack into a fresh arena
(memfd or CUDA VMM), send the arena fds and the manifest to the daemon over an inherited socket,
wait for the daemon's acknowledgement, release its own mapping, go on. Then exit. On CUDA this
process is the only one of the daemon's that ever holds a CUDA context.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time

import structlog

from . import framing
from .checkpoint import iter_rank_tensors, rank_specs
from .errors import CacheError, ProtocolError
from .fingerprint import make_config
from .gpus import visible_uuids
from .layout import open_checkpoint, validate
from failover_common.logs import configure_logging
from .manifest import ArenaSpec, Manifest, plan
from failover_common.proc import die_with_parent
from .protocol import LoadFailed, LoadProgress, Register, Registered

log = structlog.get_logger(__name__)
PROGRESS_EVERY_S = 0.25  # LoadProgress frames to the daemon (which draws or logs them)


class ArenaWriter:
    """The loader's view of one arena, CPU or CUDA: write tensors, then hand over fds (also used by
    failover_vllm.pack, the loader child for vLLM's layout)."""

    def __init__(self, size: int, device: str, device_index: int, chunk_bytes: int, label: str) -> None:
        self.kind, self.device_index = device, device_index
        if device == "cpu":
            from .arena_cpu import CpuArenaWriter

            self._cpu, self._cuda = CpuArenaWriter(size, label), None
            self.chunks = (size,)
        else:
            from .arena_cuda import CudaArena

            self._cpu, self._cuda = None, CudaArena.create(size, device_index, chunk_bytes)
            self._bytes = self._cuda.flat()
            self.chunks = self._cuda.chunks

    def write(self, offset: int, tensor) -> None:
        if self._cpu is not None:
            self._cpu.write(offset, tensor)
        else:
            import torch

            src = tensor.reshape(-1).view(torch.uint8)
            self._bytes[offset:offset + src.numel()].copy_(src)

    def finish(self) -> list[int]:
        """Fds to send (the caller closes them after sending)."""
        if self._cpu is not None:
            return [self._cpu.seal()]
        import torch

        torch.cuda.synchronize(self.device_index)
        return self._cuda.export_fds()

    def close(self) -> None:
        if self._cpu is not None:
            self._cpu.close()
        else:
            del self._bytes
            self._cuda.close()

    @property
    def spec(self) -> ArenaSpec:
        uuid = "" if self.kind == "cpu" else visible_uuids()[self.device_index]
        return ArenaSpec(self.kind, self.device_index, sum(self.chunks), tuple(self.chunks), uuid)


def _device_index(device: str, rank: int) -> int:
    if device == "cpu":
        return 0
    import torch

    return rank % torch.cuda.device_count()


class Progress:
    """Bytes packed by this loader, every rank together, reported to the daemon now and then."""

    def __init__(self, chan: socket.socket, total: int) -> None:
        self.chan, self.total, self.done = chan, total, 0
        self._last = float("-inf")

    def add(self, nbytes: int, *, force: bool = False) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if force or now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            framing.send_frame(self.chan, LoadProgress(self.done, self.total))


def rank_bytes(ckpt, args, rank: int) -> int:
    """The arena size of ``rank`` (its plan, from the checkpoint's headers: nothing read yet)."""
    specs, _ = rank_specs(ckpt, dtype=args.dtype, tp_size=args.tp, tp_rank=rank, transform=args.transform)
    return plan(specs)[1]


def load_rank(ckpt, args, rank: int, chan: socket.socket, progress: Progress) -> None:
    device_index = _device_index(args.device, rank)
    device = "cpu" if args.device == "cpu" else f"cuda:{device_index}"
    config = make_config(ckpt.path, dtype=args.dtype, tp_size=args.tp, tp_rank=rank,
                         transform=args.transform, device=device)
    kw = dict(dtype=args.dtype, tp_size=args.tp, tp_rank=rank, transform=args.transform)
    specs, aliases = rank_specs(ckpt, **kw)
    entries, size = plan(specs)
    log.info("rank_load_started", rank=rank, tensors=len(entries), bytes=size, device=device)
    arena = ArenaWriter(size, args.device, device_index, args.chunk_bytes, f"{config.key}-r{rank}")
    try:
        t0 = time.perf_counter()
        for (name, tensor), entry in zip(iter_rank_tensors(ckpt, **kw), entries, strict=True):
            assert name == entry.name and tuple(tensor.shape) == entry.shape, (name, entry.name)
            arena.write(entry.offset, tensor)
            progress.add(entry.nbytes)
        progress.add(size - sum(e.nbytes for e in entries), force=True)  # alignment padding: the rank is whole
        register(chan, config, Manifest(tuple(entries), aliases, (arena.spec,)), arena)
        dt = time.perf_counter() - t0
        log.info("rank_loaded", rank=rank, bytes=size, seconds=round(dt, 3), gbps=round(size / dt / 1e9, 2),
                 chunks=len(arena.chunks))
    finally:
        arena.close()


def register(chan: socket.socket, config, manifest: Manifest, arena: ArenaWriter) -> None:
    """Hand the filled ``arena`` to the daemon as ``config``'s rank, and wait for its acknowledgement."""
    fds = arena.finish()
    try:
        framing.send_frame(chan, Register(config, manifest, len(fds)), fds)
    finally:
        framing.close_fds(fds)
    reply, _ = framing.recv_frame(chan)
    if not isinstance(reply, Registered):
        raise ProtocolError(f"daemon answered the registration with {reply!r}", "unexpected")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cache_daemon.loader")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ranks", default="", help="comma-separated ranks (default: all)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--transform", default="none")
    p.add_argument("--chunk-bytes", type=int, default=0)
    p.add_argument("--channel-fd", type=int, required=True, help="inherited socket to the daemon")
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def run_child(args: argparse.Namespace, process: str, load, failures: tuple[type[BaseException], ...],
              event: str = "load_failed", traceback: bool = False) -> int:
    """A loader child's frame, for this loader and vLLM's (``failover_vllm.pack``): its logging, its
    death with the daemon, the inherited channel. ``load(chan)`` does the work; one of ``failures``
    is reported to the daemon as ``LoadFailed`` (exit 1), anything else propagates."""
    configure_logging(args.log_level, process=process)
    die_with_parent(signal.SIGKILL, args.parent_pid)
    chan = socket.socket(fileno=args.channel_fd)
    try:
        load(chan)
    except failures as e:
        if traceback:
            log.exception(event)
        else:
            log.error(event, error=type(e).__name__, message=str(e))
        framing.send_frame(chan, LoadFailed(type(e).__name__, str(e)))
        return 1
    finally:
        chan.close()
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else list(range(args.tp))

    def load(chan: socket.socket) -> None:
        ckpt = open_checkpoint(args.model)
        validate(ckpt, args.tp)
        progress = Progress(chan, sum(rank_bytes(ckpt, args, rank) for rank in ranks))
        for rank in ranks:
            load_rank(ckpt, args, rank, chan, progress)

    return run_child(args, "loader", load, (CacheError,))

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
