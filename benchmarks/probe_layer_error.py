"""Which layer, and keys or values, carries a model's INT2 error at a long context (a diagnostic).

One real sequence of ``--context`` tokens runs through the model in observe mode (the backend records the
post-RoPE queries, keys and values every attention call would store). For each layer whose cache quantizes
(sliding-window layers keep only their BF16 ring), the last ``--queries`` queries attend as a decode step
would: sinks and the ``window`` newest keys in full precision, every older key and value an INT2 round trip
in the artifact's basis. Reported: the relative error of the attention output (all query heads) with keys
only, values only and both quantized, per window and group size. Cheap next to a perplexity run (one
forward), so candidate fixes can be compared here first.

``--shifts`` moves every query and key of the sequence further along by the model's RoPE (a rotation by the
same extra angle for both, so every attention score, and so the reference output, is unchanged): what the
same text looks like to the INT2 basis at positions a short forward never reaches (30720 + a 2048-token
sequence: the last 2K positions of a 32K context). The error at a shift against the error at 0 is the cost of
the basis having been calibrated at short positions.

    python benchmarks/probe_layer_error.py --model gemma3-270m --context 8192 --artifact ~/.cache/oscar-compile/artifacts/NAME
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def capture(model, ids: torch.Tensor) -> dict:
    """``{layer: (q, k, v)}`` of one forward (observe mode), float32 on the CPU."""
    from oscar_compile.backend import OscarBackend
    from oscar_compile.calibration.statistics import StatsObserver
    from oscar_compile.calibration.tracer import hf_forward

    obs = StatsObserver(skip_first=0, heldout_tokens=10**12)
    obs.phase = "heldout"
    compiled = torch.compile(model, backend=OscarBackend(observer=obs, inductor=False, validate=False))
    with torch.no_grad():
        hf_forward(compiled, ids)
    torch._dynamo.reset()
    return {layer: (h.q[0], h.k[0], h.v[0]) for layer, h in obs.heldout.items()}


def text_ids(tok, text: str, context: int, offset: int = 0) -> torch.Tensor:
    """``[1, context]`` token ids of a packaged text from token ``offset`` on; exits if the text is too short."""
    from oscar_compile.assets import load_text

    ids = torch.tensor(tok(load_text(text))["input_ids"][offset:offset + context])[None]
    if ids.shape[1] < context:
        raise SystemExit(f"probe: {text} has only {ids.shape[1]} tokens from offset {offset}")
    return ids


def load_probe(model_name: str, artifact, context: int, offset: int = 0):
    """What every probe starts from: ``(model, tokenizer, artifacts, {layer: (q, k, v)} of ``context`` Wikipedia
    tokens from ``offset``, the model's text config)``."""
    from oscar_compile.assets import load_model
    from oscar_compile.calibration.artifacts import load_artifacts

    model, tok = load_model(model_name)
    model.eval()
    art = load_artifacts(artifact)
    acts = capture(model, text_ids(tok, "wikipedia", context, offset))
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return model, tok, art, acts, cfg


def score_scale(cfg, d: int) -> float:
    """The attention's score scale: ``query_pre_attn_scalar ** -0.5`` where the model has one (Gemma), else
    ``d ** -0.5``."""
    pre = getattr(cfg, "query_pre_attn_scalar", None)
    return pre**-0.5 if pre else d**-0.5


def rope_inv_freq(model, layer_type: str | None) -> torch.Tensor:
    """The inverse RoPE frequencies of a layer type (``{type}_inv_freq`` buffer, else the model's ``inv_freq``)."""
    bufs = dict(model.named_buffers())
    for name, b in bufs.items():
        if layer_type and name.endswith(f"{layer_type}_inv_freq") and "original" not in name:
            return b.float()
    for name, b in bufs.items():
        if name.endswith("inv_freq") and "original" not in name:
            return b.float()
    raise SystemExit("probe: no RoPE inv_freq buffer in this model (--shifts needs one)")


def rope_shift(x: torch.Tensor, inv_freq: torch.Tensor, shift: int) -> torch.Tensor:
    """``x`` (post-RoPE, transformers' rotate-half layout, ``[..., d]``) as it would be ``shift`` positions later:
    RoPE at position p + shift is RoPE at p followed by RoPE at shift."""
    from transformers.models.llama.modeling_llama import rotate_half

    ang = torch.cat([shift * inv_freq.double()] * 2)
    return x * ang.cos().float() + rotate_half(x) * ang.sin().float()


def output_errors(q, k, v, tr, scale: float, sinks: int, window: int, queries: int, group_size=None,
                  key_page: int = 0) -> dict:
    """Relative output error of the last ``queries`` decode-style queries: keys only, values only, both.
    ``key_page``: keys per channel over pages of that many tokens after the sinks (the cache's
    ``key_format="channel"``); 0: per token."""
    from oscar_compile.calibration.clipping import round_trip, round_trip_pages

    _, hq, t, d = q.shape
    h = k.shape[1]
    g = hq // h
    kt = torch.einsum("bhtd,hde->bhte", k.float() - tr.key_mean[None, :, None], tr.key_transform)[0]  # [H, T, d]
    vt = torch.einsum("bhtd,hde->bhte", v.float() - tr.value_mean[None, :, None], tr.value_transform)[0]
    qt = torch.einsum("hgtd,hde->hgte", q[0, :, t - queries:].float().reshape(h, g, queries, d), tr.query_transform)
    kq = round_trip_pages(kt, key_page, sinks) if key_page else round_trip(kt, tr.key_clip, group_size)
    vq = round_trip(vt, tr.value_clip, group_size)
    pos = torch.arange(t - queries, t)[:, None]
    j = torch.arange(t)[None, :]
    visible = j <= pos
    exact = (j < sinks) | (j > pos - window)  # sinks and the ring: BF16
    s_exact = torch.einsum("hgtd,hjd->hgtj", qt, kt)
    s_quant = torch.where(exact, s_exact, torch.einsum("hgtd,hjd->hgtj", qt, kq))
    p_ref = torch.softmax((s_exact * scale).masked_fill(~visible, float("-inf")), -1)
    ref_o = torch.einsum("hgtd,hde->hgte", torch.einsum("hgtj,hjd->hgtd", p_ref, vt), tr.output_transform)
    out = {}
    for name, qk, qv in (("keys", True, False), ("values", False, True), ("both", True, True)):
        p = torch.softmax(((s_quant if qk else s_exact) * scale).masked_fill(~visible, float("-inf")), -1)
        if qv:
            got = torch.einsum("hgtj,hjd->hgtd", p * exact, vt) + torch.einsum("hgtj,hjd->hgtd", p * ~exact, vq)
        else:
            got = torch.einsum("hgtj,hjd->hgtd", p, vt)
        got_o = torch.einsum("hgtd,hde->hgte", got, tr.output_transform)
        rel = ((got_o - ref_o).norm(dim=-1) / (ref_o + tr.value_mean[:, None, None]).norm(dim=-1).clamp_min(1e-9))
        out[name] = {"mean": float(rel.mean()), "per_kv_head": [round(float(x), 4) for x in rel.mean(dim=(1, 2))]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--artifact", required=True, help="artifact directory (from `oscar calibrate`)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=64)
    ap.add_argument("--windows", default="256,1024")
    ap.add_argument("--group-sizes", default="0,32", help="0: one group a row")
    ap.add_argument("--offset", type=int, default=0, help="first token of the sequence in the evaluation text")
    ap.add_argument("--shifts", default="0", help="extra RoPE positions for queries and keys (see above)")
    ap.add_argument("--key-formats", default="token", help="token and/or c<page> (c32: keys per channel over pages "
                    "of 32, the backend's default), comma-separated")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model, _, art, acts, cfg = load_probe(a.model, a.artifact, a.context, a.offset)
    rows = []
    for layer in sorted(acts):
        if layer in art.sliding_windows:
            continue
        q, k, v = acts[layer]
        d = q.shape[-1]
        scale = score_scale(cfg, d)
        tr = art.layer_transforms(layer, k.shape[1], d)
        types = getattr(cfg, "layer_types", None)
        for shift in map(int, a.shifts.split(",")):
            if shift:
                inv = rope_inv_freq(model, types[layer] if types else None)
                qs, ks = rope_shift(q.float(), inv, shift), rope_shift(k.float(), inv, shift)
            else:
                qs, ks = q, k
            combos = [(w, gs, kf) for w in map(int, a.windows.split(",")) for gs in map(int, a.group_sizes.split(","))
                      for kf in a.key_formats.split(",")]
            for w, gs, kf in combos:
                page = 0 if kf == "token" else int(kf[1:])
                e = output_errors(qs, ks, v, tr, scale, a.sinks, w, a.queries, gs or None, page)
                rows.append({"layer": layer, "shift": shift, "window": w, "group_size": gs or d, "keys_format": kf, **e})
                print(f"layer {layer:2d} shift {shift:6d} window {w:5d} group {gs or d:4d} keys {kf:>5}: "
                      f"keys {e['keys']['mean']:.4f} values {e['values']['mean']:.4f} both {e['both']['mean']:.4f}  "
                      f"per KV head {e['both']['per_kv_head']}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "context": a.context, "artifact": str(a.artifact),
                                           "method": art.method, "shifts": a.shifts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
