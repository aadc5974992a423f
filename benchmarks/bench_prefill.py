"""Prefill attention on the GPU: one chunk of a prompt over its prefix, INT2 (oscar) vs BF16 SDPA.

Llama-3-8B heads (32 query, 8 KV, d 128). A shape is ``batch x prefix + chunk``: ``chunk`` new query
tokens at positions ``prefix .. prefix + chunk - 1`` attend causally to the prefix and to themselves
(what a chunked prefill does). BF16: ``scaled_dot_product_attention`` over the dense prefix + chunk
under each backend that takes it (lower-right causal bias for flash / efficient when the prefix is not
empty, ``is_causal`` when it is, and the boolean mask a hand-written model passes under the default
pick); the fastest is the baseline. INT2: ``oscar::attention`` through the Triton kernels with the
chunk given exactly (``k_chunk``) and the prefix in the paged cache (sinks 64, window 256), without a
mask (``is_causal``) and with the boolean mask; and ``oscar::store`` of the chunk. Times are eager
medians (``do_bench``; a prefill launch is milliseconds, so launch overhead is noise), TFLOP/s count the
visible query-key pairs (4 d FLOPs a pair a query head).

    python benchmarks/bench_prefill.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import D, HKV, HQ, _sdpa_context, int2_cache, kernel_breakdown  # noqa: E402

SHAPES = [(32, 0, 4096), (32, 4096, 4096), (64, 4096, 4096), (1, 28672, 4096), (1, 126976, 4096)]


def _ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def visible_pairs(prefix: int, chunk: int) -> int:
    return chunk * prefix + chunk * (chunk + 1) // 2


def _try(name, fn, times):
    try:
        fn()
        times[name] = _ms(fn)
    except Exception as e:  # a backend or config that refuses the shape is reported, not fatal
        times[name] = float("nan")
        print(f"  {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def bench_bf16(b, prefix, chunk, device) -> dict:
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(b, HQ, chunk, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, HKV, prefix + chunk, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    times = {}
    for backend in ("cudnn", "flash", "efficient"):
        with _sdpa_context(backend):
            if prefix == 0:
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
            else:
                bias = causal_lower_right(chunk, prefix + chunk)
                fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)  # noqa: E731
            _try(backend, fn, times)
    mask = (torch.arange(prefix + chunk, device=device)[None, :] <= torch.arange(prefix, prefix + chunk, device=device)[:, None])
    _try("default_bool_mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True),
         times)
    return times


def bench_int2(b, prefix, chunk, device, configs, profile: bool) -> dict:
    from oscar_compile.kernels import triton_attention
    from oscar_compile.kernels.triton_store import store_triton

    length = prefix + chunk
    cache = int2_cache(b, length, device)
    q = torch.randn(b, HQ, chunk, D, device=device, dtype=torch.bfloat16)
    pos = torch.arange(prefix, length, device=device)[None].expand(b, chunk).contiguous()
    lens = torch.full((b,), length, device=device, dtype=torch.long)
    k_chunk = torch.randn(b, chunk, HKV, D, device=device, dtype=torch.bfloat16)
    v_chunk = torch.randn_like(k_chunk)
    mask = (torch.arange(length, device=device)[None, :] <= pos[0][:, None])[None, None]
    chunk_args = (k_chunk, v_chunk, pos)
    causal = cache.attention_args(0, q, pos, lens, is_causal=True, chunk=chunk_args)
    masked = cache.attention_args(0, q, pos, lens, attn_mask=mask, chunk=chunk_args)
    times = {}
    _try("causal", lambda: triton_attention.attention_triton(*causal), times)
    _try("bool_mask", lambda: triton_attention.attention_triton(*masked), times)
    triton_attention.attention_triton(*causal)
    plan = triton_attention.LAST_LAUNCH["plan"]
    for cfg in configs:
        _try(json.dumps(cfg, sort_keys=True), lambda: triton_attention.attention_triton(*causal, **cfg), times)
    k = torch.randn(b, HKV, chunk, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tr = cache.transforms[0]
    tr.key_clip, tr.value_clip = 0.96, 0.92
    _try("store", lambda: store_triton(*cache.store_args(0, k, v, pos)), times)
    out = {"times_ms": times, "tiles": -(-chunk // plan.tile_tokens),
           "plan": {k_: v_ for k_, v_ in vars(plan).items() if k_ != "gluon"}}
    if profile:
        try:
            out["kernels_us"] = kernel_breakdown(lambda: triton_attention.attention_triton(*causal), n=5)
        except Exception as e:  # a diagnostic: never lose the timings to it
            print(f"  profile failed: {type(e).__name__}: {e}")
    return out


def plot(rows, path) -> None:
    """Bars per shape: the fastest BF16 kernel, INT2 through the split launches, INT2 as run (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split = json.dumps({"gather_prefix": False})
    labels = [f"{r['batch']} x {r['prefix'] // 1024}K+{r['chunk'] // 1024}K" for r in rows]
    series = [("BF16 fastest (" + "/".join(sorted({r['bf16_fastest'] for r in rows})) + ")",
               [r["bf16_fastest_ms"] for r in rows]),
              ("INT2, split launches", [r["int2"]["times_ms"].get(split, float("nan")) for r in rows]),
              ("INT2, as run (fused where it applies)", [r["int2"]["times_ms"]["causal"] for r in rows])]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for i, (name, vals) in enumerate(series):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], vals, width, label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer call (log)")
    ax.set_title("Prefill attention of one 4096-token chunk over its prefix (H200, Llama-3-8B heads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--name", default="prefill_attention_h200")
    ap.add_argument("--shapes", default=None, help="batch x prefix + chunk, e.g. 32x4096+4096,1x28672+4096")
    ap.add_argument("--configs", default='[{"gather_prefix": false}]',
                    help="extra attention_triton options to time, JSON list of dicts")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--plot-only", default=None, help="re-plot a results JSON (no GPU needed)")
    a = ap.parse_args()
    if a.plot_only:
        plot(json.loads(Path(a.plot_only).read_text())["rows"], Path(a.plot_only).with_suffix(".png"))
        return
    shapes = SHAPES
    if a.shapes:
        shapes = []
        for s in a.shapes.split(","):
            bs, rest = s.split("x")
            p, c = rest.split("+")
            shapes.append((int(bs), int(p), int(c)))
    device = torch.device("cuda")
    rows = []
    print(f"{'shape':>18} {'BF16 fastest':>16} {'INT2 causal':>12} {'INT2 mask':>10} {'store':>8} {'INT2/BF16':>9} {'TFLOP/s':>9}")
    for b, prefix, chunk in shapes:
        bf16 = bench_bf16(b, prefix, chunk, device)
        torch.cuda.empty_cache()
        int2 = bench_int2(b, prefix, chunk, device, json.loads(a.configs), a.profile)
        torch.cuda.empty_cache()
        ok = {n: t for n, t in bf16.items() if not math.isnan(t)}
        fastest = min(ok, key=ok.get) if ok else None
        flops = 4 * D * HQ * b * visible_pairs(prefix, chunk)
        t_int2 = int2["times_ms"].get("causal", float("nan"))
        row = {"batch": b, "prefix": prefix, "chunk": chunk, "bf16_ms": bf16, "bf16_fastest": fastest,
               "bf16_fastest_ms": ok.get(fastest, float("nan")), "int2": int2, "flops": flops,
               "int2_tflops": flops / t_int2 / 1e9, "bf16_tflops": flops / ok.get(fastest, float("nan")) / 1e9,
               "int2_over_bf16": t_int2 / ok.get(fastest, float("nan"))}
        rows.append(row)
        print(f"{b:>4}x{prefix:>6}+{chunk:<6} {fastest or '-':>9} {row['bf16_fastest_ms']:6.2f} {t_int2:12.2f} "
              f"{int2['times_ms'].get('bool_mask', float('nan')):10.2f} {int2['times_ms'].get('store', float('nan')):8.2f} "
              f"{row['int2_over_bf16']:9.2f} {row['int2_tflops']:9.0f}")
        if "kernels_us" in int2:
            print("     kernels (us):", {k: round(v) for k, v in int2["kernels_us"].items()})
        extra = {k: round(v, 2) for k, v in int2["times_ms"].items() if k.startswith("{")}
        if extra:
            print("     configs (ms):", extra)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (out / f"{a.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out / f"{a.name}.png")


if __name__ == "__main__":
    main()
