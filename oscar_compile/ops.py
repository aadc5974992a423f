"""The two ``torch.library`` ops of oscar-compile (namespace ``oscar``).

* ``oscar::store``     mutates the cache tensors of one layer (declared exactly in ``mutates_args``)
                       and returns the transformed chunk ``(k', v')`` that attention reads exactly.
* ``oscar::attention`` reads them and returns the attention output ``[B, Hq, T, d]``.

The default implementation (every device) is the plain-PyTorch reference in ``kernels/``; the
Triton kernels register themselves for CUDA on top (``kernels/triton_*``) when Triton and a GPU are
present. Fake implementations run the same shape checks so a bad rewrite fails while tracing.
Argument meanings are in :mod:`oscar_compile.kernels.store` and :mod:`oscar_compile.kernels.attention`.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from .kernels.attention import attention_reference
from .kernels.checks import channel_pages_supported, check_attention, check_store, is_channel_key_meta
from .kernels.sliding import history_len
from .kernels.store import store_reference

CACHE_ARG_NAMES = ("k_codes", "k_meta", "v_codes", "v_meta", "k_sink", "v_sink", "k_ring", "v_ring", "block_table")
STORE_MUTATED = CACHE_ARG_NAMES[:-1]  # everything but the block table


@torch.library.custom_op("oscar::store", mutates_args=STORE_MUTATED)
def store(
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    k_codes: Tensor,
    k_meta: Tensor,
    v_codes: Tensor,
    v_meta: Tensor,
    k_sink: Tensor,
    v_sink: Tensor,
    k_ring: Tensor,
    v_ring: Tensor,
    block_table: Tensor,
    key_transform: Tensor,
    key_mean: Tensor,
    value_transform: Tensor,
    value_mean: Tensor,
    key_clip: float,
    value_clip: float,
    key_feedback: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    return store_reference(
        k, v, positions, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
        key_transform, key_mean, value_transform, value_mean, key_clip, value_clip, key_feedback,
    )


@store.register_fake
def _store_fake(
    k, v, positions, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
    key_transform, key_mean, value_transform, value_mean, key_clip, value_clip, key_feedback=None,
):
    cache = (k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table)
    geo = check_store(k, v, positions, cache, key_transform, key_mean, value_transform, value_mean, key_clip,
                      value_clip, key_feedback)
    b, h, t, d = k.shape
    t = t + history_len(geo.drops_evicted, geo.window, t)  # a chunk with the window before it (kernels/sliding.py)
    return k.new_empty((b, t, h, d), dtype=k_sink.dtype), v.new_empty((b, t, h, d), dtype=v_sink.dtype)


@torch.library.custom_op("oscar::attention", mutates_args=())
def attention(
    q: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    k_codes: Tensor,
    k_meta: Tensor,
    v_codes: Tensor,
    v_meta: Tensor,
    k_sink: Tensor,
    v_sink: Tensor,
    k_ring: Tensor,
    v_ring: Tensor,
    block_table: Tensor,
    query_transform: Tensor,
    output_transform: Tensor,
    value_mean: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: float,
    k_chunk: Optional[Tensor] = None,
    v_chunk: Optional[Tensor] = None,
    chunk_positions: Optional[Tensor] = None,
    debias: float = 0.0,
) -> Tensor:
    return attention_reference(
        q, positions, seq_lens, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
        query_transform, output_transform, value_mean, attn_mask, is_causal, scale, k_chunk, v_chunk, chunk_positions,
        debias,
    )


@attention.register_fake
def _attention_fake(
    q, positions, seq_lens, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
    query_transform, output_transform, value_mean, attn_mask, is_causal, scale, k_chunk=None, v_chunk=None,
    chunk_positions=None, debias=0.0,
) -> Tensor:
    cache = (k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table)
    check_attention(q, positions, seq_lens, cache, query_transform, output_transform, value_mean, attn_mask, scale,
                    k_chunk, v_chunk, chunk_positions, debias)
    return q.new_empty(q.shape)  # contiguous, like the real output


class InferenceOnlyError(RuntimeError):
    """A backward pass reached the INT2 KV cache, which has no gradient."""


@torch.library.custom_op("oscar::inference_only", mutates_args=())
def inference_only(grad: Tensor) -> Tensor:
    """The gradient of ``oscar::attention``: raises when a backward pass actually runs it.

    A forward in grad mode (the default outside ``torch.no_grad()``) must work, so attention has an
    autograd formula; AOTAutograd traces that formula while compiling such a forward (through the fake
    below, which returns a placeholder). Only running it means someone asked for a gradient.
    """
    raise InferenceOnlyError(
        "oscar: the INT2 KV cache is inference-only: no gradient flows through oscar::attention or oscar::store "
        "(quantized, rotated history). Run the model under torch.no_grad() or torch.inference_mode(); to train "
        "or fine-tune, run it without the oscar backend (a transformers DynamicCache or StaticCache)."
    )


@inference_only.register_fake
def _inference_only_fake(grad):
    return grad.new_empty(grad.shape)


def _attention_setup_context(ctx, inputs, output) -> None:
    pass


def _attention_backward(ctx, grad):
    # q is the only input a model's weights reach with a gradient; store's outputs (k_chunk, v_chunk) get
    # none, so a backward never reaches oscar::store (a mutating op cannot have an autograd formula).
    return (torch.ops.oscar.inference_only(grad),) + (None,) * 21


torch.library.register_autograd("oscar::attention", _attention_backward, setup_context=_attention_setup_context)


def triton_supported(head_dim: int, num_groups: int, channel_page: int = 0) -> bool:
    """Shapes the Triton kernels take (tl.dot needs d/4 >= 16; tl.arange needs powers of two). ``channel_page``:
    the page size of a cache with per-channel keys (0: per-token keys), whose pages must hold 16, 32, ... tokens."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return head_dim in (64, 128, 256) and pow2(num_groups) and (channel_page == 0 or channel_pages_supported(channel_page))


def _channel_page(k_codes: Tensor, k_meta: Tensor) -> int:
    return k_codes.shape[1] if is_channel_key_meta(k_codes, k_meta) else 0


class ReferenceUnderCaptureError(RuntimeError):
    """The reference ops (host-synchronizing) were reached while a CUDA graph was being captured."""


log = logging.getLogger("oscar_compile")
_FALLBACKS_REPORTED: set = set()


def _reference_on_cuda(op: str, head_dim: int, num_groups: int, channel_page: int) -> None:
    """The Triton kernels do not take this shape: say so once (the reference is slower and synchronizes with the
    host), and refuse clearly under CUDA-graph capture, where the reference's host reads would fail obscurely."""
    if channel_page and not channel_pages_supported(channel_page):
        why = f"per-channel keys in pages of {channel_page} (the kernels take powers of two of at least 16)"
    else:
        why = f"head_dim {head_dim} with {num_groups} value groups (the kernels take head_dim 64/128/256)"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ReferenceUnderCaptureError(
            f"oscar::{op}: {why} runs on the reference ops, which synchronize with the host and cannot be captured "
            "in a CUDA graph; compile without mode='reduce-overhead', or choose a shape the Triton kernels take")
    if (op, why) not in _FALLBACKS_REPORTED:
        _FALLBACKS_REPORTED.add((op, why))
        log.warning(
            "oscar::%s on CUDA: %s is not taken by the Triton kernels; the reference ops serve it (slower, "
            "synchronizes with the host every call)", op, why)


def _register_triton_kernels() -> bool:
    """Make the Triton kernels the CUDA implementation of both ops (the reference stays the fallback for shapes the
    kernels do not take)."""
    import os

    if os.environ.get("OSCAR_KERNELS", "triton") == "reference":
        return False
    try:
        from .kernels.triton_attention import attention_triton
        from .kernels.triton_store import store_triton
    except Exception as e:  # no usable Triton: the reference serves CUDA too
        log.warning("oscar: Triton kernels unavailable (%s); using the reference ops", e)
        return False

    # OSCAR_TRITON_STORE=0 stores through the reference on CUDA (the oracle; it syncs with the host, so
    # not for CUDA graphs): a switch for bisecting a suspected kernel bug.
    triton_store = os.environ.get("OSCAR_TRITON_STORE", "1") != "0"

    @store.register_kernel("cuda")
    def _store_cuda(k, v, positions, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
                    key_transform, key_mean, value_transform, value_mean, key_clip, value_clip, key_feedback=None):
        args = (k, v, positions, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
                key_transform, key_mean, value_transform, value_mean, key_clip, value_clip, key_feedback)
        shape = (k.shape[-1], v_meta.shape[-1] // 2, _channel_page(k_codes, k_meta))
        if triton_store and triton_supported(*shape):
            return store_triton(*args)
        if triton_store:
            _reference_on_cuda("store", *shape)
        return store_reference(*args)

    @attention.register_kernel("cuda")
    def _attention_cuda(q, positions, seq_lens, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring,
                        block_table, query_transform, output_transform, value_mean, attn_mask, is_causal, scale,
                        k_chunk=None, v_chunk=None, chunk_positions=None, debias=0.0):
        args = (q, positions, seq_lens, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
                query_transform, output_transform, value_mean, attn_mask, is_causal, scale, k_chunk, v_chunk,
                chunk_positions, debias)
        shape = (q.shape[-1], v_meta.shape[-1] // 2, _channel_page(k_codes, k_meta))
        if triton_supported(*shape):
            return attention_triton(*args)
        _reference_on_cuda("attention", *shape)
        return attention_reference(*args)

    return True


TRITON_ON_CUDA = torch.cuda.is_available() and _register_triton_kernels()


class UnrewrittenCacheError(RuntimeError):
    """A graph read an OscarCache tensor that oscar_backend did not rewrite (it holds no data)."""


@torch.library.custom_op("oscar::cache_read_guard", mutates_args=())
def cache_read_guard(x: Tensor) -> Tensor:
    """Marks a read of an :class:`~oscar_compile.OscarCache` key/value stub.

    The oscar backend removes it together with the attention it feeds. If it ever runs, the stub
    (which owns no memory) was about to be read as if it held the cache: fail loudly instead.
    """
    raise UnrewrittenCacheError(
        "oscar: a graph read an OscarCache key/value tensor that was not rewritten by oscar_backend. OscarCache keeps "
        "its tokens in INT2 pages that only compiled graphs can reach: compile the model with "
        "model.compile(backend=oscar_backend(...)) (or oscar_compile.compile(model)) and check `oscar explain` for "
        "attention calls that were not matched."
    )


@cache_read_guard.register_fake
def _cache_read_guard_fake(x):
    return x.new_empty(x.shape)
