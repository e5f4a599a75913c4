"""On an NVIDIA GPU: the engine serves from weights the daemon holds in CUDA VMM memory, mapped
read-only, with the same greedy tokens as a disk load and logits close to transformers'.

Run on a GPU machine: ``python3 -m pytest tests/test_engine_cuda.py -q`` (skipped elsewhere).
"""

from __future__ import annotations

import json

import pytest

from cache_daemon_helpers import running_daemon, start_daemon
from conftest import free_port
from engine_helpers import PROMPT_IDS, build_runner, engine_log, hf_logits, post, start_engine

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def cuda_daemon(tiny_model):
    with running_daemon(tiny_model, "--device", "cuda") as sock:
        yield sock


def test_cuda_engine_serves_from_cache_mapped_weights(cuda_daemon, tiny_model, procs):
    ports = {"cache": free_port(), "disk": free_port()}
    engines = {src: start_engine(procs, tiny_model, port, "--device", "cuda", "--weights", src,
                                 "--socket", str(cuda_daemon), "--served-model-name", "m")
               for src, port in ports.items()}
    assert '"source": "cache"' in engine_log(engines["cache"])
    outs = {}
    for src, port in ports.items():
        status, text = post(port, "/v1/completions", {"model": "m", "prompt": PROMPT_IDS, "max_tokens": 16,
                                                      "temperature": 0, "ignore_eos": True})
        assert status == 200, text
        outs[src] = json.loads(text)["choices"][0]["token_ids"]
    assert outs["cache"] == outs["disk"] and len(outs["cache"]) == 16


def test_cuda_logits_from_mapped_weights_match_transformers(cuda_daemon, tiny_model):
    from cache_daemon.client import attach
    from cache_daemon.fingerprint import make_config

    config = make_config(tiny_model, dtype="float32", tp_size=1, tp_rank=0, device="cuda")
    with attach(cuda_daemon, config) as mapped:
        assert all(t.is_cuda for t in mapped.tensors.values())
        runner = build_runner(tiny_model, weights=mapped.tensors, device="cuda")
        ours = runner.all_logits(PROMPT_IDS).cpu()
        del runner
    assert (ours - hf_logits(tiny_model, PROMPT_IDS)).abs().max().item() <= 2e-3


def test_cuda_fp8_block_from_the_daemon(tmp_path, run_dir, procs):
    # linear layers spanning several 128x128 blocks, served with the fp8-block transform
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    model = write_checkpoint(tmp_path / "model", TinySpec(hidden=256, intermediate=512, heads=4))
    start_daemon(procs, model, run_dir, "--device", "cuda", "--transform", "fp8-block")
    port = free_port()
    start_engine(procs, model, port, "--device", "cuda", "--weights", "cache", "--transform", "fp8-block",
                 "--socket", str(run_dir / "daemon.sock"), "--served-model-name", "m")
    status, text = post(port, "/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 8})
    assert status == 200, text
    assert len(json.loads(text)["choices"][0]["token_ids"]) >= 1
