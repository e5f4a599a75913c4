"""The cache daemon end to end on CPU: a real daemon process, its loader child, real sockets, and
attach() from separate processes."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from cache_daemon.checkpoint import load_shards
from cache_daemon.client import attach, query, status
from cache_daemon.errors import DaemonUnavailable, FingerprintMismatch, NotResident
from cache_daemon.fingerprint import make_config
from conftest import Procs
from cache_daemon_helpers import arena_fds, arena_mappings, child, gone, start_daemon, stop_daemon

TP = 2


def digests(tensors) -> dict[str, str]:
    return {n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


def disk_digests(model, rank: int, tp: int = TP, transform: str = "none") -> dict[str, str]:
    return digests(load_shards(model, dtype="float32", tp_size=tp, tp_rank=rank, transform=transform))


@pytest.fixture(scope="module")
def daemon(tiny_model):
    """One tp=2 daemon shared by the tests of this module; stopped (and checked clean) at the end."""
    run_dir = Path(tempfile.mkdtemp(prefix="fo-", dir="/tmp"))
    procs = Procs()
    proc = start_daemon(procs, tiny_model, run_dir, "--tp", str(TP), "--client-timeout", "1")
    yield {"proc": proc, "sock": run_dir / "daemon.sock", "run_dir": run_dir, "model": tiny_model}
    rc, err = stop_daemon(proc)
    procs.stop_all()
    try:
        assert rc == 0, err
        assert list(run_dir.iterdir()) == [], "socket or ready file left behind"
        assert gone(proc.pid)
        assert arena_fds() == [] and arena_mappings() == [], "this process still holds an arena"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def config(model, rank: int = 0, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("tp_size", TP)
    return make_config(model, tp_rank=rank, **kw)


def test_two_processes_attach_and_match_disk_bitwise(daemon, procs):
    kids = [child(procs, "hash", daemon["sock"], daemon["model"], tp=TP, ranks=(0, 1)) for _ in range(2)]
    want = {str(r): disk_digests(daemon["model"], r) for r in range(TP)}
    for kid in kids:
        out, err = kid.communicate(timeout=60)
        assert kid.returncode == 0, err
        assert json.loads(out) == want


def test_tp2_shards_reassemble_to_full_tensors(daemon):
    full = load_shards(daemon["model"], dtype="float32", tp_size=1, tp_rank=0)
    parts = [attach(daemon["sock"], config(daemon["model"], r)) for r in range(TP)]
    try:
        for name, whole in full.items():
            a, b = parts[0].tensors[name], parts[1].tensors[name]
            if ".o_proj." in name or ".down_proj." in name:
                joined = torch.cat([a, b], dim=1)
            elif any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                joined = torch.cat([a, b], dim=0)
            else:
                assert torch.equal(a, b)
                joined = a
            assert torch.equal(joined, whole), name
        del a, b, joined
    finally:
        for p in parts:
            p.close()


def test_write_through_mapping_kills_only_the_writer(daemon, procs):
    kid = child(procs, "write", daemon["sock"], daemon["model"], tp=TP, ranks=(0,))
    out, err = kid.communicate(timeout=60)
    assert kid.returncode == -signal.SIGSEGV, (out, err)
    assert "WRITE WENT THROUGH" not in out
    with attach(daemon["sock"], config(daemon["model"], 0)) as mapped:
        assert digests(mapped.tensors) == disk_digests(daemon["model"], 0)  # the bytes did not change
    assert daemon["proc"].poll() is None


def test_arena_is_sealed_against_writable_maps(daemon):
    import mmap
    import os

    from cache_daemon.client import Connection
    from cache_daemon.protocol import MAX_FDS, Fetch, FetchReply

    conn = Connection(daemon["sock"])
    try:
        reply, fds = conn.request(Fetch(config(daemon["model"])), FetchReply, max_fds=MAX_FDS)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fds[0], reply.manifest.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        conn.close()


def test_status_counts_models_and_attached_clients(daemon):
    with attach(daemon["sock"], config(daemon["model"], 1)) as mapped:
        st = status(daemon["sock"])
        assert not st.loading and st.attached >= 1 and st.clients >= 2  # the status connection counts too
        assert sorted(m.tp_rank for m in st.models) == [0, 1]
        by_rank = {m.tp_rank: m for m in st.models}
        assert by_rank[1].nbytes == mapped.manifest.nbytes
        assert by_rank[1].attached >= 1
    assert query(daemon["sock"], config(daemon["model"], 0)).nbytes > 0


def test_fingerprint_mismatch_lists_the_changed_field(daemon):
    wrong = config(daemon["model"], 0, dtype="bfloat16")
    with pytest.raises(FingerprintMismatch) as e:
        attach(daemon["sock"], wrong)
    assert [line.split(":")[0] for line in e.value.diff] == ["dtype"]
    assert "'bfloat16' != 'float32'" in e.value.diff[0]
    with pytest.raises(FingerprintMismatch) as e:
        attach(daemon["sock"], config(daemon["model"], 0, tp_size=1))
    assert [line.split(":")[0] for line in e.value.diff] == ["tp_size"]


def test_other_model_is_not_resident(daemon, tmp_path):
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    other = write_checkpoint(tmp_path / "other", TinySpec(layers=1))
    with pytest.raises(NotResident):
        attach(daemon["sock"], make_config(other, dtype="float32", tp_size=1, tp_rank=0))


def test_no_socket_is_daemon_unavailable(run_dir, tiny_model):
    with pytest.raises(DaemonUnavailable):
        attach(run_dir / "daemon.sock", make_config(tiny_model, dtype="float32", tp_size=1, tp_rank=0))
    (run_dir / "daemon.sock").touch()  # a plain file where the socket should be: nobody listens
    with pytest.raises(DaemonUnavailable):
        attach(run_dir / "daemon.sock", make_config(tiny_model, dtype="float32", tp_size=1, tp_rank=0))
