"""The split-K paged decode (``engine.fused.paged_decode``: spans of ``DECODE_SPLIT`` positions, then
merged) equals the one-program-per-row kernel it replaced, for ragged lengths, a padded row of
length 0, several chunks and both float32 and bfloat16; and the zygote's Triton preload touches no
CUDA. Run through Triton's interpreter on CPU where Triton is installed (skipped otherwise); the
compiled kernels run in the CUDA tests (``tests/test_engine_graphs.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SPLIT_CHECK = """
import sys, torch
from triton.runtime import interpreter

# Triton 3.6's interpreter holds a loaded scalar as a 1-element array, which cannot be a loop bound
# (see tests/test_engine_graphs.py); compiled Triton can. Let it take the one element.
patch = interpreter._patch_lang_tensor
def _patched(tensor, scope):
    patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patched

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
assert not torch.cuda.is_initialized(), "the preload must not create a CUDA context"
print("ok")
"""


def _run(code: str, *args: str, interpret: bool) -> str:
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    if interpret:  # the interpreter is chosen when a kernel is defined: a fresh process
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("split", [16, 64])  # 5 spans of a row's 80 positions, and 2
def test_split_decode_equals_the_unsplit_kernel(split):
    pytest.importorskip("triton")
    assert float(_run(SPLIT_CHECK, str(split), interpret=True)) <= 1e-5


def test_the_zygote_preload_caches_triton_and_creates_no_cuda_context():
    pytest.importorskip("triton")
    assert _run(PRELOAD_CHECK, interpret=False) == "ok"
