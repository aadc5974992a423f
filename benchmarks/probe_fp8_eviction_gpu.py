"""Where the FP8 ring's eviction into INT2 pages goes wrong on the GPU (2026-12-07: NaN on an H100, not in the
interpreter). ``PagedInt2KVCache`` refuses ``ring_format="fp8"`` with ``quantize=True`` until this is understood, so
the probe builds INT2 caches with BF16 rings and swaps in FP8 rings (the ops take them: ``checks.check_cache``).

It replays the decode test ``test_fp8_ring.py`` ran on the H100 with ``quantize=True`` (same sizes and random
draws: 2 rows of 19 and 7 tokens, padding, 3 sinks, a window of 6, pages of 4, 3 decode steps) with the reference store on one cache and the Triton store on its twin, and after every launch
prints which cache tensors hold non-finite values (and where), which differ between the twins, whether the attention
changed the cache, and which output rows are NaN. ``--dtype bfloat16`` repeats it in the model's dtype.

    python benchmarks/probe_fp8_eviction_gpu.py [--dtype float32|bfloat16]

``gpu_fp8_eviction_check.sh`` runs it before and after ``fp8_integer_decode.patch`` (a candidate fix, not yet run on
a GPU: e4m3 decoded by integer arithmetic instead of Triton's fp8 conversion).
"""

from __future__ import annotations

import argparse

import torch

from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.fp8_ring import decode_rows, fp8_row_bytes
from oscar_compile.kernels.store import store_reference
from oscar_compile.kernels.triton_attention import attention_triton
from oscar_compile.kernels.triton_store import store_triton
from oscar_compile.testing import twin_caches

NAMES = ("k_codes", "k_meta", "v_codes", "v_meta", "k_sink", "v_sink", "k_ring", "v_ring")


def fp8_twins(h, d, b, max_len, s, w, ps, dtype, seed, device):
    ref, got = twin_caches(h, d, b, max_len, s, w, ps, dtype=dtype, seed=seed, device=device, quantize=True)
    for c in (ref, got):
        layer = c.layers[0]
        shape = layer.k_ring.shape[:3] + (fp8_row_bytes(d),)
        layer.k_ring = torch.zeros(shape, dtype=torch.uint8, device=device)
        layer.v_ring = torch.zeros(shape, dtype=torch.uint8, device=device)
    return ref, got


def as_float(name, t):
    return decode_rows(t) if name.endswith("ring") else t.float()


def report(tag, cache):
    bad = []
    for name, t in zip(NAMES, cache.layers[0].tensors()):
        nonfinite = ~torch.isfinite(as_float(name, t))
        if nonfinite.any():
            bad.append(f"{name}: {int(nonfinite.sum())} non-finite, first at {nonfinite.nonzero()[:4].tolist()}")
    print(f"{tag}: {'; '.join(bad) or 'all finite'}")


def differ(ref, got):
    out = []
    for name, a, b in zip(NAMES, ref.layers[0].tensors(), got.layers[0].tensors()):
        gap = (as_float(name, a) - as_float(name, b)).abs().nan_to_num(1e9)
        if gap.max() > 0.1:
            out.append(f"{name} (max {float(gap.max()):.3g} at {gap.gt(0.1).nonzero()[:3].tolist()})")
    return ", ".join(out) or "none"


def nan_rows(out):
    """The first (row, head, query) indices whose output holds a NaN."""
    return out.isnan().any(-1).nonzero().tolist()[:4]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    h, gqa, d, s, w, ps = 2, 2, 64, 3, 6, 4
    lengths, steps = (19, 7), 3
    gen = torch.Generator().manual_seed(1)
    b, t, max_len = len(lengths), max(lengths), max(lengths) + steps + 1
    ref, got = fp8_twins(h, d, b, max_len, s, w, ps, dtype, 2, dev)
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in lengths]).to(dev)
    k, v = (torch.randn(b, h, t, d, generator=gen).to(dev, dtype) * 3 for _ in range(2))
    ck, cv = store_reference(*ref.store_args(0, k, v, pos))
    store_triton(*got.store_args(0, k, v, pos))
    report("prefill, reference store", ref)
    report("prefill, Triton store", got)
    print("  differ:", differ(ref, got))
    # the test drew its prefill queries here: the same draw keeps every decode step's inputs the failing run's
    q = torch.randn(b, h * gqa, t, d, generator=gen).to(dev, dtype)
    for name, cache in (("reference", ref), ("Triton", got)):  # the test read only the reference store's cache
        a = cache.attention_args(0, q, pos, pos.amax(-1) + 1, None, True, chunk=(ck, cv, pos))
        print(f"  prefill attention over the {name} store's cache: NaN rows Triton "
              f"{nan_rows(attention_triton(*a))}, reference {nan_rows(attention_reference(*a))}")
    lens = list(lengths)
    for step in range(steps):
        p1 = torch.tensor(lens, device=dev)[:, None]
        k1, v1 = (torch.randn(b, h, 1, d, generator=gen).to(dev, dtype) for _ in range(2))
        ck1, cv1 = store_reference(*ref.store_args(0, k1, v1, p1))
        store_triton(*got.store_args(0, k1, v1, p1))
        report(f"step {step}, reference store", ref)
        report(f"step {step}, Triton store", got)
        print("  differ:", differ(ref, got))
        q1 = torch.randn(b, h * gqa, 1, d, generator=gen).to(dev, dtype)
        a = got.attention_args(0, q1, p1, p1[:, 0] + 1, chunk=(ck1, cv1, p1) if step % 2 == 0 else None)
        before = [x.clone() for x in got.layers[0].tensors()]
        o_t = attention_triton(*a)
        changed = [n for n, x, y in zip(NAMES, before, got.layers[0].tensors()) if not torch.equal(x, y)]
        o_r = attention_reference(*a)
        print(f"  attention over the Triton store's cache: NaN rows Triton {nan_rows(o_t)}, reference {nan_rows(o_r)}; "
              f"cache changed by it: {changed or 'nothing'}")
        lens = [n + 1 for n in lens]


if __name__ == "__main__":
    main()
