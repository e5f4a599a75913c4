"""CUDA arenas and the daemon on a GPU (marked ``cuda``; skipped where there is none)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from failover.tools.tiny_model import TinySpec, write_checkpoint
from cache_daemon_helpers import child, start_daemon, stop_daemon

pytestmark = pytest.mark.cuda
HERE = Path(__file__).parent
CUDA_CHILD = str(HERE / "cache_cuda_child.py")


def _digests(model, rank=0, tp=1, dtype="bfloat16"):
    import hashlib

    import torch

    from cache_daemon.checkpoint import load_shards

    tensors = load_shards(model, dtype=dtype, tp_size=tp, tp_rank=rank)
    return {n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    # ~12 MiB in bfloat16: with 2 MiB chunks the arena spans several physical chunks
    spec = TinySpec(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=1024, vocab=4096,
                    dtype="bfloat16", shards=2)
    return write_checkpoint(tmp_path_factory.mktemp("gpu-model"), spec)


def test_arena_export_import_survives_exporter_and_is_read_only(run_dir, procs):
    size, chunk = 64 << 20, 32 << 20
    path = run_dir / "x.sock"
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(str(path))
        srv.listen(1)
        exporter = procs.python(CUDA_CHILD, "export", str(path), str(size), str(chunk),
                                stdout=subprocess.PIPE, text=True)
        conn, _ = srv.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 4096, 8)
    meta = json.loads(msg)
    assert exporter.wait(60) == 0  # the exporter is gone (exited without unmapping or releasing)
    exporter.stdout.close()
    try:
        assert len(fds) == len(meta["chunks"]) == 2  # two physical chunks, one VA range
        # this test process holds the fds with no CUDA context, like the daemon
        args = [",".join(map(str, fds)), ",".join(map(str, meta["chunks"])), repr(meta["sum"])]
        for mode in ("read", "write"):
            p = subprocess.run([sys.executable, CUDA_CHILD, "import", *args, mode], pass_fds=fds,
                               capture_output=True, text=True, timeout=120, cwd=HERE.parent)
            first = json.loads(p.stdout.splitlines()[0])
            assert first["same"], (first, meta)
            if mode == "read":
                assert p.returncode == 0, p.stderr
            else:
                assert p.returncode != 0 and "WRITE WENT THROUGH" not in p.stdout
                assert "illegal" in p.stderr.lower() or "CUDA" in p.stderr, p.stderr[-2000:]
    finally:
        for fd in fds:
            os.close(fd)


def test_attach_on_cuda_equals_disk_and_daemon_has_no_cuda_context(gpu_model, run_dir, procs):
    proc = start_daemon(procs, gpu_model, run_dir, "--device", "cuda", "--tp", "2", "--chunk-mib", "2")
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "libcuda" not in maps and "libtorch" not in maps, "the daemon process must stay CUDA- and torch-free"
    kid = child(procs, "hash", run_dir / "daemon.sock", gpu_model, tp=2, ranks=(0, 1), dtype="bfloat16",
                device="cuda")
    out, err = kid.communicate(timeout=120)
    assert kid.returncode == 0, err
    assert json.loads(out) == {str(r): _digests(gpu_model, r, tp=2) for r in range(2)}
    assert stop_daemon(proc)[0] == 0
    assert list(run_dir.iterdir()) == []


def test_in_process_attach_gives_cuda_views(gpu_model, run_dir, procs):
    import torch

    from cache_daemon.client import attach
    from cache_daemon.fingerprint import make_config

    proc = start_daemon(procs, gpu_model, run_dir, "--device", "cuda")
    config = make_config(gpu_model, dtype="bfloat16", tp_size=1, tp_rank=0, device="cuda")
    with attach(run_dir / "daemon.sock", config) as w:
        t = w.tensors["model.layers.0.self_attn.q_proj.weight"]
        assert t.is_cuda and t.dtype == torch.bfloat16 and t.shape == (256, 256)
        y = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16) @ t.T  # reads and matmuls work
        torch.cuda.synchronize()
        assert y.shape == (4, 256)
        base = w.tensors["model.embed_tokens.weight"].data_ptr()
        assert all(abs(v.data_ptr() - base) < w.manifest.nbytes for v in w.tensors.values())  # one range
        # the arena is keyed by the GPU's UUID, as nvidia-smi names it
        from cache_daemon.gpus import visible_uuids

        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        (arena,) = w.manifest.arenas
        assert arena.device_uuid == visible_uuids()[t.device.index] and f"UUID: {arena.device_uuid})" in listed
        del t, y
    assert stop_daemon(proc)[0] == 0


def test_an_engine_that_sees_its_gpu_by_uuid_maps_the_arena(gpu_model, run_dir, procs):
    """CUDA_VISIBLE_DEVICES=<uuid>, as a pod given one GPU: the arena is found by UUID, not ordinal."""
    from cache_daemon.gpus import visible_uuids

    proc = start_daemon(procs, gpu_model, run_dir, "--device", "cuda")
    uuid = visible_uuids()[-1]
    code = ("import sys; from cache_daemon.client import attach; from cache_daemon.fingerprint import make_config;"
            f"w = attach({str(run_dir / 'daemon.sock')!r}, make_config({str(gpu_model)!r}, dtype='bfloat16',"
            " tp_size=1, tp_rank=0, device='cuda')); t = w.tensors['model.embed_tokens.weight'];"
            " print(t.device, float(t.float().abs().sum()) > 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=uuid), cwd=HERE.parent)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["cuda:0", "True"]
    assert stop_daemon(proc)[0] == 0


def test_write_faults_only_the_writer_and_mapping_survives_daemon_kill(gpu_model, run_dir, procs):
    proc = start_daemon(procs, gpu_model, run_dir, "--device", "cuda")
    sock = run_dir / "daemon.sock"
    writer = child(procs, "write", sock, gpu_model, dtype="bfloat16", device="cuda")
    out, err = writer.communicate(timeout=120)
    assert writer.returncode != 0 and "WRITE WENT THROUGH" not in out, (out, err[-2000:])
    want = {"0": _digests(gpu_model)}
    holder = child(procs, "hold", sock, gpu_model, dtype="bfloat16", device="cuda")
    assert json.loads(holder.stdout.readline()) == want  # data unchanged by the writer
    assert stop_daemon(proc, signal.SIGKILL)[0] == -signal.SIGKILL
    holder.stdin.write("again\n")
    holder.stdin.flush()
    assert json.loads(holder.stdout.readline()) == want  # the mapping outlived the daemon
    _, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
