"""Helpers for the supervisor-side tests (zygote targets, config writers, process invariants)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from failover_common.proc import running, stat_fields


def child_main(argv: list[str]) -> int:
    """A zygote target for tests: sleep ``argv[1]`` seconds (default 0), exit with code ``argv[0]``."""
    if len(argv) > 1:
        time.sleep(float(argv[1]))
    return int(argv[0]) if argv else 0


def free_port_pair() -> int:
    """A free port whose successor is free too: a primary and its standby listen on both."""
    from failover.cmd.demo import free_port_pair as pair

    return pair()


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _table(values: dict) -> str:
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items() if v is not None)


def write_config(path, *, model, run_dir, router: dict | None = None, service_extra: dict | None = None,
                 model_extra: dict | None = None, supervisor: dict | None = None,
                 second_service: bool = False, clash: bool = False) -> Path:
    """A CPU config for the tiny model on free ports; keyword tables override or add keys."""
    from conftest import free_port

    service = {"name": "chat", "kind": "online", "priority": 100, "standbys": 1, "kv_memory": "8MiB",
               "port": free_port_pair(), "max_batch": 8} | (service_extra or {})
    text = f'run_dir = {_toml_value(run_dir)}\n\n[model]\n' + _table(
        {"path": str(model), "dtype": "float32", "tp": 1, "device": "cpu", "transform": "none"} | (model_extra or {}))
    router_port = free_port()
    while router_port in (service.get("port"), (service.get("port") or 0) + 1):
        router_port = free_port()
    text += "\n[router]\n" + _table({"host": "127.0.0.1", "port": router_port, "probe_interval": 0.2,
                                     "probe_timeout": 1.0, "probe_threshold": 2} | (router or {}))
    text += "\n[supervisor]\n" + _table({"ready_timeout": 60.0, "stop_timeout": 5.0, "drain_timeout": 5.0,
                                         "backoff_initial": 0.1} | (supervisor or {}))
    text += "\n[[service]]\n" + _table(service)
    if second_service:
        port = service["port"] + 1 if clash else free_port()
        text += "\n[[service]]\n" + _table({"name": "other", "standbys": 0, "port": port})
    Path(path).write_text(text)
    return Path(path)


# --- a stand-in supervisor for the zygote tests: a subreaper that forks through a real zygote -------

async def _zygote_scenario() -> dict:
    import asyncio

    from failover.procs.launch import Zygote
    from failover_common.proc import become_subreaper

    become_subreaper()
    out: dict = {"supervisor_pid": os.getpid()}
    zygote = Zygote(preload="torch,supervisor_helpers")
    hello = await zygote.start()
    out["zygote_pid"], out["import_s"] = hello.pid, hello.import_s

    quick = await zygote.fork("fo-quick", ["3", "0.2"], target="supervisor_helpers:child_main")
    deadline = time.monotonic() + 5.0  # the child names itself and is re-parented right after the fork
    while time.monotonic() < deadline:
        out["quick_ppid"] = int(stat_fields(f"/proc/{quick.pid}/stat")[1])
        with open(f"/proc/{quick.pid}/comm") as f:
            out["quick_comm"] = f.read().strip()
        if out["quick_comm"] == "fo-quick" and out["quick_ppid"] == os.getpid():
            break
        await asyncio.sleep(0.005)
    out["quick_rc"] = await quick.wait(10)
    out["quick_runtime_s"] = quick.exited_at - quick.started

    # a long-lived child survives the zygote's death; the next fork restarts the zygote
    long = await zygote.fork("fo-long", ["0", "30"], target="supervisor_helpers:child_main")
    os.kill(hello.pid, signal.SIGKILL)
    await zygote.child.wait(10)
    await asyncio.sleep(0.2)
    out["long_alive_after_zygote_kill"] = long.alive
    again = await zygote.fork("fo-again", ["5"], target="supervisor_helpers:child_main")
    out["zygote_restarts"] = zygote.restarts
    out["again_rc"] = await again.wait(10)
    out["long_pid"] = long.pid
    out["zygote2_pid"] = zygote.hello.pid
    print(json.dumps(out), flush=True)
    await asyncio.sleep(60)  # the test SIGKILLs us here: PDEATHSIG must take the children along
    return out


if __name__ == "__main__":
    import asyncio

    from failover_common.logs import configure_logging

    configure_logging("warning")
    if sys.argv[1:] == ["zygote-scenario"]:
        asyncio.run(_zygote_scenario())


# --- a node under test: `failover up` as a real process, and clients of its router ----------------

REPO = Path(__file__).resolve().parent.parent


def http(method: str, url: str, body: dict | None = None, token: str | None = None, timeout: float = 30.0):
    """(status, JSON body) of one request; connection errors raise."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        with e:
            raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def wait_until(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


alive = running  # True while ``pid`` runs (a zombie counts as gone)


class Node:
    """One `failover up` process on a fresh config; ``stop()`` checks it left nothing behind."""

    def __init__(self, procs, tiny_model, run_dir, **config_overrides) -> None:
        config_path = write_config(Path(run_dir) / "node.toml", model=tiny_model, run_dir=Path(run_dir) / "node",
                                   **config_overrides)
        self._launch(procs, Path(run_dir), config_path, ready_timeout=90)

    def _launch(self, procs, run_dir: Path, config_path: Path, ready_timeout: float | None) -> None:
        """Start `failover up` on ``config_path`` and wait until its router is ready (``None``: do not
        wait; ``wait_ready`` then)."""
        self.run_dir = run_dir / "node"
        self.config_path = config_path
        self.log_path = run_dir / "up.log"
        self._log = open(self.log_path, "wb")
        self.proc = procs.python("-m", "failover", "up", str(self.config_path), stdout=self._log,
                                 stderr=subprocess.STDOUT)
        self._log.close()  # the child holds its own copy; none of ours can outlive a failed test
        from failover.config.schema import load_config

        self.config = load_config(self.config_path)
        self.url = self.config.router_url
        self.seen_pids: set[int] = set()
        if ready_timeout is not None:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> None:
        try:
            wait_until(self._ready, timeout, "the node to serve")
        except AssertionError as e:
            try:
                ready = http("GET", self.url + "/ready", timeout=2)
            except OSError as err:
                ready = err
            raise AssertionError(f"{e}; /ready: {ready}; its log ends:\n{self.log()[-3000:]}") from None
        self.token = self.config.token_path.read_text().strip()

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"failover up exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        try:
            return http("GET", self.url + "/ready", timeout=2)[0] == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, *names: str) -> str:
        """The log's lines that name any of ``names`` (for an assertion's message)."""
        return "\n".join(line for line in self.log().splitlines() if any(n in line for n in names))

    def status(self) -> dict:
        code, doc = http("GET", self.url + "/admin/status", token=self.token)
        assert code == 200, doc
        sup = doc["supervisor"]
        self.seen_pids |= {p for p in (sup["daemon"]["pid"], sup["zygote"]["pid"]) if p}
        self.seen_pids |= {s["pid"] for s in sup["slots"] if s["pid"]}
        return doc

    def instances(self) -> dict[str, dict]:
        return {i["name"]: i for s in self.status()["services"] for i in s["instances"]}

    def slot(self, name: str) -> dict:
        return next(s for s in self.status()["supervisor"]["slots"] if s["slot"] == name)

    def role(self, role: str) -> dict:
        return next(i for i in self.instances().values() if i["role"] == role)

    def serving_pair(self) -> tuple[dict, dict] | None:
        """(primary, standby) when both are ready, with live pids, else None."""
        insts = list(self.instances().values())
        prim = [i for i in insts if i["role"] == "primary" and i["ready"] and i["pid"]]
        stby = [i for i in insts if i["role"] == "standby" and i["ready"] and i["pid"]]
        return (prim[0], stby[0]) if prim and stby else None

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "failover", *args, "--config", str(self.config_path)],
                               capture_output=True, text=True, timeout=60, cwd=REPO)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """Ctrl-C the node; assert a clean exit with no process and no file left behind."""
        try:
            self.status()
        except (OSError, AssertionError):
            pass
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"failover up did not exit within 60 s of signal {sig}; its log ends:\n"
                                 f"{self.log()[-4000:]}") from None
        finally:
            self._log.close()
        assert code == 0, f"failover up exited with {code}:\n{self.log()[-3000:]}"
        left = [p for p in self.seen_pids if alive(p)]
        assert not left, f"processes left behind: {left}"
        assert not self.run_dir.exists(), f"run dir left behind: {sorted(os.listdir(self.run_dir))}"


class Workers(threading.Thread):
    """``workers`` threads each running ``_worker(i)`` until :meth:`stop`; a subclass keeps its
    results under ``_lock`` and loops while ``_stop_event`` is unset."""

    join_timeout = 60.0

    def __init__(self, workers: int) -> None:
        super().__init__(daemon=True)
        self.workers = workers
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _worker(self, i: int) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop_event.set()
        self.join(self.join_timeout)


class Load(Workers):
    """Sends completions in ``workers`` threads until stopped; counts what succeeded and what failed."""

    def __init__(self, url: str, workers: int = 3, max_tokens: int = 8) -> None:
        super().__init__(workers)
        self.url, self.max_tokens = url, max_tokens
        self.ok = 0
        self.failures: list[str] = []

    def _worker(self, i: int) -> None:
        n = 0
        while not self._stop_event.is_set():
            n += 1
            body = {"model": "chat", "prompt": f"worker {i} request {n}", "max_tokens": self.max_tokens,
                    "temperature": 0}
            try:
                code, doc = http("POST", self.url + "/v1/completions", body, timeout=30)
                error = None if code == 200 and doc.get("choices") else f"{code}: {str(doc)[:200]}"
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
            with self._lock:
                if error is None:
                    self.ok += 1
                else:
                    self.failures.append(error)

    def total(self) -> int:
        with self._lock:
            return self.ok + len(self.failures)
