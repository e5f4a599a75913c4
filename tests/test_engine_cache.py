"""Weights from a real cache daemon process: same logits and greedy outputs as disk, the auto rule,
and clear failures."""

from __future__ import annotations

import json

import pytest
import torch

from cache_daemon.client import attach
from cache_daemon.fingerprint import make_config
from cache_daemon_helpers import running_daemon
from conftest import free_port
from engine_helpers import PROMPT_IDS, build_runner, engine_log, hf_logits, post, start_engine

PROMPTS = [[5, 17, 42, 99], [3, 250, 7, 11, 300, 64, 128], "Hello, world!", "one two three four"]


@pytest.fixture(scope="module")
def daemon(tiny_model):
    with running_daemon(tiny_model) as sock:
        yield sock


def test_cache_logits_match_transformers_and_are_not_copied(daemon, tiny_model):
    with attach(daemon, make_config(tiny_model, dtype="float32", tp_size=1, tp_rank=0)) as mapped:
        runner = build_runner(tiny_model, weights=mapped.tensors)
        params = dict(runner.model.named_parameters(remove_duplicate=False))
        for name, tensor in mapped.tensors.items():
            assert params[name].data_ptr() == tensor.data_ptr(), name
        ours = runner.all_logits(PROMPT_IDS)
        disk = build_runner(tiny_model).all_logits(PROMPT_IDS)
        del runner, params, tensor
    assert torch.equal(ours, disk)
    assert (ours - hf_logits(tiny_model, PROMPT_IDS)).abs().max().item() <= 1e-4


def greedy(port: int, prompt) -> list[int]:
    status, text = post(port, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0, "ignore_eos": True})
    assert status == 200, text
    return json.loads(text)["choices"][0]["token_ids"]


def test_greedy_outputs_identical_disk_vs_cache(daemon, tiny_model, procs):
    ports = {"disk": free_port(), "cache": free_port()}
    for source, port in ports.items():
        start_engine(procs, tiny_model, port, "--weights", source, "--socket", str(daemon),
                     "--served-model-name", "m", wait=False)
    from engine_helpers import wait_engine_ready

    for source, (proc, port) in zip(ports, zip(procs.started, ports.values())):
        assert wait_engine_ready(proc, port)["weights_source"] == source
        assert '"event": "weights_loaded"' in engine_log(proc) and f'"source": "{source}"' in engine_log(proc)
    for prompt in PROMPTS:
        assert greedy(ports["disk"], prompt) == greedy(ports["cache"], prompt)


def test_auto_uses_the_daemon_when_its_socket_exists(daemon, tiny_model, procs):
    port = free_port()
    proc = start_engine(procs, tiny_model, port, "--weights", "auto", "--socket", str(daemon))
    assert '"chosen": "cache"' in engine_log(proc)


def test_auto_falls_back_to_disk_loudly(tiny_model, procs, run_dir):
    port = free_port()
    proc = start_engine(procs, tiny_model, port, "--weights", "auto", "--socket", str(run_dir / "daemon.sock"))
    log = engine_log(proc)
    assert '"chosen": "disk"' in log and '"level": "warning"' in log


def test_cache_without_a_daemon_is_an_error_exit(tiny_model, procs, run_dir):
    proc = start_engine(procs, tiny_model, free_port(), "--weights", "cache",
                        "--socket", str(run_dir / "daemon.sock"), wait=False)
    assert proc.wait(30) == 1
    assert "no cache daemon" in engine_log(proc)


def test_a_different_build_is_an_error_not_a_reload(daemon, tiny_model, procs):
    proc = start_engine(procs, tiny_model, free_port(), "--weights", "auto", "--socket", str(daemon),
                        "--dtype", "bfloat16", wait=False)
    assert proc.wait(30) == 1
    log = engine_log(proc)
    assert "failover engine:" in log and "dtype" in log
