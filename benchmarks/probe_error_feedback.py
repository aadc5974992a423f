"""Error-feedback rounding of INT2 keys in the rotated basis, ordered by query energy (issue 18's candidate; a probe).

A key's INT2 error matters through the scores ``q . (k - k_hat)``: its cost is ``e^T Q e`` with ``Q = E[q q^T]`` in
the stored basis, not ``|e|^2``. Rounding a key's channels one after another and pushing each channel's rounding error
onto the channels not yet rounded, weighted by ``Q`` (GPTQ's update, with ``Q`` in the role of the Hessian), lowers
that cost where ``Q`` is far from a multiple of the identity. The basis mixes by a Hadamard after the query-aware
scaling, so ``Q`` keeps off-diagonal structure there (its diagonal is flat, its eigenvalues are not).

This probe measures the gain before any kernel work. One real sequence runs through the model in observe mode
(as ``probe_layer_error.py``); per full-attention layer, ``Q`` is estimated from the queries of the first part of the
sequence and the error is measured on the last ``--queries`` queries, as decode steps would read their keys (sinks
and the last ``window`` keys exact, the rest per channel over pages of 32 at full ranges). Reported per layer: the
relative attention-output error with INT2 keys (values exact) for plain rounding and for error feedback (channels in
the basis' order and in decreasing ``Q`` diagonal order), and the Gaussian high-rate bound of the gain
(arithmetic over geometric mean of ``Q``'s eigenvalues).

    python benchmarks/probe_error_feedback.py --model gemma3-270m --artifact DIR --context 8192
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from probe_layer_error import capture, load_probe, score_scale, text_ids


def round_pages(kt: torch.Tensor, page: int, sinks: int, moment=None, order=None, damp: float = 0.01):
    """``kt [T, d]`` (one head) with its whole pages after the sinks rounded per channel at full ranges, as the cache
    rounds them (:func:`round_trip_pages`): to nearest without ``moment``, else with error feedback for queries of that
    second moment (:func:`feedback_factor`), the channels taken in ``order`` (default: the basis order)."""
    from oscar_compile.calibration.clipping import round_trip_pages
    from oscar_compile.quant import feedback_factor

    if moment is None:
        return round_trip_pages(kt[None], page, sinks)[0]
    order = torch.arange(kt.shape[-1]) if order is None else order
    factor = feedback_factor(moment[order][:, order], damp)
    out = torch.empty_like(kt)
    out[:, order] = round_trip_pages(kt[None, :, order], page, sinks, feedback=factor[None])[0]
    return out


def high_rate_gain_bound(moment: torch.Tensor) -> float:
    """The most error feedback can gain for an error cost ``e^T M e`` (Gaussian, high rate): the arithmetic over the
    geometric mean of ``M``'s eigenvalues."""
    ev = torch.linalg.eigvalsh(moment).clamp_min(1e-12)
    return float(ev.mean() / ev.log().mean().exp())


def key_output_error(qt, kt, kq, vt, scale, sinks, window) -> float:
    """Relative RMS attention-output error of decode-style queries ``qt [g, Tq, d]`` (the last ones of the
    sequence) with keys ``kq`` where INT2 (not a sink, not in the query's last ``window``), values exact."""
    t, tq = kt.shape[0], qt.shape[1]
    pos = torch.arange(t - tq, t)[:, None]
    j = torch.arange(t)[None, :]
    visible, exact = j <= pos, (j < sinks) | (j > pos - window)
    s_ref = torch.einsum("gtd,jd->gtj", qt, kt) * scale
    s_q = torch.where(exact, s_ref, torch.einsum("gtd,jd->gtj", qt, kq) * scale)
    p_ref = torch.softmax(s_ref.masked_fill(~visible, float("-inf")), -1)
    p_q = torch.softmax(s_q.masked_fill(~visible, float("-inf")), -1)
    ref = p_ref @ vt
    return float(((p_q - p_ref) @ vt).square().sum() / ref.square().sum()) ** 0.5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--page", type=int, default=32)
    ap.add_argument("--damp", type=float, default=0.01, help="added to Q's diagonal, times its mean (GPTQ's)")
    ap.add_argument("--q-text", default="debian-handbook", help="text whose queries estimate Q (the calibration's); "
                    "'same': the first part of the measured sequence")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model, tok, art, acts, cfg = load_probe(a.model, a.artifact, a.context)
    if a.q_text != "same":
        calib = capture(model, text_ids(tok, a.q_text, a.context))
    rows = []
    for layer in sorted(acts):
        if layer in art.sliding_windows:
            continue
        q, k, v = acts[layer]
        _, hq, t, d = q.shape
        h = k.shape[1]
        g = hq // h
        scale = score_scale(cfg, d)
        tr = art.layer_transforms(layer, h, d)
        kt = torch.einsum("htd,hde->hte", k[0].float() - tr.key_mean[:, None], tr.key_transform)
        vt = torch.einsum("htd,hde->hte", v[0].float() - tr.value_mean[:, None], tr.value_transform)
        qt = torch.einsum("hgtd,hde->hgte", q[0].float().reshape(h, g, t, d), tr.query_transform)
        fit = t - a.queries - a.window  # Q from queries none of the measured ones is
        for head in range(h):
            if a.q_text == "same":
                qfit = qt[head, :, a.sinks:fit].reshape(-1, d).double()
            else:
                qc = calib[layer][0][0].float().reshape(h, g, -1, d)[head]
                qfit = torch.einsum("gtd,de->gte", qc, tr.query_transform[head])[:, a.sinks:].reshape(-1, d).double()
            Q = qfit.T @ qfit / qfit.shape[0]
            bound = high_rate_gain_bound(Q)
            rounded = {"plain": round_pages(kt[head], a.page, a.sinks),
                       "basis order": round_pages(kt[head], a.page, a.sinks, Q, damp=a.damp),
                       "by Q diagonal": round_pages(kt[head], a.page, a.sinks, Q,
                                                    torch.argsort(Q.diagonal(), descending=True), a.damp)}
            errs = {name: key_output_error(qt[head, :, t - a.queries:], kt[head], kq, vt[head], scale, a.sinks,
                                           a.window) for name, kq in rounded.items()}
            row = {"layer": layer, "head": head, "high_rate_gain_bound": round(bound, 3),
                   **{f"key_error_{k.replace(' ', '_')}": round(e, 4) for k, e in errs.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        meta = {"model": a.model, "context": a.context, "artifact": a.artifact, "q_text": a.q_text, "page": a.page,
                "window": a.window, "sinks": a.sinks}
        Path(a.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
