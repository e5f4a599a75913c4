"""What a zygote prepares for the engines it forks: the CPU-only, per-model part of an engine's start.

An engine's start reads the tokenizer (and compiles its chat template), builds the model's module
tree on the meta device and computes the RoPE tables. None of it needs CUDA, all of it is the same
for every engine of one model, and every relaunch paid it again (the tokenizer of a real model alone
takes a few hundred milliseconds). ``prepare`` does it once in the zygote (``engine.cli.prepare``,
called by ``failover.procs.zygote`` after it forked an engine); every later fork inherits the result.

Ownership and lifetime: the prepared objects live in this module of the zygote; a forked engine gets
its own copy-on-write copy. ``tokenizer`` and ``rope_tables`` hand out shared objects that nobody
writes (the tables are read-only inputs of RoPE). ``skeleton`` hands its meta-device model out once
per process (the caller assigns the weights into it): a second engine in the same process builds its
own. Everything is keyed by the identity of the model's files (inode, size, mtime of config.json,
generation_config.json, tokenizer.json, tokenizer_config.json): a checkpoint changed on disk after
``prepare`` is never served from the old state, it is loaded afresh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.layers import rope_tables as compute_rope_tables
from engine.model import CausalLM
from engine.tokenizer import Tokenizer

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass
class _Model:
    identity: tuple
    tokenizer: Tokenizer
    skeletons: dict[tuple[int, bool], CausalLM] = field(default_factory=dict)  # (tp, fp8) -> meta model
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # max_len -> (cos, sin)


_models: dict[str, _Model] = {}


def identity(model_dir: Path) -> tuple:
    """(name, inode, size, mtime_ns) of each of the model's files that decide its CPU-side state."""
    out = []
    for name in FILES:
        try:
            st = os.stat(Path(model_dir) / name)
        except FileNotFoundError:
            continue
        out.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _key(model_dir: Path) -> str:
    return str(Path(model_dir).resolve())


def _current(model_dir: Path) -> _Model | None:
    """The prepared state of ``model_dir`` if its files are still the ones it was prepared from."""
    entry = _models.get(_key(model_dir))
    return entry if entry is not None and entry.identity == identity(model_dir) else None


def prepare(model_dir: Path, model_cfg: ModelConfig, *, tp: int, fp8: bool, max_len: int) -> bool:
    """Load the tokenizer, build the meta-device model and the RoPE tables of ``model_dir`` for
    later forks (CPU only: no CUDA, no thread). False when they were already there."""
    entry = _current(model_dir)
    fresh = entry is None
    if fresh:
        entry = _models[_key(model_dir)] = _Model(identity(model_dir), Tokenizer(model_dir))
    if (tp, fp8) not in entry.skeletons:
        entry.skeletons[(tp, fp8)] = CausalLM.skeleton(model_cfg, tp, fp8)
        fresh = True
    if max_len not in entry.rope:
        entry.rope[max_len] = compute_rope_tables(model_cfg.head_dim, model_cfg.rope_theta, model_cfg.rope_scaling,
                                                  max_len)
        fresh = True
    return fresh


def tokenizer(model_dir: Path) -> tuple[Tokenizer, bool]:
    """(the tokenizer of ``model_dir``, whether it was prepared)."""
    entry = _current(model_dir)
    return (entry.tokenizer, True) if entry is not None else (Tokenizer(model_dir), False)


def skeleton(model_dir: Path, model_cfg: ModelConfig, tp: int, fp8: bool) -> tuple[CausalLM, bool]:
    """(a meta-device model to assign weights into, whether it was prepared); a prepared one is
    handed out once."""
    entry = _current(model_dir)
    prepared = entry.skeletons.pop((tp, fp8), None) if entry is not None else None
    return (prepared, True) if prepared is not None else (CausalLM.skeleton(model_cfg, tp, fp8), False)


def rope_tables(model_dir: Path, model_cfg: ModelConfig, max_len: int) -> tuple[tuple[torch.Tensor, torch.Tensor], bool]:
    """((cos, sin) float32 on the CPU, [max_len, head_dim]; whether they were prepared). Read-only."""
    entry = _current(model_dir)
    if entry is not None and max_len in entry.rope:
        return entry.rope[max_len], True
    return compute_rope_tables(model_cfg.head_dim, model_cfg.rope_theta, model_cfg.rope_scaling, max_len), False
