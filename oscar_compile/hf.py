"""transformers integration: :class:`OscarCache`, a ``StaticCache`` with no BF16 storage.

Each layer's ``keys``/``values`` is a zero-stride stub of the full static shape: Dynamo traces the
usual ``StaticCache`` graph (``index_copy_`` at the cache positions, ``repeat_kv``, a boolean mask),
the oscar backend rewrites every write and read to its INT2 pages, and the stub itself (one element
of memory) is never touched. Reading it any other way fails loudly: eagerly, ``update`` raises; in a
graph that oscar did not rewrite, the ``oscar::cache_read_guard`` op raises.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from . import ops


class OscarLayer(StaticLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        if not torch.compiler.is_compiling():
            raise ops.UnrewrittenCacheError(
                "oscar: OscarCache holds no BF16 tokens and only works inside a model compiled with oscar_backend "
                "(model.compile(backend=oscar_backend(...)) or oscar_compile.compile(model)); use a transformers "
                "StaticCache/DynamicCache to run the model eagerly."
            )
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return torch.ops.oscar.cache_read_guard(keys), torch.ops.oscar.cache_read_guard(values)

    def reset(self) -> None:
        # Stubs hold nothing to clear; positions restart at 0 and overwrite the INT2 pages.
        self.cumulative_length.zero_()


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
        max_cache_len: longest sequence (prompt + generated tokens).
        max_batch_size: batch size it will be used with.
    """

    def __init__(self, model_or_config, max_cache_len: int, max_batch_size: int = 1, dtype=None, device=None):
        config = _model_config(model_or_config)
        if getattr(config, "sliding_window", None) and any(
                t == "sliding_attention" for t in (getattr(config, "layer_types", None) or [])):
            raise ValueError("oscar: OscarCache does not support sliding-window attention layers yet")
        super().__init__(config=config, max_cache_len=max_cache_len)
        model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
        dtype = dtype or (model.dtype if model is not None else torch.get_default_dtype())
        device = torch.device(device or (model.device if model is not None else "cpu"))
        heads, head_dim = kv_geometry(config)
        self.max_batch_size = max_batch_size
        layers = []
        for _ in self.layers:
            layer = OscarLayer(max_cache_len=max_cache_len)
            layer.device, layer.batch_size, layer.num_heads = device, max_batch_size, heads
            layer.k_head_dim = layer.v_head_dim = head_dim
            # One element of memory, seen as the full [batch, heads, max_cache_len, head_dim] cache.
            layer.keys = torch.empty(1, dtype=dtype, device=device).expand(max_batch_size, heads, max_cache_len, head_dim)
            layer.values = torch.empty(1, dtype=dtype, device=device).expand(max_batch_size, heads, max_cache_len, head_dim)
            layer.cumulative_length = torch.zeros((), dtype=torch.long, device=device)
            torch._dynamo.mark_static_address(layer.cumulative_length)
            layer.is_initialized = True
            layers.append(layer)
        self.layers = layers

    # transformers 5.17 derives max_batch_size from the layers (a read-only property); newer releases
    # store it. Ours is the batch the stubs were made for, in both.
    @property
    def max_batch_size(self):
        return getattr(self, "_oscar_max_batch_size", None)

    @max_batch_size.setter
    def max_batch_size(self, value):
        self._oscar_max_batch_size = value

    def __repr__(self) -> str:
        l0 = self.layers[0]
        return (f"OscarCache(layers={len(self.layers)}, batch={self.max_batch_size}, kv_heads={l0.num_heads}, "
                f"head_dim={l0.k_head_dim}, max_cache_len={l0.max_cache_len}, no BF16 storage)")


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
