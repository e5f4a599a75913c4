"""Co-serving on a real node: a batch service evicted and resumed under online traffic loses nothing.

Each test runs `failover up` (cache daemon, zygote, engines forked from it) on CPU with the tiny model.
Results are compared with a second batch service that runs the same input on the same node without
ever being preempted (greedy decoding: the same request gives the same tokens).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

from failover.config.argv import share
from failover.procs.priority import nice_of
from coserve_helpers import Burst, CoNode, batch_input, essence, node_config, read_output
from supervisor_helpers import REPO, Load, wait_until

DEADLINE = 0.5  # evict_timeout: SIGTERM -> SIGKILL
KILL_SLACK_MS = 400  # SIGKILL -> reaped, on a loaded 2-core machine
ITEMS = 1200  # enough that a quiet machine cannot finish the batch before the tenth preemption (160 did,
# once each engine got its share of the cores: docs/operations.md, "CPU threads")


def online(**kw) -> dict:
    return {"name": "chat", "kind": "online", "priority": 100, "standbys": 0, "kv_memory": "8MiB",
            "max_batch": 8} | kw


def batch(name: str, priority: int, **kw) -> dict:
    return {"name": name, "kind": "batch", "priority": priority, "standbys": 0, "kv_memory": "8MiB",
            "max_batch": 8, "batch": kw}


def test_ten_preemptions_under_online_traffic_lose_and_repeat_nothing(procs, tiny_model, run_dir):
    ids = batch_input(run_dir / "in.jsonl", ITEMS)
    common = dict(input=str(run_dir / "in.jsonl"), concurrency=2, queue_high=4, queue_low=1,
                  ttft_high=1000.0, ttft_low=999.0,  # load = queue depth here; CPU TTFT is too noisy
                  hold=0.3, sample_interval=0.1, evict_timeout=DEADLINE)
    node = CoNode(procs, tiny_model, run_dir, [
        online(),
        batch("offline", 10, output=str(run_dir / "out.jsonl"), **common),
        batch("ref", 5, output=str(run_dir / "ref.jsonl"), watch=[], **common),  # never preempted
    ])
    rng = random.Random(6)
    kinds = ["operator", "load"] * 5
    rng.shuffle(kinds)
    traffic = Load(node.url, workers=1)
    traffic.start()
    spikes: list[str] = []
    try:
        for n, kind in enumerate(kinds):
            # a random moment: the batch back and serving, a random number of new results, a random delay
            b = wait_until(lambda: (b := node.batch("offline"))["state"] == "running"
                           and node.slot("offline-0")["state"] == "running" and b, 60, "the batch running")
            target = b["done"] + rng.randint(0, 2)
            wait_until(lambda: node.batch("offline")["done"] >= target, 60, "new batch results")
            time.sleep(rng.uniform(0.0, 0.2))
            assert node.batch("offline")["state"] == "running", "the batch finished too early for the test"
            if kind == "operator":
                res = node.cli("preempt", "offline") if n % 2 else None
                if res is None:
                    node.admin("preempt", "offline")
                else:
                    assert res.returncode == 0, res.stderr
                wait_until(lambda: node.batch("offline")["preemptions"] == n + 1, 30, "the eviction")
                assert node.batch("offline")["state"] == "preempted"
                time.sleep(rng.uniform(0.0, 0.3))
                res = node.cli("resume", "offline")
                assert res.returncode == 0, res.stderr
            else:  # a spike of online requests: queue depth over queue_high evicts, calm resumes
                # a fast machine may answer one spike between two load samples: spike until it evicts
                deadline = time.monotonic() + 30
                while node.batch("offline")["preemptions"] < n + 1:
                    assert time.monotonic() < deadline, "no load eviction after 30 s of spikes"
                    spikes += Burst(node.url, 12, max_tokens=48).join()
                assert node.batch("offline")["preemptions"] == n + 1
        wait_until(lambda: node.batch("offline")["state"] == "done" and node.batch("ref")["state"] == "done",
                   120, "both batches done")
    finally:
        traffic.stop()
    table = node.cli("status")
    metrics = http_text(node.url + "/metrics")
    preempted, resumed = node.events("batch_preempted"), node.events("batch_resumed")
    node.stop()

    # online requests never failed
    assert traffic.failures == [] and spikes == [], (traffic.failures + spikes)[:5]
    assert traffic.ok > 0
    # every input id exactly once, results identical to the uninterrupted run
    out, ref = read_output(run_dir / "out.jsonl"), read_output(run_dir / "ref.jsonl")
    assert Counter(r["id"] for r in out) == Counter(ids)
    assert Counter(r["id"] for r in ref) == Counter(ids)
    ref_by_id = {r["id"]: essence(r) for r in ref}
    assert {r["id"]: essence(r) for r in out} == ref_by_id
    # bad lines: an error record with its line number, and the run went on
    by_id = {r["id"]: r for r in out}
    assert by_id["in.jsonl:4"]["error"]["message"].startswith("line is not JSON")
    assert by_id["in.jsonl:4"]["error"]["line"] == "in.jsonl:4"
    assert by_id["no-prompt"]["error"] == {"message": "request has no 'prompt'", "line": "in.jsonl:8"}
    assert sum(r["response"] is not None and r["response"]["status_code"] == 200 for r in out) == ITEMS
    # ten evictions, as triggered, each within its deadline, memory verified free
    mine = [e for e in preempted if e["service"] == "offline"]
    assert [e for e in preempted if e["service"] == "ref"] == []
    assert Counter(e["reason"] for e in mine) == {"operator": 5, "load": 5}, mine
    for e in mine:
        assert e["memory_verified"] is True, e
        assert e["term_to_gone_ms"] <= DEADLINE * 1e3 + KILL_SLACK_MS, e
    # ten resumes, each timed to its engine's /ready and to its first new result (unless it was
    # evicted again before one: the random moment may fall before the first result)
    back = [e for e in resumed if e["service"] == "offline"]
    assert len(back) == 10 and all("ready_ms" in e for e in back), back
    assert all("first_result_ms" in e or e.get("evicted_first") for e in back), back
    # progress in `failover status` and on /metrics
    assert table.returncode == 0 and f"batch offline: done, {ITEMS + 2}/{ITEMS + 2} done (2 errors)" in table.stdout, table.stdout
    assert f'failover_supervisor_batch_requests_done{{service="offline"}} {ITEMS + 2}.0' in metrics
    counted = [line for line in metrics.splitlines() if line.startswith("failover_supervisor_batch_preemptions_total")]
    for reason in ("operator", "load"):  # the counter, by reason, as the events above (labels sorted)
        assert f'failover_supervisor_batch_preemptions_total{{reason="{reason}",service="offline"}} 5.0' in counted, counted


def http_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def test_a_relaunch_that_needs_the_memory_evicts_the_batch_first(procs, tiny_model, run_dir):
    # enough that it still runs when the standby is killed: 12 were done within 70 ms of the batch
    # engine's start once engines froze their start's heap (failover_common/gc_pauses.py), and the
    # kill then found nothing to evict (1 run in 4)
    ids = batch_input(run_dir / "in.jsonl", 200, bad_lines=False)
    node = CoNode(procs, tiny_model, run_dir, [
        online(standbys=1),
        # a margin no machine has: every online relaunch finds too little free memory
        batch("offline", 10, input=str(run_dir / "in.jsonl"), output=str(run_dir / "out.jsonl"),
              concurrency=1, hold=0.2, sample_interval=0.1, memory_margin="1000TiB"),
    ])
    try:
        standby = wait_until(lambda: (p := node.serving_pair()) and p[1], 60, "a ready standby")
        wait_until(lambda: node.batch("offline")["state"] == "running", 30, "the batch running")
        # the batch engine runs batch.nice (10) below the supervisor, every thread; the online
        # primary and its ready standby at the supervisor's own priority
        base = os.getpriority(os.PRIO_PROCESS, 0)  # the supervisor's: `failover up` inherits ours
        assert set(nice_of(node.slot("offline-0")["pid"])) == {min(19, base + 10)}
        for inst in node.serving_pair():
            assert set(nice_of(inst["pid"])) == {base}, inst
        # the node's cores (less one) shared out between the two engines that compute at once, as each reports
        each = share(len(os.sched_getaffinity(0)), 2)
        assert [node.slot(s)["cpu_threads"] for s in ("chat-0", "chat-1", "offline-0")] == [each] * 3
        os.kill(standby["pid"], signal.SIGKILL)
        wait_until(lambda: node.batch("offline")["preemptions"] == 1, 30, "the memory eviction")
        assert node.batch("offline")["last_preempt"]["reason"] == "memory"
        wait_until(lambda: (p := node.serving_pair()) and p[1]["pid"] != standby["pid"], 60, "the standby back")
        time.sleep(0.5)  # calm, but the memory is still short: no resume by itself
        assert node.batch("offline")["state"] == "preempted"
        res = node.cli("resume", "offline")  # an operator's decision overrides the memory check
        assert res.returncode == 0, res.stderr
        wait_until(lambda: node.batch("offline")["state"] == "done", 90, "the batch done")
        events = node.events("batch_preempted")
        lowered = node.events("batch_priority_lowered")
    finally:
        node.stop()
    assert [e["reason"] for e in events] == ["memory"] and events[0]["memory_verified"] is True
    assert len(lowered) == 2 and all(e["nice"] == min(19, base + 10) for e in lowered), lowered  # resumed too
    assert Counter(r["id"] for r in read_output(run_dir / "out.jsonl")) == Counter(ids)


def test_unwritable_output_or_missing_input_stops_before_any_work(tiny_model, run_dir):
    (run_dir / "in.jsonl").write_text('{"prompt": "x"}\n')
    (run_dir / "out.jsonl").mkdir()  # a directory where the results file should be (fails as root too)
    path = node_config(run_dir / "node.toml", model=tiny_model, run_dir=run_dir / "node", services=[
        online(), batch("offline", 10, input=str(run_dir / "in.jsonl"), output=str(run_dir / "out.jsonl"))])
    res = subprocess.run([sys.executable, "-m", "failover", "up", str(path)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert res.returncode == 2, res.stderr
    assert f"service[1].batch.output: {run_dir / 'out.jsonl'} is not a regular file" in res.stderr
    assert os.listdir(run_dir / "out.jsonl") == [] and not (run_dir / "node").exists()

    path = node_config(run_dir / "node.toml", model=tiny_model, run_dir=run_dir / "node", services=[
        online(), batch("offline", 10, input=str(run_dir / "nope.jsonl"), output=str(run_dir / "o2.jsonl"),
                        queue_low=9, queue_high=8)])
    res = subprocess.run([sys.executable, "-m", "failover", "up", str(path)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert res.returncode == 2
    assert "service[1].batch.queue_low: 9 must be below queue_high (8)" in res.stderr
    (run_dir / "node.toml").write_text((run_dir / "node.toml").read_text().replace("queue_low = 9", "queue_low = 1"))
    res = subprocess.run([sys.executable, "-m", "failover", "up", str(path)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert res.returncode == 2 and "service[1].batch.input:" in res.stderr and "does not exist" in res.stderr
    assert not (run_dir / "o2.jsonl").exists()


def test_status_line_of_a_batch_service():
    from failover.cmd.admin import render_table

    doc = {"services": [{"name": "offline", "instances": [], "batch": {
        "state": "preempted", "preempted_by": "load", "done": 37, "total": 100, "errors": 2,
        "tokens_per_s": 52.14, "eta_s": 75.0, "preemptions": 3}}]}
    assert render_table(doc).splitlines()[-1] == (
        "batch offline: preempted (load), 37/100 done (2 errors), 52.1 tok/s, ETA 1m15s, 3 preemptions")


def test_shipped_coserve_examples_parse_and_the_cpu_one_passes_its_batch_checks(monkeypatch):
    from failover.config.preflight import _check_batch_files
    from failover.config.schema import load_config

    monkeypatch.chdir(REPO)  # the CPU example names its input relative to the repository root
    cpu = load_config(REPO / "deploy" / "examples" / "coserve-cpu.toml")
    gpu = load_config(REPO / "deploy" / "examples" / "coserve-gpu.toml")
    assert [s.kind for s in cpu.service] == [s.kind for s in gpu.service] == ["online", "batch"]
    assert _check_batch_files("service[1].batch", cpu.service[1].batch) == []


def test_batch_keys_are_checked_with_their_key_path(tiny_model):
    import pytest

    from failover.config.schema import ConfigError, parse_config

    def problems(online_kw: dict, batch_kw: dict) -> str:
        raw = {"run_dir": "/tmp/x", "model": {"path": str(tiny_model), "device": "cpu"}, "service": [
            {"name": "chat", "port": 9100} | online_kw,
            {"name": "offline", "kind": "batch", "standbys": 0, "port": 9200,
             "batch": {"input": "in.jsonl", "output": "out.jsonl"} | batch_kw}]}
        with pytest.raises(ConfigError) as info:
            parse_config(raw)
        return str(info.value)

    msg = problems({}, {"watch": ["nope"], "ttft_low": 2.0, "memory_margin": "lots"})
    assert "service[1].batch.watch: 'nope' is not an online service; online: ['chat']" in msg
    assert "service[1].batch.ttft_low: 2.0 must be below ttft_high (1.0)" in msg
    assert "service[1].batch.memory_margin:" in msg
    assert "service[1].batch.evict_timeout: expected a number" in problems({}, {"evict_timeout": "soon"})
    assert "only a service with kind = \"batch\" takes [service.batch]" in problems(
        {"batch": {"input": "a", "output": "b"}}, {})


def test_ttft_is_read_from_the_engines_own_metrics_page():
    from engine.metrics import EngineMetrics
    from failover.coserve.load import ttft_totals

    m = EngineMetrics("chat")
    assert ttft_totals(m.render().decode()) == (0.0, 0.0)
    for seconds in (0.1, 0.3):
        m.ttft.labels("chat").observe(seconds)
    total, count = ttft_totals(m.render().decode())
    assert count == 2 and abs(total - 0.4) < 1e-9
