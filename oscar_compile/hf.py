"""transformers integration: :class:`OscarCache`, a ``StaticCache`` with no BF16 storage.

Each layer's ``keys``/``values`` is a zero-stride stub ``[1, heads, max_cache_len, head_dim]``, expanded
to the batch of each input: Dynamo traces the usual ``StaticCache`` graph (``index_copy_`` at
``arange(T) + cumulative_length``, ``repeat_kv``, a boolean mask), the oscar backend rewrites every write
and read to its INT2 pages, and the stub itself (one element of memory) is never touched. Reading it any
other way fails loudly: eagerly, ``update`` raises; in a graph that oscar did not rewrite, the
``oscar::cache_read_guard`` op raises.

Sizes. ``max_cache_len`` is the most tokens a sequence holds (prompt plus every generated token); a
write past it raises :class:`~oscar_compile.CacheCapacityError` before anything runs (the host follows
each layer's ``cumulative_length``, see :mod:`oscar_compile.passes.capacity`). The batch size is
``max_batch_size`` when given, else that of the first input, as ``StaticCache`` does; a larger batch
later raises. The INT2 storage itself belongs to the backend (one per layer, reused across caches), and so do,
in effect, the position counters: a new cache reuses those of a cache that is gone (:class:`_CounterPool`).
"""

from __future__ import annotations

import gc
import weakref

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from . import ops
from .passes.capacity import forget_counter, known_value, track_counter
from .tensor_parallel import local_kv_heads, tensor_parallel_size


class _CounterPool:
    """Position counters handed from caches that are gone to new ones, layer by layer, at the same addresses.

    A counter is a graph input marked static (each call's ``add_`` must land in it under CUDA graphs), so under
    ``mode="reduce-overhead"`` a counter at a new address makes every CUDA graph that reads it re-record: one new
    cache per request would cost every request a recording (3 s of 16 x 4K prefill on the H100), and after
    ``cudagraph_unexpected_rerecord_limit`` (128) re-records Inductor stops using CUDA graphs for that graph at all.
    Live caches never share a counter: a counter returns here only when its layer is garbage collected."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._out: dict[tuple, int] = {}  # counters held by layers not yet given back

    def reclaim(self, device: torch.device) -> None:
        """Before a new cache takes counters: if none is free but some are out, collect garbage once. A cache
        freed in a reference cycle (the first, whose call compiled the graphs, is) gives its counters back only
        when the cycle collector runs; without it the second cache would take new addresses and re-record."""
        mode = torch.is_inference_mode_enabled()
        if not any(t.is_inference() == mode for t in self._free.get((device, 0), ())) and self._out.get((device, 0)):
            gc.collect()

    def take(self, device: torch.device, layer: int) -> torch.Tensor:
        self._out[device, layer] = self._out.get((device, layer), 0) + 1
        free = self._free.get((device, layer), [])
        # an inference tensor takes in-place updates only in inference mode: reuse a counter in the mode it was made in
        fit = [i for i, t in enumerate(free) if t.is_inference() == torch.is_inference_mode_enabled()]
        if fit:
            t = free.pop(fit[-1])
            forget_counter(t)  # a new owner: nothing of the old cache's positions or storage carries over
            t.zero_()
            return t
        t = torch.zeros((), dtype=torch.long, device=device)
        torch._dynamo.mark_static_address(t)
        return t

    def give(self, device: torch.device, layer: int, t: torch.Tensor) -> None:
        self._out[device, layer] -= 1
        free = self._free.setdefault((device, layer), [])
        # taken last to first: a counter that never advanced was never read by a CUDA graph, so it goes below
        free.insert(len(free) if known_value(t) else 0, t)


_COUNTER_POOL = _CounterPool()


class OscarLayer(StaticLayer):
    """One layer of an :class:`OscarCache`: a stub, a position counter and the host's copy of it."""

    def __init__(self, max_cache_len: int, num_heads: int, head_dim: int, dtype, device, batch_size: int | None,
                 index: int = 0):
        super().__init__(max_cache_len=max_cache_len)
        self.device, self.num_heads, self.batch_size = device, num_heads, batch_size
        self.k_head_dim = self.v_head_dim = head_dim
        # One element of memory, seen as [1, heads, max_cache_len, head_dim] and expanded to each input's batch.
        self.keys = torch.empty(1, dtype=dtype, device=device).expand(1, num_heads, max_cache_len, head_dim)
        self.values = torch.empty(1, dtype=dtype, device=device).expand(1, num_heads, max_cache_len, head_dim)
        device = torch.device(device)
        # the counter of a gone cache's layer `index`, at the address the compiled CUDA graphs recorded
        self.cumulative_length = _COUNTER_POOL.take(device, index)
        weakref.finalize(self, _COUNTER_POOL.give, device, index, self.cumulative_length)
        self._counter = track_counter(self.cumulative_length, 0, owner=self)
        self._rows = None  # rows of the sequences held now
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not torch.compiler.is_compiling():
            raise ops.UnrewrittenCacheError(
                "oscar: OscarCache holds no BF16 tokens and only works inside a model compiled with oscar_backend "
                "(model.compile(backend=oscar_backend(...)) or oscar_compile.compile(model)); use a transformers "
                "StaticCache/DynamicCache to run the model eagerly. If the model is compiled, Dynamo fell back to "
                "eager: TORCH_LOGS=recompiles says why (e.g. torch._dynamo.config.recompile_limit reached)."
            )
        batch, t = key_states.shape[0], key_states.shape[-2]
        keys = self.keys.expand(batch, -1, -1, -1)
        values = self.values.expand(batch, -1, -1, -1)
        positions = torch.arange(t, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(t)
        keys.index_copy_(2, positions, key_states)  # never runs: oscar rewrites it to oscar::store
        values.index_copy_(2, positions, value_states)
        return torch.ops.oscar.cache_read_guard(keys), torch.ops.oscar.cache_read_guard(values)

    def reset(self) -> None:
        # Stubs hold nothing to clear; positions restart at 0 and overwrite the INT2 pages.
        self.cumulative_length.zero_()
        track_counter(self.cumulative_length, 0, owner=self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``b`` continues beam ``beam_idx[b]``; the INT2 rows move (StaticLayer's would
        index the stubs, which hold nothing)."""
        storage = self._counter.storage  # where the compiled graphs wrote this layer's rows
        if storage is not None:
            storage.reorder_rows(beam_idx)

    # Called by the compiled graph's host checks (passes/capacity.py) before every call.
    def _oscar_admit(self, batch: int, start: int) -> None:
        """A call writing ``batch`` rows from position ``start``: it must fit the cache's batch, and a call that
        continues a sequence (``start > 0``) must bring the rows it holds (as a StaticCache's tensors require)."""
        if self.batch_size is None:
            self.batch_size = batch
        if batch > self.batch_size:
            raise ValueError(
                f"oscar: this OscarCache holds {self.batch_size} sequence(s) (its max_batch_size, or the batch of its "
                f"first input) but got a batch of {batch}; use a new OscarCache for this batch, or create it with "
                f"max_batch_size={batch}"
            )
        if start > 0 and self._rows is not None and batch != self._rows:
            raise ValueError(
                f"oscar: this OscarCache holds {self._rows} sequence(s) of {start} tokens, and a batch of {batch} cannot "
                "continue them; call cache.reset() to start new sequences"
            )
        self._rows = batch


def _model_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_geometry(model_or_config) -> tuple[int, int]:
    """(KV heads, head_dim) of a transformers model or config (``head_dim`` when the config sets it)."""
    config = _model_config(model_or_config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class OscarCache(StaticCache):
    """A transformers cache for models compiled with :func:`oscar_compile.oscar_backend`.

    Args:
        model_or_config: the model (its dtype and device are used) or its config.
        max_cache_len: most tokens per sequence: prompt plus every generated token. Writing past it
            raises :class:`~oscar_compile.CacheCapacityError` (nothing is written, nothing is evicted).
        max_batch_size: most sequences at once; ``None`` takes the batch of the first input (as
            ``StaticCache`` does). A larger batch later raises ``ValueError``.
    """

    def __init__(self, model_or_config, max_cache_len: int, max_batch_size: int | None = None, dtype=None, device=None):
        config = _model_config(model_or_config)
        if int(max_cache_len) < 1 or (max_batch_size is not None and int(max_batch_size) < 1):
            raise ValueError(f"oscar: max_cache_len and max_batch_size must be >= 1, got {max_cache_len} and {max_batch_size}")
        super().__init__(config=config, max_cache_len=max_cache_len)
        model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
        dtype = dtype or (model.dtype if model is not None else torch.get_default_dtype())
        device = torch.device(device or (model.device if model is not None else "cpu"))
        heads, head_dim = kv_geometry(config)
        heads = local_kv_heads(heads, tensor_parallel_size(model))
        _COUNTER_POOL.reclaim(device)
        self.layers = [OscarLayer(max_cache_len, heads, head_dim, dtype, device, max_batch_size, i)
                       for i in range(len(self.layers))]

    # transformers 5.17 derives max_batch_size from the layers (a read-only property, deprecated); newer
    # releases store it. Ours is the batch the cache holds: given, or taken from the first input.
    @property
    def max_batch_size(self):
        return self.layers[0].batch_size if self.layers else None

    @max_batch_size.setter
    def max_batch_size(self, value):
        for layer in getattr(self, "layers", ()):
            layer.batch_size = value

    def __repr__(self) -> str:
        l0 = self.layers[0]
        return (f"OscarCache(layers={len(self.layers)}, batch={self.max_batch_size}, kv_heads={l0.num_heads}, "
                f"head_dim={l0.k_head_dim}, max_cache_len={l0.max_cache_len}, no BF16 storage)")


def sliding_windows(model_or_config) -> dict[int, int]:
    """``{layer: window}`` of the layers whose keys are limited to their last ``window`` positions, from the
    config as transformers reads it: ``layer_types`` (``"sliding_attention"``) where the config has them,
    else every layer when ``sliding_window`` is set (Mistral-style configs)."""
    config = _model_config(model_or_config)
    window = getattr(config, "sliding_window", None)
    if not window:
        return {}
    types = getattr(config, "layer_types", None)
    if types is None:  # older configs: Qwen-style use_sliding_window=False keeps the window unused
        if getattr(config, "use_sliding_window", True) is False:
            return {}
        return {i: int(window) for i in range(config.num_hidden_layers)}
    return {i: int(window) for i, kind in enumerate(types) if kind == "sliding_attention"}


def cache_kwarg(model) -> str:
    """transformers >= 5.2x calls the forward argument ``cache``; older 5.x ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_hf_cache(kind: str, model, max_len: int, batch: int):
    """``kind``: oscar (an OscarCache), static or dynamic."""
    from transformers import DynamicCache, StaticCache

    if kind == "oscar":
        return OscarCache(model, max_cache_len=max_len, max_batch_size=batch)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    raise ValueError(f"unknown cache kind {kind!r}")
