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

import torch


def history_len(drops_evicted: bool, ring_len: int, tokens: int) -> int:
    """Entries ``oscar::store`` puts before a chunk of ``tokens`` new tokens (0: it returns the chunk as it is)."""
    return ring_len - 1 if drops_evicted and ring_len > 1 and tokens > 1 else 0


def _first_positions(pos: torch.Tensor) -> torch.Tensor:
    """Each row's first (smallest) real position; 0 for a row of padding only (no history then)."""
    big = torch.iinfo(pos.dtype).max
    c0 = torch.where(pos >= 0, pos, big).amin(-1)
    return torch.where(c0 == big, torch.zeros_like(c0), c0)


def _history_index(pos: torch.Tensor, n: int):
    """``(index, positions)``: for every entry of the ``[B, n + T]`` result, the row it takes from
    ``cat([history of n, chunk of T])`` and its position (-1: padding). ``pos``: ``[B, T]``."""
    b, t = pos.shape
    c0 = _first_positions(pos)
    real = torch.clamp(c0, max=n)  # history tokens that exist: positions c0 - real .. c0 - 1
    i = torch.arange(n + t, device=pos.device)
    index = ((n - real)[:, None] + i).clamp_(max=n + t - 1)
    src_pos = torch.cat([c0[:, None] - n + torch.arange(n, device=pos.device), pos], dim=1)
    positions = torch.where(i < (real + t)[:, None], src_pos.gather(1, index), -1)
    return index, positions


def positions_with_history(chunk_positions: torch.Tensor, batch: int, entries: int) -> torch.Tensor:
    """``[B, entries]`` positions of a chunk returned with its history (``entries - T`` history slots), from the
    ``[T]`` or ``[B, T]`` positions the chunk was stored at; the positions as they are for a chunk without one."""
    pos = chunk_positions.expand(batch, chunk_positions.shape[-1]) if chunk_positions.dim() == 1 else chunk_positions
    n = entries - pos.shape[-1]
    return pos if n == 0 else _history_index(pos, n)[1].to(pos.dtype)


def read_history(pos: torch.Tensor, sink: torch.Tensor, ring: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n, H, d]``: the ``n`` stored tokens before each row's chunk (``pos [B, T]``): the sink below
    ``num_sinks``, else ring slot ``p % R``; rows for positions below 0 are some slot's (never used). Read it before
    the chunk is written. Plain tensor ops: no host sync (CUDA-graph safe)."""
    b = pos.shape[0]
    hist_pos = (_first_positions(pos)[:, None] - n + torch.arange(n, device=pos.device)).long()  # [B, n]
    rows = torch.arange(b, device=pos.device)[:, None]
    hist = ring[rows, hist_pos % ring.shape[1]]
    s = sink.shape[1]
    if s:
        hist = torch.where((hist_pos < s)[..., None, None], sink[rows, hist_pos.clamp(0, s - 1)], hist)
    return hist


def place_history(pos: torch.Tensor, hist: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``[B, n + T, H, d]``: the history ``hist [B, n, H, d]`` (:func:`read_history`) and the transformed chunk
    ``new [B, T, H, d]``, laid out as the module says."""
    b, t, h, d = new.shape
    n = hist.shape[1]
    index, _ = _history_index(pos, n)
    src = torch.cat([hist.to(new.dtype), new], dim=1)
    return src.gather(1, index[:, :, None, None].expand(b, n + t, h, d))


def chunk_with_history(pos: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_sink: torch.Tensor,
                       v_sink: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, n: int):
    """``(k, v)``: the transformed chunk ``k_new, v_new [B, T, H, d]`` with the ``n`` stored tokens before it, as
    ``oscar::store`` returns it (:func:`read_history`, then :func:`place_history`); the chunk as it is if ``n`` is
    0. Call it before the chunk is written."""
    if n == 0:
        return k_new, v_new
    return (place_history(pos, read_history(pos, k_sink, k_ring, n), k_new),
            place_history(pos, read_history(pos, v_sink, v_ring, n), v_new))
