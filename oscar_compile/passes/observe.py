"""Observe mode: leave attention as it is and hand the tensors the cache would store to a callback.

Used by calibration, so it sees exactly what the rewrite would quantize, for every model the
matcher supports: before each matched SDPA the pass inserts
``observer.record(layer, q, k_new, v_new, positions)`` (post-RoPE, as written to the cache).
"""

from __future__ import annotations

from typing import Callable

from torch import fx

from .fx_utils import meta
from .matcher import AttentionMatch, GraphAnalysis
from .rewrite import _positions, new_head_major


def insert_observers(gm: fx.GraphModule, analysis: GraphAnalysis, record: Callable,
                     layer_of: Callable[[AttentionMatch], int]) -> int:
    graph = gm.graph
    for m in analysis.matches:
        with graph.inserting_before(m.sdpa):
            positions = _positions(graph, m, meta(m.key_write.new).device)
            k_new, v_new = new_head_major(graph, m.key_write), new_head_major(graph, m.value_write)
            graph.call_function(record, (layer_of(m), m.query, k_new, v_new, positions))
    graph.lint()
    gm.recompile()
    return len(analysis.matches)
