"""``oscar::store``: transform, quantize and write new keys/values into the paged INT2 cache.

Semantics (DESIGN.md section 3), per sequence row ``b``; ``S`` sinks, ``W`` window, page size ``P``:

* Every token is first transformed, ``k' = (k - mu_k) A_k`` (likewise ``v``), and rounded to the
  cache dtype. All three regions hold transformed values, so one transformed query serves all.
* Position ``p < S`` goes to the BF16 sink ``sink[b, p]``.
* Position ``p >= S`` goes to the BF16 ring ``ring[b, p % W]`` (or an FP8 ring, :mod:`.fp8_ring`: the row rounded
  to FP8 with its own scale). When it arrives, the token it
  evicts (position ``p - W``, if ``>= S``) is quantized into its page: quantized index
  ``j = p - W - S`` lives at ``pages[block_table[b, j // P], j % P]``.
* A chunk of many tokens (prefill) has the same end state as writing them one at a time: tokens
  that would be evicted inside the chunk go straight to their pages (quantized from the same
  cache-dtype rounded value the ring would have held, so chunking never changes the result).
* Per-channel keys (``k_meta`` of ``[num_pages, 1, H, 2 * d]``, see :func:`checks.is_channel_key_meta`): a
  page's keys are quantized together, per channel over its ``P`` tokens, when the last of them leaves the
  window; until then they stay in the ring, which holds ``W + P - 1`` tokens (``W`` = ring length - P + 1).
  Values go per token, entering the pages at the same time. ``key_clip`` < 1 then narrows each channel's range
  over the page to that fraction of its width about its midpoint (:func:`~oscar_compile.quant.quantize_int2_channels`).
  ``key_feedback`` (``[H, d, d]``, :func:`~oscar_compile.quant.feedback_factor`) rounds those keys with error
  feedback: channel by channel, each token's rounding error pushed onto its later channels, weighted by what the
  queries read (the grid stays the page's).
* Negative positions are padding and are skipped. The valid positions of a row must be
  consecutive and continue that row's history (as every KV cache writes them).
* A cache with no pages (block table of width 0) drops a token that leaves the ring instead of
  quantizing it: the storage of a sliding-window layer whose window fits the ring (DESIGN.md section 3).
  Of a chunk longer than the ring only the newest ring-length tokens stay.
* Capacity: a position past what the row can hold (``num_sinks + window + max_pages * page_size``),
  or one whose page the row does not own, raises :class:`CacheCapacityError` before any row of the
  batch is written. (Compiled models check on the host before the graph runs, see
  :mod:`oscar_compile.passes.capacity`; the Triton kernel cannot raise and drops such writes.)
* Non-finite keys or values are stored as they are, in their own row only: a sink or ring token
  keeps its NaN/inf, and a quantized token whose row (one KV head) holds any non-finite value gets
  NaN scale and minimum, so it dequantizes to NaN. Attention over that row then returns NaN, as
  BF16 attention would; other rows are never affected. Nothing is checked on the host (no sync).
* Returns the transformed chunk ``(k', v')`` as ``[B, T, H, d]`` in the cache dtype: attention over
  the same tokens uses it for the chunk's own keys (the new chunk attends to itself exactly, as in
  serving systems; only history is read through the quantized cache). It is also the data
  dependency that orders the write before the read. A cache with no pages returns a chunk of more than one
  token with the ring's tokens before it (``[B, R - 1 + T, H, d]``, :mod:`.sliding`), read before the write
  overwrites them: its queries see them, and attention finds them there.
"""

from __future__ import annotations

import torch

from ..quant import quantize_int2, quantize_int2_channels
from . import fragment_order
from .checks import CacheGeometry, check_store
from .fp8_ring import read_ring, write_ring
from .sliding import chunk_with_history, history_len


class CacheCapacityError(RuntimeError):
    """A write past what the cache can hold: a position beyond its length, or a page the row does not own."""


def transform_rows(x: torch.Tensor, matrix: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, d]`` -> ``[B, T, H, d]`` float32: ``(x - mean[h]) @ matrix[h]`` per KV head."""
    xc = x.float() - mean.float()[None, :, None, :]
    return torch.einsum("bhtd,hde->bthe", xc, matrix.float())


def _page_slots(geo: CacheGeometry, block_table: torch.Tensor, row: int, quant_index: torch.Tensor):
    """Map quantized indices ``j = p - S`` of one row to (page, slot), checking ownership."""
    logical = torch.div(quant_index, geo.page_size, rounding_mode="floor")
    if logical.numel() and int(logical.max()) >= geo.max_pages:
        p = int(quant_index.max()) + geo.num_sinks
        raise CacheCapacityError(
            f"oscar: row {row}: quantizing position {p} needs page {int(logical.max())} but the block table holds "
            f"{geo.max_pages}; {_capacity_text(geo)}"
        )
    pages = block_table[row].long()[logical]
    if pages.numel() and bool((pages < 0).any()):
        p = int(quant_index[pages < 0][0]) + geo.num_sinks
        raise CacheCapacityError(
            f"oscar: row {row} has no page allocated for position {p}; allocate it first "
            f"(PagedInt2KVCache.allocate) - the pool holds {geo.num_pages} pages of {geo.page_size} tokens"
        )
    if pages.numel() and int(pages.max()) >= geo.num_pages:
        raise CacheCapacityError(f"oscar: block_table of row {row} names page {int(pages.max())} >= pool size {geo.num_pages}")
    return pages, quant_index % geo.page_size


def _capacity_text(geo: CacheGeometry) -> str:
    return (f"the cache holds {geo.capacity} tokens per row ({geo.num_sinks} sinks + {geo.window} ring + {geo.max_pages} pages "
            f"x {geo.page_size}); size it for the prompt plus every new token (max_seq_len / max_cache_len)")


def _write_pages(geo, codes, meta, block_table, row, quant_index, rows_fp, clip, kind, feedback=None):
    if quant_index.numel() == 0 or geo.drops_evicted:  # no pages: what leaves the ring is dropped
        return
    pages, slots = _page_slots(geo, block_table, row, quant_index)
    nan = torch.tensor(float("nan"), dtype=meta.dtype, device=meta.device)
    if kind == "k" and geo.key_channel:  # whole pages (quant_index starts and ends on page boundaries)
        ps, h, d = geo.page_size, geo.num_kv_heads, geo.head_dim
        by_page = rows_fp.reshape(-1, ps, h, d).transpose(1, 2)  # [pages, H, P, d]
        packed, scale, minimum = quantize_int2_channels(by_page, meta_dtype=meta.dtype, clip_ratio=clip,
                                                        feedback=feedback)
        # a (page, head) holding a NaN/inf dequantizes to NaN as a whole: its channels' ranges are meaningless
        bad = ~torch.isfinite(by_page).flatten(2).all(dim=-1)[..., None]
        scale, minimum = torch.where(bad, nan, scale), torch.where(bad, nan, minimum)
        fragment_order.write_rows(codes, pages, slots, packed.transpose(1, 2).reshape(-1, h, d // 4), kind)
        meta[pages[::ps], 0] = torch.cat([scale, minimum], dim=-1)
        return
    packed, scale, minimum = quantize_int2(rows_fp, geo.group_size, clip, meta_dtype=meta.dtype)
    # A row with a NaN/inf must dequantize to NaN, not to finite values from whatever the codes became.
    bad = ~torch.isfinite(rows_fp).all(dim=-1, keepdim=True)
    scale, minimum = torch.where(bad, nan, scale), torch.where(bad, nan, minimum)
    fragment_order.write_rows(codes, pages, slots, packed, kind)
    meta[pages, slots] = torch.cat([scale, minimum], dim=-1)


def _row_spans(geo: CacheGeometry, pos: torch.Tensor, block_table: torch.Tensor):
    """Per row: (row, valid mask, positions). Checks every row before anything is written."""
    spans = []
    for b in range(pos.shape[0]):
        valid = pos[b] >= 0
        p = pos[b][valid]
        if p.numel() == 0:
            continue
        first, last = int(p[0]), int(p[-1])
        if last >= geo.capacity:
            raise CacheCapacityError(f"oscar: row {b}: position {last} is past the end of the cache; {_capacity_text(geo)}")
        if not torch.equal(p, torch.arange(first, last + 1, dtype=p.dtype, device=p.device)):
            raise ValueError(f"oscar: positions of row {b} must be consecutive, got {p.tolist()[:16]}")
        lo, hi = geo.quantized_len(first), geo.quantized_len(last + 1)  # page tokens before and after the call
        if hi > lo and not geo.drops_evicted:
            _page_slots(geo, block_table, b, torch.arange(lo, hi, device=p.device))
        spans.append((b, valid, p))
    return spans


def _store_side(geo, x_t, spans, codes, meta, sink, ring, block_table, clip, kind, feedback=None):
    """Write one side (keys or values) of every row. ``x_t``: ``[B, T, H, d]`` in cache dtype."""
    s, ring_len = geo.num_sinks, geo.window
    for b, valid, p in spans:
        x = x_t[b][valid]
        first, new_len = int(p[0]), int(p[-1]) + 1
        # Positions s + lo .. s + hi - 1 enter the pages now: those before `first` leave the ring (earlier calls
        # wrote them), the rest come from this call. Quantized together, so a per-channel page sees all its tokens.
        lo, hi = geo.quantized_len(first), geo.quantized_len(new_len)
        in_page = (p >= s) & (p < s + hi)
        if hi > lo:
            old = torch.arange(s + lo, max(s + lo, min(first, s + hi)), device=p.device)
            rows = x[in_page].float()
            if ring_len:
                rows = torch.cat([read_ring(ring[b, old % ring_len]), rows])
            _write_pages(geo, codes, meta, block_table, b, torch.arange(lo, hi, device=p.device), rows, clip, kind,
                         feedback)
        in_sink = p < s
        in_ring = (p >= s) & ~in_page & (p >= new_len - ring_len)  # a chunk longer than the ring keeps its newest
        sink[b, p[in_sink]] = x[in_sink]
        if ring_len > 0:
            write_ring(ring, (b, p[in_ring] % ring_len), x[in_ring])


def store_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    k_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_codes: torch.Tensor,
    v_meta: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    block_table: torch.Tensor,
    key_transform: torch.Tensor,
    key_mean: torch.Tensor,
    value_transform: torch.Tensor,
    value_mean: torch.Tensor,
    key_clip: float,
    value_clip: float,
    key_feedback: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch ``oscar::store`` (the CPU implementation and the test oracle). ``k, v``: ``[B, H, T, d]``."""
    cache = (k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table)
    geo = check_store(k, v, positions, cache, key_transform, key_mean, value_transform, value_mean, key_clip,
                      value_clip, key_feedback)
    b, _, t, _ = k.shape
    pos = positions.long().expand(b, t) if positions.dim() == 1 else positions.long()
    kt = transform_rows(k, key_transform, key_mean)
    vt = transform_rows(v, value_transform, value_mean)
    spans = _row_spans(geo, pos, block_table)  # validates everything before the first write
    kt, vt = kt.to(k_sink.dtype).contiguous(), vt.to(v_sink.dtype).contiguous()  # fake returns contiguous
    # a cache without pages returns the window before the chunk with it, read before the chunk overwrites it
    out = chunk_with_history(pos, kt, vt, k_sink, v_sink, k_ring, v_ring, history_len(geo.drops_evicted, geo.window, t))
    _store_side(geo, kt, spans, k_codes, k_meta, k_sink, k_ring, block_table, key_clip, "k", key_feedback)
    _store_side(geo, vt, spans, v_codes, v_meta, v_sink, v_ring, block_table, value_clip, "v")
    return out
