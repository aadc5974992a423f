"""End to end on the GPU: generate() with the oscar backend (Inductor + the Triton kernels) vs BF16.

Random-weight models with the shapes of SmolLM2-135M and Llama-3-8B (real weights do not fit the
transfer to the GPU machine), in bf16. For each: BF16 StaticCache + torch.compile (Inductor), and
OscarCache + oscar backend (INT2), optionally with quantization off (same path, BF16 storage) as a
check that the rewrite computes what the model computes: greedy tokens must then agree.
Reports tokens/s of the decode phase and peak GPU memory.

    python benchmarks/e2e_gpu.py --models smollm2,llama3-8b:8 --configs int2,off,eager,inductor

Each configuration runs in its own process (a compiler crash costs one row, not the run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
}


def make(name, layers=None):
    cfg = transformers.LlamaConfig(**SHAPES[name], bos_token_id=1, eos_token_id=2)
    if layers:
        cfg.num_hidden_layers = layers
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval().generation_config.disable_compile = True  # we compile ourselves
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model


def uncompile(model):
    model._compiled_call_impl = None
    torch._dynamo.reset()


@torch.no_grad()
def timed_generate(model, ids, cache, new):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False, min_new_tokens=1)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    cache.reset()
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    decode_s = (t2 - t1) - (t1 - t0)  # minus one prefill (+ first token)
    return out[:, ids.shape[1]:], ids.shape[0] * (new - 1) / max(decode_s, 1e-9)


def run_config(model, name, ids, batch, prompt, new, mode, label, opts, weights):
    import oscar_compile

    uncompile(model)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if opts is None or opts == "eager":
        if opts is None:
            model.compile(mode=None if mode == "default" else mode)
        cache = transformers.StaticCache(config=model.config, max_cache_len=prompt + new + 1)
    else:
        oscar_compile.compile(model, mode=mode, **opts)
        cache = oscar_compile.OscarCache(model, max_cache_len=prompt + new + 1, max_batch_size=batch)
    timed_generate(model, ids, cache, 3)  # warm both graphs (prefill and decode) once
    compile_s = time.perf_counter() - t0
    cache.reset()
    tokens, tps = timed_generate(model, ids, cache, new)
    peak = torch.cuda.max_memory_allocated()
    row = {"model": name, "layers": model.config.num_hidden_layers, "config": label, "batch": batch,
           "prompt": prompt, "new_tokens": new, "mode": mode, "decode_tokens_per_s": tps,
           "peak_gb": peak / 1e9, "peak_above_weights_gb": (peak - weights) / 1e9, "warmup_s": compile_s}
    if isinstance(opts, dict):
        row["layers_rewritten"] = [len(g.rewritten) for g in model.oscar_backend.graphs]
        row["int2_storage_gb"] = model.oscar_backend.kv_bytes / 1e9
    return row, tokens


CONFIGS = {  # key: (label, options, compile mode: None = the --mode argument)
    "int2": ("oscar INT2", {}, None),
    "off": ("oscar, quantize off", {"quantize": False}, None),
    "eager": ("bf16 StaticCache eager", "eager", None),
    "inductor": ("bf16 StaticCache + inductor (default mode)", None, "default"),
    "inductor-ro": ("bf16 StaticCache + inductor (reduce-overhead)", None, "reduce-overhead"),
}


def child(args):
    """One configuration of one model in this process; writes its row and tokens for the parent."""
    name, _, layers = args.child.partition(":")
    label, opts, mode = CONFIGS[args.config]
    model = make(name, int(layers) if layers else None)
    ids = torch.randint(3, 1000, (args.batch, args.prompt), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    weights = torch.cuda.memory_allocated()
    row, tokens = run_config(model, name, ids, args.batch, args.prompt, args.new, mode or args.mode, label, opts, weights)
    torch.save(tokens.cpu(), args.result + ".pt")
    Path(args.result + ".json").write_text(json.dumps(row))


def run_isolated(spec, config, args, tmp) -> tuple[dict, torch.Tensor | None]:
    """Run one configuration in a subprocess: a crash (a segfault in a compiler) costs only that row."""
    import subprocess
    import sys

    result = str(Path(tmp) / f"{spec.replace(':', '_')}_{config}")
    cmd = [sys.executable, __file__, "--child", spec, "--config", config, "--result", result, "--batch", str(args.batch),
           "--prompt", str(args.prompt), "--new", str(args.new), "--mode", args.mode]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.config_timeout)
        err = None if proc.returncode == 0 else f"exit {proc.returncode}: " + proc.stderr.strip()[-600:]
    except subprocess.TimeoutExpired:
        err = f"timed out after {args.config_timeout} s"
    if err is None and Path(result + ".json").exists():
        return json.loads(Path(result + ".json").read_text()), torch.load(result + ".pt")
    return {"model": spec, "config": CONFIGS[config][0], "error": err}, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,llama3-8b:8", help="name[:layers],...")
    ap.add_argument("--configs", default="int2,off,eager,inductor", help=",".join(CONFIGS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--mode", default="reduce-overhead", help="compile mode of the oscar configurations")
    ap.add_argument("--config-timeout", type=int, default=150)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "e2e_h200.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.models.split(","):
            tokens, spec_rows = {}, {}
            for config in args.configs.split(","):
                spec_rows[config], tok = run_isolated(spec, config, args, tmp)
                if tok is not None:
                    tokens[config] = tok
                print(json.dumps(spec_rows[config]), flush=True)
            # greedy tokens against the first BF16 configuration that ran, whatever the order
            ref = next((k for k in ("eager", "inductor", "inductor-ro") if k in tokens), None)
            for config, tok in tokens.items():
                if ref and config != ref:
                    spec_rows[config]["tokens_equal_to"] = {CONFIGS[ref][0]: float((tok == tokens[ref]).float().mean())}
            rows += spec_rows.values()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                                          "transformers": transformers.__version__, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
