"""Compile the attention kernel for sm_90 without a GPU and report registers, spills and instruction mix.

Uses Triton's bundled ptxas, so kernel variants can be compared here before spending device time:

    python benchmarks/kernel_resources.py --block-n 64 128 --warps 4 --unpack asm ops
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from oscar_compile.kernels import triton_attention as ta

POINTERS = {"qq_ptr": "*fp16", "pos_ptr": "*i64", "len_ptr": "*i64", "c0_ptr": "*i64", "cend_ptr": "*i64",
            "kch_ptr": "*bf16", "vch_ptr": "*bf16", "kc_ptr": "*i32", "km_ptr": "*fp16", "vc_ptr": "*i32",
            "vm_ptr": "*fp16", "ks_ptr": "*bf16", "vs_ptr": "*bf16", "kr_ptr": "*bf16", "vr_ptr": "*bf16",
            "bt_ptr": "*i32", "mask_ptr": "*bf16", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
            "part_o_ptr": "*fp32"}


def compile_attention(block_n, warps, stages, unpack, d=128, g=4, ablate=0, region=0):
    fn = ta._attn_kernel
    names = fn.arg_names
    const = dict(H=8, G=g, D=d, NG=1, PS=16, HAS_RING=True, BLOCK_M=16, BLOCK_N=block_n, IS_CAUSAL=False,
                 MASK_KIND=0, HAS_CHUNK=False, DT=tl.float16, KC=min(d, 64), ALIGNED=True, ABLATE=ablate,
                 USE_ASM=unpack == "asm", REGION=region)
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "i32") for n in names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def ptxas_report(ptx: str) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        open(path, "w").write(ptx)
        out = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--stages", type=int, nargs="+", default=[1])
    ap.add_argument("--unpack", nargs="+", default=["asm"])
    ap.add_argument("--ablate", type=int, nargs="+", default=[0])
    ap.add_argument("--region", type=int, nargs="+", default=[0], help="0: INT2 pages, 1: BF16 keys")
    ap.add_argument("--dump", default=None, help="write the PTX of the last variant here")
    args = ap.parse_args()
    for bn, w, st, up, ab, rg in itertools.product(args.block_n, args.warps, args.stages, args.unpack, args.ablate,
                                                   args.region):
        k = compile_attention(bn, w, st, up, ablate=ab, region=rg)
        ptx = k.asm["ptx"]
        mix = {op: ptx.count(op) for op in ("ld.global", "lop3", "cvt.rn.f16", "cvt.rn.f32", "st.shared", "ld.shared",
                                             "ldmatrix", "mma.sync", "shfl")}
        print(f"region={rg} block_n={bn} warps={w} stages={st} unpack={up} ablate={ab}: {ptxas_report(ptx)} "
              f"shared={k.metadata.shared} {mix}", flush=True)
        if args.dump:
            open(args.dump, "w").write(ptx)


if __name__ == "__main__":
    main()
