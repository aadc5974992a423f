"""Decode attention on the GPU: INT2 paged attention (Triton) vs BF16 scaled_dot_product_attention.

Llama-3-8B-shaped heads (32 query heads, 8 KV heads, head_dim 128), one query token per sequence,
batch x context in DESIGN.md section 6. For each shape, both methods run in the same process on
fresh random data. BF16 SDPA is timed under its default pick and under every backend that runs
(cuDNN, flash, efficient); speedups and roofline fractions are taken against the fastest of them. Time is GPU time per call as a decode step sees it under CUDA graphs (what
``mode="reduce-overhead"`` runs): a graph of (L2 flush, call) is replayed, minus a graph of the flush
alone, median of many replays. The eager time (``do_bench``, Python launch overhead included) is
reported beside it. Bytes are what each must read (KV, metadata, BF16 sinks/ring, query, output
written), achieved TB/s is bytes / time, and the roofline is bytes / 4.27 TB/s (the H200's
measured copy bandwidth).
Also: a sweep of kernel configurations per shape, and the store kernel's time per decode step.

    python benchmarks/bench_decode.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

COPY_TBPS = 4.27
SHAPES = [(1, 4096), (1, 32768), (1, 131072), (32, 8192), (64, 4096), (32, 32768)]
HQ, HKV, D = 32, 8, 128


def _bench(fn, warmup=25, rep=100) -> float:
    """Eager time (us), Python and launch overhead included."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


_FLUSH = {}


def _graph_median_us(graph, reps) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_graph(fn, reps=60) -> float:
    """GPU time (us) of ``fn`` captured in a CUDA graph, L2 flushed before it (flush time subtracted)."""
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.empty(512 * 2**20, dtype=torch.int8, device="cuda")  # 512 MiB >> 60 MiB of L2
    buf = _FLUSH["buf"]
    fn()
    torch.cuda.synchronize()
    flush_only, both = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(flush_only):
        buf.zero_()
    with torch.cuda.graph(both):
        buf.zero_()
        fn()
    for g in (flush_only, both):
        g.replay()
    torch.cuda.synchronize()
    return _graph_median_us(both, reps) - _graph_median_us(flush_only, reps)


def kernel_breakdown(fn, n=20) -> dict:
    """GPU time (us) of each kernel one call launches, from the profiler (L2 flushed before every call)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    buf = _FLUSH.setdefault("buf", torch.empty(512 * 2**20, dtype=torch.int8, device="cuda"))
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            buf.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and "elementwise" not in e.name
                      and "fill" not in e.name.lower()), key=lambda e: e.time_range.start)
    out: dict = {}
    split_launches = 0
    gluon = any(e.name == "_page_decode_kernel" for e in kernels)
    for e in kernels:  # the Triton page and BF16 launches share a kernel name: they alternate within a call
        name = e.name[:48]
        if e.name == "_page_decode_kernel":
            name = "pages (gluon)"
        elif e.name == "_attn_kernel" and gluon:
            name = "bf16_keys"
        elif e.name == "_attn_kernel":
            name = "pages" if split_launches % 2 == 0 else "bf16_keys"
            split_launches += 1
        out[name] = out.get(name, 0.0) + e.time_range.elapsed_us() / n
    return out


def _sdpa_context(backend: str):
    """``default``: what SDPA picks by itself; else only that backend."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        return contextlib.nullcontext()
    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]])


SDPA_BACKENDS = ("default", "cudnn", "flash", "efficient")


def bench_bf16_backends(q, k, v) -> dict:
    """CUDA-graph time (us) of BF16 GQA decode SDPA under each backend; NaN where a backend refuses."""
    times = {}
    for name in SDPA_BACKENDS:
        try:
            with _sdpa_context(name):
                times[name] = bench_graph(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        except Exception as e:  # e.g. no kernel of that backend for these shapes: reported, not fatal
            times[name] = float("nan")
            print(f"  SDPA {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    return times


def profile_both(q, b, length, device, int2_call, backend: str) -> dict | None:
    """Per-kernel times of BF16 SDPA (fresh K/V, the given backend) and of the INT2 call; None if the profiler fails."""
    try:
        k = torch.randn(b, HKV, length, D, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        with _sdpa_context(backend):
            sdpa = kernel_breakdown(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        del k, v
        return {"bf16_sdpa": sdpa, "int2": kernel_breakdown(int2_call)}
    except Exception as e:  # a diagnostic: never lose the timings to it
        print(f"  profile failed: {type(e).__name__}: {e}")
        return None


def fill_random_int2(cache, seed: int = 0) -> None:
    """Random codes, (scale, min) and BF16 rows in every layer of ``cache`` (timing does not depend on values;
    zeros could make it look faster than real data)."""
    g = torch.Generator(device=cache.device).manual_seed(seed)
    for layer in cache.layers:
        for codes in (layer.k_codes, layer.v_codes):
            codes.copy_(torch.randint(0, 256, codes.shape, device=cache.device, generator=g, dtype=torch.int32).to(torch.uint8))
        for meta in (layer.k_meta, layer.v_meta):
            half = meta.shape[-1] // 2  # (scales, minimums): per group of a token, or per channel of a page
            meta[..., :half].uniform_(0.01, 0.2, generator=g)
            meta[..., half:].normal_(0, 0.3, generator=g)
        for t in (layer.k_sink, layer.v_sink, layer.k_ring, layer.v_ring):
            t.normal_(generator=g)


def int2_cache(b, length, device, sinks=64, window=256, page=16, key_format="token", heads=HKV):
    from oscar_compile import LayerTransforms, PagedInt2KVCache
    from oscar_compile.testing import random_orthogonal

    cache = PagedInt2KVCache(1, heads, D, max_batch_size=b, max_seq_len=length, num_sinks=sinks, window=window,
                             page_size=page, identity_block_table=True, dtype=torch.bfloat16, device=device,
                             key_format=key_format)
    fill_random_int2(cache)
    rot = random_orthogonal(heads, D, torch.Generator().manual_seed(0))
    cache.set_transforms(0, LayerTransforms.from_matrices(rot, rot))
    return cache


def int2_bytes(b, length, sinks=64, window=256, page=16, key_format="token"):
    from oscar_compile.kernels.checks import quantized_len

    flush = page if key_format == "channel" else 1
    quantized = quantized_len(length, sinks, window, flush)  # whole pages with per-channel keys
    key_meta = 4 * D / page if key_format == "channel" else 4  # fp16 (scale, min) per channel and page, or per token
    kv = b * HKV * (quantized * (2 * (D // 4) + key_meta + 4) + (length - quantized) * 2 * D * 2)
    return int(kv) + 2 * b * HQ * D * 2  # + query read + output written


def bf16_bytes(b, length):
    return 2 * b * HKV * length * D * 2 + 2 * b * HQ * D * 2


def bench_shape(b, length, device, sweep: bool, ablations: bool = False, profile: bool = False, extra=(),
                as_model: bool = False, key_formats=("token",), channel_page: int = 32, debias: float = 0.0):
    from oscar_compile.kernels.triton_attention import attention_triton

    q = torch.randn(b, HQ, 1, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, HKV, length, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    t_backends = bench_bf16_backends(q, k, v)
    fastest = min((n for n in t_backends if not math.isnan(t_backends[n])), key=t_backends.__getitem__)
    t_sdpa = t_backends[fastest]
    del k, v
    rows = []
    for key_format in key_formats:
        page = channel_page if key_format == "channel" else 16
        r = _bench_int2(b, length, device, q, t_backends, fastest, sweep, ablations, profile, extra, as_model,
                        key_format, page, debias)
        rows.append(r)
        torch.cuda.empty_cache()
    return rows


def _bench_int2(b, length, device, q, t_backends, fastest, sweep, ablations, profile, extra, as_model, key_format,
                page, debias=0.0):
    from oscar_compile.kernels.triton_attention import attention_triton

    t_sdpa = t_backends[fastest]
    cache = int2_cache(b, length, device, page=page, key_format=key_format)
    cache.score_debias = debias
    pos = torch.full((b, 1), length - 1, device=device, dtype=torch.long)
    lens = torch.full((b,), length, device=device, dtype=torch.long)
    # as_model: what the rewritten graph of a model passes (gpt-fast, transformers' generate): a bool [1, 1, 1, L]
    # mask row, no is_causal, and the store's transformed chunk (the new token). The BF16 baseline stays unmasked
    # (its fastest case).
    attn_mask, chunk = None, None
    if as_model:
        from oscar_compile.kernels.triton_store import store_triton

        attn_mask = torch.ones(1, 1, 1, length, dtype=torch.bool, device=device)
        k_new = torch.randn(b, HKV, 1, D, device=device, dtype=torch.bfloat16)
        chunk = (*store_triton(*cache.store_args(0, k_new, torch.randn_like(k_new), pos)), pos)
    args = cache.attention_args(0, q, pos, lens, attn_mask=attn_mask, is_causal=not as_model, chunk=chunk)
    configs = [{}]
    if sweep:
        configs += [dict(block_n=bn, num_warps=w, num_stages=1) for bn in (32, 64, 128) for w in (2, 4, 8)]
        configs += [dict(page_warps=2), dict(page_warps=4)]  # the page region alone (the default picks per shape)
        configs += [dict(num_stages=2), dict(splits=0.5), dict(splits=2.0), dict(splits=4.0)]
        configs += [dict(unpack="ops")]  # shifts, masks and int->float conversions instead of the PTX unpacking
    configs += list(extra)
    if sweep or ablations:
        configs += [dict(ablate=a) for a in (1, 2, 4)]  # drop values / key dot / all but loads
    timings = []
    from oscar_compile.kernels import triton_attention

    attention_triton(*args)
    base_splits = triton_attention.LAST_LAUNCH["plan"].nsplit
    configs = [dict(cfg, splits=max(1, round(cfg["splits"] * base_splits))) if isinstance(cfg.get("splits"), float)
               else cfg for cfg in configs]
    for cfg in configs:
        try:
            attention_triton(*args, **cfg)
            timings.append((cfg, bench_graph(lambda: attention_triton(*args, **cfg))))
        except Exception as e:  # a config the compiler rejects is reported, not fatal
            timings.append((cfg, float("nan")))
            print(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
    t_int2 = timings[0][1]
    t_eager = _bench(lambda: attention_triton(*args))
    best_cfg, t_best = min((x for x in timings if not math.isnan(x[1]) and "ablate" not in x[0]), key=lambda x: x[1])
    from oscar_compile.kernels import triton_attention

    attention_triton(*args)
    kstats = {name: {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                     "shared": getattr(getattr(k, "metadata", None), "shared", None)}
              for name, k in triton_attention.LAST_LAUNCH.items() if name not in ("plan", "dense_chunk", "dense_pages")}
    nb_int2, nb_bf16 = int2_bytes(b, length, page=page, key_format=key_format), bf16_bytes(b, length)
    breakdown = profile_both(q, b, length, device, lambda: attention_triton(*args), fastest) if profile else None
    return {
        "batch": b, "context": length, "key_format": key_format, "page_size": page, "score_debias": debias,
        "bf16_sdpa_us": t_sdpa, "bf16_fastest_backend": fastest,
        "bf16_sdpa_backends_us": t_backends, "int2_us": t_int2, "int2_eager_us": t_eager, "int2_best_us": t_best,
        "int2_best_config": best_cfg, "default_splits": base_splits, "bf16_bytes": nb_bf16, "int2_bytes": nb_int2,
        "bf16_tbps": nb_bf16 / t_sdpa / 1e6, "int2_tbps": nb_int2 / t_int2 / 1e6,
        "int2_roofline_fraction": (nb_int2 / (COPY_TBPS * 1e12)) / (t_int2 * 1e-6),
        "bf16_roofline_fraction": (nb_bf16 / (COPY_TBPS * 1e12)) / (t_sdpa * 1e-6),
        "speedup": t_sdpa / t_int2, "byte_ratio": nb_bf16 / nb_int2,
        "sweep": [{"config": c, "us": t} for c, t in timings] if (sweep or ablations or extra) else None, "kernels": kstats,
        "kernel_breakdown_us": breakdown,
    }


def bench_store(device, key_formats=("token",), channel_page: int = 32):
    from oscar_compile.kernels.triton_store import store_triton

    rows = []
    for key_format in key_formats:
        page = channel_page if key_format == "channel" else 16
        # per-channel keys write a page every `page` steps: time a step that completes one and a step that does not
        # (position 3999 completes a page with 64 sinks + 256 window at pages of 16, 32 or 64)
        steps = (4000, 3999) if key_format == "channel" else (4000,)
        for b in (1, 32, 64, 93, 319):  # 93 and 319: the largest batches of a 60 GB budget at 32K and 8K
            for p in steps:
                cache = int2_cache(b, 4096, device, page=page, key_format=key_format)
                tr = cache.transforms[0]
                k = torch.randn(b, HKV, 1, D, device=device, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                pos = torch.full((b, 1), p, device=device, dtype=torch.long)
                tr.key_clip, tr.value_clip = 0.96, 0.92  # clipping on: the store's slowest path
                args = cache.store_args(0, k, v, pos)
                store_triton(*args)
                from oscar_compile.kernels import triton_store

                k = triton_store.LAST_LAUNCH["store"]
                rows.append({"batch": b, "key_format": key_format, "page_size": page, "position": p,
                             "completes_page": key_format == "channel" and (p + 1 - 64 - 256) % page == 0,
                             "store_us": bench_graph(lambda: store_triton(*args)),
                             "store_eager_us": _bench(lambda: store_triton(*args)),
                             "n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None)})
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = len({r.get("key_format", "token") for r in rows}) > 1
    labels = [f"{r['batch']}x{r['context'] // 1024}K" + (f"\n{r['key_format']}" if several else "") for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax1.bar([i - 0.2 for i in x], [r["bf16_sdpa_us"] for r in rows], 0.4, label="BF16 SDPA, fastest backend")
    ax1.bar([i + 0.2 for i in x], [r["int2_us"] for r in rows], 0.4, label="oscar INT2")
    ax1.set_yscale("log")
    for i, r in enumerate(rows):
        ax1.text(i - 0.2, r["bf16_sdpa_us"], r["bf16_fastest_backend"], ha="center", va="bottom", fontsize=7)
    ax1.set_ylabel("decode attention time (us, log)")
    ax1.set_xticks(list(x), labels)
    for i, r in enumerate(rows):
        ax1.text(i + 0.2, r["int2_us"], f"{r['speedup']:.1f}x", ha="center", va="bottom", fontsize=8)
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [r["bf16_tbps"] for r in rows], 0.4, label="BF16 SDPA (fastest)")
    ax2.bar([i + 0.2 for i in x], [r["int2_tbps"] for r in rows], 0.4, label="oscar INT2")
    ax2.axhline(COPY_TBPS, color="k", ls="--", lw=1, label="copy roofline 4.27 TB/s")
    ax2.set_ylabel("achieved TB/s (bytes each must read)")
    ax2.set_xticks(list(x), labels)
    ax2.legend()
    fig.suptitle("Decode attention on H200: 32 q heads, 8 KV heads, d=128 (batch x context)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ablations", action="store_true", help="also time variants that drop one stage")
    ap.add_argument("--shapes", default=None, help="e.g. 1x4096,32x32768")
    ap.add_argument("--name", default="decode_attention_h200", help="file stem of the JSON and plot")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time from the profiler")
    ap.add_argument("--configs", default=None, help="extra kernel configs to time, JSON list of dicts")
    ap.add_argument("--no-store", action="store_true")
    ap.add_argument("--key-formats", default="token", help="token, channel or token,channel (INT2 rows of each)")
    ap.add_argument("--channel-page", type=int, default=32, help="page size of the per-channel key rows")
    ap.add_argument("--debias", type=float, default=0.0, help="the INT2 caches' score_debias (0: off)")
    ap.add_argument("--as-model", action="store_true",
                    help="INT2 calls as a model's rewritten graph makes them: a bool mask row (not is_causal), the chunk")
    args = ap.parse_args()
    device = torch.device("cuda")
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = []
    t0 = time.time()
    key_formats = tuple(args.key_formats.split(","))
    for b, length in shapes:
        for r in bench_shape(b, length, device, args.sweep, args.ablations, args.profile,
                             json.loads(args.configs) if args.configs else (), as_model=args.as_model,
                             key_formats=key_formats, channel_page=args.channel_page, debias=args.debias):
            rows.append(r)
            _print_row(r)
        torch.cuda.empty_cache()
    store = [] if args.no_store else bench_store(device, key_formats, args.channel_page)
    for s in store:
        print(f"store kernel, {s['key_format']} keys, batch {s['batch']:>3}, one decode token per layer at {s['position']}"
              f"{' (completes a page)' if s['completes_page'] else ''}: {s['store_us']:.1f} us "
              f"(eager {s['store_eager_us']:.1f} us) "
              f"(regs {s['n_regs']}, spills {s['n_spills']})")
    _write(args, rows, store, t0)


def _print_row(r):
    b, length = r["batch"], r["context"]
    print(f"{b:>3} x {length:>6} {r['key_format']} keys: BF16 SDPA " + " ".join(f"{n} {t:.1f}" for n, t in r["bf16_sdpa_backends_us"].items())
          + f" us; fastest {r['bf16_fastest_backend']} {r['bf16_sdpa_us']:8.1f} us ({r['bf16_tbps']:.2f} TB/s) | INT2 "
          f"{r['int2_us']:8.1f} us ({r['int2_tbps']:.2f} TB/s, {100 * r['int2_roofline_fraction']:.0f}% of roofline) "
          f"| speedup {r['speedup']:.2f}x (bytes {r['byte_ratio']:.2f}x) | best {r['int2_best_us']:.1f} us "
          f"{r['int2_best_config']} | eager {r['int2_eager_us']:.1f} us | regs/spills {r['kernels']}", flush=True)
    if r["kernel_breakdown_us"]:
        print("    per kernel (us):", {k: {n: round(t, 1) for n, t in v.items()} for k, v in r["kernel_breakdown_us"].items()})
    if r["sweep"]:
        print("   ", "; ".join(f"{c['config']}: {c['us']:.0f}" for c in r["sweep"]), flush=True)


def _write(args, rows, store, t0):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tbps": COPY_TBPS,
            "heads": [HQ, HKV, D], "baseline": "fastest of BF16 SDPA default/cudnn/flash/efficient (enable_gqa), same run",
            "timing": "CUDA graph replay of (L2 flush, call) minus the flush alone, median; "
            "int2_eager_us/store_eager_us: triton.testing.do_bench median (launch overhead included)", "seconds": time.time() - t0,
            "int2_call": "as a model's graph: bool [1, 1, 1, L] mask, not causal, the store's chunk" if args.as_model
            else "is_causal, no mask, no chunk"}
    import triton

    meta["triton"] = triton.__version__
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "store": store}, indent=2))
    plot(rows, out / f"{args.name}.png")
    print(f"wrote {out / args.name}.json")


if __name__ == "__main__":
    main()
