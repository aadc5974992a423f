import pytest
import torch

from oscar_compile import CacheCapacityError, LayerTransforms, PagedInt2KVCache
from oscar_compile.quant import unpack_int2


def _kv(gen, b, h, t, d, dtype=torch.bfloat16):
    return (torch.randn(b, h, t, d, generator=gen).to(dtype), torch.randn(b, h, t, d, generator=gen).to(dtype))


def test_sink_and_ring_tokens_come_back_bit_exact():
    gen = torch.Generator().manual_seed(0)
    s, w, h, d = 8, 16, 2, 64
    cache = PagedInt2KVCache(1, h, d, max_batch_size=2, max_seq_len=200, num_sinks=s, window=w, page_size=16)
    lengths = [70, 13]
    ks, vs = [], []
    for row, n in enumerate(lengths):
        cache.allocate(row, n)
        k, v = _kv(gen, 1, h, n, d)
        pos = torch.arange(n)
        padded = torch.full((2, n), -1)
        padded[row] = pos
        kk = torch.zeros(2, h, n, d, dtype=k.dtype)
        vv = torch.zeros_like(kk)
        kk[row], vv[row] = k[0], v[0]
        cache.store(0, kk, vv, padded)  # the other row is padding: it must stay untouched
        ks.append(k[0].transpose(0, 1))  # [T, H, d]
        vs.append(v[0].transpose(0, 1))
    layer = cache.layers[0]
    for row, n in enumerate(lengths):
        n_sink = min(s, n)
        assert torch.equal(layer.k_sink[row, :n_sink], ks[row][:n_sink])
        assert torch.equal(layer.v_sink[row, :n_sink], vs[row][:n_sink])
        for p in range(max(s, n - w), n):  # the ring holds the last W non-sink positions
            assert torch.equal(layer.k_ring[row, p % w], ks[row][p])
            assert torch.equal(layer.v_ring[row, p % w], vs[row][p])
    # row 1 (13 tokens) has its first 8 in the sink and 5 in the ring; nothing was quantized for it
    assert cache.pages_for(13) == 0 and cache.block_table[1, 0] == -1


def test_page_allocation_and_release_for_rows_of_different_lengths():
    cache = PagedInt2KVCache(2, 2, 64, max_batch_size=3, max_seq_len=300, num_sinks=4, window=8, page_size=16, num_pages=20)
    cache.allocate(0, 100)  # (100 - 12) / 16 -> 6 pages
    cache.allocate(1, 12)  # all in sink + ring: no page
    cache.allocate(2, 29)  # 17 quantized tokens -> 2 pages
    assert cache.free_pages == 20 - 8
    owned = [set(cache.block_table[r][cache.block_table[r] >= 0].tolist()) for r in range(3)]
    assert [len(o) for o in owned] == [6, 0, 2]
    assert not owned[0] & owned[2]
    assert cache.seq_lens.tolist() == [100, 12, 29]
    cache.allocate(0, 101)  # still fits in its sixth page
    assert cache.free_pages == 12
    cache.release(0)
    assert cache.free_pages == 18 and (cache.block_table[0] == -1).all() and cache.seq_lens[0] == 0
    cache.allocate(1, 200)  # 188 quantized tokens -> 12 pages; reuses row 0's
    assert cache.free_pages == 6
    with pytest.raises(CacheCapacityError, match=r"exhausted.*20 pages"):
        cache.allocate(0, 150)
    with pytest.raises(CacheCapacityError, match="max_seq_len=300"):
        cache.allocate(2, 301)
    with pytest.raises(IndexError):
        cache.allocate(3, 10)


def test_identity_block_table():
    cache = PagedInt2KVCache(1, 1, 8, max_batch_size=3, max_seq_len=100, num_sinks=2, window=4, page_size=8, identity_block_table=True)
    mp = cache.max_pages
    assert mp == 12
    assert torch.equal(cache.block_table, torch.arange(3 * mp, dtype=torch.int32).view(3, mp))
    cache.release(1)  # fixed pages stay
    assert torch.equal(cache.block_table[1], torch.arange(mp, 2 * mp, dtype=torch.int32))


def test_store_beyond_allocation_raises_and_writes_nothing():
    gen = torch.Generator().manual_seed(1)
    cache = PagedInt2KVCache(1, 2, 16, max_batch_size=1, max_seq_len=64, num_sinks=2, window=4, page_size=4)
    cache.allocate(0, 10)  # 4 quantized tokens: one page
    k, v = _kv(gen, 1, 2, 11, 16)
    # 11 tokens: positions 2..6 leave sink + window; position 6 needs a second page
    with pytest.raises(CacheCapacityError, match="no page allocated for position 6"):
        cache.store(0, k, v, torch.arange(11))
    assert all((t == 0).all() for t in cache.layers[0].tensors())  # checked before any write
    big = PagedInt2KVCache(1, 2, 16, max_batch_size=1, max_seq_len=10, num_sinks=2, window=4, page_size=4)
    with pytest.raises(CacheCapacityError, match="position 10 is past the end of the cache; the cache holds 10 tokens"):
        big.store(0, *_kv(gen, 1, 2, 11, 16), torch.arange(11))


def test_quantized_pages_hold_codes_and_metadata():
    gen = torch.Generator().manual_seed(2)
    cache = PagedInt2KVCache(1, 1, 16, max_batch_size=1, max_seq_len=64, num_sinks=2, window=4, page_size=4, meta_dtype=torch.float32, dtype=torch.float32)
    cache.allocate(0, 20)
    k, v = _kv(gen, 1, 1, 20, 16, torch.float32)
    cache.store(0, k, v, torch.arange(20))
    layer = cache.layers[0]
    page = cache.block_table[0, 0]
    row = k[0, 0, 2]  # position 2 = quantized index 0 = first slot of the first page
    codes = unpack_int2(layer.k_codes[page, 0, 0])
    scale, mn = layer.k_meta[page, 0, 0]
    assert mn == row.min() and torch.allclose(scale, (row.max() - row.min()) / 3)
    assert codes[row.argmin()] == 0 and codes[row.argmax()] == 3


@pytest.mark.parametrize("d", [64, 128])
def test_memory_report_matches_format(d):
    cache = PagedInt2KVCache(30, 3, d, max_batch_size=1, max_seq_len=256, page_size=16)
    for ctx in (4096, 32768, 131072):
        rep = cache.memory_report(ctx)
        pages = -(-(ctx - 64 - 256) // 16)
        per_layer = 2 * (320 * 3 * d * 2 + pages * 16 * 3 * (d // 4 + 4))
        assert rep.int2_bytes == 30 * per_layer
        assert rep.bf16_bytes == 30 * 2 * ctx * 3 * d * 2
        assert rep.bits_per_element == pytest.approx(8 * per_layer / (2 * ctx * 3 * d))
    at_128k = cache.memory_report(131072)
    if d == 128:  # DESIGN.md: ~2.28 bits per element at 128K for d = 128
        assert 2.25 < at_128k.bits_per_element < 2.30 and at_128k.compression > 6.9
    else:
        assert 2.5 < at_128k.bits_per_element < 2.55


def test_transforms_validation():
    h, d = 2, 8
    t = LayerTransforms.identity(h, d)
    t.validate(h, d)
    bad = LayerTransforms.identity(h, d)
    bad.query_transform = bad.query_transform * 2
    with pytest.raises(ValueError, match="not the identity"):
        bad.validate(h, d)
    with pytest.raises(ValueError, match="shape"):
        LayerTransforms.identity(h, d).validate(h + 1, d)
    nan = LayerTransforms.identity(h, d)
    nan.key_mean[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        nan.validate(h, d)
    cache = PagedInt2KVCache(1, h, d)
    with pytest.raises(ValueError, match="not the identity"):
        cache.set_transforms(0, bad)


def test_bad_cache_construction():
    with pytest.raises(ValueError, match="divisible by 4"):
        PagedInt2KVCache(1, 1, 30)
    with pytest.raises(ValueError, match="group_size"):
        PagedInt2KVCache(1, 1, 64, group_size=48)
    with pytest.raises(ValueError, match="num_sinks and window"):
        PagedInt2KVCache(1, 1, 64, window=-1)


def _filled(batch, max_len, length, identity=True, seed=3):
    gen = torch.Generator().manual_seed(seed)
    cache = PagedInt2KVCache(1, 2, 16, max_batch_size=batch, max_seq_len=max_len, num_sinks=2, window=3, page_size=4,
                             identity_block_table=identity, dtype=torch.float32)
    cache.set_transforms(0, LayerTransforms.hadamard(2, 16))
    if not identity:
        for row in range(batch):
            cache.allocate(row, max_len)
    cache.store(0, *_kv(gen, batch, 2, length, 16, torch.float32), torch.arange(length))
    return cache


def _read(cache, rows, length):
    """Attention of fixed queries over the first ``rows`` rows: what a row holds, as attention sees it."""
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(9)).expand(rows, -1, -1, -1)  # one query
    pos = torch.full((rows, 1), length - 1)
    return cache.attention(0, q, pos, seq_lens=torch.full((rows,), length))


@pytest.mark.parametrize("identity", [True, False])
def test_reorder_rows_moves_every_region(identity):
    cache, length = _filled(3, 32, 20, identity), 20  # sinks, ring and pages all in use
    before = _read(cache, 3, length)
    cache.reorder_rows(torch.tensor([2, 0, 0]))  # beam search: rows may repeat
    after = _read(cache, 3, length)
    # the same row read at another batch position may differ by an ulp with 2+ threads (batched matmuls split
    # there); a row that lost or swapped a token is off by far more than 1e-6
    torch.testing.assert_close(after, before[[2, 0, 0]], rtol=0, atol=1e-6)


def test_copy_rows_to_a_storage_of_another_size():
    src, length = _filled(4, 64, 20), 20
    dst = PagedInt2KVCache(1, 2, 16, max_batch_size=2, max_seq_len=24, num_sinks=2, window=3, page_size=4,
                           identity_block_table=True, dtype=torch.float32)
    dst.set_transforms(0, src.transforms[0])
    src.copy_rows_to(dst, 2, length)
    torch.testing.assert_close(_read(dst, 2, length), _read(src, 2, length), rtol=0, atol=0)
    with pytest.raises(CacheCapacityError):
        src.copy_rows_to(dst, 2, 30)  # dst holds 2 + 3 + 5 x 4 = 25 tokens a row


def test_transforms_invert_wide_heads_with_several_threads():
    # torch 2.13's CPU oneMKL fails a batched float64 inverse of [H, 256, 256] with 2+ threads; calibrating a model
    # with head_dim 256 and several KV heads (Gemma) crashed there. Each head's inverse must come back exact.
    gen = torch.Generator().manual_seed(0)
    a_k = torch.linalg.qr(torch.randn(2, 256, 256, dtype=torch.float64, generator=gen))[0] * 1.5
    a_v = torch.randn(2, 256, 256, dtype=torch.float64, generator=gen) + 16 * torch.eye(256, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tr = LayerTransforms.from_matrices(a_k, a_v)
    finally:
        torch.set_num_threads(threads)
    eye = torch.eye(256).expand(2, 256, 256)
    # float32 storage of well-conditioned float64 inverses: products equal the identity to ~1e-5
    torch.testing.assert_close(tr.key_transform @ tr.query_transform.transpose(-1, -2), eye, rtol=0, atol=1e-4)
    torch.testing.assert_close(tr.value_transform @ tr.output_transform, eye, rtol=0, atol=1e-4)
