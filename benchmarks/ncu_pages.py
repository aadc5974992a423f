"""Hardware counters of the INT2 page-region kernel (Nsight Compute), to see where its time goes.

Runs the decode attention of ``bench_decode`` once per (shape, config) after a warm-up call; meant to
be run under ``ncu`` with a filter on the page region's kernel (``_attn_kernel`` launched first of
the two per call). ``gpu_session.sh ncu`` does that and keeps the report.

    ncu --kernel-name regex:_attn_kernel --launch-skip 2 --launch-skip-before-match 0 ... \
        python benchmarks/ncu_pages.py --shapes 32x32768 --configs '[{}]'
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_decode import HQ, int2_cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32x32768,1x131072")
    ap.add_argument("--configs", default='[{}, {"ablate": 1}, {"ablate": 4}]', help="JSON list of kernel options")
    args = ap.parse_args()
    from oscar_compile.kernels.triton_attention import attention_triton

    dev = torch.device("cuda")
    for shape in args.shapes.split(","):
        b, length = map(int, shape.split("x"))
        cache = int2_cache(b, length, dev)
        q = torch.randn(b, HQ, 1, cache.head_dim, device=dev, dtype=torch.bfloat16)
        pos = torch.full((b, 1), length - 1, device=dev, dtype=torch.long)
        lens = torch.full((b,), length, device=dev, dtype=torch.long)
        a = cache.attention_args(0, q, pos, lens)
        for cfg in json.loads(args.configs):
            attention_triton(*a, **cfg)  # compile (its launches are skipped by ncu's --launch-skip)
            torch.cuda.synchronize()
            attention_triton(*a, **cfg)  # the profiled call
            torch.cuda.synchronize()
            print(f"profiled {shape} {cfg}", flush=True)
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
