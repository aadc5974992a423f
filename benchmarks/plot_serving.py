"""Plot and tabulate ``results/serving_gptfast_h200.json`` (``serve_gptfast.py``): end to end and at a fixed KV budget.

    python benchmarks/plot_serving.py [results/serving_gptfast_h200.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path):
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if "error" not in r and "superseded" not in r]
    e2e, budget = {}, {}
    for r in rows:
        table, key = ((e2e, (r["batch"], r["prompt"], r["config"])) if r["mode"] == "e2e"
                      else (budget, (r["context"], r["config"])))
        old = table.get(key)
        # oscar: its newest row; BF16: the fastest of its runs (ratios against the best baseline measured)
        if old is None or r["config"] != "bf16" or r["decode_tokens_per_s"] > old["decode_tokens_per_s"]:
            table[key] = r
    return e2e, budget


def peak(r):
    return r["peak_gb"] - r.get("leaked_previous_storage_gb", 0.0)


def tables(e2e, budget) -> str:
    lines = ["| batch x prompt | TTFT bf16 / oscar (s) | decode tok/s bf16 / oscar | oscar / bf16 | peak GB bf16 / oscar | KV GB bf16 / oscar |",
             "|---|---|---|---|---|---|"]
    for b, p in sorted({(b, p) for b, p, _ in e2e}, key=lambda x: (x[1] * x[0], x[0])):
        bf, os_ = e2e.get((b, p, "bf16")), e2e.get((b, p, "oscar"))
        f = lambda r, k, fmt: fmt.format(r[k]) if r else "-"  # noqa: E731
        ratio = f"{os_['decode_tokens_per_s'] / bf['decode_tokens_per_s']:.2f}x" if bf and os_ else "-"
        kv_bf = f"{b * bf16_kv_gb_per_seq(p + 33):.1f}" if not bf else f"{bf['kv_gb']:.1f}"
        lines.append(f"| {b} x {p // 1024}K | {f(bf, 'ttft_s', '{:.1f}')} / {f(os_, 'ttft_s', '{:.1f}')} | "
                     f"{f(bf, 'decode_tokens_per_s', '{:.0f}')} / {f(os_, 'decode_tokens_per_s', '{:.0f}')} | {ratio} | "
                     f"{'%.1f' % peak(bf) if bf else 'does not fit'} / {'%.1f' % peak(os_) if os_ else '-'} | "
                     f"{kv_bf} / {f(os_, 'kv_gb', '{:.1f}')} |")
    lines += ["", "| context | bf16: batch, tok/s | oscar INT2: batch, tok/s | tok/s oscar / bf16 |", "|---|---|---|---|"]
    for ctx in sorted({c for c, _ in budget}):
        bf, os_ = budget.get((ctx, "bf16")), budget.get((ctx, "oscar"))
        lines.append(f"| {ctx // 1024}K | {bf['batch']}, {bf['decode_tokens_per_s']:.0f} | {os_['batch']}, "
                     f"{os_['decode_tokens_per_s']:.0f} | {os_['decode_tokens_per_s'] / bf['decode_tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def bf16_kv_gb_per_seq(max_len, layers=32, heads=8, d=128):
    return 2 * layers * heads * max_len * d * 2 / 1e9


def plot(e2e, budget, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(b, p) for b, p, _ in e2e}, key=lambda x: (x[1] * x[0], x[0]))
    labels = [f"{b}x{p // 1024}K" for b, p in shapes]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, key, title in ((axes[0], "decode_tokens_per_s", "decode tokens/s"), (axes[1], "peak", "peak GPU memory (GB)")):
        for off, cfg in ((-0.2, "bf16"), (0.2, "oscar")):
            vals = [(peak(e2e[(b, p, cfg)]) if key == "peak" else e2e[(b, p, cfg)][key]) if (b, p, cfg) in e2e else 0
                    for b, p in shapes]
            ax.bar([i + off for i in range(len(shapes))], vals, 0.4, label="BF16 (own static cache)" if cfg == "bf16" else "oscar INT2")
        ax.set_xticks(range(len(shapes)), labels)
        ax.set_title(title)
        ax.legend()
    ctxs = sorted({c for c, _ in budget})
    ax = axes[2]
    for off, cfg in ((-0.2, "bf16"), (0.2, "oscar")):
        rs = [budget[(c, cfg)] for c in ctxs]
        bars = ax.bar([i + off for i in range(len(ctxs))], [r["decode_tokens_per_s"] for r in rs], 0.4, label=cfg)
        for bar, r in zip(bars, rs):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"batch {r['batch']}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ctxs)), [f"{c // 1024}K" for c in ctxs])
    ax.set_title("decode tokens/s in 60 GB of KV cache")
    ax.legend()
    fig.suptitle("Llama-3-8B shape (32 layers), gpt-fast-style model, H200: BF16 vs oscar INT2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "serving_gptfast_h200.json")
    e2e, budget = load(path)
    plot(e2e, budget, path.with_suffix(".png"))
    print(tables(e2e, budget))


if __name__ == "__main__":
    main()
