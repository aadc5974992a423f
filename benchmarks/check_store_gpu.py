"""Triton store against the reference, one line per case, saying *where* they differ (GPU or interpreter).

For each cache dtype x clip x path (a long prefill whose tokens go straight to pages; a decode loop
whose tokens reach pages by eviction from the ring) it reports: stored rows (max abs difference),
the fraction of (scale, min) and of codes that differ, and whether the Triton (scale, min) equal the
reference quantizer applied to the Triton kernel's *own* rows (isolates the quantizer from the transform).

    python benchmarks/check_store_gpu.py
"""

import torch

from oscar_compile.kernels.store import store_reference
from oscar_compile.kernels.triton_store import store_triton
from oscar_compile.quant import quantize_int2
from oscar_compile.testing import twin_caches

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SINKS, WINDOW, PAGE = 64, 256, 16


def case(dtype, clip, path, h=4, d=128, batch=2, n=700, steps=40):
    gen = torch.Generator(device=DEV).manual_seed(1)
    prefill = n if path == "prefill" else 300
    ref, got = twin_caches(h, d, batch, prefill + steps + 1, SINKS, WINDOW, PAGE, dtype=dtype, clip=clip, device=DEV)
    k, v = (torch.randn(batch, h, prefill, d, device=DEV, generator=gen).to(dtype) for _ in range(2))
    pos = torch.arange(prefill, device=DEV)
    kr, _ = store_reference(*ref.store_args(0, k, v, pos))
    kg, _ = store_triton(*got.store_args(0, k, v, pos))
    if path == "decode":
        for i in range(steps):
            p1 = torch.full((batch, 1), prefill + i, device=DEV)
            k1, v1 = (torch.randn(batch, h, 1, d, device=DEV, generator=gen).to(dtype) for _ in range(2))
            store_reference(*ref.store_args(0, k1, v1, p1))
            store_triton(*got.store_args(0, k1, v1, p1))
    lr, lg = ref.layers[0], got.layers[0]
    n_q = max(0, (prefill + (steps if path == "decode" else 0)) - SINKS - WINDOW)  # quantized tokens per row
    pages = ref.block_table[:, : -(-n_q // PAGE)].long()
    sel = lambda x: x[pages].flatten(1, 2)[:, :n_q]  # [batch, n_q, h, ...] in position order  # noqa: E731
    meta_r, meta_g = sel(lr.k_meta).float(), sel(lg.k_meta).float()
    meta_off = ~torch.isclose(meta_g, meta_r, rtol=1e-2, atol=1e-3)
    codes_off = sel(lr.k_codes) != sel(lg.k_codes)
    line = (f"{str(dtype)[6:]:<9} clip={clip:<5} {path:<8} rows maxdiff {(kg.float() - kr.float()).abs().max():.2e}  "
            f"meta differ {meta_off.float().mean():.4f}  code bytes differ {codes_off.float().mean():.4f}")
    if path == "prefill":  # pages hold positions SINKS .. n - WINDOW of the returned chunk
        rows_g = kg[:, SINKS: SINKS + n_q]  # [batch, n_q, h, d]
        _, sc, mn = quantize_int2(rows_g.float(), None, clip if clip < 1 else None, meta_dtype=lg.k_meta.dtype)
        own = torch.cat([sc, mn], -1).float()
        line += f"  vs quantizer on own rows: {(~torch.isclose(meta_g, own, rtol=1e-3, atol=1e-4)).float().mean():.4f}"
        bad = meta_off.any(-1).nonzero()
        if len(bad):
            b, t, hh = bad[0].tolist()
            line += f"\n    first bad (row {b}, token {t}, head {hh}): ref {meta_r[b, t, hh].tolist()} got {meta_g[b, t, hh].tolist()} own {own[b, t, hh].tolist()}"
    return line, float(meta_off.float().mean())


def main():
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for clip in (1.0, 0.95):
            for path in ("prefill", "decode"):
                line, off = case(dtype, clip, path)
                worst = max(worst, off)
                print(line, flush=True)
    print(f"worst meta mismatch {worst:.4f} ({'OK' if worst < 0.005 else 'MISMATCH'})")


if __name__ == "__main__":
    main()
