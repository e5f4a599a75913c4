"""A real etcd cluster (Debian's etcd-server) on loopback ports, with its data in a temp dir:
started and ended by a test or a benchmark. Also HAProxy as a TCP front with /ready checks.

    with EtcdCluster(3) as etcd:       # etcd.endpoints: ["http://127.0.0.1:P", ...]
        etcd.kill(1)                   # kill -9 of one member; etcd.restart(1) brings it back
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from failover_common.ports import free_port

ETCD = shutil.which("etcd")
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)


def version(binary: str | None, flag: str) -> str:
    if binary is None:
        return "absent"
    out = subprocess.run([binary, flag], capture_output=True, text=True, timeout=10)
    return (out.stdout or out.stderr).splitlines()[0].strip()


class EtcdCluster:
    def __init__(self, members: int = 3, *, heartbeat_ms: int = 50, election_ms: int = 500) -> None:
        assert ETCD is not None, "etcd is not installed (apt-get install etcd-server)"
        self.dir = Path(tempfile.mkdtemp(prefix="fo-etcd-"))
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = [free_port() for _ in self.names]
        self.peer_ports = [free_port() for _ in self.names]
        self.timing = (heartbeat_ms, election_ms)
        self.procs: list[subprocess.Popen | None] = [None] * members

    @property
    def endpoints(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.client_ports]

    def _argv(self, i: int, state: str) -> list[str]:
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        return [ETCD, "--name", self.names[i], "--data-dir", str(self.dir / self.names[i]),
                "--listen-client-urls", self.endpoints[i], "--advertise-client-urls", self.endpoints[i],
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", cluster, "--initial-cluster-state", state,
                "--initial-cluster-token", self.dir.name,
                "--heartbeat-interval", str(self.timing[0]), "--election-timeout", str(self.timing[1]),
                "--log-level", "error", "--logger", "zap"]

    def _spawn(self, i: int, state: str) -> None:
        log = open(self.dir / f"{self.names[i]}.log", "ab")
        self.procs[i] = subprocess.Popen(self._argv(i, state), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        log.close()

    def start(self, attempts: int = 3) -> EtcdCluster:
        for attempt in range(attempts):
            for i in range(len(self.names)):
                self._spawn(i, "new")
            try:
                self.wait_healthy()
                return self
            except RuntimeError as exc:
                # free_port() only probes a port; another process may take it before etcd binds it
                if "address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                self._end_all()
                for i in range(len(self.names)):
                    shutil.rmtree(self.dir / self.names[i], ignore_errors=True)
                    (self.dir / f"{self.names[i]}.log").unlink(missing_ok=True)
                self.client_ports = [free_port() for _ in self.names]
                self.peer_ports = [free_port() for _ in self.names]
        raise AssertionError("unreachable")

    def wait_healthy(self, timeout: float = 30.0, members: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        for i in members if members is not None else range(len(self.names)):
            while True:
                try:
                    with urllib.request.urlopen(self.endpoints[i] + "/health", timeout=1) as r:
                        if json.loads(r.read()).get("health") in ("true", True):
                            break
                except OSError:
                    pass
                if self.procs[i] is not None and self.procs[i].poll() is not None:
                    raise RuntimeError(f"etcd {self.names[i]} exited: {self.log(i)[-2000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd {self.names[i]} not healthy: {self.log(i)[-2000:]}")
                time.sleep(0.05)

    def log(self, i: int) -> str:
        path = self.dir / f"{self.names[i]}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def freeze(self, i: int) -> None:
        """SIGSTOP of one member: its sockets stay open, it answers nothing (a hung member)."""
        self.procs[i].send_signal(signal.SIGSTOP)

    def thaw(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGCONT)

    def index(self, endpoint: str) -> int:
        return self.endpoints.index(endpoint)

    def restart(self, i: int) -> None:
        self.kill(i)
        self._spawn(i, "existing")

    def _end_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a frozen member would not act on SIGTERM
                proc.terminate()
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self.procs = [None] * len(self.names)

    def stop(self) -> None:
        self._end_all()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


# What the front can and cannot do for a killed router (docs/cluster.md, "A router's kill"):
# - observe layer4 + error-limit 1 + on-error mark-down: the first refused connection marks the dead
#   router down, before its next check; fall 1 at inter 100 ms bounds the rest;
# - retries 3 + "option redispatch 1": a refused connection is re-tried on another router at once
#   (plain "option redispatch" only moves the last retry);
# - no on-marked-down shutdown-sessions: a router marked down because it holds routing (etcd lost,
#   /ready 503) keeps its running streams;
# - TCP mode cannot move a running stream, nor a client's keep-alive connection spliced to the dead
#   router. HTTP mode ends the clients' connections in HAProxy and re-sends a request that got no
#   response byte (retry-on conn-failure empty-response): a stream whose router dies before its
#   first event (the router sends its 200 only then) is re-issued on the other router; one that
#   has sent bytes is still cut.
HAPROXY_CFG = """
global
    maxconn 2000
defaults
    mode {mode}
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    retries 3
    option redispatch 1
{http}listen front
    bind 127.0.0.1:{port}
    option httpchk GET /ready
{servers}
"""
HTTP_DEFAULTS = """    timeout http-request 10s
    timeout http-keep-alive 60s
    option http-buffer-request
    retry-on conn-failure empty-response
"""


class Front:
    """HAProxy in front of the routers (``mode`` "tcp", or "http"), checking each one's /ready every
    ``inter_ms``."""

    def __init__(self, routers: list[str], *, inter_ms: int = 100, mode: str = "tcp") -> None:
        assert mode in ("tcp", "http"), mode
        assert HAPROXY is not None, "haproxy is not installed (apt-get install haproxy)"
        self.port = free_port()
        self.inter_ms = inter_ms
        self.dir = Path(tempfile.mkdtemp(prefix="fo-haproxy-"))
        servers = "\n".join(f"    server r{i} {hostport} check inter {inter_ms}ms fall 1 rise 2 "
                            f"observe layer4 error-limit 1 on-error mark-down"
                            for i, hostport in enumerate(routers))
        self.mode = mode
        (self.dir / "haproxy.cfg").write_text(HAPROXY_CFG.format(
            mode=mode, port=self.port, servers=servers, http=HTTP_DEFAULTS if mode == "http" else ""))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Front:
        log = open(self.dir / "haproxy.log", "wb")
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(self.dir / "haproxy.cfg")], stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 20
        while True:  # the front answers /ready once one router behind it is up
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not serve: {(self.dir / 'haproxy.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        """What HAProxy printed (in the foreground it reports each server going DOWN or UP)."""
        path = self.dir / "haproxy.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
