"""Several nodes on one machine: each its own `failover up` (own run dir, ports, daemon) bound to
its own loopback address (127.0.0.2, 127.0.0.3, ...), peer routers (`failover router --etcd`),
and streaming clients through the official openai SDK that record every token's arrival.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import Procs
from etcd_helpers import EtcdCluster, Front
from failover_common.ports import free_port
from failover_common.proc import stat_fields
from supervisor_helpers import Workers, _table, _toml_value, http, wait_until

KEY = "/failover/test/primary/chat"


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(stat_fields(f"/proc/{entry}/stat")[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def free_port_on(host: str) -> int:
    """A port free on ``host`` and its successor (a slot's port and the next)."""
    import socket

    while True:
        p = free_port()
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((host, p))
                b.bind((host, p + 1))
            return p
        except OSError:
            continue


class ClusterNode:
    """One `failover up` with a [cluster] table; one engine slot (standbys = 0) unless told."""

    def __init__(self, procs, model: Path, base: Path, name: str, host: str, endpoints: list[str], *,
                 ttl: int = 2, standbys: int = 0, cluster: dict | None = None) -> None:
        self.procs, self.name, self.host = procs, name, host
        self.dir = base / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = self.dir / "run"
        self.router_port = free_port_on(host)
        self.engine_port = free_port_on(host)
        self.config_path = self.dir / "node.toml"
        text = f"run_dir = {_toml_value(str(self.run_dir))}\n\n[model]\n" + _table(
            {"path": str(model), "dtype": "float32", "tp": 1, "device": "cpu", "transform": "none"})
        text += "\n[router]\n" + _table({"host": host, "port": self.router_port, "probe_interval": 0.1,
                                         "probe_timeout": 0.5, "probe_threshold": 2})
        text += "\n[supervisor]\n" + _table({"ready_timeout": 90.0, "stop_timeout": 5.0, "drain_timeout": 2.0,
                                             "backoff_initial": 0.1})
        text += "\n[cluster]\n" + _table({"etcd": endpoints, "node": name, "ttl": ttl, "host": host,
                                          "name": "test", **(cluster or {})})
        text += "\n[[service]]\n" + _table({"name": "chat", "kind": "online", "standbys": standbys,
                                            "kv_memory": "8MiB", "port": self.engine_port, "max_batch": 8})
        self.config_path.write_text(text)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.standbys = standbys

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    def start(self) -> ClusterNode:
        self.starts += 1
        log = open(self.dir / f"up-{self.starts}.log", "wb")
        self.proc = self.procs.python("-m", "failover", "up", str(self.config_path), stdout=log,
                                      stderr=subprocess.STDOUT)
        log.close()
        return self

    def log(self) -> str:
        path = self.dir / f"up-{self.starts}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Its router answers and its engine is registered (ready) in the node's own view."""
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.name} exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                code, doc = http("GET", self.url + "/admin/status", token=self.token(), timeout=2)
            except OSError:
                return False
            return code == 200 and all(i["ready"] for s in doc["services"] for i in s["instances"]) \
                and any(s["instances"] for s in doc["services"])
        wait_until(up, timeout, f"node {self.name} to serve")

    def token(self) -> str:
        return (self.run_dir / "admin.token").read_text().strip()

    def status(self) -> dict:
        code, doc = http("GET", self.url + "/admin/status", token=self.token(), timeout=5)
        assert code == 200, doc
        return doc

    def engine_pids(self) -> list[int]:
        return [s["pid"] for s in self.status()["supervisor"]["slots"] if s["pid"]]

    def pids(self) -> list[int]:
        return tree(self.proc.pid) if self.proc is not None and self.proc.poll() is None else []

    def kill(self) -> None:
        """kill -9 of the whole node: supervisor, daemon, zygote and engines at once."""
        signal_all(self.pids(), signal.SIGKILL)
        self.proc.wait(10)

    def freeze(self) -> list[int]:
        pids = self.pids()
        signal_all(pids, signal.SIGSTOP)
        return pids

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)


class PeerRouter:
    def __init__(self, procs, base: Path, name: str, endpoints: list[str], *, ttl: int = 2,
                 store: list[str] | None = None) -> None:
        self.procs, self.name, self.endpoints, self.ttl = procs, name, endpoints, ttl
        self.store = store if store is not None else ["--etcd", ",".join(endpoints)]  # or --k8s-lease ...
        self.port = free_port()
        self.log_path = base / f"router-{name}.log"
        self.token_path = base / f"router-{name}.token"
        self.token_path.write_text("t-" + name + "\n")
        os.chmod(self.token_path, 0o600)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PeerRouter:
        log = open(self.log_path, "ab")
        self.proc = self.procs.python(
            "-m", "failover", "router", *self.store, "--cluster", "test",
            "--router-id", self.name, "--ttl", str(self.ttl), "--port", str(self.port),
            "--admin-token-file", str(self.token_path), "--probe-interval", "0.1", "--probe-timeout", "0.5",
            "--queue-deadline", "20", stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def status(self) -> dict:
        code, doc = http("GET", self.url + "/admin/status", token=self.token_path.read_text().strip(), timeout=5)
        assert code == 200, doc
        return doc

    def primary(self) -> str | None:
        try:
            svc = next((s for s in self.status()["services"] if s["name"] == "chat"), None)
        except OSError:
            return None
        return svc["primary"] if svc and svc["ready"] else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


PROMPTS = ["one two three four", "The primary engine fails", "def main():", "Failover in well under"]


class Streams(Workers):
    """``workers`` threads streaming completions through ``url`` with the openai SDK; each stream's
    text is checked against the undisturbed greedy run (``expected``) and its arrival times kept."""

    join_timeout = 90.0

    def __init__(self, url: str, expected: dict[str, str], *, workers: int = 3, max_tokens: int = 24,
                 max_retries: int = 0) -> None:
        super().__init__(workers)
        # 0: every error counts. The SDK's default (2) re-sends a request that got no response
        # (never a stream already under way): what an application using the SDK as shipped sees.
        self.max_retries = max_retries
        self.url, self.expected, self.max_tokens = url, expected, max_tokens
        self.ok = 0
        self.failures: list[str] = []
        self.mismatches: list[str] = []
        self.arrivals: list[float] = []  # monotonic time of every chunk, all streams
        self.gaps: list[tuple[float, float]] = []  # (start, length) of each gap inside a stream
        self.failed_at: list[tuple[float, float, int]] = []  # (start, failure, chunks received)

    def _worker(self, i: int) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=self.max_retries, timeout=60)
        n = 0
        while not self._stop_event.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            text, times, t0 = "", [], time.monotonic()
            try:
                for chunk in client.completions.create(model="chat", prompt=prompt, max_tokens=self.max_tokens,
                                                       temperature=0, stream=True):
                    now = time.monotonic()
                    times.append(now)
                    text += chunk.choices[0].text if chunk.choices else ""
            except Exception as exc:  # noqa: BLE001 - any client-visible failure is counted
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                    self.failed_at.append((t0, time.monotonic(), len(times)))
                continue
            with self._lock:
                self.ok += 1
                self.arrivals += times
                self.gaps += [(a, b - a) for a, b in zip(times, times[1:])]
                if text != self.expected[prompt]:
                    self.mismatches.append(f"{prompt!r}: {text!r} != {self.expected[prompt]!r}")

    def longest_gap_after(self, t: float, within: float = 30.0) -> float:
        """Longest silence inside any stream that spans ``t`` or starts within ``within`` s after it."""
        with self._lock:
            spans = [g for s, g in self.gaps if s <= t + within and s + g >= t]
        return max(spans, default=0.0)


def expected_texts(url: str, max_tokens: int = 24) -> dict[str, str]:
    """The undisturbed greedy run of every prompt (non-streamed, one at a time)."""
    out = {}
    for p in PROMPTS:
        code, doc = http("POST", url + "/v1/completions",
                         {"model": "chat", "prompt": p, "max_tokens": max_tokens, "temperature": 0}, timeout=60)
        assert code == 200, doc
        out[p] = doc["choices"][0]["text"]
    return out


def etcd_get(endpoints: list[str], key: str) -> dict | None:
    """Read one key with etcdctl-free HTTP (the JSON gateway), for assertions."""
    import base64
    import urllib.request

    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    # short first (a frozen member: go on to the next), then patient (a loaded box: etcd is slow)
    for timeout in (0.5, 3.0):
        for ep in endpoints:
            try:
                req = urllib.request.Request(ep + "/v3/kv/range", data=body, method="POST")
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    doc = json.loads(r.read())
            except OSError:
                continue
            if "header" not in doc:  # an error answer (no leader just now): not "absent"
                continue
            kvs = doc.get("kvs") or []
            if not kvs:
                return None
            kv = kvs[0]
            return {"value": json.loads(base64.b64decode(kv["value"])), "mod_revision": int(kv["mod_revision"]),
                    "version": int(kv.get("version", 0))}
    raise OSError("no etcd endpoint answered")


class Rig:
    def __init__(self, model: Path, *, ttl: int = 2, standbys_b: int = 0, front: str = "tcp") -> None:
        self.procs = Procs()
        self.base = Path(tempfile.mkdtemp(prefix="fo-mn-", dir="/tmp"))
        self.etcd = EtcdCluster(3).start()
        eps = self.etcd.endpoints
        # b runs a standby beside its engine: a failed primary on b has a standby on its own node
        # and one on a, and the routers must take a's (roles.EtcdRoles.rank)
        self.nodes = {n: ClusterNode(self.procs, model, self.base, n, h, eps, ttl=ttl, standbys=sb)
                      for n, h, sb in (("a", "127.0.0.2", 0), ("b", "127.0.0.3", standbys_b))}
        for node in self.nodes.values():  # one at a time: a is the first primary
            node.start().wait_serving()
        self.routers = [PeerRouter(self.procs, self.base, f"r{i}", eps, ttl=ttl).start() for i in (1, 2)]
        self.front = Front([f"127.0.0.1:{r.port}" for r in self.routers], mode=front).start()
        self.settle()
        self.expected = expected_texts(self.front.url)

    @property
    def slots(self) -> int:
        return 2 + self.nodes["b"].standbys

    def metric(self, router: PeerRouter, name: str) -> float:
        """The sum of one counter's samples in a router's /metrics."""
        import urllib.request

        with urllib.request.urlopen(router.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def primary(self) -> str:
        return etcd_get(self.etcd.endpoints, KEY)["value"]["instance"]

    def version(self) -> int:
        return etcd_get(self.etcd.endpoints, KEY)["mod_revision"]

    def node_of_primary(self) -> ClusterNode:
        return self.nodes[self.primary().rpartition("@")[2]]

    def other(self, node: ClusterNode) -> ClusterNode:
        return next(n for n in self.nodes.values() if n is not node)

    def settle(self, timeout: float = 90.0) -> None:
        """Both routers route to etcd's primary, and the other node's instance is a ready standby."""
        seen: list = ["nothing read yet"]

        def ok() -> bool:
            try:
                docs = [r.status() for r in self.routers]
                primary = self.primary()
            except (OSError, AssertionError, TypeError) as e:
                seen[0] = repr(e)
                return False
            views = []
            for doc in docs:
                svc = next((s for s in doc["services"] if s["name"] == "chat"), None)
                views.append(None if svc is None else {
                    "primary": svc["primary"], "ready": svc["ready"],
                    "instances": {i["name"]: (i["role"], i["ready"]) for i in svc["instances"]}})
            seen[0] = {"etcd primary": primary, "routers": views}
            for svc in views:
                if svc is None or svc["primary"] != primary or not svc["ready"]:
                    return False
                roles = sorted(svc["instances"].values())
                if roles != [("primary", True)] + [("standby", True)] * (self.slots - 1):
                    return False
            return True
        try:
            wait_until(ok, timeout, "the cluster to settle (one primary, every other instance a ready standby, "
                       "both routers agree)")
        except AssertionError as e:  # what the routers last showed, to tell a slow box from a stuck role
            raise AssertionError(f"{e}; last seen: {seen[0]}") from None

    def streaming(self, **kw) -> Streams:
        s = Streams(self.front.url, self.expected, **kw)
        s.start()
        time.sleep(1.5)
        # a loaded box can be slower than that: the fault waits for one whole stream through the front
        wait_until(lambda: s.ok > 0 or s.failures, 30, "a stream through the front before the fault")
        assert s.ok > 0, s.failures[:3]
        return s

    def close(self) -> None:
        try:
            self.front.stop()
            for node in self.nodes.values():
                if node.proc is not None and node.proc.poll() is None:
                    signal_all(node.pids(), signal.SIGCONT)
                    node.stop()
        finally:
            self.procs.stop_all()
            self.etcd.stop()
            shutil.rmtree(self.base, ignore_errors=True)
