"""Find every SDPA call and the KV-cache writes that feed it, in a Dynamo-level FX graph.

For each ``scaled_dot_product_attention`` node the key and value inputs are traced back through
views that do not change what is read (dtype casts, ``contiguous``, ``repeat_kv``'s
getitem/expand/reshape, ``repeat_interleave``, a leading slice ``[:, :, :n]`` of the sequence
dimension) to a cache tensor, and that tensor to the single write that fills it in this graph:

* ``buf.index_copy_(2, positions, new)``            (transformers ``StaticCache``)
* ``buf[:, :, positions] = new`` / ``buf[:, :, a:b] = new``   (gpt-fast style buffers)
* ``torch.ops.aten.index_put_(buf, [None, None, positions], new)`` (eager ``Tensor.index_put_`` takes no None)
* ``torch.cat((past, new), dim=-2)``                (transformers ``DynamicCache``)

Caches are head-major ``[batch, heads, seq, d]`` or sequence-major ``[batch, seq, heads, d]`` (Meta's
reference Llama, flash-attn style code): the latter are read through ``transpose(1, 2)`` (or
``permute(0, 2, 1, 3)``), possibly after a slice ``[:, :n]``, and written along dim 1 by the same three
idioms (``index_copy_(1, ...)``, ``buf[:, positions] = new``, ``aten.index_put_(buf, [None, positions], new)``).

Anything that does not fit is reported with a reason in plain words and left untouched.
Nothing here changes the graph; :mod:`.rewrite` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .fx_utils import (
    describe,
    is_call,
    is_full_slice,
    is_getitem,
    is_sdpa,
    is_setitem,
    layer_index_from_source,
    meta,
    node_order,
    sdpa_args,
    shape,
    source_name,
)

SEQ_DIM = 2  # SDPA inputs and head-major caches are [batch, heads, seq, head_dim]
SEQ_MAJOR_DIM = 1  # sequence-major caches are [batch, seq, heads, head_dim]
_CASTS = {"contiguous", "clone", "to", "float", "half", "bfloat16", "type_as", "detach"}
_METADATA_READS = {"size", "dim", "numel", "stride", "data_ptr", "element_size", "is_contiguous"}
_WRITE_METHODS = {"index_copy_", "index_put_", "index_copy", "copy_", "scatter_", "fill_", "zero_", "add_"}


@dataclass
class KVRead:
    """How one SDPA input (key or value) reads a cache tensor."""

    buffer: fx.Node
    n_rep: int = 1  # GQA expansion applied on the way (repeat_kv)
    seq_len: Any = None  # a leading slice [:, :, :seq_len] of the sequence, or None (all of it)
    seq_len_arg: Any = None  # the same as it appears in the graph (an int or a SymInt node)
    chain: list[fx.Node] = field(default_factory=list)  # views from the SDPA input back to the buffer
    seq_dim: int = SEQ_DIM  # the buffer's sequence dim: 2 (head-major) or 1 (sequence-major, read transposed)


@dataclass
class CacheWrite:
    kind: str  # index_copy_ | setitem | index_put_ | cat
    node: fx.Node
    buffer: fx.Node  # the tensor written (for cat: the past tensor)
    new: fx.Node  # new keys or values [B, H, T, d] ([B, T, H, d] for a sequence-major cache)
    positions: Any  # an index tensor node, a (start, stop) pair for slice writes, None for cat
    seq_dim: int = SEQ_DIM  # the dim of the buffer (and of ``new``) the positions index


@dataclass
class AttentionMatch:
    index: int  # order of this SDPA among all SDPA calls of the graph
    sdpa: fx.Node
    query: fx.Node
    key_write: CacheWrite
    value_write: CacheWrite
    key_read: KVRead
    value_read: KVRead
    batch: Any
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_len: Any
    key_len: Any  # length of the key view SDPA sees
    max_len: Any  # cache buffer length (None for cat: grows)
    scale: float
    mask: fx.Node | None
    mask_kind: str  # none | bool | additive
    is_causal: bool
    source: str | None  # where the key cache tensor came from, if a graph input
    stub: bool  # the cache tensor has no storage (an OscarCache): it must be rewritten

    @property
    def write_kind(self) -> str:
        return self.key_write.kind

    @property
    def layout(self) -> str:
        return "head-major" if self.key_write.seq_dim == SEQ_DIM else "sequence-major"

    @property
    def source_layer(self) -> int | None:
        return layer_index_from_source(self.source)


@dataclass
class Unmatched:
    node: fx.Node
    kind: str  # "attention" or "cache write"
    reason: str
    stub: bool = False


@dataclass
class GraphAnalysis:
    matches: list[AttentionMatch]
    unmatched: list[Unmatched]
    num_sdpa: int


class _NoMatch(Exception):
    def __init__(self, reason: str, stub: bool = False):
        super().__init__(reason)
        self.reason, self.stub = reason, stub


def _is_stub(node: fx.Node) -> bool:
    v = meta(node)
    return isinstance(v, torch.Tensor) and v.dim() == 4 and v.numel() > 1 and all(s == 0 for s in v.stride())


def _int(x) -> int | None:
    return x if isinstance(x, int) else None


def _same(a, b) -> bool:
    """Equal sizes, including symbolic ones that are the same expression."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:
        return a is b


def _known_le(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a <= b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a <= b))
    except Exception:
        return False


def _is_read_guard(node: fx.Node) -> bool:
    from .. import ops  # noqa: F401  (registers the op)

    guard = torch.ops.oscar.cache_read_guard
    return node.op == "call_function" and node.target in (guard, guard.default)


_ATEN_INDEX_PUT = (torch.ops.aten.index_put_, torch.ops.aten.index_put_.default)


def _is_index_put(node: fx.Node) -> bool:
    """``buf.index_put_(...)``, or ``torch.ops.aten.index_put_(buf, [None, ..., positions], new)`` (eager
    ``index_put_`` takes no ``None`` index; the aten op does)."""
    return (is_call(node, "index_put_") or is_call(node, "index_put")
            or (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _ATEN_INDEX_PUT))


def _is_seq_head_swap(node: fx.Node) -> bool:
    """``x.transpose(1, 2)`` (any spelling) or ``x.permute(0, 2, 1, 3)`` of a 4-D ``x``."""
    if not isinstance(node, fx.Node) or not node.args or len(shape(node.args[0]) or ()) != 4:
        return False
    if is_call(node, "transpose") or is_call(node, fn=torch.transpose):
        dims = node.args[1:3]
        return len(dims) == 2 and {d % 4 for d in dims if isinstance(d, int)} == {1, 2}
    if is_call(node, "permute") or is_call(node, fn=torch.permute):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return [d % 4 if isinstance(d, int) else d for d in dims] == [0, 2, 1, 3]
    return False


def trace_read(node: fx.Node) -> KVRead:
    """Walk back from an SDPA key/value input to the tensor it reads."""
    read = KVRead(buffer=node)
    cur = node
    while isinstance(cur, fx.Node):
        src = cur.args[0] if cur.args else None
        if read.seq_dim == SEQ_DIM and _is_seq_head_swap(cur):
            # a sequence-major cache seen head-major: what lies behind is indexed [batch, seq, heads, d]
            read.seq_dim = SEQ_MAJOR_DIM
            read.chain.append(cur)
            cur = src
            continue
        if cur.op == "call_method" and cur.target in _CASTS and shape(src) == shape(cur):
            read.chain.append(cur)
            cur = src
            continue
        if _is_read_guard(cur):
            read.chain.append(cur)
            cur = src
            continue
        # repeat_kv: x[:, :, None, :, :].expand(B, H, n, L, d).reshape(B, H * n, L, d)
        if read.seq_dim == SEQ_DIM and (is_call(cur, "reshape") or is_call(cur, "view")):
            exp = src
            if is_call(exp, "expand") and is_getitem(exp.args[0]):
                gi = exp.args[0]
                idx = gi.args[1]
                x = gi.args[0]
                sx, so = shape(x), shape(cur)
                if (isinstance(idx, tuple) and len(idx) >= 3 and idx[2] is None and all(is_full_slice(i) for i in idx[:2])
                        and all(is_full_slice(i) for i in idx[3:]) and sx and so and len(sx) == 4 and len(so) == 4
                        and _int(sx[1]) and _int(so[1]) and so[1] % sx[1] == 0
                        and _same(so[0], sx[0]) and _same(so[2], sx[2]) and _same(so[3], sx[3])):
                    read.n_rep *= so[1] // sx[1]
                    read.chain += [cur, exp, gi]
                    cur = x
                    continue
        if is_call(cur, "repeat_interleave"):
            reps = cur.args[1] if len(cur.args) > 1 else cur.kwargs.get("repeats")
            dim = cur.args[2] if len(cur.args) > 2 else cur.kwargs.get("dim")
            head_dims = (1, -3) if read.seq_dim == SEQ_DIM else (2, -2)
            if isinstance(reps, int) and dim in head_dims:
                read.n_rep *= reps
                read.chain.append(cur)
                cur = src
                continue
        if is_getitem(cur) and isinstance(cur.args[1], tuple):
            idx, sd = cur.args[1], read.seq_dim
            if (sd + 1 <= len(idx) <= 4 and all(is_full_slice(i) for i in idx[:sd])
                    and all(is_full_slice(i) for i in idx[sd + 1:])):
                sl = idx[sd]
                if isinstance(sl, slice) and sl.start in (None, 0) and sl.step in (None, 1):
                    if sl.stop is not None and read.seq_len is None:
                        read.seq_len = meta(sl.stop) if isinstance(sl.stop, fx.Node) else sl.stop
                        read.seq_len_arg = sl.stop
                    read.chain.append(cur)
                    cur = src
                    continue
        if is_call(cur, "narrow") and cur.args[1] in (read.seq_dim, read.seq_dim - 4) and cur.args[2] == 0:
            n = cur.args[3]
            if read.seq_len is None:
                read.seq_len = meta(n) if isinstance(n, fx.Node) else n
                read.seq_len_arg = n
            read.chain.append(cur)
            cur = src
            continue
        break
    read.buffer = cur
    return read


def _positions_of(write: CacheWrite):
    return write.positions


_LAYOUT_NAME = {SEQ_DIM: "[batch, heads, seq, dim]", SEQ_MAJOR_DIM: "[batch, seq, heads, dim]"}


def _parse_write(node: fx.Node, buffer: fx.Node, sd: int = SEQ_DIM) -> CacheWrite:
    """The write ``node`` into ``buffer``, whose sequence dim (as the attention reads it) is ``sd``."""
    bshape = shape(buffer)
    lead = "cache[:, :, positions(, :)] = new" if sd == SEQ_DIM else "cache[:, positions(, :, :)] = new"
    if is_call(node, "index_copy_"):
        _, dim, index, new = (list(node.args) + [None] * 4)[:4]
        dim = node.kwargs.get("dim", dim)
        if dim not in (sd, sd - 4):
            raise _NoMatch(f"index_copy_ writes along dim {dim}, not the sequence dim {sd} of a {_LAYOUT_NAME[sd]} "
                           "cache (the layout the attention reads it in)")
        return CacheWrite("index_copy_", node, buffer, new, index, sd)
    if is_setitem(node):
        _, idx, new = node.args
        if isinstance(idx, tuple) and sd == SEQ_MAJOR_DIM and len(idx) == 2 and isinstance(idx[0], slice):
            idx = (*idx, slice(None))  # cache[:, positions] = new
        if not (isinstance(idx, tuple) and sd + 1 <= len(idx) <= 4 and all(is_full_slice(i) for i in idx[:sd])
                and all(is_full_slice(i) for i in idx[sd + 1:])):
            raise _NoMatch(f"setitem index {describe(node)} is not {lead}")
        pos = idx[sd]
        if isinstance(pos, slice):
            if pos.step not in (None, 1) or pos.start is None or pos.stop is None:
                raise _NoMatch("slice assignment into the cache needs explicit start:stop with step 1")
            pos = (pos.start, pos.stop)
        elif not isinstance(pos, fx.Node):
            raise _NoMatch(f"setitem writes at {pos!r}, not at a position tensor or slice")
        return CacheWrite("setitem", node, buffer, new, pos, sd)
    if _is_index_put(node):
        _, indices, new = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if accumulate:
            raise _NoMatch("index_put_ with accumulate=True adds into the cache; only plain writes are supported")
        want = "(None, None, positions)" if sd == SEQ_DIM else "(None, positions)"
        if not (isinstance(indices, (tuple, list)) and len(indices) == sd + 1 and all(i is None for i in indices[:sd])
                and isinstance(indices[sd], fx.Node)):
            raise _NoMatch(f"index_put_ indices of {describe(node)} are not {want}")
        return CacheWrite("index_put_", node, buffer, new, indices[sd], sd)
    raise _NoMatch(f"{describe(node)} modifies the cache in a way oscar does not model (shape {bshape})")


def _find_write(read: KVRead, sdpa: fx.Node, order: dict) -> CacheWrite:
    """The single write that fills the tensor ``read`` reads, checked to be this SDPA's alone."""
    buf = read.buffer
    stub = _is_stub(buf)
    if is_call(buf, fn=torch.cat):
        tensors = buf.args[0]
        dim = buf.args[1] if len(buf.args) > 1 else buf.kwargs.get("dim", 0)
        if read.seq_dim != SEQ_DIM:
            raise _NoMatch(f"{describe(buf)} grows a [batch, seq, heads, dim] cache by concatenation; only "
                           "head-major caches grown by torch.cat((past, new), dim=-2) are supported")
        if not (isinstance(tensors, (list, tuple)) and len(tensors) == 2 and dim in (SEQ_DIM, SEQ_DIM - 4)):
            raise _NoMatch(f"{describe(buf)} is not torch.cat((past, new), dim=-2)")
        past, new = tensors
        _check_other_users(buf, read, sdpa)
        return CacheWrite("cat", buf, past, new, None)
    if shape(buf) is None or len(shape(buf)) != 4:
        raise _NoMatch(f"the key/value tensor comes from {describe(buf)}, not from a [batch, heads, seq, dim] or "
                       "[batch, seq, heads, dim] cache", stub)
    writes = []
    for user in buf.users:
        if user in read.chain:
            continue
        if is_setitem(user) and user.args[0] is buf:
            writes.append(user)
        elif user.op == "call_method" and user.target in _WRITE_METHODS and user.args[0] is buf:
            writes.append(user)
        elif _is_index_put(user) and user.args[0] is buf:
            writes.append(user)
    if not writes:
        raise _NoMatch(f"SDPA reads {buf.name}, but no write into it happens in this graph (a graph break between "
                       "the cache update and attention?)", stub)
    if len(writes) > 1:
        raise _NoMatch(f"{buf.name} is written {len(writes)} times in this graph ({', '.join(w.name for w in writes)})", stub)
    write = writes[0]
    if order[write] > order[sdpa]:
        raise _NoMatch(f"{write.name} writes {buf.name} after SDPA reads it", stub)
    try:
        parsed = _parse_write(write, buf, read.seq_dim)
    except _NoMatch as e:
        raise _NoMatch(e.reason, stub) from None
    _check_other_users(buf, read, sdpa, skip=write)
    return parsed


def _check_other_users(buf: fx.Node, read: KVRead, sdpa: fx.Node, skip: fx.Node | None = None) -> None:
    """The cache tensor may not be read elsewhere: after the rewrite it no longer holds the tokens.

    Graph outputs are allowed (transformers hands its cache tensors back to Python); they keep the
    model's own buffers, which oscar no longer writes.
    """
    for user in buf.users:
        if user is skip or user is sdpa or user in read.chain or user.op == "output":
            continue
        if user.op == "call_method" and user.target in _METADATA_READS:
            continue
        raise _NoMatch(f"the cache tensor {buf.name} is also used by {describe(user)}; rewriting would change that use",
                       _is_stub(buf))


def _match_one(index: int, sdpa: fx.Node, order: dict) -> AttentionMatch:
    a = sdpa_args(sdpa)
    q, k, v = a["query"], a["key"], a["value"]
    if not all(isinstance(x, fx.Node) for x in (q, k, v)):
        raise _NoMatch("query/key/value are not graph tensors")
    if a["dropout_p"] not in (0, 0.0):
        raise _NoMatch(f"dropout_p={a['dropout_p']!r}: only inference attention (dropout 0) is rewritten")
    if not isinstance(a["is_causal"], bool):
        raise _NoMatch("is_causal is not a constant")
    if a["scale"] is not None and not isinstance(a["scale"], (int, float)):
        raise _NoMatch("the softmax scale is not a constant")
    kr, vr = trace_read(k), trace_read(v)
    stub = _is_stub(kr.buffer) or _is_stub(vr.buffer)
    try:
        if kr.buffer is vr.buffer:
            raise _NoMatch("key and value read the same tensor")
        kw = _find_write(kr, sdpa, order)
        vw = _find_write(vr, sdpa, order)
    except _NoMatch as e:
        raise _NoMatch(e.reason, e.stub or stub) from None

    def fail(reason):
        raise _NoMatch(reason, stub)

    if kw.kind != vw.kind:
        fail(f"keys are written by {kw.kind} but values by {vw.kind}")
    if kw.seq_dim != vw.seq_dim:
        fail("the key cache and the value cache have different layouts")
    if kr.n_rep != vr.n_rep or not _same_len(kr.seq_len, vr.seq_len):
        fail("keys and values are read through different views")
    if kw.kind != "cat":
        if not _same_positions(kw.positions, vw.positions):
            fail(f"keys and values are written at different positions ({describe(kw.node)} vs {describe(vw.node)})")
        if isinstance(kw.positions, fx.Node):
            ps = shape(kw.positions)
            if ps is None or len(ps) not in (1, 2):
                fail(f"write positions {kw.positions.name} have shape {ps}, not [T] or [B, T]")
    qs, ks_new, vs_new = shape(q), shape(kw.new), shape(vw.new)
    bk = shape(kw.buffer) if kw.kind != "cat" else shape(kw.node)
    if kw.seq_dim != SEQ_DIM:  # compare everything head-major
        ks_new, vs_new, bk = (_swap_seq_heads(x) for x in (ks_new, vs_new, bk))
    if not (qs and ks_new and vs_new and bk) or not all(len(s) == 4 for s in (qs, ks_new, vs_new, bk)):
        fail("query, new keys/values or cache are not 4-D [batch, heads, seq, head_dim]")
    b, hq, t, d = qs
    _, hkv, tk, dk = ks_new
    if ks_new != vs_new and not all(_same(x, y) for x, y in zip(ks_new, vs_new)):
        fail(f"new keys {ks_new} and values {vs_new} differ in shape")
    if not (_same(dk, d) and _same(bk[3], d)):
        fail(f"head_dim differs between query ({d}) and keys ({dk})")
    if not _same(bk[1], hkv) or not _same(bk[0], ks_new[0]):
        fail(f"new keys {ks_new} do not fit the cache {bk}")
    if not _same(b, ks_new[0]):
        fail(f"query batch {b} differs from key batch {ks_new[0]}")
    if not _same(t, tk):
        fail(f"{t} queries but {tk} new keys: only self-attention over the cache is rewritten")
    if not (isinstance(hq, int) and isinstance(hkv, int) and isinstance(d, int)):
        fail("head counts or head_dim are symbolic")
    if d % 4:
        fail(f"head_dim {d} is not divisible by 4 (INT2 packing)")
    if kr.n_rep > 1:
        if hkv * kr.n_rep != hq:
            fail(f"repeat_kv expands {hkv} KV heads x{kr.n_rep}, but the query has {hq} heads")
    elif a["enable_gqa"]:
        if hq % hkv:
            fail(f"enable_gqa with {hq} query heads and {hkv} KV heads (not a multiple)")
    elif hq != hkv:
        fail(f"{hq} query heads but {hkv} KV heads without repeat_kv or enable_gqa")
    key_shape = shape(k)
    key_len = key_shape[2]
    mask = a["attn_mask"]
    mask_kind = "none"
    if mask is not None:
        if not isinstance(mask, fx.Node):
            fail("attn_mask is not a tensor")
        mv = meta(mask)
        ms = tuple(mv.shape)
        mask_kind = "bool" if mv.dtype == torch.bool else ("additive" if mv.dtype.is_floating_point else "")
        if not mask_kind:
            fail(f"attn_mask has dtype {mv.dtype}")
        if not (2 <= len(ms) <= 4) or not (_same(ms[-1], key_len) or ms[-1] == 1):
            fail(f"attn_mask shape {ms} does not cover the {key_len} keys")
        if len(ms) >= 3 and not (ms[-3] == 1 or _same(ms[-3], hq)):
            fail(f"attn_mask shape {ms} is per head in a way that does not match {hq} query heads")
    if a["is_causal"] and not _known_le(t, key_len):
        fail(f"is_causal with {t} queries over {key_len} keys: cannot show that queries <= keys")
    if kw.kind != "cat" and mask is None and not a["is_causal"] and kr.seq_len is None:
        fail("attention over the whole preallocated cache without a mask also reads slots that were never written; "
             "oscar attends only to written tokens, so it would not compute the same thing")
    scale = float(a["scale"]) if a["scale"] is not None else d**-0.5
    max_len = None if kw.kind == "cat" else bk[2]
    return AttentionMatch(
        index=index, sdpa=sdpa, query=q, key_write=kw, value_write=vw, key_read=kr, value_read=vr,
        batch=b, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, q_len=t, key_len=key_len, max_len=max_len,
        scale=scale, mask=mask, mask_kind=mask_kind, is_causal=a["is_causal"],
        source=source_name(_stub_root(kw.buffer)), stub=stub,
    )


def _swap_seq_heads(s):
    return (s[0], s[2], s[1], *s[3:]) if s and len(s) == 4 else s


def _stub_root(node: fx.Node) -> fx.Node:
    """An OscarCache stub is written through ``stub.expand(batch, ...)``: its source is the stub's."""
    while is_call(node, "expand") and isinstance(node.args[0], fx.Node) and _is_stub(node.args[0]):
        node = node.args[0]
    return node


def _same_len(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return _same(a, b)


def _same_positions(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return all(x is y or x == y for x, y in zip(a, b))
    return a is b


def _looks_like_cache_write(node: fx.Node) -> bool:
    if is_setitem(node) or _is_index_put(node) or is_call(node, "index_copy_"):
        s = shape(node.args[0]) if node.args else None
        return s is not None and len(s) == 4
    return False


def analyze(gm: fx.GraphModule) -> GraphAnalysis:
    """Match every SDPA node of ``gm`` to its cache writes. Pure: the graph is not changed."""
    order = node_order(gm.graph)
    matches, unmatched = [], []
    sdpas = [n for n in gm.graph.nodes if is_sdpa(n)]
    for i, node in enumerate(sdpas):
        try:
            matches.append(_match_one(i, node, order))
        except _NoMatch as e:
            unmatched.append(Unmatched(node, "attention", e.reason, e.stub))
    # A write feeding two attention calls cannot become one store per attention.
    seen: dict[fx.Node, AttentionMatch] = {}
    for m in list(matches):
        for w in (m.key_write.node, m.value_write.node):
            if w in seen and seen[w] is not m:
                matches.remove(m)
                unmatched.append(Unmatched(m.sdpa, "attention", f"its cache write {w.name} also feeds {seen[w].sdpa.name}", m.stub))
                break
            seen[w] = m
    used = {m.key_write.node for m in matches} | {m.value_write.node for m in matches}
    readers = {}  # cache tensor -> the unmatched attention that reads it
    for u in unmatched:
        a = sdpa_args(u.node)
        for x in (a["key"], a["value"]):
            if isinstance(x, fx.Node):
                readers.setdefault(trace_read(x).buffer, u.node)
    for node in gm.graph.nodes:
        if node not in used and _looks_like_cache_write(node):
            reader = readers.get(node.args[0])
            if reader is not None:
                reason = f"kept because the attention reading it ({reader.name}) is kept"
            elif not sdpas:
                reason = ("this graph has no scaled_dot_product_attention call: the model computes attention another "
                          "way (attn_implementation='eager', or a variant SDPA cannot express, such as Gemma 2's "
                          "logit soft-capping); oscar rewrites SDPA only")
            else:
                reason = "no attention in this graph reads this tensor"
            unmatched.append(Unmatched(node, "cache write", reason, _is_stub(node.args[0])))
    return GraphAnalysis(matches, unmatched, len(sdpas))


def cache_sources(analysis: GraphAnalysis) -> tuple[set[str], set[str]]:
    """Sources (graph inputs) of the cache tensors this graph's rewrite moves to INT2 storage, and of those
    it leaves to be read or written densely. ``torch.cat`` caches are in neither (the rewrite keeps them growing)."""
    int2 = {source_name(w.buffer) for m in analysis.matches for w in (m.key_write, m.value_write) if w.kind != "cat"}
    dense = set()
    for u in analysis.unmatched:
        if u.kind == "attention":
            a = sdpa_args(u.node)
            dense |= {source_name(trace_read(x).buffer) for x in (a["key"], a["value"]) if isinstance(x, fx.Node)}
        elif u.node.args and isinstance(u.node.args[0], fx.Node):
            dense.add(source_name(u.node.args[0]))
    return int2 - {None}, dense - {None}
