"""The model fingerprint that nodes compare: what weights an instance serves, by content.

The cache daemon's fingerprint (cache_daemon/fingerprint.py) includes file mtimes: cheap, and right
for one node (a file rewritten in place must not be served from a stale arena), but two copies of
one checkpoint on two nodes differ by it. This one is built from what a copy keeps:

- ``config.json`` and the safetensors index, whole (small);
- per weight file, in name order: its name, its size, and its safetensors header whole (the JSON of
  every tensor's name, dtype, shape and byte range, plus ``__metadata__``; a few KB to a few MB);
- per weight file, ``SAMPLES`` reads of ``SAMPLE_BYTES`` at fixed, evenly spaced offsets of its data
  (the first and the last bytes included).

Cost: the headers plus ``SAMPLES x SAMPLE_BYTES`` (1 MiB) per file, read once when the node starts
(never on a request's path, and never a whole multi-GB file: the daemon's loader is the one reader
of whole files). A 140 GB checkpoint in 30 files reads about 35 MB: ~0.1 s warm, a few hundred ms of
seeks cold. It tells apart different checkpoints, revisions, quantizations and truncated copies; it
is an identity, not an integrity check: a byte flipped between two samples goes unseen.

The key also holds what changes the served tokens besides the bytes: dtype, transform, tp size and
the device kind (not the model's path, nor the device index).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SAMPLES = 16
SAMPLE_BYTES = 64 << 10
MAX_HEADER = 100 << 20  # safetensors' own limit
SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SMALL_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
               "quantize_config.json")


def content_identity(model_dir: Path) -> str:
    """A hex digest of the checkpoint in ``model_dir`` by content (see the module docstring)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    h = hashlib.sha256()
    for name in SMALL_FILES:
        if (model_dir / name).is_file():
            h.update(f"{name}\0".encode() + (model_dir / name).read_bytes() + b"\0")
    for path in sorted(p for p in model_dir.iterdir() if p.name.endswith(SUFFIXES) and p.is_file()):
        _file(h, path)
    return h.hexdigest()


def _file(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    data_start = 0
    with open(path, "rb") as f:
        if path.name.endswith(".safetensors") and size >= 8:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= min(MAX_HEADER, size - 8):
                h.update(f.read(n))
                data_start = 8 + n
        span = size - data_start
        if span <= SAMPLES * SAMPLE_BYTES:  # small: all of it
            f.seek(data_start)
            h.update(f.read(span))
            return
        for i in range(SAMPLES):  # evenly spaced, the first and the last bytes included
            f.seek(data_start + (span - SAMPLE_BYTES) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))


def fingerprint(model_path: str, *, dtype: str, tp: int, transform: str, device: str) -> dict:
    """The record a node publishes: ``key`` is what routers compare across nodes."""
    try:
        content = content_identity(Path(model_path).resolve())
    except OSError as exc:  # the daemon reports the real error; the record says unknown
        content = f"unknown: {exc}"
    doc = {"content": content, "dtype": dtype, "tp": tp, "transform": transform,
           "device": device.split(":", 1)[0]}
    key = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    if content.startswith("unknown"):
        key = "unknown"  # compared with nothing: a node that cannot read its model fails at its daemon
    return {"model": model_path, **doc, "key": key}
