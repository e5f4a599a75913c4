"""vLLM's model as named tensors, and back: what the daemon packs, and how an instance points a
model built on the meta device at the daemon's arena.

Three kinds of tensor, recorded in each manifest entry's ``attrs["kind"]``:

- ``param``: every parameter after vLLM's loading (fused ``qkv_proj`` / ``gate_up_proj``, this rank's
  TP shard, any quantization post-processing). In an instance it is a read-only view of the arena:
  zero-copy, shared by every instance of the node.
- ``buffer``: registered buffers (rotary ``cos_sin_cache``, attention ``_k_scale`` ...). vLLM writes
  some of them after loading (``set_default_quant_scales`` does ``_k_scale.fill_(1.0)``), which
  would fault on the read-only arena, so an instance gets a private copy of each (counted, logged).
- ``attr``: plain tensor attributes that loading or post-processing set on modules (``_k_scale_cpu``,
  a repacked weight kept beside the parameter). Private copies too, for the same reason.

Tied tensors (lm_head = embed_tokens) are one entry plus an alias; the instance registers the same
object under both names, so the tie holds.

Where vLLM writes weights after loading on CPU: ``dispatch_cpu_unquantized_gemm`` hands every
unquantized linear weight to oneDNN (``create_onednn_mm``), which keeps a private reordered copy and
replaces the parameter by an empty one. :func:`cpu_gemm` decides what an instance does instead.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

PARAM, BUFFER, ATTR = "param", "buffer", "attr"
CPU_GEMM_MODES = ("shared", "prepack")


def named_tensors(model: nn.Module) -> tuple[list[tuple[str, str, torch.Tensor]], dict[str, str]]:
    """(name, kind, tensor) for every tensor of ``model``, and aliases (alias -> name) for tensors
    that are the same memory as an earlier one (ties)."""
    out: list[tuple[str, str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}

    def add(name: str, kind: str, t: torch.Tensor) -> None:
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            return
        if key is not None:
            seen[key] = name
        out.append((name, kind, t.detach()))

    for name, p in model.named_parameters(remove_duplicate=False):
        add(name, PARAM, p)
    for name, b in model.named_buffers(remove_duplicate=False):
        add(name, BUFFER, b)
    for mod_name, module in model.named_modules():
        for leaf, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                add(f"{mod_name}.{leaf}" if mod_name else leaf, ATTR, value)
    return out, aliases


def apply(model: nn.Module, kinds: dict[str, str], views: dict[str, torch.Tensor],
          aliases: dict[str, str]) -> dict[str, int]:
    """Point ``model`` (built on the meta device) at ``views`` (name -> read-only arena tensor):
    parameters as the views themselves, buffers and attributes as private copies. Returns the
    tensors and bytes of each ("shared", "copied")."""
    modules = dict(model.named_modules(remove_duplicate=False))
    placed: dict[str, object] = {}
    figures = {"shared_tensors": 0, "shared_bytes": 0, "copied_tensors": 0, "copied_bytes": 0}

    def place(name: str, kind: str, obj) -> None:
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise LayoutError(f"the daemon's arena holds {name!r} but this vLLM model has no module "
                              f"{module_name!r}: the daemon packed another model or vLLM version")
        module._parameters.pop(leaf, None)
        module._buffers.pop(leaf, None)
        if kind == PARAM:
            module.register_parameter(leaf, obj)
        elif kind == BUFFER:
            module.register_buffer(leaf, obj)
        else:
            setattr(module, leaf, obj)
        placed[name] = obj

    for name, kind in kinds.items():
        view = views[name]
        if kind == PARAM:
            obj = nn.Parameter(view, requires_grad=False)  # no copy: the arena's memory itself
            figures["shared_tensors"] += 1
            figures["shared_bytes"] += view.nbytes
        else:
            obj = view.clone()  # vLLM may write these after loading (see the module docstring)
            figures["copied_tensors"] += 1
            figures["copied_bytes"] += view.nbytes
        place(name, kind, obj)
    for alias, target in aliases.items():
        place(alias, kinds[target], placed[target])
    return figures


def arena_params(model: nn.Module, views) -> dict[str, int]:
    """name -> bytes of each parameter of ``model`` whose memory lies in the arena (of ``views``)."""
    spans = [(v.data_ptr(), v.data_ptr() + v.nbytes) for v in views if v.nbytes]
    lo, hi = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)
    return {n: p.nbytes for n, p in model.named_parameters() if p.nbytes and lo <= p.data_ptr() < hi}


def meta_leftovers(model: nn.Module) -> list[str]:
    """Tensors still on the meta device (nothing in the arena for them): must be none."""
    left = [n for n, t in [*model.named_parameters(remove_duplicate=False),
                           *model.named_buffers(remove_duplicate=False)] if t.is_meta]
    for mod_name, module in model.named_modules():
        left += [f"{mod_name}.{k}" for k, v in vars(module).items() if isinstance(v, torch.Tensor) and v.is_meta]
    return left


@contextlib.contextmanager
def cpu_gemm(mode: str):
    """vLLM's CPU GEMM dispatch during ``process_weights_after_loading``.

    ``prepack``: vLLM's own (oneDNN/sgl packed copy of each linear weight, private to the process,
    the parameter replaced by an empty one): the same kernels and numerics as vLLM's disk load, and
    one private copy of every linear weight per instance.
    ``shared``: each linear layer runs ``torch.nn.functional.linear`` on the arena's weight (vLLM's
    own fallback, the path it takes for layers it does not pack), so nothing is copied. The daemon's
    loader child packs with ``shared``, so the arena holds the unpacked weights either way.
    """
    if mode not in CPU_GEMM_MODES:
        raise ValueError(f"cpu_gemm must be one of {', '.join(CPU_GEMM_MODES)}, not {mode!r}")
    if mode == "prepack":
        yield
        return
    from vllm.model_executor.layers import utils

    def plain(layer: nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    saved = utils.dispatch_cpu_unquantized_gemm
    utils.dispatch_cpu_unquantized_gemm = plain  # imported by name at each call in vLLM 0.32
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = saved


class LayoutError(RuntimeError):
    """The arena's tensors do not fit this vLLM model."""
