"""The zygote prepares a model's CPU-side start (tokenizer and chat template, meta-device model) after
its first fork, with no thread and no CUDA; later forks inherit it and serve the same tokens; a
changed checkpoint is loaded afresh; a failing prepare costs the zygote nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from engine_helpers import PROMPT_IDS, build_runner

TESTS = Path(__file__).resolve().parent


def _engine_built(log: Path) -> list[dict]:
    events = []
    for line in log.read_text(errors="replace").splitlines():
        if '"engine_built"' in line or '"kv_cache_allocated"' in line:
            events.append(json.loads(line[line.index("{"):]))
    return events


def test_a_prepared_model_gives_the_logits_of_a_fresh_one_and_a_changed_checkpoint_is_reloaded(tiny_model, tmp_path):
    from engine import prepared
    from engine.cli import prepare

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    fresh = build_runner(model).all_logits(PROMPT_IDS)
    assert prepare(["--model", str(model), "--port", "9"]) is True
    assert prepare(["--model", str(model), "--port", "9"]) is False  # already there: a few stats
    assert prepare(["--model", str(model / "missing"), "--port", "9"]) is False  # the engine reports it
    assert prepare(["--no-such-option"]) is False
    runner = build_runner(model)
    assert torch.equal(runner.all_logits(PROMPT_IDS), fresh)
    # the meta-device model is handed out once; the tokenizer is shared
    again = build_runner(model)
    assert again.model is not runner.model and torch.equal(again.all_logits(PROMPT_IDS), fresh)
    tok, had = prepared.tokenizer(model)
    assert had and prepared.tokenizer(model)[0] is tok

    # a checkpoint rewritten in place after prepare() is never served from the old state
    cfg = model / "tokenizer_config.json"
    text = json.loads(cfg.read_text())
    text["eos_token"] = "<|endoftext|>"
    cfg.write_text(json.dumps(text))
    tok2, had2 = prepared.tokenizer(model)
    assert not had2 and tok2 is not tok and tok2.eos_token == "<|endoftext|>"
    assert prepared.skeleton(model, runner.model_cfg, 1, False)[1] is False


def test_forks_inherit_what_the_zygote_prepared_and_a_failed_prepare_is_harmless(tiny_model, tmp_path):
    log = tmp_path / "zygote.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    done = subprocess.run([sys.executable, str(TESTS / "zygote_prepare_helpers.py"), str(tiny_model), str(log)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:] + log.read_text(errors="replace")[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # fork 1 found nothing prepared; 2 inherited fork 1's prepare, 3 fork 2's too; "boom" failed in
    # the zygote after fork 3, so fork 4 inherited no more, and the zygote never restarted
    assert out["rcs"] == [10, 11, 12, 12]
    assert out["zygote_kept"] is True
    assert "zygote_prepare_failed" in log.read_text(errors="replace")
    # two real engines: the first loads the model itself, the second inherits the zygote's tokenizer
    # and module tree, and both serve the same greedy text
    (text1, pid1), (text2, pid2) = out["texts"]
    assert text1 == text2 and pid1 != pid2 and text1
    assert out["engine_rcs"] == [0, 0]
    events = _engine_built(log)
    tokens = [e["prepared_tokenizer"] for e in events if e["event"] == "engine_built"]
    models = [e["prepared_model"] for e in events if e["event"] == "kv_cache_allocated"]
    assert tokens == [False, True] and models == [False, True]


PREPARE_CHECK = """
import os, sys, threading, torch
import engine.cli, engine.serve
tasks = len(os.listdir("/proc/self/task"))
assert engine.cli.prepare(["--model", sys.argv[1], "--port", "9", "--device", "cuda"]) is True
assert len(os.listdir("/proc/self/task")) == tasks, "prepare started a native thread"
assert threading.active_count() == 1, "prepare started a Python thread"
assert not torch.cuda.is_initialized(), "prepare must not create a CUDA context"
print("ok")
"""


def test_prepare_starts_no_thread_and_no_cuda(tiny_model):
    # what the zygote runs between forks must leave it fit to fork: one thread of its own, no CUDA
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    done = subprocess.run([sys.executable, "-c", PREPARE_CHECK, str(tiny_model)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"
