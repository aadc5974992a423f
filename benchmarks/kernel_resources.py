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

from oscar_compile.kernels.sm90 import compile_attention


def ptxas_report(ptx: str) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas Triton itself uses for sm_90 (it differs between Triton releases)
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
            k = compile_attention(d=d, block_m=bm, block_n=bn, region=rg, prefill=args.prefill, unpack=up, ablate=ab,
                                  num_warps=w, num_stages=st)
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
