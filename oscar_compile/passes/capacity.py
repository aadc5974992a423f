"""Host-side capacity checks for rewritten graphs: a write past the end of the cache raises before it runs.

A kernel cannot raise, and under CUDA graphs nothing but the graph runs; reading the positions back from
the GPU at every decode step would stall it. But the graph shows where the positions come from, and for
the caches models actually use the host can follow them without reading the device:

* transformers ``StaticCache`` and ``OscarCache`` write at ``arange(T) + cumulative_length`` and advance
  ``cumulative_length.add_(T)`` (a 0-d tensor per layer, a graph input). The host keeps a copy of each
  such counter (:class:`HostCounter`) and advances it by ``T`` after every call. The device value is read
  once, when a counter is first seen or after code outside the graph changed it (its ``_version`` moved:
  ``cache.reset()``, ``crop``); an ``OscarCache`` keeps its copies exact itself and is never read.
* ``DynamicCache`` (``torch.cat``) writes after the past, whose length is a shape.
* a slice write ``cache[:, :, a:b] = new`` has ``a`` and ``b`` in the graph (constants or sizes).
* positions in a tensor the caller passes (gpt-fast's ``input_pos``) are not known without a read:
  there the op checks (the reference raises on CPU; the Triton store drops writes past the cache).

:func:`guard_writes` wraps the compiled graph: before each call it checks ``start + T <= capacity`` for
every rewritten write and raises :class:`~oscar_compile.CacheCapacityError` naming the position, the
capacity and how to size the cache. Nothing has run then: no row, and no counter, has changed.
For an :class:`~oscar_compile.OscarCache` it also admits the batch (the cache sizes itself from its first
input). Each counter remembers the INT2 storage its sequences were written to: beam search reorders it,
a continuing call whose graph uses another storage moves the rows there first, and a cache continued
after another cache wrote that storage is refused.
"""

from __future__ import annotations

import logging
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels.store import CacheCapacityError
from .fx_utils import is_call, meta

log = logging.getLogger("oscar_compile.capacity")

# ----------------------------------------------------------------------------- host copies of position counters


class HostCounter:
    """The host's copy of a 0-d position counter tensor (transformers' ``cumulative_length``).

    ``owner`` (weak) is the cache layer that manages the counter, when it cooperates (``OscarLayer``):
    it sets :attr:`value` itself on ``reset`` and admits batches. :attr:`storage` is the INT2 storage the
    sequences at these positions were written to (beam search reorders it; a graph built for another cache
    size that continues them gets them moved to its own storage).
    """

    __slots__ = ("value", "version", "_owner", "buffer_ptr", "storage", "__weakref__")

    def __init__(self, value: int, version: int | None, owner=None):
        self.value, self.version = value, version
        self._owner = weakref.ref(owner) if owner is not None else None
        self.buffer_ptr: int | None = None  # the cache tensor written at these positions (foreign caches)
        self.storage = None

    @property
    def owner(self):
        return self._owner() if self._owner is not None else None


_COUNTERS = WeakIdKeyDictionary()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter: trust the host copy
        return None


def track_counter(t: torch.Tensor, value: int, owner=None) -> HostCounter:
    """Record that counter ``t`` holds ``value`` now (no device read). Returns its host copy."""
    c = _COUNTERS.get(t)
    if c is None:
        c = _COUNTERS[t] = HostCounter(value, _version(t), owner)
    else:
        c.value, c.version = value, _version(t)
    return c


def forget_counter(t: torch.Tensor) -> None:
    """Drop what the host knows of counter ``t`` (its value, owner and storage): it is being reused by a new cache."""
    _COUNTERS.pop(t, None)


def known_value(t: torch.Tensor) -> int | None:
    """The host's copy of counter ``t``'s value, None if it has none (no device read)."""
    c = _COUNTERS.get(t)
    return None if c is None else c.value


def host_counter(t: torch.Tensor) -> HostCounter:
    """The host copy of ``t``; read from the device only if unknown or changed outside compiled graphs."""
    c = _COUNTERS.get(t)
    version = _version(t)
    if c is None or (version is not None and c.version != version):
        return track_counter(t, int(t.item()), c.owner if c is not None else None)
    return c


# ----------------------------------------------------------------------------- integers known at run time


@dataclass(frozen=True)
class RuntimeInt:
    """An integer of the graph: a constant, or an expression in sizes bound from the call's arguments."""

    const: int | None = None
    expr: Any = None
    getters: tuple = ()  # (symbol, getter(args) -> int)

    def __call__(self, args) -> int:
        if self.const is not None:
            return self.const
        if len(self.getters) == 1 and self.expr == self.getters[0][0]:
            return int(self.getters[0][1](args))
        return int(self.expr.xreplace({s: sympy.Integer(get(args)) for s, get in self.getters}))

    def __str__(self) -> str:
        return str(self.const if self.const is not None else self.expr)


def _symbol_getters(gm: fx.GraphModule) -> dict:
    """Each bare size symbol of the graph -> how to read its value from the call's arguments."""
    out: dict = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        v = meta(node)
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            out.setdefault(v.node.expr, lambda a, i=i: a[i])
        elif isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    out.setdefault(size.node.expr, lambda a, i=i, d=d: a[i].shape[d])
    return out


def _runtime_int(value, getters: dict) -> RuntimeInt | None:
    """``value``: an int, a SymInt, or a graph node holding one. None if it cannot be computed on the host."""
    if isinstance(value, fx.Node):
        value = meta(value)
    if isinstance(value, int):
        return RuntimeInt(const=int(value))
    if not isinstance(value, torch.SymInt):
        return None
    expr = value.node.expr
    if expr.is_number:
        return RuntimeInt(const=int(expr))
    if not all(s in getters for s in expr.free_symbols):
        return None
    return RuntimeInt(expr=expr, getters=tuple((s, getters[s]) for s in expr.free_symbols))


# ----------------------------------------------------------------------------- one check per rewritten write


@dataclass
class WriteCheck:
    """What the host checks before one rewritten cache write runs."""

    slot: str
    new_tokens: RuntimeInt  # T
    capacity: RuntimeInt  # tokens the cache holds per row
    batch: RuntimeInt | None
    how_to_size: str
    counter: int | None = None  # argument index of the position counter (transformers caches)
    advances: tuple = ()  # amounts this graph adds to that counter
    start: RuntimeInt | None = None  # first position, when it is a size or constant (cat, slice writes)
    buffer: int | None = None  # argument index of the cache tensor (to notice one replaced mid-sequence)
    storage: Any = None  # the PagedInt2KVCache it writes

    def first_position(self, args) -> tuple[int, HostCounter | None]:
        if self.counter is None:
            return self.start(args), None
        c = host_counter(args[self.counter])
        return c.value, c


def _counter_positions(positions, placeholders: dict):
    """``arange(T) + counter`` (transformers' static layers): (counter placeholder, T) or None."""
    if not (isinstance(positions, fx.Node) and (
            (positions.op == "call_function" and positions.target in (operator.add, torch.add))
            or is_call(positions, "add"))):
        return None
    a, b = positions.args[:2]
    for ar, ctr in ((a, b), (b, a)):
        if (is_call(ar, fn=torch.arange) and len(ar.args) == 1 and isinstance(ctr, fx.Node) and ctr in placeholders):
            v = meta(ctr)
            if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point():
                return ctr, ar.args[0]
    return None


def _advances(counter: fx.Node, getters: dict) -> tuple | None:
    """What the graph adds to ``counter`` (``counter.add_(T)``); None if an amount is not known on the host."""
    out = []
    for user in counter.users:
        if is_call(user, "add_") and user.args[0] is counter:
            amount = _runtime_int(user.args[1], getters)
            if amount is None:
                return None
            out.append(amount)
    return tuple(out)


def plan_checks(gm: fx.GraphModule, rewritten, grow_capacity: int) -> list[WriteCheck]:
    """A :class:`WriteCheck` for every rewritten write whose start position the host can know."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    getters = _symbol_getters(gm)
    checks = []
    for r in rewritten:
        m, kw = r.match, r.match.key_write
        t = _runtime_int(m.q_len, getters)
        batch = _runtime_int(m.batch, getters)
        if kw.kind == "cat":
            past = meta(kw.buffer)
            start = _runtime_int(past.shape[2], getters) if isinstance(past, torch.Tensor) and past.dim() == 4 else \
                RuntimeInt(const=0)
            check = WriteCheck(r.slot, t, RuntimeInt(const=grow_capacity), batch,
                               f"caches that grow (DynamicCache) get INT2 storage for max_seq_len={grow_capacity} tokens: "
                               "pass a larger max_seq_len to oscar_backend", start=start, storage=r.storage)
        else:
            capacity = _runtime_int(m.max_len, getters)
            how = ("size the cache for the prompt plus every new token: OscarCache(model, max_cache_len=...) or "
                   "StaticCache(config, max_cache_len=...)")
            counted = _counter_positions(kw.positions, placeholders)
            if counted is not None:
                counter, amount = counted
                advances = _advances(counter, getters)
                if advances is None:
                    continue
                check = WriteCheck(r.slot, _runtime_int(amount, getters), capacity, batch, how,
                                   counter=placeholders[counter], advances=advances, storage=r.storage,
                                   buffer=placeholders.get(_root(kw.buffer)))
            elif isinstance(kw.positions, tuple):  # cache[:, :, a:b] = new
                start = _runtime_int(kw.positions[0], getters)
                check = WriteCheck(r.slot, t, capacity, batch, how, start=start, storage=r.storage)
            else:
                continue  # positions from a tensor the caller passes: the op checks them
        if check.new_tokens is None or check.capacity is None or (check.counter is None and check.start is None):
            continue
        checks.append(check)
    return checks


def _root(node: fx.Node) -> fx.Node:
    """The placeholder behind a batch ``expand`` of an OscarCache stub (the node itself otherwise)."""
    while is_call(node, "expand") and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


# ----------------------------------------------------------------------------- the wrapper


def _admit(check: WriteCheck, args) -> tuple[int, HostCounter | None]:
    """Everything that can refuse the call, before anything changes: (first position, position counter)."""
    start, counter = check.first_position(args)
    t = check.new_tokens(args)
    capacity = check.capacity(args)
    owner = counter.owner if counter is not None else None
    if owner is not None:
        if check.batch is not None:
            owner._oscar_admit(check.batch(args), start)
    elif counter is not None and check.buffer is not None:
        _check_same_buffer(check, counter, args[check.buffer], start)
    storage = check.storage
    if getattr(storage, "sliding_window", None) and t > storage.max_chunk:
        raise CacheCapacityError(
            f"oscar: {check.slot}: a sliding-window layer takes at most max_chunk={storage.max_chunk} new tokens a call "
            f"(its store returns them with the window of {storage.sliding_window} before them), got {t}. Nothing was "
            "written; prefill long prompts in chunks (generate(..., prefill_chunk_size=N) in transformers), or "
            "compile with a larger oscar_backend(max_chunk=...)."
        )
    if start + t > capacity:
        what = f"{t} new tokens at positions {start}..{start + t - 1}" if t != 1 else f"a token at position {start}"
        raise CacheCapacityError(
            f"oscar: {check.slot}: the KV cache is full - writing {what} needs {start + t} positions, but the cache "
            f"holds {capacity} tokens per sequence (positions 0..{capacity - 1}). Nothing was written; {check.how_to_size}."
        )
    if counter is not None and start > 0 and counter.storage is not None:
        writer = _WRITERS.get(counter.storage)
        if writer is not None and writer() is not counter:
            raise RuntimeError(
                f"oscar: {check.slot}: another cache wrote this cache's INT2 storage since its last call. A backend "
                "keeps one batch of sequences per cache size: finish one cache's sequences (or reset it) before "
                "using another cache of the same size, or compile a second model for the second cache."
            )
    return start, counter


_WRITERS = weakref.WeakKeyDictionary()  # INT2 storage -> (weak) the position counter whose sequences it holds


def _follow_storage(check: WriteCheck, counter: HostCounter, args, start: int) -> None:
    """The sequences at ``counter``'s positions live in ``counter.storage``; this call writes ``check.storage``.

    They differ when Dynamo runs a continuing call with a graph built for another cache size (the prefill
    graph of one compile, the decode graph of a later one, each with storage for its own sizes): the rows
    move over first, on the device. Rare (once per such switch), so exact storage for static sizes stays safe.
    """
    if start > 0 and counter.storage is not None and counter.storage is not check.storage:
        rows = check.batch(args) if check.batch is not None else check.storage.max_batch_size
        log.info("oscar: %s: sequences continue in another INT2 storage (%s -> %s): moving %d rows of %d tokens",
                 check.slot, counter.storage.max_seq_len, check.storage.max_seq_len, rows, start)
        counter.storage.copy_rows_to(check.storage, rows, start)
    counter.storage = check.storage
    _WRITERS[check.storage] = weakref.ref(counter)


def _check_same_buffer(check: WriteCheck, counter: HostCounter, buffer: torch.Tensor, start: int) -> None:
    """A foreign cache (transformers StaticCache) whose tensor was replaced mid-sequence: beam search's
    ``reorder_cache`` does that, and the INT2 rows cannot follow it."""
    ptr = buffer.data_ptr()
    if counter.buffer_ptr is not None and counter.buffer_ptr != ptr and start > 0:
        raise RuntimeError(
            f"oscar: {check.slot}: the cache tensor was replaced in the middle of a sequence (transformers' "
            "reorder_cache does that for beam search); oscar keeps the tokens in its INT2 storage, which cannot "
            "follow. Use oscar_compile.OscarCache: its reorder_cache reorders the INT2 rows."
        )
    counter.buffer_ptr = ptr


def guard_writes(fn: Callable, checks: list[WriteCheck]) -> Callable:
    """``fn`` (the compiled graph) preceded by the host checks of ``checks`` and followed by counter updates.

    Host work at every call, decode steps included: about 3 us a layer (91 us a step for a 30-layer model
    on the CI machine's CPU; under CUDA graphs that is beside the replay, not inside it).
    """
    if not checks:
        return fn

    def run(*args):
        admitted = [(check, *_admit(check, args)) for check in checks]  # may raise: nothing has changed yet
        counted = {}
        for check, start, counter in admitted:
            if counter is not None:
                _follow_storage(check, counter, args, start)
                counted.setdefault(id(counter), (check, counter))
        out = fn(*args)
        for check, counter in counted.values():  # one update per counter, however many writes share it
            counter.value += sum(a(args) for a in check.advances)
            counter.version = _version(args[check.counter])
        return out

    run.__wrapped__ = fn
    return run
