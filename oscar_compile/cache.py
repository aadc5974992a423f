"""The paged INT2 KV cache: page pools, block tables, BF16 sinks and recent ring, per-head transforms.

Layout per layer (DESIGN.md section 3)::

    k_codes, v_codes  [num_pages, page_size, kv_heads, d // 4]    uint8, INT2 in fragment order (kernels/fragment_order.py;
                                                                  logical quartered order where d % 64 or page_size % 16)
    k_meta,  v_meta   [num_pages, page_size, kv_heads, 2 * d // g] (scales..., mins...) in meta_dtype
                      (k_meta [num_pages, 1, kv_heads, 2 * d] with key_format="channel")
    k_sink,  v_sink   [batch, num_sinks, kv_heads, d]             cache dtype (BF16)
    k_ring,  v_ring   [batch, window, kv_heads, d]                cache dtype, slot = position % window
                      (uint8 [batch, window, kv_heads, d + 4] with ring_format="fp8": FP8 codes and a scale a row,
                      kernels/fp8_ring.py)

shared by all layers::

    block_table [batch, max_pages] int32 (-1 = no page), seq_lens [batch] int32

The pages hold the quantized positions ``S .. L - W - 1`` of a row (quantized index ``j = p - S``),
so a row of length ``L`` owns ``ceil((L - S - W) / page_size)`` pages. With ``key_format="channel"`` the keys
of a page are quantized per channel over its tokens (KIVI's axis, in the transformed basis), so a page is
written whole once its last token leaves the window: the ring holds ``W + page_size - 1`` tokens and a row owns
``floor((L - S - W) / page_size)`` pages. Page ownership is managed
here on the host (:meth:`allocate`, :meth:`release`); the ops only read the block table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import ops
from .kernels.fp8_ring import RING_FORMATS, fp8_row_bytes
from .kernels.checks import quantized_len
from .kernels.store import CacheCapacityError
from .quant import bits_per_element, channel_bits_per_element, hadamard_matrix

__all__ = ["LayerTransforms", "LayerKV", "PagedInt2KVCache", "MemoryReport", "CacheCapacityError"]


def _inverse(m: torch.Tensor) -> torch.Tensor:
    """Inverse of each ``[d, d]`` matrix of ``m`` (``[H, d, d]``), one at a time: torch 2.13's CPU wheel (oneMKL)
    fails a batched float64 inverse at d = 256 once more than one thread runs ("Parameter 6 was incorrect on entry
    to DLASWP"), which crashed calibrating Gemma-sized heads; one matrix at a time does not."""
    return torch.stack([torch.linalg.inv(x) for x in m]) if m.dim() == 3 else torch.linalg.inv(m)


@dataclass
class LayerTransforms:
    """Per-KV-head transforms of one layer (DESIGN.md section 4); all matrices ``[H, d, d]``.

    Keys are stored as ``(k - key_mean) @ key_transform`` and queries used as ``q @ query_transform``
    with ``query_transform = key_transform^-T`` (scores unchanged up to a per-query constant);
    values are stored as ``(v - value_mean) @ value_transform`` and the output is
    ``o' @ output_transform + value_mean`` with ``output_transform = value_transform^-1``.
    Clip ratios (``1.0`` = no clipping) apply to the stored page rows.
    """

    key_transform: torch.Tensor
    query_transform: torch.Tensor
    value_transform: torch.Tensor
    output_transform: torch.Tensor
    key_mean: torch.Tensor
    value_mean: torch.Tensor
    key_clip: float = 1.0
    value_clip: float = 1.0
    # per-channel keys (key_format="channel"): each channel's page range narrows to this fraction of its width
    # (quant.quantize_int2_channels); the key clip above is per-token keys' (a quantile of each row's |x|)
    key_page_clip: float = 1.0
    # per-channel keys: error-feedback rounding (quant.feedback_factor of the calibration's query second moment in the
    # stored basis, [H, d, d]); None rounds each value to its nearest level
    key_feedback: torch.Tensor | None = None

    @classmethod
    def identity(cls, num_kv_heads: int, head_dim: int, device=None) -> "LayerTransforms":
        eye = torch.eye(head_dim, device=device).expand(num_kv_heads, head_dim, head_dim).contiguous()
        zero = torch.zeros(num_kv_heads, head_dim, device=device)
        return cls(eye, eye.clone(), eye.clone(), eye.clone(), zero, zero.clone())

    @classmethod
    def hadamard(cls, num_kv_heads: int, head_dim: int, device=None) -> "LayerTransforms":
        """Keys and values rotated by the normalized Hadamard (QuaRot-style); no means, no clipping."""
        h = hadamard_matrix(head_dim, device=device).expand(num_kv_heads, head_dim, head_dim).contiguous()
        zero = torch.zeros(num_kv_heads, head_dim, device=device)
        # H is symmetric and orthogonal: query matrix H^-T = H, output matrix H^-1 = H.
        return cls(h, h.clone(), h.clone(), h.clone(), zero, zero.clone())

    @classmethod
    def from_matrices(
        cls,
        key_transform: torch.Tensor,
        value_transform: torch.Tensor,
        key_mean: torch.Tensor | None = None,
        value_mean: torch.Tensor | None = None,
        key_clip: float = 1.0,
        value_clip: float = 1.0,
    ) -> "LayerTransforms":
        """Build from ``A_k``, ``A_v`` (``[H, d, d]``, invertible); inverses are taken offline in float64."""
        a_k = key_transform.double()
        a_v = value_transform.double()
        b_q = _inverse(a_k).transpose(-1, -2)
        b_o = _inverse(a_v)
        h, d, _ = a_k.shape
        zero = torch.zeros(h, d, dtype=torch.float64)
        return cls(
            a_k.float(), b_q.float(), a_v.float(), b_o.float(),
            (zero if key_mean is None else key_mean.double()).float(),
            (zero if value_mean is None else value_mean.double()).float(),
            float(key_clip), float(value_clip),
        )

    def heads(self, lo: int, hi: int) -> "LayerTransforms":
        """The transforms of KV heads ``lo .. hi - 1`` (a tensor-parallel rank's share)."""
        return replace(self, **{n: getattr(self, n)[lo:hi] for n in self._present_tensor_names()})

    def select(self, heads) -> "LayerTransforms":
        """The transforms of the KV heads listed in ``heads`` (in that order)."""
        idx = torch.as_tensor(list(heads), dtype=torch.long, device=self.key_transform.device)
        return replace(self, **{n: getattr(self, n).index_select(0, idx) for n in self._present_tensor_names()})

    def to(self, device) -> "LayerTransforms":
        return replace(self, **{n: getattr(self, n).to(device=device, dtype=torch.float32)
                                for n in self._present_tensor_names()})

    def _present_tensor_names(self):
        """The tensors this layer holds: every one of :meth:`_tensor_names`, and the optional ones that are set."""
        return self._tensor_names() + tuple(n for n in self._optional_tensor_names() if getattr(self, n) is not None)

    @staticmethod
    def _optional_tensor_names():
        return ("key_feedback",)

    @staticmethod
    def _tensor_names():
        return ("key_transform", "query_transform", "value_transform", "output_transform", "key_mean", "value_mean")

    def validate(self, num_kv_heads: int, head_dim: int, rtol: float = 1e-3) -> None:
        """Check shapes, finiteness and that the query/output matrices invert the key/value ones."""
        h, d = num_kv_heads, head_dim
        for name in self._tensor_names():
            t = getattr(self, name)
            want = (h, d) if name.endswith("mean") else (h, d, d)
            if tuple(t.shape) != want:
                raise ValueError(f"oscar: {name} must have shape {list(want)}, got {tuple(t.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"oscar: {name} has non-finite entries")
        eye = torch.eye(d, dtype=torch.float64, device=self.key_transform.device)
        checks = (
            ("key_transform^T @ query_transform", self.key_transform.double().transpose(-1, -2) @ self.query_transform.double()),
            ("value_transform @ output_transform", self.value_transform.double() @ self.output_transform.double()),
        )
        for name, prod in checks:
            err = (prod - eye).abs().max().item()
            if err > rtol * max(1.0, prod.abs().max().item()):
                raise ValueError(f"oscar: {name} is not the identity (max error {err:.2e}): the inverse matrices do not match")
        if self.key_feedback is not None:
            u = self.key_feedback
            if tuple(u.shape) != (h, d, d) or not torch.isfinite(u).all():
                raise ValueError(f"oscar: key_feedback must be finite with shape {[h, d, d]}, got {tuple(u.shape)}")
            if not (u.diagonal(dim1=-2, dim2=-1) > 0).all() or u.tril(-1).abs().max() > 0:
                raise ValueError("oscar: key_feedback must be upper triangular with a positive diagonal "
                                 "(quant.feedback_factor)")
        for name in ("key_clip", "value_clip", "key_page_clip"):
            r = getattr(self, name)
            if not 0.0 < r <= 1.0:
                raise ValueError(f"oscar: {name} must be in (0, 1], got {r}")


@dataclass
class LayerKV:
    """The cache tensors of one layer, in the argument order of the oscar ops."""

    k_codes: torch.Tensor
    k_meta: torch.Tensor
    v_codes: torch.Tensor
    v_meta: torch.Tensor
    k_sink: torch.Tensor
    v_sink: torch.Tensor
    k_ring: torch.Tensor
    v_ring: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k_codes, self.k_meta, self.v_codes, self.v_meta, self.k_sink, self.v_sink, self.k_ring, self.v_ring)


@dataclass(frozen=True)
class ExactHeads:
    """A layer's KV heads split in two: ``int2_heads`` in the cache itself, ``exact_heads`` in ``cache`` (BF16)."""

    cache: "PagedInt2KVCache"
    int2_heads: tuple[int, ...]
    exact_heads: tuple[int, ...]

    @property
    def heads(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.int2_heads, self.exact_heads


@dataclass(frozen=True)
class MemoryReport:
    """KV memory of one sequence at a given context length (all layers unless noted)."""

    context_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    int2_bytes: int  # this cache: sinks + ring + the row's pages (codes and metadata)
    bf16_bytes: int  # a BF16 cache of the same length
    bytes_per_token_per_layer: float
    bits_per_element: float

    @property
    def compression(self) -> float:
        return self.bf16_bytes / self.int2_bytes

    def __str__(self) -> str:
        return (
            f"context {self.context_len:>7}: {self.bytes_per_token_per_layer:8.1f} B/token/layer, "
            f"{self.bits_per_element:.3f} bits/element, {self.int2_bytes / 2**20:9.2f} MiB "
            f"(BF16 {self.bf16_bytes / 2**20:9.2f} MiB, {self.compression:.2f}x smaller)"
        )


def row_bytes(heads: int, head_dim: int, bf16_tokens: int, page_tokens: int, group_size: int, dtype: torch.dtype,
              meta_dtype: torch.dtype, channel_page: int = 0, fp8_tokens: int = 0) -> int:
    """Bytes of one row's keys (or values) in one layer: ``bf16_tokens`` in the cache dtype (sinks and ring)
    plus ``page_tokens`` in INT2 pages (codes and per-group scale and minimum; ``channel_page`` > 0: one
    scale and minimum per channel for every ``channel_page`` tokens instead, the per-channel key format) plus
    ``fp8_tokens`` in FP8 rows with a scale each (an FP8 ring, :mod:`.kernels.fp8_ring`)."""
    token = heads * head_dim * (torch.finfo(dtype).bits // 8)
    fp8 = fp8_tokens * heads * fp8_row_bytes(head_dim)
    meta_bytes = torch.finfo(meta_dtype).bits // 8
    if channel_page:
        return (bf16_tokens * token + fp8 + page_tokens * heads * head_dim // 4
                + page_tokens // channel_page * heads * 2 * head_dim * meta_bytes)
    page_token = heads * (head_dim // 4 + 2 * (head_dim // group_size) * meta_bytes)
    return bf16_tokens * token + fp8 + page_tokens * page_token


class PagedInt2KVCache:
    """Paged INT2 KV cache for ``num_layers`` layers of ``num_kv_heads`` heads of ``head_dim``.

    Args:
        max_batch_size: rows (sequences) held at once.
        max_seq_len: longest row; sizes the block table.
        page_size: tokens per page.
        num_sinks, window: BF16 attention-sink tokens and BF16 recent window (DESIGN.md section 3).
        group_size: channels per (scale, min) group; ``None`` = ``head_dim`` (one group per row).
        num_pages: pages per layer pool; default enough for every row at ``max_seq_len``.
        identity_block_table: give row ``b`` the pages ``[b * max_pages, (b + 1) * max_pages)``
            up front (the static-cache special case used by compiled models).
        quantize: ``False`` keeps every token in the ring (BF16 in place of INT2; for checks).
        sliding_window: the layer attends to its last ``sliding_window`` positions only (a query at ``i``
            sees keys ``i - sliding_window < j <= i``, transformers' sliding-window layers). Its storage is
            then a BF16 ring of ``sliding_window`` tokens and nothing else: no sinks, no pages, memory
            independent of the context and as small as a BF16 cache's; tokens leaving the ring are dropped,
            since no later query can see them. A chunk's queries also see the window before the chunk, which
            its write overwrites: :meth:`store` returns those tokens with the chunk, for :meth:`attention`.
            ``max_chunk``: most tokens one :meth:`store` call may write to such a layer (it bounds that
            returned chunk; a longer prompt is prefilled in chunks); a larger call raises
            :class:`CacheCapacityError`.
        key_format: ``"token"`` (the cache's default; the backend's is ``"channel"``): keys quantized per token in
            groups of ``group_size`` channels, as values.
            ``"channel"``: keys quantized per channel over each page's ``page_size`` tokens (one fp16 scale and
            minimum per channel and page: ``2 + 32 / page_size`` bits), KIVI's axis in the transformed basis,
            which keeps the keys' per-channel ranges and so the ranking of scores that retrieval depends on.
            A page is written once all its tokens left the window (the ring holds ``window + page_size - 1``).
            On CUDA the Triton kernels take pages of 16, 32, ... tokens; smaller pages run the PyTorch reference.
        score_debias: ``c`` in [0, 4]: attention lowers each INT2 key's score by ``c`` times half the variance of its
            rounding error (``oscar::attention``'s ``debias``), which otherwise inflates the INT2 keys' share of
            the attention. 0 (default) reads the scores as they are.
        dtype: dtype of sinks and ring; meta_dtype: dtype of scales and minimums.
        ring_format: ``"bf16"`` (the ring in ``dtype``) or ``"fp8"``: the ring's rows in FP8 e4m3 with an fp32 scale
            each (``8 + 32 / head_dim`` bits an element, :mod:`.kernels.fp8_ring`); sinks stay in ``dtype``. Not with
            a sliding window. The backend gives it to retrieval heads (``exact_format``: a cache that quantizes
            nothing, every token in its ring) and, with ``ring_format="fp8"``, to INT2 layers, whose pages then
            quantize the FP8 rows they evict.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_batch_size: int = 1,
        max_seq_len: int = 4096,
        page_size: int = 16,
        num_sinks: int = 64,
        window: int = 256,
        group_size: int | None = None,
        num_pages: int | None = None,
        identity_block_table: bool = False,
        quantize: bool = True,
        sliding_window: int | None = None,
        max_chunk: int = 2048,
        key_format: str = "token",
        score_debias: float = 0.0,
        dtype: torch.dtype = torch.bfloat16,
        meta_dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        ring_format: str = "bf16",
    ):
        if head_dim % 4:
            raise ValueError(f"oscar: head_dim must be divisible by 4 for INT2 packing, got {head_dim}")
        group_size = head_dim if group_size is None else int(group_size)
        if group_size <= 0 or head_dim % group_size:
            raise ValueError(f"oscar: group_size {group_size} must divide head_dim {head_dim}")
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("max_batch_size", max_batch_size),
                          ("max_seq_len", max_seq_len), ("page_size", page_size)):
            if int(val) < 1:
                raise ValueError(f"oscar: {name} must be >= 1, got {val}")
        if num_sinks < 0 or window < 0:
            raise ValueError(f"oscar: num_sinks and window must be >= 0, got {num_sinks} and {window}")
        if key_format not in ("token", "channel"):
            raise ValueError(f"oscar: key_format must be 'token' or 'channel', got {key_format!r}")
        if key_format == "channel" and page_size < 2:
            raise ValueError("oscar: key_format='channel' quantizes each channel over a page's tokens: page_size must be "
                             f">= 2 (16 to 64 is sensible), got {page_size}")
        # per-channel keys only where tokens are quantized (a sliding-window or unquantized cache has no pages)
        self.key_format = key_format if quantize and sliding_window is None else "token"
        if sliding_window is not None:
            if int(sliding_window) < 1 or int(max_chunk) < 1:
                raise ValueError(f"oscar: sliding_window and max_chunk must be >= 1, got {sliding_window} and {max_chunk}")
            # The ring holds the window (a decode step's keys); a chunk's queries get the window before the chunk
            # from store, which reads it before the chunk's write (kernels/sliding.py)
            num_sinks, window = 0, min(int(sliding_window), max_seq_len)
        elif not quantize:
            window = max(window, max_seq_len)  # every token stays in the BF16 ring: nothing is evicted
        if ring_format not in RING_FORMATS:
            raise ValueError(f"oscar: ring_format must be one of {RING_FORMATS}, got {ring_format!r}")
        if ring_format == "fp8" and sliding_window is not None:
            raise ValueError("oscar: ring_format='fp8' needs a cache without a sliding window (its ring is in the "
                             "cache dtype)")
        self.ring_format = ring_format
        if not 0.0 <= float(score_debias) <= 4.0:
            raise ValueError(f"oscar: score_debias must be in [0, 4] (1 removes the expected INT2 score noise), got {score_debias}")
        self.score_debias = float(score_debias)
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.max_chunk = int(max_chunk)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_batch_size, self.max_seq_len, self.page_size = max_batch_size, max_seq_len, page_size
        self.num_sinks, self.window, self.group_size = num_sinks, window, group_size
        self.quantize, self.dtype, self.meta_dtype = quantize, dtype, meta_dtype
        self.device = torch.device(device)
        # A row of length L owns pages for its quantized positions S .. L - W - 1. Keep >= 1 page so
        # no tensor is zero-sized (kernels index them unconditionally behind masks); a sliding-window
        # layer has a block table of width 0 (no pages: the ops drop what leaves the ring) and a 1-page pool.
        self.ring_len = window + (page_size - 1 if self.key_format == "channel" else 0)  # + the page being filled
        self.max_pages = 0 if self.sliding_window else max(1, self.pages_for(max_seq_len))
        self.num_pages = max(1, max_batch_size * self.max_pages) if num_pages is None else int(num_pages)
        if self.num_pages < 1:
            raise ValueError(f"oscar: num_pages must be >= 1, got {num_pages}")

        h, d, g = num_kv_heads, head_dim, group_size
        dev = self.device

        def pool(cols, dt):
            return torch.zeros(self.num_pages, page_size, h, cols, dtype=dt, device=dev)

        def bf16(tokens):
            return torch.zeros(max_batch_size, tokens, h, d, dtype=dtype, device=dev)

        def ring(tokens):
            if ring_format == "fp8":  # FP8 codes and an fp32 scale a row (kernels/fp8_ring.py)
                return torch.zeros(max_batch_size, tokens, h, fp8_row_bytes(d), dtype=torch.uint8, device=dev)
            return bf16(tokens)

        def key_meta():
            if self.key_format == "channel":  # one (scales, minimums) row per page and head
                return torch.zeros(self.num_pages, 1, h, 2 * d, dtype=meta_dtype, device=dev)
            return pool(2 * d // g, meta_dtype)

        self.layers = [
            LayerKV(pool(d // 4, torch.uint8), key_meta(), pool(d // 4, torch.uint8), pool(2 * d // g, meta_dtype),
                    bf16(num_sinks), bf16(num_sinks), ring(self.ring_len), ring(self.ring_len))
            for _ in range(num_layers)
        ]
        self.transforms = [LayerTransforms.identity(h, d, device=dev) for _ in range(num_layers)]
        self.block_table = torch.full((max_batch_size, self.max_pages), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=dev)
        self.exact: ExactHeads | None = None  # a layer's retrieval heads, kept beside it in BF16 (keep_heads_exact)
        self._row_pages: list[list[int]] = [[] for _ in range(max_batch_size)]
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low pages first
        self.identity_block_table = identity_block_table
        if identity_block_table:
            if self.num_pages < max_batch_size * self.max_pages:
                raise ValueError(
                    f"oscar: an identity block table needs {max_batch_size} x {self.max_pages} pages, pool has {self.num_pages}"
                )
            for row in range(max_batch_size):
                self._take_pages(row, self.max_pages)

    # ---------------------------------------------------------------- pages
    def pages_for(self, length: int) -> int:
        """Pages a row of ``length`` tokens owns (none in a sliding-window layer)."""
        return -(-self.quantized_tokens(length) // self.page_size)  # per-channel keys: whole pages only

    @property
    def capacity_tokens(self) -> int:
        """Tokens one row can hold at most (sinks + window + its block-table width in pages; a
        sliding-window layer: ``max_seq_len``, its ring keeps what its window can see)."""
        if self.sliding_window:
            return self.max_seq_len
        return self.num_sinks + self.ring_len + self.max_pages * self.page_size

    def quantized_tokens(self, length: int) -> int:
        """Tokens of a row of ``length`` held in INT2 pages (the ring holds the rest after the sinks; a page is
        written whole when keys go per channel). None in a sliding-window layer, which drops what leaves its ring."""
        if self.sliding_window:
            return 0
        return quantized_len(length, self.num_sinks, self.window, self.page_size if self.key_format == "channel" else 1)

    def _take_pages(self, row: int, count: int) -> None:
        have = len(self._row_pages[row])
        if count > len(self._free_pages):
            raise CacheCapacityError(
                f"oscar: page pool exhausted: row {row} needs {count} more pages but only {len(self._free_pages)} of the "
                f"pool's {self.num_pages} pages are free (page_size {self.page_size}: capacity "
                f"{self.num_pages * self.page_size} quantized tokens per layer); release rows or make the pool larger"
            )
        new = [self._free_pages.pop() for _ in range(count)]
        self._row_pages[row].extend(new)
        self.block_table[row, have : have + count] = torch.tensor(new, dtype=torch.int32, device=self.device)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_batch_size:
            raise IndexError(f"oscar: row {row} out of range for a cache of {self.max_batch_size} rows")

    def allocate(self, row: int, length: int) -> None:
        """Make ``row`` able to hold ``length`` tokens (grows only) and record it as its length."""
        self._check_row(row)
        if length > self.max_seq_len:
            raise CacheCapacityError(f"oscar: row {row} would hold {length} tokens, beyond max_seq_len={self.max_seq_len}")
        need = self.pages_for(length) - len(self._row_pages[row])
        if need > 0:
            self._take_pages(row, need)
        self.seq_lens[row] = max(int(self.seq_lens[row]), length)

    def release(self, row: int) -> None:
        """Return the row's pages to the pool (an identity block table keeps its fixed pages)."""
        self._check_row(row)
        if not self.identity_block_table:
            self._free_pages.extend(reversed(self._row_pages[row]))
            self._row_pages[row] = []
            self.block_table[row] = -1
        self.seq_lens[row] = 0
        if self.exact is not None:
            self.exact.cache.release(row)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    # ---------------------------------------------------------------- transforms
    def keep_heads_exact(self, int2_heads, exact_heads, ring_format: str = "bf16") -> "PagedInt2KVCache":
        """Make this cache hold the ``int2_heads`` of a layer (its ``num_kv_heads``, in that order) and a BF16
        companion the ``exact_heads`` (retrieval heads): same rows, length and sinks, every token in its ring (in
        ``ring_format``: "fp8" rounds the ring's rows to FP8 with a scale each). The
        backend's rewrite stores and reads the two apart and puts the heads back in order; rows move, reorder and
        are released together. Returns the companion."""
        int2_heads, exact_heads = tuple(int2_heads), tuple(exact_heads)
        if len(int2_heads) != self.num_kv_heads or not exact_heads or set(int2_heads) & set(exact_heads):
            raise ValueError(f"oscar: exact heads {exact_heads} and INT2 heads {int2_heads} must be disjoint, the "
                             f"INT2 ones this cache's {self.num_kv_heads} heads")
        if self.num_layers != 1 or not self.identity_block_table:
            raise ValueError("oscar: exact heads need a one-layer cache with an identity block table (the backend's)")
        companion = PagedInt2KVCache(
            1, len(exact_heads), self.head_dim, max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
            page_size=self.page_size, num_sinks=self.num_sinks, window=self.window, identity_block_table=True,
            quantize=False, dtype=self.dtype, meta_dtype=self.meta_dtype, device=self.device, ring_format=ring_format)
        self.exact = ExactHeads(companion, int2_heads, exact_heads)
        return companion

    def set_transforms(self, layer: int, transforms: LayerTransforms) -> None:
        transforms.validate(self.num_kv_heads, self.head_dim)
        self.transforms[layer] = transforms.to(self.device)

    # ---------------------------------------------------------------- ops
    def _op_args(self, layer: int):
        return (*self.layers[layer].tensors(), self.block_table)

    def store_key_clip(self, tr: LayerTransforms) -> float:
        """The ``key_clip`` argument of ``oscar::store`` for this cache: per-channel keys take the page range ratio."""
        return float(tr.key_page_clip if self.key_format == "channel" else tr.key_clip)

    def store_key_feedback(self, tr: LayerTransforms):
        """The ``key_feedback`` argument of ``oscar::store``: the layer's factor with per-channel keys, else None."""
        pages = self.key_format == "channel" and self.quantize and not self.sliding_window
        return tr.key_feedback if pages else None

    def store_args(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The arguments of ``oscar::store`` that :meth:`store` passes (to call an implementation directly)."""
        tr = self.transforms[layer]
        return (k, v, positions, *self._op_args(layer), tr.key_transform, tr.key_mean, tr.value_transform,
                tr.value_mean, self.store_key_clip(tr), tr.value_clip, self.store_key_feedback(tr))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Write ``k, v [B, kv_heads, T, d]`` at ``positions [T] or [B, T]`` (negative = padding).

        Returns the transformed chunk ``(k', v') [B, T, kv_heads, d]``; pass it to :meth:`attention`
        as ``chunk=(k', v', positions)`` so the chunk attends to itself exactly. A sliding-window layer returns a
        chunk of more than one token with the ``sliding_window - 1`` tokens before it (``[B, W - 1 + T, ...]``):
        the write overwrote them in the ring, and the chunk's queries see them.
        """
        if self.sliding_window and positions.shape[-1] > self.max_chunk:
            raise CacheCapacityError(
                f"oscar: a sliding-window layer of this cache takes at most max_chunk={self.max_chunk} new tokens a "
                f"call (it returns them with the window of {self.sliding_window} before them), got {positions.shape[-1]}: "
                "prefill longer prompts in chunks, or make the cache with a larger max_chunk")
        return ops.store(*self.store_args(layer, k, v, positions))

    def attention_args(self, layer: int, q: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                       chunk: tuple | None = None) -> tuple:
        """The arguments of ``oscar::attention`` that :meth:`attention` passes (defaults resolved there)."""
        tr = self.transforms[layer]
        scale = self.head_dim**-0.5 if scale is None else float(scale)
        if seq_lens is None:
            seq_lens = (positions.amax(dim=-1) + 1).clamp(min=0).reshape(-1)
        if self.sliding_window and attn_mask is None:
            attn_mask = self.sliding_mask(positions, int(seq_lens.max()) if seq_lens.numel() else 0)
        k_chunk, v_chunk, chunk_positions = chunk if chunk is not None else (None, None, None)
        return (q, positions, seq_lens, *self._op_args(layer), tr.query_transform, tr.output_transform, tr.value_mean,
                attn_mask, is_causal, scale, k_chunk, v_chunk, chunk_positions, self.score_debias)

    def sliding_mask(self, positions: torch.Tensor, num_keys: int) -> torch.Tensor:
        """``[B, 1, T, num_keys]`` bool: query at ``i`` sees keys ``i - sliding_window < j <= i`` (what
        transformers' sliding-window layers mask; :meth:`attention` uses it when given no mask)."""
        pos = positions.reshape(-1, positions.shape[-1])[:, None, :, None]
        j = torch.arange(num_keys, device=positions.device)
        return (j <= pos) & (j > pos - self.sliding_window)

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        chunk: tuple | None = None,
    ) -> torch.Tensor:
        """Attention of ``q [B, q_heads, T, d]`` at ``positions`` over this layer's cache.

        ``seq_lens [B]`` (tokens stored per row) defaults to each row's newest query position + 1,
        right for self-attention right after ``store`` of the same positions. ``chunk`` is
        ``(k', v', chunk_positions)``: the newest tokens, read exactly (see :meth:`store`).
        """
        return ops.attention(*self.attention_args(layer, q, positions, seq_lens, attn_mask, is_causal, scale, chunk))

    def reorder_rows(self, rows: torch.Tensor) -> None:
        """Row ``b`` takes what row ``rows[b]`` holds, for ``b < len(rows)`` (beam search), in place.

        Rows may repeat. Sinks, rings, pages and lengths all move; the tensors stay where they are (CUDA
        graphs keep their addresses). With an identity block table this is device work only (no sync).
        """
        n = rows.shape[0]
        if n > self.max_batch_size:
            raise IndexError(f"oscar: reorder of {n} rows in a cache of {self.max_batch_size} rows")
        rows = rows.to(self.device, torch.long)
        if self.identity_block_table:
            src, dst = self.block_table[rows].long().flatten(), self.block_table[:n].long().flatten()
        else:  # pages owned per row on the host: read the order once
            order = rows.tolist()
            if any(len(self._row_pages[r]) != len(self._row_pages[b]) for b, r in enumerate(order)):
                raise CacheCapacityError("oscar: reorder_rows needs rows that own the same number of pages")
            src = torch.tensor([p for r in order for p in self._row_pages[r]], dtype=torch.long, device=self.device)
            dst = torch.tensor([p for b in range(n) for p in self._row_pages[b]], dtype=torch.long, device=self.device)
        for layer in self.layers:
            for t in (layer.k_sink, layer.v_sink, layer.k_ring, layer.v_ring):
                t[:n] = t.index_select(0, rows)
            for t in (layer.k_codes, layer.k_meta, layer.v_codes, layer.v_meta):
                t[dst] = t.index_select(0, src)
        self.seq_lens[:n] = self.seq_lens.index_select(0, rows)
        if self.exact is not None:
            self.exact.cache.reorder_rows(rows)

    def copy_rows_to(self, dst: "PagedInt2KVCache", rows: int, length: int) -> None:
        """Copy what rows ``[0, rows)`` hold for positions ``[0, length)`` into ``dst`` (same format, other sizes).

        A compiled model whose graphs were built for different cache sizes may write a sequence into one
        storage and continue it in another (see :mod:`oscar_compile.passes.capacity`); this moves it, on the
        device. Both caches need identity block tables, the same sinks, page size, heads and dtypes, and
        either the same window or windows that hold every position (``quantize=False``).
        """
        s, ps = self.num_sinks, self.page_size
        same = (s, ps, self.num_kv_heads, self.head_dim, self.group_size, self.dtype, self.meta_dtype, self.key_format,
                self.ring_format) == (dst.num_sinks, dst.page_size, dst.num_kv_heads, dst.head_dim, dst.group_size,
                                      dst.dtype, dst.meta_dtype, dst.key_format, dst.ring_format)
        windows_ok = self.window == dst.window or min(self.ring_len, dst.ring_len) >= length
        same_exact = (self.exact is None) == (dst.exact is None) and (
            self.exact is None or self.exact.heads == dst.exact.heads)
        if not (same and same_exact and windows_ok and self.identity_block_table and dst.identity_block_table):
            raise ValueError(f"oscar: cannot move rows from {self!r} to {dst!r}")
        if rows > min(self.max_batch_size, dst.max_batch_size) or length > min(self.capacity_tokens, dst.capacity_tokens):
            raise CacheCapacityError(f"oscar: {rows} rows of {length} tokens do not fit both {self!r} and {dst!r}")
        ring_pos = torch.arange(min(s + self.quantized_tokens(length), length), length, device=self.device)
        pages = self.pages_for(length)
        src_pages, dst_pages = self.block_table[:rows, :pages].long(), dst.block_table[:rows, :pages].long()
        for a, b in zip(self.layers, dst.layers):
            b.k_sink[:rows], b.v_sink[:rows] = a.k_sink[:rows], a.v_sink[:rows]
            if self.ring_len:
                b.k_ring[:rows, ring_pos % dst.ring_len] = a.k_ring[:rows, ring_pos % self.ring_len]
                b.v_ring[:rows, ring_pos % dst.ring_len] = a.v_ring[:rows, ring_pos % self.ring_len]
            for name in ("k_codes", "k_meta", "v_codes", "v_meta"):
                getattr(b, name)[dst_pages] = getattr(a, name)[src_pages]
        if self.exact is not None:
            self.exact.cache.copy_rows_to(dst.exact.cache, rows, length)

    def reset(self) -> None:
        """Forget every row (pages return to the pool; buffers are not cleared, they are never read unwritten)."""
        for row in range(self.max_batch_size):
            self.release(row)

    # ---------------------------------------------------------------- memory
    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this cache allocated (all layers, whole pool)."""
        tensors = [t for layer in self.layers for t in layer.tensors()] + [self.block_table, self.seq_lens]
        return sum(t.numel() * t.element_size() for t in tensors) + (self.exact.cache.nbytes if self.exact else 0)

    def memory_report(self, context_len: int) -> MemoryReport:
        """Memory one row of ``context_len`` tokens takes: its sink and ring buffers plus its pages."""
        h, d, nl = self.num_kv_heads, self.head_dim, self.num_layers
        # K and V: the row's full sink and ring buffers plus its pages (the block table is negligible).
        fp8_tokens = self.ring_len if self.ring_format == "fp8" else 0
        bf16_tokens, page_tokens = self.num_sinks + self.ring_len - fp8_tokens, self.pages_for(context_len) * self.page_size
        values = row_bytes(h, d, bf16_tokens, page_tokens, self.group_size, self.dtype, self.meta_dtype,
                           fp8_tokens=fp8_tokens)
        keys = row_bytes(h, d, bf16_tokens, page_tokens, self.group_size, self.dtype, self.meta_dtype,
                         channel_page=self.page_size if self.key_format == "channel" else 0, fp8_tokens=fp8_tokens)
        per_layer = keys + values
        elements = 2 * context_len * h * d
        return MemoryReport(
            context_len=context_len, num_layers=nl, num_kv_heads=h, head_dim=d,
            int2_bytes=per_layer * nl, bf16_bytes=elements * 2 * nl,
            bytes_per_token_per_layer=per_layer / context_len,
            bits_per_element=8 * per_layer / elements,
        )

    @property
    def page_bits_per_element(self) -> float:
        """Bits per element of the pages, keys and values averaged."""
        values = bits_per_element(self.head_dim, self.group_size, self.meta_dtype)
        if self.key_format == "channel":
            return (values + channel_bits_per_element(self.page_size, self.meta_dtype)) / 2
        return values

    def __repr__(self) -> str:
        return (
            f"PagedInt2KVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"batch={self.max_batch_size}, max_seq_len={self.max_seq_len}, pages={self.num_pages}x{self.page_size}, "
            f"sinks={self.num_sinks}, window={self.window}, group={self.group_size}, quantize={self.quantize}, "
            + (f"keys per channel over pages, ring {self.ring_len}, " if self.key_format == "channel" else "")
            + ("FP8 ring, " if self.ring_format == "fp8" else "")
            + (f"exact heads {list(self.exact.exact_heads)}, " if self.exact else "") +
            f"{self.nbytes / 2**20:.1f} MiB on {self.device})"
        )
