"""The chunk a cache without pages hands to attention: its new tokens with the window before them.

A cache without pages (a sliding-window layer's storage: sinks and a BF16 ring of ``R`` tokens) drops what leaves
its ring. A query of a chunk of ``T`` new tokens at ``c0 .. c0 + T - 1`` sees up to ``R - 1`` tokens before ``c0``,
but writing the chunk overwrites the ring slots of ``T - 1`` of them. So ``oscar::store`` reads them first and
returns them in front of the chunk: attention then finds every key a chunk's query can see exactly in the chunk
it is given, and the ring needs only the window itself (what a decode step sees), not window + chunk - 1.

Layout (per row ``b``, ``n = R - 1`` history slots, ``h_b = min(n, c0_b)`` of them real): entry ``i < h_b`` is
position ``c0_b - h_b + i`` (the history, read from the sinks or the ring), entries ``h_b .. h_b + T - 1`` are the
chunk as given (its positions as given), the last ``n - h_b`` entries are padding (position -1). A row's first real
position thus sits at entry 0, as the Triton attention reads a chunk (entry ``j - c0`` for key ``j``).
A decode step (``T == 1``) needs no history: the ring holds its window after the write.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def history_len(drops_evicted: bool, ring_len: int, tokens: int) -> int:
    """Entries ``oscar::store`` puts before a chunk of ``tokens`` new tokens (0: it returns the chunk as it is)."""
    return ring_len - 1 if drops_evicted and ring_len > 1 and tokens > 1 else 0


def _first_positions(pos: torch.Tensor) -> torch.Tensor:
    """Each row's first (smallest) real position; 0 for a row of padding only (no history then)."""
    big = torch.iinfo(pos.dtype).max
    c0 = torch.where(pos >= 0, pos, big).amin(-1)
    return torch.where(c0 == big, torch.zeros_like(c0), c0)


class HistoryLayout(NamedTuple):
    """Where the ``n`` history slots and the ``T`` chunk entries of each row land in the ``[B, n + T]`` result.
    History slot ``i`` of row ``b`` holds position ``c0_b - n + i``; the slots at negative positions hold no token and
    land in the padding at the end, so each row's entries are a permutation of ``0 .. n + T - 1``."""

    hist_pos: torch.Tensor  # [B, n] the position each history slot reads (negative: none)
    hist_dest: torch.Tensor  # [B, n] its entry in the result
    chunk_dest: torch.Tensor  # [B, T] each chunk entry's entry in the result


def history_layout(pos: torch.Tensor, n: int) -> HistoryLayout:
    """The layout of a chunk at ``pos [B, T]`` returned with ``n`` history slots (see the module)."""
    b, t = pos.shape
    c0 = _first_positions(pos).long()
    real = c0.clamp(max=n)[:, None]  # history tokens that exist: positions c0 - real .. c0 - 1
    i = torch.arange(n, device=pos.device)
    skip = n - real
    hist_dest = torch.where(i >= skip, i - skip, real + t + i)
    return HistoryLayout(c0[:, None] - n + i, hist_dest, real + torch.arange(t, device=pos.device))


def place_history(layout: HistoryLayout, hist: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """``[B, n + T, ...]``: the history ``hist [B, n, ...]`` (:func:`read_history`, or positions) and the chunk
    ``chunk [B, T, ...]`` (the transformed tokens, or their positions) at their entries: one allocation, each entry
    written once."""
    b, n = layout.hist_dest.shape
    out = chunk.new_empty(b, n + chunk.shape[1], *chunk.shape[2:])
    rows = torch.arange(b, device=chunk.device)[:, None]
    out[rows, layout.hist_dest] = hist.to(chunk.dtype)
    out[rows, layout.chunk_dest] = chunk
    return out


def positions_with_history(chunk_positions: torch.Tensor, batch: int, entries: int) -> torch.Tensor:
    """``[B, entries]`` positions of a chunk returned with its history (``entries - T`` history slots), from the
    ``[T]`` or ``[B, T]`` positions the chunk was stored at; the positions as they are for a chunk without one."""
    pos = chunk_positions.expand(batch, chunk_positions.shape[-1]) if chunk_positions.dim() == 1 else chunk_positions
    n = entries - pos.shape[-1]
    if n == 0:
        return pos
    layout = history_layout(pos, n)
    return place_history(layout, layout.hist_pos.clamp(min=-1), pos)


def read_history(layout: HistoryLayout, sink: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """``[B, n, H, d]``: the stored tokens the history slots hold: the sink below ``num_sinks``, else ring slot
    ``p % R`` (a slot at a negative position reads some slot, never used). Read it before the chunk is written.
    Plain tensor ops: no host sync (CUDA-graph safe)."""
    hist_pos = layout.hist_pos
    rows = torch.arange(hist_pos.shape[0], device=hist_pos.device)[:, None]
    hist = ring[rows, hist_pos % ring.shape[1]]
    s = sink.shape[1]
    if s:
        hist = torch.where((hist_pos < s)[..., None, None], sink[rows, hist_pos.clamp(0, s - 1)], hist)
    return hist


def chunk_with_history(pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_sink: torch.Tensor,
                       v_sink: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, n: int):
    """``(k, v)``: the transformed chunk ``k_new, v_new [B, T, H, d]`` with the ``n`` stored tokens before it, as
    ``oscar::store`` returns it (:func:`read_history`, then :func:`place_history`); the chunk as it is if ``n`` is
    0. Call it before the chunk is written."""
    if n == 0:
        return k_new, v_new
    layout = history_layout(pos, n)
    return (place_history(layout, read_history(layout, k_sink, k_ring), k_new),
            place_history(layout, read_history(layout, v_sink, v_ring), v_new))
