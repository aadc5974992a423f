"""The FP8 ring (retrieval heads in FP8 with a scale a row, kernels/fp8_ring.py): its format against torch's own
float8_e4m3fn, the Triton store and attention against the reference on it, and the cache around it.

Tolerances: the format is exact (torch's e4m3 rounding of ``x / scale``, the scale ``max|x| / 448`` correctly
rounded), and the Triton store writes the same bytes as the reference wherever its rows match bit for bit (fp32
caches: its transform matches torch's to the last bits only, so a code or scale may move by one step at a rounding
tie; we allow 0.5% of codes). Attention compares at the Triton tests' 5e-3 relative (fp16 tensor-core operands).
"""

import pytest
import torch
import triton
import triton.language as tl

from oscar_compile import PagedInt2KVCache
from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.fp8_ring import FP8_MAX, decode_rows, encode_rows, fp8_row_bytes, is_fp8_ring
from oscar_compile.kernels.store import store_reference
from oscar_compile.kernels.triton_attention import LAST_LAUNCH, attention_triton
from oscar_compile.kernels.triton_store import load_fp8_rows, store_triton
from oscar_compile.testing import rel_error, twin_caches

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATTN_TOL = 5e-3


def test_rows_round_trip_through_e4m3_with_a_scale_each():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen) * torch.logspace(-3, 3, 7)[:, None, None]  # scales far apart
    x[2, 1] = 0.0  # a row of zeros keeps scale 0
    rows = encode_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 3, fp8_row_bytes(64)) and is_fp8_ring(rows[None], 64)
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    want = (x / scale.clamp(min=1e-30)).to(torch.float8_e4m3fn).float() * scale
    torch.testing.assert_close(decode_rows(rows), want, rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: a normal value moves by at most 2^-4 of itself, a subnormal by 2^-10 of the scale
    err = (decode_rows(rows) - x).abs()
    assert bool((err <= x.abs() / 16 + scale * 2**-10 + 1e-30).all())
    assert decode_rows(rows)[2, 1].abs().sum() == 0


def test_a_non_finite_value_makes_its_row_nan_and_no_other():
    x = torch.randn(4, 64)
    x[1, 5], x[2, 9] = float("nan"), float("inf")
    y = decode_rows(encode_rows(x))
    assert bool(y[1].isnan().all() and y[2].isnan().all()) and bool(torch.isfinite(y[[0, 3]]).all())


@triton.jit
def _load_rows(ring_ptr, out_ptr, finite_ptr, row_ptr, ok_ptr, N: tl.constexpr, D: tl.constexpr):
    i = tl.arange(0, N)
    ok = tl.load(ok_ptr + i) != 0
    x = load_fp8_rows(ring_ptr + tl.load(row_ptr + i).to(tl.int64) * (D + 4), ok, D)
    tl.store(out_ptr + i[:, None] * D + tl.arange(0, D)[None, :], x)
    tl.store(finite_ptr + i, tl.min(((x - x) == 0.0).to(tl.int32), axis=1))  # the store's finiteness test


def test_kernels_read_fp8_rows_and_zero_the_rows_they_skip():
    # On an H100 (Triton 3.6, 2026-12-07) the rows a masked read skipped were not finite in registers (the store
    # then wrote NaN metadata for the rows it evicted) while a store of the same registers wrote zeros: the test
    # checks the registers, as the store's quantizer reads them. Decoding is exact: the same e4m3 codes and scale.
    gen = torch.Generator().manual_seed(5)
    n, d = 16, 64
    ring = encode_rows(torch.randn(7, d, generator=gen) * 3).to(DEV)
    rows = torch.randint(0, 7, (n,), generator=gen).to(DEV)
    ok = (torch.rand(n, generator=gen) < 0.6).to(DEV, torch.int32)
    out, finite = torch.full((n, d), 7.0, device=DEV), torch.zeros(n, dtype=torch.int32, device=DEV)
    _load_rows[(1,)](ring, out, finite, rows, ok, N=n, D=d)
    assert 0 < int(ok.sum()) < n and bool(finite.all())
    assert torch.equal(out, torch.where(ok[:, None] != 0, decode_rows(ring[rows]), 0.0))


def _caches(h, d, batch, max_len, s, w, ps, quantize, dtype, seed, key_format="token"):
    return twin_caches(h, d, batch, max_len, s, w, ps, dtype=dtype, seed=seed, device=DEV, quantize=quantize,
                       ring_format="fp8", key_format=key_format)


def _assert_same_rings(ref, got):
    d = ref.head_dim
    for a, b in ((ref.layers[0].k_ring, got.layers[0].k_ring), (ref.layers[0].v_ring, got.layers[0].v_ring)):
        same = (a[..., :d] == b[..., :d]).float().mean()
        assert same >= 0.995, f"{1 - same:.4f} of the FP8 ring's codes differ"
        # a row's max moves by the transform's last bit, and its scale with it
        torch.testing.assert_close(b[..., d:].contiguous().view(torch.float32),
                                   a[..., d:].contiguous().view(torch.float32), rtol=1e-6, atol=0)
        torch.testing.assert_close(decode_rows(b), decode_rows(a), rtol=0.07, atol=1e-3)  # one e4m3 step: 2^-4


@pytest.mark.parametrize("quantize,key_format,w,ps,lengths", [
    (False, "token", 6, 4, (19, 7)), (True, "token", 6, 4, (19, 7)), (True, "channel", 20, 16, (57, 23))],
    ids=["every-token-in-the-ring", "int2-pages-behind-it", "per-channel-pages-behind-it"])
def test_store_and_attention_match_reference_small(quantize, key_format, w, ps, lengths):
    # rows of different lengths with padding, a prefill longer than the window (INT2 caches evict FP8 rows into
    # pages; per-channel keys flush whole pages from the ring), decode steps read with and without the store's
    # chunk. The INT2 case gave NaN on an H100 (2026-12-07) until the rows an FP8 read skips were zeroed
    # (test_kernels_read_fp8_rows_and_zero_the_rows_they_skip)
    h, gqa, d, s, dtype = 2, 2, 64, 3, torch.float32
    steps = 3 if key_format == "token" else ps + 2  # per-channel keys: a decode step that completes a page
    gen = torch.Generator().manual_seed(1)
    b, t, max_len = len(lengths), max(lengths), max(lengths) + steps + 1
    ref, got = _caches(h, d, b, max_len, s, w, ps, quantize, dtype, seed=2, key_format=key_format)
    assert got.key_format == key_format
    assert got.layers[0].k_ring.dtype == torch.uint8
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in lengths]).to(DEV)
    k, v = (torch.randn(b, h, t, d, generator=gen).to(DEV, dtype) * 3 for _ in range(2))
    ck, cv = store_reference(*ref.store_args(0, k, v, pos))
    ck_g, cv_g = store_triton(*got.store_args(0, k, v, pos))
    valid = pos >= 0
    torch.testing.assert_close(ck_g[valid], ck[valid], rtol=2e-5, atol=2e-5)
    _assert_same_rings(ref, got)
    q = torch.randn(b, h * gqa, t, d, generator=gen).to(DEV, dtype)
    seq_lens = pos.amax(-1) + 1
    a = ref.attention_args(0, q, pos, seq_lens, None, True, chunk=(ck, cv, pos))
    assert rel_error(attention_triton(*a), attention_reference(*a)) < ATTN_TOL
    lens = list(lengths)
    for step in range(steps):
        p1 = torch.tensor(lens, device=DEV)[:, None]
        k1, v1 = (torch.randn(b, h, 1, d, generator=gen).to(DEV, dtype) for _ in range(2))
        ck1, cv1 = store_reference(*ref.store_args(0, k1, v1, p1))
        store_triton(*got.store_args(0, k1, v1, p1))
        q1 = torch.randn(b, h * gqa, 1, d, generator=gen).to(DEV, dtype)
        chunk = (ck1, cv1, p1) if step % 2 == 0 else None  # the new token exactly, or from the FP8 ring
        a = got.attention_args(0, q1, p1, p1[:, 0] + 1, chunk=chunk)
        assert rel_error(attention_triton(*a), attention_reference(*a)) < ATTN_TOL
        # the two stores' caches read alike (pages included: a rounding tie may move a code, no more)
        a_ref = ref.attention_args(0, q1, p1, p1[:, 0] + 1, chunk=chunk)
        assert rel_error(attention_reference(*a), attention_reference(*a_ref)) < ATTN_TOL
        assert not LAST_LAUNCH["chunk_from_ring"]  # an FP8 ring holds it rounded: the chunk is read exactly
        lens = [n + 1 for n in lens]
    _assert_same_rings(ref, got)


@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_decode_over_many_fp8_blocks_in_splits_with_masks_small(mask):
    # A retrieval head's cache (every token in the FP8 ring) over several key blocks of the BF16-key launch (64 keys)
    # split three ways: rows of different lengths, value rows whose scales differ by 10^4 (the launch scales values
    # by their block's largest), a bool mask with a hole or an additive one, the step's token from the chunk.
    h, gqa, d, s = 1, 4, 64, 4
    gen = torch.Generator().manual_seed(6)
    lengths = (150, 67, 131)
    b, max_len = len(lengths), max(lengths) + 2
    ref, got = _caches(h, d, b, max_len, s, 8, 16, False, torch.bfloat16, seed=7)
    t = max(lengths)
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in lengths]).to(DEV)
    k = torch.randn(b, h, t, d, generator=gen)
    v = torch.randn(b, h, t, d, generator=gen) * 10 ** (4 * torch.rand(b, h, t, 1, generator=gen) - 3)
    for c in (ref, got):
        store_reference(*c.store_args(0, k.to(DEV, torch.bfloat16), v.to(DEV, torch.bfloat16), pos))
    p1 = torch.tensor(lengths, device=DEV)[:, None]
    k1, v1 = (torch.randn(b, h, 1, d, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    ck1, cv1 = store_reference(*got.store_args(0, k1, v1, p1))
    q1 = torch.randn(b, h * gqa, 1, d, generator=gen).to(DEV, torch.bfloat16)
    attn_mask = None
    if mask != "none":
        seen = torch.arange(max_len, device=DEV)[None, :] <= p1  # causal and each row's length
        seen[0, 70:90] = False  # a hole in row 0, across a block boundary
        attn_mask = seen[:, None, None, :]
        if mask == "additive":
            attn_mask = torch.where(seen, torch.rand(seen.shape, generator=gen).to(DEV) - 0.5, float("-inf"))
            attn_mask = attn_mask[:, None, None, :].to(torch.bfloat16)
    a = got.attention_args(0, q1, p1, p1[:, 0] + 1, attn_mask, chunk=(ck1, cv1, p1))
    out = attention_triton(*a, bf16_splits=3)
    assert LAST_LAUNCH["plan"].nb == 3
    assert rel_error(out, attention_reference(*a)) < ATTN_TOL


@pytest.mark.parametrize("quantize", [False, True], ids=["every-token-in-the-ring", "int2-pages-behind-it"])
def test_prefill_over_a_gathered_fp8_prefix_small(quantize):
    # a second chunk after a first: the fused prefill gathers the rows before the chunk (FP8 ring rows decoded, and
    # INT2 pages where the cache quantizes)
    h, gqa, d, s = 1, 4, 64, 2
    gen = torch.Generator().manual_seed(3)
    ref, got = _caches(h, d, 2, 64, s, 8, 4, quantize, torch.bfloat16, seed=4)
    for c0, c1 in ((0, 21), (21, 37)):
        pos = torch.arange(c0, c1, device=DEV)
        k, v = (torch.randn(2, h, c1 - c0, d, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
        ck, cv = store_reference(*ref.store_args(0, k, v, pos))
        store_triton(*got.store_args(0, k, v, pos))
    q = torch.randn(2, h * gqa, 16, d, generator=gen).to(DEV, torch.bfloat16)
    a = got.attention_args(0, q, pos, None, None, True, chunk=(ck, cv, pos))
    out = attention_triton(*a, gather_prefix=True)
    assert LAST_LAUNCH["gather_prefix"]
    # bf16 tensor-core operands in the fused prefill (8 mantissa bits): 1e-2, as the Triton tests
    assert rel_error(out, attention_reference(*a)) < 1e-2


def test_fp8_ring_halves_the_exact_tokens_and_moves_with_its_rows():
    kw = dict(max_batch_size=3, max_seq_len=512, num_sinks=4, window=8, quantize=False, identity_block_table=True)
    bf16 = PagedInt2KVCache(1, 2, 128, **kw)
    fp8 = PagedInt2KVCache(1, 2, 128, ring_format="fp8", **kw)
    assert "FP8 ring" in repr(fp8)
    # 8 + 32 / 128 bits a ring element instead of 16 (the sinks stay 16)
    rb, rf = bf16.memory_report(512), fp8.memory_report(512)
    want = (4 * 16 + 512 * (8 + 32 / 128)) / (4 * 16 + 512 * 16)
    assert rf.int2_bytes / rb.int2_bytes == pytest.approx(want)
    k = torch.randn(3, 2, 20, 128)
    fp8.store(0, k, -k, torch.arange(20))
    ring = fp8.layers[0].k_ring.clone()
    fp8.reorder_rows(torch.tensor([2, 0, 1]))
    assert torch.equal(fp8.layers[0].k_ring[0], ring[2])  # codes and scale travel together
    with pytest.raises(ValueError, match="cannot move rows"):
        fp8.copy_rows_to(bf16, 3, 20)


def test_fp8_ring_is_refused_where_the_kernels_do_not_take_it():
    with pytest.raises(ValueError, match="ring_format='fp8' needs a cache without a sliding window"):
        PagedInt2KVCache(1, 1, 64, sliding_window=16, ring_format="fp8")
    with pytest.raises(ValueError, match="ring_format must be one of"):
        PagedInt2KVCache(1, 1, 64, ring_format="int4")
    c = PagedInt2KVCache(1, 1, 64, max_seq_len=32, ring_format="fp8")
    layer = c.layers[0]
    k = torch.randn(1, 1, 3, 64)
    args = list(c.store_args(0, k, k, torch.arange(3)))
    args[10] = torch.zeros_like(layer.k_ring[..., :64], dtype=torch.bfloat16)  # v_ring in BF16 beside an FP8 k_ring
    with pytest.raises(TypeError, match="both be FP8 rings or neither"):
        store_reference(*args)
