"""A Hugging Face checkpoint directory read from its headers alone (no torch): files, tensors,
validation against config.json, and the tensor-parallel sharding rule of every tensor.

The daemon validates here before it spawns a loader, so a bad checkpoint is refused at once with a
message naming the file, tensor or config field; the loader and ``load_shards`` rely on the same
rules, so there is one sharding implementation.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import (CheckpointError, DtypeMismatchError, MissingShardError, MissingTensorError,
                     ShapeMismatchError, TPSizeError, UnknownTensorError)

INDEX = "model.safetensors.index.json"
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
             "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
FLOATS = {"float64", "float32", "float16", "bfloat16"}
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # what an engine computes in (--dtype)
MAX_HEADER = 100 << 20
COLUMN, ROW, REPLICATED = "column", "row", "replicated"
_RULES = [
    (re.compile(r"\.self_attn\.(q|k|v)_proj\.(weight|bias)$"), COLUMN),
    (re.compile(r"\.mlp\.(gate|up)_proj\.weight$"), COLUMN),
    (re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$"), ROW),
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), REPLICATED),
    (re.compile(r"norm\.weight$"), REPLICATED),
]


@dataclass(frozen=True, slots=True)
class SourceTensor:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # data offset inside the file, to read files front to back


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    config: dict
    tensors: dict[str, SourceTensor]  # in file order

    @property
    def tied(self) -> bool:
        """lm_head is an alias of the embeddings (tied and not stored)."""
        return bool(self.config.get("tie_word_embeddings")) and "lm_head.weight" not in self.tensors

    @property
    def dtype(self) -> str:
        return str(self.config.get("torch_dtype") or "float32")


def shard_rule(name: str) -> str:
    for pattern, rule in _RULES:
        if pattern.search(name):
            return rule
    raise UnknownTensorError(f"tensor {name!r} has no tensor-parallel rule (column, row or replicated); "
                             "refusing to replicate it silently: add a rule in cache_daemon/layout.py")


def shard_shape(shape: tuple[int, ...], rule: str, tp_size: int) -> tuple[int, ...]:
    dim = {COLUMN: 0, ROW: 1}.get(rule)
    if dim is None:
        return shape
    out = list(shape)
    out[dim] //= tp_size
    return tuple(out)


def read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise MissingShardError(f"{path} is truncated (no safetensors header): re-download it")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise CheckpointError(f"{path} has a {n}-byte header: not a safetensors file")
        body = f.read(n)
    try:
        header = json.loads(body)
    except ValueError as e:
        raise CheckpointError(f"{path} has a corrupt safetensors header ({e}): re-download it") from None
    header.pop("__metadata__", None)
    for name, meta in header.items():
        meta["data_offsets"][0] += 8 + n
    return header


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    index = path / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise MissingShardError(f"{path}: shard file(s) named by {INDEX} are missing: "
                                    f"{', '.join(missing)}; re-download the checkpoint")
        return [path / f for f in files], weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors file: point --model at a checkpoint directory")
    return files, None


def open_checkpoint(model_dir) -> Checkpoint:
    """Read config.json, the index and every file's header; check the index against the files."""
    path = Path(model_dir).resolve()
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: point --model at a Hugging Face checkpoint directory")
    config = json.loads((path / "config.json").read_text())
    files, weight_map = _weight_files(path)
    found: list[SourceTensor] = []
    for file in files:
        for name, meta in read_header(file).items():
            dtype = ST_DTYPES.get(meta["dtype"])
            if dtype is None:
                raise CheckpointError(f"{file.name}: tensor {name!r} has unsupported dtype {meta['dtype']}")
            found.append(SourceTensor(name, file, dtype, tuple(meta["shape"]), meta["data_offsets"][0]))
    tensors = {t.name: t for t in sorted(found, key=lambda t: (t.file.name, t.offset))}
    for name, fname in (weight_map or {}).items():
        if name not in tensors or tensors[name].file.name != fname:
            raise MissingShardError(f"{INDEX} places {name!r} in {fname}, which does not hold it: "
                                    "the shard is truncated or from another checkpoint")
    return Checkpoint(path, config, tensors)


def expected_shapes(config: dict, tied: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, the config fields it follows) for the Llama/Qwen2/Qwen3/Mistral family."""
    g = config.get
    try:
        d, inter, layers = g("hidden_size"), g("intermediate_size"), g("num_hidden_layers")
        heads, vocab = g("num_attention_heads"), g("vocab_size")
        kv = g("num_key_value_heads") or heads
        hd = g("head_dim") or d // heads
    except TypeError as e:
        raise CheckpointError(f"config.json lacks a size field the model family needs ({e})") from None
    q, k = heads * hd, kv * hd
    out = {"model.embed_tokens.weight": ((vocab, d), "vocab_size, hidden_size"),
           "model.norm.weight": ((d,), "hidden_size")}
    if not tied:
        out["lm_head.weight"] = ((vocab, d), "vocab_size, hidden_size")
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": ((d,), "hidden_size"),
                p + "post_attention_layernorm.weight": ((d,), "hidden_size"),
                p + "self_attn.q_proj.weight": ((q, d), "num_attention_heads*head_dim, hidden_size"),
                p + "self_attn.k_proj.weight": ((k, d), "num_key_value_heads*head_dim, hidden_size"),
                p + "self_attn.v_proj.weight": ((k, d), "num_key_value_heads*head_dim, hidden_size"),
                p + "self_attn.o_proj.weight": ((d, q), "hidden_size, num_attention_heads*head_dim"),
                p + "mlp.gate_proj.weight": ((inter, d), "intermediate_size, hidden_size"),
                p + "mlp.up_proj.weight": ((inter, d), "intermediate_size, hidden_size"),
                p + "mlp.down_proj.weight": ((d, inter), "hidden_size, intermediate_size")}
    return out


def _optional_shape(name: str, config: dict) -> tuple[int, ...] | None:
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or config["hidden_size"] // heads
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (hd,)
    if name.endswith("q_proj.bias"):
        return (heads * hd,)
    if name.endswith(("k_proj.bias", "v_proj.bias")):
        return (kv * hd,)
    return None


def undivided_by_tp(config: dict, tp_size: int) -> list[tuple[str, int]]:
    """The (field, value) pairs of config.json that ``tp_size`` does not divide: the one rule the
    daemon, the engine and the node config's preflight check (each words its own error)."""
    heads = config.get("num_attention_heads", 1)
    fields = (("num_attention_heads", heads),
              ("num_key_value_heads", config.get("num_key_value_heads") or heads),
              ("intermediate_size", config.get("intermediate_size", 0)))
    return [(field, value) for field, value in fields if isinstance(value, int) and value % tp_size]


def check_tp(config: dict, tp_size: int) -> None:
    if tp_size < 1:
        raise TPSizeError(f"--tp must be at least 1, not {tp_size}")
    for field, value in undivided_by_tp(config, tp_size)[:1]:
        raise TPSizeError(f"tp size {tp_size} does not divide {field} ({value}) of config.json: "
                          "choose a --tp that divides it")


def resolve_dtype(dtype: str, config: dict) -> str:
    """``auto`` -> config.json's ``torch_dtype`` when it is a compute dtype, else float32; any other
    value as given. The daemon and the engine both resolve here, so their fingerprints agree."""
    if dtype != "auto":
        return dtype
    found = config.get("torch_dtype") or "float32"
    return found if found in COMPUTE_DTYPES else "float32"


def validate(ckpt: Checkpoint, tp_size: int) -> None:
    """Raise the specific :class:`CheckpointError` for the first contradiction found."""
    check_tp(ckpt.config, tp_size)
    expected = expected_shapes(ckpt.config, ckpt.tied)
    missing = [n for n in expected if n not in ckpt.tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise MissingTensorError(f"{ckpt.path}: tensor(s) {', '.join(missing[:3])}{more} required by "
                                 "config.json are in no safetensors file: the checkpoint is incomplete")
    quantized = bool(ckpt.config.get("quantization_config"))
    for t in ckpt.tensors.values():
        shard_rule(t.name)
        want, fields = expected.get(t.name) or (_optional_shape(t.name, ckpt.config), "head_dim")
        if want is not None and t.shape != want:
            raise ShapeMismatchError(f"{t.file.name}: {t.name} has shape {list(t.shape)} but config.json "
                                     f"({fields}) says {list(want)}")
        if not quantized and t.dtype in FLOATS and t.dtype != ckpt.dtype:
            raise DtypeMismatchError(f"{t.file.name}: {t.name} is {t.dtype} but config.json torch_dtype "
                                     f"is {ckpt.dtype}: fix torch_dtype or re-export the checkpoint")
