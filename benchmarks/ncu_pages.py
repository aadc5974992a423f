"""Hardware counters of the INT2 page-region kernel (Nsight Compute), to see where its time goes.

Calls the decode attention of ``bench_decode`` twice per (shape, config): a compile/warm-up call, then
the profiled one. Each call launches ``_attn_kernel`` twice (page region, then BF16 keys), so under
``ncu --kernel-name _attn_kernel --launch-skip 2 --launch-count 1`` with one config per process the
profiled kernel is the second call's page region. ``gpu_session.sh ncu`` (summary counters) and
``ncusrc`` (per-SASS-instruction report; ``ncu_summary.py`` condenses it) run it that way.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_decode import HQ, int2_cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32x32768", help="one shape per process under ncu (see above)")
    ap.add_argument("--configs", default="[{}]", help="JSON list of kernel options (one per process under ncu)")
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
