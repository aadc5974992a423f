"""Serving a hand-written gpt-fast-style Llama: its own BF16 static cache vs the oscar backend (INT2).

Both run the same model (``gptfast_model.py``, same seed, so greedy tokens compare): BF16 reads the
model's own head-major cache through ``enable_gqa`` SDPA with a boolean mask (the GQA-native BF16
decode); oscar rewrites every cache write and SDPA and releases the dense buffers it made dead. Each
decode step is one CUDA graph replay (eager ops captured; oscar's rewritten graph runs without Inductor,
so neither side gets Inductor's fusions and the difference is the attention, the store and the KV
bytes). Prefill runs eagerly in chunks of ``--chunk`` tokens.

    python benchmarks/serve_gptfast.py e2e --config oscar --shapes 1x32768,32x8192
    python benchmarks/serve_gptfast.py budget --config bf16 --context 32768 --budget-gb 60

``e2e``: a random prompt prefilled in chunks (time to first token, after one warm-up chunk), then
``--new`` greedy decode steps: tokens/s, peak memory, tokens. ``budget``: the largest batch whose KV
cache fits ``--budget-gb`` at ``--context`` (caches filled with random values, no prefill), then
decode: tokens/s at a fixed memory budget. One JSON line per shape on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gptfast_model import ARGS, Transformer, init_random  # noqa: E402

SINKS, WINDOW, PAGE = 64, 256, 16


def kv_bytes_per_sequence(config: str, a, max_len: int) -> int:
    """KV-cache bytes one sequence of ``max_len`` tokens takes in each method (all layers)."""
    h, d = a.n_kv_heads, a.head_dim
    if config == "bf16":
        return 2 * a.n_layers * h * max_len * d * 2
    pages = math.ceil(max(0, max_len - SINKS - WINDOW) / PAGE)
    per_layer = 2 * (pages * PAGE * h * (d // 4 + 4) + (SINKS + WINDOW) * h * d * 2)  # codes + fp16 (scale, min)
    return a.n_layers * per_layer


class Runner:
    """One model, one method; ``step(tokens, input_pos)`` is the model call (eager or oscar-compiled)."""

    def __init__(self, config: str, model_name: str, device: str):
        self.config, self.device = config, torch.device(device)
        with torch.device(self.device):
            self.model = init_random(Transformer(ARGS[model_name])).to(torch.bfloat16).eval()
        self.a = self.model.a
        self.backend = None
        self.step = self.model

    def setup(self, batch: int, max_len: int, stub: bool = False) -> None:
        """New caches; for oscar also a new backend (the previous shape's graphs and INT2 storage go)."""
        if self.backend is not None:
            self.backend.detach()  # its eager guard: the new caches below are real buffers again
        self.backend = self.step = None
        torch._dynamo.reset()
        self.model.setup_caches(batch, max_len, stub=stub)
        torch.cuda.empty_cache() if self.device.type == "cuda" else None
        self.step = self.model
        if self.config == "oscar":
            import oscar_compile

            # per-token keys: the sizing above counts them (this benchmark predates per-channel keys as the default)
            self.backend = oscar_compile.oscar_backend(inductor=False, num_sinks=SINKS, window=WINDOW, page_size=PAGE,
                                                       key_format="token")
            self.backend.attach(self.model)  # frees the dense buffers the rewrite makes dead
            self.step = torch.compile(self.model, backend=self.backend, dynamic=False)

    def fill_random(self) -> None:
        if self.backend is None:
            for layer in self.model.layers:
                layer.attention.kv_cache.k_cache.normal_()
                layer.attention.kv_cache.v_cache.normal_()
        else:
            from bench_decode import fill_random_int2

            for i, cache in enumerate(self.backend.storage.values()):
                fill_random_int2(cache, seed=i)

    def decode_graph(self, first_tok: torch.Tensor, pos0: int, steps: int):
        """Capture one greedy decode step (model, argmax, position += 1) as a CUDA graph; returns
        ``run()`` that replays it ``steps`` times from ``first_tok`` at ``pos0`` and gives the tokens."""
        tok = first_tok.clone()
        pos = torch.tensor([pos0], device=self.device)
        hist = torch.zeros(tok.shape[0], steps, dtype=torch.long, device=self.device)
        idx = torch.zeros(1, dtype=torch.long, device=self.device)

        def one():
            logits = self.step(tok, pos)
            tok.copy_(logits.argmax(-1, keepdim=True))
            hist.index_copy_(1, idx, tok)
            pos.add_(1)
            idx.add_(1)

        def restart():
            tok.copy_(first_tok)
            pos.fill_(pos0)
            idx.zero_()

        for _ in range(2):  # compile (oscar), Triton JIT, allocator warm-up; rewrites the same positions later
            one()
            restart()
        if self.device.type != "cuda":
            def run():
                restart()
                for _ in range(steps):
                    one()
                return hist.clone()
            return run
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            one()
            restart()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one()
        restart()

        def run():
            restart()
            for _ in range(steps):
                graph.replay()
            return hist.clone()
        return run


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gb(device) -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else float("nan")


def run_e2e(r: Runner, batch: int, prompt: int, new: int, chunk: int, stub: bool) -> dict:
    dev = r.device
    r.setup(batch, prompt + new + 1, stub=stub)
    gen = torch.Generator(device=dev).manual_seed(batch * 100003 + prompt)
    ids = torch.randint(3, r.a.vocab_size, (batch, prompt), device=dev, generator=gen)
    chunk = min(chunk, prompt)
    if prompt % chunk:
        raise ValueError(f"prompt {prompt} is not a multiple of the prefill chunk {chunk}")
    t0 = time.perf_counter()
    with torch.no_grad():
        r.step(ids[:, :chunk], torch.arange(chunk, device=dev))  # warm-up (compiles the chunk graph for oscar)
        _sync(dev)
        warm = time.perf_counter() - t0
        _reset_peak(dev)
        t1 = time.perf_counter()
        for i in range(0, prompt, chunk):
            logits = r.step(ids[:, i:i + chunk], torch.arange(i, i + chunk, device=dev))
        first = logits.argmax(-1, keepdim=True)
        _sync(dev)
        ttft = time.perf_counter() - t1
        t2 = time.perf_counter()
        run = r.decode_graph(first, prompt, new)
        _sync(dev)
        warm += time.perf_counter() - t2
        run()  # once untimed
        _sync(dev)
        t3 = time.perf_counter()
        tokens = run()
        _sync(dev)
        dt = time.perf_counter() - t3
    row = dict(mode="e2e", config=r.config, batch=batch, prompt=prompt, new_tokens=new, prefill_chunk=chunk,
               ttft_s=ttft, decode_tokens_per_s=batch * new / dt, decode_step_ms=1e3 * dt / new,
               peak_gb=_peak_gb(dev), warmup_s=warm, stub_caches=stub, tokens=tokens[:, :16].tolist())
    return _with_kv(r, row, batch, prompt + new + 1)


def _with_kv(r: Runner, row: dict, batch: int, max_len: int) -> dict:
    row["kv_gb"] = batch * kv_bytes_per_sequence(r.config, r.a, max_len) / 1e9
    if r.backend is not None:
        row["int2_storage_gb"] = r.backend.kv_bytes / 1e9
        row["released_gb"] = r.backend.released.nbytes / 1e9
    return row


def kernel_breakdown(run, device, steps: int, top: int = 12) -> list:
    """GPU time a decode step spends in each kernel (us, summed over a step's launches), largest first:
    ``run()`` replays ``steps`` steps under the profiler (CUPTI reports the kernels inside a CUDA graph)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        _sync(device)
    rows = [(e.key, (e.device_time_total if cuda else e.self_cpu_time_total) / steps, e.count / steps)
            for e in prof.key_averages()]
    rows = [x for x in rows if x[1] > 0]
    rows.sort(key=lambda x: -x[1])
    return [dict(kernel=k[:80], us_per_step=round(us, 1), launches_per_step=round(n, 1)) for k, us, n in rows[:top]]


def run_budget(r: Runner, context: int, new: int, budget_gb: float, batch: int | None = None,
               profile: bool = False) -> dict:
    dev = r.device
    max_len = context + new + 1
    per_seq = kv_bytes_per_sequence(r.config, r.a, max_len)
    batch = batch or max(1, int(budget_gb * 1e9 // per_seq))
    r.setup(batch, max_len, stub=r.config == "oscar")
    first = torch.randint(3, r.a.vocab_size, (batch, 1), device=dev)
    with torch.no_grad():
        t0 = time.perf_counter()
        run = r.decode_graph(first, context, new)  # compiles; allocates oscar's INT2 storage
        r.fill_random()
        _sync(dev)
        warm = time.perf_counter() - t0
        run()
        _reset_peak(dev)
        _sync(dev)
        t1 = time.perf_counter()
        run()
        _sync(dev)
        dt = time.perf_counter() - t1
    row = dict(mode="budget", config=r.config, budget_gb=budget_gb, context=context, batch=batch, new_tokens=new,
               decode_tokens_per_s=batch * new / dt, decode_step_ms=1e3 * dt / new, peak_gb=_peak_gb(dev),
               warmup_s=warm)
    if profile:
        with torch.no_grad():
            row["kernels"] = kernel_breakdown(run, dev, new)
    return _with_kv(r, row, batch, max_len)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["e2e", "budget"])
    ap.add_argument("--config", choices=["bf16", "oscar"], required=True)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(ARGS))
    ap.add_argument("--shapes", default="1x32768,32x8192,64x8192,1x131072", help="e2e: batch x prompt, ...")
    ap.add_argument("--stub-shapes", default="", help="e2e shapes whose dense caches are stubs (too large to allocate)")
    ap.add_argument("--contexts", default="8192,32768", help="budget: contexts")
    ap.add_argument("--budget-gb", type=float, default=60.0)
    ap.add_argument("--batch", type=int, default=None, help="budget: this batch instead of the largest that fits")
    ap.add_argument("--profile", action="store_true", help="budget: GPU time per kernel of a decode step")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    r = Runner(args.config, args.model, args.device)
    jobs = []
    if args.mode == "e2e":
        stubs = set(filter(None, args.stub_shapes.split(",")))
        for spec in filter(None, (args.shapes + "," + args.stub_shapes).split(",")):
            b, p = map(int, spec.split("x"))
            jobs.append((spec, lambda b=b, p=p, stub=spec in stubs: run_e2e(r, b, p, args.new, args.chunk, stub)))
    else:
        for ctx in map(int, args.contexts.split(",")):
            jobs.append((f"context {ctx}", lambda ctx=ctx: run_budget(r, ctx, args.new, args.budget_gb, args.batch,
                                                                           args.profile)))
    for what, job in jobs:
        try:
            row = job()
        except Exception as e:  # report the shape that failed (out of memory, say) and go on
            row = {"mode": args.mode, "config": args.config, "shape": what, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
