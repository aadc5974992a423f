"""Where a generate's time goes, per configuration of :mod:`e2e_gpu`: time to first token and decode tokens/s of a
warmed-up generate, then the same generate under ``torch.profiler``: the GPU kernels and the CPU ops that take the
most time. For finding a slow route (e.g. the exact-heads companion's prefill), not for speed claims.

    python benchmarks/profile_prefill.py --model llama3-8b:2 --shape 16x4096 --configs int2,int2-xh
"""

from __future__ import annotations

import argparse
import json

import torch

import e2e_gpu


def profile(spec, config, batch, prompt, new, mode, top):
    import oscar_compile

    name, _, layers = spec.partition(":")
    _, opts, _ = e2e_gpu.CONFIGS[config]
    model = e2e_gpu.make(name, int(layers) if layers else None, prompt + new + 8)
    if isinstance(opts, dict) and opts.get("exact_heads") == "every-other-layer":
        opts = dict(opts, exact_heads={layer: (0,) for layer in range(0, model.config.num_hidden_layers, 2)})
    oscar_compile.compile(model, mode=mode, **opts)
    ids = torch.randint(3, 1000, (batch, prompt), device="cuda")
    max_len = prompt + new + 1
    for _ in range(2):  # compile, then the steady state
        _, ttft, tps = e2e_gpu.timed_generate(model, ids, e2e_gpu.make_cache(model, opts, batch, max_len), new, prompt)
    row = {"config": config, "ttft_s": round(ttft, 4), "decode_tokens_per_s": round(tps, 1)}
    cache = e2e_gpu.make_cache(model, opts, batch, max_len)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        e2e_gpu.timed_generate(model, ids, cache, new, prompt)
    events = prof.key_averages()
    gpu = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    row["gpu_ms"] = [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 2)) for e in gpu]
    row["cpu_ms"] = [(e.key[:90], e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in cpu]
    del model
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b:2")
    ap.add_argument("--shape", default="16x4096")
    ap.add_argument("--configs", default="int2,int2-xh")
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--mode", default="reduce-overhead")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batch, prompt = map(int, args.shape.split("x"))
    rows = []
    for config in args.configs.split(","):
        row = profile(args.model, config, batch, prompt, args.new, args.mode, args.top)
        rows.append(row)
        print(f"\n== {config}: ttft {row['ttft_s']} s, decode {row['decode_tokens_per_s']} tok/s")
        for title, key in (("GPU (self, ms)", "gpu_ms"), ("CPU (self, ms)", "cpu_ms")):
            print(f"  {title}")
            for k, n, ms in row[key]:
                print(f"    {ms:10.2f}  x{n:<5} {k}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
