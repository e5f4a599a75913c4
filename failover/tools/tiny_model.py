"""``failover tiny-model DIR``: a small random-weight checkpoint in Hugging Face layout.

The checkpoint is what every test, benchmark and the demo serve: ``config.json``, one or more
``*.safetensors`` files (with ``model.safetensors.index.json`` when sharded), ``tokenizer.json``
(a byte-level BPE trained here on a few lines of text) and ``tokenizer_config.json`` with a ChatML
chat template. Transformers loads it as is, which is how the engine's outputs are checked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A hot standby takes over when the primary engine fails.",
    "Weights stay resident in device memory and are mapped read-only by every engine.",
    "Hello, world! How are you today? I am fine, thank you.",
    "one two three four five six seven eight nine ten",
    "def main():\n    return 0\n",
    "Failover in well under a second; no request is lost.",
]


@dataclass(frozen=True, slots=True)
class TinySpec:
    arch: str = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 512
    max_positions: int = 512
    head_dim: int | None = None
    tie: bool = False
    dtype: str = "float32"
    shards: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, not {self.arch!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.vocab < 300:
            raise ValueError("vocab must be at least 300 (256 bytes plus merges and special tokens)")
        if self.shards < 1:
            raise ValueError("shards must be at least 1")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


def hf_config(spec: TinySpec) -> dict:
    cfg = {
        "architectures": [ARCHS[spec.arch]],
        "model_type": spec.arch,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.resolved_head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie,
        "torch_dtype": spec.dtype,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "attention_bias": False,
    }
    if spec.arch == "mistral":
        cfg["sliding_window"] = None
    if spec.arch == "qwen2":
        cfg.pop("attention_bias")  # Qwen2 always has q/k/v bias
        cfg["use_sliding_window"] = False
    if spec.arch == "qwen3":
        cfg["use_sliding_window"] = False
    return cfg


def tensor_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, in Hugging Face names, with its shape."""
    d, hd = spec.hidden, spec.resolved_head_dim
    q, kv = spec.heads * hd, spec.kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, d)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (spec.intermediate, d),
            p + "mlp.up_proj.weight": (spec.intermediate, d),
            p + "mlp.down_proj.weight": (d, spec.intermediate),
        }
        if spec.arch == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if spec.arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    shapes["model.norm.weight"] = (d,)
    if not spec.tie:
        shapes["lm_head.weight"] = (spec.vocab, d)
    return shapes


def random_tensors(spec: TinySpec):
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    for name, shape in tensor_shapes(spec).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        else:  # keep activations O(1) through the layers so logits differ token to token
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        yield name, t.to(dtype)


def write_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE,
    }, indent=2))


def write_checkpoint(out: Path, spec: TinySpec) -> Path:
    """Write the checkpoint to ``out`` (created if missing) and return it."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(spec)
    tensors = dict(random_tensors(spec))
    names = list(tensors)
    per_shard = math.ceil(len(names) / spec.shards)
    groups = [names[i:i + per_shard] for i in range(0, len(names), per_shard)]
    if len(groups) == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file({n: tensors[n] for n in group}, str(out / fname), metadata={"format": "pt"})
            weight_map |= {n: fname for n in group}
            total += sum(tensors[n].numel() * tensors[n].element_size() for n in group)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "bos_token_id": 0}))
    write_tokenizer(out, min(spec.vocab, 512))
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="failover tiny-model", description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="output directory (created; existing files are overwritten)")
    p.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--tie", action="store_true", help="tie lm_head to the input embeddings")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    try:
        spec = TinySpec(arch=a.arch, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                        intermediate=a.intermediate, vocab=a.vocab, max_positions=a.max_positions,
                        head_dim=a.head_dim, tie=a.tie, dtype=a.dtype, shards=a.shards, seed=a.seed)
    except ValueError as e:
        print(f"failover tiny-model: {e}", file=sys.stderr)
        return 2
    out = write_checkpoint(a.dir, spec)
    n = len(tensor_shapes(spec))
    print(f"wrote {spec.arch} checkpoint ({n} tensors, {spec.shards} file(s)) to {out.resolve()}")
    return 0
