"""What error-feedback rounding of per-channel keys costs the Triton store (GPU).

The flush launch rounds a page's keys channel after channel (a loop of ``d`` steps over the page's tokens) instead of
all at once. Timed with and without it, Llama-3-8B's KV shape (8 KV heads of 128; Gemma 3's 1 of 256 with ``--d
256 --heads 1``), pages of 32, bf16 cache:

* a prefill chunk of ``--chunk`` tokens for each of ``--batch`` rows (its pages all flushed in that call);
* a decode step of ``--batch`` rows that all complete a page (the worst step: every row flushes), and the mean over
  the 32 steps of a page (one of which flushes).

    python benchmarks/bench_key_feedback.py --batch 64 --chunk 4096 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from oscar_compile.cache import PagedInt2KVCache
from oscar_compile.kernels.triton_store import store_triton
from oscar_compile.quant import feedback_factor
from oscar_compile.testing import anisotropic_moment, random_transforms


def cache_for(h, d, batch, max_len, feedback):
    c = PagedInt2KVCache(1, h, d, max_batch_size=batch, max_seq_len=max_len, num_sinks=64, window=256, page_size=32,
                         key_format="channel", dtype=torch.bfloat16, device="cuda")
    tr = random_transforms(h, d, "orthogonal", torch.Generator().manual_seed(0), clip=0.9)
    if feedback:
        tr = replace(tr, key_feedback=feedback_factor(anisotropic_moment(h, d, torch.Generator().manual_seed(1))))
    c.set_transforms(0, tr)
    for r in range(batch):
        c.allocate(r, max_len)
    return c


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    h, d, b = a.heads, a.d, a.batch
    max_len = a.chunk + 64
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(b, h, a.chunk, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    k1, v1 = (torch.randn(b, h, 1, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    for feedback in (False, True):
        c = cache_for(h, d, b, max_len, feedback)
        pos = torch.arange(a.chunk, device="cuda")
        prefill_us = timed(lambda: store_triton(*c.store_args(0, k, v, pos)), reps=5)
        steps = []
        for p in range(a.chunk, a.chunk + 32):  # one page's worth of decode positions: exactly one flushes
            p1 = torch.full((b, 1), p, device="cuda")
            steps.append(timed(lambda: store_triton(*c.store_args(0, k1, v1, p1))))
        row = {"feedback": feedback, "batch": b, "kv_heads": h, "head_dim": d, "chunk": a.chunk,
               "prefill_chunk_us": round(prefill_us, 1), "decode_step_flushing_us": round(max(steps), 1),
               "decode_step_mean_us": round(sum(steps) / len(steps), 1),
               "decode_step_median_us": round(sorted(steps)[len(steps) // 2], 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
