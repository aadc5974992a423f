"""Helpers for tests of oscar-compile and of code built on it (random transforms, float64 oracles)."""

from __future__ import annotations

import torch

from .cache import LayerTransforms, PagedInt2KVCache
from .kernels.store import transform_rows
from .quant import dequantize_int2, quantize_int2, quantize_int2_channels


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
    """``kind``: identity | orthogonal | invertible (means random unless identity). ``clip``: every clip ratio
    (per-token keys and values, and per-channel keys' page range)."""
    if kind == "identity":
        t = LayerTransforms.identity(h, d)
    else:
        make = random_orthogonal if kind == "orthogonal" else random_invertible
        t = LayerTransforms.from_matrices(
            make(h, d, gen), make(h, d, gen),
            key_mean=torch.randn(h, d, generator=gen), value_mean=torch.randn(h, d, generator=gen),
        )
    t.key_clip = t.value_clip = t.key_page_clip = clip
    return t


def anisotropic_moment(h: int, d: int, gen: torch.Generator, spread: float = 100.0) -> torch.Tensor:
    """A random ``[h, d, d]`` second moment whose eigenvalues span ``spread`` (log-uniform) in a random basis: the
    queries' ``E[q q^T]`` that error-feedback rounding of keys is weighted by (a multiple of the identity gains
    nothing)."""
    basis = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0]
    eig = spread ** -torch.rand(h, d, generator=gen, dtype=torch.float64)
    return (basis * eig[:, None, :]) @ basis.transpose(-1, -2)


def twin_caches(h: int, d: int, batch: int, max_len: int, num_sinks: int, window: int, page_size: int,
                group_size: int | None = None, dtype=torch.float32, kind: str = "orthogonal", clip: float = 1.0,
                seed: int = 0, device="cpu", key_format: str = "token", **cache_options
                ) -> tuple[PagedInt2KVCache, PagedInt2KVCache]:
    """Two identical one-layer caches (same random transforms, every row allocated to ``max_len``): one
    for a reference implementation, one for the implementation under test. ``cache_options``: more
    :class:`PagedInt2KVCache` arguments (``quantize``, ``ring_format``, ...)."""
    tr = random_transforms(h, d, kind, torch.Generator().manual_seed(seed), clip=clip)
    caches = []
    for _ in range(2):
        c = PagedInt2KVCache(1, h, d, max_batch_size=batch, max_seq_len=max_len, num_sinks=num_sinks, window=window,
                             page_size=page_size, group_size=group_size, dtype=dtype, device=device,
                             key_format=key_format, **cache_options)
        c.set_transforms(0, tr)
        for r in range(batch):
            c.allocate(r, max_len)
        caches.append(c)
    return caches[0], caches[1]


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

    def append(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record ``k, v [H, T, d]`` appended to ``row``."""
        self.append_batch(k[None], v[None], [k.shape[-2]], rows=[row])

    def append_batch(self, k: torch.Tensor, v: torch.Tensor, lengths: list[int], rows: list[int] | None = None) -> None:
        """Record ``k, v [B, H, T, d]``: row ``rows[i]`` (default ``i``) appends its first ``lengths[i]`` tokens.

        The whole batch is transformed at once, as the store op transforms it: CPU matmuls of another
        batch shape may sum in another order, and a one-ulp difference flips INT2 codes.
        """
        kt = transform_rows(k, self.tr.key_transform, self.tr.key_mean).to(self.cache.dtype)
        vt = transform_rows(v, self.tr.value_transform, self.tr.value_mean).to(self.cache.dtype)
        for i, n in enumerate(lengths):
            row = i if rows is None else rows[i]
            self.keys[row].extend(kt[i, :n].unbind(0))
            self.values[row].extend(vt[i, :n].unbind(0))

    def history(self, row: int, tokens: list[torch.Tensor], clip: float, exact_from: int, channel: bool = False) -> torch.Tensor:
        """Stored history; positions ``>= exact_from`` (the newest chunk) are read exactly. ``channel``: the side
        is quantized per channel over whole pages (the cache's per-channel keys; ``clip`` then narrows each channel's
        range about its midpoint)."""
        c = self.cache
        x = torch.stack(tokens).double()  # [L, H, d]
        length, (_, h, d) = x.shape[0], x.shape
        lo, hi = c.num_sinks, c.num_sinks + c.quantized_tokens(length)
        if channel and hi > lo:  # every whole page, its chunk tokens included; those are then read exactly
            by_page = x[lo:hi].to(c.dtype).float().reshape(-1, c.page_size, h, d).transpose(1, 2)
            packed, scale, mn = quantize_int2_channels(by_page, c.meta_dtype, clip)
            deq = dequantize_int2(packed, scale[..., None, :], mn[..., None, :], group_size=1)
            exact = x[exact_from:].clone()
            x[lo:hi] = deq.transpose(1, 2).reshape(hi - lo, h, d).double()
            x[exact_from:] = exact
        elif min(hi, exact_from) > lo:
            hi = min(hi, exact_from)
            packed, scale, mn = quantize_int2(x[lo:hi].to(c.dtype).float(), c.group_size, clip, c.meta_dtype)
            x[lo:hi] = dequantize_int2(packed, scale, mn, c.group_size).double()
        return x

    def attention(self, row: int, q: torch.Tensor, q_pos: torch.Tensor, scale: float, causal: bool = True,
                  chunk: int = 0) -> torch.Tensor:
        """``q [Hq, T, d]`` at absolute positions ``q_pos [T]`` -> ``[Hq, T, d]`` float64.

        The newest ``chunk`` tokens are read exactly (as when attention gets the stored chunk).
        """
        exact_from = len(self.keys[row]) - chunk
        keys = self.history(row, self.keys[row], self.cache.store_key_clip(self.tr), exact_from,
                            channel=self.cache.key_format == "channel")
        vals = self.history(row, self.values[row], self.tr.value_clip, exact_from)
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


def decode_against_oracle(cache: PagedInt2KVCache, oracle: CacheOracle, lengths: list[int], steps: int, q_heads: int,
                          scale: float, gen: torch.Generator, key_offset: float = 0.0) -> tuple[list[int], float]:
    """``steps`` decode steps on every row of layer 0 (random ``k + key_offset``, ``v``, ``q`` drawn in that
    order), through the cache's ops and the oracle. Returns the rows' new lengths and the worst relative error."""
    b, h, d = len(lengths), cache.num_kv_heads, cache.head_dim
    worst = 0.0
    for _ in range(steps):
        pos = torch.tensor(lengths)[:, None]
        for row, n in enumerate(lengths):
            cache.allocate(row, n + 1)
        k, v = torch.randn(b, h, 1, d, generator=gen) + key_offset, torch.randn(b, h, 1, d, generator=gen)
        q = torch.randn(b, q_heads, 1, d, generator=gen)
        cache.store(0, k, v, pos)
        out = cache.attention(0, q, pos, scale=scale)
        oracle.append_batch(k, v, [1] * b)
        for row in range(b):
            worst = max(worst, rel_error(out[row], oracle.attention(row, q[row], pos[row], scale)))
        lengths = [n + 1 for n in lengths]
    return lengths, worst


def replay_decode_in_cuda_graph(ref: PagedInt2KVCache, got: PagedInt2KVCache, prefill: int, steps: int, q_heads: int,
                                tol: float, seed: int = 0) -> None:
    """Twin caches on CUDA (:func:`twin_caches`): ``prefill`` random tokens a row, then ``steps`` decode steps whose
    Triton store + attention on ``got`` are captured once in a CUDA graph (after one eager step, which compiles the
    kernels) and replayed; every step is checked against the reference ops on ``ref`` (relative error < ``tol``).
    A degenerating kernel, or one that reads back to the host, fails here."""
    from .kernels.attention import attention_reference
    from .kernels.store import store_reference
    from .kernels.triton_attention import attention_triton
    from .kernels.triton_store import store_triton

    batch, h, d, dt = ref.max_batch_size, ref.num_kv_heads, ref.head_dim, ref.dtype
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (torch.randn(batch, h, prefill, d, device="cuda", generator=gen, dtype=dt) for _ in range(2))
    pos = torch.arange(prefill, device="cuda")
    store_reference(*ref.store_args(0, k, v, pos))
    store_triton(*got.store_args(0, k, v, pos))
    # static buffers the graph reads; refilled before every replay
    p1 = torch.full((batch, 1), prefill, device="cuda", dtype=torch.long)
    k1 = torch.empty(batch, h, 1, d, device="cuda", dtype=dt)
    v1, q1 = torch.empty_like(k1), torch.empty(batch, q_heads, 1, d, device="cuda", dtype=dt)

    def refill():
        for x in (k1, v1, q1):
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))

    def step():
        store_triton(*got.store_args(0, k1, v1, p1))
        return attention_triton(*got.attention_args(0, q1, p1, p1[:, 0] + 1))

    def check(out):
        store_reference(*ref.store_args(0, k1, v1, p1))
        err = rel_error(out, attention_reference(*ref.attention_args(0, q1, p1, p1[:, 0] + 1)))
        assert err < tol, (int(p1[0, 0]), err)

    refill()
    check(step())  # step 0 eagerly: compiles the kernels
    p1 += 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run
        graph_out = step()
    for _ in range(1, steps):
        refill()
        graph.replay()
        check(graph_out)
        p1 += 1


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- models for tests
class TinyDecoder(torch.nn.Module):
    """A small decoder that is *not* transformers code, written the gpt-fast way.

    It keeps its own KV buffers ``[batch, kv_heads, max_len, head_dim]`` written with
    ``cache[:, :, input_pos] = k``, builds a boolean causal mask by indexing a mask buffer with the
    positions, applies its own RoPE and expands GQA with ``repeat_interleave``. With
    ``reference`` set to a :class:`PagedInt2KVCache` it calls the oscar ops directly instead (the
    oracle for the compiled model).

    ``layout="seq"`` keeps the buffers sequence-major ``[batch, max_len, kv_heads, head_dim]`` (Meta's
    reference Llama, flash-attn style code), read through ``transpose(1, 2)``; ``write`` picks the idiom
    that fills them: ``"setitem"`` (``cache[..., input_pos] = k``), ``"index_copy"``, ``"index_put"`` (the aten op) or
    ``"slice"`` (``cache[..., start:start + T] = k``, with ``forward(..., start=int)``).
    """

    def __init__(self, vocab: int = 97, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 max_len: int = 64, batch: int = 2, seed: int = 0, layout: str = "head", write: str = "setitem"):
        super().__init__()
        if layout not in ("head", "seq") or write not in ("setitem", "index_copy", "index_put", "slice"):
            raise ValueError(f"TinyDecoder: layout {layout!r} / write {write!r}")
        self.layout, self.write = layout, write
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.embed = torch.nn.Parameter(torch.randn(vocab, dim, generator=gen) * 0.5)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            blk = torch.nn.Module()
            for name, shape in (("wq", (dim, dim)), ("wk", (kv_heads * self.head_dim, dim)),
                                ("wv", (kv_heads * self.head_dim, dim)), ("wo", (dim, dim)),
                                ("w1", (2 * dim, dim)), ("w2", (dim, 2 * dim))):
                setattr(blk, name, torch.nn.Parameter(torch.randn(*shape, generator=gen) / shape[1] ** 0.5))
            cache_shape = (batch, kv_heads, max_len, self.head_dim) if layout == "head" else (
                batch, max_len, kv_heads, self.head_dim)
            blk.register_buffer("k_cache", torch.zeros(cache_shape))
            blk.register_buffer("v_cache", torch.zeros(cache_shape))
            self.blocks.append(blk)
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv)
        self.reference: PagedInt2KVCache | None = None

    def _rope(self, x, pos):
        ang = pos.float()[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def _write(self, cache: torch.Tensor, new: torch.Tensor, input_pos: torch.Tensor, start: int | None) -> None:
        """``new`` ([B, H, T, d]) into ``cache`` at ``input_pos``, by this model's idiom and layout."""
        dim = 2 if self.layout == "head" else 1
        if dim == 1:
            new = new.transpose(1, 2)
        lead = (slice(None),) * dim
        if self.write == "setitem":
            cache[(*lead, input_pos)] = new
        elif self.write == "index_copy":
            cache.index_copy_(dim, input_pos, new)
        elif self.write == "index_put":  # the aten op: eager Tensor.index_put_ takes no None index
            torch.ops.aten.index_put_(cache, [None] * dim + [input_pos], new)
        else:
            cache[(*lead, slice(start, start + new.shape[dim]))] = new

    def _read(self, cache: torch.Tensor) -> torch.Tensor:
        return cache if self.layout == "head" else cache.transpose(1, 2)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, start: int | None = None) -> torch.Tensor:
        b, t = tokens.shape
        x = self.embed[tokens]
        mask = self.causal[None, None, input_pos]  # [1, 1, T, max_len]
        rep = self.heads // self.kv_heads
        for i, blk in enumerate(self.blocks):
            h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
            q = (h @ blk.wq.T).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = (h @ blk.wk.T).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = (h @ blk.wv.T).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, input_pos), self._rope(k, input_pos)
            if self.reference is not None:
                kt, vt = self.reference.store(i, k, v, input_pos)
                o = self.reference.attention(i, q, input_pos, attn_mask=mask, chunk=(kt, vt, input_pos))
            else:
                self._write(blk.k_cache, k, input_pos, start)
                self._write(blk.v_cache, v, input_pos, start)
                kk = self._read(blk.k_cache).repeat_interleave(rep, dim=1)
                vv = self._read(blk.v_cache).repeat_interleave(rep, dim=1)
                o = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            x = x + o.transpose(1, 2).reshape(b, t, -1) @ blk.wo.T
            h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
            x = x + torch.nn.functional.silu(h @ blk.w1.T) @ blk.w2.T
        return x @ self.embed.T


def hadamard_reference_cache(model, batch: int, max_len: int, dtype=torch.float32, device="cpu",
                             **cache_options) -> PagedInt2KVCache:
    """An INT2 cache shaped for ``model`` with the transforms the backend uses without artifacts (Hadamard),
    every row allocated to ``max_len``: the cache :func:`reference_attention` calls the ops on. Its key format and
    page size are the backend's defaults unless ``cache_options`` name them."""
    from .backend import BackendOptions, resolve_page_size
    from .hf import _model_config, kv_geometry

    cache_options.setdefault("key_format", BackendOptions.key_format)
    cache_options["page_size"] = resolve_page_size(cache_options["key_format"], cache_options.get("page_size"))

    h, d = kv_geometry(model)
    layers = _model_config(model).num_hidden_layers
    cache = PagedInt2KVCache(layers, h, d, max_batch_size=batch, max_seq_len=max_len, dtype=dtype, device=device,
                             **cache_options)
    for layer in range(layers):
        cache.set_transforms(layer, LayerTransforms.hadamard(h, d))
    for row in range(batch):
        cache.allocate(row, max_len)
    return cache


def reference_attention(cache: PagedInt2KVCache):
    """A transformers attention function that calls the oscar ops on ``cache`` directly.

    Register it (``AttentionInterface.register(name, fn)``) and run the model eagerly with a
    ``DynamicCache``: the keys/values it receives hold the whole history, the last ``T`` are new.
    """

    def attention_fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
        t, length = query.shape[2], key.shape[2]
        positions = torch.arange(length - t, length, device=query.device)
        kt, vt = cache.store(module.layer_idx, key[:, :, -t:], value[:, :, -t:], positions)
        # No mask with several queries means causal over the absolute positions (bottom-right aligned: a later
        # prefill chunk sees the earlier ones), which is what transformers' mask would say.
        causal = bool(t > 1 and attention_mask is None and (is_causal if is_causal is not None else module.is_causal))
        q_pos = positions
        seq_lens = torch.full((1,), length, device=query.device)
        out = cache.attention(module.layer_idx, query, q_pos, seq_lens=seq_lens, attn_mask=attention_mask,
                              is_causal=causal, scale=scaling, chunk=(kt, vt, positions))
        return out.transpose(1, 2).contiguous(), None

    return attention_fn


def register_reference_attention(name: str, cache: PagedInt2KVCache) -> None:
    """Register :func:`reference_attention` as attention implementation ``name``, with masks that are never
    skipped: transformers hands a custom implementation no mask where SDPA's ``is_causal`` would do, which
    drops a sliding window."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def always_mask(*args, **kwargs):
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(name, reference_attention(cache))
    AttentionMaskInterface.register(name, always_mask)


# ----------------------------------------------------------------------------- transformers helpers
_COMMON = dict(vocab_size=97, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "olmo2", "phi3", "gemma", "llama-mqa")


def tiny_config(family: str):
    """A small config of a transformers family (random weights; for pass and backend tests only)."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(**_COMMON)
    if family == "qwen2":  # attention biases
        return transformers.Qwen2Config(**_COMMON)
    if family == "qwen3":  # q/k norms, explicit head_dim
        return transformers.Qwen3Config(**_COMMON, head_dim=16)
    if family == "mistral":
        return transformers.MistralConfig(**_COMMON, sliding_window=None)
    if family == "olmo2":  # q/k norms over the whole projection, before RoPE
        return transformers.Olmo2Config(**_COMMON)
    if family == "phi3":  # fused qkv projection, partial rotary
        return transformers.Phi3Config(**{k: v for k, v in _COMMON.items() if k != "pad_token_id"},
                                       partial_rotary_factor=0.5, pad_token_id=0)
    if family == "gemma":  # head_dim 256 (wider than hidden / heads), GeGLU, scaled embeddings
        return transformers.GemmaConfig(**_COMMON, head_dim=256)
    if family == "llama-mqa":  # one KV head
        return transformers.LlamaConfig(**{**_COMMON, "num_key_value_heads": 1})
    if family == "gpt2":  # no RoPE, no GQA
        return transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                                       eos_token_id=2)
    raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


# Families whose configs mix sliding-window and full-attention layers (window 8: test prompts pass it).
SLIDING_FAMILIES = ("mistral-window", "qwen2-window", "qwen3-window", "gemma3")


def tiny_sliding_config(family: str, window: int = 8):
    """A small config with sliding-window layers (random weights; pass and backend tests)."""
    import transformers

    if family == "mistral-window":  # every layer sliding
        return transformers.MistralConfig(**_COMMON, sliding_window=window)
    if family == "qwen2-window":  # layer 0 full, layer 1 sliding
        return transformers.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=window, max_window_layers=1)
    if family == "qwen3-window":
        return transformers.Qwen3Config(**_COMMON, head_dim=16, use_sliding_window=True, sliding_window=window,
                                        max_window_layers=1)
    if family == "gemma3":  # q/k norms, query_pre_attn_scalar, local + global layers
        return transformers.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=window, query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention", "full_attention"])
    raise ValueError(f"unknown sliding-window family {family!r}; known: {SLIDING_FAMILIES}")


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_sliding_config(family) if family in SLIDING_FAMILIES else tiny_config(family)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


from .hf import cache_kwarg, make_hf_cache  # noqa: E402,F401  (re-exported for tests)


@torch.no_grad()
def prefill_and_decode(model, ids: torch.Tensor, cache, steps: int) -> torch.Tensor:
    """Logits of a prefill of ``ids`` then ``steps`` greedy decode steps, concatenated over time.

    Each step's logits are cloned: under CUDA graphs (mode="reduce-overhead") an output lives in the graph's
    memory pool and the next replay overwrites it.
    """
    kw = cache_kwarg(getattr(model, "_orig_mod", model))
    out = model(ids, **{kw: cache}, use_cache=True)
    logits = [out.logits.clone()]
    tok = logits[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(tok, **{kw: cache}, use_cache=True)
        logits.append(out.logits.clone())
        tok = logits[-1][:, -1:].argmax(-1)
    return torch.cat(logits, dim=1)


def gemma3_like_model(device, dtype, window: int, layers: int = 2, hidden: int = 128):
    """Gemma 3 270M's attention geometry (head_dim 256, one KV head for 4 query heads, q/k norms,
    ``query_pre_attn_scalar``; five sliding layers to one full layer, or one of each at ``layers`` < 6),
    small elsewhere; random weights."""
    import transformers

    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    layer_types = pattern * (layers // 6) if layers >= 6 else ["sliding_attention", "full_attention"]
    cfg = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=1,
                                        head_dim=256, query_pre_attn_scalar=256, sliding_window=window,
                                        max_position_embeddings=32768, layer_types=layer_types, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.eval().to(device=device, dtype=dtype)


def quantize_off_vs_eager(model, context: int, steps: int, max_chunk: int, chunk: int, batch: int = 2,
                          num_sinks: int = 4, window: int = 8) -> float:
    """Relative error of the oscar session with quantization off (prompt prefilled in chunks of ``chunk``,
    then ``steps`` decode steps, past a sliding ring's wrap) against one eager forward over the whole
    sequence (transformers' own masks, no cache); logits centred per row (softmax ignores a shift)."""
    from .evaluation import Method, Session

    device, dtype = model.device, model.dtype
    ids = torch.randint(1, model.config.vocab_size, (batch, context + steps),
                        generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        ref = model(ids).logits.float()
    s = Session(model, Method("bf16", "bf16", options={"max_chunk": max_chunk}), batch, context + steps,
                num_sinks=num_sinks, window=window, cache_dtype=dtype, prefill_chunk=chunk)
    got = torch.stack([s(ids[:, :context])] + [s(ids[:, p : p + 1]) for p in range(context, context + steps - 1)], 1)
    want = ref[:, context - 1 : context + steps - 1]
    return rel_error(got - got.mean(-1, keepdim=True), want - want.mean(-1, keepdim=True))
