"""Pair retrieval answers across `oscar eval` runs on the same prompts: each method's answer NLL against BF16's.

Runs with the same seed, lengths, depths, tasks and samples ask the same prompts, and on the CPU (float32, reference
ops) BF16 answers them identically, so a variant measured in a later run need not re-run BF16. A run with BF16 of its
own pairs with it; a run without pairs with the other runs' BF16 (a warning where two runs' BF16 differ on a prompt:
other draws or other code). Prompts pair by (task, length, depth, answer, order); a prompt missing from either side
is left out.

    python benchmarks/retrieval_nll_pairs.py benchmarks/results/eval_smollm2-135m_cpu_2k_retrieval_nll*.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from oscar_compile.evaluation import answer_nll_delta


def keyed(rows: list[dict]) -> dict:
    """{(task, length, depth, answer, n-th such prompt): row}."""
    seen, out = Counter(), {}
    for r in rows:
        k = (r["task"], r["length"], r["depth"], r["answer"])
        out[k + (seen[k],)] = r
        seen[k] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    runs = [[r for r in json.load(open(path))["retrieval"] if r.get("answer_nll") is not None] for path in args.reports]
    pooled = {}  # BF16 of every run, a prompt's first: for a run without BF16 of its own
    for run in runs:
        for k, r in keyed([r for r in run if r["method"] == "bf16"]).items():
            if k in pooled and abs(pooled[k]["answer_nll"] - r["answer_nll"]) > 1e-3:
                print(f"warning: two runs' BF16 differ on {k} ({pooled[k]['answer_nll']:.3f} vs {r['answer_nll']:.3f}"
                      " nats): other prompts or other code; runs without BF16 of their own pair with the first")
            pooled.setdefault(k, r)
    out = []
    for run in runs:
        own = keyed([r for r in run if r["method"] == "bf16"])
        base = own or pooled  # a run's own BF16 asked exactly its prompts
        for name in dict.fromkeys(r["method"] for r in run if r["method"] != "bf16"):
            mine = keyed([r for r in run if r["method"] == name])
            both = [k for k in mine if k in base]
            if len(both) < 2:
                continue
            d = answer_nll_delta([(mine[k]["answer_nll"], base[k]["answer_nll"]) for k in both])
            d.update(method=name, correct=sum(mine[k]["correct"] for k in both),
                     correct_bf16=sum(base[k]["correct"] for k in both), bf16="own run" if own else "other runs")
            out.append(d)
            lo, hi = d["ci95_nats"]
            print(f"{name[:70]:<70} {d['delta_nats']:+.3f} nats ({lo:+.3f}..{hi:+.3f}) over {d['prompts']} prompts; "
                  f"p(answer) {d['p_answer']:.3f} vs {d['p_answer_bf16']:.3f}; correct {d['correct']} vs "
                  f"{d['correct_bf16']} (BF16 of {d['bf16']})")
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
