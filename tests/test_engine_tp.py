"""Tensor parallelism over gloo with two real processes: logits equal transformers' from disk and
from a tp=2 cache daemon; a ``--tp 2`` engine serves the same greedy tokens as tp=1 and leaves no
rank behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from cache_daemon_helpers import running_daemon
from conftest import free_port
from engine_helpers import (PROMPT_IDS, build_llm_engine, engine_log, hf_logits, make_seq, post, run_engine,
                            start_engine, token_file)

HELPER = str(Path(__file__).with_name("engine_helpers.py"))


@pytest.fixture(scope="module")
def daemon(tiny_model):
    with running_daemon(tiny_model, "--tp", "2") as sock:
        yield sock


def test_tp2_logits_match_transformers_from_disk_and_cache(daemon, tiny_model, procs, tmp_path):
    init, out = f"tcp://127.0.0.1:{free_port()}", tmp_path / "logits.pt"
    ranks = [procs.python(HELPER, "tp-logits", str(tiny_model), str(r), "2", init, str(out), str(daemon))
             for r in range(2)]
    assert [p.wait(120) for p in ranks] == [0, 0]
    got = torch.load(out)
    assert torch.equal(got["disk"], got["cache"])
    assert (got["disk"] - hf_logits(tiny_model, PROMPT_IDS)).abs().max().item() <= 1e-4


def test_tp2_engine_serves_tp1_greedy_tokens_and_stops_its_ranks(daemon, tiny_model, procs):
    port = free_port()
    path, auth = token_file(procs)
    proc = start_engine(procs, tiny_model, port, "--tp", "2", "--weights", "cache", "--socket", str(daemon),
                        "--served-model-name", "m", "--admin-token-file", str(path))
    prompts = [[5, 17, 42, 99], [3, 250, 7, 11, 300, 64, 128]]
    local = build_llm_engine(tiny_model)
    expected = run_engine(local, [make_seq(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)])
    for budget in (None, 256 << 10, 1 << 20):  # as started, then every rank's pool shrunk and grown
        if budget is not None:
            status, text = post(port, "/admin/kv", {"kv_memory": budget}, headers=auth)
            assert status == 200 and json.loads(text)["kv_bytes"] == budget, text
        for i, prompt in enumerate(prompts):
            status, text = post(port, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 12,
                                                          "temperature": 0, "ignore_eos": True})
            assert status == 200, text
            assert json.loads(text)["choices"][0]["token_ids"] == expected[str(i)][0]
    workers = [json.loads(line)["pid"] for line in engine_log(proc).splitlines()
               if '"tp_worker_started"' in line]
    assert len(workers) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_tp_worker_dies_with_rank0(daemon, tiny_model, procs):
    port = free_port()
    proc = start_engine(procs, tiny_model, port, "--tp", "2", "--weights", "cache", "--socket", str(daemon))
    workers = [json.loads(line)["pid"] for line in engine_log(proc).splitlines()
               if '"tp_worker_started"' in line]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead; its reaper is gone with rank 0
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False

