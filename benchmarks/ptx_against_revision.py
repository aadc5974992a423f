"""Whether the default launches (16-bit rings) compile to the same sm_90 code as at another revision, without a GPU.

Compiles the attention launches (INT2 pages; BF16 keys: sinks, ring, chunk), the per-channel page flush and the ring
launch, decode and prefill, at d = 64, 128 and 256, of this revision and of
another one's ``triton_attention.py`` / ``triton_store.py``, then compares their PTX with registers renumbered and
debug info dropped. ``same`` means the code that ran on the GPU at that revision is the code now.

    git show 65dba96:oscar_compile/kernels/triton_attention.py > build/attention_65dba96.py
    git show 65dba96:oscar_compile/kernels/triton_store.py > build/store_65dba96.py
    PYTHONPATH=$PWD python3 benchmarks/ptx_against_revision.py build/attention_65dba96.py build/store_65dba96.py

2026-12-07: all 27 are the same as at 65dba96 (the revision of the last H100 runs), once
the page flush's and the ring launch's 16-bit branches were written as they were there.
"""

from __future__ import annotations

import argparse
import re

import triton.language as tl
from bench_fp8_ring import revision_module

from oscar_compile.kernels import sm90, triton_attention, triton_store


def normalised_ptx(kernel) -> list[str]:
    """PTX lines without the debug sections, locations and comments, every register named ``%R``."""
    text = kernel.asm["ptx"].split(".section")[0]
    text = re.sub(r"%[a-z]+[0-9]+", "%R", text)
    text = re.sub(r"_(attn|flush_pages|ring)_kernel", "K", text)
    return [line for line in text.splitlines() if line.strip() and not line.strip().startswith((".loc", ".file", "//", "$L__"))]


def with_ring_fp8_off(fn, constexprs: dict) -> dict:
    return dict(constexprs, RING_FP8=False) if "RING_FP8" in fn.arg_names else constexprs


def attention(d, **kw):  # sm90.compile_attention's constants: BF16-key launch (region 1) or INT2 pages (region 0)
    prefill = kw.get("prefill", False)
    const = dict(H=8, G=4, D=d, NG=1, PS=32, HAS_RING=True, KCH=kw.get("kch", True), DEBIAS=False,
                 BLOCK_M=kw.get("block_m", 16), BLOCK_N=kw.get("block_n", 64), IS_CAUSAL=prefill, MASK_KIND=kw.get("mask_kind", 0), HAS_CHUNK=prefill, DT=tl.float16,
                 KC=min(d, 64), ALIGNED=True, ABLATE=0, USE_ASM=True, REGION=kw.get("region", 1), FRAG=True, DENSE_CHUNK=prefill,
                 CDT=tl.bfloat16 if prefill else tl.float16, MASK_BOUNDS=kw.get("mask_bounds", False), KFOLD=True)
    return lambda fn: sm90.compile_sm90(fn, with_ring_fp8_off(fn, const), sm90.ATTENTION_POINTERS, 4, 2)


def page_flush(d):  # sm90.compile_store_pages's
    const = dict(PS=32, D=d, NG=1, V_CLIP=True, FRAG=True, HAS_TMAP=True, K_RANGE=True, FEEDBACK=False, fb_ptr=None)
    return lambda fn: sm90.compile_sm90(fn, with_ring_fp8_off(fn, const), dict(sm90.STORE_POINTERS, fb_ptr="*fp32"),
                                        8 if d * 32 >= 8192 else 4)


def ring_launch(d):  # sm90.compile_store_ring's
    return lambda fn: sm90.compile_sm90(fn, with_ring_fp8_off(fn, dict(PS=32, BLOCK_T=16, D=d)), sm90.STORE_POINTERS, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("attention_file", help="another revision's kernels/triton_attention.py")
    ap.add_argument("store_file", help="another revision's kernels/triton_store.py")
    args = ap.parse_args()
    old_attention = revision_module(args.attention_file, "_attention_rev")
    old_store = revision_module(args.store_file, "_store_rev")
    cases = []
    for d in (64, 128, 256):
        cases += [(f"d={d} attention, BF16 keys {kw or ''}", attention(d, **kw), "_attn_kernel", old_attention,
                   triton_attention)
                  for kw in ({}, {"kch": False}, {"mask_kind": 1, "mask_bounds": True}, {"prefill": True},
                             {"prefill": True, "mask_kind": 1})]
        cases += [(f"d={d} attention, INT2 pages {kw}", attention(d, region=0, **kw), "_attn_kernel", old_attention,
                   triton_attention)
                  for kw in ({"block_n": 128 if d <= 128 else 64}, {"prefill": True, "block_m": 32, "block_n": 32})]
        cases += [(f"d={d} page flush, per-channel keys", page_flush(d), "_flush_pages_kernel", old_store, triton_store),
                  (f"d={d} ring launch, per-channel keys", ring_launch(d), "_ring_kernel", old_store, triton_store)]
    for label, compile_fn, name, old, new in cases:
        now, then = normalised_ptx(compile_fn(getattr(new, name))), normalised_ptx(compile_fn(getattr(old, name)))
        print(f"{'same' if now == then else 'DIFF'}  {label}: {len(now)} / {len(then)} lines", flush=True)


if __name__ == "__main__":
    main()
