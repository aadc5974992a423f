"""Do the retrieval heads depend on how far back the copy is? Induction scores at several spans, one model.

Calibration scores each KV head on random tokens said twice, 256 tokens apart (`calibration/retrieval_heads.py`),
and the backend keeps the best 1/16 in BF16. Qwen2.5-Coder-1.5B's default missed two needles ~16K tokens back at
32K that BF16 found (2026-12-06, H100): were other heads doing that copy? This measures each head's score at longer
spans on the CPU and compares the heads each span would choose.

    python benchmarks/probe_induction_span.py --model qwen2.5-coder-1.5b --spans 256,2048 --rows 2 \
        --out benchmarks/results/probe_induction_span_qwen2.5-coder-1.5b.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oscar_compile.assets import load_model
from oscar_compile.calibration.retrieval_heads import (INDUCTION_FLOOR, RETRIEVAL_HEAD_SHARE, induction_inputs,
                                                       induction_scores, select_retrieval_heads)
from oscar_compile.hf import sliding_windows
from probe_retrieval_heads import spearman  # benchmarks/, the script's own folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--spans", default="256,2048", help="tokens between the two copies")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, _ = load_model(args.model, dtype=torch.float32)
    vocab, bos, longest = induction_inputs(model)
    skip = set(sliding_windows(model.config))
    runs = {}
    for span in (int(s) for s in args.spans.split(",")):
        t0 = time.perf_counter()
        with torch.no_grad():
            scores = induction_scores(model, vocab, bos, span=span, rows=args.rows)
        heads = select_retrieval_heads(scores, skip)
        wide = select_retrieval_heads(scores, skip, share=1 / 8)
        runs[span] = {"scores": scores, "heads_1_16": heads, "heads_1_8": wide,
                      "seconds": round(time.perf_counter() - t0, 1)}
        print(f"span {span:>6}: 1/16 {heads}  1/8 {wide}  ({runs[span]['seconds']} s)")
    spans = list(runs)
    flat = {s: torch.tensor([x for row in runs[s]["scores"] for x in row]) for s in spans}
    for s in spans[1:]:
        same = {tuple(h) for h in runs[s]["heads_1_16"]} & {tuple(h) for h in runs[spans[0]]["heads_1_16"]}
        print(f"span {s} against {spans[0]}: Spearman {spearman(flat[s], flat[spans[0]]):.2f} over all heads, "
              f"{len(same)} of {len(runs[s]['heads_1_16'])} chosen heads shared")
        runs[s]["spearman_vs_first"] = round(spearman(flat[s], flat[spans[0]]), 3)
        runs[s]["shared_with_first"] = len(same)
    if args.out:
        json.dump({"model": args.model, "rows": args.rows, "floor": INDUCTION_FLOOR, "share": RETRIEVAL_HEAD_SHARE,
                   "context_span_limit": longest, "runs": {str(k): v for k, v in runs.items()}},
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
