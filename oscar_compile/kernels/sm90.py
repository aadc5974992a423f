"""Compile the Triton kernels for sm_90 on a machine without a GPU (Triton's bundled ``ptxas``).

The interpreter never runs the GPU compiler, and the GPU compiler has rejected variants the interpreter
accepts (Triton 3.6 on the H200: an "Illegal shared layout" for d = 64 with 64 query rows, an assertion
on a loop-carried reduction over a 3-D tile). Compiling every launch variant here catches that class
of failure in CI, and gives registers and spills for comparing variants (``benchmarks/kernel_resources.py``).

Arguments are specialised the way a launch specialises them: pointers and strides divisible by 16
(the compiler vectorises, and picks layouts, from that), runtime sizes not.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

# Integer arguments taken as not divisible by 16: those a kernel declares ``do_not_specialize`` (read from
# the kernel) and these, rarely multiples of 16 at a launch; every other one (strides) is taken as one.
NOT_DIVISIBLE = {"sc_s", "sm_s", "sm_h", "MAX_PAGES", "NH"}
FLOATS = {"qk_scale", "kclip_frac", "vclip_frac", "kratio", "debias"}

ATTENTION_POINTERS = {
    "qq_ptr": "*fp16", "pos_ptr": "*i64", "len_ptr": "*i64", "c0_ptr": "*i64", "cend_ptr": "*i64",
    "kch_ptr": "*bf16", "vch_ptr": "*bf16", "kc_ptr": "*i32", "km_ptr": "*fp16", "vc_ptr": "*i32", "vm_ptr": "*fp16",
    "ks_ptr": "*bf16", "vs_ptr": "*bf16", "kr_ptr": "*bf16", "vr_ptr": "*bf16", "bt_ptr": "*i32", "mask_ptr": "*bf16",
    "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_o_ptr": "*fp32", "mb_ptr": "*i32",
    # merge / query kernels
    "bo_ptr": "*fp32", "muv_ptr": "*fp32", "out_ptr": "*bf16", "q_ptr": "*bf16", "bq_ptr": "*fp32", "mrow_ptr": "*u8",
}
FP8_RING_POINTERS = {"kr_ptr": "*u8", "vr_ptr": "*u8"}  # an FP8 ring: rows of codes and a scale (fp8_ring.py)
STORE_POINTERS = {
    "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "first_ptr": "*i64", "last_ptr": "*i64",
    "ak_ptr": "*fp32", "muk_ptr": "*fp32", "av_ptr": "*fp32", "muv_ptr": "*fp32", "kout_ptr": "*bf16",
    "vout_ptr": "*bf16", "kc_ptr": "*u8", "km_ptr": "*fp16", "vc_ptr": "*u8", "vm_ptr": "*fp16", "ks_ptr": "*bf16",
    "vs_ptr": "*bf16", "kr_ptr": "*bf16", "vr_ptr": "*bf16", "bt_ptr": "*i32", "tmap_ptr": "*i32",
}


def compile_sm90(fn, constexprs: dict, pointers: dict, num_warps: int = 4, num_stages: int = 2, maxnreg=None,
                 divisible=None):
    """``fn`` (a ``@triton.jit`` or ``@gluon.jit`` kernel) compiled for sm_90; raises what the compiler raises.

    ``divisible``: the integer arguments taken as multiples of 16 (default: every one but
    :data:`NOT_DIVISIBLE` and those the kernel declares ``do_not_specialize``)."""
    names = fn.arg_names
    unspecialised = {p.name for p in getattr(fn, "params", []) if p.do_not_specialize} | NOT_DIVISIBLE
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in pointers:
            sig[n] = pointers[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in FLOATS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if (n in divisible) if divisible is not None else (n not in unspecialised):
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {(names.index(k),): v for k, v in constexprs.items()}
    if type(fn).__module__.startswith("triton.experimental.gluon"):
        from triton.experimental import gluon

        src = gluon._runtime.GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    else:
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_attention(d=128, g=4, block_m=16, block_n=128, region=0, prefill=False, unpack="asm", ablate=0,
                      num_warps=4, num_stages=2, ng=1, mask_kind=0, maxnreg=None, causal=None, frag=True,
                      mask_bounds=False, kch=False, ps=16, debias=False, kfold=True, ring_fp8=False):
    from .triton_attention import _attn_kernel

    const = dict(H=8, G=g, D=d, NG=ng, PS=ps, HAS_RING=True, KCH=kch, DEBIAS=debias, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=prefill if causal is None else causal,
                 MASK_KIND=mask_kind, HAS_CHUNK=prefill, DT=tl.float16, KC=min(d, 64), ALIGNED=True, ABLATE=ablate,
                 USE_ASM=unpack == "asm", REGION=region, FRAG=frag and d % 64 == 0, DENSE_CHUNK=prefill,
                 CDT=tl.bfloat16 if prefill else tl.float16, MASK_BOUNDS=mask_bounds, KFOLD=kfold, RING_FP8=ring_fp8)
    pointers = dict(ATTENTION_POINTERS, **(FP8_RING_POINTERS if ring_fp8 else {}))
    return compile_sm90(_attn_kernel, const, pointers, num_warps, num_stages, maxnreg)


def compile_prefill(d=128, g=4, block_m=64, mask_kind=0, causal=True, rows="*bf16", num_warps=4, tiles=0):
    """The fused prefill launch (gathered prefix + chunk) of :mod:`.triton_attention`; ``tiles``: which row blocks
    it takes (0 all; 1 interval rows, 2 the others, the two launches of a bool mask)."""
    import triton.language as tl

    from .triton_attention import _prefill_kernel

    const = dict(H=8, G=g, D=d, BLOCK_M=block_m, BLOCK_N=64, IS_CAUSAL=causal, MASK_KIND=mask_kind, HAS_CHUNK=True,
                 CDT=tl.bfloat16 if rows == "*bf16" else tl.float16, MASK_I32=mask_kind == 1, TILES=tiles)
    pointers = dict(ATTENTION_POINTERS, kp_ptr=rows, vp_ptr=rows, kch_ptr=rows, vch_ptr=rows, flag_ptr="*i32",
                    mask_ptr={1: "*u8", 3: "*i32"}.get(mask_kind, "*bf16"))
    return compile_sm90(_prefill_kernel, const, pointers, num_warps)


def compile_gather(d=128, ng=1, frag=True, kch=False, ring_fp8=False):
    from .triton_attention import _gather_prefix_kernel

    return compile_sm90(_gather_prefix_kernel, dict(H=8, D=d, NG=ng, PS=16, BLOCK_N=32, HAS_CHUNK=True, ALIGNED=True,
                                                    FRAG=frag and d % 64 == 0, KCH=kch, RING_FP8=ring_fp8),
                        dict(ATTENTION_POINTERS, ko_ptr="*bf16", vo_ptr="*bf16",
                             **(FP8_RING_POINTERS if ring_fp8 else {})), 4)


def compile_merge(d=128, g=4, decode=False):
    from .triton_attention import _merge_kernel

    return compile_sm90(_merge_kernel, dict(H=8, G=g, D=d, BLOCK_M=16, KC=min(d, 32),
                                            SB=max(1, (1024 if decode else 512) // d)),
                        ATTENTION_POINTERS, num_warps=8 if decode else 4, num_stages=3)


def compile_query(d=128, g=4, block_m=16):
    from .triton_attention import _query_kernel

    # the decode launch also finds a bool mask row's bounds (8 KB steps)
    return compile_sm90(_query_kernel, dict(H=8, G=g, D=d, BLOCK_M=block_m, KC=min(d, 64), MASK_BLOCK=8192),
                        ATTENTION_POINTERS, num_stages=3)


def compile_store(d=128, ng=1, clip=True, frag=True, chunk_only=False, ring_fp8=False):
    from .triton_store import _store_kernel

    return compile_sm90(_store_kernel, dict(PS=16, BLOCK_T=16, D=d, NG=ng, K_CLIP=clip, V_CLIP=clip, HAS_RING=True,
                                            FRAG=frag and d % 64 == 0, CHUNK_ONLY=chunk_only, RING_FP8=ring_fp8),
                        dict(STORE_POINTERS, **(FP8_RING_POINTERS if ring_fp8 else {})),
                        num_warps=8 if d >= 256 else 4, num_stages=3)


def compile_store_pages(d=128, ps=32, clip=True, tmap=True, feedback=False, ring_fp8=False):
    """Per-channel keys: the page flush (a chunk, or a decode step without the chunk map) and the ring write that
    follow the store's chunk launch. ``clip``: values clipped and keys' page ranges narrowed (key_page_clip).
    ``feedback``: keys rounded with error feedback (key_feedback)."""
    from .triton_store import _flush_pages_kernel

    const = dict(PS=ps, D=d, NG=1, V_CLIP=clip, FRAG=True, HAS_TMAP=tmap, K_RANGE=clip, FEEDBACK=feedback,
                 RING_FP8=ring_fp8)
    if not feedback:
        const["fb_ptr"] = None  # as the launch passes it
    return compile_sm90(_flush_pages_kernel, const,
                        dict(STORE_POINTERS, fb_ptr="*fp32", **(FP8_RING_POINTERS if ring_fp8 else {})),
                        num_warps=8 if d * ps >= 8192 else 4)


def compile_store_ring(d=128, ps=32, ring_fp8=False):
    from .triton_store import _ring_kernel

    return compile_sm90(_ring_kernel, dict(PS=ps, BLOCK_T=16, D=d, RING_FP8=ring_fp8),
                        dict(STORE_POINTERS, **(FP8_RING_POINTERS if ring_fp8 else {})), num_warps=4)


def compile_gluon_decode(d=128, g=4, mask_kind=1, causal=True, num_warps=None, tiles=None, subnormal=True,
                         stages=None, wide=False, mask_heads=True, mask_bounds=False, kch=False, ps=16):
    """The Gluon decode kernel of the page region (:mod:`.gluon_decode`) for sm_90."""
    from . import triton_attention as ta
    from .gluon_decode import _page_decode_kernel

    cfg = ta.GLUON or ta.GLUON_WIDE
    num_warps, tiles, stages = num_warps or cfg.warps, tiles or cfg.tiles, stages or cfg.stages
    const = dict(H=8, G=g, D=d, PS=ps, NW=num_warps, NT=tiles, HAS_CHUNK=True, MASK_KIND=mask_kind, IS_CAUSAL=causal,
                 SUBNORMAL=subnormal, WIDE=wide, STAGES=stages, MASK_HEADS=mask_heads,
                 MASK_BOUNDS=mask_bounds, KCH=kch)
    # metadata as (scale|min) words; per-channel keys (kch): the keys' fp16 page rows
    pointers = dict(ATTENTION_POINTERS, km_ptr="*fp16" if kch else "*i32", vm_ptr="*i32", mask_ptr="*u8",
                    mb_ptr="*i32")
    return compile_sm90(_page_decode_kernel, const, pointers, num_warps, divisible={"sc_p", "sc_s", "sm_p", "sbt_b"})


def launch_variants(d: int) -> dict:
    """What :func:`attention_triton` and :func:`store_triton` launch for head_dim ``d`` (name -> thunk)."""
    bn_pages = 64 if d > 128 else 128
    return {
        f"decode pages d={d}": lambda: compile_attention(d=d, block_m=16, block_n=bn_pages, region=0),
        f"decode bf16 keys d={d}": lambda: compile_attention(d=d, block_m=16, block_n=64, region=1),
        f"prefill pages d={d}": lambda: compile_attention(d=d, block_m=32, block_n=bn_pages, region=0, prefill=True),
        f"prefill bf16 keys d={d}": lambda: compile_attention(d=d, block_m=64, block_n=64, region=1, prefill=True),
        f"prefill fused d={d}": lambda: compile_prefill(d=d),
        f"prefill gather d={d}": lambda: compile_gather(d=d),
        f"prefill chunk launch d={d}": lambda: compile_attention(d=d, block_m=64, block_n=64, region=2, prefill=True),
        f"merge d={d}": lambda: compile_merge(d=d),
        f"merge decode d={d}": lambda: compile_merge(d=d, decode=True),
        f"query d={d}": lambda: compile_query(d=d, block_m=16),
        f"query prefill d={d}": lambda: compile_query(d=d, block_m=64),
        f"store d={d}": lambda: compile_store(d=d, clip=True),
        # retrieval heads in FP8 (exact_format="fp8"): their ring's rows in FP8 with a scale each
        f"decode bf16 keys, FP8 ring d={d}": lambda: compile_attention(d=d, block_m=16, block_n=64, region=1,
                                                                        ring_fp8=True),
        f"prefill bf16 keys, FP8 ring d={d}": lambda: compile_attention(d=d, block_m=64, block_n=64, region=1,
                                                                         prefill=True, ring_fp8=True),
        f"prefill gather, FP8 ring d={d}": lambda: compile_gather(d=d, ring_fp8=True),
        f"store, FP8 ring d={d}": lambda: compile_store(d=d, clip=True, ring_fp8=True),
        # per-channel keys (key_format="channel", pages of 32): page region, gather, the store's three launches
        f"decode pages, per-channel keys d={d}": lambda: compile_attention(d=d, block_m=16, block_n=bn_pages, region=0,
                                                                            kch=True, ps=32),
        f"prefill pages, per-channel keys d={d}": lambda: compile_attention(d=d, block_m=32, block_n=32, region=0,
                                                                             prefill=True, kch=True, ps=32),
        f"prefill gather, per-channel keys d={d}": lambda: compile_gather(d=d, kch=True),
        f"store chunk, per-channel keys d={d}": lambda: compile_store(d=d, chunk_only=True),
        f"store pages, per-channel keys d={d}": lambda: compile_store_pages(d=d),
        f"store pages of a decode step, per-channel keys d={d}": lambda: compile_store_pages(d=d, tmap=False),
        f"store pages with error feedback, per-channel keys d={d}": lambda: compile_store_pages(d=d, feedback=True),
        f"store ring, per-channel keys d={d}": lambda: compile_store_ring(d=d),
        # per-channel keys with the ring in FP8 (ring_format="fp8")
        f"store pages, per-channel keys, FP8 ring d={d}": lambda: compile_store_pages(d=d, ring_fp8=True),
        f"store ring, per-channel keys, FP8 ring d={d}": lambda: compile_store_ring(d=d, ring_fp8=True),
        f"decode bf16 keys, per-channel keys, FP8 ring d={d}": lambda: compile_attention(
            d=d, block_m=16, block_n=64, region=1, kch=True, ps=32, ring_fp8=True),
        f"prefill gather, per-channel keys, FP8 ring d={d}": lambda: compile_gather(d=d, kch=True, ring_fp8=True),
        f"gluon decode d={d}": lambda: compile_gluon_decode(d=d),
        **({"gluon decode d=128, no mask, G=8": lambda: compile_gluon_decode(d=128, g=8, mask_kind=0, causal=False),
            "gluon decode d=128, 2 tiles": lambda: compile_gluon_decode(d=128, tiles=2),
            "gluon decode d=128, one mask row for all heads": lambda: compile_gluon_decode(d=128, mask_heads=False),
            "gluon decode d=128, one mask row with bounds": lambda: compile_gluon_decode(d=128, mask_heads=False,
                                                                                        mask_bounds=True),
            "gluon decode d=128, 4 warps (narrow)": lambda: compile_gluon_decode(d=128, num_warps=4, stages=1),
            "gluon decode d=128, int64 page offsets": lambda: compile_gluon_decode(d=128, wide=True),
            "gluon decode d=128, per-channel keys (pages of 32)": lambda: compile_gluon_decode(d=128, kch=True, ps=32),
            "gluon decode d=128, per-channel keys, 4 warps (narrow)": lambda: compile_gluon_decode(
                d=128, kch=True, ps=32, num_warps=4, tiles=1, stages=1),
            "gluon decode d=128, per-channel keys, mask bounds": lambda: compile_gluon_decode(
                d=128, kch=True, ps=32, mask_heads=False, mask_bounds=True)}
           if d == 128 else {}),
    }


def extra_variants() -> dict:
    return {
        "pages, bool mask": lambda: compile_attention(d=64, block_m=32, region=0, prefill=True, mask_kind=1),
        "decode bf16 keys, bool mask row with bounds": lambda: compile_attention(
            d=128, block_m=16, block_n=64, region=1, mask_kind=1, causal=True, mask_bounds=True),
        "decode bf16 keys, bool mask row with bounds, not causal": lambda: compile_attention(
            d=128, block_m=16, block_n=64, region=1, mask_kind=1, causal=False, mask_bounds=True),  # transformers
        "bf16 keys, additive mask": lambda: compile_attention(d=128, block_m=16, block_n=64, region=1, mask_kind=2),
        "prefill bf16 keys, bool mask": lambda: compile_attention(d=128, block_m=64, block_n=64, region=1, prefill=True,
                                                                  mask_kind=1, causal=False),  # transformers' prefill
        "prefill fused, bool mask": lambda: compile_prefill(d=128, mask_kind=1, causal=False),
        "prefill fused, bool mask rows not intervals": lambda: compile_prefill(d=128, mask_kind=1, causal=False,
                                                                                tiles=2),
        "prefill fused, fp16 rows": lambda: compile_prefill(d=128, rows="*fp16"),
        "prefill fused, interval mask": lambda: compile_prefill(d=128, mask_kind=3, causal=False, tiles=1),
        "prefill gather, 2 groups": lambda: compile_gather(d=128, ng=2),
        "pages, 2 groups": lambda: compile_attention(d=128, block_m=16, region=0, ng=2),
        "pages, 2 warps": lambda: compile_attention(d=128, block_m=16, region=0, num_warps=2),
        "store, 2 groups, no clip": lambda: compile_store(d=128, ng=2, clip=False),
        "store, logical order": lambda: compile_store(d=128, frag=False),
        "decode pages, debiased scores": lambda: compile_attention(d=128, block_m=16, region=0, debias=True),
        "decode pages, 2 groups, debiased scores": lambda: compile_attention(d=128, block_m=16, region=0, ng=2,
                                                                              debias=True),
        "decode pages, per-channel keys, debiased scores": lambda: compile_attention(
            d=128, block_m=16, block_n=128, region=0, kch=True, ps=32, debias=True),
        "decode pages, per-channel keys, dequantized (no fold)": lambda: compile_attention(
            d=128, block_m=16, block_n=128, region=0, kch=True, ps=32, kfold=False),
        "decode pages, per-channel keys, dequantized, debiased": lambda: compile_attention(
            d=128, block_m=16, block_n=64, region=0, kch=True, ps=32, kfold=False, debias=True),
        "decode pages, per-channel keys, one page a block": lambda: compile_attention(
            d=128, block_m=16, block_n=32, region=0, kch=True, ps=32),
        "decode pages, per-channel keys, pages of 16": lambda: compile_attention(
            d=128, block_m=16, block_n=128, region=0, kch=True, ps=16),
        "pages, logical order": lambda: compile_attention(d=128, block_m=16, region=0, frag=False),
    }


def main(argv=None) -> int:
    """``python -m oscar_compile.kernels.sm90 [d ...]``: compile every variant, one line each; exit 1 on a failure."""
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels the compiler needs", file=sys.stderr)
        return 2
    dims = [int(x) for x in (argv if argv is not None else sys.argv[1:])] or [64, 128, 256]
    variants = {}
    for d in dims:
        variants.update(launch_variants(d))
    if 128 in dims:
        variants.update(extra_variants())
    failed = 0
    for name, build in variants.items():
        try:
            k = build()
            print(f"ok      {name}: {k.metadata.shared} B shared", flush=True)
        except Exception as e:  # report every failing variant, not just the first
            failed += 1
            print(f"FAILED  {name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
