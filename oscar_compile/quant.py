"""INT2 quantization over the last dimension, and the fixed transforms (Hadamard, identity).

Format (DESIGN.md section 3):

* Asymmetric INT2 per row over groups of ``g`` channels (default ``g = d``: one group per row):
  ``scale = (max - min) / 3``, ``minimum = min``, codes ``0..3``, ``x_hat = minimum + code * scale``.
* Codes are packed four to a byte, *quartered*: byte ``i`` of a row holds channels
  ``i, i + d/4, i + d/2, i + 3d/4`` in bits 0-1, 2-3, 4-5, 6-7, so a kernel unpacks four
  contiguous ``d/4`` slices with one shift and mask each.
* ``scale`` and ``minimum`` are rounded to the metadata dtype (fp16 by default) *before* the codes
  are chosen, so the stored triple is self-consistent and dequantization is reproducible.
* Rounding is ``floor((x - minimum) / scale + 0.5)`` clamped to ``[0, 3]`` (what the kernels do).
* Optional clipping: each row is clamped to ``+-t`` with ``t`` the ``clip_ratio`` quantile of its
  ``|x|`` (linear interpolation between order statistics, as ``torch.quantile``), before min/max.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "pack_int2",
    "unpack_int2",
    "clip_rows",
    "quantize_int2",
    "dequantize_int2",
    "quantize_int2_channels",
    "feedback_factor",
    "hadamard_matrix",
    "identity_matrix",
    "bits_per_element",
]

_INT2_LEVELS = 3  # codes 0..3


def _check_head_dim(d: int, group_size: int | None) -> int:
    if d % 4 != 0:
        raise ValueError(f"INT2 packing needs the last dimension divisible by 4, got {d}")
    g = d if group_size is None else int(group_size)
    if g <= 0 or d % g != 0:
        raise ValueError(f"group_size must divide the last dimension {d}, got {group_size}")
    return g


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """Pack integer codes in ``[0, 3]`` (last dim ``d``) into uint8 ``[..., d/4]``, quartered."""
    d = codes.shape[-1]
    _check_head_dim(d, None)
    c = codes.to(torch.uint8)
    q = d // 4
    return c[..., 0:q] | (c[..., q : 2 * q] << 2) | (c[..., 2 * q : 3 * q] << 4) | (c[..., 3 * q :] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int2`: uint8 ``[..., d/4]`` -> uint8 codes ``[..., d]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed INT2 codes must be uint8, got {packed.dtype}")
    return torch.cat([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)


def clip_rows(x: torch.Tensor, clip_ratio: float | None) -> torch.Tensor:
    """Clamp each row (last dim) to ``+-t``, ``t`` the ``clip_ratio`` quantile of its ``|x|``.

    ``None`` or ``>= 1`` leaves ``x`` unchanged. Sort-based so it has no size limit
    (``torch.quantile`` refuses more than 2**24 elements) and matches the kernels' formula.
    """
    if clip_ratio is None or clip_ratio >= 1.0:
        return x
    if not 0.0 < clip_ratio < 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    d = x.shape[-1]
    sorted_abs = x.abs().sort(dim=-1).values
    pos = clip_ratio * (d - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, d - 1)
    frac = pos - lo
    t = sorted_abs[..., lo] + frac * (sorted_abs[..., hi] - sorted_abs[..., lo])
    t = t.unsqueeze(-1)
    return torch.minimum(torch.maximum(x, -t), t)


def quantize_int2(
    x: torch.Tensor,
    group_size: int | None = None,
    clip_ratio: float | None = None,
    meta_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., d]`` to packed INT2.

    Returns ``(codes, scale, minimum)``: ``codes`` uint8 ``[..., d/4]`` (quartered packing),
    ``scale`` and ``minimum`` in ``meta_dtype`` with shape ``[..., d/g]``.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize_int2 needs a floating-point tensor, got {x.dtype}")
    d = x.shape[-1]
    g = _check_head_dim(d, group_size)
    xf = clip_rows(x.float(), clip_ratio)
    grouped = xf.unflatten(-1, (d // g, g))
    mn = grouped.amin(dim=-1)
    mx = grouped.amax(dim=-1)
    scale = ((mx - mn) / _INT2_LEVELS).to(meta_dtype)
    minimum = mn.to(meta_dtype)
    s32, m32 = scale.float().unsqueeze(-1), minimum.float().unsqueeze(-1)
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    codes = torch.floor((grouped - m32) * inv + 0.5).clamp_(0, _INT2_LEVELS)
    return pack_int2(codes.flatten(-2).to(torch.uint8)), scale, minimum


def quantize_int2_channels(
    x: torch.Tensor, meta_dtype: torch.dtype = torch.float16, clip_ratio: float | None = None,
    feedback: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., T, d]`` to INT2 per channel over its ``T`` tokens (KIVI's key axis): one (scale, min)
    per channel, the same rounding as :func:`quantize_int2`. ``clip_ratio`` < 1 narrows each channel's range to
    that fraction of its width about its midpoint (tokens outside take the end codes): a layer's ratio is chosen by
    the long-context check on the attention output, since one outlier token a page otherwise spends the channel's
    four levels on itself. Returns ``(codes, scale, minimum)``: codes uint8 ``[..., T, d/4]`` (quartered packing,
    as per-token rows), ``scale`` and ``minimum`` in ``meta_dtype`` with shape ``[..., d]``.

    ``feedback`` (``[..., d, d]``, broadcast against ``x``'s leading dimensions): error-feedback rounding (see
    :func:`feedback_factor`). The grid stays each channel's over the page as given; the channels are then rounded in
    order, each token's rounding error pushed onto its channels not yet rounded by the row of ``feedback``."""
    if not x.is_floating_point():
        raise TypeError(f"quantize_int2_channels needs a floating-point tensor, got {x.dtype}")
    _check_head_dim(x.shape[-1], None)
    if clip_ratio is not None and not 0.0 < clip_ratio <= 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    xf = x.float()
    mn, mx = xf.amin(dim=-2), xf.amax(dim=-2)
    width = mx - mn
    if clip_ratio is not None and clip_ratio < 1.0:
        # the same float32 operations, in the same order, as the Triton store (triton_store._quantize_store)
        width = width * clip_ratio
        mn = (mx + mn) * 0.5 - width * 0.5
    scale = (width / _INT2_LEVELS).to(meta_dtype)
    minimum = mn.to(meta_dtype)
    s32, m32 = scale.float().unsqueeze(-2), minimum.float().unsqueeze(-2)
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    if feedback is not None:
        xf = _feedback_round(xf, m32, s32, inv, feedback.float())
    codes = torch.floor((xf - m32) * inv + 0.5).clamp_(0, _INT2_LEVELS)
    return pack_int2(codes.to(torch.uint8)), scale, minimum


def _feedback_round(x, m32, s32, inv, u):
    """``x [..., T, d]`` with channel ``i`` replaced by its grid value and its rounding error (over ``u[..., i, i]``)
    times ``u[..., i, i + 1:]`` subtracted from the channels after it, for ``i = 0 .. d - 1``: GPTQ's column update,
    with the tokens as rows. The Triton store does the same float32 operations in the same order."""
    x = x.clone()
    for i in range(x.shape[-1]):
        xi = x[..., i]
        q = m32[..., i] + torch.floor((xi - m32[..., i]) * inv[..., i] + 0.5).clamp(0, _INT2_LEVELS) * s32[..., i]
        err = (xi - q) / u[..., i, i].unsqueeze(-1)
        x[..., i + 1:] -= err.unsqueeze(-1) * u[..., i, i + 1:].unsqueeze(-2)
        x[..., i] = q
    return x


def feedback_factor(query_moment: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """The ``feedback`` of :func:`quantize_int2_channels` for keys read by queries of second moment
    ``query_moment = E[q q^T]`` (``[..., d, d]``, in the stored basis): the upper Cholesky factor of
    ``(Q + damp mean(diag Q) I)^-1``, float32. A key's rounding error ``e`` costs ``e^T Q e`` in its scores; rounding
    the channels in order with this feedback (GPTQ, with ``Q`` as the Hessian) lowers that cost where ``Q`` is not a
    multiple of the identity (Gemma 3 270M at 8K: the attention output's key error 0.15 -> 0.09)."""
    q = query_moment.double()
    d = q.shape[-1]
    eye = torch.eye(d, dtype=torch.float64, device=q.device)
    q = q + damp * q.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
    inv = torch.cholesky_inverse(torch.linalg.cholesky(q))
    return torch.linalg.cholesky(inv, upper=True).float()


def dequantize_int2(
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_int2` (up to quantization error): returns ``[..., d]``."""
    return dequantize_codes(unpack_int2(codes), scale, minimum, group_size, dtype)


def dequantize_codes(
    c: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`dequantize_int2` of codes already unpacked (uint8 ``[..., d]``, 0..3)."""
    d = c.shape[-1]
    g = _check_head_dim(d, group_size)
    if scale.shape[-1] != d // g or minimum.shape[-1] != d // g:
        raise ValueError(
            f"scale/minimum need last dim d/g = {d // g}, got {tuple(scale.shape)} / {tuple(minimum.shape)}"
        )
    grouped = c.unflatten(-1, (d // g, g)).float()
    x = grouped * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)
    return x.flatten(-2).to(dtype)


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix ``H`` (``H @ H.T = I``), ``d`` a power of two."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"Hadamard needs a power-of-two size, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype=dtype, device=device)


def identity_matrix(d: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    return torch.eye(d, dtype=dtype, device=device)


def bits_per_element(head_dim: int, group_size: int | None = None, meta_dtype: torch.dtype = torch.float16) -> float:
    """Bits per stored element of the INT2 page format: 2 code bits + (scale, min) per group."""
    g = _check_head_dim(head_dim, group_size)
    meta_bits = 2 * torch.finfo(meta_dtype).bits
    return 2.0 + meta_bits / g


def channel_bits_per_element(page_size: int, meta_dtype: torch.dtype = torch.float16) -> float:
    """Bits per stored key element when keys go per channel over pages of ``page_size`` tokens."""
    return 2.0 + 2 * torch.finfo(meta_dtype).bits / page_size
