"""Triton kernels of per-channel keys (``key_format="channel"``) against the PyTorch reference ops.

The store writes whole pages in its own launch (keys per channel over the page's tokens, values per token), from the
ring and the chunk, then the ring; attention folds each page's per-channel scale into the query (the Triton page
region, in blocks of part of a page or several whole pages; the Gluon decode kernel, a warp's tiles in one page) or
dequantizes whole pages (the fused prefill's gather). Without a GPU they run in Triton's interpreter (tiny shapes);
the Gluon kernel runs on a GPU only.

Tolerances: the store's transform is an fp32-accurate dot, so the INT2 codes and the (scale, min) of a page match the
reference except where a rounding tie moves by one code (allowed for 0.5% of codes, as for per-token pages); the
rings and sinks match to fp32 rounding. Attention runs fp16 tensor-core operands (the page-scaled query keeps 11
bits) with fp32 accumulation: 5e-3 relative (Frobenius) error against the reference, as for per-token pages.
"""

from dataclasses import replace

import pytest
import torch

from oscar_compile.kernels import fragment_order
from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.checks import check_cache
from oscar_compile.kernels.store import store_reference
from oscar_compile.kernels.triton_attention import LAST_LAUNCH, attention_triton, choose_page_kernel
from oscar_compile.kernels.triton_store import store_triton
from oscar_compile.ops import triton_supported
from oscar_compile.quant import feedback_factor, unpack_int2
from oscar_compile.testing import anisotropic_moment, rel_error, replay_decode_in_cuda_graph, twin_caches

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATTN_TOL = 5e-3


def _dequantized_pages(layer):
    """Keys and values of every page as floats (``[num_pages, P, H, d]``), from the codes and metadata."""
    kc = unpack_int2(fragment_order.logical_pool(layer.k_codes, "k")).float()
    vc = unpack_int2(fragment_order.logical_pool(layer.v_codes, "v")).float()
    d = kc.shape[-1]
    k = kc * layer.k_meta[..., :d].float() + layer.k_meta[..., d:].float()  # [pages, 1, H, 2d]: one row a page
    ng = layer.v_meta.shape[-1] // 2
    vs, vm = (m.float().repeat_interleave(d // ng, -1) for m in layer.v_meta.chunk(2, -1))
    return k, vc * vs + vm, layer.k_meta[..., :d].float(), vs


def _assert_same_cache(ref, got, dtype):
    lr, lg = ref.layers[0], got.layers[0]
    rtol, atol = (2e-5, 2e-5) if dtype == torch.float32 else (2**-7, 1e-3)  # one ulp of the cache dtype
    for name in ("k_sink", "v_sink", "k_ring", "v_ring"):
        torch.testing.assert_close(getattr(lg, name).float(), getattr(lr, name).float(), rtol=rtol, atol=atol,
                                   msg=name)
    kr, vr, ks, vs = _dequantized_pages(lr)
    kg, vg, _, _ = _dequantized_pages(lg)
    for name, a, b, step in (("keys", kr, kg, ks), ("values", vr, vg, vs)):
        moved = (a - b).abs() > 0.5 * step + 1e-3  # more than a rounding tie's worth
        assert moved.float().mean() <= 5e-3, f"{moved.float().mean():.4f} of dequantized {name} moved"


def _run(h, gqa, d, ps, s, w, lengths, chunks=(), decode_steps=0, dtype=torch.float32, clip=1.0, seed=0,
         mask=False, debias=0.0, key_format="channel", group=None, feedback=False, **options):
    """Prefill rows of ``lengths`` (padding at the end), then further chunks of ``chunks`` tokens a row, then decode
    steps; after every store the caches and the attention outputs of both implementations are compared.
    ``feedback``: keys rounded with error feedback (a random anisotropic query second moment's factor)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    max_len = max(lengths) + sum(chunks) + decode_steps + 1
    ref, got = twin_caches(h, d, batch, max_len, s, w, ps, group, dtype, "orthogonal", clip, seed, device=DEV,
                           key_format=key_format)
    if feedback:
        factor = feedback_factor(anisotropic_moment(h, d, torch.Generator().manual_seed(seed + 1)))
        for c in (ref, got):
            c.set_transforms(0, replace(c.transforms[0], key_feedback=factor))
    ref.score_debias = got.score_debias = debias
    lens = [0] * batch
    for i, step in enumerate([lengths] + [(c,) * batch for c in chunks] + [(1,) * batch] * decode_steps):
        t = max(step)
        pos = torch.stack([torch.where(torch.arange(t) < n, n0 + torch.arange(t), -1) for n, n0 in zip(step, lens)])
        pos = pos.to(DEV)
        k, v = (torch.randn(batch, h, t, d, generator=gen).to(DEV, dtype) + 0.5 for _ in range(2))
        ck, cv = store_reference(*ref.store_args(0, k, v, pos))
        ck_g, cv_g = store_triton(*got.store_args(0, k, v, pos))
        valid = pos >= 0
        torch.testing.assert_close(ck_g[valid].float(), ck[valid].float(), rtol=2e-5 if dtype == torch.float32 else
                                   2**-7, atol=2e-5 if dtype == torch.float32 else 1e-3)
        if key_format == "channel":
            _assert_same_cache(ref, got, dtype)
        lens = [n0 + n for n0, n in zip(lens, step)]
        q = torch.randn(batch, h * gqa, t, d, generator=gen).to(DEV, dtype)
        attn_mask = None
        if mask and t > 1:  # a bool mask with holes: the page region's keys are masked one by one
            keep = torch.rand(batch, 1, t, max_len, generator=gen) > 0.3
            keep[..., 0] = True
            attn_mask = keep.to(DEV)
        seq_lens = torch.tensor(lens, device=DEV)
        a = ref.attention_args(0, q, pos, seq_lens, attn_mask, attn_mask is None, chunk=(ck, cv, pos))
        err = rel_error(attention_triton(*a, **options), attention_reference(*a))
        tol = 1e-2 if dtype == torch.bfloat16 and LAST_LAUNCH.get("gather_prefix") else ATTN_TOL  # bf16 operands
        assert err < tol, f"store {i}: attention error {err:.2e}"
    return ref, got


def test_store_and_decode_match_reference_small():
    # rows of different lengths, none a multiple of the page; 20 decode steps cross page ends from the ring; every
    # clip ratio 0.9 (the keys' page ranges narrowed about their midpoints)
    _run(h=1, gqa=2, d=64, ps=16, s=2, w=5, lengths=(70, 23), decode_steps=20, clip=0.9)


def test_error_feedback_store_matches_reference_small():
    # keys rounded with error feedback (each channel's rounding error pushed onto the later channels): pages completed
    # by a prefill of rows of odd lengths, by a later chunk (tokens partly from the ring) and by decode steps, with
    # narrowed page ranges; the grid, the codes and the attention match the reference as without feedback (the
    # kernel may fuse the update's multiply-add, so a code may move where the reference's value sits on a tie)
    args = dict(h=2, gqa=2, d=64, ps=16, s=2, w=5, lengths=(70, 23), chunks=(19,), decode_steps=18, clip=0.9)
    ref, _ = _run(**args, feedback=True)
    plain, _ = _run(**args)  # the same tokens rounded to nearest: the feedback moved keys, not values or the grid
    kf, vf, ksf, _ = _dequantized_pages(ref.layers[0])
    kp, vp, ksp, _ = _dequantized_pages(plain.layers[0])
    assert torch.equal(vf, vp) and torch.equal(ksf, ksp)
    assert (kf != kp).float().mean() > 0.05


def test_chunked_prefill_reads_pages_through_the_gather_small():
    # later chunks read the earlier ones' pages: the fused prefill's gather dequantizes them per channel; a chunk
    # completes pages whose tokens come partly from the ring, partly from the chunk
    _run(h=2, gqa=1, d=64, ps=16, s=3, w=7, lengths=(21, 40, 9), chunks=(33, 17), decode_steps=2,
         dtype=torch.bfloat16, gather_prefix=True)


def test_page_region_in_many_blocks_and_splits_small():
    # blocks of 16 keys in pages of 32 (two blocks a page), three splits of whole pages, a bool mask with holes,
    # and the split launches (not the gather) for a later chunk
    _run(h=1, gqa=4, d=64, ps=32, s=0, w=16, lengths=(150, 61), chunks=(20,), decode_steps=2, seed=2, mask=True,
         block_n=16, splits=3, gather_prefix=False)


@pytest.mark.parametrize("block_n, fold, debias", [(32, True, 0.0), (128, False, 1.0)])  # the default (blocks of
# 128 keys, folded) runs in every other test here
def test_blocks_of_whole_pages_small(block_n, fold, debias):
    # a block of 2 or 8 pages of 16 (each page's scale folded into its own copy of the query and one batched dot, or
    # the keys dequantized), rows whose page region ends mid-block, three splits of whole blocks, a bool mask with
    # holes; then decode steps
    _run(h=1, gqa=4, d=64, ps=16, s=1, w=16, lengths=(150, 61), chunks=(20,), decode_steps=3, seed=3, mask=True,
         block_n=block_n, splits=3, gather_prefix=False, channel_fold=fold, debias=debias)


def test_default_block_is_whole_pages(monkeypatch):
    # per-channel keys: a decode step reads CHANNEL_BLOCK_N keys a block (several small pages, part of a page where
    # the page is larger), a prefill tile at most a page a block, and so does everything where CHANNEL_BLOCK_N is None
    from oscar_compile.kernels import triton_attention as ta

    for d, ps, few, many in ((128, 32, 128, 64), (64, 16, 128, 128), (256, 32, 64, 64), (128, 256, 128, 64)):
        cache, _ = twin_caches(1, d, 1, 600, 0, 4, ps, key_format="channel", device="cpu")
        q = torch.randn(1, 2, 1, d)
        args = cache.attention_args(0, q, torch.tensor([[0]]), torch.tensor([1]))
        geo = check_cache(*args[3:12])
        for batch, want in ((1, few), (200, many)):  # 1 or 200 (row, KV head) programs on 132 SMs
            plan = ta.plan_attention(batch, 2, 1, geo, 132)
            assert plan.block_n == want and plan.keys_per_split % max(ps, want) == 0
        assert ta.plan_attention(1, 2, 64, geo, 132).block_n == min(ps, 64 if d > 128 else 128)  # prefill: one page
    monkeypatch.setattr(ta, "CHANNEL_BLOCK_N", None)
    assert ta.plan_attention(1, 2, 1, geo, 132).block_n == ps


@pytest.mark.parametrize("key_format, group", [("channel", None), ("token", None), ("token", 32)])
def test_debiased_scores_match_reference_small(key_format, group):
    # the page kernel subtracts each INT2 key's rounding-noise variance: per page (per-channel keys), per key (one
    # group a row) or per element (groups of 32); prefill through the split launches (the gather has no steps)
    _run(h=1, gqa=2, d=64, ps=16, s=2, w=5, lengths=(70, 23), chunks=(9,), decode_steps=3, seed=7, debias=1.0,
         key_format=key_format, group=group)
    assert not LAST_LAUNCH["gather_prefix"]


@pytest.mark.parametrize("key_format", ["token", "channel"])
def test_debias_brings_the_int2_share_back_toward_exact_keys(key_format):
    """What the correction is for: INT2 rounding noise inflates the attention the quantized keys get (exp of a noisy
    score averages exp(s + var / 2)). Values 1 on the INT2 tokens and 0 on the BF16 ones (identity transforms;
    constant rows quantize exactly) make the output the INT2 keys' share of the attention: with exact keys (a BF16
    cache), INT2 keys, and INT2 keys debiased."""
    from oscar_compile import PagedInt2KVCache
    from oscar_compile.testing import random_transforms

    gen = torch.Generator().manual_seed(3)
    h, d, n, batch, sinks, window = 2, 64, 600, 8, 4, 64
    tr = random_transforms(h, d, "identity", torch.Generator().manual_seed(1))
    k = torch.randn(batch, h, n, d, generator=gen)
    v = torch.zeros(batch, h, n, d)
    v[:, :, sinks:n - window - 31] = 1.0  # the INT2 pages (whole pages of 16 for per-channel keys: the ring holds
    # window + 15 tokens), a margin of BF16 zeros past them
    q = 1.5 * torch.randn(batch, h, 1, d, generator=gen)  # scores of sd ~1.5: many keys share the attention
    share = {}
    for name, quantize, debias in (("exact", False, 0.0), ("int2", True, 0.0), ("debiased", True, 1.0)):
        c = PagedInt2KVCache(1, h, d, max_batch_size=batch, max_seq_len=n + 1, num_sinks=sinks, window=window,
                             page_size=16, dtype=torch.float32, quantize=quantize, score_debias=debias,
                             key_format=key_format)
        c.set_transforms(0, tr)
        for r in range(batch):
            c.allocate(r, n + 1)
        c.store(0, k, v, torch.arange(n))
        out = attention_reference(*c.attention_args(0, q, torch.full((batch, 1), n - 1), torch.full((batch,), n)))
        share[name] = out.mean(-1)  # [B, H, 1]: every channel is the share
    inflation = (share["int2"] - share["exact"]).mean()
    bias_left = (share["debiased"] - share["exact"]).mean()
    err, err_debiased = ((share[m] - share["exact"]).abs().mean() for m in ("int2", "debiased"))
    if key_format == "token":  # measured: inflation 0.025 -> 0.007 left, mean error 0.026 -> 0.013
        assert abs(bias_left) < 0.5 * inflation and err_debiased < 0.7 * err
    else:
        # measured: 0.0077 -> -0.0049, mean error unchanged (0.0093 -> 0.0092). A channel's extreme tokens of a page
        # sit on its grid's ends (no rounding error), so on random Gaussian keys the uniform-noise estimate
        # overshoots; on Gemma 3's keys it brought the INT2 share from 0.311 to 0.279 against 0.273 exact
        # (probe_key_noise.py)
        assert abs(bias_left) < 0.7 * inflation


def test_page_size_and_kernel_choice(monkeypatch):
    # a block of keys lies within a page: pages of 16, 32, ... tokens only (else the reference serves CUDA)
    assert triton_supported(64, 1, 16) and triton_supported(128, 1, 64) and triton_supported(64, 1, 0)
    assert not triton_supported(64, 1, 8) and not triton_supported(64, 1, 24)
    ref, _ = twin_caches(1, 64, 1, 40, 0, 4, 8, key_format="channel", device=DEV)
    q = torch.randn(1, 1, 1, 64, device=DEV)
    args = ref.attention_args(0, q, torch.tensor([[0]], device=DEV), torch.tensor([1], device=DEV))
    with pytest.raises(ValueError, match="pages of 16, 32"):
        attention_triton(*args)
    # the Gluon decode kernel reads per-token metadata only: per-channel keys take the Triton page kernel
    big, _ = twin_caches(1, 128, 1, 64, 0, 4, 32, dtype=torch.float16, key_format="channel", device=DEV)
    q = torch.randn(1, 1, 1, 128, device=DEV)
    args = big.attention_args(0, q, torch.tensor([[0]], device=DEV), torch.tensor([1], device=DEV))
    geo = check_cache(*args[3:12])
    assert geo.key_channel
    from oscar_compile.kernels import triton_attention as ta

    # the Gluon kernel reads pages of 32+ where OSCAR_GLUON_KEY_CHANNEL is on (and a GPU runs it)
    monkeypatch.setattr(ta, "GLUON_KEY_CHANNEL", False)
    assert choose_page_kernel(q, geo, args[3], args[4], 1, 0, torch.float16, "auto") == "triton"
    monkeypatch.setattr(ta, "GLUON_KEY_CHANNEL", True)
    want = "gluon" if DEV == "cuda" and ta._gluon_decode() is not None else "triton"
    assert choose_page_kernel(q, geo, args[3], args[4], 1, 0, torch.float16, "auto") == want
    small, _ = twin_caches(1, 128, 1, 64, 0, 4, 16, dtype=torch.float16, key_format="channel", device=DEV)
    args16 = small.attention_args(0, q, torch.tensor([[0]], device=DEV), torch.tensor([1], device=DEV))
    geo16 = check_cache(*args16[3:12])
    assert choose_page_kernel(q, geo16, args16[3], args16[4], 1, 0, torch.float16, "auto") == "triton"


def test_non_finite_key_stays_in_its_page_and_head_small():
    gen = torch.Generator().manual_seed(5)
    h, d, ps = 2, 64, 16
    ref, got = twin_caches(h, d, 2, 80, 1, 4, ps, key_format="channel", device=DEV)
    t = 60
    pos = torch.arange(t, device=DEV).expand(2, t)
    k, v = (torch.randn(2, h, t, d, generator=gen).to(DEV) for _ in range(2))
    k[0, 1, 10, 3] = float("nan")  # row 0, head 1, position 10: page 0 of that row
    store_reference(*ref.store_args(0, k, v, pos))
    store_triton(*got.store_args(0, k, v, pos))
    km_r, km_g = ref.layers[0].k_meta, got.layers[0].k_meta
    assert torch.equal(torch.isnan(km_r), torch.isnan(km_g)) and torch.isnan(km_g).any()
    q = torch.randn(2, h, 1, d, generator=gen).to(DEV)
    a = ref.attention_args(0, q, torch.full((2, 1), t, device=DEV), torch.full((2,), t + 1, device=DEV))
    out_r, out_g = attention_reference(*a), attention_triton(*a)
    assert torch.equal(torch.isnan(out_r), torch.isnan(out_g))
    assert torch.isnan(out_g[0, 1]).all() and not torch.isnan(out_g[1]).any() and not torch.isnan(out_g[0, 0]).any()
    assert rel_error(out_g[1], out_r[1]) < ATTN_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("d, gqa, ps", [(64, 3, 16), (128, 4, 32), (128, 8, 64), (256, 2, 32)])
def test_full_shapes_gpu(d, gqa, ps):
    # pages of 32 (the default) with a narrowed page range (key_page_clip) and every clip, the others without
    _run(h=2, gqa=gqa, d=d, ps=ps, s=4, w=64, lengths=(900, 333, 1), chunks=(257,), decode_steps=40,
         dtype=torch.bfloat16, seed=d + gqa, clip=0.85 if ps == 32 else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("d, gqa", [(64, 3), (128, 4), (256, 4)])
def test_error_feedback_full_shapes_gpu(d, gqa):
    # error-feedback rounding at model head sizes (a loop of d steps over a page's tokens in the flush launch)
    _run(h=2, gqa=gqa, d=d, ps=32, s=4, w=64, lengths=(900, 333, 1), chunks=(257,), decode_steps=40,
         dtype=torch.bfloat16, seed=d + gqa + 1, clip=0.85, feedback=True)


@pytest.mark.gpu
def test_decode_in_a_cuda_graph_gpu():
    """A decode step (store + attention) of per-channel keys captured in a CUDA graph and replayed 300 times: the page
    flush (every 32 steps) and the ring write are device work only (nothing read back), and every step
    matches the reference on a twin cache."""
    h, gqa, d, batch, steps, prefill = 4, 4, 128, 3, 300, 100
    ref, got = twin_caches(h, d, batch, prefill + steps + 1, 64, 256, 32, None, torch.bfloat16, "orthogonal", 0.95,
                           device="cuda", key_format="channel")
    replay_decode_in_cuda_graph(ref, got, prefill, steps, h * gqa, ATTN_TOL)
    _assert_same_cache(ref, got, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["wide", "narrow"])
@pytest.mark.parametrize("d, gqa, ps", [(128, 4, 32), (64, 3, 64), (256, 2, 32)])
def test_gluon_decode_reads_channel_pages_gpu(monkeypatch, d, gqa, ps, config):
    """The Gluon decode kernel on per-channel keys (forced: each decode step raises if it declines), in both launch
    shapes: one warp of two tiles inside a page, or four warps of one tile each (two pages a block)."""
    from oscar_compile.kernels import triton_attention as ta

    monkeypatch.setattr(ta, "GLUON_KEY_CHANNEL", True)
    monkeypatch.setattr(ta, "GLUON", {"wide": ta.GLUON_WIDE_KEY_CHANNEL, "narrow": ta.GLUON_NARROW}[config])
    _run(h=2, gqa=gqa, d=d, ps=ps, s=4, w=64, lengths=(900, 333, 1), decode_steps=40, dtype=torch.bfloat16,
         seed=d + ps, page_kernel="gluon")
