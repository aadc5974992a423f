"""The graph-rewrite debugging tool: what oscar matched, what it rewrote, what it left and why.

    report = oscar_compile.explain(model, input_ids, max_new_tokens=1)   # prefill + one decode step
    print(report)            # per graph: each attention call, its cache write, heads, mask, slot
    print(report.diff())     # the graphs before and after, as a unified diff

The same summaries go to the ``oscar_compile`` logger: ``TORCH_LOGS="oscar_compile"`` prints them
with torch's own logs, ``TORCH_LOGS="+oscar_compile"`` adds the before/after diffs.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from .backend import CompiledGraph, OscarBackend, oscar_backend


def _fmt(x) -> str:
    return str(x) if not isinstance(x, torch.SymInt) else str(x.node.expr)


def format_graph_summary(rec: CompiledGraph) -> str:
    a = rec.analysis
    lines = [f"graph {rec.index}: {a.num_sdpa} attention call(s), {len(rec.rewritten)} rewritten, "
             f"{sum(u.kind == 'attention' for u in a.unmatched)} attention / "
             f"{sum(u.kind == 'cache write' for u in a.unmatched)} cache write(s) left unchanged"]
    if rec.rewritten:
        header = f"  {'#':>3}  {'sdpa node':<22} {'slot':<10} {'cache write':<12} {'q/kv heads':<10} {'d':>4}  {'queries':<8} {'mask':<9} {'causal':<6} {'scale':<8}"
        lines.append(header)
        for r in rec.rewritten:
            m = r.match
            heads = f"{m.num_q_heads}/{m.num_kv_heads}"
            write = m.write_kind + (" [B,T,H,d]" if m.layout == "sequence-major" else "")  # head-major unmarked
            exact = getattr(r.storage, "exact", None)  # retrieval heads kept in BF16 beside the INT2 ones
            split = "" if exact is None else (f"  KV heads {','.join(map(str, exact.exact_heads))} BF16, "
                                              f"{','.join(map(str, exact.int2_heads))} INT2")
            lines.append(
                f"  {m.index:>3}  {m.sdpa.name:<22} {r.slot:<10} {write:<12} {heads:<10} {m.head_dim:>4}  "
                f"{_fmt(m.q_len):<8} {m.mask_kind:<9} {'yes' if m.is_causal else 'no':<6} {m.scale:<8.4g}{split}"
            )
    for u in a.unmatched:
        lines.append(f"  left unchanged: {u.kind} {u.node.name}: {u.reason}")
    return "\n".join(line.rstrip() for line in lines)


def graph_diff(before: str, after: str, context: int = 2) -> str:
    diff = difflib.unified_diff(before.strip().splitlines(), after.strip().splitlines(), "before", "after",
                                n=context, lineterm="")
    return "\n".join(diff)


@dataclass
class ExplainReport:
    graphs: list[CompiledGraph]
    backend: OscarBackend

    @property
    def num_rewritten(self) -> int:
        return sum(len(g.rewritten) for g in self.graphs)

    @property
    def num_unmatched(self) -> int:
        return sum(len(g.unmatched) for g in self.graphs)

    def summary(self) -> str:
        return "\n".join(format_graph_summary(g) for g in self.graphs) or "no graph was compiled"

    def diff(self) -> str:
        return "\n\n".join(f"=== graph {g.index}\n{graph_diff(g.before, g.after)}" for g in self.graphs)

    def before(self, index: int = 0) -> str:
        return self.graphs[index].before

    def after(self, index: int = 0) -> str:
        return self.graphs[index].after

    def __str__(self) -> str:
        return self.summary()


def explain(model, *args, backend: OscarBackend | None = None, max_new_tokens: int | None = None,
            cache: str = "oscar", max_cache_len: int | None = None, **kwargs) -> ExplainReport:
    """Compile ``model`` with the oscar backend on the given input and report every graph.

    For a plain callable or ``nn.Module``: ``explain(fn, *args, **kwargs)`` compiles and calls it once.
    For a transformers causal LM with ``max_new_tokens``: runs ``generate`` (prefill and decode
    graphs) with ``cache`` = ``"oscar"`` (an OscarCache), ``"static"`` or ``"dynamic"``.
    The rewritten graphs run eagerly (no Inductor) unless ``backend`` says otherwise.
    """
    backend = backend or oscar_backend(inductor=False)
    start = len(backend.graphs)
    if max_new_tokens is not None:
        input_ids = args[0] if args else kwargs.pop("input_ids")
        _explain_generate(model, input_ids, backend, max_new_tokens, cache, max_cache_len, **kwargs)
    else:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            compiled(*args, **kwargs)
    return ExplainReport(backend.graphs[start:], backend)


def _explain_generate(model, input_ids, backend, max_new_tokens, cache, max_cache_len, **kwargs):
    from .hf import cache_kwarg, make_hf_cache

    if cache not in ("oscar", "static", "dynamic"):
        raise ValueError(f"oscar explain: cache must be oscar, static or dynamic, got {cache!r}")
    torch._dynamo.reset()
    length = max_cache_len or (input_ids.shape[-1] + max_new_tokens + 1)
    kv = make_hf_cache(cache, model, length, input_ids.shape[0])
    kw = cache_kwarg(model)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(input_ids, **{kw: kv}, use_cache=True, **kwargs)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(max_new_tokens):
            out = compiled(tok, **{kw: kv}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
