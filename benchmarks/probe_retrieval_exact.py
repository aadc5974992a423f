"""Where does INT2 history cost the retrieval answer? Re-run `oscar eval`'s retrieval with some of the cache read
back exactly: keys or values, of some layers (and KV heads), everything else as the default stores it.

CPU only (the reference ops). A shadow copy of every stored token in the cache's own transformed basis is kept
beside the INT2 pages (``store_reference`` is wrapped), and ``gather_history`` returns the shadow instead of the
dequantized pages for the chosen layers, heads and side. Sinks and the ring are exact anyway, so only INT2 history
changes. With nothing chosen the run is the default's, bit for bit (the check below).

    python benchmarks/probe_retrieval_exact.py --variants K V K0-9 V0-9 -- --model smollm2-135m \\
        --ppl-contexts "" --retrieval-lengths 2048 --retrieval-samples 6 --retrieval-depths 0.1,0.5 --device cpu

A variant is ``K`` or ``V`` (or ``KV``), then optional layers ``a-b`` or ``a,b,...``, then optional ``h`` and KV
heads (``K0-9h0,1``). Each writes one eval JSON whose method is renamed ``default exact <variant>``; pair them
against a BF16 run of the same prompts with ``retrieval_nll_pairs.py``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

import oscar_compile.kernels.attention as attention_mod
import oscar_compile.ops as ops_mod
from oscar_compile import cli
from oscar_compile.kernels.store import transform_rows

_orig_store = ops_mod.store_reference
_orig_gather = attention_mod.gather_history

# data_ptr of a layer's k_sink / v_sink -> (layer index, side); shadow[(layer, side)] = [B, T, H, d] float32
_layer_of: dict[int, tuple[int, str]] = {}
_shadow: dict[tuple[int, str], torch.Tensor] = {}
_chosen = {"sides": "", "layers": None, "heads": None, "pairs": None}


def parse_variant(v: str) -> dict:
    pairs = re.fullmatch(r"(KV|K|V):((?:\d+\.\d+,?)+)", v)  # KV:3.1,7.0: (layer, KV head) pairs
    if pairs:
        chosen = {tuple(map(int, p.split("."))) for p in pairs.group(2).strip(",").split(",")}
        return {"sides": pairs.group(1), "layers": {a for a, _ in chosen}, "heads": None, "pairs": chosen}
    m = re.fullmatch(r"(KV|K|V)([0-9,\-]*)(?:h([0-9,\-]+))?", v)
    if not m:
        raise SystemExit(f"bad variant {v!r}")

    def numbers(s):
        if not s:
            return None
        out = set()
        for part in s.split(","):
            a, _, b = part.partition("-")
            out.update(range(int(a), int(b or a) + 1))
        return out

    return {"sides": m.group(1), "layers": numbers(m.group(2)), "heads": numbers(m.group(3)), "pairs": None}


def _write_shadow(layer: int, side: str, x_t: torch.Tensor, pos: torch.Tensor) -> None:
    b, t, h, d = x_t.shape
    need = int(pos.max()) + 1
    cur = _shadow.get((layer, side))
    if cur is None or cur.shape[0] < b or cur.shape[1] < need:
        grown = torch.zeros(max(b, 0 if cur is None else cur.shape[0]), max(need, 0 if cur is None else cur.shape[1]),
                            h, d)
        if cur is not None:
            grown[: cur.shape[0], : cur.shape[1]] = cur
        cur = _shadow[(layer, side)] = grown
    for row in range(b):
        ok = pos[row] >= 0
        cur[row, pos[row][ok]] = x_t[row][ok]


def store_with_shadow(k, v, positions, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring,
                      block_table, key_transform, key_mean, value_transform, value_mean, *rest):
    # a layer is known by its sink tensors (its codes may be empty: a sliding-window layer has no pages)
    for sink, side in ((k_sink, "k"), (v_sink, "v")):
        if sink.data_ptr() not in _layer_of:
            _layer_of[sink.data_ptr()] = (len(_layer_of) // 2, side)  # layers store in order, k then v
    layer = _layer_of[k_sink.data_ptr()][0]
    b, _, t, _ = k.shape
    pos = positions.long().expand(b, t) if positions.dim() == 1 else positions.long()
    _write_shadow(layer, "k", transform_rows(k, key_transform, key_mean), pos)
    _write_shadow(layer, "v", transform_rows(v, value_transform, value_mean), pos)
    return _orig_store(k, v, positions, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring,
                       block_table, key_transform, key_mean, value_transform, value_mean, *rest)


def gather_with_shadow(geo, codes, meta, sink, ring, block_table, lengths, max_len, kind, steps=False):
    out = _orig_gather(geo, codes, meta, sink, ring, block_table, lengths, max_len, kind, steps)
    layer, side = _layer_of.get(sink.data_ptr(), (None, None))
    c = _chosen
    if layer is None or side.upper() not in c["sides"] or (c["layers"] is not None and layer not in c["layers"]):
        return out
    x, step = out if steps else (out, None)
    sh = _shadow[(layer, side)]
    n = min(max_len, sh.shape[1])
    heads = sorted(c["heads"]) if c["heads"] is not None else list(range(x.shape[2]))
    if c["pairs"] is not None:
        heads = sorted(h for a, h in c["pairs"] if a == layer)
    valid = (torch.arange(n)[None, :] < lengths[:, None])[..., None, None]
    x[:, :n, heads] = torch.where(valid, sh[: x.shape[0], :n, heads].to(x.dtype), x[:, :n, heads])
    if step is not None:  # exact keys have no rounding noise to debias
        step[:, :n, heads] = torch.where(valid, 0.0, step[:, :n, heads])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--method", default="default")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default="probe_exact")
    ap.add_argument("eval_args", nargs=argparse.REMAINDER, help="after --: the `oscar eval` arguments")
    args = ap.parse_args()
    eval_args = [a for a in args.eval_args if a != "--"]
    ops_mod.store_reference = store_with_shadow
    attention_mod.gather_history = gather_with_shadow
    for v in args.variants:
        _chosen.update(parse_variant(v) if v != "none" else {"sides": "", "layers": None, "heads": None, "pairs": None})
        _layer_of.clear()
        _shadow.clear()
        stem = f"{args.stem}_{re.sub(r'[^A-Za-z0-9_-]', '_', v)[:60]}"
        cli.main(["eval", *eval_args, "--methods", args.method, "--out", args.out, "--name", stem])
        path = Path(args.out) / f"{stem}.json"
        report = json.loads(path.read_text())
        for r in report["retrieval"]:
            r["method"] = f"{args.method} exact {v}"
        report["probe"] = {"variant": v, "layers_seen": len(_layer_of) // 2,
                           **{k: sorted(s) if isinstance(s, set) else s for k, s in _chosen.items()}}
        path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
