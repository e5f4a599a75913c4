"""Checkpoint reading, sharding, fingerprint, the fp8-block transform and the packing plan."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cache_daemon import transforms
from cache_daemon.checkpoint import load_shards, rank_specs
from cache_daemon.errors import (DtypeMismatchError, MissingShardError, MissingTensorError,
                                 ShapeMismatchError, TPSizeError, UnknownTensorError)
from cache_daemon.fingerprint import make_config
from cache_daemon.layout import open_checkpoint
from cache_daemon.manifest import ALIGN, plan
from failover.tools.tiny_model import TinySpec, write_checkpoint


def test_load_shards_tp1_equals_the_files(tiny_model):
    files = {}
    for f in sorted(tiny_model.glob("*.safetensors")):
        files |= load_file(str(f))
    got = load_shards(tiny_model, dtype="float32", tp_size=1, tp_rank=0)
    assert set(got) == set(files)
    assert all(torch.equal(got[n], files[n]) for n in files)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_tp_shards_cover_every_family(tmp_path, arch):
    model = write_checkpoint(tmp_path, TinySpec(arch=arch, heads=4, kv_heads=2))
    full = load_shards(model, dtype="float32", tp_size=1, tp_rank=0)
    parts = [load_shards(model, dtype="float32", tp_size=2, tp_rank=r) for r in range(2)]
    for name, whole in full.items():
        dim = 1 if (".o_proj." in name or ".down_proj." in name) else 0
        if whole.shape == parts[0][name].shape:
            assert torch.equal(parts[0][name], whole) and torch.equal(parts[1][name], whole)
        else:
            assert torch.equal(torch.cat([parts[0][name], parts[1][name]], dim=dim), whole), name


def test_tied_embeddings_are_an_alias_not_a_copy(tmp_path):
    model = write_checkpoint(tmp_path, TinySpec(tie=True))
    specs, aliases = rank_specs(open_checkpoint(model), dtype="float32", tp_size=1, tp_rank=0)
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in {s.name for s in specs}
    t = load_shards(model, dtype="float32", tp_size=1, tp_rank=0)
    assert t["lm_head.weight"].data_ptr() == t["model.embed_tokens.weight"].data_ptr()


def test_dtype_cast_is_applied(tiny_model):
    t = load_shards(tiny_model, dtype="bfloat16", tp_size=1, tp_rank=0)
    assert {v.dtype for v in t.values()} == {torch.bfloat16}


def test_fp8_block_round_trip_within_bound():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 1, 200)  # columns of very different range
    q, scale = transforms.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (3, 2)  # ceil(300/128), ceil(200/128)
    err = (transforms.dequantize_fp8_block(q, scale) - w).abs()
    assert bool((err <= transforms.error_bound(w, scale)).all())
    assert float(err.max()) > 0  # it is lossy, and the bound is what holds it


def test_fp8_block_in_load_shards_has_manifest_attrs(tiny_model):
    ckpt = open_checkpoint(tiny_model)
    specs, _ = rank_specs(ckpt, dtype="float32", tp_size=2, tp_rank=1, transform="fp8-block")
    by_name = {s.name: s for s in specs}
    q = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == "float8_e4m3fn" and q.shape == (32, 64)
    assert q.attrs == {"transform": "fp8-block", "block": [128, 128],
                       "scale": "model.layers.0.self_attn.q_proj.weight_scale_inv"}
    assert by_name["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    assert by_name["model.norm.weight"].dtype == "float32"
    assert by_name["lm_head.weight"].dtype == "float32"
    t = load_shards(tiny_model, dtype="float32", tp_size=2, tp_rank=1, transform="fp8-block")
    assert set(t) == set(by_name)
    assert all(tuple(t[n].shape) == s.shape and str(t[n].dtype) == "torch." + s.dtype for n, s in by_name.items())


def test_plan_aligns_every_tensor(tiny_model):
    specs, _ = rank_specs(open_checkpoint(tiny_model), dtype="float32", tp_size=1, tp_rank=0)
    entries, size = plan(specs)
    assert [e.name for e in entries] == [s.name for s in specs]  # the loader fills them in this order
    assert all(e.offset % ALIGN == 0 for e in entries)
    placed = sorted(entries, key=lambda e: e.offset)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(placed, placed[1:]))
    assert size >= placed[-1].offset + placed[-1].nbytes


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_plan_puts_each_layers_fusable_projections_back_to_back(tiny_model, tp_rank):
    specs, _ = rank_specs(open_checkpoint(tiny_model), dtype="bfloat16", tp_size=2, tp_rank=tp_rank)
    at = {e.name: e for e in plan(specs)[0]}
    layers = {n.split(".")[2] for n in at if n.startswith("model.layers.")}
    assert layers
    for i in layers:
        p = f"model.layers.{i}."
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            members = [at[p + m + ".weight"] for m in group]
            for a, b in zip(members, members[1:]):
                assert b.offset == a.offset + a.nbytes, (a.name, b.name)


def test_fingerprint_diff_names_each_changed_field(tiny_model):
    a = make_config(tiny_model, dtype="float32", tp_size=2, tp_rank=0)
    assert a.diff(a) == []
    b = make_config(tiny_model, dtype="bfloat16", tp_size=2, tp_rank=1, transform="fp8-block")
    assert [line.split(":")[0] for line in a.diff(b)] == ["dtype", "tp_rank", "transform"]
    assert make_config(tiny_model, dtype=torch.float32, tp_size=2, tp_rank=0) == a


def test_fingerprint_follows_the_files(tmp_path):
    model = write_checkpoint(tmp_path, TinySpec())
    before = make_config(model, dtype="float32", tp_size=1, tp_rank=0)
    (model / "config.json").write_text((model / "config.json").read_text() + "\n")
    after = make_config(model, dtype="float32", tp_size=1, tp_rank=0)
    assert [line.split(":")[0] for line in before.diff(after)] == ["model_identity"]


# ---- bad checkpoints: each a specific error naming what is wrong --------------------------------

@pytest.fixture
def model(tmp_path):
    return write_checkpoint(tmp_path / "m", TinySpec(shards=2))


def _config(model, **changes):
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(changes)
    (model / "config.json").write_text(json.dumps(cfg))


def _load(model, tp=1):
    return load_shards(model, dtype="float32", tp_size=tp, tp_rank=0)


def test_missing_shard_file(model):
    (model / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(MissingShardError, match="model-00001-of-00002.safetensors"):
        _load(model)


def test_shard_without_the_tensors_the_index_promises(model):
    f = model / "model-00002-of-00002.safetensors"
    tensors = load_file(str(f))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(f))
    with pytest.raises(MissingShardError, match=dropped.replace(".", r"\.")):
        _load(model)


def test_missing_tensor_without_index(tmp_path):
    model = write_checkpoint(tmp_path, TinySpec())
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(MissingTensorError, match="model.layers.1.mlp.up_proj.weight"):
        _load(model)


def test_dtype_contradiction(model):
    _config(model, torch_dtype="float16")
    with pytest.raises(DtypeMismatchError, match="torch_dtype is float16"):
        _load(model)


def test_shape_contradiction(model):
    _config(model, vocab_size=1000)
    with pytest.raises(ShapeMismatchError, match=r"vocab_size.*\[1000, 64\]"):
        _load(model)


@pytest.mark.parametrize("tp,field", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_tp_must_divide_heads(model, tp, field):
    with pytest.raises(TPSizeError, match=field):
        _load(model, tp)


def test_tp_must_divide_intermediate(tmp_path):
    model = write_checkpoint(tmp_path, TinySpec(heads=4, kv_heads=4, intermediate=102))
    with pytest.raises(TPSizeError, match=r"intermediate_size \(102\)"):
        _load(model, 4)


def test_unknown_tensor_is_not_replicated_silently(tmp_path):
    model = write_checkpoint(tmp_path, TinySpec())
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.0.w1.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(UnknownTensorError, match="experts.0.w1"):
        _load(model)
