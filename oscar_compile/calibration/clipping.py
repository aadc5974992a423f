"""Attention-aware errors of a layer's INT2 cache, and the clip-ratio search that minimises them.

On held-out sequences (queries, keys, values as the cache sees them):

* key error: the logit error of every causal (query, key) pair, ``sum (q'.(k_hat' - k'))^2``; this is
  ``e^T S_q e`` measured on real query/key pairs instead of moments;
* value error: the output error ``|| P (v_hat' - v') B_o ||^2`` with ``P`` the real attention weights;
* recorded per layer, not searched on (:func:`relative_errors`): the output error of INT2 keys
  ``|| (P_hat - P) v ||^2`` and the value error, each relative to ``|| P v ||^2``.

``k'``, ``v'`` are the transformed rows the cache stores; ``k_hat'`` their INT2 round trip at a clip
ratio. The ratio is chosen per layer, separately for K and V, from a grid.
"""

from __future__ import annotations

import torch

from ..cache import LayerTransforms
from ..quant import dequantize_int2, quantize_int2, quantize_int2_channels

CLIP_GRID = (1.0, 0.995, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92, 0.9, 0.88, 0.85, 0.8, 0.75, 0.7)


def round_trip(x: torch.Tensor, clip: float | None, group_size: int | None) -> torch.Tensor:
    codes, scale, mn = quantize_int2(x, group_size, clip)
    return dequantize_int2(codes, scale, mn, group_size)


# Page range ratios the long-context check tries for per-channel keys (1.0: each channel's full range over a page).
PAGE_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def round_trip_pages(x: torch.Tensor, page: int, start: int = 0, clip: float | None = None,
                     feedback: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., T, d]`` with its whole pages of ``page`` tokens from ``start`` on quantized per channel over each
    page (the cache's ``key_format="channel"``; ``clip``: the page range ratio, see ``quantize_int2_channels``); the
    tokens before ``start`` and those of a last, partial page (still in the cache's ring) stay exact.
    ``feedback``: ``[H, d, d]`` error-feedback factors (``x`` is ``[B, H, T, d]``), the backend's ``key_feedback``."""
    n = (x.shape[-2] - start) // page
    if n <= 0:
        return x.clone()
    pages = x[..., start:start + n * page, :].unflatten(-2, (n, page))
    fb = None if feedback is None else feedback[:, None]  # [H, 1, d, d]: broadcast over the pages of each head
    codes, scale, mn = quantize_int2_channels(pages, clip_ratio=clip, feedback=fb)
    deq = dequantize_int2(codes, scale.unsqueeze(-2), mn.unsqueeze(-2), group_size=1)  # a group a channel
    out = x.clone()
    out[..., start:start + n * page, :] = deq.flatten(-3, -2)
    return out


def _causal(t: int, skip: int, device) -> torch.Tensor:
    i = torch.arange(t, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] >= skip)


def _int2_pairs(t: int, skip: int, window: int, device) -> torch.Tensor:
    """``[T, T]``: whether query ``i`` reads key ``j`` from the INT2 pages, as in a decode step of a cache of
    ``i + 1`` tokens: not a sink (``j >= skip``) and not among its last ``window`` tokens (``j <= i - window``)."""
    i = torch.arange(t, device=device)
    return (i[None, :] <= i[:, None] - window) & (i[None, :] >= skip)


def key_error(q, k, tr: LayerTransforms, clip: float, group_size=None, skip: int = 0) -> float:
    """Query-weighted logit error of INT2 keys. ``q [B, Hq, T, d]``, ``k [B, H, T, d]``."""
    b, hq, t, d = q.shape
    h = k.shape[1]
    kt = torch.einsum("bhtd,hde->bhte", k.float() - tr.key_mean[None, :, None], tr.key_transform)
    qt = torch.einsum("bhgtd,hde->bhgte", q.float().reshape(b, h, hq // h, t, d), tr.query_transform)
    e = round_trip(kt, clip, group_size) - kt
    logit_err = torch.einsum("bhgtd,bhjd->bhgtj", qt, e)
    return float((logit_err.square() * _causal(t, skip, q.device)).sum())


def output_energy(probs, v) -> float:
    """``|| P v ||^2`` of the exact outputs: the denominator of :func:`value_error` and :func:`key_output_error`
    for a relative error (relative to the whole output, the part the BF16 sinks carry included)."""
    return float(torch.einsum("bhgtj,bhjd->bhgtd", probs, v.float()).square().sum())


def attention_probs(q, k, scale: float | None = None) -> torch.Tensor:
    """Causal softmax weights ``[B, H, G, T, T]`` of the original (unquantized) queries and keys."""
    b, hq, t, d = q.shape
    h = k.shape[1]
    s = torch.einsum("bhgtd,bhjd->bhgtj", q.float().reshape(b, h, hq // h, t, d), k.float()) * (scale or d**-0.5)
    return torch.softmax(s.masked_fill(~_causal(t, 0, q.device), float("-inf")), dim=-1)


def value_error(probs, v, tr: LayerTransforms, clip: float, group_size=None, skip: int = 0, window: int = 0) -> float:
    """Attention-weighted output error of INT2 values. ``probs [B, H, G, T, T]``, ``v [B, H, T, d]``; ``window``:
    each query's last ``window`` keys stay in BF16 too (the cache's ring)."""
    vt = torch.einsum("bhtd,hde->bhte", v.float() - tr.value_mean[None, :, None], tr.value_transform)
    e = round_trip(vt, clip, group_size) - vt
    e = torch.einsum("bhtd,hde->bhte", e, tr.output_transform)  # back to the model's basis
    if window:
        probs = probs * _int2_pairs(e.shape[2], skip, window, e.device)
    elif skip:
        e[:, :, :skip] = 0  # sink tokens stay in BF16
    return float(torch.einsum("bhgtj,bhjd->bhgtd", probs, e).square().sum())


def search_clip(heldout_q, heldout_k, heldout_v, tr: LayerTransforms, group_size=None, skip: int = 0,
                grid=CLIP_GRID, sides=("key", "value"), heldout_probs=None) -> tuple[float | None, float | None, dict]:
    """Best (key_clip, value_clip) on the held-out sequences, and the errors per ratio (``sides``: which of the two
    to search; the other's ratio is None and its errors are left out). ``heldout_probs``: each sequence's
    :func:`attention_probs`, when the caller searches several transforms of one layer (they do not depend on them)."""
    errs = {f"{side}_error": {r: 0.0 for r in grid} for side in sides}
    for i, (q, k, v) in enumerate(zip(heldout_q, heldout_k, heldout_v)):
        probs = None
        if "value" in sides:
            probs = heldout_probs[i] if heldout_probs is not None else attention_probs(q, k)
        for r in grid:
            if "key" in sides:
                errs["key_error"][r] += key_error(q, k, tr, r, group_size, skip)
            if "value" in sides:
                errs["value_error"][r] += value_error(probs, v, tr, r, group_size, skip)
    best = {side: min(grid, key=lambda r: (errs[f"{side}_error"][r], -r)) if side in sides else None
            for side in ("key", "value")}
    return best["key"], best["value"], errs


def key_output_error(probs, q, k, v, tr: LayerTransforms, clip: float, group_size=None, skip: int = 0,
                     window: int = 0, key_page: int = 0) -> float:
    """``|| (P_hat - P) v ||^2``: what INT2 keys do to the attention output, values exact (``probs``: ``P``, from
    :func:`attention_probs`). ``key_page``: keys per channel over pages of that many tokens after the sinks (the
    cache's ``key_format="channel"``; ``clip`` is then the page range ratio, ``group_size`` unused); 0: per token.

    A logit error matters by its size in nats, not relative to the logits: a layer with large, peaked logits
    loses its attention pattern to a relative logit error that is harmless elsewhere (Qwen2.5-Coder-0.5B's layer
    0: 0.25 relative RMS logit error like its other layers, but ~1.0 relative output error at 2K)."""
    return key_output_errors(probs, q, k, v, tr, [(key_page, clip)], group_size, skip, window)[0]


def key_output_errors(probs, q, k, v, tr: LayerTransforms, formats, group_size=None, skip: int = 0,
                      window: int = 0) -> list[float]:
    """:func:`key_output_error` for each ``(key_page, clip)`` of ``formats``: the transformed queries and keys, the
    exact scores of the ring and the masks are computed once for all of them."""
    b, hq, t, d = q.shape
    h = k.shape[1]
    kt = torch.einsum("bhtd,hde->bhte", k.float() - tr.key_mean[None, :, None], tr.key_transform)
    qt = torch.einsum("bhgtd,hde->bhgte", q.float().reshape(b, h, hq // h, t, d), tr.query_transform)
    # each query's last `window` keys are exact too (the ring)
    ring = (~_int2_pairs(t, skip, window, q.device), torch.einsum("bhgtd,bhjd->bhgtj", qt, kt) * d**-0.5) \
        if window else None
    future = ~_causal(t, 0, q.device)
    vf = v.float()
    out = []
    for key_page, clip, *feedback in formats:  # (page, clip) or (page, clip, error-feedback factors)
        kq = (round_trip_pages(kt, key_page, skip, clip, *feedback) if key_page
              else round_trip(kt, clip, group_size))
        if skip:
            kq[:, :, :skip] = kt[:, :, :skip]  # sink tokens stay in BF16
        # q'.k_hat' is q.k_hat less q.mu_k, the same for every key of a query: softmax ignores it
        s = torch.einsum("bhgtd,bhjd->bhgtj", qt, kq) * d**-0.5
        if ring is not None:
            s = torch.where(ring[0], ring[1], s)
        p_hat = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1)
        out.append(float(torch.einsum("bhgtj,bhjd->bhgtd", p_hat - probs, vf).square().sum()))
    return out


def lower_medians(errors) -> list[float]:
    """The lower median of the key and of the value error over layers (``[[key, value], ...]``; None entries,
    layers that hold no INT2, left out): what a layer's error is compared with to call it an outlier."""
    errors = [e for e in errors if e is not None]
    return [sorted(e[j] for e in errors)[(len(errors) - 1) // 2] for j in (0, 1)]


def relative_errors(heldout_q, heldout_k, heldout_v, tr: LayerTransforms, group_size=None, skip: int = 0,
                    window: int = 0, key_page: int = 0, other_key_pages: tuple = (), page_clips: tuple = (),
                    feedback_clips: tuple = ()) -> tuple:
    """Held-out relative RMS errors of a layer's attention output with INT2 keys (values exact) and with INT2
    values (keys exact) at its clip ratios: what the calibration records per layer so that a layer whose keys or
    values do not survive 2 bits stands out. ``skip`` sinks and each query's last ``window`` keys stay exact
    (0: every key but the sinks is INT2); ``key_page``: keys per channel over pages (:func:`key_output_error`).
    ``other_key_pages``: the key error in other key formats too, appended, on the same attention weights.
    ``page_clips``: with per-channel keys, the key error at each of these page range ratios, appended after those
    (``tr.key_clip`` is the per-token clip: per-channel keys are measured at ratio 1 unless given here).
    ``feedback_clips``: with per-channel keys and ``tr.key_feedback``, the key error rounded with error feedback at
    each of these page range ratios, appended last."""
    formats = [(page, tr.key_clip if not page else 1.0) for page in (key_page, *other_key_pages)]
    formats += [(key_page, r) for r in (page_clips if key_page else ())]
    if key_page and tr.key_feedback is not None:
        formats += [(key_page, r, tr.key_feedback) for r in feedback_clips]
    ke, ve, energy = [0.0] * len(formats), 0.0, 0.0
    for q, k, v in zip(heldout_q, heldout_k, heldout_v):
        probs = attention_probs(q, k)
        ke = [a + e for a, e in zip(ke, key_output_errors(probs, q, k, v, tr, formats, group_size, skip, window))]
        ve += value_error(probs, v, tr, tr.value_clip, group_size, skip, window)
        energy += output_energy(probs, v)
    rel = [(e / max(energy, 1e-30)) ** 0.5 for e in (ke[0], ve, *ke[1:])]
    return tuple(rel)
