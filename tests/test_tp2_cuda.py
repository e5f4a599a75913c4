"""Tensor parallelism on two GPUs (marked ``cuda``; skipped unless this process sees two or more).

One arena per rank, each on its own GPU and keyed by that GPU's UUID; the daemon holds no CUDA
context; each rank maps its own GPU's arena read-only; a tp=2 engine serves tp=1's greedy tokens.
Run on a two-GPU machine: ``python3 -m pytest -m cuda tests/test_tp2_cuda.py -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache_daemon_helpers import child, start_daemon, stop_daemon
from conftest import free_port
from engine_helpers import PROMPT_IDS, engine_log, post, start_engine

pytestmark = pytest.mark.cuda
HERE = Path(__file__).parent


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


two_gpus = pytest.mark.skipif(_gpu_count() < 2, reason="needs two GPUs")


def _digests(model, rank, tp=2, dtype="float32"):
    import hashlib

    import torch

    from cache_daemon.checkpoint import load_shards

    tensors = load_shards(model, dtype=dtype, tp_size=tp, tp_rank=rank)
    return {n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


def _attach_probe(sock: Path, model: Path, rank: int, visible: str) -> dict:
    """In a fresh process that sees the GPUs as ``visible`` (UUIDs, in that order), attach ``rank``."""
    code = (
        "import json, hashlib, torch; from cache_daemon.client import attach;"
        " from cache_daemon.fingerprint import make_config;"
        f" w = attach({str(sock)!r}, make_config({str(model)!r}, dtype='float32', tp_size=2,"
        f" tp_rank={rank}, device='cuda'));"
        " t = w.tensors['model.embed_tokens.weight'];"
        " (arena,) = w.manifest.arenas;"
        " print(json.dumps({'device': str(t.device), 'uuid': arena.device_uuid,"
        " 'sha': hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()}))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=visible), cwd=HERE.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


@two_gpus
def test_daemon_puts_each_rank_on_its_own_gpu_without_a_cuda_context(tiny_model, run_dir, procs):
    from cache_daemon.gpus import visible_uuids

    uuids = visible_uuids()
    proc = start_daemon(procs, tiny_model, run_dir, "--device", "cuda", "--tp", "2")
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "libcuda" not in maps and "libtorch" not in maps
    sock = run_dir / "daemon.sock"
    kid = child(procs, "hash", sock, tiny_model, tp=2, ranks=(0, 1), device="cuda")
    out, err = kid.communicate(timeout=120)
    assert kid.returncode == 0, err
    assert json.loads(out) == {str(r): _digests(tiny_model, r) for r in range(2)}
    # each rank's arena lives on GPU r, named by UUID; a process that sees the GPUs in the other
    # order still finds rank 1 on the same physical GPU (its ordinal 0 there)
    seen = [_attach_probe(sock, tiny_model, r, ",".join(uuids[:2])) for r in range(2)]
    assert [s["uuid"] for s in seen] == list(uuids[:2])
    assert [s["device"] for s in seen] == ["cuda:0", "cuda:1"]
    swapped = _attach_probe(sock, tiny_model, 1, f"{uuids[1]},{uuids[0]}")
    assert swapped["uuid"] == uuids[1] and swapped["device"] == "cuda:0" and swapped["sha"] == seen[1]["sha"]
    assert stop_daemon(proc)[0] == 0


@two_gpus
def test_a_write_through_rank1s_mapping_faults_only_the_writer(tiny_model, run_dir, procs):
    proc = start_daemon(procs, tiny_model, run_dir, "--device", "cuda", "--tp", "2")
    sock = run_dir / "daemon.sock"
    writer = child(procs, "write", sock, tiny_model, tp=2, ranks=(1,), device="cuda")
    out, err = writer.communicate(timeout=120)
    assert writer.returncode != 0 and "WRITE WENT THROUGH" not in out, (out, err[-2000:])
    reader = child(procs, "hash", sock, tiny_model, tp=2, ranks=(0, 1), device="cuda")
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    assert json.loads(out) == {str(r): _digests(tiny_model, r) for r in range(2)}  # unchanged
    assert stop_daemon(proc)[0] == 0


@two_gpus
def test_tp2_cuda_engine_from_the_daemon_serves_tp1_greedy_tokens(tiny_model, run_dir, procs):
    start_daemon(procs, tiny_model, run_dir, "--device", "cuda", "--tp", "2")
    sock = str(run_dir / "daemon.sock")
    ports = {"tp1": free_port(), "tp2": free_port()}
    engines = {
        "tp1": start_engine(procs, tiny_model, ports["tp1"], "--device", "cuda", "--weights", "disk",
                            "--served-model-name", "m"),
        "tp2": start_engine(procs, tiny_model, ports["tp2"], "--device", "cuda", "--tp", "2", "--weights",
                            "cache", "--socket", sock, "--served-model-name", "m"),
    }
    assert '"source": "cache"' in engine_log(engines["tp2"])
    outs = {}
    for name, port in ports.items():
        status, text = post(port, "/v1/completions", {"model": "m", "prompt": PROMPT_IDS, "max_tokens": 16,
                                                      "temperature": 0, "ignore_eos": True})
        assert status == 200, text
        outs[name] = json.loads(text)["choices"][0]["token_ids"]
    assert outs["tp2"] == outs["tp1"] and len(outs["tp1"]) == 16
