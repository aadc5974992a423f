"""End to end on the GPU: transformers' generate() with the oscar backend vs BF16 StaticCache + torch.compile.

Random-weight models with the shapes of SmolLM2-135M and Llama-3-8B (full depth unless ``name:layers``;
real weights do not fit the transfer to the GPU machine), in bf16. Configurations: BF16 StaticCache +
torch.compile (Inductor; what users run: K/V expanded by repeat_kv), OscarCache + oscar backend (INT2),
optionally quantization off (same path, BF16 storage). Both prefill long prompts in chunks (transformers'
``prefill_chunk_size``). Per shape: time to first token and decode tokens/s from one timed generate after
a warm-up, peak GPU memory of that generate, warm-up time, greedy tokens against BF16.

    python benchmarks/e2e_gpu.py --models llama3-8b --configs inductor,int2 --shapes 1x32768,32x8192

Each configuration runs in its own process (a compiler crash costs its rows, not the run). ``--parallel``
runs the configurations' processes at once on one GPU: their warm-ups (compiling, minutes at full depth)
overlap, and the timed generates run one at a time after every process has warmed up for that shape (a
file barrier, then a file lock), so no timing shares the GPU or the CPU with a compile.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
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
    "tiny": dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512),  # checks of this script
}


def make(name, layers=None, max_positions=None, device="cuda"):
    cfg = transformers.LlamaConfig(**SHAPES[name], bos_token_id=1, eos_token_id=2)
    if layers:
        cfg.num_hidden_layers = layers
    if max_positions:
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_positions)
    with torch.device(device):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval().generation_config.disable_compile = True  # we compile ourselves
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model


class _FirstTokenClock(transformers.LogitsProcessor):
    """Records when the prefill's logits are ready (synchronised once): time to first token."""

    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            torch.cuda.synchronize()
            self.first = time.perf_counter()
        return scores


@torch.no_grad()
def timed_generate(model, ids, cache, new, chunk):
    """Greedy ``generate`` of ``new`` tokens with the prompt prefilled in chunks of ``chunk`` tokens:
    (tokens, time to first token in s, decode tokens/s over the remaining steps)."""
    clock = _FirstTokenClock()
    model.generation_config.prefill_chunk_size = chunk if chunk < ids.shape[1] else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         logits_processor=transformers.LogitsProcessorList([clock]))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    return out[:, ids.shape[1]:], clock.first - t0, ids.shape[0] * (new - 1) / max(t1 - clock.first, 1e-9)


def make_cache(model, opts, batch, max_len):
    import oscar_compile

    if opts is None or opts == "eager":
        return transformers.StaticCache(config=model.config, max_cache_len=max_len)
    return oscar_compile.OscarCache(model, max_cache_len=max_len, max_batch_size=batch)


def fresh_compile(model):
    """Forget the graphs (and oscar's INT2 storage) of the previous shape: each shape compiles for itself."""
    torch._dynamo.reset()
    backend = getattr(model, "oscar_backend", None)
    if backend is not None:
        backend.reset()
    torch.cuda.empty_cache()


class _TimingTurn:
    """Serialises the timed part of parallel configuration processes (see the module docstring): wait until
    every process has warmed up for this shape (or died), then time under an exclusive file lock."""

    def __init__(self, sync_dir, configs, me, shape):
        self.dir, self.configs, self.me, self.shape = sync_dir and Path(sync_dir), configs, me, shape

    def __enter__(self):
        if self.dir is None:
            return self
        (self.dir / f"ready_{self.shape}_{self.me}").touch()
        deadline = time.time() + 900
        while time.time() < deadline and not all((self.dir / f"ready_{self.shape}_{c}").exists()
                                                  or (self.dir / f"dead_{c}").exists() for c in self.configs):
            time.sleep(0.5)
        self.lock = open(self.dir / "timing.lock", "w")
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.dir is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.lock.close()


def run_shape(model, name, batch, prompt, new, chunk, mode, label, opts, weights, turn=None):
    fresh_compile(model)
    ids = torch.randint(3, 1000, (batch, prompt), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    max_len = prompt + new + 1
    t0 = time.perf_counter()
    # warm-up: two chunks and two new tokens compile the first-chunk, later-chunk and decode graphs
    warm = ids[:, :min(2 * chunk, prompt)]
    timed_generate(model, warm, make_cache(model, opts, batch, max_len), 2, chunk)
    warm_s = time.perf_counter() - t0
    with turn or contextlib.nullcontext():
        torch.cuda.reset_peak_memory_stats()
        tokens, ttft, tps = timed_generate(model, ids, make_cache(model, opts, batch, max_len), new, chunk)
        peak = torch.cuda.max_memory_allocated()
    row = {"model": name, "layers": model.config.num_hidden_layers, "config": label, "batch": batch,
           "prompt": prompt, "new_tokens": new, "prefill_chunk": chunk, "mode": mode, "ttft_s": ttft,
           "decode_tokens_per_s": tps, "peak_gb": peak / 1e9, "peak_above_weights_gb": (peak - weights) / 1e9,
           "warmup_s": warm_s}
    if isinstance(opts, dict):
        row["layers_rewritten"] = [len(g.rewritten) for g in model.oscar_backend.graphs]
        row["int2_storage_gb"] = model.oscar_backend.kv_bytes / 1e9
    return row, tokens


CONFIGS = {  # key: (label, options, compile mode: None = the --mode argument)
    "int2": ("oscar INT2", {}, None),  # the backend's defaults: keys per channel since 2026-12-05, per token before
    "int2-channel": ("oscar INT2, per-channel keys (pages of 32)", {"key_format": "channel", "page_size": 32}, None),
    "int2-token": ("oscar INT2, per-token keys (pages of 16)", {"key_format": "token"}, None),
    "int2-r8": ("oscar INT2, the INT2 layers' rings in FP8 (ring_format='fp8')", {"ring_format": "fp8"}, None),
    "off": ("oscar, quantize off", {"quantize": False}, None),
    # retrieval heads in BF16: KV head 0 of every other layer (1/16 of the KV heads at 8 a layer, the calibrated share)
    "int2-xh": ("oscar INT2, KV head 0 of every other layer in BF16 (exact_heads; 1/16 of Llama-3-8B's heads)", {"exact_heads": "every-other-layer"}, None),
    "int2-xh8": ("oscar INT2, KV head 0 of every other layer in FP8 (exact_heads, exact_format='fp8')",
                 {"exact_heads": "every-other-layer", "exact_format": "fp8"}, None),
    "eager": ("bf16 StaticCache eager", "eager", None),
    "inductor": ("bf16 StaticCache + inductor (default mode)", None, "default"),
    "inductor-ro": ("bf16 StaticCache + inductor (reduce-overhead)", None, "reduce-overhead"),
}


def child(args):
    """One configuration of one model, every shape, in this process; writes rows and tokens for the parent."""
    import oscar_compile

    name, _, layers = args.child.partition(":")
    label, opts, mode = CONFIGS[args.config]
    mode = mode or args.mode
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    model = make(name, int(layers) if layers else None, max(p for _, p in shapes) + args.new + 8)
    weights = torch.cuda.memory_allocated()
    if isinstance(opts, dict) and opts.get("exact_heads") == "every-other-layer":
        opts = dict(opts, exact_heads={layer: (0,) for layer in range(0, model.config.num_hidden_layers, 2)})
    if opts is None:
        model.compile(mode=None if mode == "default" else mode)
    elif opts != "eager":
        oscar_compile.compile(model, mode=mode, **opts)
    rows, tokens = [], {}
    for batch, prompt in shapes:
        try:
            turn = _TimingTurn(args.sync_dir, args.configs.split(","), args.config, f"{batch}x{prompt}")
            row, tok = run_shape(model, name, batch, prompt, args.new, args.chunk, mode, label, opts, weights, turn)
            tokens[f"{batch}x{prompt}"] = tok.cpu()
        except Exception as e:  # out of memory at a shape BF16 cannot hold, say: reported, the next shape runs
            row = {"model": name, "config": label, "batch": batch, "prompt": prompt, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.save(tokens, args.result + ".pt")
        Path(args.result + ".json").write_text(json.dumps(rows))


def run_isolated(spec, configs, args, tmp) -> dict:
    """Run each configuration in a subprocess (a crash, say a segfault in a compiler, costs only its rows),
    one after another or, with ``--parallel``, at once: config -> (rows, tokens)."""
    import subprocess
    import sys

    sync = Path(tmp) / f"sync_{spec.replace(':', '_')}"
    sync.mkdir(exist_ok=True)
    results, procs = {}, {}

    def start(config):
        result = str(Path(tmp) / f"{spec.replace(':', '_')}_{config}")
        cmd = [sys.executable, __file__, "--child", spec, "--config", config, "--result", result, "--shapes",
               args.shapes, "--new", str(args.new), "--chunk", str(args.chunk), "--mode", args.mode, "--configs",
               ",".join(configs)] + (["--sync-dir", str(sync)] if args.parallel else [])
        with open(result + ".log", "w") as log:  # a file, not a pipe: a pipe nobody reads blocks a chatty child
            procs[config] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), result)

    def finish(config, timeout):
        proc, result = procs.pop(config)
        try:
            proc.wait(timeout=max(timeout, 1))
            err = None if proc.returncode == 0 else f"exit {proc.returncode}: " + Path(result + ".log").read_text().strip()[-600:]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            err = f"timed out after {args.config_timeout} s"
        (sync / f"dead_{config}").touch()  # a parallel sibling waiting for this one's warm-up stops waiting
        rows = json.loads(Path(result + ".json").read_text()) if Path(result + ".json").exists() else []
        tokens = torch.load(result + ".pt") if Path(result + ".pt").exists() else {}
        if err is not None:
            rows.append({"model": spec, "config": CONFIGS[config][0], "error": err})
        results[config] = rows, tokens

    if args.parallel:
        for config in configs:
            start(config)
        deadline = time.time() + args.config_timeout
        while procs:  # reap each as it exits (its dead_ file must appear at once), kill the rest at the deadline
            for config in [c for c, (p, _) in procs.items() if p.poll() is not None or time.time() > deadline]:
                finish(config, deadline - time.time())
            time.sleep(0.5)
    else:
        for config in configs:
            start(config)
            finish(config, args.config_timeout)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3-8b", help="name[:layers],...")
    ap.add_argument("--configs", default="inductor,int2", help=",".join(CONFIGS))
    ap.add_argument("--shapes", default="1x32768,32x8192", help="batch x prompt, ...")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk (transformers' prefill_chunk_size)")
    ap.add_argument("--mode", default="reduce-overhead", help="compile mode of the oscar configurations")
    ap.add_argument("--config-timeout", type=int, default=300)
    ap.add_argument("--parallel", action="store_true", help="warm up the configurations at once (see the docstring)")
    ap.add_argument("--sync-dir", default=None, help=argparse.SUPPRESS)
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
            for config, (rows_c, tokens_c) in run_isolated(spec, args.configs.split(","), args, tmp).items():
                spec_rows[config], tokens[config] = rows_c, tokens_c
                for row in rows_c:
                    print(json.dumps(row), flush=True)
            # greedy tokens against the first BF16 configuration that ran, per shape
            ref = next((k for k in ("inductor", "eager", "inductor-ro") if tokens.get(k)), None)
            for config, per_shape in tokens.items():
                if ref is None or config == ref:
                    continue
                for row in spec_rows[config]:
                    key = f"{row.get('batch')}x{row.get('prompt')}"
                    if key in per_shape and key in tokens[ref]:
                        first = (per_shape[key] == tokens[ref][key]).float()
                        row["tokens_equal_to"] = {CONFIGS[ref][0]: float(first.mean()),
                                                  "first_step": float(first[:, 0].mean())}
            rows += [r for rs in spec_rows.values() for r in rs]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                          "torch": torch.__version__, "transformers": transformers.__version__,
                                          "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
