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


# runtime sizes that are rarely multiples of 16; every other argument (pointers, strides) is, as in a real launch
NOT_DIVISIBLE = {"T", "M_TOTAL", "S", "W", "NSPLIT", "NS", "mask_len", "sp_b", "sbt_b", "sc_s", "sm_s", "sm_h",
                 "keys_per_split", "bf16_per_split"}


def compile_attention(block_n, warps, stages, unpack, d=128, g=4, ablate=0, region=0, block_m=16, prefill=False):
    fn = ta._attn_kernel
    names = fn.arg_names
    const = dict(H=8, G=g, D=d, NG=1, PS=16, HAS_RING=True, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=prefill,
                 MASK_KIND=0, HAS_CHUNK=prefill, DT=tl.float16, KC=min(d, 64), ALIGNED=True, ABLATE=ablate,
                 USE_ASM=unpack == "asm", REGION=region)
    sig = {n: "constexpr" if n in const else POINTERS.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in const and n not in NOT_DIVISIBLE}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                                    attrs=attrs)
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
    ap.add_argument("--d", type=int, nargs="+", default=[128], help="head_dim")
    ap.add_argument("--block-m", type=int, nargs="+", default=[16])
    ap.add_argument("--prefill", action="store_true", help="causal, with the new chunk (prefill launches)")
    ap.add_argument("--dump", default=None, help="write the PTX of the last variant here")
    args = ap.parse_args()
    for bn, w, st, up, ab, rg, d, bm in itertools.product(args.block_n, args.warps, args.stages, args.unpack, args.ablate,
                                                          args.region, args.d, args.block_m):
        try:
            k = compile_attention(bn, w, st, up, d=d, ablate=ab, region=rg, block_m=bm, prefill=args.prefill)
        except Exception as e:  # a configuration the compiler rejects
            print(f"region={rg} d={d} block_m={bm} block_n={bn} warps={w}: COMPILE FAILED {type(e).__name__}", flush=True)
            continue
        ptx = k.asm["ptx"]
        mix = {op: ptx.count(op) for op in ("ld.global", "lop3", "cvt.rn.f16", "cvt.rn.f32", "st.shared", "ld.shared",
                                             "ldmatrix", "mma.sync", "shfl")}
        print(f"region={rg} d={d} block_m={bm} block_n={bn} warps={w} stages={st} unpack={up} ablate={ab}: {ptxas_report(ptx)} "
              f"shared={k.metadata.shared} {mix}", flush=True)
        if args.dump:
            open(args.dump, "w").write(ptx)


if __name__ == "__main__":
    main()
