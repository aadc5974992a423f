"""The FP8 ring: a cache's recent (or, without INT2 pages in use, every) token row in FP8 with its own scale.

A layer's retrieval heads (the backend's ``exact_heads``) keep every token in the ring of a cache that quantizes
nothing. In BF16 that ring costs 16 bits an element; stored here it costs ``8 + 32 / d``, and on Gemma 3 270M at 2K
(CPU) it kept the retrieval heads' gain (README, "FP8 retrieval heads, the storage").

Format: the ring tensor is ``uint8 [batch, tokens, kv_heads, d + 4]``; a token row of one head is ``d`` FP8 e4m3
codes (``float8_e4m3fn``: max 448, 3 mantissa bits, round to nearest even) followed by its fp32 scale, little
endian. Encoding: ``scale = max|x| / 448``, ``code = e4m3(x / scale)``; decoding ``e4m3 * scale``. The scale
travels inside the row, so whatever moves rows (``reorder_rows``, ``copy_rows_to``, the ops' ring slots) moves it
too, as FlashMLA's FP8 cache keeps each token's scales in its row. A row holding a NaN or inf decodes to NaN
entirely (its scale is NaN or inf), as an INT2 row does: the non-finite value stays in its own row.

The Triton kernels round in fp32 before their conversion to e4m3 (:func:`round_to_e4m3` in
``triton_store``): Triton's interpreter rounds some values just below a power of two the wrong way.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4  # one fp32 scale after each row's codes
RING_FORMATS = ("bf16", "fp8")


def fp8_row_bytes(head_dim: int) -> int:
    """Bytes of one token row of one head in an FP8 ring."""
    return head_dim + SCALE_BYTES


def is_fp8_ring(ring: torch.Tensor, head_dim: int) -> bool:
    """Whether ``ring`` (a cache's ring tensor) is in the FP8 format above."""
    return ring.dtype == torch.uint8 and ring.dim() == 4 and ring.shape[-1] == fp8_row_bytes(head_dim)


def encode_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., d]`` (any float dtype) -> FP8 rows ``uint8 [..., d + 4]``."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX  # NaN (inf) where the row holds a NaN (an inf)
    # a row of zeros keeps scale 0 and codes 0; 448 * (1 + 2^-23) rounds back to 448 (clamp: no NaN code)
    y = (x / torch.where(scale > 0, scale, 1.0)).clamp(-FP8_MAX, FP8_MAX)
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)


def decode_rows(rows: torch.Tensor) -> torch.Tensor:
    """FP8 rows ``uint8 [..., d + 4]`` -> ``float32 [..., d]``."""
    d = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :d].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., d:].contiguous().view(torch.float32)
    return codes * scale


def read_ring(ring: torch.Tensor) -> torch.Tensor:
    """Rows of a ring (any index of it) as float32 ``[..., d]``, whichever format it holds (an FP8 ring is the
    only ring in uint8: ``checks.check_cache``)."""
    return decode_rows(ring) if ring.dtype == torch.uint8 else ring.float()


def write_ring(ring: torch.Tensor, index, rows: torch.Tensor) -> None:
    """``ring[index] = rows`` (``[..., d]`` in the cache dtype), encoded where the ring is FP8."""
    ring[index] = encode_rows(rows) if ring.dtype == torch.uint8 else rows
