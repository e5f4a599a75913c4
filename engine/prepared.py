"""What a zygote prepares for the engines it forks: the CPU-only, per-model part of an engine's start.

An engine's start reads the tokenizer (and compiles its chat template) and builds the model's module
tree on the meta device. Neither needs CUDA or computes anything, both are the same for every engine
of one model, and every relaunch paid them again (the tokenizer of a real model alone takes a few
hundred milliseconds). ``prepare`` does them once in the zygote (``engine.cli.prepare``, called by
``failover.procs.zygote`` after it forked an engine); every later fork inherits the result. The RoPE
tables are not prepared here: computing them runs torch's CPU ops, and the first of those starts the
intra-op thread pool, which a process that forks must not have (``tests/test_zygote_prepare.py``
checks that ``prepare`` leaves the zygote with no new thread).

Ownership and lifetime: the prepared objects live in this module of the zygote; a forked engine gets
its own copy-on-write copy. ``tokenizer`` hands out a shared object (nobody writes to it);
``skeleton`` hands its meta-device model out once per process (the caller assigns the weights into
it): a second engine in the same process builds its own. Everything is keyed by the identity of the
model's files (inode, size, mtime of config.json, generation_config.json, tokenizer.json,
tokenizer_config.json): a checkpoint changed on disk after ``prepare`` is never served from the old
state, it is loaded afresh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import ModelConfig
from engine.model import CausalLM
from engine.tokenizer import Tokenizer

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass
class _Model:
    identity: tuple
    tokenizer: Tokenizer
    skeletons: dict[tuple[int, bool], CausalLM] = field(default_factory=dict)  # (tp, fp8) -> meta model


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


def prepare(model_dir: Path, model_cfg: ModelConfig, *, tp: int, fp8: bool) -> bool:
    """Load the tokenizer and build the meta-device model of ``model_dir`` for later forks (no
    compute, no CUDA, no thread). False when they were already there."""
    entry = _current(model_dir)
    fresh = entry is None
    if fresh:
        entry = _models[_key(model_dir)] = _Model(identity(model_dir), Tokenizer(model_dir))
    if (tp, fp8) not in entry.skeletons:
        entry.skeletons[(tp, fp8)] = CausalLM.skeleton(model_cfg, tp, fp8)
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
