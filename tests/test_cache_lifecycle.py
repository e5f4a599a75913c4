"""Daemon lifecycle: clean exit, stale files, a live daemon refused, mappings that outlive a killed
daemon, fp8-block through the daemon, and bad checkpoints refused by the CLI with specific errors."""

from __future__ import annotations

import json
import shutil
import signal
import time

import pytest

from cache_daemon import cli
from cache_daemon.client import attach, evict, ping, status
from cache_daemon.errors import NotResident, ProtocolError
from cache_daemon.fingerprint import make_config
from failover.cli import main as failover_main
from failover.tools.tiny_model import TinySpec, write_checkpoint
from cache_daemon_helpers import arena_fds, arena_mappings, gone, start_daemon, stop_daemon
from test_cache_daemon import digests, disk_digests


def test_sigterm_exits_cleanly_and_removes_its_files(tiny_model, run_dir, procs):
    proc = start_daemon(procs, tiny_model, run_dir)
    ready = json.loads((run_dir / "daemon.ready").read_text())
    assert ready["pid"] == proc.pid and ready["socket"] == str(run_dir / "daemon.sock")
    assert [fp["tp_rank"] for fp in ready["fingerprints"]] == [0]
    assert oct((run_dir / "daemon.sock").stat().st_mode & 0o777) == "0o600"
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
    assert len(arena_fds(proc.pid)) == 1  # the daemon holds the arena fd, and no mapping
    rc, err = stop_daemon(proc, signal.SIGINT)
    assert rc == 0, err
    assert list(run_dir.iterdir()) == []


def test_evict_frees_the_daemon_side_and_keeps_client_mappings(tiny_model, run_dir, procs):
    proc = start_daemon(procs, tiny_model, run_dir)
    sock = run_dir / "daemon.sock"
    config = make_config(tiny_model, dtype="float32", tp_size=1, tp_rank=0)
    with attach(sock, config) as mapped:
        # a running node maps it: refused unless forced (an evict by any same-uid client went unnoticed)
        with pytest.raises(ProtocolError) as refused:
            evict(sock, config)
        assert refused.value.code == "in_use" and "force" in str(refused.value)
        assert status(sock).models[0].attached == 1  # still resident, still served
        assert evict(sock, config, force=True) == mapped.manifest.nbytes
        assert status(sock).models == [] and arena_fds(proc.pid) == []
        assert not (run_dir / "daemon.ready").exists()  # nothing resident: not ready
        assert digests(mapped.tensors) == disk_digests(tiny_model, 0, tp=1)
        with pytest.raises(NotResident):
            attach(sock, config)
    assert stop_daemon(proc)[0] == 0


def test_a_model_nobody_maps_is_evicted_without_force(tiny_model, run_dir, procs):
    proc = start_daemon(procs, tiny_model, run_dir)
    sock = run_dir / "daemon.sock"
    config = make_config(tiny_model, dtype="float32", tp_size=1, tp_rank=0)
    with attach(sock, config):
        pass  # attached, then gone: the daemon counts it off when the connection closes
    deadline = time.monotonic() + 5
    while status(sock).models[0].attached and time.monotonic() < deadline:
        time.sleep(0.02)
    assert evict(sock, config) > 0 and status(sock).models == []
    assert stop_daemon(proc)[0] == 0


def test_mapping_survives_sigkill_and_stale_files_are_cleaned(tiny_model, run_dir, procs):
    proc = start_daemon(procs, tiny_model, run_dir)
    want = disk_digests(tiny_model, 0, tp=1)
    with attach(run_dir / "daemon.sock", make_config(tiny_model, dtype="float32", tp_size=1, tp_rank=0)) as mapped:
        assert digests(mapped.tensors) == want
        assert stop_daemon(proc, signal.SIGKILL)[0] == -signal.SIGKILL
        assert (run_dir / "daemon.sock").exists()  # a dead daemon's socket stays behind
        assert not ping(run_dir / "daemon.sock")
        assert digests(mapped.tensors) == want  # this client's mapping outlived the daemon
    assert arena_fds() == [] and arena_mappings() == []
    # the next daemon removes the stale socket and ready file and serves again
    again = start_daemon(procs, tiny_model, run_dir)
    assert ping(run_dir / "daemon.sock")
    assert stop_daemon(again)[0] == 0
    assert list(run_dir.iterdir()) == []


def test_live_daemon_is_refused_unless_forced(tiny_model, run_dir, procs):
    first = start_daemon(procs, tiny_model, run_dir)
    second = start_daemon(procs, tiny_model, run_dir, wait=False)
    _, err = second.communicate(timeout=30)
    assert second.returncode == 1 and "already serving" in err
    forced = start_daemon(procs, tiny_model, run_dir, "--force")
    assert stop_daemon(first)[0] == 0
    assert ping(run_dir / "daemon.sock"), "the first daemon removed the socket it no longer owns"
    assert stop_daemon(forced)[0] == 0
    assert list(run_dir.iterdir()) == []
    assert gone(first.pid) and gone(forced.pid)


def test_fp8_block_through_the_daemon_matches_disk(tiny_model, run_dir, procs):
    proc = start_daemon(procs, tiny_model, run_dir, "--transform", "fp8-block")
    config = make_config(tiny_model, dtype="float32", tp_size=1, tp_rank=0, transform="fp8-block")
    with attach(run_dir / "daemon.sock", config) as mapped:
        assert digests(mapped.tensors) == disk_digests(tiny_model, 0, tp=1, transform="fp8-block")
        entry = next(e for e in mapped.manifest.tensors if e.name.endswith("q_proj.weight"))
        assert entry.dtype == "float8_e4m3fn" and entry.attrs["scale"] == entry.name + "_scale_inv"
    assert stop_daemon(proc)[0] == 0


@pytest.fixture
def broken(tmp_path):
    return write_checkpoint(tmp_path / "ckpt", TinySpec(shards=2))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _daemon_cli(capsys, model, run_dir, *args) -> tuple[int, str]:
    rc = failover_main(["daemon", "--model", str(model), "--run-dir", str(run_dir), *args])
    return rc, capsys.readouterr().err


def test_missing_shard_is_refused(broken, run_dir, capsys):
    (broken / "model-00002-of-00002.safetensors").unlink()
    rc, err = _daemon_cli(capsys, broken, run_dir)
    assert rc == 2 and "model-00002-of-00002.safetensors" in err and "missing" in err
    assert list(run_dir.iterdir()) == []


def test_dtype_contradicting_config_is_refused(broken, run_dir, capsys):
    _edit_config(broken, torch_dtype="bfloat16")
    rc, err = _daemon_cli(capsys, broken, run_dir)
    assert rc == 2 and "is float32 but config.json torch_dtype is bfloat16" in err


def test_shape_contradicting_config_is_refused(broken, run_dir, capsys):
    _edit_config(broken, intermediate_size=96)
    rc, err = _daemon_cli(capsys, broken, run_dir)
    assert rc == 2 and "has shape [" in err and "intermediate_size" in err


def test_tp_not_dividing_heads_is_refused(broken, run_dir, capsys):
    rc, err = _daemon_cli(capsys, broken, run_dir, "--tp", "3")
    assert rc == 2 and "does not divide num_attention_heads (4)" in err


def test_not_a_checkpoint_is_refused(tmp_path, run_dir, capsys):
    rc, err = _daemon_cli(capsys, tmp_path, run_dir)
    assert rc == 2 and "no config.json" in err


def test_unknown_dtype_is_usage_error(broken, run_dir, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", str(broken), "--dtype", "int3"])
    assert e.value.code == 2
    shutil.rmtree(broken)
