"""Summarise Nsight Compute's per-SASS-instruction page (``ncu -i R --page source --print-source sass --csv``).

Prints, per opcode: instructions executed, shared-memory wavefronts (and the excess over ideal, i.e. bank
conflicts) and the share of warp-stall samples; then the stall reasons over the whole kernel.

    python benchmarks/ncu_summary.py pages_sass.csv
"""

from __future__ import annotations

import collections
import csv
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def summarise(path: str, top: int = 25) -> str:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Source" in r)
    names, data = rows[header], rows[header + 1:]
    col = {h: i for i, h in enumerate(names)}
    by_op = collections.defaultdict(lambda: [0.0] * 4)
    for r in data:
        words = r[col["Source"]].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") else words[0]
        acc = by_op[op]
        for k, name in enumerate(("Instructions Executed", "L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive",
                                  "Warp Stall Sampling (All Samples)")):
            acc[k] += _num(r[col[name]])
    samples = sum(v[3] for v in by_op.values()) or 1.0
    lines = [f"{'opcode':24s} {'executed':>10s} {'shared wavefr.':>14s} {'excess':>10s} {'stall samples':>13s}"]
    for op, (ex, wf, exc, st) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{op:24s} {ex / 1e6:9.2f}M {wf / 1e6:13.2f}M {exc / 1e6:9.2f}M {100 * st / samples:12.1f}%")
    reasons = [h for h in names if h.startswith("stall_") and "Not Issued" not in h]
    share = {h[6:]: 100 * sum(_num(r[col[h]]) for r in data) / samples for h in reasons}
    lines.append("stall reasons (% of samples): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                             sorted(share.items(), key=lambda kv: -kv[1]) if v >= 0.5))
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarise(sys.argv[1]))
