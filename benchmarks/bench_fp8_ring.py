"""Decode attention over a retrieval head's cache (every token in the ring, ``quantize=False``): FP8 rows against
BF16 rows against BF16 SDPA, and the launch's knobs for the FP8 read.

At full depth (H100, 2026-12-07) Llama-3-8B's FP8 heads (KV head 0 of every other layer) cost 11.8 ms a decode step
at 64 x 8K: if all of it is their read, about 0.19 TB/s. This times that read alone, the way the backend calls it
(a one-head companion of ``keep_heads_exact``, the step's own token as the chunk), in CUDA graphs with L2 flushed
(``bench_decode.bench_graph``): per format and per forced split count / warps of the BF16-key launch; and the INT2 side of such a layer (7 KV
heads) against a whole INT2 layer (8), per head. ``--load f16``
swaps the attention's FP8 row decode for one in fp16 arithmetic (run it in its own process: Triton caches the
kernel with its first decode); only a revision whose BF16-key launch decodes FP8 rows with ``load_fp8_rows`` (65dba96)
takes it: this one's loops no longer call it. ``--attention-from FILE`` times another revision of ``kernels/triton_attention.py``
(e.g. ``git show REV:oscar_compile/kernels/triton_attention.py > build/attention_rev.py``, carried to the device).

    python benchmarks/bench_fp8_ring.py --shapes 64x8192,1x131072 --out benchmarks/results/bench_fp8_ring_h100.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_decode import COPY_TBPS, bench_bf16_backends, bench_graph, int2_cache
from oscar_compile import PagedInt2KVCache
from oscar_compile.kernels import triton_attention
from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.fp8_ring import encode_rows, fp8_row_bytes
from oscar_compile.kernels.triton_store import store_triton
from oscar_compile.testing import rel_error

ATTENTION = triton_attention  # the module timed (--attention-from)
GQA, D = 4, 128  # Llama-3-8B: 4 query heads a KV head, head_dim 128


@triton.jit
def load_fp8_rows_f16(row_ptr, ok, D: tl.constexpr):
    """The attention's FP8 decode in fp16 (codes exact in fp16, one rounding of the product): no fp32 tile."""
    row_ptr = tl.multiple_of(row_ptr, 4)
    codes = tl.load(row_ptr[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0)
    scale = tl.load((row_ptr + D).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float16) * scale.to(tl.float16)[:, None]
    return tl.where(ok[:, None], x, 0.0)


def revision_module(path: str, name: str = "_attention_rev"):
    """Another revision's file of ``oscar_compile/kernels`` (e.g. ``triton_attention.py``), imported inside the
    package as ``oscar_compile.kernels.<name>`` (its relative imports)."""
    import importlib.util
    import sys

    name = f"oscar_compile.kernels.{name}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # registered first: its dataclasses need it
    spec.loader.exec_module(module)
    return module


def companion(b, length, fmt, device):
    """The retrieval head's cache as the backend makes it, every ring row random (FP8 rows encoded)."""
    int2 = PagedInt2KVCache(1, 7, D, max_batch_size=b, max_seq_len=length + 8, identity_block_table=True,
                            dtype=torch.bfloat16, device=device)
    c = int2.keep_heads_exact(tuple(range(1, 8)), (0,), ring_format=fmt)
    gen = torch.Generator(device=device).manual_seed(0)
    layer = c.layers[0]
    for ring in (layer.k_ring, layer.v_ring):
        rows = torch.randn(*ring.shape[:3], D, device=device, generator=gen, dtype=torch.bfloat16)
        ring.copy_(encode_rows(rows) if fmt == "fp8" else rows)
    for sink in (layer.k_sink, layer.v_sink):
        sink.normal_(generator=gen)
    return c


def bench_int2(b, length, heads, device):
    """A decode step's INT2 attention over ``heads`` KV heads (the INT2 side of an exact-heads layer at 7)."""
    # the backend's default INT2 layer: per-channel keys in pages of 32 (with exact heads, 7 of the 8 KV heads)
    c = int2_cache(b, length + 8, device, page=32, key_format="channel", heads=heads)
    p1 = torch.full((b, 1), length - 1, device=device)
    q = torch.randn(b, heads * GQA, 1, D, device=device, dtype=torch.bfloat16)
    args = c.attention_args(0, q, p1, p1[:, 0] + 1)
    call = lambda: ATTENTION.attention_triton(*args)  # noqa: E731
    err = rel_error(call(), attention_reference(*args))
    us = bench_graph(call) if device == "cuda" else float("nan")
    return dict(batch=b, context=length, ring=f"INT2 layer, {heads} KV heads", rel_error=float(err), us=us,
                us_per_head=us / heads, page_kernel=ATTENTION.LAST_LAUNCH["plan"].page_kernel)


def bench(b, length, fmt, device, splits, warps):
    c = companion(b, length, fmt, device)
    p1 = torch.full((b, 1), length - 1, device=device)
    k1, v1 = (torch.randn(b, 1, 1, D, device=device, dtype=torch.bfloat16) for _ in range(2))
    ck, cv = store_triton(*c.store_args(0, k1, v1, p1))
    q = torch.randn(b, GQA, 1, D, device=device, dtype=torch.bfloat16)
    args = c.attention_args(0, q, p1, p1[:, 0] + 1, chunk=(ck, cv, p1))
    call = lambda: ATTENTION.attention_triton(*args, bf16_splits=splits, bf16_warps=warps)  # noqa: E731
    # the launch against the reference on this very cache (bf16 operands: 1e-2, as the Triton tests)
    err = rel_error(call(), attention_reference(*args))
    plan = ATTENTION.LAST_LAUNCH["plan"]
    us = bench_graph(call) if device == "cuda" else float("nan")
    row_bytes = fp8_row_bytes(D) if fmt == "fp8" else 2 * D
    nbytes = 2 * b * length * row_bytes + 2 * b * GQA * D * 2
    return dict(batch=b, context=length, ring=fmt, bf16_splits=splits or f"auto ({plan.nb})", bf16_warps=warps or "auto",
                rel_error=float(err), us=us, bytes=nbytes, tbps=nbytes / us / 1e6, roofline=nbytes / us / 1e6 / COPY_TBPS)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64x8192,1x131072")
    ap.add_argument("--splits", default="0,8,16,32", help="forced BF16-key splits a row (0: the launch's own)")
    ap.add_argument("--warps", default="0,8")
    ap.add_argument("--load", default="fp32", choices=["fp32", "f16"], help="the attention's FP8 row decode")
    ap.add_argument("--attention-from", default=None, help="another revision of kernels/triton_attention.py")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script (TRITON_INTERPRET=1, tiny shapes)")
    args = ap.parse_args()
    global ATTENTION
    if args.attention_from:
        ATTENTION = revision_module(args.attention_from)
    if args.load == "f16":
        ATTENTION.load_fp8_rows = load_fp8_rows_f16
    dev = args.device
    rows = []
    for shape in args.shapes.split(","):
        b, length = (int(x) for x in shape.split("x"))
        if dev == "cuda":  # every SDPA backend on the same shapes in BF16 (one KV head, GQA 4): the fastest
            kv = torch.randn(b, 1, length, D, device=dev, dtype=torch.bfloat16)
            q = torch.randn(b, GQA, 1, D, device=dev, dtype=torch.bfloat16)
            sdpa = bench_bf16_backends(q, kv, kv.clone())
            best = min((t, n) for n, t in sdpa.items() if t == t)
            del kv
            nbytes = 2 * b * length * D * 2 + 2 * b * GQA * D * 2
            rows.append(dict(batch=b, context=length, ring=f"BF16 SDPA ({best[1]})", us=best[0], bytes=nbytes,
                             tbps=nbytes / best[0] / 1e6, roofline=nbytes / best[0] / 1e6 / COPY_TBPS, sdpa=sdpa))
            print(json.dumps(rows[-1]), flush=True)
        for heads in (8, 7):  # the INT2 side of a layer with and without a retrieval head taken out
            rows.append(bench_int2(b, length, heads, dev))
            rows[-1]["attention"] = args.attention_from or "this revision"
            print(json.dumps(rows[-1]), flush=True)
        for fmt in ("bf16", "fp8"):
            grid = [(0, 0)] if fmt == "bf16" else itertools.product(
                (int(s) for s in args.splits.split(",")), (int(w) for w in args.warps.split(",")))
            for splits, warps in grid:
                try:
                    r = bench(b, length, fmt, dev, splits or None, warps or None)
                except Exception as e:  # a configuration the launch refuses: reported, not fatal
                    r = dict(batch=b, context=length, ring=fmt, bf16_splits=splits, bf16_warps=warps,
                             error=f"{type(e).__name__}: {str(e)[:200]}")
                r["load"] = args.load if fmt == "fp8" else None
                r["attention"] = args.attention_from or "this revision"
                rows.append(r)
                print(json.dumps(r), flush=True)
                if dev == "cuda":
                    torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name() if dev == "cuda" else dev, torch=torch.__version__,
                                                  triton=triton.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
