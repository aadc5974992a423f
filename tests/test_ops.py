import pytest
import torch
import torch.nn.functional as F

import oscar_compile  # noqa: F401  (registers torch.ops.oscar)
from oscar_compile import PagedInt2KVCache
from oscar_compile.testing import CacheOracle, decode_against_oracle, random_transforms, rel_error


def _filled_cache(gen, h=2, d=16, lengths=(21, 9), **kw):
    kw = {"max_seq_len": 64, "num_sinks": 3, "window": 5, "page_size": 4, "max_batch_size": len(lengths), **kw}
    cache = PagedInt2KVCache(1, h, d, **kw)
    cache.set_transforms(0, random_transforms(h, d, "orthogonal", gen, clip=0.9))
    t = max(lengths)
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in lengths])
    for row, n in enumerate(lengths):
        cache.allocate(row, n)
    k, v = (torch.randn(len(lengths), h, t, d, generator=gen) for _ in range(2))
    cache.store(0, k, v, pos)
    return cache, pos


def test_opcheck_store_and_attention():
    gen = torch.Generator().manual_seed(0)
    cache, pos = _filled_cache(gen)
    b, h, d = 2, 2, 16
    k, v = (torch.randn(b, h, 1, d, generator=gen) for _ in range(2))
    step = pos.max(dim=1, keepdim=True).values + 1
    for row in range(b):
        cache.allocate(row, int(step[row]) + 1)
    torch.library.opcheck(torch.ops.oscar.store.default, cache.store_args(0, k, v, step))
    q = torch.randn(b, 3 * h, 1, d, generator=gen)
    torch.library.opcheck(torch.ops.oscar.attention.default, cache.attention_args(0, q, step))
    q = torch.randn(b, 3 * h, 4, d, generator=gen)
    qpos = torch.stack([torch.arange(4) + int(step[r]) - 3 for r in range(b)])
    mask = torch.rand(b, 1, 4, 40, generator=gen) > 0.3
    torch.library.opcheck(torch.ops.oscar.attention.default, cache.attention_args(0, q, qpos, attn_mask=mask, is_causal=True))


def test_store_declares_exactly_what_it_mutates():
    schema = torch.ops.oscar.store.default._schema
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == {"k_codes", "k_meta", "v_codes", "v_meta", "k_sink", "v_sink", "k_ring", "v_ring"}
    assert not any(a.alias_info is not None for a in torch.ops.oscar.attention.default._schema.arguments)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 3, 6])
def test_attention_matches_float64_oracle_over_prefill_and_300_decode_steps(d, gqa):
    gen = torch.Generator().manual_seed(d * 10 + gqa)
    h, s, w, ps = 2, 5, 24, 16
    prefill = [37, 3, 70]  # not multiples of the page size; different per row
    steps = 300
    cache = PagedInt2KVCache(1, h, d, max_batch_size=3, max_seq_len=400, num_sinks=s, window=w, page_size=ps,
                             dtype=torch.float32, meta_dtype=torch.float16)
    kind = ["orthogonal", "invertible", "identity"][d % 3]
    cache.set_transforms(0, random_transforms(h, d, kind, gen, clip=0.95 if gqa == 3 else 1.0))
    oracle = CacheOracle(cache)
    scale = d**-0.5
    t = max(prefill)
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in prefill])
    k, v = torch.randn(3, h, t, d, generator=gen), torch.randn(3, h, t, d, generator=gen) * 2 + 0.5
    q = torch.randn(3, h * gqa, t, d, generator=gen)
    for row, n in enumerate(prefill):
        cache.allocate(row, n)
    oracle.append_batch(k, v, prefill)
    kt, vt = cache.store(0, k, v, pos)
    out = cache.attention(0, q, pos, is_causal=True, scale=scale)  # every key through the cache
    exact = cache.attention(0, q, pos, is_causal=True, scale=scale, chunk=(kt, vt, pos))  # chunk read exactly
    for row, n in enumerate(prefill):
        ref = oracle.attention(row, q[row, :, :n], torch.arange(n), scale)
        assert rel_error(out[row, :, :n], ref) < 1e-3
        ref_exact = oracle.attention(row, q[row, :, :n], torch.arange(n), scale, chunk=n)
        assert rel_error(exact[row, :, :n], ref_exact) < 1e-3
        assert (out[row, :, n:] == 0).all() and (exact[row, :, n:] == 0).all()  # padding queries
    assert rel_error(exact, out) > 1e-3  # the chunk really was read differently
    lengths, worst = decode_against_oracle(cache, oracle, list(prefill), steps, h * gqa, scale, gen)
    assert min(lengths) > s + w + ps  # every row crossed from ring into several pages
    assert worst < 1e-3, worst


def test_default_sinks_and_window_cross_into_pages():
    gen = torch.Generator().manual_seed(7)
    h, d = 1, 64
    cache = PagedInt2KVCache(1, h, d, max_seq_len=420, dtype=torch.float32)  # 64 sinks, 256 window
    cache.set_transforms(0, random_transforms(h, d, "orthogonal", gen))
    oracle = CacheOracle(cache)
    n = 20
    cache.allocate(0, n)
    k, v = torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)
    cache.store(0, k, v, torch.arange(n))
    oracle.append(0, k[0], v[0])
    worst = 0.0
    for p in range(n, 400):
        cache.allocate(0, p + 1)
        k, v, q = (torch.randn(1, h, 1, d, generator=gen) for _ in range(3))
        cache.store(0, k, v, torch.tensor([p]))
        oracle.append(0, k[0], v[0])
        out = cache.attention(0, q, torch.tensor([p]))
        worst = max(worst, rel_error(out[0], oracle.attention(0, q[0], torch.tensor([p]), d**-0.5)))
    assert cache.pages_for(400) == 5 and worst < 1e-3


def test_chunked_prefill_gives_the_same_cache_as_one_shot():
    gen = torch.Generator().manual_seed(11)
    h, d, n = 2, 32, 90
    k, v = torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)
    tr = random_transforms(h, d, "orthogonal", gen, clip=0.9)
    caches = []
    for chunks in ([n], [10, 1, 33, 46], [1] * n):
        cache = PagedInt2KVCache(1, h, d, max_seq_len=128, num_sinks=4, window=16, page_size=8)  # bf16 ring
        cache.set_transforms(0, tr)
        cache.allocate(0, n)
        start = 0
        for c in chunks:
            cache.store(0, k[:, :, start : start + c], v[:, :, start : start + c], torch.arange(start, start + c))
            start += c
        caches.append(cache)
    for other in caches[1:]:
        for a, b in zip(caches[0].layers[0].tensors(), other.layers[0].tensors()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["orthogonal", "invertible"])
def test_transforms_are_exact_without_quantization(kind):
    """With every token in the (fp32) ring, any transform pair and any means leave attention unchanged."""
    gen = torch.Generator().manual_seed(5)
    h, gqa, d, n = 2, 3, 64, 50
    k, v = torch.randn(2, h, n, d, generator=gen), torch.randn(2, h, n, d, generator=gen)
    q = torch.randn(2, h * gqa, n, d, generator=gen)
    outs = []
    for transforms in ("identity", kind):
        cache = PagedInt2KVCache(1, h, d, max_batch_size=2, max_seq_len=n, quantize=False, dtype=torch.float32)
        cache.set_transforms(0, random_transforms(h, d, transforms, gen))
        cache.store(0, k, v, torch.arange(n))
        outs.append(cache.attention(0, q, torch.arange(n), is_causal=True))
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1), is_causal=True)
    assert rel_error(outs[0], sdpa) < 1e-5
    # fp32 products with matrices of condition number <= 16 and their inverses: ~1e-6 relative
    assert rel_error(outs[1], sdpa) < 1e-4


def test_boolean_and_additive_masks_match_sdpa():
    gen = torch.Generator().manual_seed(6)
    h, gqa, d, n, lk = 2, 2, 32, 12, 20
    k, v = torch.randn(2, h, n, d, generator=gen), torch.randn(2, h, n, d, generator=gen)
    q = torch.randn(2, h * gqa, n, d, generator=gen)
    keep = torch.rand(2, 1, n, lk, generator=gen) > 0.4
    keep[..., 0] = True  # every query sees at least one key
    cache = PagedInt2KVCache(1, h, d, max_batch_size=2, max_seq_len=lk, quantize=False, dtype=torch.float32)
    cache.store(0, k, v, torch.arange(n))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1), attn_mask=keep[..., :n])
    out_bool = cache.attention(0, q, torch.arange(n), attn_mask=keep)
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    out_add = cache.attention(0, q, torch.arange(n), attn_mask=additive)
    assert rel_error(out_bool, ref) < 1e-5 and rel_error(out_add, ref) < 1e-5
    # A mask over a shorter key view hides the keys past it (what SDPA over that view computes).
    short = keep[..., :7]
    ref_short = F.scaled_dot_product_attention(q, k[:, :, :7].repeat_interleave(gqa, 1), v[:, :, :7].repeat_interleave(gqa, 1), attn_mask=short)
    assert rel_error(cache.attention(0, q, torch.arange(n), attn_mask=short), ref_short) < 1e-5


def test_causal_positions_are_separate_from_cache_length():
    """SDPA's top-left ``is_causal`` over the first T keys of a longer cache: positions arange(T), seq_lens L."""
    gen = torch.Generator().manual_seed(12)
    h, d, n, t = 2, 32, 15, 6
    k, v = torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)
    q = torch.randn(1, h, t, d, generator=gen)
    cache = PagedInt2KVCache(1, h, d, max_seq_len=n, quantize=False, dtype=torch.float32)
    cache.store(0, k, v, torch.arange(n))
    out = cache.attention(0, q, torch.arange(t), seq_lens=torch.tensor([n]), is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # top-left: query i sees keys <= i
    assert rel_error(out, ref) < 1e-5


def test_bad_inputs_give_clear_errors():
    gen = torch.Generator().manual_seed(9)
    cache, pos = _filled_cache(gen)
    k = torch.randn(2, 2, 1, 16, generator=gen)
    with pytest.raises(TypeError, match="floating"):
        cache.store(0, k.to(torch.int32), k, pos[:, :1])
    with pytest.raises(ValueError, match="heads of dim"):
        cache.store(0, k[:, :1], k[:, :1], pos[:, :1])
    with pytest.raises(ValueError, match="positions"):
        cache.store(0, k, k, torch.tensor([[0, 1], [0, 1]]))
    with pytest.raises(TypeError, match="positions must be int"):
        cache.store(0, k, k, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="consecutive"):
        cache.store(0, torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="not a multiple"):
        cache.attention(0, torch.randn(2, 3, 1, 16), pos[:, :1])
    with pytest.raises(ValueError, match="head_dim"):
        cache.attention(0, torch.randn(2, 4, 1, 8), pos[:, :1])
    with pytest.raises(ValueError, match="seq_lens"):
        cache.attention(0, torch.randn(2, 4, 1, 16), pos[:, :1], seq_lens=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="outside"):
        cache.attention(0, torch.randn(2, 4, 1, 16), pos[:, :1], seq_lens=torch.tensor([1, 1000]))
    with pytest.raises(TypeError, match="bool or floating"):
        cache.attention(0, torch.randn(2, 4, 1, 16), pos[:, :1], attn_mask=torch.ones(2, 1, 1, 30, dtype=torch.int64))
    with pytest.raises(ValueError, match="scale"):
        cache.attention(0, torch.randn(2, 4, 1, 16), pos[:, :1], scale=-1.0)
    with pytest.raises(ValueError, match="batch 3 exceeds"):
        cache.store(0, torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16), torch.zeros(1, dtype=torch.long))


def test_cuda_fallback_to_the_reference_is_reported_once_and_refused_under_capture(monkeypatch, caplog):
    """Shapes the Triton kernels do not take run on the reference on CUDA: one warning that says why, and under
    CUDA-graph capture (where the reference's host reads fail obscurely) a clear error instead."""
    from oscar_compile import ops

    monkeypatch.setattr(ops, "_FALLBACKS_REPORTED", set())
    with caplog.at_level("WARNING", logger="oscar_compile"):
        ops._reference_on_cuda("store", 128, 4, 8)
        ops._reference_on_cuda("store", 128, 4, 8)
        ops._reference_on_cuda("attention", 80, 4, 0)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "pages of 8" in msgs[0] and "reference" in msgs[0]
    assert "head_dim 80" in msgs[1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ops.ReferenceUnderCaptureError, match="cannot be captured in a CUDA graph"):
        ops._reference_on_cuda("store", 128, 4, 8)
