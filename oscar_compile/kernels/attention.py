"""``oscar::attention``: attention of new queries over the paged INT2 cache (sink + pages + ring).

Semantics, per sequence row ``b``:

* ``seq_lens[b] = L_b`` is the number of tokens stored in the row (what the last ``store`` left:
  its newest position + 1). Key ``j < L_b`` is read from the sink (``j < S``), the ring
  (``j >= max(S, L_b - W)``; with per-channel keys from the last whole page's end, see
  ``CacheGeometry.quantized_len``) or its INT2 page (dequantized), all in the transformed basis. Keys
  ``j >= L_b`` do not exist.
* ``positions[b, t]`` is query ``t``'s position, used only for ``is_causal`` (key ``j`` visible iff
  ``j <= positions[b, t]``) and for padding (a negative position returns zeros).
* The query is transformed ``q' = q B_q`` (``B_q`` of its KV head; GQA: query head ``h`` reads KV
  head ``h // (Hq / Hkv)``), scores ``s = scale * q'.k'``. An optional ``attn_mask`` (bool: True
  keeps, or additive float), broadcastable to ``[B, Hq, T, Lk]``, indexes *logical* key positions;
  keys ``j >= Lk`` are not visible (so a mask over a shorter key view means what SDPA means).
* A cache without pages (block table of width 0) has dropped the keys that left its ring: key
  ``S <= j < min(L_b - W, first chunk position)`` is not visible (a sliding-window layer's storage).
* ``k_chunk, v_chunk`` (optional, ``[B, T', H, d]``, what ``store`` returned) hold the newest tokens
  at ``chunk_positions`` exactly: those keys are read from them, not from the (maybe quantized)
  cache, so a prefill chunk attends to itself in full precision. From a cache without pages a chunk of
  more than one token comes with the ring's tokens before it (``T' = R - 1 + T``, :mod:`.sliding`), which
  its write overwrote: they are read from the chunk too.
* ``debias`` (``c``, 0 = off): an INT2 key's score is lowered by ``c var / 2``, ``var = scale^2 sum_c (q'_c
  step_c)^2 / 12`` (``step``: the key's quantization step in channel ``c``), the variance of its rounding error
  (uniform over a step). That error inflates ``exp(s)`` by ``exp(var / 2)`` on average, so without the correction
  the INT2 keys take more of the attention than the exact keys would (``benchmarks/probe_key_noise.py``).
* Output ``o = softmax(s) V' B_o + mu_v`` in the query's dtype. A padding query or a query with no
  visible key returns zeros (SDPA would return NaN there).
"""

from __future__ import annotations

import torch

from ..quant import dequantize_codes
from . import fragment_order
from .checks import CacheGeometry, check_attention
from .fp8_ring import read_ring
from .sliding import positions_with_history

# Queries per chunk in the reference: bounds the [heads, chunk, L] score buffer for long prefills.
_QUERY_CHUNK = 256


def gather_history(
    geo: CacheGeometry, codes, meta, sink, ring, block_table, lengths: torch.Tensor, max_len: int, kind: str,
    steps: bool = False,
):
    """Read the stored (transformed) history of each row: ``[B, max_len, H, d]`` float32.

    Positions at or past a row's length are zero (they are masked by the caller). ``steps``: also return each
    element's quantization step (its scale; 0 where the row is BF16), same shape.
    """
    s, w, ps = geo.num_sinks, geo.window, geo.page_size
    nb = lengths.shape[0]
    dev = sink.device
    j = torch.arange(max_len, device=dev)
    shortest = int(lengths.min()) if nb else max_len  # one host sync; the caller already made one (max_len)
    out = torch.zeros(nb, max_len, geo.num_kv_heads, geo.head_dim, dtype=torch.float32, device=dev)
    step = torch.zeros_like(out) if steps else None
    n_sink = min(s, max_len)
    out[:, :n_sink] = sink[:nb, :n_sink].float()
    if max_len > s and geo.drops_evicted:  # no pages: only the ring (the caller hides dropped positions)
        if w > 0:
            out[:, s:] = read_ring(ring[:nb][:, j[s:] % w])
    elif max_len > s:
        # every page a row owns up to max_len, read whole (a decode step reads the whole history: per-slot
        # indexing was most of the CPU's decode time); slots past the pages' span are the ring's below
        n_quantized = max_len - s
        n_pages = min(-(-n_quantized // ps), geo.max_pages)
        pages = block_table[:nb, :n_pages].long().clamp(min=0)  # [B, P]; unowned -> masked below
        meta_rows = meta[pages].float()  # [B, P, ps, H, 2 groups] ([B, P, 1, H, 2d] for per-channel keys)
        group = 1 if kind == "k" and geo.key_channel else geo.group_size
        codes_rows = fragment_order.read_page_codes(codes, pages, kind)
        deq = dequantize_codes(codes_rows, *meta_rows.chunk(2, dim=-1), group_size=group).flatten(1, 2)[:, :n_quantized]
        out[:, s:s + deq.shape[1]] = deq
        if steps:
            scale = meta_rows[..., : meta_rows.shape[-1] // 2].repeat_interleave(group, -1)
            step[:, s:s + deq.shape[1]] = scale.expand(codes_rows.shape[:-1] + (geo.head_dim,)).flatten(1, 2)[:, :n_quantized]
        # positions before every row's window read pages; from there on, a row's window reads its ring
        ring_from = s + geo.quantized_len(shortest)
        if w > 0 and ring_from < max_len:
            jr = j[ring_from:]
            ring_rows = read_ring(ring[:nb][:, jr % w])  # ring slot = absolute position % ring length
            in_page = jr[None, :] < s + geo.quantized_len(lengths[:, None])
            out[:, ring_from:] = torch.where(in_page[..., None, None], out[:, ring_from:], ring_rows)
            if steps:
                step[:, ring_from:] = torch.where(in_page[..., None, None], step[:, ring_from:], 0.0)
    # where, not a product: a NaN in a slot the row does not own (another row's page, a stale token)
    # must not reach this row (NaN * 0 is NaN, and a masked NaN key still poisons its softmax row). Every row
    # owns the positions before the shortest row's length.
    valid = j[None, shortest:] < lengths[:, None]
    out[:, shortest:] = torch.where(valid[..., None, None], out[:, shortest:], 0.0)
    if steps:
        step[:, shortest:] = torch.where(valid[..., None, None], step[:, shortest:], 0.0)
        return out, step
    return out


def attention_reference(
    q: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    k_codes: torch.Tensor,
    k_meta: torch.Tensor,
    v_codes: torch.Tensor,
    v_meta: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    block_table: torch.Tensor,
    query_transform: torch.Tensor,
    output_transform: torch.Tensor,
    value_mean: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    k_chunk: torch.Tensor | None = None,
    v_chunk: torch.Tensor | None = None,
    chunk_positions: torch.Tensor | None = None,
    debias: float = 0.0,
) -> torch.Tensor:
    """Plain-PyTorch ``oscar::attention`` (the CPU implementation and the test oracle)."""
    cache = (k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table)
    geo = check_attention(q, positions, seq_lens, cache, query_transform, output_transform, value_mean, attn_mask, scale,
                          k_chunk, v_chunk, chunk_positions, debias)
    b, hq, t, d = q.shape
    h = geo.num_kv_heads
    g = hq // h
    pos = positions.long().expand(b, t) if positions.dim() == 1 else positions.long()
    lengths = seq_lens.long().expand(b)
    capacity = geo.capacity
    if b and (int(lengths.min()) < 0 or int(lengths.max()) > capacity):
        raise ValueError(f"oscar: seq_lens {lengths.tolist()} outside [0, {capacity}] (the cache capacity per row)")
    max_len = int(lengths.max()) if b else 0
    out = torch.zeros(b, h, g, t, d, dtype=torch.float32, device=q.device)
    has_key = torch.zeros(b, h, g, t, dtype=torch.bool, device=q.device)
    if max_len == 0:
        return out.reshape(b, hq, t, d).to(q.dtype)

    keys = gather_history(geo, k_codes, k_meta, k_sink, k_ring, block_table, lengths, max_len, "k", steps=debias > 0)
    if debias > 0:
        keys, key_steps = keys
    values = gather_history(geo, v_codes, v_meta, v_sink, v_ring, block_table, lengths, max_len, "v")
    if k_chunk is not None:
        cpos = positions_with_history(chunk_positions.long(), b, k_chunk.shape[1])
        for row in range(b):
            sel = (cpos[row] >= 0) & (cpos[row] < lengths[row])
            keys[row, cpos[row][sel]] = k_chunk[row][sel].float()
            values[row, cpos[row][sel]] = v_chunk[row][sel].float()
            if debias > 0:
                key_steps[row, cpos[row][sel]] = 0.0
    qt = torch.einsum("bhgtd,hde->bhgte", q.float().reshape(b, h, g, t, d), query_transform.float())
    key_pos = torch.arange(max_len, device=q.device)
    visible_len = key_pos[None, :] < lengths[:, None]  # [B, L]
    if geo.drops_evicted:  # keys that left the ring before the chunk (the chunk's own keys are kept) are gone
        first_kept = lengths - geo.window
        if k_chunk is not None:
            c0 = torch.where(cpos >= 0, cpos, lengths[:, None]).amin(-1)
            first_kept = torch.minimum(first_kept, c0)
        visible_len &= (key_pos[None, :] < geo.num_sinks) | (key_pos[None, :] >= first_kept[:, None])
    mask = None
    if attn_mask is not None:
        mask = attn_mask[..., :max_len]
        covered = mask.shape[-1]
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(b, hq, t, covered)
        if covered < max_len:  # keys past the mask are not visible
            pad = (False if mask.dtype == torch.bool else float("-inf"))
            mask = torch.cat([mask, mask.new_full((b, hq, t, max_len - covered), pad)], dim=-1)
        mask = mask.reshape(b, h, g, t, max_len)

    k_heads = keys.transpose(1, 2)  # [B, H, L, d]
    v_heads = values.transpose(1, 2)
    for t0 in range(0, t, _QUERY_CHUNK):
        t1 = min(t, t0 + _QUERY_CHUNK)
        n = t1 - t0
        keep = visible_len[:, None, None, None, :].expand(b, h, g, n, max_len)
        if is_causal:
            keep = keep & (key_pos[None, None, None, None, :] <= pos[:, None, None, t0:t1, None])
        bias = None
        if mask is not None:
            m = mask[:, :, :, t0:t1]
            if m.dtype == torch.bool:
                keep = keep & m
            else:
                bias = m.float()
                keep = keep & (bias > float("-inf"))
        row_ok = keep.any(dim=-1) & (pos[:, None, None, t0:t1] >= 0)
        has_key[:, :, :, t0:t1] = row_ok
        # Fully masked rows would give NaN: let them see everything, their output is zeroed below.
        keep = keep | ~row_ok[..., None]
        if debias > 0:
            # INT2 rounding noise of each score, var = scale^2 sum_c (q'_c step_c)^2 / 12, inflates exp(s) by
            # exp(var / 2) on average: subtract it
            var = torch.einsum("bhgtd,bjhd->bhgtj", qt[:, :, :, t0:t1].square(), key_steps.square()) * scale**2 / 12
            bias = (0.0 if bias is None else bias) - debias * var / 2
        attn_mask = keep if bias is None else torch.where(keep, bias.masked_fill(~torch.isfinite(bias), 0.0), float("-inf"))
        q_rows = qt[:, :, :, t0:t1].reshape(b, h * g, n, d)  # query head h*G+g reads KV head h
        o = torch.nn.functional.scaled_dot_product_attention(
            q_rows, k_heads, v_heads, attn_mask=attn_mask.reshape(b, h * g, n, max_len), scale=scale, enable_gqa=True)
        out[:, :, :, t0:t1] = o.reshape(b, h, g, n, d)

    out = torch.einsum("bhgtd,hde->bhgte", out, output_transform.float()) + value_mean.float()[None, :, None, None, :]
    out = torch.where(has_key[..., None], out, torch.zeros_like(out))  # padding / no visible key -> 0
    return out.reshape(b, hq, t, d).to(q.dtype)
