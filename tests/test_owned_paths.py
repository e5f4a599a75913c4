"""Run dirs and batch outputs in shared places (/tmp): a planted symlink or another user's file is
refused with what to do, never followed, chmodded or trusted (issue 11, item 5; cache_daemon/owned.py).

These run `failover up` and the cache daemon as real processes; every refusal happens before either
starts anything, so each test takes about an interpreter start.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coserve_helpers import node_config
from supervisor_helpers import REPO

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")


def up(config) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "failover", "up", str(config)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def daemon(model, run_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cache_daemon", "--model", str(model), "--run-dir", str(run_dir),
                           "--log-level", "warning"], capture_output=True, text=True, timeout=60, cwd=REPO)


def chat_only(tmp, model, run_dir, **batch) -> os.PathLike:
    services = [{"name": "chat", "kind": "online", "priority": 100, "standbys": 0, "kv_memory": "8MiB"}]
    if batch:
        (tmp / "in.jsonl").write_text('{"id": "p1", "prompt": "x", "max_tokens": 2}\n')
        services.append({"name": "offline", "kind": "batch", "priority": 10, "standbys": 0, "kv_memory": "8MiB",
                         "batch": {"input": str(tmp / "in.jsonl")} | batch})
    return node_config(tmp / "node.toml", model=model, run_dir=run_dir, services=services)


def test_a_run_dir_planted_as_a_symlink_is_refused_and_its_target_left_alone(tiny_model, run_dir):
    target = run_dir / "target"  # stands for a directory of root's that the attacker points at
    target.mkdir()
    os.chmod(target, 0o755)
    link = run_dir / "node"
    link.symlink_to(target)
    res = up(chat_only(run_dir, tiny_model, link))
    assert res.returncode == 2, res.stderr
    assert f"run_dir: run dir {link} is a symbolic link" in res.stderr and "remove it" in res.stderr
    res = daemon(tiny_model, link)
    assert res.returncode == 1 and f"run dir {link} is a symbolic link" in res.stderr, res.stderr
    assert target.stat().st_mode & 0o777 == 0o755 and os.listdir(target) == []
    assert link.is_symlink()


@as_root
def test_a_run_dir_of_another_uid_or_writable_by_others_is_refused(tiny_model, run_dir):
    foreign = run_dir / "node"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, NOBODY, NOBODY)
    res = up(chat_only(run_dir, tiny_model, foreign))
    assert res.returncode == 2 and f"belongs to uid {NOBODY}, not to us (uid 0)" in res.stderr, res.stderr
    res = daemon(tiny_model, foreign)
    assert res.returncode == 1 and f"belongs to uid {NOBODY}" in res.stderr, res.stderr
    assert os.listdir(foreign) == [] and foreign.stat().st_mode & 0o777 == 0o755
    os.chown(foreign, 0, 0)
    os.chmod(foreign, 0o777)  # ours, but anyone could have planted files in it
    res = up(chat_only(run_dir, tiny_model, foreign))
    assert res.returncode == 2 and "writable by group or others (mode 0777)" in res.stderr, res.stderr
    assert os.listdir(foreign) == []


def test_a_precreated_0666_output_with_a_forged_line_is_refused_before_anything_runs(tiny_model, run_dir):
    out = run_dir / "out.jsonl"
    out.write_text('{"id":"p1","response":{"status_code":200,"body":"forged"},"error":null}\n')
    os.chmod(out, 0o666)
    res = up(chat_only(run_dir, tiny_model, run_dir / "node", output=str(out)))
    assert res.returncode == 2, res.stderr
    assert f"service[1].batch.output: batch output {out} is writable by group or others (mode 0666)" in res.stderr
    assert not (run_dir / "node").exists()
    link = run_dir / "link.jsonl"
    link.symlink_to(run_dir / "elsewhere.jsonl")  # dangling: we would have created root's file there
    res = up(chat_only(run_dir, tiny_model, run_dir / "node", output=str(link)))
    assert res.returncode == 2 and f"batch output {link} is a symbolic link" in res.stderr, res.stderr
    assert not (run_dir / "elsewhere.jsonl").exists()


@as_root
def test_an_output_of_another_uid_is_refused(tiny_model, run_dir):
    out = run_dir / "out.jsonl"
    out.write_text("")
    os.chmod(out, 0o600)
    os.chown(out, NOBODY, NOBODY)
    res = up(chat_only(run_dir, tiny_model, run_dir / "node", output=str(out)))
    assert res.returncode == 2 and f"batch output {out} belongs to uid {NOBODY}" in res.stderr, res.stderr


def test_output_mode_is_checked_where_the_config_is_read(tiny_model, run_dir):
    res = up(chat_only(run_dir, tiny_model, run_dir / "node", output=str(run_dir / "o.jsonl"), output_mode=0o666))
    assert res.returncode == 2 and "service[1].batch.output_mode: 0o666 must let us read and write" in res.stderr
