"""Helpers for tests of oscar-compile and of code built on it (random transforms, float64 oracles)."""

from __future__ import annotations

import torch

from .cache import LayerTransforms, PagedInt2KVCache
from .kernels.store import transform_rows
from .quant import dequantize_int2, quantize_int2


def random_orthogonal(h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))
    return q.float()


def random_invertible(h: int, d: int, gen: torch.Generator, spread: float = 4.0) -> torch.Tensor:
    """A non-orthogonal, well-conditioned matrix: U diag(s) V with singular values in [1/spread, spread]."""
    u = random_orthogonal(h, d, gen).double()
    v = random_orthogonal(h, d, gen).double()
    s = torch.exp(torch.empty(h, d, dtype=torch.float64).uniform_(-1, 1, generator=gen) * torch.log(torch.tensor(spread)))
    return (u * s[:, None, :] @ v).float()


def random_transforms(h: int, d: int, kind: str, gen: torch.Generator, clip: float = 1.0) -> LayerTransforms:
    """``kind``: identity | orthogonal | invertible (means random unless identity)."""
    if kind == "identity":
        t = LayerTransforms.identity(h, d)
        t.key_clip = t.value_clip = clip
        return t
    make = random_orthogonal if kind == "orthogonal" else random_invertible
    return LayerTransforms.from_matrices(
        make(h, d, gen), make(h, d, gen),
        key_mean=torch.randn(h, d, generator=gen), value_mean=torch.randn(h, d, generator=gen),
        key_clip=clip, value_clip=clip,
    )


class CacheOracle:
    """An independent float64 model of what the cache should hold and what attention should return.

    It keeps every transformed token and applies the region rule directly (sink: ``p < S``; pages:
    ``S <= p < L - W``, quantize-dequantize of the cache-dtype row; ring: the rest), so it checks the
    reference ops' bookkeeping (rings, evictions, block tables) without sharing any of it.
    """

    def __init__(self, cache: PagedInt2KVCache, layer: int = 0):
        self.cache, self.tr = cache, cache.transforms[layer]
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(cache.max_batch_size)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(cache.max_batch_size)]

    def _transform(self, x, mat, mean):  # x [H, T, d] -> [T, H, d] in cache dtype, as stored
        # The same fp32 arithmetic as the store op: a one-ulp difference would flip INT2 codes at
        # rounding boundaries (a whole quantization step). Transform exactness is tested separately.
        return transform_rows(x[None], mat, mean)[0].to(self.cache.dtype)

    def append(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record ``k, v [H, T, d]`` appended to ``row``."""
        self.keys[row].extend(self._transform(k, self.tr.key_transform, self.tr.key_mean).unbind(0))
        self.values[row].extend(self._transform(v, self.tr.value_transform, self.tr.value_mean).unbind(0))

    def history(self, row: int, tokens: list[torch.Tensor], clip: float) -> torch.Tensor:
        c = self.cache
        x = torch.stack(tokens).double()  # [L, H, d]
        length = x.shape[0]
        lo, hi = c.num_sinks, length - c.window
        if hi > lo:
            packed, scale, mn = quantize_int2(x[lo:hi].to(c.dtype).float(), c.group_size, clip, c.meta_dtype)
            x[lo:hi] = dequantize_int2(packed, scale, mn, c.group_size).double()
        return x

    def attention(self, row: int, q: torch.Tensor, q_pos: torch.Tensor, scale: float, causal: bool = True) -> torch.Tensor:
        """``q [Hq, T, d]`` at absolute positions ``q_pos [T]`` -> ``[Hq, T, d]`` float64."""
        keys = self.history(row, self.keys[row], self.tr.key_clip)
        vals = self.history(row, self.values[row], self.tr.value_clip)
        hq, t, d = q.shape
        h = keys.shape[1]
        g = hq // h
        qt = torch.einsum("hgtd,hde->hgte", q.double().reshape(h, g, t, d), self.tr.query_transform.double())
        s = torch.einsum("hgtd,lhd->hgtl", qt, keys) * scale
        if causal:
            key_pos = torch.arange(keys.shape[0])
            s = s.masked_fill(key_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
        o = torch.einsum("hgtl,lhd->hgtd", torch.softmax(s, dim=-1), vals)
        o = torch.einsum("hgtd,hde->hgte", o, self.tr.output_transform.double()) + self.tr.value_mean.double()[:, None, None]
        return o.reshape(hq, t, d)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
