"""Plot ``e2e_gpu.py`` runs of the retrieval heads' storage: decode tokens/s and INT2 storage per configuration
(every head INT2, retrieval heads in BF16, in FP8), one panel pair per shape.

    python benchmarks/plot_exact_heads_e2e.py results/e2e_exact_heads_fp8_64x8k_h100.json [more.json] --out PNG
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def short(config: str) -> str:
    if "FP8" in config:
        return "heads in FP8"
    if "BF16" in config and "exact" in config:
        return "heads in BF16"
    if config.startswith("bf16 StaticCache"):
        return "BF16 (Inductor)"
    return "every head INT2" if config == "oscar INT2" else config[:24]


def storage_gb(r: dict) -> float:
    """The cache's storage: oscar's own count, or BF16's K and V of Llama-3-8B's shape (8 KV heads of 128)."""
    if "int2_storage_gb" in r:
        return r["int2_storage_gb"]
    return r["batch"] * (r["prompt"] + r["new_tokens"]) * r.get("layers", 32) * 8 * 128 * 2 * 2 / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="8 layers", help="the models' depth, for the title")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes: dict[tuple, list] = {}
    device = ""
    for f in args.files:
        data = json.loads(Path(f).read_text())
        device = data.get("device", device)
        for r in data["rows"]:
            if "error" not in r:
                shapes.setdefault((r["batch"], r["prompt"]), []).append(r)
    fig, axes = plt.subplots(len(shapes), 2, figsize=(9, 3 * len(shapes)), squeeze=False)
    for (batch, prompt), (ax_speed, ax_bytes) in zip(sorted(shapes), axes):
        rows = shapes[(batch, prompt)]
        names = [short(r["config"]) for r in rows]
        ax_speed.barh(names, [r["decode_tokens_per_s"] for r in rows], color="tab:blue")
        ax_speed.set_xlabel("decode tokens/s")
        ax_speed.set_title(f"{batch} x {prompt // 1024}K")
        ax_bytes.barh(names, [storage_gb(r) for r in rows], color="tab:orange")
        ax_bytes.set_xlabel("cache storage, GB")
        ax_bytes.set_yticklabels([])
    fig.suptitle(f"Retrieval heads' storage, Llama-3-8B shape, {args.layers} ({device})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
