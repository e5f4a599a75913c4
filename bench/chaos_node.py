"""The node under test in the chaos soak: ``failover up`` as a real process, and what we ask of it.

``Node`` writes a config for a tiny CPU model into a private run dir, starts ``failover up CONFIG``
in its own session with a marker in its environment (every process of the node inherits it: the
daemon, the zygote, the engines the zygote forks), reads the admin API (``GET /admin/status``, bearer
token from ``RUN_DIR/admin.token``) and the router's ``/metrics``, and stops it with SIGTERM, the way
an operator would. ``leftovers()`` then scans /proc for anything the node left behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import aiohttp

REPO = Path(__file__).resolve().parent.parent
MARKER = "FAILOVER_CHAOS_RUN"
SERVICE = "chat"
Starter = Callable[..., subprocess.Popen]


def default_starter(args: list[str], *, env: dict[str, str], **kw) -> subprocess.Popen:
    """Starts ``failover up`` in its own session; ``env`` holds what to add to ours (as the tests'
    ``procs.start`` takes it)."""
    return subprocess.Popen(args, start_new_session=True, cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **env), **kw)


def free_port_pair(avoid: set[int]) -> int:
    """A free port whose successor is free too (a primary and a standby), clear of ``avoid``."""
    from failover.cmd.demo import free_port_pair as pair

    while True:
        port = pair()
        if not {port, port + 1} & avoid:
            return port


def node_toml(run_dir: Path, model: Path, router_port: int, engine_port: int, log_level: str,
              batch: dict | None) -> str:
    """The node config. Chaos kills engines on purpose, so the crash-loop guard is set out of reach."""
    text = f"""run_dir = "{run_dir}"

[model]
path = "{model}"
dtype = "float32"
device = "cpu"

[router]
port = {router_port}
probe_interval = 0.2
probe_timeout = 1.0
probe_threshold = 2
queue_timeout = 30.0

[supervisor]
launch = "zygote"
log_level = "{log_level}"
stop_timeout = 3.0
drain_timeout = 5.0
restart_attempts = 10
backoff_initial = 0.2
backoff_max = 2.0
crash_loop_exits = 100000
crash_loop_window = 60.0

[[service]]
name = "{SERVICE}"
standbys = 1
kv_memory = "16MiB"
max_batch = 8
port = {engine_port}
"""
    if batch is not None:
        text += f"""
[[service]]
name = "batch"
kind = "batch"
priority = 0
standbys = 0
kv_memory = "16MiB"
max_batch = 8
port = {batch['port']}

[service.batch]
input = "{batch['input']}"
output = "{batch['output']}"
concurrency = 2
# the co-serving load triggers out of reach: the batch engine stays up, to be faulted
queue_high = 100000
queue_low = 50000
ttft_high = 3600.0
ttft_low = 1800.0
"""
    return text


@dataclass
class Node:
    workdir: Path
    model: Path
    run_dir: Path
    log_level: str = "warning"
    batch: dict | None = None  # {"port", "input", "output"} when the node runs a batch service
    starter: Starter = default_starter
    marker: str = field(default_factory=lambda: secrets.token_hex(8))
    proc: subprocess.Popen | None = None
    token: str = ""
    router_port: int = 0
    engine_port: int = 0
    exit_code: int | None = None
    shutdown_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def socket(self) -> Path:
        return self.run_dir / "daemon.sock"

    @property
    def log_path(self) -> Path:
        return self.workdir / "node.log"

    def write_config(self) -> Path:
        self.router_port = free_port_pair(set())
        self.engine_port = free_port_pair({self.router_port, self.router_port + 1})
        if self.batch is not None:
            self.batch["port"] = free_port_pair({self.router_port, self.router_port + 1,
                                                 self.engine_port, self.engine_port + 1})
        path = self.workdir / "node.toml"
        path.write_text(node_toml(self.run_dir, self.model, self.router_port, self.engine_port,
                                  self.log_level, self.batch))
        return path

    async def start(self, timeout: float = 180.0) -> None:
        """``failover up`` in its own session; returns once the router is ready and the token read."""
        config = self.write_config()
        log = open(self.log_path, "ab")
        try:
            self.proc = self.starter([sys.executable, "-m", "failover", "up", str(config)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={MARKER: self.marker})
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as s:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"failover up exited with {self.proc.returncode}; see {self.log_path}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the node was not ready after {timeout:.0f} s; see {self.log_path}")
                try:
                    async with s.get(self.url + "/ready") as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.1)
        self.token = (self.run_dir / "admin.token").read_text().strip()

    # -- reading the node --------------------------------------------------------------------------
    async def status(self, session: aiohttp.ClientSession) -> dict:
        async with session.get(self.url + "/admin/status",
                               headers={"Authorization": f"Bearer {self.token}"}) as r:
            r.raise_for_status()
            return await r.json()

    async def metrics(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """The router's /metrics, each sample summed over its labels except ``reason`` and ``code``."""
        async with session.get(self.url + "/metrics") as r:
            r.raise_for_status()
            text = await r.text()
        return parse_metrics(text)

    # -- stopping ----------------------------------------------------------------------------------
    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a clean shutdown), then SIGKILL of the whole session if it does not go."""
        if self.proc is None:
            return None
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.exit_code = None
        self.shutdown_s = time.monotonic() - t0
        return self.exit_code

    def kill(self) -> None:
        """Last resort (and a test's cleanup): SIGKILL ``failover up`` and every process we marked."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        for pid in marked_pids(self.marker):
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels = m.group(1), m.group(2) or ""
        keep = re.findall(r'(reason|code)="([^"]*)"', labels)
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in keep) + "}" if keep else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


# -- /proc scans -------------------------------------------------------------------------------
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]


def marked_pids(marker: str) -> list[int]:
    """Live processes (not zombies) carrying our marker in their environment."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for pid in _pids():
        if needle in _read(f"/proc/{pid}/environ").split(b"\0"):
            stat = _read(f"/proc/{pid}/stat")
            if stat and stat.rsplit(b")", 1)[1].split()[0] != b"Z":
                found.append(pid)
    return found


def is_ours(pid: int, marker: str) -> bool:
    return f"{MARKER}={marker}".encode() in _read(f"/proc/{pid}/environ").split(b"\0")


def start_time(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    return int(stat.rsplit(b")", 1)[1].split()[19]) if stat else None


def leftovers(node: Node, arena_keys: set[str]) -> dict:
    """What the stopped node left: processes, run-dir entries, memfds and mappings of its arenas."""
    mentions = [str(node.run_dir).encode(), str(node.workdir).encode()]
    procs, memfds, mapped, foreign = [], [], [], 0
    for pid in _pids():
        cmdline = _read(f"/proc/{pid}/cmdline")
        stat = _read(f"/proc/{pid}/stat")
        zombie = bool(stat) and stat.rsplit(b")", 1)[1].split()[0] == b"Z"
        ours = is_ours(pid, node.marker) or any(m in cmdline for m in mentions)
        if ours and not zombie:
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]
            procs.append(f"{pid} {shown}")
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if "memfd:" in target:
                if ours or any(k in target for k in arena_keys):
                    memfds.append(f"{pid}: {target}")
                else:
                    foreign += 1
        maps = _read(f"/proc/{pid}/maps")
        if arena_keys and any(k.encode() in maps for k in arena_keys):
            mapped.append(pid)
    run_files = sorted(p.name for p in node.run_dir.iterdir()) if node.run_dir.exists() else []
    return {"processes": procs, "run_dir_exists": node.run_dir.exists(), "run_dir_files": run_files,
            "memfds": memfds, "arena_mappings": mapped, "foreign_memfds": foreign}


def wait_gone(marker: str, timeout: float = 10.0) -> list[int]:
    """Processes die with the supervisor (PR_SET_PDEATHSIG) a moment after it: give them that moment."""
    deadline = time.monotonic() + timeout
    while (left := marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
