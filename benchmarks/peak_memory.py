"""Peak memory of a compiled model's KV cache: transformers StaticCache vs OscarCache (INT2 pages).

Each configuration runs in its own process (peak RSS is per process): load the model, compile it
with the oscar backend, prefill a prompt and decode a few tokens with a cache sized for
``--max-len`` tokens of ``--batch`` sequences. Reported: peak RSS, the bytes held by the cache
object's own tensors (storage actually allocated) and the backend's INT2 storage.

    python benchmarks/peak_memory.py --model smollm2-135m --batch 4 --max-len 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def _storage_bytes(cache) -> int:
    seen, total = set(), 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is None or not hasattr(t, "untyped_storage"):
                continue
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def run_one(kind: str, model_name: str, batch: int, max_len: int, device: str) -> dict:
    import torch
    from transformers import StaticCache

    import oscar_compile
    from oscar_compile.assets import load_model
    from oscar_compile.testing import prefill_and_decode

    model, tok = load_model(model_name)
    model.to(device)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    backend = oscar_compile.oscar_backend(inductor=False)
    compiled = torch.compile(model, backend=backend)
    cache = (oscar_compile.OscarCache(model, max_cache_len=max_len, max_batch_size=batch) if kind == "oscar"
             else StaticCache(config=model.config, max_cache_len=max_len))
    ids = torch.randint(100, 1000, (batch, 64), generator=torch.Generator().manual_seed(0)).to(device)
    t0 = time.perf_counter()
    prefill_and_decode(compiled, ids, cache, steps=4)
    out = {
        "kind": kind, "model": model_name, "batch": batch, "max_len": max_len, "device": device,
        "model_dtype": str(model.dtype),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_load_bytes": rss0,
        "hf_cache_tensor_bytes": _storage_bytes(cache),
        "oscar_int2_storage_bytes": backend.kv_bytes,
        "layers_rewritten": [len(g.rewritten) for g in backend.graphs],
        "seconds": time.perf_counter() - t0,
    }
    if device == "cuda":
        out["cuda_peak_bytes_above_model"] = torch.cuda.max_memory_allocated() - base
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "peak_memory_cpu.json"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.model, args.batch, args.max_len, args.device)))
        return
    rows = []
    for kind in ("static", "oscar"):
        cmd = [sys.executable, __file__, "--one", kind, "--model", args.model, "--batch", str(args.batch),
               "--max-len", str(args.max_len), "--device", args.device]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if res.returncode:
            sys.exit(f"{kind} failed:\n{res.stderr[-3000:]}")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    mib = 2**20
    print(f"{args.model}, batch {args.batch} x {args.max_len} tokens, {rows[0]['model_dtype']} model, compiled with oscar_backend")
    print(f"{'cache':<8} {'peak RSS MiB':>12} {'cache tensors MiB':>18} {'INT2 storage MiB':>17}")
    for r in rows:
        print(f"{r['kind']:<8} {r['peak_rss_bytes'] / mib:12.0f} {r['hf_cache_tensor_bytes'] / mib:18.1f} "
              f"{r['oscar_int2_storage_bytes'] / mib:17.1f}")
    saved = rows[0]["peak_rss_bytes"] - rows[1]["peak_rss_bytes"]
    print(f"OscarCache lowers peak RSS by {saved / mib:.0f} MiB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "peak_rss_saved_bytes": saved}, indent=2))


if __name__ == "__main__":
    main()
