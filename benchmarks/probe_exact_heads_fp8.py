"""Retrieval heads stored in FP8 instead of BF16: an accuracy probe before any storage or kernel work.

The backend keeps a model's retrieval heads (``exact_heads``) in a BF16 companion cache. Each such head costs
~13 bits an element more than an INT2 one, so Gemma 3's second head (``exact_heads=1/8``, which closes its 32K gap)
costs 0.74 bits at 32K. FP8 (e4m3, one scale per token and head, as FP8 KV caches store it) would cost about half.
Would it keep the heads' accuracy? This runs ``oscar eval`` unchanged except for one thing: the rewrite rounds the
keys and values that the BF16 companion stores (and the new chunk attention reads) through FP8 and back, for a copy
of the last method, named ``... fp8 heads``. Everything else, the INT2 heads included, is the real backend.

    PYTHONPATH=$PWD python3 benchmarks/probe_exact_heads_fp8.py --model gemma3-270m --methods bf16,default:xh0.125 \
        --ppl-contexts 2048 --ppl-sequences 32 --retrieval-lengths 2048 --out benchmarks/results --name NAME

(every ``oscar eval`` argument is taken; the last method in ``--methods``, tagged ``:xh`` or ``:xh<share>``, is run
twice: BF16 heads, then FP8 heads). 2026-12-06, Gemma 3 at 2K, ``:xh0.125``: 32 x 64 took 33 minutes on one CPU
thread, 48 retrieval prompts 25 minutes a method.
The report's bits count the FP8 copy's heads as BF16 (the probe changes values, not storage).
"""

from __future__ import annotations

import dataclasses
import re
import sys

import torch

from oscar_compile import cli, evaluation
from oscar_compile.backend import resolve_exact_heads
from oscar_compile.passes import rewrite

FP8_MAX = 448.0  # e4m3's largest finite value
_state = {"fp8": False, "whole_layers": set()}  # set per method as its session starts


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_dim] through float8_e4m3fn and back, one absmax scale per vector (token and head)."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


_store = rewrite._store


def _store_fp8(graph, gm, cache, layer, prefix, k_new, v_new, positions):
    # the BF16 companion of a layer's retrieval heads, or a layer whose every KV head is one (a BF16 layer then:
    # Gemma 3's layers 5 and 11 hold one KV head each)
    whole = re.fullmatch(r"_oscar_layer_(\d+)", prefix)  # `layer` is the storage's own index (0): the slot names it
    if _state["fp8"] and (prefix.endswith("_exact") or (whole and int(whole[1]) in _state["whole_layers"])):
        k_new, v_new = (graph.call_function(fp8_round_trip, (x,)) for x in (k_new, v_new))
    return _store(graph, gm, cache, layer, prefix, k_new, v_new, positions)


_session_init = evaluation.Session.__init__


def _session_init_fp8(self, model, method, *args, **kwargs):
    _state["fp8"] = method.name.endswith("fp8 heads")  # graphs are traced after this, at the session's first call
    _state["whole_layers"] = set()
    if _state["fp8"]:
        heads = resolve_exact_heads(method.options["exact_heads"], method.artifacts)
        kv_heads = method.artifacts.fingerprint["num_kv_heads"]
        _state["whole_layers"] = {layer for layer, hs in heads.items() if len(hs) == kv_heads}
        print(f"probe_exact_heads_fp8: FP8 retrieval heads {heads}; whole layers {sorted(_state['whole_layers'])}")
    _session_init(self, model, method, *args, **kwargs)


_run_eval = evaluation.run_eval


def _run_eval_fp8(model, tok, methods, *args, **kwargs):
    last = methods[-1]
    if last.kind != "oscar" or not last.options.get("exact_heads"):
        raise SystemExit(f"probe_exact_heads_fp8: the last method ({last.name}) keeps no retrieval heads")
    return _run_eval(model, tok, [*methods, dataclasses.replace(last, name=f"{last.name} fp8 heads")], *args, **kwargs)


def main() -> int:
    rewrite._store = _store_fp8
    evaluation.Session.__init__ = _session_init_fp8
    evaluation.run_eval = _run_eval_fp8  # cli's eval imports it at call time
    return cli.main(["eval", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
