"""The split-K paged decode (``engine.fused.paged_decode``: spans of ``DECODE_SPLIT`` positions, a
few per program when a row is longer than ``decode_programs`` spans, then merged) and the
one-program-per-row kernel both equal attention over each row's blocks read position by position,
for ragged lengths, a padded row of length 0, several chunks and block sizes that are and are not
powers of two; and the zygote's Triton preload touches no CUDA. Run through Triton's interpreter on
CPU where Triton is installed (skipped otherwise), in float32 only: the interpreter takes a bfloat16
``tl.dot``'s operands as their raw bits, so its bfloat16 output is garbage (the old check compared
two such outputs with each other). The compiled kernels, bfloat16 included, run in the CUDA tests
(``tests/test_engine_graphs.py``)."""

from __future__ import annotations

import pytest

import triton_interp

SPLIT_CHECK = """
import sys, torch
import triton_interp
triton_interp.allow_loaded_scalar_bounds()

from engine import fused
from engine.kv_cache import KVPool
split, programs, bs, heads, kv_heads, dim, longest = (int(x) for x in sys.argv[1:8])
device, dtype = sys.argv[8], getattr(torch, sys.argv[9])
fused.DECODE_SPLIT, fused.DECODE_PROGRAMS = split, programs
torch.manual_seed(0)


def reference(kv, layer, q, tables, lens):
    # each row's K/V read position by position from the chunks, softmax in float64
    out = torch.zeros(q.shape, dtype=torch.float64)
    chunks = [c.cpu().double() for c in kv.chunks]
    group = heads // kv_heads
    for r, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        kvs = []
        for which in (0, 1):
            rows = []
            for p in range(n):
                block = int(tables[p // bs, r])
                c = max(i for i, start in enumerate(kv.starts) if start <= block)
                rows.append(chunks[c][which, layer, block - kv.starts[c], p % bs])
            kvs.append(torch.stack(rows))  # [n, Hkv, D]
        k, v = kvs
        for h in range(heads):
            w = torch.softmax(k[:, h // group] @ q[r, h].cpu().double() * dim ** -0.5, 0)
            out[r, h] = w @ v[:, h // group]
    return out


width = -(-longest // bs)  # blocks of the longest row
kv = KVPool(2, kv_heads, dim, bs, dtype, device, min_blocks=8, max_blocks=4 * width)
if device == "cpu":  # the fused path's addressing and chunks, as on CUDA (no reserved range)
    kv.fused, kv._arena = True, None
    kv.anchor = torch.empty(64, dtype=dtype)
    kv.offsets = torch.zeros((2, 2, 4 * width), dtype=torch.long)
third = 4 * width // 3
kv.resize((third, 4 * width - 2 * third, third))  # three chunks
for c in kv.chunks:
    c.copy_(torch.randn(c.shape).to(dtype))
tables = torch.zeros((width, 6), dtype=torch.long)
perm = torch.randperm(4 * width)
for r in range(4):
    tables[:, r] = perm[r * width:(r + 1) * width]
lens = torch.tensor([longest, 1, 0, longest // 2 - 3], dtype=torch.long)
q = torch.randn(4, heads, dim).to(dtype)
tables, lens, q = tables.to(device), lens.to(device), q.to(device)
split = fused.paged_decode(kv, 1, q, tables, lens)
whole = fused.paged_decode_unsplit(kv, 1, q, tables, lens)
ref = reference(kv, 1, q, tables.cpu(), lens.cpu())
assert split[2].abs().max().item() == 0 and whole[2].abs().max().item() == 0, "a padded row gets zeros"
print(max((got.cpu().double() - ref).abs().max().item() for got in (split, whole)))
"""

PRELOAD_CHECK = """
import torch
import engine.cli
engine.cli.preload("cuda")
from triton.runtime.cache import triton_key
assert triton_key.cache_info().currsize == 1, "Triton's install hash is cached for the forks"
from engine import fused
names = {k.fn.__name__ for k in fused.kernels()}
assert {"paged_decode_split_kernel", "paged_decode_combine_kernel", "store_kv_kernel", "rope_kernel"} <= names, names
assert all(k.hash is not None for k in fused.kernels()), "every launched kernel's source hash is cached"
import importlib.util, sys
if importlib.util.find_spec("triton.experimental.gluon") is not None:
    assert "triton.experimental.gluon" in sys.modules, "the Gluon modules a first launch imports are loaded"
assert not torch.cuda.is_initialized(), "the preload must not create a CUDA context"
print("ok")
"""


# (positions per span, programs to aim for, block size): 5 spans of a row's 79 positions, one program
# each, or 2 programs (spans 0, 2, 4 and 1, 3) or 1 per row and kv head; 2 spans; a block size
# that is not a power of two (each position's block looked up alone), one larger than a span and 1
@pytest.mark.parametrize("split,programs,block", [(16, 1024, 4), (16, 16, 4), (16, 8, 4), (64, 1024, 4),
                                                  (16, 16, 3), (16, 1024, 32), (16, 16, 1)])
def test_split_and_unsplit_decode_equal_attention_over_each_rows_blocks(split, programs, block):
    pytest.importorskip("triton")
    out = triton_interp.run(SPLIT_CHECK, str(split), str(programs), str(block), "8", "2", "32", "79", "cpu", "float32")
    assert float(out) <= 1e-5


# compiled, at Llama-3-8B's head layout (32 query heads on 8 kv heads of 128, blocks of 16, a row of
# 300 positions), in the default spans and with fewer programs than spans, and at a small layout
@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("shape", [("64", "1024", "16", "32", "8", "128", "300"),
                                   ("64", "8", "16", "32", "8", "128", "300"), ("16", "16", "4", "8", "2", "32", "79")])
def test_compiled_decode_kernels_equal_attention_over_each_rows_blocks(shape, dtype, tolerance):
    assert float(triton_interp.run(SPLIT_CHECK, *shape, "cuda", dtype, interpret=False)) <= tolerance


def test_the_zygote_preload_caches_triton_and_creates_no_cuda_context():
    pytest.importorskip("triton")
    assert triton_interp.run(PRELOAD_CHECK, interpret=False) == "ok"
