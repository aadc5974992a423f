"""Shape and dtype checks shared by every implementation of the oscar ops (reference, Triton, fake).

They look only at metadata, so they also run at trace time inside the fake implementations: a
rewritten graph with inconsistent shapes fails when it is compiled, not later with a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8_ring import fp8_row_bytes, is_fp8_ring
from .sliding import history_len


@dataclass(frozen=True)
class CacheGeometry:
    """Sizes read off the cache tensors of one layer."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    num_groups: int  # quantization groups per row (d / g)
    num_sinks: int
    window: int
    batch_capacity: int
    max_pages: int
    # Keys quantized per channel over each page's tokens (one (scale, min) per channel and page: KIVI's axis,
    # in the transformed basis), values per token as usual. A page is then quantized only once all its tokens
    # have left the window, so the ring holds ``window + page_size - 1`` tokens (``window`` here is the ring's
    # length; ``evict_window`` the window the cache was made with).
    key_channel: bool = False
    # The ring's rows in FP8 with a scale each (:mod:`.fp8_ring`) instead of the cache dtype: the storage of a
    # layer's retrieval heads (the backend's exact_format="fp8").
    ring_fp8: bool = False

    @property
    def group_size(self) -> int:
        return self.head_dim // self.num_groups

    @property
    def flush(self) -> int:
        """Tokens that enter the pages together: a whole page for per-channel keys, else one."""
        return self.page_size if self.key_channel else 1

    @property
    def evict_window(self) -> int:
        """Tokens a row keeps in the ring at least (all of the ring but the ``flush - 1`` slots of a filling page)."""
        return self.window - self.flush + 1

    def quantized_len(self, length):
        """Page tokens of a row holding ``length`` tokens (an int or a tensor): see :func:`quantized_len`."""
        return quantized_len(length, self.num_sinks, self.evict_window, self.flush)

    @property
    def drops_evicted(self) -> bool:
        """A cache without pages (a block table of width 0) keeps its sinks and its ring only: a token
        leaving the ring is dropped, not quantized (a sliding-window layer whose window fits the ring)."""
        return self.max_pages == 0

    @property
    def capacity(self) -> int:
        """Tokens one row can hold: sinks + window + its block-table width in pages (unbounded without pages)."""
        if self.drops_evicted:
            return UNBOUNDED
        return self.num_sinks + self.window + self.max_pages * self.page_size  # the ring's length, not evict_window


def quantized_len(length, num_sinks: int, window: int, flush: int):
    """Page tokens (quantized indices ``0 .. n - 1``) of a row holding ``length`` tokens (an int or a tensor):
    every position before the last ``window`` (after the sinks), rounded down to a multiple of ``flush`` (a whole
    page for per-channel keys, else 1). The ring holds positions ``num_sinks + n .. length - 1``. The one rule for
    where the pages end: the ops (through :class:`CacheGeometry`) and the host cache both use it."""
    n = length - num_sinks - window
    n = n.clamp(min=0) if isinstance(n, torch.Tensor) else max(0, n)
    return n // flush * flush


UNBOUNDED = 2**62  # positions of a cache that drops what leaves its ring never run out


def _fail(msg: str, exc=ValueError):
    raise exc(f"oscar: {msg}")


def check_cache(k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table) -> CacheGeometry:
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes)):
        if t.dtype != torch.uint8:
            _fail(f"{name} must be uint8 packed INT2 codes, got {t.dtype}", TypeError)
        if t.dim() != 4:
            _fail(f"{name} must be [num_pages, page_size, kv_heads, d/4], got shape {tuple(t.shape)}")
    if k_codes.shape != v_codes.shape:
        _fail(f"k_codes {tuple(k_codes.shape)} and v_codes {tuple(v_codes.shape)} differ")
    num_pages, page_size, h, d4 = k_codes.shape
    d = 4 * d4
    key_channel = is_channel_key_meta(k_codes, k_meta)
    for name, t in (("k_meta", k_meta), ("v_meta", v_meta)):
        if not t.is_floating_point():
            _fail(f"{name} must be floating point (scale, min), got {t.dtype}", TypeError)
        if name == "k_meta" and key_channel:
            if tuple(t.shape) != (num_pages, 1, h, 2 * d):
                _fail(f"k_meta of per-channel keys must be [{num_pages}, 1, {h}, {2 * d}], got {tuple(t.shape)}")
            continue
        if t.dim() != 4 or tuple(t.shape[:3]) != (num_pages, page_size, h) or t.shape[3] % 2:
            _fail(f"{name} must be [{num_pages}, {page_size}, {h}, 2 * d/g], got {tuple(t.shape)}")
    if not key_channel and k_meta.shape != v_meta.shape:
        _fail(f"k_meta {tuple(k_meta.shape)} and v_meta {tuple(v_meta.shape)} differ")
    groups = v_meta.shape[3] // 2
    if groups == 0 or d % groups:
        _fail(f"metadata holds {groups} groups, which does not divide head_dim {d}")
    ring_fp8 = is_fp8_ring(k_ring, d)
    if ring_fp8 != is_fp8_ring(v_ring, d):
        _fail(f"k_ring and v_ring must both be FP8 rings or neither, got {k_ring.dtype} {tuple(k_ring.shape)} and "
              f"{v_ring.dtype} {tuple(v_ring.shape)}", TypeError)
    for name, t in (("k_sink", k_sink), ("v_sink", v_sink), ("k_ring", k_ring), ("v_ring", v_ring)):
        if ring_fp8 and name.endswith("ring"):
            if t.dim() != 4 or t.shape[2] != h:
                _fail(f"{name} (FP8 rows) must be [batch, tokens, {h}, {fp8_row_bytes(d)}], got {tuple(t.shape)}")
            continue
        if not t.is_floating_point():
            _fail(f"{name} must be floating point (or uint8 FP8 rows of {fp8_row_bytes(d)} bytes, the FP8 ring), "
                  f"got {t.dtype} {tuple(t.shape)}", TypeError)
        if t.dim() != 4 or t.shape[2] != h or t.shape[3] != d:
            _fail(f"{name} must be [batch, tokens, {h}, {d}], got {tuple(t.shape)}")
    if k_sink.shape != v_sink.shape or k_ring.shape != v_ring.shape or k_sink.shape[0] != k_ring.shape[0]:
        _fail(
            f"sink/ring shapes disagree: k_sink {tuple(k_sink.shape)}, v_sink {tuple(v_sink.shape)}, "
            f"k_ring {tuple(k_ring.shape)}, v_ring {tuple(v_ring.shape)}"
        )
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.dim() != 2:
        _fail(f"block_table must be int32 [batch, max_pages], got {block_table.dtype} {tuple(block_table.shape)}")
    if key_channel and k_ring.shape[1] < page_size - 1:
        _fail(f"per-channel keys need a ring of at least page_size - 1 = {page_size - 1} tokens (the page being filled), "
              f"got {k_ring.shape[1]}")
    if block_table.shape[1] == 0 and k_ring.shape[1] == 0:
        _fail("a cache without pages (block table of width 0) needs a ring: it would keep nothing but its sinks")
    if block_table.shape[0] != k_sink.shape[0]:
        _fail(f"block_table has {block_table.shape[0]} rows but the sink/ring buffers have {k_sink.shape[0]}")
    if ring_fp8 and block_table.shape[1] == 0:
        _fail("an FP8 ring needs INT2 pages (or a cache that quantizes nothing): a sliding-window cache keeps its ring "
              "in the cache dtype")
    return CacheGeometry(
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=h,
        head_dim=d,
        num_groups=groups,
        num_sinks=k_sink.shape[1],
        window=k_ring.shape[1],
        batch_capacity=k_sink.shape[0],
        max_pages=block_table.shape[1],
        key_channel=key_channel and block_table.shape[1] > 0,  # without pages nothing is quantized
        ring_fp8=ring_fp8,
    )


def is_channel_key_meta(k_codes: torch.Tensor, k_meta: torch.Tensor) -> bool:
    """Whether ``k_meta`` holds per-channel key metadata: ``[num_pages, 1, H, 2 * d]`` (scales, then minimums, of
    each channel over the page's tokens) in a cache of pages of more than one token. Per-token metadata is
    ``[num_pages, page_size, H, 2 * d/g]``; with one-token pages the two formats are the same thing."""
    return k_codes.dim() == 4 and k_meta.dim() == 4 and k_codes.shape[1] > 1 and k_meta.shape[1] == 1


def channel_pages_supported(page_size: int) -> bool:
    """Page sizes the Triton kernels take with per-channel keys: powers of two of at least 16 (a page-region block
    of 16+ keys, ``tl.dot``'s least, lies within one page)."""
    return page_size >= 16 and page_size & (page_size - 1) == 0


def check_positions(positions: torch.Tensor, batch: int, tokens: int) -> None:
    if positions.dtype not in (torch.int32, torch.int64):
        _fail(f"positions must be int32 or int64, got {positions.dtype}", TypeError)
    if positions.dim() == 1:
        if positions.shape[0] != tokens:
            _fail(f"positions has {positions.shape[0]} entries for {tokens} tokens")
    elif positions.dim() == 2:
        if tuple(positions.shape) != (batch, tokens):
            _fail(f"positions must be [{tokens}] or [{batch}, {tokens}], got {tuple(positions.shape)}")
    else:
        _fail(f"positions must be [tokens] or [batch, tokens], got {tuple(positions.shape)}")


def check_transforms(geo: CacheGeometry, **mats_and_means) -> None:
    h, d = geo.num_kv_heads, geo.head_dim
    for name, t in mats_and_means.items():
        want = (h, d) if name.endswith("mean") else (h, d, d)
        if tuple(t.shape) != want:
            _fail(f"{name} must have shape {list(want)} (per KV head), got {tuple(t.shape)}")
        if not t.is_floating_point():
            _fail(f"{name} must be floating point, got {t.dtype}", TypeError)


def check_clip(name: str, ratio: float) -> None:
    if not (0.0 < ratio <= 1.0):
        _fail(f"{name} must be in (0, 1] (1 = no clipping), got {ratio}")


def check_store(k, v, positions, cache_tensors, key_transform, key_mean, value_transform, value_mean, key_clip,
                value_clip, key_feedback=None):
    geo = check_cache(*cache_tensors)
    if k.dim() != 4 or k.shape != v.shape:
        _fail(f"k and v must both be [batch, kv_heads, tokens, head_dim], got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (k.is_floating_point() and v.is_floating_point()):
        _fail(f"k and v must be floating point, got {k.dtype} and {v.dtype}", TypeError)
    b, h, t, d = k.shape
    if d % 4:
        _fail(f"head_dim must be divisible by 4 for INT2 packing, got {d}")
    if (h, d) != (geo.num_kv_heads, geo.head_dim):
        _fail(f"k/v have {h} heads of dim {d} but the cache holds {geo.num_kv_heads} heads of dim {geo.head_dim}")
    if b > geo.batch_capacity:
        _fail(f"batch {b} exceeds the cache's {geo.batch_capacity} rows")
    check_positions(positions, b, t)
    check_transforms(geo, key_transform=key_transform, key_mean=key_mean, value_transform=value_transform, value_mean=value_mean)
    check_clip("key_clip", key_clip)
    check_clip("value_clip", value_clip)
    if key_feedback is not None:
        check_transforms(geo, key_feedback=key_feedback)
        if not geo.key_channel:
            _fail("key_feedback (error-feedback rounding of keys) needs keys per channel (key_format='channel')")
    return geo


def check_attention(q, positions, seq_lens, cache_tensors, query_transform, output_transform, value_mean, attn_mask, scale,
                    k_chunk=None, v_chunk=None, chunk_positions=None, debias=0.0):
    geo = check_cache(*cache_tensors)
    if q.dim() != 4 or not q.is_floating_point():
        _fail(f"q must be a floating [batch, q_heads, tokens, head_dim] tensor, got {q.dtype} {tuple(q.shape)}")
    b, hq, t, d = q.shape
    if d != geo.head_dim:
        _fail(f"q has head_dim {d} but the cache holds {geo.head_dim}")
    if hq % geo.num_kv_heads:
        _fail(f"{hq} query heads are not a multiple of the cache's {geo.num_kv_heads} KV heads")
    if b > geo.batch_capacity:
        _fail(f"batch {b} exceeds the cache's {geo.batch_capacity} rows")
    check_positions(positions, b, t)
    if seq_lens.dtype not in (torch.int32, torch.int64) or seq_lens.dim() != 1 or seq_lens.shape[0] not in (1, b):
        _fail(f"seq_lens must be an int32/int64 tensor [batch={b}] (or [1]), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    check_transforms(geo, query_transform=query_transform, output_transform=output_transform, value_mean=value_mean)
    if attn_mask is not None:
        if attn_mask.dim() > 4:
            _fail(f"attn_mask must have at most 4 dims, got {tuple(attn_mask.shape)}")
        shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
        for got, want, name in zip(shape[:3], (b, hq, t), ("batch", "heads", "queries")):
            if got not in (1, want):
                _fail(f"attn_mask {tuple(attn_mask.shape)} does not broadcast over {name}={want}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            _fail(f"attn_mask must be bool or floating (additive), got {attn_mask.dtype}", TypeError)
    if not scale > 0:
        _fail(f"softmax scale must be positive, got {scale}")
    if not 0.0 <= debias <= 4.0:
        _fail(f"debias must be in [0, 4] (0 off, 1 removes the expected INT2 score noise), got {debias}")
    chunk = (k_chunk, v_chunk, chunk_positions)
    if any(x is not None for x in chunk):
        if any(x is None for x in chunk):
            _fail("k_chunk, v_chunk and chunk_positions go together")
        if k_chunk.shape != v_chunk.shape or k_chunk.dim() != 4 or k_chunk.shape[0] != b or \
                tuple(k_chunk.shape[2:]) != (geo.num_kv_heads, geo.head_dim):
            _fail(f"k_chunk/v_chunk must be [{b}, T, {geo.num_kv_heads}, {geo.head_dim}], got "
                  f"{tuple(k_chunk.shape)} and {tuple(v_chunk.shape)}")
        tc = chunk_positions.shape[-1]  # a chunk stored by a cache without pages comes with the window before it
        check_positions(chunk_positions, b, tc)
        want = tc + history_len(geo.drops_evicted, geo.window, tc)
        if k_chunk.shape[1] != want:
            _fail(f"k_chunk/v_chunk hold {k_chunk.shape[1]} tokens for {tc} chunk positions, expected {want}: pass "
                  "what store returned (a cache without pages returns a chunk of more than one token with the "
                  f"{want - tc} ring tokens before it, which its write overwrote)")
    return geo
