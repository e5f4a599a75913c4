"""deploy/grafana and deploy/prometheus against a real node: every metric they name is one the node
exports (read off its /metrics pages, not a list), the rules pass promtool, and a real Prometheus
scraping a running `failover up` evaluates every dashboard query and fires exactly the alerts the
node's state calls for."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port
from coserve_helpers import CoNode, batch_input
from supervisor_helpers import Load, http, wait_until

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "failover.json"
RULES = DEPLOY / "prometheus" / "alerts.yml"
NAME = re.compile(r"\b((?:failover|vllm)[a-z0-9_:]*)")
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")


# panels whose series appear with their first event (a failover, a retry, a relaunch, an eviction)
EVENT_PANELS = {"Failover blackout (unplanned)", "Failovers by reason", "Retries, migrated streams, saturated",
                "Relaunches and restarts", "Batch preemptions by reason"}


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard, its annotations included."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]
    return exprs + [("annotation " + a["name"], a["expr"]) for a in doc["annotations"]["list"] if "expr" in a]


def dashboard_exprs() -> list[str]:
    return [e for _, e in dashboard_targets()]


def rule_exprs() -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("", "_sum", "_count")}


def exported(url: str) -> set[str]:
    """Every series name a /metrics page declares, from its families' names and types (a labelled
    family declares its series before its first sample: counters as NAME_total, histograms as
    NAME_bucket/_sum/_count)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        names |= {fam.name + suffix for suffix in SUFFIXES.get(fam.type, ("",))}
        names |= {sample.name for sample in fam.samples}
    return names


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is absent (apt-get install prometheus)")
def test_promtool_checks_the_rules_and_the_scrape_config():
    for args in (["check", "rules", str(RULES)], ["check", "config", str(DEPLOY / "prometheus/prometheus.yml")]):
        res = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr


def test_the_dashboard_is_grafana_json_with_one_query_per_target():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] and doc["__inputs"][0]["pluginId"] == "prometheus"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in doc["panels"]).lower()
    for topic in ("roles", "blackout", "request rate", "error", "first token", "kv", "batch"):
        assert topic in titles, topic


@pytest.fixture
def node(procs, tiny_model, run_dir):
    """An online service with a standby, one without, and a batch whose output file is corrupt."""
    batch_input(run_dir / "in.jsonl", 4, bad_lines=False)
    out = run_dir / "out.jsonl"
    out.write_text('{"id":"p1","respo\n')
    os.chmod(out, 0o600)
    n = CoNode(procs, tiny_model, run_dir, [
        {"name": "chat", "kind": "online", "priority": 100, "standbys": 1, "kv_memory": "8MiB", "max_batch": 4},
        {"name": "solo", "kind": "online", "priority": 90, "standbys": 0, "kv_memory": "8MiB", "max_batch": 4},
        {"name": "offline", "kind": "batch", "priority": 10, "standbys": 0, "kv_memory": "8MiB", "max_batch": 4,
         "batch": {"input": str(run_dir / "in.jsonl"), "output": str(out), "concurrency": 1, "watch": []}},
    ])
    yield n
    n.stop()


def test_dashboard_and_alerts_work_against_a_running_node(node, run_dir, procs):
    wait_until(lambda: node.serving_pair(), 30, "chat's primary and standby ready")
    wait_until(lambda: node.batch("offline")["state"] == "failed", 30, "the batch to fail on its output")
    engines = [f"127.0.0.1:{s['port']}" for s in node.status()["supervisor"]["slots"] if s["pid"]]
    load = Load(node.url, workers=1)  # requests, tokens, TTFT: every family has samples
    load.start()
    try:
        names = exported(node.url)
        for target in engines:
            names |= exported("http://" + target)
        wanted = {m for e in dashboard_exprs() + list(rule_exprs().values()) for m in NAME.findall(e)}
        assert wanted and wanted <= names, f"not exported by the node: {sorted(wanted - names)}"
        if PROMETHEUS is None:
            pytest.skip("prometheus is absent (apt-get install prometheus): queries not evaluated")
        prom = _prometheus(procs, run_dir, node.url.removeprefix("http://"), engines)
        # every dashboard query evaluates (no PromQL error), and the core ones have data
        time.sleep(12)  # a few scrapes: rate() over a 10 s window needs two samples
        results = {(t, e): _query(prom, e.replace("$__rate_interval", "10s")) for t, e in dashboard_targets()}
        roles = results["Roles over time", next(e for t, e in results if t == "Roles over time")]
        assert {s["metric"]["backend"] for s in roles} >= {"chat-0", "chat-1", "solo-0"}
        assert {s["metric"]["backend"]: float(s["value"][1]) for s in roles}["chat-0"] == 1.0  # primary
        empty = [(t, e) for (t, e), r in results.items()
                 if not r and t not in EVENT_PANELS and not t.startswith("annotation")]
        assert not empty, f"queries with no data on a serving node: {empty}"
        # the alerts: a service with no standby, a failed batch; nothing else
        firing = wait_until(lambda: (f := _firing(prom)) >= {("FailoverNoReadyStandby", "solo"),
                                                             ("FailoverBatchFailed", "offline")} and f,
                            30, "the alerts to fire")
        assert firing == {("FailoverNoReadyStandby", "solo"), ("FailoverBatchFailed", "offline")}, firing
    finally:
        load.stop()
    assert load.failures == [], load.failures[:3]


def _prometheus(procs, run_dir: Path, router: str, engines: list[str]) -> str:
    """A real Prometheus scraping the node every second, with the rules' `for:` set to 0 s (the
    same expressions; waiting out each N is not what this test is about)."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule.pop("for", None)
    (run_dir / "rules.yml").write_text(yaml.safe_dump(rules))
    port = free_port()
    (run_dir / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(run_dir / "rules.yml")],
        "scrape_configs": [{"job_name": "failover-router", "static_configs": [{"targets": [router]}]},
                           {"job_name": "failover-engine", "static_configs": [{"targets": engines}]}]}))
    log = open(run_dir / "prometheus.log", "wb")
    procs.start([PROMETHEUS, f"--config.file={run_dir / 'prometheus.yml'}", f"--storage.tsdb.path={run_dir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _up(url), 30, "prometheus to answer")
    wait_until(lambda: len(_query(url, "up == 1")) == 1 + len(engines), 30, "every target scraped")
    return url


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _query(url: str, expr: str) -> list:
    code, doc = http("GET", url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert code == 200 and doc["status"] == "success", (expr, doc)
    return doc["data"]["result"]


def _firing(url: str) -> set[tuple[str, str]]:
    code, doc = http("GET", url + "/api/v1/alerts")
    assert code == 200, doc
    return {(a["labels"]["alertname"], a["labels"].get("service", "")) for a in doc["data"]["alerts"]
            if a["state"] == "firing"}
