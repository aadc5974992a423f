"""Tensor-parallel decode with the oscar backend: tokens/s and KV memory per rank, for 1, 2, ... ranks.

A random-weight Llama-shaped model (``e2e_gpu.py``'s shapes) is saved once, then every rank loads it with
transformers' ``tp_plan="auto"`` (KV heads split over the ranks), compiles it with ``oscar_compile.compile``
(each rank gets the transforms of the KV heads it holds) and runs a prefill plus timed greedy decode steps
into an ``OscarCache``. ``--config bf16`` runs the same model with a BF16 ``StaticCache`` (no oscar),
compiled by Inductor (default mode). The prompt is prefilled in chunks of ``--chunk`` tokens and only the
last position's logits are computed (full logits of 32 x 8K prompts would be 67 GB).
Rank 0 prints one JSON line; ``--out`` appends it to a file.

    torchrun --nproc-per-node 2 benchmarks/tp_gpu.py --model llama3-8b --batch 32 --prompt 8192
    torchrun --nproc-per-node 2 benchmarks/tp_gpu.py --model tiny --device cpu   # gloo, a check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))
from e2e_gpu import make  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", help="a shape of e2e_gpu.py (llama3-8b, smollm2, tiny)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32, help="timed decode steps")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk in tokens")
    ap.add_argument("--config", choices=["oscar", "bf16"], default="oscar")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--weights", default=None, help="directory of the saved random model (default: a temp dir)")
    ap.add_argument("--out", default=None, help="append rank 0's JSON line to this file")
    args = ap.parse_args()

    import transformers

    import oscar_compile
    from oscar_compile.hf import cache_kwarg

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    path = args.weights or os.path.join(tempfile.gettempdir(), f"oscar-tp-{args.model}-{args.layers}")
    if rank == 0 and not (Path(path) / "config.json").exists():
        torch.manual_seed(0)
        make(args.model, args.layers, args.prompt + 2 + args.new, device=device).to(dtype).save_pretrained(path)
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()
    # transformers 5.17 leaves tensors outside the tp_plan (the embedding at world size 1) on the CPU
    for mod in model.modules():
        for tensors in (mod._parameters, mod._buffers):
            for name, t in tensors.items():
                if t is not None and not isinstance(t, DTensor) and t.device != device:
                    tensors[name] = (torch.nn.Parameter(t.to(device), t.requires_grad)
                                     if isinstance(t, torch.nn.Parameter) else t.to(device))
    max_len = args.prompt + 2 + args.new  # prompt, two warm-up steps, the timed steps
    if args.config == "oscar":
        # dynamic=False: Dynamo cannot trace the DTensor embedding with symbolic sizes (torch 2.13)
        oscar_compile.compile(model, mode="reduce-overhead" if cuda else None, dynamic=False,
                              inductor=cuda)
        cache = oscar_compile.OscarCache(model, max_cache_len=max_len, max_batch_size=args.batch)
    else:
        if cuda:  # the baseline a user would run: the same model compiled by Inductor. Not reduce-overhead:
            # Inductor skips CUDA graphs for StaticCache's mutated counters anyway, and that mode
            # segfaults on torch 2.11 + transformers 5.17 (seen on the H200)
            model.compile(dynamic=False)
        cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
    kw = cache_kwarg(model)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))

    def prefill(length):
        for start in range(0, length, args.chunk):
            logits = model(ids[:, start:min(start + args.chunk, length)], **{kw: cache}, use_cache=True,
                           logits_to_keep=1).logits
        return logits.argmax(-1)

    with torch.no_grad():
        # warm-up on two chunks compiles the first-chunk, later-chunk and decode graphs; then the cache is
        # reset and the whole prompt prefilled, timed
        t0 = time.perf_counter()
        tok = prefill(min(2 * args.chunk, args.prompt))
        for _ in range(2):  # compiles the decode graph (and records its CUDA graph)
            tok = model(tok, **{kw: cache}, use_cache=True).logits.argmax(-1)
        _sync(device)
        warm = time.perf_counter() - t0
        cache.reset()
        _sync(device)
        t0 = time.perf_counter()
        first = prefill(args.prompt)
        _sync(device)
        ttft = time.perf_counter() - t0
        tok = first
        for _ in range(2):
            tok = model(tok, **{kw: cache}, use_cache=True).logits.argmax(-1)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(args.new):
            tok = model(tok, **{kw: cache}, use_cache=True).logits.argmax(-1)
        _sync(device)
        step = (time.perf_counter() - t0) / args.new
    kv = model.oscar_backend.kv_bytes if args.config == "oscar" else \
        sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
            if isinstance(t, torch.Tensor))
    row = dict(model=args.model, layers=model.config.num_hidden_layers, config=args.config, world_size=world,
               batch=args.batch, prompt=args.prompt, new_tokens=args.new, device=torch.cuda.get_device_name(device)
               if cuda else "cpu", decode_step_ms=step * 1e3, decode_tokens_per_s=args.batch / step,
               kv_gb_per_rank=kv / 1e9, warmup_s=warm, ttft_s=ttft, prefill_chunk=args.chunk,
               first_tokens=first[:4, 0].tolist(),
               peak_gb_per_rank=torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        row["kv_gb_per_rank"] = max(r["kv_gb_per_rank"] for r in rows)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
