"""`failover up` as a real process: failures of each part are healed and serving never stops."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from failover.procs import priority
from supervisor_helpers import REPO, Load, Node, alive, http, wait_until


@pytest.fixture
def node(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir)
    yield n
    n.stop()  # Ctrl-C: exit 0, no process, no file left (asserted)


def test_kill_primary_under_load_switches_and_relaunches_through_the_zygote(node):
    primary, standby = wait_until(node.serving_pair, 30, "a ready primary and standby")
    load = Load(node.url)
    load.start()
    wait_until(lambda: load.total() >= 5, 30, "some traffic")
    os.kill(primary["pid"], signal.SIGKILL)
    # the router switches to the standby; the dead slot comes back as a ready standby, new pid
    wait_until(lambda: node.role("primary")["name"] == standby["name"], 10, "the switch")
    back = wait_until(lambda: (p := node.serving_pair()) and p[1]["name"] == primary["name"]
                      and p[1]["pid"] != primary["pid"] and p, 30, "the replacement standby")
    seen = load.total()
    wait_until(lambda: load.total() >= seen + 5, 30, "traffic after the failover")
    load.stop()
    assert load.failures == [], load.failures[:5]
    assert back[0]["name"] == standby["name"]
    slot = node.slot(primary["name"])
    assert slot["weights_source"] == "cache" and slot["launches"] == 2
    assert slot["last_relaunch_ms"] is not None
    assert node.status()["last_failover"]["chat"]["old"] == primary["name"]
    assert "launch=zygote" in node.log() or '"launch": "zygote"' in node.log()
    # the replacement standby started below the supervisor's CPU priority, and is back at it, ready
    new = back[1]["pid"]
    for event in ("standby_priority_lowered", "standby_priority_restored"):
        assert any(f'"pid": {new},' in line or f"pid={new} " in line
                   for line in node.log().splitlines() if event in line), (event, node.log()[-2000:])
    assert set(priority.nice_of(new)) == {priority.base()}


def test_kill_standby_zygote_and_daemon_each_replaced_while_serving(node):
    primary, standby = wait_until(node.serving_pair, 30, "a ready primary and standby")
    sup = node.status()["supervisor"]
    load = Load(node.url, workers=2)
    load.start()

    os.kill(standby["pid"], signal.SIGKILL)
    wait_until(lambda: (p := node.serving_pair()) and p[1]["pid"] != standby["pid"], 30, "a new standby")
    assert node.role("primary")["pid"] == primary["pid"]  # the primary never moved

    os.kill(sup["zygote"]["pid"], signal.SIGKILL)
    wait_until(lambda: node.status()["supervisor"]["zygote"]["pid"] not in (None, sup["zygote"]["pid"]),
               30, "a new zygote")

    os.kill(sup["daemon"]["pid"], signal.SIGKILL)
    wait_until(lambda: (d := node.status()["supervisor"]["daemon"])["ready"] and d["pid"] != sup["daemon"]["pid"],
               60, "the daemon back")
    assert node.status()["supervisor"]["daemon"]["incidents"][-1]["returncode"] == -9

    # after all that, a failover still relaunches through the new zygote from the new daemon
    primary2, standby2 = wait_until(node.serving_pair, 30, "a ready pair")
    os.kill(primary2["pid"], signal.SIGKILL)
    wait_until(lambda: (p := node.serving_pair()) and p[1]["name"] == primary2["name"]
               and p[1]["pid"] != primary2["pid"], 30, "the replacement standby")
    seen = load.total()
    wait_until(lambda: load.total() >= seen + 3, 30, "traffic at the end")
    load.stop()
    assert load.failures == [], load.failures[:5]
    assert alive(node.status()["supervisor"]["zygote"]["pid"])


def test_sigterm_is_a_clean_shutdown_too(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir)
    n.stop(signal.SIGTERM)


def test_engines_take_admin_calls_only_with_the_supervisors_engine_token(node):
    token_file = node.config.engine_token_path
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.stat().st_uid == os.getuid()
    engine_token = token_file.read_text().strip()
    assert engine_token and engine_token != node.token  # not the router's admin token
    url = f"http://127.0.0.1:{node.config.service[0].ports[0]}"
    kv_bytes = http("GET", url + "/ready")[1]["kv_bytes"]
    grow = {"kv_memory": 2 * kv_bytes}
    for token in (None, "wrong", node.token):
        assert http("POST", url + "/admin/kv", grow, token=token)[0] == 401
    code, doc = http("POST", url + "/admin/kv", grow, token=engine_token)
    assert code == 200 and doc["kv_bytes"] >= kv_bytes, doc  # (the pool may be at max_batch already)
    # node.stop() then asserts the run dir, engine.token included, is gone


def test_crash_loop_marks_the_service_failed(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir, supervisor={"crash_loop_exits": 3, "crash_loop_window": 60.0,
                                                     "backoff_initial": 0.05})
    try:
        for _ in range(3):
            primary, standby = wait_until(n.serving_pair, 30, "a ready pair")
            os.kill(standby["pid"], signal.SIGKILL)
            wait_until(lambda: n.slot(standby["name"])["pid"] != standby["pid"], 30, "the exit seen")
        doc = wait_until(lambda: (d := n.status())["supervisor"]["failed"] and d, 10, "the service failed")
        assert "exited 3 times" in doc["supervisor"]["failed"]["chat"]
        assert "failed" in doc["services"][0]["state"]
        assert "service_failed" in n.log()
        # still serving on the primary; an operator's resume brings the standby back
        assert n.role("primary")["ready"]
        resumed = n.cli("resume", "chat")
        assert resumed.returncode == 0, resumed.stderr
        wait_until(n.serving_pair, 30, "the standby back after resume")
    finally:
        n.stop()


def test_demo_exits_0_and_its_figures_parse():
    import re
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "failover", "demo", "--warmup", "1", "--after", "0.5"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    figures = dict(re.findall(r"^([a-z_]+)=(\S+)$", res.stdout, re.M))
    for key in ("blackout_ms", "detect_ms", "switch_ms", "exit_seen_ms", "relaunch_ms"):
        assert float(figures[key]) >= 0, key
    assert int(figures["requests"]) > 0 and int(figures["failed"]) == 0
    assert figures["relaunch_weights_source"] == "cache" and figures["relaunch_launch"] == "zygote"
    assert figures["leftover_processes"] == "0" and figures["leftover_run_dir"] == "0"
    assert "kill -9" in res.stdout


def test_hung_primary_is_fenced_and_replaced(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir, supervisor={"stop_timeout": 1.0})
    try:
        primary, standby = wait_until(n.serving_pair, 30, "a ready pair")
        load = Load(n.url, workers=2)
        load.start()
        wait_until(lambda: load.total() >= 3, 30, "some traffic")
        os.kill(primary["pid"], signal.SIGSTOP)  # alive, holding its port, answering nothing
        wait_until(lambda: n.role("primary")["name"] == standby["name"], 15, "the probe-driven switch")
        # the router asks the supervisor to fence it: SIGTERM, then SIGKILL (a stopped process ignores TERM)
        wait_until(lambda: not alive(primary["pid"]), 15, "the hung engine fenced")
        wait_until(lambda: (p := n.serving_pair()) and p[1]["name"] == primary["name"]
                   and p[1]["pid"] != primary["pid"], 30, "its replacement as standby")
        seen = load.total()
        wait_until(lambda: load.total() >= seen + 3, 30, "traffic after the fence")
        load.stop()
        assert load.failures == [], load.failures[:5]
        assert '"reason": "fenced by the router"' in n.log()
    finally:
        n.stop()


def test_an_engine_that_hangs_every_time_it_is_promoted_backs_off_and_ends_failed(procs, tiny_model, run_dir):
    # every new primary hangs (SIGSTOP), 5 times under load: the router fences each, and the fence's
    # exit goes through the restart policy like a crash, so the relaunches back off and the 5th ends
    # the service in `failed`; the other instance goes on serving and no request fails
    n = Node(procs, tiny_model, run_dir, supervisor={"stop_timeout": 1.0, "crash_loop_exits": 5,
                                                     "crash_loop_window": 300.0, "backoff_initial": 0.2})
    load = Load(n.url, workers=2)
    try:
        load.start()
        for _ in range(5):
            primary, standby = wait_until(n.serving_pair, 60, "a ready pair")
            os.kill(primary["pid"], signal.SIGSTOP)
            wait_until(lambda: not alive(primary["pid"]), 30, "the hung primary fenced")
        doc = wait_until(lambda: (d := n.status())["supervisor"]["failed"] and d, 15, "the service failed")
        assert "exited 5 times" in doc["supervisor"]["failed"]["chat"]
        res = n.cli("status", "--json")
        assert res.returncode == 0, res.stderr
        status = json.loads(res.stdout)
        assert "failed" in status["services"][0]["state"]
        assert "exited 5 times" in status["supervisor"]["failed"]["chat"]
        assert n.role("primary")["name"] == standby["name"] and n.role("primary")["ready"]
        seen = load.total()
        wait_until(lambda: load.total() >= seen + 5, 30, "the other instance serving")
        load.stop()
        assert load.failures == [], load.failures[:5]
        assert n.log().count('"new": "backoff"') >= 3  # the relaunches after the first waited
        assert n.log().count('"reason": "fenced by the router"') >= 5
    finally:
        load.stop()
        n.stop()


def test_supervisor_sigkill_leaves_no_orphan_and_the_run_dir_is_reusable(procs, tiny_model, run_dir):
    n = Node(procs, tiny_model, run_dir)
    wait_until(n.serving_pair, 30, "a ready pair")
    n.status()
    pids = set(n.seen_pids)
    assert len(pids) == 4  # daemon, zygote, two engines
    n.proc.kill()
    n.proc.wait(10)
    n._log.close()
    wait_until(lambda: not any(alive(p) for p in pids), 15, "every child gone with the supervisor")
    assert not (n.run_dir / "daemon.sock").exists()  # the daemon got SIGTERM and cleaned up
    # a stale pid file does not block the next `failover up` on the same run dir
    n2 = Node(procs, tiny_model, run_dir)
    wait_until(n2.serving_pair, 30, "the node back")
    n2.stop()


def test_a_stale_pid_file_naming_a_reused_pid_and_a_stale_token_are_replaced_at_up(procs, tiny_model, run_dir):
    # after a kill -9 of the supervisor its pid may be reused by any program: that is no supervisor
    sleeper = procs.start(["sleep", "120"])
    node_dir = run_dir / "node"
    node_dir.mkdir(mode=0o700)
    (node_dir / "supervisor.pid").write_text(f"{sleeper.pid}\n")
    (node_dir / "admin.token").write_text("stale\n")
    n = Node(procs, tiny_model, run_dir)
    try:
        assert (node_dir / "supervisor.pid").read_text().strip() == str(n.proc.pid)
        assert n.token != "stale" and stat.S_IMODE((node_dir / "admin.token").stat().st_mode) == 0o600
        # a live supervisor's pid file still keeps a second `up` off the same run dir
        second = n.cli("status")  # (the config's admin client works: the fresh token is the one in use)
        assert second.returncode == 0, second.stderr
        res = subprocess.run([sys.executable, "-m", "failover", "up", str(n.config_path)],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert res.returncode != 0 and "already running" in res.stderr, res.stderr
        assert (node_dir / "supervisor.pid").read_text().strip() == str(n.proc.pid)
    finally:
        n.stop()
    assert alive(sleeper.pid)  # a stale pid file is never a reason to signal its pid
