"""The decoder against transformers on the same random checkpoints (fp32, CPU), in process.

Tolerance: max |ours - transformers| <= 1e-4 on the logits (they are O(1); in practice the two agree
to the bit, since both run the same fp32 ops in the same order).
"""

from __future__ import annotations

import json

import pytest
import torch

from cache_daemon.checkpoint import load_shards
from engine.kv_cache import KVBudgetError
from engine.layers import dequant_fp8_block
from failover.tools.tiny_model import TinySpec, write_checkpoint
from engine_helpers import PROMPT_IDS, build_runner, hf_logits

ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    specs = {
        "llama": TinySpec(arch="llama"),
        "qwen2": TinySpec(arch="qwen2"),
        "qwen3": TinySpec(arch="qwen3", tie=True),
        "mistral": TinySpec(arch="mistral", head_dim=32),
    }
    return {name: write_checkpoint(tmp_path_factory.mktemp(name), spec) for name, spec in specs.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(checkpoints, arch):
    model = checkpoints[arch]
    ours = build_runner(model).all_logits(PROMPT_IDS)
    ref = hf_logits(model, PROMPT_IDS)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    model = write_checkpoint(tmp_path, TinySpec(arch="llama", head_dim=32, heads=2, kv_heads=1))
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_scaling"] = scaling
    cfg["rope_theta"] = 500000.0
    (model / "config.json").write_text(json.dumps(cfg))
    ids = list(range(3, 200))  # long enough for the low-frequency bands to matter
    ours = build_runner(model).all_logits(ids)
    assert (ours - hf_logits(model, ids)).abs().max().item() <= ATOL


def test_weights_are_assigned_not_copied(checkpoints):
    weights = load_shards(checkpoints["qwen3"], dtype=torch.float32)
    runner = build_runner(checkpoints["qwen3"], weights=weights)
    params = dict(runner.model.named_parameters(remove_duplicate=False))
    for name, tensor in weights.items():
        assert params[name].data_ptr() == tensor.data_ptr(), name
    # tied: lm_head is the embedding, same bytes
    assert params["lm_head.weight"].data_ptr() == params["model.embed_tokens.weight"].data_ptr()


def test_fp8_block_weights_used_as_mapped(tmp_path):
    model = write_checkpoint(tmp_path, TinySpec(arch="qwen2", hidden=160, intermediate=320, heads=5, kv_heads=1))
    fp8 = load_shards(model, dtype=torch.float32, transform="fp8-block")
    q = fp8["model.layers.0.mlp.down_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn
    before = q.clone()
    runner = build_runner(model, weights=fp8, transform="fp8-block")
    logits = runner.all_logits(PROMPT_IDS)
    assert torch.equal(q.view(torch.uint8), before.view(torch.uint8))  # never written
    # the same model with the dequantized weights as plain dense tensors gives the same logits
    dense = {}
    for name, t in fp8.items():
        if name.endswith("_scale_inv"):
            continue
        scale = fp8.get(name + "_scale_inv")
        dense[name] = t if scale is None else dequant_fp8_block(t, scale, torch.float32)
    assert torch.allclose(build_runner(model, weights=dense).all_logits(PROMPT_IDS), logits, atol=1e-5)
    # and close to the unquantized model (fp8 has 3 mantissa bits)
    ref = build_runner(model).all_logits(PROMPT_IDS)
    assert (ref - logits).abs().max().item() < 0.5


def test_kv_budget_too_small_is_a_clear_error(checkpoints):
    with pytest.raises(KVBudgetError, match="raise --kv-memory"):
        build_runner(checkpoints["llama"], kv_memory=1024)


def test_kv_blocks_follow_the_budget(checkpoints):
    runner = build_runner(checkpoints["llama"], kv_memory=3 * 256 * 1024 + 5, max_batch=16)
    # per block: 2 (k, v) * 2 layers * 2 kv heads * 16 positions * 16 dims * 4 bytes = 8 KiB
    assert runner.kv.num_blocks == 96 and runner.kv.nbytes == 3 * 256 * 1024
    assert len(runner.kv.chunks) == 4  # so that a shrink can release part of it
    # capped at max_batch full contexts (512 positions = 32 blocks each): more could never be used
    assert build_runner(checkpoints["llama"], kv_memory=1 << 30, max_batch=2).kv.num_blocks == 64
