"""What the decode step's Triton kernels compile to for an H100/H200 (sm_90), without a GPU.

    python3 bench/kernel_stats.py            # Llama-3-8B's layout, bf16, blocks of 16

Per kernel: registers per thread, local memory (spills), shared memory, and the global loads and
stores of its PTX by width (``ld.global.b16`` is one bf16 per instruction; ``cp.async``/``v4`` are
16-byte vectors). Registers bound how many programs an SM holds (65,536 a SM: 4 warps at 255
registers fit 2). Needs Triton with its NVIDIA backend (it ships ptxas and cuobjdump); compiles
with the constexprs ``engine.fused`` launches with. Figures from the compiler, not timings.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FLOATS = {"sm_scale", "eps"}


def compile_stats(fn, pointers: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    # every pointer and stride 16-byte divisible, as torch's allocations and these shapes' strides are
    # (what Triton's launcher specializes on); the layer index is not specialized (do_not_specialize)
    div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
           if n not in constexprs and n not in FLOATS and n != "layer"}
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in constexprs.items()}, div)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": num_warps, "num_stages": num_stages})
    ops: dict = {}
    for m in re.finditer(r"\b(ld\.global[.\w]*|st\.global[.\w]*|cp\.async\.c[ag][.\w]*)", ck.asm["ptx"]):
        ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    regs, stack = (int(x) for x in m.groups()) if m else (-1, -1)
    return {"regs": regs, "stack": stack, "shared": ck.metadata.shared, "ops": ops}


def kernels(a) -> list:
    """(name, kernel, pointer dtypes, constexprs, num_warps, num_stages) as ``engine.fused`` launches them."""
    from engine import fused
    from engine import triton_kernels as tk

    elem = {"bf16": 2, "fp16": 2, "fp32": 4}[a.dtype]
    kv = SimpleNamespace(block_size=a.block_size, head_dim=a.head_dim,
                         anchor=SimpleNamespace(element_size=lambda: elem))
    group, d, t = a.heads // a.kv_heads, a.head_dim, a.dtype
    split = fused.DECODE_SPLIT if d <= 128 else fused.DECODE_SPLIT // 2
    spans = -(-a.max_len // split)
    nsplit = fused.decode_programs(a.batch, a.kv_heads, spans)
    cache = {"anchor_ptr": f"*{t}", "offsets_ptr": "*i64"}
    attn = dict(H_KV=a.kv_heads, GROUP=group, D=d, BS=a.block_size, BLOCK_H=fused._pow2(group, 16),
                BLOCK_D=fused._pow2(d, 16), ALIGN=fused._align(kv), IEEE=t == "fp32")
    return [
        ("rope_store_kv", tk.rope_store_kv_kernel,
         {**cache, **{k: f"*{t}" for k in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr")}, "slots_ptr": "*i64",
          "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
         dict(H=a.heads, H_KV=a.kv_heads, D=d, BS=a.block_size, HALF=d // 2, BLOCK=fused._pow2(d // 2),
              ALIGN=fused._align(kv)), 1 if d <= 128 else 2, 3),
        (f"paged_decode_split (batch {a.batch}: {nsplit} programs a row and kv head)", tk.paged_decode_split_kernel,
         {**cache, "q_ptr": f"*{t}", "part_ptr": "*fp32", "ml_ptr": "*fp32", "tables_ptr": "*i64", "lens_ptr": "*i64"},
         dict(attn, H=a.heads, NSPLIT=nsplit, SPLIT=split, PAGE_N=fused._page_n(kv, split)), 4, 2),
        ("paged_decode_combine", tk.paged_decode_combine_kernel,
         {"part_ptr": "*fp32", "ml_ptr": "*fp32", "lens_ptr": "*i64", "o_ptr": f"*{t}"},
         dict(H=a.heads, D=d, NSPLIT=nsplit, SPLIT=split, BLOCK_S=fused._pow2(nsplit),
              BLOCK_D=fused._pow2(d, 16)), 4, 3),
        ("paged_decode (one program a row and kv head)", tk.paged_decode_kernel,
         {**cache, "q_ptr": f"*{t}", "o_ptr": f"*{t}", "tables_ptr": "*i64", "lens_ptr": "*i64"},
         dict(attn, BLOCK_N=64 if d <= 128 else 32, PAGE_N=fused._page_n(kv, 64 if d <= 128 else 32)), 4, 2),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=16, help="the decode bucket (sets the split's programs)")
    p.add_argument("--max-len", type=int, default=1034, help="positions the tables address (bench/engine.py's)")
    a = p.parse_args()
    import triton

    print(f"# bench/kernel_stats.py {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}Z {platform.node()} "
          f"triton {triton.__version__}, target sm_90; command: {' '.join([sys.executable, *sys.argv])}")
    for name, fn, pointers, constexprs, warps, stages in kernels(a):
        s = compile_stats(fn, pointers, constexprs, warps, stages)
        ops = ", ".join(f"{k} {v}" for k, v in sorted(s["ops"].items()))
        print(f"{name}: {s['regs']} registers, {s['stack']} B stack (spills), {s['shared']} B shared, "
              f"{warps} warps; {ops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
