"""Would error feedback pay for INT2 values? The bound, from the weights alone (issue 18; a probe, no kernel).

Keys gain from error-feedback rounding because their error costs ``e^T Q e`` with a far-from-isotropic query moment
``Q`` in the stored basis. A value's error reaches the residual stream through the output projection: for a KV head,
``e^T H e`` with ``H`` the Gram matrix of the ``o_proj`` columns of the query heads that read it, moved into the
stored value basis (``T^-1 H T^-T``, ``T`` the artifact's value transform). Feedback along a token's channels (GPTQ's
update with ``H`` as the Hessian) can gain at most about the ratio of ``H``'s eigenvalues' arithmetic to geometric
mean (the Gaussian high-rate bound the key probe reports as ``high_rate_gain_bound``). This prints and saves that
bound for every full-attention layer and KV head; beside it, the same bound for keys from ``probe_error_feedback.py`` when given.

    python benchmarks/probe_value_feedback_bound.py --model smollm2-135m --artifact DIR --out F.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from probe_error_feedback import high_rate_gain_bound


def value_gram_bound(o_proj: torch.Tensor, value_transform: torch.Tensor, kv_head: int, group: int) -> tuple[float, float]:
    """``(high-rate gain bound, max/min of the diagonal)`` of ``H`` in the stored value basis of ``kv_head``."""
    d = value_transform.shape[-1]
    cols = [o_proj[:, (kv_head * group + j) * d:(kv_head * group + j + 1) * d].double() for j in range(group)]
    gram = sum(c.T @ c for c in cols)
    t_inv = torch.linalg.inv(value_transform[kv_head].double())
    h = t_inv @ gram @ t_inv.T
    diag = h.diagonal()
    return high_rate_gain_bound(h), float(diag.max() / diag.min())


@torch.no_grad()
def main():
    from oscar_compile.assets import load_model
    from oscar_compile.calibration.artifacts import load_artifacts

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--key-probe", default=None, help="probe_error_feedback.py's JSON, for the keys' bound beside")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model, _ = load_model(a.model)
    art = load_artifacts(a.artifact)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h = cfg.num_key_value_heads
    group = cfg.num_attention_heads // h
    attns = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    rows = []
    for layer, attn in enumerate(attns):
        if layer in art.sliding_windows:  # a sliding layer keeps its window exact: no INT2 values (as the key probe)
            continue
        tr = art.layer_transforms(layer, h, d)
        for head in range(h):
            bound, spread = value_gram_bound(attn.o_proj.weight.float(), tr.value_transform, head, group)
            rows.append({"layer": layer, "head": head, "value_high_rate_gain_bound": round(bound, 3),
                         "value_diagonal_spread": round(spread, 2)})
    values = [r["value_high_rate_gain_bound"] for r in rows]
    summary = {"value_bound_median": statistics.median(values), "value_bound_max": max(values)}
    if a.key_probe:
        keys = [r["high_rate_gain_bound"] for r in json.loads(Path(a.key_probe).read_text())["rows"]]
        summary |= {"key_bound_median": statistics.median(keys), "key_bound_max": max(keys)}
    print(json.dumps(summary))
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "artifact": a.artifact, **summary, "rows": rows},
                                          indent=1))


if __name__ == "__main__":
    main()
