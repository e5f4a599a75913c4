"""The split-K paged decode (``engine.fused.paged_decode``: spans of ``DECODE_SPLIT`` positions, then
merged) equals the one-program-per-row kernel it replaced, for ragged lengths, a padded row of
length 0, several chunks and both float32 and bfloat16; and the zygote's Triton preload touches no
CUDA. Run through Triton's interpreter on CPU where Triton is installed (skipped otherwise); the
compiled kernels run in the CUDA tests (``tests/test_engine_graphs.py``)."""

from __future__ import annotations

import pytest

import triton_interp

SPLIT_CHECK = """
import sys, torch
import triton_interp
triton_interp.allow_loaded_scalar_bounds()

from engine import fused
from engine.kv_cache import KVPool
fused.DECODE_SPLIT = int(sys.argv[1])
torch.manual_seed(0)
worst = 0.0
for dtype in (torch.float32, torch.bfloat16):
    kv = KVPool(2, 2, 32, 4, dtype, "cpu", min_blocks=8, max_blocks=80)
    kv.fused = True
    kv.anchor = torch.empty(64, dtype=dtype)
    kv.offsets = torch.zeros((2, 2, 80), dtype=torch.long)
    kv.resize((30, 20, 30))
    for c in kv.chunks:
        c.copy_(torch.randn(c.shape).to(dtype))
    tables = torch.zeros((20, 6), dtype=torch.long)
    perm = torch.randperm(80)
    for r in range(4):
        tables[:, r] = perm[r * 20:(r + 1) * 20]
    lens = torch.tensor([79, 1, 0, 37], dtype=torch.long)
    q = torch.randn(4, 8, 32).to(dtype)
    split = fused.paged_decode(kv, 1, q, tables, lens)
    whole = fused.paged_decode_unsplit(kv, 1, q, tables, lens)
    assert split[2].abs().max().item() == 0, "a padded row gets zeros"
    worst = max(worst, (split.float() - whole.float()).abs().max().item() / (1 if dtype == torch.float32 else 100))
print(worst)
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


@pytest.mark.parametrize("split", [16, 64])  # 5 spans of a row's 80 positions, and 2
def test_split_decode_equals_the_unsplit_kernel(split):
    pytest.importorskip("triton")
    assert float(triton_interp.run(SPLIT_CHECK, str(split))) <= 1e-5


def test_the_zygote_preload_caches_triton_and_creates_no_cuda_context():
    pytest.importorskip("triton")
    assert triton_interp.run(PRELOAD_CHECK, interpret=False) == "ok"
