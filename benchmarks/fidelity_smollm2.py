"""First fidelity measurement: teacher-forced decode perplexity of SmolLM2-135M through the backend.

Calibrated on the Debian handbook, evaluated on the (disjoint) Wikipedia sample. Each method runs
with the default BF16 sinks/window (64 / 256) and with none at all (a harsher test). The model's own
weights are 4-bit GGUF (Q4_1), dequantized to fp32; the KV cache is BF16 or INT2.

    python benchmarks/fidelity_smollm2.py            # ~20 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from oscar_compile.assets import load_model, load_text
from oscar_compile.calibration import collect_statistics, derive_artifacts, token_batches
from oscar_compile.evaluation import Method, Session, bits_per_element, perplexity_nll

METHODS = ["identity", "hadamard", "oscar", "oscar+kmean", "oscar+mean", "oscar+mean+scale", "hadamard+mean"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib-batches", type=int, default=16)
    ap.add_argument("--calib-seq", type=int, default=512)
    ap.add_argument("--calib-batch-size", type=int, default=4)
    ap.add_argument("--eval-seqs", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--settings", default="64/256,0/0", help="sinks/window pairs")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fidelity_smollm2.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    t0 = time.perf_counter()
    calib_ids = tok(load_text("debian-handbook"), return_tensors="pt").input_ids[0]
    batches = token_batches(calib_ids, args.calib_seq, args.calib_batch_size,
                            max_tokens=(args.calib_batches + 1) * args.calib_seq * args.calib_batch_size)
    stats = collect_statistics(model, batches, data_description="debian-handbook")
    artifacts = {m: derive_artifacts(stats, m) for m in args.methods.split(",")}
    calib_seconds = time.perf_counter() - t0

    length = args.context + args.decode + 1
    eval_ids = tok(load_text("wikipedia"), return_tensors="pt").input_ids[0]
    tokens = eval_ids[: args.eval_seqs * length].view(args.eval_seqs, length)
    rows = []
    methods = [Method("bf16", "bf16")] + [Method(m, "oscar", a) for m, a in artifacts.items()]
    for setting in args.settings.split(","):
        sinks, window = map(int, setting.split("/"))
        for m in methods:
            torch._dynamo.reset()
            session = Session(model, m, tokens.shape[0], length, sinks, window)
            nll, n = perplexity_nll(session, tokens, args.context)
            ppl = float(torch.tensor(nll / n).exp())
            bits = bits_per_element(model.config, m, length, sinks, window)
            rows.append({"method": m.name, "sinks": sinks, "window": window, "ppl": ppl, "nll": nll / n, "tokens": n,
                         "bits_per_element": bits})
            print(f"sinks {sinks:>3} window {window:>3}  {m.name:<18} ppl {ppl:9.3f}  bits/elem {bits:.3f}", flush=True)
    result = {
        "model": args.model, "weights": "Q4_1 GGUF dequantized to fp32", "kv_cache_dtype": "bfloat16 (sinks/ring)",
        "calibration": {"text": "debian-handbook", **stats.info, "total_seconds": round(calib_seconds, 1)},
        "evaluation": {"text": "wikipedia", "sequences": args.eval_seqs, "context": args.context,
                       "decode_steps_scored": args.decode},
        "clip_ratios": {m: a.clip_ratios for m, a in artifacts.items()},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
