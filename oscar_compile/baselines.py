"""KIVI-2, the per-channel baseline, as a transformers cache on the reference path (fake quantization).

KIVI quantizes keys per channel over groups of ``group`` consecutive tokens and values per token
(over groups of ``group`` channels), and keeps the newest ``residual`` tokens in full precision.
Here the quantized part is stored dequantized (it is an accuracy baseline, not a memory saver):

* keys: once ``residual + group`` full-precision tokens have piled up, the oldest ``group`` of them
  are quantized together, per channel (so ``residual .. residual + group - 1`` stay exact);
* values: every token older than the newest ``residual`` is quantized on its own.

As with the oscar ops, the tokens of the current call are attended to exactly; only history is read
through the quantized state. Asymmetric 2-bit codes with an fp16 scale and minimum per group:
3 bits per element at ``group = 32``, plus the full-precision residual.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .quant import dequantize_int2, quantize_int2


def _fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """Quantize-dequantize over the last dim in groups of ``group``."""
    d = x.shape[-1]
    g = min(group, d)
    codes, scale, mn = quantize_int2(x.float(), g if d % g == 0 else None)
    return dequantize_int2(codes, scale, mn, g if d % g == 0 else None).to(x.dtype)


class KiviLayer(DynamicLayer):
    def __init__(self, group: int = 32, residual: int = 128):
        super().__init__()
        self.group, self.residual = group, residual
        self.k_q = self.v_q = None  # quantized history (dequantized), [B, H, n, d]
        self.k_fp = self.v_fp = None  # full-precision tail

    def _cat(self, a, b):
        return b if a is None else torch.cat([a, b], dim=-2)

    def update(self, key_states, value_states, *args, **kwargs):
        # what attention sees: the stored history, then this call's tokens exactly
        keys = self._cat(self._cat(self.k_q, self.k_fp), key_states)
        values = self._cat(self._cat(self.v_q, self.v_fp), value_states)
        self.k_fp = self._cat(self.k_fp, key_states)
        self.v_fp = self._cat(self.v_fp, value_states)
        g, r = self.group, self.residual
        while self.k_fp.shape[-2] >= r + g:  # keys: per channel over the oldest group of tokens
            grp = self.k_fp[:, :, :g]
            q = _fake_quant(grp.transpose(-1, -2), g).transpose(-1, -2)
            self.k_q = self._cat(self.k_q, q)
            self.k_fp = self.k_fp[:, :, g:]
        n_old = self.v_fp.shape[-2] - r
        if n_old > 0:  # values: per token
            self.v_q = self._cat(self.v_q, _fake_quant(self.v_fp[:, :, :n_old], g))
            self.v_fp = self.v_fp[:, :, n_old:]
        self.keys, self.values = keys, values
        self.is_initialized = True
        return keys, values

    def get_seq_length(self) -> int:
        n = 0
        for t in (self.k_q, self.k_fp):
            n += 0 if t is None else t.shape[-2]
        return n


class KiviCache(DynamicCache):
    """``DynamicCache`` whose history is KIVI-2 fake-quantized (run the model eagerly with it)."""

    def __init__(self, config, group: int = 32, residual: int = 128):
        super().__init__(config=config)
        n = len(self.layers) or config.get_text_config().num_hidden_layers
        self.layers = [KiviLayer(group, residual) for _ in range(n)]
        self.group, self.residual = group, residual


def kivi_bits_per_element(context: int, head_dim: int, group: int = 32, residual: int = 128, fp_bits: int = 16) -> float:
    """KIVI-2's bits per K/V element of one sequence: 2-bit codes, fp16 (scale, min) per group, fp residual."""
    g = min(group, head_dim)
    quant = max(0, context - residual)
    return (quant * (2 + 32 / g) + min(context, residual) * fp_bits) / max(context, 1)
