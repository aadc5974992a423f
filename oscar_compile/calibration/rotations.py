"""Per-layer, per-KV-head transforms from calibration statistics (DESIGN.md section 2).

A method is a base rotation plus exact improvements, written ``base[+improvement...]``:

* ``identity``  naive INT2;   ``hadamard``  QuaRot-style;   ``oscar``  the OSCAR recipe:
  ``R_k = U_k P H`` with ``U_k`` the eigenvectors of the query second moment ``S_q`` (decreasing
  eigenvalue), ``P`` placing sorted direction ``i`` at the bit-reversed position of ``i`` (spreads
  the dominant directions), ``H`` the normalized Hadamard; ``R_v = U_v P H`` from the
  score-weighted value moment ``S_v``.
* ``+kmean``  store ``k - mu_k``: a per-query constant shift of every logit, softmax-exact.
* ``+vmean``  store ``v - mu_v`` and add ``mu_v`` to the output (attention weights sum to 1).
* ``+mean``   both.
* ``+scale``  query-aware scaling: in the eigenbasis of ``S_q`` (eigenvalues ``lambda_i``) with key
  variances ``sigma_i^2``, scale coordinate ``i`` by ``(lambda_i / sigma_i^2)^(1/4)`` before ``P H``;
  queries get the inverse, so ``q.k`` is unchanged. Needs the ``oscar`` eigenbasis.
* ``+scaleR`` (e.g. ``+scale8``)  the same, with the scales' dynamic range bounded by ``R`` (max / min):
  directions whose calibration queries are nearly silent (RoPE pairs that turn little within a
  calibration sequence) get tiny scales, and the queries of a longer context that do reach them are
  amplified by the inverse. Those eigenvectors are ill-conditioned too (the reduction order of the
  statistics moves them).
* ``+clip`` / ``-clip``  search (or not) a per-layer clip ratio for K and V on held-out tokens;
  ``oscar`` methods search by default, ``identity`` and ``hadamard`` do not.

All matrices are computed here in float64, offline; the ops never invert anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import LayerTransforms
from ..quant import hadamard_matrix
from .statistics import LayerStats

BASES = ("identity", "hadamard", "oscar")
DEFAULT_METHOD = "oscar+mean+scale"


@dataclass(frozen=True)
class MethodSpec:
    base: str
    key_mean: bool = False
    value_mean: bool = False
    query_scaling: bool = False
    clip_search: bool = False
    scale_range: float | None = None  # +scaleR: max / min of the query-aware scales

    @property
    def name(self) -> str:
        parts = [self.base]
        if self.key_mean and self.value_mean:
            parts.append("mean")
        elif self.key_mean:
            parts.append("kmean")
        elif self.value_mean:
            parts.append("vmean")
        if self.query_scaling:
            parts.append("scale" + (f"{self.scale_range:g}" if self.scale_range else ""))
        default_clip = self.base == "oscar"
        if self.clip_search != default_clip:
            parts.append("clip" if self.clip_search else "-clip")
        return "+".join(parts).replace("+-clip", "-clip")


def parse_method(method: str) -> MethodSpec:
    """``"oscar+mean+scale"`` -> :class:`MethodSpec`. ``"default"`` is :data:`DEFAULT_METHOD`."""
    if method == "default":
        method = DEFAULT_METHOD
    text = method.replace("-clip", "+-clip")
    base, *mods = [p for p in text.split("+") if p]
    if base not in BASES:
        raise ValueError(f"oscar: unknown method {method!r}: the base must be one of {BASES}")
    spec = dict(base=base, clip_search=base == "oscar")
    for m in mods:
        if m == "kmean":
            spec["key_mean"] = True
        elif m == "vmean":
            spec["value_mean"] = True
        elif m == "mean":
            spec["key_mean"] = spec["value_mean"] = True
        elif m.startswith("scale"):
            if base != "oscar":
                raise ValueError(f"oscar: {method!r}: +scale needs the oscar eigenbasis")
            spec["query_scaling"] = True
            if m != "scale":
                try:
                    spec["scale_range"] = float(m.removeprefix("scale"))
                except ValueError:
                    raise ValueError(f"oscar: {method!r}: +scaleR takes a number R > 1 (e.g. +scale8)") from None
                if not spec["scale_range"] > 1:
                    raise ValueError(f"oscar: {method!r}: +scaleR takes a number R > 1 (e.g. +scale8)")
        elif m == "clip":
            spec["clip_search"] = True
        elif m == "-clip":
            spec["clip_search"] = False
        else:
            raise ValueError(f"oscar: unknown method part {m!r} in {method!r} (kmean, vmean, mean, scale, clip, -clip)")
    return MethodSpec(**spec)


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """``perm[i]`` = ``i`` with its ``log2(d)`` bits reversed."""
    bits = max(d.bit_length() - 1, 0)
    return torch.tensor([int(f"{i:0{bits}b}"[::-1], 2) if bits else 0 for i in range(d)])


def spreading_matrix(d: int) -> torch.Tensor:
    """``P`` as a matrix acting on rows: sorted coordinate ``i`` moves to position ``bitrev(i)``."""
    p = torch.zeros(d, d, dtype=torch.float64)
    p[torch.arange(d), bit_reversal_permutation(d)] = 1.0
    return p


def sorted_eigenbasis(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (decreasing) and eigenvectors (columns) of symmetric ``m [H, d, d]``, float64."""
    m = 0.5 * (m + m.transpose(-1, -2))
    vals, vecs = torch.linalg.eigh(m.double())
    return vals.flip(-1), vecs.flip(-1)


def _regularized(x: torch.Tensor, rel: float = 1e-6) -> torch.Tensor:
    return x.clamp_min(0) + rel * x.clamp_min(0).mean(-1, keepdim=True).clamp_min(1e-30)


def derive_transforms(stats: LayerStats, spec: MethodSpec) -> LayerTransforms:
    """The layer's transforms for ``spec`` (clip ratios 1.0: they are searched separately)."""
    h, d = stats.num_kv_heads, stats.head_dim
    eye = torch.eye(d, dtype=torch.float64).expand(h, d, d)
    key_mean = stats.key_mean if spec.key_mean else torch.zeros(h, d, dtype=torch.float64)
    value_mean = stats.value_mean if spec.value_mean else torch.zeros(h, d, dtype=torch.float64)
    if spec.base == "identity":
        a_k, a_v = eye, eye
    else:
        had = hadamard_matrix(d, dtype=torch.float64)
        if spec.base == "hadamard":
            a_k, a_v = had.expand(h, d, d), had.expand(h, d, d)
        else:
            ph = spreading_matrix(d) @ had
            lam, u_k = sorted_eigenbasis(stats.query_second_moment)
            left = u_k
            if spec.query_scaling:
                cov = stats.key_second_moment(about=key_mean)  # what is stored is k - key_mean
                sigma2 = torch.einsum("hdi,hde,hei->hi", u_k, cov, u_k)
                s = (_regularized(lam) / _regularized(sigma2)) ** 0.25
                if spec.scale_range:  # within [g / sqrt(R), g * sqrt(R)] of the geometric mean g
                    g = s.log().mean(-1, keepdim=True).exp()
                    half = spec.scale_range ** 0.5
                    s = torch.minimum(torch.maximum(s, g / half), g * half)
                s = s / s.mean(-1, keepdim=True)  # the scale of a row is irrelevant to INT2; keep it near 1
                left = u_k * s[:, None, :]
            a_k = left @ ph
            _, u_v = sorted_eigenbasis(stats.weighted_value_second_moment(about=value_mean))
            a_v = u_v @ ph
    return LayerTransforms.from_matrices(a_k, a_v, key_mean, value_mean)
