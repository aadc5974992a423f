"""How much noise INT2 keys add to attention scores, per layer and key format (a diagnostic for retrieval).

One real sequence runs through the model in observe mode (as ``probe_layer_error.py``). For each layer that
quantizes, the last ``--queries`` queries score every key of the INT2 region (past the sinks, older than the
window) in the artifact's basis, exact and with the keys quantized in several formats at their bits per element:

* ``row``: the cache's format, one (scale, min) per token over ``g`` channels (``row g32``: groups of 32), with the
  artifact's clip ratio;
* ``chan tN``: one (scale, min) per channel over N consecutive tokens (KIVI's axis, here in OSCAR's basis).
* ``chan t32 eig`` / ``chan t32 raw``: the same over 32 tokens in the artifact's basis without its final Hadamard (the
  scaled eigenbasis) and in the raw centred keys (KIVI's basis): which basis per-channel keys want.

Reported: the standard deviation of the score error (softmax units: scale included), how often the INT2 region's
best key stays the best (a proxy for finding a needle), and the INT2 region's share of the attention with exact
and quantized keys (INT2 noise inflates it: ``E[exp(s + e)] = exp(s + var(e) / 2)``).

    python benchmarks/probe_key_noise.py --model gemma3-270m --context 2048 --artifact ~/.cache/oscar-compile/artifacts/NAME
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from probe_layer_error import load_probe, score_scale


def per_channel_round_trip(k: torch.Tensor, tokens: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [H, T, d]`` with keys ``first ..`` quantized to INT2 per channel over groups of ``tokens`` tokens
    (asymmetric, fp16 metadata); a last partial group and the keys before ``first`` stay exact. Also returns each
    element's quantization step (0 where exact)."""
    h, t, d = k.shape
    n = (t - first) // tokens * tokens
    x = k[:, first:first + n].reshape(h, n // tokens, tokens, d)
    mn, mx = x.amin(2, keepdim=True), x.amax(2, keepdim=True)
    step = ((mx - mn) / 3).half().float()
    mn = mn.half().float()
    codes = ((x - mn) / step.clamp_min(1e-12)).round().clamp(0, 3)
    out = k.clone()
    out[:, first:first + n] = (codes * step + mn).reshape(h, n, d)
    steps = torch.zeros_like(k)
    steps[:, first:first + n] = step.expand_as(x).reshape(h, n, d)
    return out, steps


def key_noise(q, k, tr, scale: float, sinks: int, window: int, queries: int) -> dict:
    from oscar_compile.quant import dequantize_int2, quantize_int2

    _, hq, t, d = q.shape
    h = k.shape[1]
    kt = torch.einsum("bhtd,hde->bhte", k.float() - tr.key_mean[None, :, None], tr.key_transform)[0]
    qt = torch.einsum("hgtd,hde->hgte", q[0, :, t - queries:].float().reshape(h, hq // h, queries, d), tr.query_transform)
    pos = torch.arange(t - queries, t)[:, None]
    j = torch.arange(t)[None, :]
    visible = j <= pos
    int2 = visible & (j >= sinks) & (j <= pos - window)
    exact = torch.einsum("hgtd,hjd->hgtj", qt, kt) * scale
    best = exact.masked_fill(~int2, float("-inf")).argmax(-1)
    p_exact = torch.softmax(exact.masked_fill(~visible, float("-inf")), -1)
    formats = [("row", None, 2 + 32 / d)] + [(f"row g{g}", g, 2 + 32 / g) for g in (64, 32) if g < d]
    formats += [(f"chan t{n}", -n, 2 + 32 / n) for n in (64, 32)]
    # the same per-channel format in two other bases (exact scores unchanged): the artifact's without its final
    # Hadamard (the scaled eigenbasis: per-channel ranges are scale-invariant), and the raw centred keys (KIVI's)
    from oscar_compile.quant import hadamard_matrix

    bases = {"eig": hadamard_matrix(d), "raw": torch.linalg.inv(tr.key_transform)}  # kt @ M: keys in that basis
    formats += [(f"chan t32 {b}", -32, 2 + 1.0) for b in bases]
    out = {"int2_share_exact": float((p_exact * int2).sum(-1).mean())}
    for name, g, bits in formats:
        m = bases.get(name.split()[-1])
        steps = None  # each element's quantization step in the queries' basis (for the debiased share)
        if m is not None:  # quantized in that basis and brought back to the artifact's, where the queries are
            kq, _ = per_channel_round_trip(kt @ m, -g, sinks)
            kq = kq @ torch.linalg.inv(m)
        elif g is not None and g < 0:
            kq, steps = per_channel_round_trip(kt, -g, sinks)
        else:
            packed, sc, mn = quantize_int2(kt, g, tr.key_clip)
            kq = dequantize_int2(packed, sc, mn, g)
            steps = sc.float().repeat_interleave(d // sc.shape[-1], -1)
        s = torch.where(int2, torch.einsum("hgtd,hjd->hgtj", qt, kq) * scale, exact)
        err = (s - exact)[int2.expand_as(s)]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        out[name] = {"bits": round(bits, 3), "score_noise_sd": round(float(err.std()), 4),
                     "best_key_kept": round(float((s.masked_fill(~int2, float("-inf")).argmax(-1) == best).float().mean()), 3),
                     "int2_share": round(float((p * int2).sum(-1).mean()), 4)}
        if steps is not None:
            # rounding noise of a score, per (query, key): sum over channels of (q_c step_c)^2 / 12 (uniform error of
            # half a step); exp(s + e) averages exp(s + var / 2), so subtracting var / 2 removes the inflation
            var = torch.einsum("hgtd,hjd->hgtj", qt.square(), steps.square()) * scale**2 / 12
            sd = torch.where(int2, s - var / 2, exact)
            pd = torch.softmax(sd.masked_fill(~visible, float("-inf")), -1)
            out[name]["int2_share_debiased"] = round(float((pd * int2).sum(-1).mean()), 4)
            out[name]["predicted_noise_sd"] = round(float(var[int2.expand_as(var)].mean().sqrt()), 4)
            # how far the attention weights are from exact (total variation), quantized and debiased
            out[name]["tv"] = round(float(0.5 * (p - p_exact).abs().sum(-1).mean()), 4)
            out[name]["tv_debiased"] = round(float(0.5 * (pd - p_exact).abs().sum(-1).mean()), 4)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--artifact", required=True, help="artifact directory (from `oscar calibrate`)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--offset", type=int, default=0, help="first token of the sequence in the evaluation text")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    _, _, art, acts, cfg = load_probe(a.model, a.artifact, a.context, a.offset)
    rows = []
    for layer in sorted(acts):
        if layer in art.sliding_windows:
            continue
        q, k, _ = acts[layer]
        d = q.shape[-1]
        r = key_noise(q, k, art.layer_transforms(layer, k.shape[1], d), score_scale(cfg, d), a.sinks, a.window,
                      a.queries)
        rows.append({"layer": layer, **r})
        print(f"layer {layer:2d}  INT2 share {r['int2_share_exact']:.3f}  " + " | ".join(
            f"{n} ({v['bits']:.2f} b): noise {v['score_noise_sd']:.3f}, best kept {v['best_key_kept']:.2f}, share {v['int2_share']:.3f}"
            + (f" (debiased {v['int2_share_debiased']:.3f}; tv {v['tv']:.3f} -> {v['tv_debiased']:.3f})"
               if "tv" in v else "")
            for n, v in r.items() if isinstance(v, dict)), flush=True)
    names = [n for n, v in rows[0].items() if isinstance(v, dict)] if rows else []
    for n in names:
        mean = lambda key: sum(r[n][key] for r in rows) / len(rows)  # noqa: E731
        print(f"mean over layers  {n:<9} noise {mean('score_noise_sd'):.3f}  best kept {mean('best_key_kept'):.3f}  "
              f"share {mean('int2_share'):.3f} (exact {sum(r['int2_share_exact'] for r in rows) / len(rows):.3f})"
              + (f"  debiased {mean('int2_share_debiased'):.3f}  tv {mean('tv'):.4f} -> {mean('tv_debiased'):.4f}"
                 if "tv" in rows[0][n] else ""))
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "context": a.context, "artifact": str(a.artifact),
                                           "method": art.method, "sinks": a.sinks, "window": a.window,
                                           "queries": a.queries, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
