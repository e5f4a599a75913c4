"""Fused projections (``engine.fusion``): q/k/v and gate/up as one GEMM each over views of the
weights laid out by the daemon's own plan, with the same logits as one GEMM per projection."""

from __future__ import annotations

import pytest
import torch

from cache_daemon.checkpoint import load_shards, rank_specs
from cache_daemon.layout import open_checkpoint
from cache_daemon.manifest import Manifest, plan, views
from engine.fusion import pack_onto, spanning_view
from failover.tools.tiny_model import TinySpec, write_checkpoint
from engine_helpers import PROMPT_IDS, build_runner, hf_logits

ARCHS = {
    "llama": TinySpec(arch="llama"),
    "qwen2": TinySpec(arch="qwen2"),  # q/k/v biases
    "qwen3": TinySpec(arch="qwen3", tie=True),  # q/k norms
    "mistral": TinySpec(arch="mistral", head_dim=32),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: write_checkpoint(tmp_path_factory.mktemp(name), spec) for name, spec in ARCHS.items()}


def arena_weights(model, dtype="float32") -> dict[str, torch.Tensor]:
    """The rank's tensors as the daemon serves them: views into one flat arena at the daemon's
    planned offsets (``manifest.plan`` + ``manifest.views``), filled from the checkpoint."""
    specs, aliases = rank_specs(open_checkpoint(model), dtype=dtype, tp_size=1, tp_rank=0)
    entries, size = plan(specs)
    arena = torch.zeros(size, dtype=torch.uint8)
    mapped = views(Manifest(tuple(entries), aliases, ()), [arena])
    for name, tensor in load_shards(model, dtype=getattr(torch, dtype)).items():
        mapped[name].copy_(tensor)
    return mapped


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_mapped_weights_fuse_without_a_copy_and_keep_the_logits(checkpoints, arch):
    model = checkpoints[arch]
    weights = arena_weights(model)
    fused = build_runner(model, weights=weights)
    layers = fused.model.model.layers
    assert fused.model.fuse() == (len(layers), len(layers))
    for i, layer in enumerate(layers):
        qkv, bias = layer.self_attn.qkv
        q = weights[f"model.layers.{i}.self_attn.q_proj.weight"]
        assert qkv.data_ptr() == q.data_ptr()  # a view of the mapped bytes, not a copy
        assert torch.equal(qkv, torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                           layer.self_attn.v_proj.weight]))
        assert (bias is not None) == (arch == "qwen2")
        assert layer.mlp.gate_up.data_ptr() == weights[f"model.layers.{i}.mlp.gate_proj.weight"].data_ptr()
    separate = build_runner(model)  # load_shards: tensors of their own, not adjacent
    assert separate.model.fuse() == (0, 0) and separate.model.model.layers[0].self_attn.qkv is None
    ours = fused.all_logits(PROMPT_IDS)
    assert (ours - separate.all_logits(PROMPT_IDS)).abs().max().item() <= 1e-5
    assert (ours - hf_logits(model, PROMPT_IDS)).abs().max().item() <= 1e-4


def test_greedy_tokens_equal_fused_and_separate(checkpoints):
    model = checkpoints["llama"]
    outs = []
    for weights in (arena_weights(model), None):
        runner = build_runner(model, weights=weights)
        ids = list(PROMPT_IDS)
        for _ in range(8):
            ids.append(int(runner.all_logits(ids)[-1].argmax()))
        outs.append(ids)
    assert outs[0] == outs[1]


def test_spanning_view_needs_back_to_back_parts():
    flat = torch.arange(40, dtype=torch.float32)
    a, b, c = flat[0:8].view(2, 4), flat[8:16].view(2, 4), flat[24:32].view(2, 4)
    whole = spanning_view([a, b])
    assert whole is not None and whole.shape == (4, 4) and whole.data_ptr() == a.data_ptr()
    assert torch.equal(whole, flat[:16].view(4, 4))
    assert spanning_view([a, c]) is None  # a gap
    assert spanning_view([b, a]) is None  # out of order
    assert spanning_view([a, torch.arange(8.0).view(2, 4)]) is None  # another storage
    assert spanning_view([a, flat[8:14].view(2, 3)]) is None  # another row width
    assert spanning_view([a, flat[8:16].double().view(2, 4)]) is None  # another dtype


def test_pack_onto_gives_an_owned_copy_the_mapped_layout(checkpoints):
    model = checkpoints["qwen2"]
    host = load_shards(model, dtype=torch.float32)
    packed = pack_onto(host, torch.device("cpu"))
    assert list(packed) == list(host)
    assert all(torch.equal(packed[n], host[n]) for n in host)
    runner = build_runner(model, weights=packed)
    layers = runner.model.model.layers
    assert runner.model.fuse() == (len(layers), len(layers))
    assert layers[0].self_attn.qkv[1] is not None  # the biases lie back to back too: a view
    assert layers[0].self_attn.qkv[1].data_ptr() == packed["model.layers.0.self_attn.q_proj.bias"].data_ptr()


@pytest.mark.cuda
def test_cuda_disk_weights_fuse_and_keep_the_logits(checkpoints):
    model = checkpoints["qwen2"]
    host = load_shards(model, dtype=torch.float32)
    fused = build_runner(model, weights=pack_onto(host, torch.device("cuda")), device="cuda")  # as --weights disk
    layers = fused.model.model.layers
    assert fused.model.fuse() == (len(layers), len(layers))
    apart = {n: t.cuda() for n, t in host.items()}  # one allocation each
    separate = build_runner(model, weights=apart, device="cuda")
    assert separate.model.model.layers[0].mlp.gate_up is None
    ours = fused.all_logits(PROMPT_IDS).cpu()
    assert (ours - separate.all_logits(PROMPT_IDS).cpu()).abs().max().item() <= 1e-4
    assert (ours - hf_logits(model, PROMPT_IDS)).abs().max().item() <= 1e-4
