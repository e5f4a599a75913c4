"""Reference-engine processes for the proof benchmarks: start on a port, wait for /ready, kill."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from failover_common import ports  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    return ports.free_port()


def on_cpus(cpus: frozenset[int] | None):
    """A ``preexec_fn`` putting the child on ``cpus`` before exec (None: no preexec_fn)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


class EngineProc:
    """One ``failover engine`` process (disk weights unless told otherwise), in its own process group.
    Class-wide, set from a bench's command line: ``cpu_threads``, its ``--cpu-threads`` (0: torch's);
    ``cpus``, the CPUs it runs on (None: the kernel's choice; failover_common.cpus)."""

    cpu_threads = 0
    cpus: frozenset[int] | None = None

    def __init__(self, model: Path, port: int | None = None, *, extra: tuple[str, ...] = (),
                 log_dir: Path | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "failover", "engine", "--model", str(model), "--weights", "disk",
                "--device", "cpu", "--port", str(self.port), "--cpu-threads", str(self.cpu_threads), *extra]
        out = open(log_dir / f"engine-{self.port}-{time.monotonic_ns()}.log", "wb") if log_dir else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=on_cpus(self.cpus))
        if out is not subprocess.DEVNULL:
            out.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine on port {self.port} exited with {self.proc.returncode}")
                try:
                    async with s.get(self.url + "/ready") as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError(f"engine on port {self.port} not ready after {timeout:.0f} s")

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(10)
