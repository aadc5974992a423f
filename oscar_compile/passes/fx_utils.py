"""Small helpers for reading Dynamo-level FX graphs (the graph a custom backend receives first)."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def sdpa_args(node: fx.Node) -> dict[str, Any]:
    """SDPA arguments by name, defaults filled in."""
    out = dict(_SDPA_DEFAULTS)
    out.update(zip(_SDPA_PARAMS, node.args))
    out.update(node.kwargs)
    return out


def meta(node: Any):
    """The fake tensor (or value) Dynamo recorded for ``node``; None for non-nodes."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def shape(node: Any) -> tuple | None:
    v = meta(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def is_call(node: Any, method: str | None = None, fn: Any = None) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if method is not None:
        return node.op == "call_method" and node.target == method
    return node.op == "call_function" and node.target is fn


def is_setitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.setitem


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def source_name(node: fx.Node) -> str | None:
    """Where a placeholder's tensor came from (``L['kwargs']['cache'].layers[0].keys``), if known."""
    if node.op == "get_attr":
        return str(node.target)
    if node.op != "placeholder":
        return None
    arg = node.meta.get("grapharg")
    src = getattr(arg, "source", None)
    if src is None:
        return None
    name = getattr(src, "name", None)
    name = name() if callable(name) else name  # a method in older torch, a property in newer
    return name if isinstance(name, str) else str(src)


_INDEX_RE = re.compile(r"\[\s*'?(\d+)'?\s*\]|\.(\d+)(?=\.|$)")


def layer_index_from_source(name: str | None) -> int | None:
    """The layer number in a source path, when it holds exactly one integer subscript."""
    if not name:
        return None
    found = {int(a or b) for a, b in _INDEX_RE.findall(name)}
    return found.pop() if len(found) == 1 else None


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def is_full_slice(x: Any) -> bool:
    return isinstance(x, slice) and x.start in (None, 0) and x.stop is None and x.step in (None, 1)


def describe(node: Any) -> str:
    """A short readable form of a node: ``index_copy_(keys, 2, cache_position, k_embed)``."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op in ("placeholder", "get_attr"):
        return node.name
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))

    def fmt(a):
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, (tuple, list)):
            return "(" + ", ".join(fmt(x) for x in a) + ")"
        if isinstance(a, slice):
            return ":".join("" if v is None else fmt(v) for v in (a.start, a.stop)) + ("" if a.step is None else f":{a.step}")
        return repr(a)

    args = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
    return f"{node.name} = {target}({', '.join(args)})"
