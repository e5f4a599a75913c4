"""`failover router --workers N`: N router processes on one port sharing roles through their parent.

Real engines, a real `failover router --workers 2` process tree, the official openai SDK as the client.
A connection goes to whichever worker the kernel picks (SO_REUSEPORT), so each check that must reach
both workers opens fresh connections until it has.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port
from router_helpers import Load, kill, references, start_engines

TOKEN = "workers-test-token"


class NotYet(Exception):
    """A check that may pass on a later try (a worker not listening yet)."""


def get(url: str, path: str, token: bool = False) -> tuple[int, bytes]:
    """One request on a fresh connection (so each call may land on another worker)."""
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read()


def statuses(url: str, attempts: int = 100) -> dict[str, dict]:
    """/admin/status of every worker: fresh connections until both answered (by ``cluster.router``)."""
    seen: dict[str, dict] = {}
    for _ in range(attempts):
        doc = json.loads(get(url, "/admin/status", token=True)[1])
        seen[doc["cluster"]["router"]] = doc
        if len(seen) == 2:
            return seen
    raise NotYet(f"only {sorted(seen)} answered in {attempts} fresh connections")


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (value := predicate()):
                return value
        except (OSError, NotYet, KeyError, IndexError):  # a worker whose view lacks a record or service yet
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


@pytest.fixture
def pool(procs, tiny_model, tmp_path):
    """Two engines (a primary, b standby) behind `failover router --workers 2`; (url, engines, proc)."""
    a, b = start_engines(procs, tiny_model, ["a", "b"])
    token = tmp_path / "admin.token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    log = open(tmp_path / "router.log", "w")
    proc = procs.python("-m", "failover", "router", "--backend", f"a={a.url}", "--standby", f"b={b.url}",
                        "--service", "tiny", "--port", str(port), "--workers", "2", "--admin-token-file", str(token),
                        "--probe-timeout", "1.0", "--failure-threshold", "3", "--log-level", "warning",
                        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: all(
            d["services"][0]["primary"] == "a" for d in statuses(url).values()), 60, "both workers serving a")
    except Exception:
        log.close()
        raise AssertionError(f"the pool did not come up:\n{(tmp_path / 'router.log').read_text()[-3000:]}") from None
    yield url, {"a": a, "b": b}, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "router.log").read_text()[-3000:]
    log.close()


def worker_pids(url: str) -> dict[str, int]:
    return wait_until(lambda: {w: d["cluster"]["routers"][w]["pid"] for w, d in statuses(url).items()}, 30,
                      "both workers' records")


def requests_by_worker(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in get(url, "/metrics")[1].decode().splitlines():
        if line.startswith("failover_router_requests_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] = out.get(worker, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def client(url: str):
    import openai
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_two_workers_share_the_port_and_any_metrics_scrape_counts_both(pool):
    url, _, _ = pool
    pids = worker_pids(url)
    assert len(set(pids.values())) == 2 and all(pid != os.getpid() for pid in pids.values())

    async def go():
        for _ in range(12):  # a new SDK client is a new connection: the kernel spreads them
            c = client(url)
            r = await c.completions.create(model="tiny", prompt="one two", max_tokens=4, temperature=0)
            assert r.choices[0].text is not None
            await c.close()
    asyncio.run(go())
    wait_until(lambda: len(requests_by_worker(url)) == 2, 10, "requests counted by both workers")
    counts = requests_by_worker(url)
    assert sum(counts.values()) >= 12  # whichever worker was scraped, every worker's requests are in it


def fence_warnings(log_path, instance: str) -> list[dict]:
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    return [r for r in rows if r.get("event") == "no_launcher" and r.get("instance") == instance]


def test_primary_kill_under_streaming_load_fails_nothing_and_every_worker_follows_one_primary(pool, tmp_path):
    url, engines, _ = pool

    async def go():
        c = client(url)
        ref = await references(c)
        await c.close()
        loads = [Load(client(url), workers=6) for _ in range(2)]  # 12 connections over the two workers
        for load in loads:
            load.start()
        await asyncio.gather(*(load.streaming(2) for load in loads))
        kill(engines["a"].proc)
        await asyncio.gather(*(load.until(len(load.outcomes) + 12, timeout=60) for load in loads))
        for load in loads:
            await load.stop()
            await load.c.close()
            load.check(ref)  # 0 failed, every answer equal to the uninterrupted greedy run
        return sum(len(load.outcomes) for load in loads)
    assert asyncio.run(go()) > 24
    docs = statuses(url)
    for worker, doc in docs.items():
        svc = doc["services"][0]
        roles = {i["name"]: i["role"] for i in svc["instances"]}
        assert svc["primary"] == "b" and roles["a"] != "primary", (worker, roles)
    holders = {w: d["cluster"]["holders"]["tiny"] for w, d in docs.items()}
    assert len({(h["instance"], h["revision"]) for h in holders.values()}) == 1, holders  # one decision
    assert all(v > 0 for v in requests_by_worker(url).values()) and len(requests_by_worker(url)) == 2
    # every worker fences a; the operator is told once (worker 1), not once per worker
    wait_until(lambda: fence_warnings(tmp_path / "router.log", "a"), 10, "worker 1's fence warning")
    time.sleep(0.5)  # a second worker's warning, if any, has been written too
    warned = fence_warnings(tmp_path / "router.log", "a")
    assert [w["process"] for w in warned] == ["router-worker-1"], warned


def test_a_killed_worker_is_restarted_while_the_other_keeps_serving(pool):
    url, _, proc = pool
    before = worker_pids(url)
    os.kill(before["worker-1"], signal.SIGKILL)
    # connections already queued on the dying worker's listener are reset by the kernel as it closes;
    # once it is gone (its parent reaped it) every new connection goes to the survivor
    wait_until(lambda: not Path(f"/proc/{before['worker-1']}").exists(), 10, "worker-1 reaped")
    codes = [get(url, "/v1/models")[0] for _ in range(30)]  # before its replacement is up: the survivor
    assert codes == [200] * 30
    def restarted():
        pids = {w: d["cluster"]["routers"][w]["pid"] for w, d in statuses(url).items()}
        return pids if pids["worker-1"] != before["worker-1"] else None
    after = wait_until(restarted, 30, "worker-1 restarted")
    assert after["worker-2"] == before["worker-2"]
    assert all(d["services"][0]["primary"] == "a" for d in statuses(url).values())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    for pid in after.values():  # every worker ended with its parent
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.parametrize("argv, says", [
    (["--workers", "0"], "--workers must be 1..64"),
    (["--workers", "1000"], "--workers must be 1..64"),
    (["--workers", "two"], "whole number"),
    (["--workers", "2", "--port", "0"], "needs a fixed --port"),
    (["--workers", "2", "--etcd", "http://127.0.0.1:1"], "an etcd cluster is one process"),
])
def test_bad_worker_counts_are_clear_errors(argv, says):
    res = subprocess.run([sys.executable, "-m", "failover", "router", "--backend", "a=http://127.0.0.1:1", *argv],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and says in res.stderr, res.stderr
