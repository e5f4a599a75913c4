"""`failover status|promote|drain` against a running node; refusals are clear and exit non-zero."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from supervisor_helpers import Node, wait_until, write_config


@pytest.fixture
def node(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir)
    yield n
    n.stop()


def test_status_and_refusals(node):
    primary, standby = wait_until(node.serving_pair, 30, "a ready pair")
    table = node.cli("status")
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split() == ["SERVICE", "INSTANCE", "ROLE", "PID", "URL", "READY", "UPTIME", "KV"]
    assert {r.split()[2] for r in rows[:2]} == {"primary", "standby"}
    doc = json.loads(node.cli("status", "--json").stdout)
    assert doc["services"][0]["name"] == "chat" and doc["supervisor"]["launch"] == "zygote"

    res = node.cli("promote", "--to", primary["name"])  # the primary is no standby
    assert res.returncode == 1
    assert "only a ready standby can be promoted" in res.stderr and res.stderr.count("\n") == 1
    res = node.cli("promote", "--to", "chat-9")
    assert res.returncode == 1 and "unknown instance 'chat-9'" in res.stderr
    res = node.cli("drain", "nope-0")
    assert res.returncode == 1 and "unknown instance 'nope-0'" in res.stderr
    res = node.cli("preempt", "nosuch")
    assert res.returncode == 1 and "unknown service 'nosuch'" in res.stderr
    res = node.cli("preempt", "chat")  # an online service: refused, nothing stopped
    assert res.returncode == 1 and "'chat' is an online service" in res.stderr and "--force" in res.stderr
    pair = node.serving_pair()
    assert pair is not None and (pair[0]["pid"], pair[1]["pid"]) == (primary["pid"], standby["pid"])


def test_promote_then_drain_from_the_cli(node):
    primary, standby = wait_until(node.serving_pair, 30, "a ready pair")
    res = node.cli("promote", "--to", standby["name"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("promote: ok")
    assert node.role("primary")["name"] == standby["name"]
    # the old primary drained and stayed on as the standby
    wait_until(lambda: node.role("standby")["name"] == primary["name"], 10, "the old primary as standby")

    new_primary, old = wait_until(node.serving_pair, 30, "a ready pair")
    res = node.cli("drain", new_primary["name"], "--timeout", "5")
    assert res.returncode == 0, res.stderr
    assert node.role("primary")["name"] == old["name"]  # switched away before draining
    # the drained instance is recycled: a fresh process, back as a ready standby
    wait_until(lambda: (p := node.serving_pair()) and p[1]["name"] == new_primary["name"]
               and p[1]["pid"] != new_primary["pid"], 30, "the drained instance back as standby")


def test_no_router_and_bad_usage(tmp_path, tiny_model, run_dir):
    path = write_config(tmp_path / "c.toml", model=tiny_model, run_dir=run_dir)
    res = subprocess.run([sys.executable, "-m", "failover", "status", "--config", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "no admin token" in res.stderr
    (run_dir / "admin.token").write_text("x\n")
    res = subprocess.run([sys.executable, "-m", "failover", "status", "--config", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "cannot reach the router" in res.stderr
    res = subprocess.run([sys.executable, "-m", "failover", "status"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--config" in res.stderr
