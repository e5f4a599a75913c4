"""CPU placement (``router.cpus``, ``failover router --cpus``): the router on cores of its own, every
process the node starts on the others. Real processes; each one's placement is asked of the kernel
(``sched_getaffinity``) for every thread of it (``/proc/PID/task``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import free_port
from failover.cmd.admin import render_table
from failover.config.schema import ConfigError, load_config
from failover.config.preflight import preflight
from failover.coserve.release import descendants
from failover_common import cpus
from supervisor_helpers import Node, http, wait_until, write_config

ALLOWED = frozenset(os.sched_getaffinity(0))
TWO = pytest.mark.skipif(len(ALLOWED) < 2, reason="placement needs two CPUs this process may run on")


def threads_cpus(pid: int) -> dict[int, frozenset[int]]:
    """Every thread of ``pid`` (tid -> the CPUs it may run on)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))  # a thread id works as a pid here
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    return out


@pytest.mark.parametrize("listed, cpus_, canonical", [
    ("0", {0}, "0"), ("0-3,8", {0, 1, 2, 3, 8}, "0-3,8"), ("3, 1,2", {1, 2, 3}, "1-3"), ("5-5", {5}, "5"),
])
def test_cpu_lists_parse_as_the_kernel_writes_them(listed, cpus_, canonical):
    assert cpus.parse(listed) == cpus_
    assert cpus.text(cpus.parse(listed)) == canonical


@pytest.mark.parametrize("listed", ["", "a", "1-", "-1", "3-1", "0,,1", "²", "9000"])
def test_a_bad_cpu_list_is_refused_saying_which_part(listed):
    with pytest.raises(ValueError, match="CPU list"):
        cpus.parse(listed)


def test_the_router_takes_only_cpus_the_node_has_and_leaves_the_engines_some():
    assert cpus.split("0", frozenset({0, 1, 2, 3})) == ({0}, {1, 2, 3})
    assert cpus.split("1-2", frozenset({0, 1, 2, 3})) == ({1, 2}, {0, 3})
    with pytest.raises(ValueError, match="names CPU.* 4 this process may not run on"):
        cpus.split("3-4", frozenset({0, 1, 2, 3}))
    with pytest.raises(ValueError, match="leave at least one for the engines"):
        cpus.split("0-3", frozenset({0, 1, 2, 3}))


def test_router_cpus_in_the_config_is_checked_at_load_and_against_the_machine(tiny_model, run_dir):
    bad = write_config(run_dir / "bad.toml", model=tiny_model, run_dir=run_dir / "run", router={"cpus": "0-x"})
    with pytest.raises(ConfigError, match=r"router.cpus: CPU list '0-x'"):
        load_config(bad)
    every = cpus.text(ALLOWED)
    greedy = write_config(run_dir / "all.toml", model=tiny_model, run_dir=run_dir / "run", router={"cpus": every})
    config = load_config(greedy)  # the shape is fine; the machine is not
    with pytest.raises(ConfigError, match=r"router.cpus: .* leave at least one for the engines"):
        preflight(config)
    far = write_config(run_dir / "far.toml", model=tiny_model, run_dir=run_dir / "run",
                       router={"cpus": str(max(ALLOWED) + 1)})
    with pytest.raises(ConfigError, match=r"router.cpus: .* may not run on"):
        preflight(load_config(far))


@TWO
def test_a_node_runs_its_router_on_its_cpus_and_every_process_it_starts_on_the_others(procs, tiny_model, run_dir):
    mine = min(ALLOWED)
    rest = ALLOWED - {mine}
    node = Node(procs, tiny_model, run_dir, router={"cpus": str(mine)})
    try:
        doc = node.status()
        sup = doc["supervisor"]
        assert sup["cpus"] == {"router": str(mine), "engines": cpus.text(rest)}
        assert f"cpus: router {mine}, engines {cpus.text(rest)}" in render_table(doc).splitlines()
        placed = threads_cpus(node.proc.pid)
        assert len(placed) > 1 and set(placed.values()) == {frozenset({mine})}, placed  # every thread
        started = [sup["daemon"]["pid"], sup["zygote"]["pid"], *(s["pid"] for s in sup["slots"])]
        assert all(started) and len(started) == 4, sup
        for pid in started:
            for p in [pid, *descendants(pid)]:
                assert set(threads_cpus(p).values()) == {rest}, (pid, p, threads_cpus(p))
        # a replacement, forked by the zygote after the kill, is placed as the first ones were
        primary = next(s for s in sup["slots"] if s["slot"] == doc["services"][0]["primary"])
        os.kill(primary["pid"], signal.SIGKILL)

        def replaced():
            slots = node.status()["supervisor"]["slots"]
            again = next(s for s in slots if s["slot"] == primary["slot"])
            return again if again["pid"] not in (None, primary["pid"]) and again["state"] == "running" else None
        again = wait_until(replaced, 60, "the killed primary's slot running again")
        assert set(threads_cpus(again["pid"]).values()) == {rest}
        code, body = http("POST", node.url + "/v1/completions",
                          {"model": "chat", "prompt": "one two", "max_tokens": 4, "temperature": 0})
        assert code == 200 and body["choices"][0]["text"] is not None, body
    finally:
        node.stop()


@TWO
def test_a_standalone_router_and_its_workers_run_on_the_cpus_given(procs, tmp_path):
    mine = min(ALLOWED)
    token = tmp_path / "admin.token"
    token.write_text("cpus-test-token")
    token.chmod(0o600)
    port = free_port()
    log = open(tmp_path / "router.log", "w")
    proc = procs.python("-m", "failover", "router", "--backend", f"a=http://127.0.0.1:{free_port()}",
                        "--port", str(port), "--workers", "2", "--admin-token-file", str(token),
                        "--cpus", str(mine), "--log-level", "warning", stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        def workers():
            kids = descendants(proc.pid)
            return kids if len(kids) >= 2 else None
        kids = wait_until(workers, 60, "two router workers")
        time.sleep(0.5)  # their loops and threads started
        for pid in [proc.pid, *kids]:
            assert set(threads_cpus(pid).values()) == {frozenset({mine})}, (pid, threads_cpus(pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "router.log").read_text()[-3000:]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_router_cpus_outside_the_machine_are_a_clear_error(workers):
    res = subprocess.run([sys.executable, "-m", "failover", "router", "--backend", "a=http://127.0.0.1:1",
                          "--port", str(free_port()), "--workers", workers, "--cpus", str(max(ALLOWED) + 1)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--cpus: CPU list" in res.stderr and "may not run on" in res.stderr, res.stderr
