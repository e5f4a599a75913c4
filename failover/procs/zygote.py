"""The zygote: a process that has paid for ``import torch`` and the engine once, and forks engines.

Started by the supervisor as ``python -m failover.procs.zygote --fd N``, with one end of a socketpair as fd
N. It imports the preload modules, says ``Hello``, and then serves ``Fork`` requests one at a time.
It never creates a CUDA context, a thread pool or an event loop: each fork must get a clean copy.

Each engine is double-forked: the zygote forks an intermediate that starts a new session, forks the
engine and exits at once. The engine is re-parented to the nearest child subreaper, the supervisor,
and only then sets PR_SET_PDEATHSIG against it. So the engine is the supervisor's child (reaped and
watched there), dies with the supervisor, and outlives the zygote: a crashed zygote costs no
serving engine, only a restart of itself.

Wire: the project's frame codec (``failover_common.frames``: a 4-byte big-endian length, capped) with
a msgpack body, one tagged union (below).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import struct
import sys
import time
import traceback
import warnings

import msgspec
import structlog

from failover_common import frames, gc_pauses

log = structlog.get_logger(__name__)

MAX_FRAME = 1 << 20


class Hello(msgspec.Struct, tag="hello"):
    """zygote -> supervisor, once the preload imports are done: the zygote is ready."""

    pid: int
    preload: list[str]
    import_s: float


class Fork(msgspec.Struct, tag="fork"):
    """supervisor -> zygote: fork ``target(argv)`` as a process named ``name``.

    ``target`` is ``module:function`` (a function taking argv and returning an exit code).
    ``parent_pid``: the subreaper the engine must be re-parented to before it arms PR_SET_PDEATHSIG
    (0: do not wait, for a zygote used without a subreaper).
    """

    id: int
    name: str
    argv: list[str]
    target: str = "engine.cli:main"
    parent_pid: int = 0
    env: dict[str, str] = {}


class Forked(msgspec.Struct, tag="forked"):
    id: int
    pid: int


class Failed(msgspec.Struct, tag="failed"):
    id: int
    message: str


class Ping(msgspec.Struct, tag="ping"):
    """supervisor -> zygote: a liveness check, answered with ``Pong`` of the same id."""

    id: int


class Pong(msgspec.Struct, tag="pong"):
    id: int


Message = Hello | Fork | Forked | Failed | Ping | Pong
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return frames.pack(_encoder.encode(msg), MAX_FRAME)


def decode(body: bytes) -> Message:
    return _decoder.decode(body)


def _read_frame(sock: socket.socket) -> Message:
    body, _ = frames.recv(sock, max_size=MAX_FRAME)
    return decode(body)


def serve(sock: socket.socket, preload: list[str], import_s: float) -> int:
    sock.sendall(encode(Hello(pid=os.getpid(), preload=preload, import_s=import_s)))
    while True:
        try:
            msg = _read_frame(sock)
        except frames.FrameError as e:
            if e.code not in ("closed", "bad_frame"):
                raise
            # EOF: the supervisor is done with us; nothing to tear down (skip torch's atexit)
            sys.stderr.flush()
            os._exit(0)
        if isinstance(msg, Ping):
            sock.sendall(encode(Pong(id=msg.id)))
            continue
        if not isinstance(msg, Fork):
            sock.sendall(encode(Failed(id=-1, message=f"zygote: unexpected {type(msg).__name__}")))
            continue
        try:
            pid = _double_fork(msg, sock)
        except OSError as e:
            sock.sendall(encode(Failed(id=msg.id, message=f"fork failed: {e}")))
            continue
        sock.sendall(encode(Forked(id=msg.id, pid=pid)))
        _prepare(msg)


def _prepare(req: Fork) -> None:
    """After a fork (answered already): the target's module may prepare, in the zygote, what later
    forks of the same target inherit: ``module.prepare(argv)`` (``engine.cli.prepare``: the model's
    tokenizer and meta-device module tree). It must start no thread and touch no CUDA, like every
    preload. A failure is logged and costs nothing but the head start."""
    module, _, _ = req.target.partition(":")
    try:
        prepare = getattr(importlib.import_module(module), "prepare", None)
        if prepare is not None:
            t0 = time.perf_counter()
            if prepare(req.argv):
                gc_pauses.freeze()  # what later forks inherit, frozen with the rest
                log.info("zygote_prepared", target=req.target, after=req.name,
                         ms=round((time.perf_counter() - t0) * 1e3, 1))
    except Exception as e:  # noqa: BLE001 - the zygote keeps forking; the engine loads it itself
        log.warning("zygote_prepare_failed", target=req.target, error=f"{type(e).__name__}: {e}",
                    detail="the next forks load it themselves")


def _double_fork(req: Fork, sock: socket.socket) -> int:
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:  # intermediate: new session, fork the engine, report its pid, vanish
        try:
            os.close(r)
            sock.close()
            os.setsid()
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _run_child(req)  # never returns
            os.write(w, struct.pack("!i", pid))
        finally:
            os._exit(0)
    os.close(w)
    try:
        data = os.read(r, 4)
    finally:
        os.close(r)
        os.waitpid(mid, 0)
    if len(data) != 4:
        raise OSError("the intermediate process died before reporting the engine pid")
    return struct.unpack("!i", data)[0]


def _run_child(req: Fork) -> None:
    """In the forked engine: arm the parent-death signal, name the process, run the target."""
    from failover_common.proc import die_with_parent, set_process_name

    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        set_process_name(req.name)
        if req.parent_pid:
            deadline = time.monotonic() + 5.0
            while os.getppid() != req.parent_pid and time.monotonic() < deadline:
                time.sleep(0.0005)  # the intermediate exits right after forking us
            die_with_parent(signal.SIGKILL)
            if os.getppid() != req.parent_pid:  # the supervisor died meanwhile (or is no subreaper)
                os._exit(70)
        os.environ.update(req.env)
        module, _, func = req.target.partition(":")
        code = int(getattr(importlib.import_module(module), func or "main")(req.argv) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the child must never return into the zygote's loop
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m failover.procs.zygote", description=__doc__.splitlines()[0])
    p.add_argument("--fd", type=int, required=True, help="inherited socket to the supervisor")
    p.add_argument("--preload", default="torch,engine.cli,engine.serve,cache_daemon.client",
                   help="comma-separated modules to import before forking")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="also load what attaching weights on this device needs (no CUDA context)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a = p.parse_args(argv)
    from failover_common.logs import configure_logging
    from failover_common.proc import set_process_name

    set_process_name("fo:zygote")
    configure_logging(a.log_level, process="zygote")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    # Python >= 3.12 warns at every fork of a process with more than one thread. `import torch`
    # starts one native helper thread (parked on a futex, holding no lock a child needs); the zygote
    # itself runs no Python thread, no torch op and no event loop, so the fork is the safe kind.
    warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)
    sock = socket.socket(fileno=a.fd)
    preload = [m for m in a.preload.split(",") if m]
    t0 = time.perf_counter()
    for module in preload:
        importlib.import_module(module)
    if "cache_daemon.client" in preload:  # on CUDA: the driver library and symbols, but no cuInit
        importlib.import_module("cache_daemon.client").preload(a.device)
    if "engine.cli" in preload:  # on CUDA: Triton's CUDA-free first-launch work (engine.fused.preload)
        importlib.import_module("engine.cli").preload(a.device)
    import_s = time.perf_counter() - t0
    gc_pauses.freeze()  # its forks inherit the frozen heap: their own freeze at ready walks only theirs
    return serve(sock, preload, import_s)


if __name__ == "__main__":
    sys.exit(main())
