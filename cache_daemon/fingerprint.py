"""The fingerprint of a resident model: what a client must agree on before it may map the weights.

Any difference between the fingerprint a client computes and the one the loader computed is a
mismatch, reported field by field; the daemon never reloads or converts silently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec

from .errors import CheckpointError
from .transforms import TRANSFORM_VERSIONS

WEIGHT_SUFFIXES = (".safetensors",)
INDEX_NAME = "model.safetensors.index.json"


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Identity of one rank's packed weights. Built by :func:`make_config`; compared field by field."""

    model_path: str  # resolved directory
    model_identity: str  # sha256 of config.json and the weight files' names, sizes and mtimes
    revision: str  # hub commit when known (snapshot dir or ``_commit_hash``), else ""
    architecture: str
    dtype: str  # torch dtype name of the unquantized tensors, e.g. "bfloat16"
    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    quant_method: str  # from config.json's quantization_config, "none" when absent
    quant_hash: str  # stable hash of that quantization_config
    transform: str  # "none" | "fp8-block"
    transform_version: int
    device: str  # "cpu" | "cuda"
    device_capability: str  # "9.0" on an H200, "" on cpu
    torch_version: str
    # Which engine's layout the arena holds: "failover" (the reference engine's tensors, named as in
    # the checkpoint) or "vllm" (vLLM's parameters after its own loading: failover_vllm). For vLLM,
    # engine_version is vLLM's version and engine_config the (key, value) pairs of its model,
    # parallel and quantization config that decide the bytes (failover_vllm.fingerprint).
    engine: str = "failover"
    engine_version: str = ""
    engine_config: tuple[tuple[str, str], ...] = ()

    def diff(self, other: CacheConfig) -> list[str]:
        """One line per differing field: ``field: <this> != <other>`` (``engine_config.key`` for the
        engine's own settings, one line each)."""
        lines = []
        for name in self.__struct_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "engine_config":
                lines += _pairs_diff(dict(mine), dict(theirs))
            elif mine != theirs:
                lines.append(f"{name}: {mine!r} != {theirs!r}")
        return lines

    @property
    def key(self) -> str:
        """A short stable id for logs and status (not a substitute for comparing configs)."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:12]

    def describe(self) -> str:
        return (f"{self.model_path} rank {self.tp_rank}/{self.tp_size} {self.dtype} "
                f"transform={self.transform} device={self.device}")


def _pairs_diff(mine: dict, theirs: dict) -> list[str]:
    return [f"engine_config.{k}: {mine.get(k, '<unset>')!r} != {theirs.get(k, '<unset>')!r}"
            for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)]


def dtype_name(dtype) -> str:
    """Accept ``torch.bfloat16`` or ``"bfloat16"``; return the bare name."""
    return str(dtype).removeprefix("torch.")


def model_identity(model_dir: Path) -> str:
    h = hashlib.sha256()
    config = model_dir / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{model_dir} has no config.json: point --model at a Hugging Face checkpoint directory")
    h.update(config.read_bytes())
    for path in sorted(model_dir.iterdir()):
        if path.name.endswith(WEIGHT_SUFFIXES) or path.name == INDEX_NAME:
            st = path.stat()
            h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _revision(model_dir: Path, hf: dict) -> str:
    if hf.get("_commit_hash"):
        return str(hf["_commit_hash"])
    if model_dir.parent.name == "snapshots":  # Hugging Face hub cache layout
        return model_dir.name
    return ""


def device_capability(device: str) -> str:
    if device == "cpu":
        return ""
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    major, minor = torch.cuda.get_device_capability(index)
    return f"{major}.{minor}"


def make_config(model_dir, *, dtype, tp_size: int, tp_rank: int, transform: str = "none",
                device: str = "cpu") -> CacheConfig:
    """The fingerprint of ``model_dir`` as rank ``tp_rank`` of ``tp_size`` would pack it.

    ``device`` is ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (only the kind and the capability are kept).
    Imports torch (for its version, and for the GPU capability on CUDA).
    """
    import torch

    if transform not in TRANSFORM_VERSIONS:
        raise ValueError(f"transform must be one of {sorted(TRANSFORM_VERSIONS)}, not {transform!r}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1}")
    path = Path(model_dir).resolve()
    identity = model_identity(path)
    hf = json.loads((path / "config.json").read_text())
    quant = hf.get("quantization_config") or {}
    return CacheConfig(
        model_path=str(path), model_identity=identity, revision=_revision(path, hf),
        architecture=(hf.get("architectures") or [hf.get("model_type", "")])[0],
        dtype=dtype_name(dtype), tp_size=tp_size, tp_rank=tp_rank,
        quant_method=str(quant.get("quant_method", "none")),
        quant_hash=hashlib.sha256(json.dumps(quant, sort_keys=True).encode()).hexdigest()[:16],
        transform=transform, transform_version=TRANSFORM_VERSIONS[transform],
        device=device.split(":", 1)[0], device_capability=device_capability(device),
        torch_version=str(torch.__version__),
    )
