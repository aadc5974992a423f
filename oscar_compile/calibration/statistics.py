"""Streaming float64 statistics of the post-RoPE queries, keys and values of each attention layer.

Per (layer, KV head), over every calibration token at position ``>= skip_first`` (attention sinks
have outsized activations and stay in BF16 anyway):

* ``query_moment``  ``S_q = E[q q^T]`` over every query head of the KV head's GQA group;
* ``key_sum``, ``key_moment``        (mean and second moment of the keys, as stored);
* ``value_sum``, ``value_moment``    (likewise for values);
* ``weighted_value_moment`` ``S_v = sum_t w_t v_t v_t^T`` with ``w_t = k_t^T S_q k_t``, the key's
  expected logit energy (DESIGN.md section 2), and ``weight_sum``, ``weighted_value_sum``.

Memory does not grow with the token count. ``S_v`` is accumulated in the same pass as ``S_q``, so
its weights use the running ``S_q`` estimate (including the current batch): a one-pass
approximation of the final weights that converges after the first batch. A few held-out sequences
are kept whole (``HeldOut``) for the clip-ratio search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerStats:
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    query_moment: torch.Tensor
    key_sum: torch.Tensor
    key_moment: torch.Tensor
    value_sum: torch.Tensor
    value_moment: torch.Tensor
    weighted_value_moment: torch.Tensor
    weighted_value_sum: torch.Tensor
    weight_sum: torch.Tensor
    query_count: int = 0
    token_count: int = 0

    @classmethod
    def empty(cls, kv_heads: int, q_heads: int, d: int) -> "LayerStats":
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        return cls(kv_heads, q_heads, d, z(kv_heads, d, d), z(kv_heads, d), z(kv_heads, d, d), z(kv_heads, d),
                   z(kv_heads, d, d), z(kv_heads, d, d), z(kv_heads, d), z(kv_heads))

    # ---------------------------------------------------------------- derived
    @property
    def query_second_moment(self) -> torch.Tensor:
        return self.query_moment / max(self.query_count, 1)

    @property
    def key_mean(self) -> torch.Tensor:
        return self.key_sum / max(self.token_count, 1)

    @property
    def value_mean(self) -> torch.Tensor:
        return self.value_sum / max(self.token_count, 1)

    def key_second_moment(self, about: torch.Tensor | None = None) -> torch.Tensor:
        """``E[(k - a)(k - a)^T]`` about ``a`` (zero if None)."""
        m = self.key_moment / max(self.token_count, 1)
        return m if about is None else _about(m, self.key_mean, about)

    def weighted_value_second_moment(self, about: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_t w_t (v_t - a)(v_t - a)^T / sum_t w_t``."""
        w = self.weight_sum.clamp_min(1e-300)[:, None, None]
        m = self.weighted_value_moment / w
        return m if about is None else _about(m, self.weighted_value_sum / w[..., 0], about)

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add tokens: ``q [N, Hkv, G, d]``, ``k, v [N, Hkv, d]`` (float64)."""
        n = k.shape[0]
        if n == 0:
            return
        self.query_moment += torch.einsum("nhgd,nhge->hde", q, q)
        self.query_count += n * q.shape[2]
        self.key_sum += k.sum(0)
        self.key_moment += torch.einsum("nhd,nhe->hde", k, k)
        self.value_sum += v.sum(0)
        self.value_moment += torch.einsum("nhd,nhe->hde", v, v)
        self.token_count += n
        w = torch.einsum("nhd,hde,nhe->nh", k, self.query_second_moment, k)
        self.weight_sum += w.sum(0)
        self.weighted_value_sum += torch.einsum("nh,nhd->hd", w, v)
        self.weighted_value_moment += torch.einsum("nh,nhd,nhe->hde", w, v, v)


def _about(second_moment, mean, about):
    """``E[(x - a)(x - a)^T]`` from ``E[x x^T]`` and ``E[x]``."""
    return (second_moment - mean[:, :, None] * about[:, None, :] - about[:, :, None] * mean[:, None, :]
            + about[:, :, None] * about[:, None, :])


@dataclass
class HeldOut:
    """Whole held-out sequences of one layer (float32), for the clip search: ``[B, H, T, d]``."""

    q: list[torch.Tensor] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0


class StatsObserver:
    """Receives the tensors the cache would store at every attention call (observe mode)."""

    def __init__(self, skip_first: int = 4, heldout_tokens: int = 4096):
        self.skip_first = skip_first
        self.heldout_tokens = heldout_tokens
        self.phase = "stats"  # or "heldout"
        self.layers: dict[int, LayerStats] = {}
        self.heldout: dict[int, HeldOut] = {}
        self.calls = 0

    def record(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """``q [B, Hq, T, d]``, ``k, v [B, Hkv, T, d]`` post-RoPE, ``positions [T] or [B, T]``."""
        self.calls += 1
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        if not (torch.isfinite(q).all() and torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise ValueError(f"oscar calibrate: non-finite queries/keys/values at layer {layer}")
        if self.phase == "heldout":
            h = self.heldout.setdefault(layer, HeldOut())
            if h.tokens < self.heldout_tokens:
                h.q.append(q.detach().float().cpu())
                h.k.append(k.detach().float().cpu())
                h.v.append(v.detach().float().cpu())
                h.tokens += b * t
            return
        stats = self.layers.get(layer)
        if stats is None:
            stats = self.layers[layer] = LayerStats.empty(hkv, hq, d)
        pos = positions.reshape(-1, t).expand(b, t) if positions.dim() else positions.expand(b, t)
        keep = (pos >= self.skip_first).cpu()
        qd = q.detach().double().cpu().reshape(b, hkv, hq // hkv, t, d).permute(0, 3, 1, 2, 4)[keep]  # [N, H, G, d]
        kd = k.detach().double().cpu().permute(0, 2, 1, 3)[keep]  # [N, H, d]
        vd = v.detach().double().cpu().permute(0, 2, 1, 3)[keep]
        stats.update(qd, kd, vd)
