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
* ``+vauto``  store ``v - mu_v`` or ``v`` itself, per layer, whichever has the smaller held-out attention-weighted
  value error (searched with the clip ratio and sign pattern). Centering can triple a layer's error: tokens that
  act as attention sinks away from the start (SmolLM2's " the" in layers 3-10, 3-9% of the attention each)
  have values of small norm, so small INT2 errors uncentred and ordinary-sized ones centred, and their weight
  carries those errors into every output (relative output error 0.30-0.39 centred, 0.09-0.15 not, at 2K). The
  calibration records the choice (``value_centred``).
* ``+scale``  query-aware scaling: in the eigenbasis of ``S_q`` (eigenvalues ``lambda_i``) with key
  variances ``sigma_i^2``, scale coordinate ``i`` by ``(lambda_i / sigma_i^2)^(1/4)`` before ``P H``;
  queries get the inverse, so ``q.k`` is unchanged. Needs the ``oscar`` eigenbasis.
* ``+scaleR`` (e.g. ``+scale8``)  the same, with the scales' dynamic range bounded by ``R`` (max / min):
  directions whose calibration queries are nearly silent (RoPE pairs that turn little within a
  calibration sequence) get tiny scales, and the queries of a longer context that do reach them would be
  amplified by the inverse (a hypothesis: not measured to matter yet).
* ``+gm`` / ``+gmR``  query-aware scaling without the eigenvectors of ``S_q``: keys get ``G^(1/2)`` with ``G`` the
  matrix geometric mean of ``S_q`` and the inverse key covariance ``Sigma^-1`` (``G Sigma G = S_q``), so stored keys
  and rotated queries have the same second moment ``M = G^(1/2) Sigma G^(1/2)``, whose eigenbasis then goes before
  ``P H``. ``G`` is a continuous function of the statistics: where ``S_q``'s eigenvalues nearly coincide (any basis
  of them is an eigenbasis) ``+scale``'s transforms jump, these do not. ``R`` bounds the scales' range as above.
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
DEFAULT_METHOD = "oscar+kmean+vauto+scale"


@dataclass(frozen=True)
class MethodSpec:
    base: str
    key_mean: bool = False
    value_mean: bool | str = False  # True, False, or "auto" (chosen per layer by the calibration, see +vauto)
    query_scaling: bool = False
    clip_search: bool = False
    scale_range: float | None = None  # +scaleR / +gmR: max / min of the query-aware scales
    scaling: str = "eig"  # "eig" (+scale: diagonal in S_q's eigenbasis) or "gm" (+gm: matrix geometric mean)

    @property
    def name(self) -> str:
        parts = [self.base]
        if self.key_mean and self.value_mean is True:
            parts.append("mean")
        else:
            if self.key_mean:
                parts.append("kmean")
            if self.value_mean:
                parts.append("vauto" if self.value_mean == "auto" else "vmean")
        if self.query_scaling:
            word = "gm" if self.scaling == "gm" else "scale"
            parts.append(word + (f"{self.scale_range:g}" if self.scale_range else ""))
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
        elif m == "vauto":
            spec["value_mean"] = "auto"
        elif m.startswith("scale") or m.startswith("gm"):
            word = "scale" if m.startswith("scale") else "gm"
            if base != "oscar":
                raise ValueError(f"oscar: {method!r}: +{word} needs the oscar eigenbasis")
            spec["query_scaling"] = True
            spec["scaling"] = "eig" if word == "scale" else "gm"
            if m != word:
                try:
                    spec["scale_range"] = float(m.removeprefix(word))
                except ValueError:
                    raise ValueError(f"oscar: {method!r}: +{word}R takes a number R > 1 (e.g. +{word}8)") from None
                if not spec["scale_range"] > 1:
                    raise ValueError(f"oscar: {method!r}: +{word}R takes a number R > 1 (e.g. +{word}8)")
        elif m == "clip":
            spec["clip_search"] = True
        elif m == "-clip":
            spec["clip_search"] = False
        else:
            raise ValueError(f"oscar: unknown method part {m!r} in {method!r} (kmean, vmean, vauto, mean, scale, clip, -clip)")
    if spec.get("value_mean") == "auto" and not spec["clip_search"]:
        raise ValueError(f"oscar: {method!r}: +vauto chooses by held-out error, so it needs the held-out search "
                         "(an oscar method, or +clip)")
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


def sorted_eigenbasis(m: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (decreasing) and eigenvectors (columns) of symmetric ``m [H, d, d]``, float64.

    Each eigenvector's sign is fixed (its largest-magnitude entry's sign times :func:`_fixed_signs`): ``eigh`` returns
    ``u`` or ``-u`` as its rounding goes, and the sign decides how ``P H`` mixes that coordinate with the others, so
    without this the same statistics gave different artifacts on another machine or thread count (Gemma 3 270M:
    stored keys 150% apart, same Gram matrix; README)."""
    m = 0.5 * (m + m.transpose(-1, -2))
    vals, vecs = torch.linalg.eigh(m.double())
    vecs = torch.stack([_canonical_null_space(v, u) for v, u in zip(vals, vecs)])
    peak = vecs.gather(-2, vecs.abs().argmax(-2, keepdim=True))  # [H, 1, d]: each column's largest entry
    # then a fixed +-1 pattern: signs that agree would let the Hadamard add a shared component (a key mean) up into one
    # coordinate, an outlier; incoherent ones spread it (a randomized Hadamard, with a seed that never changes)
    vecs = vecs * torch.where(peak < 0, -1.0, 1.0) * _fixed_signs(vecs.shape[-1], seed)
    return vals.flip(-1), vecs.flip(-1)


def _fixed_signs(d: int, seed: int = 0) -> torch.Tensor:
    """A fixed pseudo-random +-1 vector of length ``d`` for ``seed`` (the same on every machine and torch version).
    Equivalent patterns quantize differently (Gemma 3 at 8K: +3.6% to +20% perplexity), so calibration tries a few
    and keeps the one with the least held-out error (``derive_artifacts``)."""
    state, out = (0x9E3779B9 ^ (seed * 0x85EBCA6B)) & 0xFFFFFFFF or 1, []
    for _ in range(d):  # xorshift32: no dependence on torch's generator implementation
        state ^= (state << 13) & 0xFFFFFFFF
        state ^= state >> 17
        state ^= (state << 5) & 0xFFFFFFFF
        out.append(1.0 if state & 1 else -1.0)
    return torch.tensor(out, dtype=torch.float64)


def _canonical_null_space(vals: torch.Tensor, vecs: torch.Tensor, rel: float = 1e-12) -> torch.Tensor:
    """``vecs`` (ascending ``vals``) with the basis of the numerically-zero eigenvalues (below ``rel`` of the largest)
    made canonical: any basis of that subspace is an eigenbasis and ``eigh`` picks one by rounding. Gemma 3 270M's
    queries and keys have whole RoPE pairs of channels that are exactly zero (4-14 directions on 4 layers). The basis
    is the Gram-Schmidt of the subspace's projector columns, channels taken by decreasing weight in it."""
    n = int((vals <= rel * vals.abs().max()).sum())
    if n < 2:
        return vecs
    null = vecs[:, :n]
    proj = null @ null.T
    weight = torch.diagonal(proj)
    order = sorted(range(len(weight)), key=lambda i: (-round(float(weight[i]), 9), i))[:n]
    q, r = torch.linalg.qr(proj[:, order])
    q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)
    if torch.linalg.matrix_rank(q.T @ null) < n:  # dependent channel columns (no n channels span it): keep eigh's
        return vecs
    out = vecs.clone()
    out[:, :n] = q
    return out


def _regularized(x: torch.Tensor, rel: float = 1e-6) -> torch.Tensor:
    return x.clamp_min(0) + rel * x.clamp_min(0).mean(-1, keepdim=True).clamp_min(1e-30)


def _bounded(scales: torch.Tensor, scale_range: float | None) -> torch.Tensor:
    """``scales [H, d]`` over their geometric mean, within ``[1 / sqrt(R), sqrt(R)]`` when ``R`` is given."""
    scales = scales / scales.log().mean(-1, keepdim=True).exp()
    if scale_range:
        half = scale_range ** 0.5
        scales = scales.clamp(1 / half, half)
    return scales


def _sym_fn(m: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` applied to the eigenvalues of symmetric ``m [H, d, d]`` (float64)."""
    vals, vecs = torch.linalg.eigh(0.5 * (m + m.transpose(-1, -2)))
    return (vecs * fn(vals)[:, None, :]) @ vecs.transpose(-1, -2)


def _regularized_matrix(m: torch.Tensor, rel: float = 1e-6) -> torch.Tensor:
    """``m`` plus ``rel`` times its mean eigenvalue on the diagonal (positive definite, as :func:`_regularized`)."""
    d = m.shape[-1]
    mean = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30 * d) / d
    return m + rel * mean[:, None, None] * torch.eye(d, dtype=m.dtype)


def geometric_mean_scaling(s_q: torch.Tensor, cov: torch.Tensor, scale_range: float | None = None) -> torch.Tensor:
    """``G^(1/2) U_M`` [H, d, d] (columns: directions, decreasing energy) for ``+gm``: ``G = S_q # Sigma^-1``, the
    symmetric positive definite solution of ``G Sigma G = S_q``, and ``U_M`` the eigenbasis of the common second
    moment ``M = G^(1/2) Sigma G^(1/2)`` of stored keys and rotated queries. Scaled so the singular values (the
    eigenvalues of ``G^(1/2)``) have geometric mean 1, their range bounded by ``scale_range`` when given."""
    s_q, cov = _regularized_matrix(s_q.double()), _regularized_matrix(cov.double())
    c_half = _sym_fn(cov, torch.sqrt)
    c_inv_half = _sym_fn(cov, torch.rsqrt)
    g = c_inv_half @ _sym_fn(c_half @ s_q @ c_half, lambda x: x.clamp_min(0).sqrt()) @ c_inv_half
    vals, vecs = torch.linalg.eigh(0.5 * (g + g.transpose(-1, -2)))
    r = _bounded(vals.clamp_min(1e-300).sqrt(), scale_range)  # eigenvalues of G^(1/2): the key scales
    g_half = (vecs * r[:, None, :]) @ vecs.transpose(-1, -2)
    _, u_m = sorted_eigenbasis(g_half @ cov @ g_half)
    return g_half @ u_m


def derive_transforms(stats: LayerStats, spec: MethodSpec, key_seed: int = 0, value_seed: int = 0) -> LayerTransforms:
    """The layer's transforms for ``spec`` (clip ratios 1.0: they are searched separately); ``key_seed`` and
    ``value_seed`` pick the eigenvectors' sign patterns (:func:`_fixed_signs`)."""
    if spec.value_mean == "auto":
        raise ValueError("oscar: +vauto chooses value centering per layer by held-out error: derive with "
                         "value_mean True or False (derive_artifacts tries both)")
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
            lam, u_k = sorted_eigenbasis(stats.query_second_moment, key_seed)
            left = u_k
            if spec.query_scaling and spec.scaling == "gm":
                left = geometric_mean_scaling(stats.query_second_moment, stats.key_second_moment(about=key_mean),
                                              spec.scale_range)
            elif spec.query_scaling:
                cov = stats.key_second_moment(about=key_mean)  # what is stored is k - key_mean
                sigma2 = torch.einsum("hdi,hde,hei->hi", u_k, cov, u_k)
                s = (_regularized(lam) / _regularized(sigma2)) ** 0.25
                if spec.scale_range:
                    s = _bounded(s, spec.scale_range)
                s = s / s.mean(-1, keepdim=True)  # the scale of a row is irrelevant to INT2; keep it near 1
                left = u_k * s[:, None, :]
            a_k = left @ ph
            _, u_v = sorted_eigenbasis(stats.weighted_value_second_moment(about=value_mean), value_seed)
            a_v = u_v @ ph
    return LayerTransforms.from_matrices(a_k, a_v, key_mean, value_mean)
