"""Rewrite matched attention in place: cache writes -> ``oscar::store``, SDPA -> ``oscar::attention``.

For each :class:`~.matcher.AttentionMatch` the pass

1. inserts one ``oscar.store(k_new, v_new, positions, <INT2 cache>, <transforms>)`` right before the
   later of the two cache writes (both new tensors exist there, and it precedes the SDPA, so the
   write-before-read order of the original graph is kept); the transformed chunk it returns goes
   to the attention, which reads the new tokens exactly (and depends on the store through it);
2. replaces the SDPA node by ``oscar.attention(q, q_positions, seq_lens, <INT2 cache>, ...)`` with the
   same semantics: ``seq_lens`` = newest written position + 1; for ``is_causal`` (SDPA aligns it
   top-left: query ``t`` sees keys ``<= t`` of the view) the query positions are ``arange(T)``;
   masks pass through (they index logical key positions); a sliced key view ``[:n]`` without a
   mask becomes a mask of ``n`` ones;
   the new keys and values are detached first: no gradient flows through the INT2 cache (a
   backward pass through ``oscar.attention`` raises :class:`~oscar_compile.ops.InferenceOnlyError`);
   a layer with retrieval heads in BF16 (the backend's ``exact_heads``: ``cache.exact``) gets one store and one
   attention per part, each on its own heads (``index_select``), and the outputs go back in head order;
3. erases the original writes and the views that only fed the SDPA. Nothing else is touched: a
   blanket dead-code elimination would delete transformers' ``cumulative_length.add_``.

The INT2 cache and transform tensors enter the graph as buffers of ``gm`` (``get_attr``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from .. import ops  # noqa: F401  (registers torch.ops.oscar)
from ..cache import PagedInt2KVCache
from .fx_utils import meta
from .matcher import _METADATA_READS, SEQ_DIM, AttentionMatch, CacheWrite, GraphAnalysis, _is_read_guard


@dataclass
class Rewritten:
    match: AttentionMatch
    slot: str  # which INT2 storage it reads and writes (e.g. "layer 3")
    store: fx.Node  # the INT2 part's store where the layer's retrieval heads are stored apart (exact_heads)
    attention: fx.Node
    storage: PagedInt2KVCache | None = None  # that storage


class RewriteError(RuntimeError):
    """The rewritten graph would not compute what the original computes; nothing is run."""


def _register(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> fx.Node:
    """Expose ``tensor`` to the graph as a buffer of ``gm`` (``get_attr``), with a Dynamo source."""
    if not hasattr(gm, name):
        gm.register_buffer(name, tensor, persistent=False)
        if hasattr(gm, "_param_name_to_source"):  # AOTAutograd needs one for every lifted buffer
            from torch._dynamo.source import ConstantSource

            gm._param_name_to_source[name] = ConstantSource(f"oscar:{name}")
    elif getattr(gm, name) is not tensor:
        raise RewriteError(f"oscar: buffer name {name} already taken on the graph module")
    return gm.graph.get_attr(name)


def _erase_if_dead(graph: fx.Graph, nodes) -> None:
    for n in nodes:
        if n.graph is graph and not n.users:
            graph.erase_node(n)
        elif n.graph is graph and _is_read_guard(n) and all(
                u.op == "call_method" and u.target in _METADATA_READS for u in n.users):
            # An OscarCache read whose result is only measured (``keys.size()`` in a symbolic-length graph):
            # the stub has the same shape, and the guard would raise if it stayed.
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)


def rewrite(
    gm: fx.GraphModule,
    analysis: GraphAnalysis,
    storage_for: Callable[[AttentionMatch], tuple[PagedInt2KVCache, int, str]],
) -> list[Rewritten]:
    """Apply the rewrite to every match. ``storage_for(match) -> (cache, layer, slot name)``."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = []
    for m in analysis.matches:
        cache, layer, slot = storage_for(m)
        prefix = f"_oscar_{slot.replace(' ', '_').replace('.', '_')}"
        kw, vw = m.key_write, m.value_write
        later = max(kw.node, vw.node, key=order.__getitem__)
        device = meta(kw.new).device

        with graph.inserting_before(later):
            positions = _positions(graph, m, device)
            # Detached: the INT2 cache is inference-only, and in grad mode AOTAutograd would otherwise
            # trace a backward through store (a mutating op, which cannot have an autograd formula).
            k_new, v_new = (graph.call_method("detach", (new_head_major(graph, w),)) for w in (kw, vw))
        parts = [(cache, prefix, None)]
        if cache.exact is not None:  # retrieval heads in a BF16 companion: each part stores and reads its heads
            parts = [(cache, prefix, cache.exact.int2_heads), (cache.exact.cache, f"{prefix}_exact", cache.exact.exact_heads)]
        with graph.inserting_before(m.sdpa):
            mask = _mask(graph, m, device)
        outputs, stores = [], []
        for part, part_prefix, heads in parts:
            with graph.inserting_before(later):
                k_part, v_part = k_new, v_new
                if heads is not None:
                    kv_index = _register(gm, f"{part_prefix}_heads", torch.tensor(heads, device=device))
                    k_part, v_part = (graph.call_method("index_select", (x, 1, kv_index)) for x in (k_new, v_new))
                cache_nodes, t_nodes, store = _store(graph, gm, part, layer, part_prefix, k_part, v_part, positions)
                k_chunk, v_chunk = (graph.call_function(operator.getitem, (store, i)) for i in (0, 1))
                stores.append(store)
            with graph.inserting_before(m.sdpa):
                query, part_mask = m.query, mask
                if heads is not None:
                    q_index = _register(gm, f"{part_prefix}_query_heads", _query_heads(heads, m).to(device))
                    query = graph.call_method("index_select", (query, 1, q_index))
                    if mask is not None and meta(mask).dim() == 4 and meta(mask).shape[1] > 1:
                        part_mask = graph.call_method("index_select", (mask, 1, q_index))
                outputs.append(_attend(graph, m, part, device, query, positions, cache_nodes, t_nodes, part_mask,
                                       k_chunk, v_chunk))
        with graph.inserting_before(m.sdpa):
            if len(outputs) == 1:
                attn = outputs[0]
            else:  # the parts' heads back in the model's order
                inverse = torch.cat([_query_heads(heads, m) for _, _, heads in parts]).argsort()
                both = graph.call_function(torch.cat, (outputs, 1))
                attn = graph.call_method("index_select", (both, 1, _register(gm, f"{prefix}_head_order",
                                                                               inverse.to(device))))
        m.sdpa.replace_all_uses_with(attn)
        graph.erase_node(m.sdpa)
        _erase_if_dead(graph, m.key_read.chain + m.value_read.chain)
        for w in (kw, vw):
            if w.kind == "cat":
                _erase_if_dead(graph, [w.node])
            else:
                w.node.replace_all_uses_with(w.buffer)  # in-place writes return the buffer itself
                graph.erase_node(w.node)
        done.append(Rewritten(m, slot, stores[0], attn, cache))
    try:
        graph.lint()
    except Exception as e:  # pragma: no cover - a bug in this pass, never a user error
        raise RewriteError(f"oscar: the rewritten graph is malformed: {e}") from e
    gm.recompile()
    return done


def _store(graph, gm, cache, layer, prefix, k_new, v_new, positions):
    """``oscar.store`` of ``k_new, v_new`` into ``cache``: (its cache nodes, its transform nodes, the store node, whose
    outputs are the chunk k', v')."""
    cache_nodes = [_register(gm, f"{prefix}_{name}", t) for name, t in zip(
        ("k_codes", "k_meta", "v_codes", "v_meta", "k_sink", "v_sink", "k_ring", "v_ring"), cache.layers[layer].tensors())]
    cache_nodes.append(_register(gm, f"{prefix}_block_table", cache.block_table))
    tr = cache.transforms[layer]
    t_nodes = {name: _register(gm, f"{prefix}_{name}", getattr(tr, name)) for name in tr._tensor_names()}
    feedback = cache.store_key_feedback(tr)  # error-feedback rounding of per-channel keys, if calibrated
    store = graph.call_function(
        torch.ops.oscar.store.default,
        (k_new, v_new, positions, *cache_nodes, t_nodes["key_transform"], t_nodes["key_mean"],
         t_nodes["value_transform"], t_nodes["value_mean"], cache.store_key_clip(tr), float(tr.value_clip),
         None if feedback is None else _register(gm, f"{prefix}_key_feedback", feedback)),
    )
    return cache_nodes, t_nodes, store


def _attend(graph, m: AttentionMatch, cache, device, query, positions, cache_nodes, t_nodes, mask, k_chunk, v_chunk):
    """``oscar.attention`` of ``query`` over ``cache`` (what replaces the SDPA)."""
    last = graph.call_method("amax", (positions, -1))
    seq_lens = graph.call_method("reshape", (graph.call_function(operator.add, (last, 1)), -1))
    if m.is_causal:
        t = graph.call_method("size", (query, 2))
        q_positions = graph.call_function(torch.arange, (t,), {"device": device})
    else:
        q_positions = positions
    return graph.call_function(
        torch.ops.oscar.attention.default,
        (query, q_positions, seq_lens, *cache_nodes, t_nodes["query_transform"], t_nodes["output_transform"],
         t_nodes["value_mean"], mask, bool(m.is_causal), float(m.scale), k_chunk, v_chunk, positions,
         float(cache.score_debias)),
    )


def _query_heads(kv_heads, m: AttentionMatch) -> torch.Tensor:
    """The query heads that read ``kv_heads`` (GQA: query head ``h`` reads KV head ``h // group``), in order."""
    group = meta(m.query).shape[1] // m.num_kv_heads
    return torch.tensor([h * group + i for h in kv_heads for i in range(group)], dtype=torch.long)


def new_head_major(graph: fx.Graph, w: CacheWrite) -> fx.Node:
    """The new keys or values of a write as ``[B, H, T, d]`` (a sequence-major cache is written ``[B, T, H, d]``)."""
    return w.new if w.seq_dim == SEQ_DIM else graph.call_method("transpose", (w.new, 1, 2))


def _positions(graph: fx.Graph, m: AttentionMatch, device) -> fx.Node:
    """Absolute positions of the new tokens, as a graph tensor ``[T]`` or ``[B, T]``."""
    kw = m.key_write
    if kw.kind == "cat":
        past = kw.buffer
        ps = meta(past).shape
        past_len = graph.call_method("size", (past, 2)) if len(ps) == 4 else 0
        t = graph.call_method("size", (kw.new, 2))
        end = graph.call_function(operator.add, (past_len, t))
        return graph.call_function(torch.arange, (past_len, end), {"device": device})
    if isinstance(kw.positions, tuple):
        start, stop = kw.positions
        return graph.call_function(torch.arange, (start, stop), {"device": device})
    return kw.positions


def _mask(graph: fx.Graph, m: AttentionMatch, device):
    if m.mask is not None:
        ms = meta(m.mask).shape
        if ms[-1] == 1 and m.key_len != 1:  # broadcast over keys: make it explicit for the op
            n = m.key_read.seq_len_arg if m.key_read.seq_len_arg is not None else m.key_len
            return graph.call_method("expand", (m.mask, *([-1] * (len(ms) - 1)), n))
        return m.mask
    if m.key_read.seq_len is not None and not m.is_causal:
        # SDPA over cache[:, :, :n] without a mask: the first n keys
        return graph.call_function(torch.ones, ((1, 1, 1, m.key_read.seq_len_arg),), {"dtype": torch.bool, "device": device})
    return None
