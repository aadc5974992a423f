"""Triton kernels against their PyTorch references.

Without a GPU they run in Triton's interpreter (slow: tiny shapes). With a GPU the ``gpu`` tests run
full shapes, a >= 500-case fuzz and a 4,000-step CUDA-graph decode loop.

Tolerances: the store's transform is an fp32 (``ieee``) dot, so rows match the reference to fp32
rounding, and INT2 codes match exactly except at rounding ties moved by that last bit (we allow
0.5% of codes to differ by one step). Attention uses fp16 tensor-core operands (the rotated query
and the softmax weights keep 11 mantissa bits; codes are exact) with fp32 accumulation: about 1e-3
relative error, so outputs are compared at 5e-3 relative (Frobenius) error against fp32 references.
"""

import random

import pytest
import torch

from oscar_compile import PagedInt2KVCache
from oscar_compile.kernels import fragment_order
from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.store import store_reference
from oscar_compile.kernels.checks import CacheGeometry
from oscar_compile.kernels.triton_attention import (
    LAST_LAUNCH,
    TEMP_BYTES_BUDGET,
    _sm_count,
    attention_triton,
    page_region_warps,
    plan_attention,
    plan_tiles,
)
from oscar_compile.kernels.triton_store import store_triton
from oscar_compile.quant import dequantize_int2
from oscar_compile.testing import rel_error, replay_decode_in_cuda_graph, twin_caches

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATTN_TOL = 5e-3


def _row_tol(dtype):
    """Stored rows: the kernel's fp32 transform differs from torch's in the last bits, which can move a
    rounding to the cache dtype by one unit: 2e-5 for fp32 caches; for bf16 one ulp, which is 2^-7 of
    the value just above a power of two (7 stored mantissa bits)."""
    return (2e-5, 2e-5) if dtype == torch.float32 else (2 ** -7, 1e-3)


def _assert_same_cache(ref: PagedInt2KVCache, got: PagedInt2KVCache):
    lr, lg = ref.layers[0], got.layers[0]
    rtol, atol = _row_tol(lr.k_sink.dtype)
    for a, b in ((lr.k_sink, lg.k_sink), (lr.v_sink, lg.v_sink), (lr.k_ring, lg.k_ring), (lr.v_ring, lg.v_ring)):
        torch.testing.assert_close(b.float(), a.float(), rtol=rtol, atol=atol)
    g = ref.group_size
    for kind, codes_r, meta_r, codes_g, meta_g in (("k", lr.k_codes, lr.k_meta, lg.k_codes, lg.k_meta),
                                                   ("v", lr.v_codes, lr.v_meta, lg.v_codes, lg.v_meta)):
        codes_r, codes_g = fragment_order.logical_pool(codes_r, kind), fragment_order.logical_pool(codes_g, kind)
        # (scale, min) follow the rows: a one-ulp row difference at a row's extreme moves them as much
        close = torch.isclose(meta_g.float(), meta_r.float(), rtol=1e-2, atol=1e-3)
        assert close.float().mean() >= 0.995, f"{1 - close.float().mean():.4f} of (scale, min) differ"
        x_r = dequantize_int2(codes_r, *meta_r.float().chunk(2, -1), g)
        x_g = dequantize_int2(codes_g, *meta_g.float().chunk(2, -1), g)
        step = meta_r[..., : meta_r.shape[-1] // 2].float().repeat_interleave(g, -1)
        off = (x_r - x_g).abs() > 0.5 * step + 1e-3
        assert off.float().mean() <= 5e-3, f"{off.float().mean():.4f} of dequantized values moved"


def _run_case(h, gqa, d, lengths, s, w, ps, decode_steps, group=None, clip=1.0, kind="orthogonal", mask_kind=None,
              dtype=torch.float32, seed=0, **kernel_options):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    batch, max_len = len(lengths), max(lengths) + decode_steps + 1
    ref, got = twin_caches(h, d, batch, max_len, s, w, ps, group, dtype, kind, clip, seed, device=DEV)
    t = max(lengths)
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in lengths]).to(DEV)
    k, v = (torch.randn(batch, h, t, d, generator=gen).to(DEV, dtype) for _ in range(2))
    ck_r, cv_r = store_reference(*ref.store_args(0, k, v, pos))
    ck_g, cv_g = store_triton(*got.store_args(0, k, v, pos))
    valid = pos >= 0
    rtol, atol = _row_tol(dtype)
    torch.testing.assert_close(ck_g[valid].float(), ck_r[valid].float(), rtol=rtol, atol=atol)
    _assert_same_cache(ref, got)
    q = torch.randn(batch, h * gqa, t, d, generator=gen).to(DEV, dtype)
    seq_lens = (pos.amax(-1) + 1)
    mask = None
    if mask_kind is not None:
        keep = torch.rand(batch, 1, t, max_len, generator=gen) > 0.3
        keep[..., 0] = True
        mask = keep if mask_kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        mask = mask.to(DEV)
    a = ref.attention_args(0, q, pos, seq_lens, mask, mask is None, chunk=(ck_r, cv_r, pos))
    out_r = attention_reference(*a)
    out_g = attention_triton(*a, **kernel_options)
    # A prefill of a bf16 cache runs its tensor cores on bf16 (q', K, V and P at 8 mantissa bits, as FlashAttention on
    # bf16 inputs; ~2e-3 relative rounding each): 1e-2. Decode steps keep fp16 operands and ATTN_TOL.
    assert rel_error(out_g, out_r) < (1e-2 if dtype == torch.bfloat16 and LAST_LAUNCH.get("gather_prefix") else ATTN_TOL)
    lens = list(lengths)
    for _ in range(decode_steps):
        p1 = torch.tensor(lens, device=DEV)[:, None]
        k1, v1 = (torch.randn(batch, h, 1, d, generator=gen).to(DEV, dtype) for _ in range(2))
        ck1, cv1 = store_reference(*ref.store_args(0, k1, v1, p1))
        store_triton(*got.store_args(0, k1, v1, p1))
        q1 = torch.randn(batch, h * gqa, 1, d, generator=gen).to(DEV, dtype)
        # with the store's chunk, as a model's graph passes it: the Triton op reads the new token from the ring
        a = ref.attention_args(0, q1, p1, p1[:, 0] + 1, chunk=(ck1, cv1, p1))
        assert rel_error(attention_triton(*a, **kernel_options), attention_reference(*a)) < ATTN_TOL
        assert LAST_LAUNCH["chunk_from_ring"] == (w > 0 and "dense_chunk" not in kernel_options)
        lens = [n + 1 for n in lens]
    _assert_same_cache(ref, got)


def test_store_and_attention_match_reference_small():
    # prefill longer than the window (tokens go straight to pages), padding, clipping, decode evictions
    _run_case(h=1, gqa=3, d=64, lengths=(21, 9), s=2, w=4, ps=8, decode_steps=2, clip=0.9, kind="invertible")


def test_decode_store_of_more_rows_than_a_program_takes_small():
    # a store program takes 16 (row, token) pairs of the flattened batch: 19 rows of different lengths
    # span two programs in decode (one token a row) and mix rows within a program in prefill
    _run_case(h=2, gqa=2, d=64, lengths=tuple(5 + (7 * i) % 23 for i in range(19)), s=2, w=4, ps=4, decode_steps=2,
              clip=0.9, seed=3)


def test_bf16_keys_in_forced_splits_small():
    # the sinks + ring (+ chunk) keys in 3 splits of 64-key blocks (the last may be empty): 3 + 40 keys a decode row
    _run_case(h=1, gqa=4, d=64, lengths=(90, 57), s=3, w=40, ps=4, decode_steps=2, seed=4, bf16_splits=3)


def test_groups_masks_and_no_bf16_tokens_small():
    _run_case(h=1, gqa=2, d=64, lengths=(13,), s=0, w=0, ps=4, decode_steps=1, group=16, mask_kind="bool", seed=1)
    _run_case(h=1, gqa=1, d=64, lengths=(11,), s=1, w=3, ps=4, decode_steps=0, mask_kind="additive", seed=2)


def test_many_key_blocks_and_splits_small():
    # small key blocks so the page loop runs many iterations (its hand-pipelined prefetch included),
    # split boundaries inside pages, and a padded row whose page region is empty
    _run_case(h=2, gqa=2, d=64, lengths=(83, 47, 5), s=3, w=5, ps=8, decode_steps=1, seed=3, block_n=16, splits=3)
    # more splits than the merge reads at once (8 for d = 64), so it combines them in several chunks
    _run_case(h=1, gqa=4, d=64, lengths=(150,), s=2, w=3, ps=8, decode_steps=1, seed=4, block_n=16, splits=11)


def _prefill_chunks(h, gqa, d, chunks, s, w, ps, mask, seed, dtype=torch.float32, tol=ATTN_TOL, mask_window=None,
                    group=None, **kernel_options):
    """A prompt stored and attended in ``chunks`` (each [batch] lengths), every chunk checked against the
    reference: later chunks read the earlier ones from the cache (pages, ring) and themselves exactly."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(chunks[0])
    max_len = sum(max(c) for c in chunks) + 1
    ref, got = twin_caches(h, d, batch, max_len, s, w, ps, group, dtype, "invertible", 0.95, seed, device=DEV)
    start = [0] * batch
    for chunk in chunks:
        t = max(chunk)
        pos = torch.stack([torch.where(torch.arange(t) < n, st + torch.arange(t), -1)
                           for st, n in zip(start, chunk)]).to(DEV)
        k, v = (torch.randn(batch, h, t, d, generator=gen).to(DEV, dtype) for _ in range(2))
        ck, cv = store_reference(*ref.store_args(0, k, v, pos))
        store_triton(*got.store_args(0, k, v, pos))
        q = torch.randn(batch, h * gqa, t, d, generator=gen).to(DEV, dtype)
        causal = torch.arange(max_len, device=DEV)[None, None, None, :] <= pos[:, None, :, None]
        if mask_window:  # a sliding-window mask: keys more than mask_window back are hidden too
            causal &= torch.arange(max_len, device=DEV)[None, None, None, :] > pos[:, None, :, None] - mask_window
        m = causal if mask else None  # a bool mask (as transformers passes) or is_causal
        a = ref.attention_args(0, q, pos, pos.amax(-1) + 1, m, not mask, chunk=(ck, cv, pos))
        assert rel_error(attention_triton(*a, **kernel_options), attention_reference(*a)) < tol
        start = [st + n for st, n in zip(start, chunk)]
    return LAST_LAUNCH["plan"]


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "bool_mask"])
def test_prefill_in_query_tiles_small(mask):
    # A temporary budget of a few tokens: the prompt runs in several query tiles (the last one shorter),
    # over two chunks with padding; tiles must cover every query exactly once and read the same keys.
    budget = 20000  # bytes: about 8 query tokens of 2 rows x 2 heads with their partial states
    plan = _prefill_chunks(h=1, gqa=2, d=64, chunks=[(37, 20), (29, 33)], s=2, w=6, ps=8, mask=mask, seed=7,
                           temp_budget=budget, block_n=16)
    assert plan.tile_tokens < 33 and plan.temp_bytes <= budget


@pytest.mark.parametrize("mask,window", [(False, None), (True, None), (True, 9)],
                         ids=["causal", "bool_mask", "sliding_mask"])
def test_prefill_dense_chunk_launch_small(mask, window):
    # The chunk's own keys in a launch of their own (a prefill plan): chunks shorter and longer than the sinks +
    # window, padding, the first chunk overlapping the sink positions (read once, from the sink buffer), and a
    # mask whose visible keys start past the chunk's first block (the launch bounds its loop from the mask)
    _prefill_chunks(h=1, gqa=2, d=64, chunks=[(37, 20), (29, 33), (70, 9)], s=2, w=6, ps=8, mask=mask, seed=7,
                    block_n=16, dense_chunk=True, mask_window=window, gather_prefix=False)
    assert LAST_LAUNCH["dense_chunk"]


@pytest.mark.parametrize("group,mask,window", [(None, False, None), (None, True, None), (None, True, 9),
                                                (16, False, None)],
                         ids=["causal", "bool_mask", "sliding_mask", "groups_of_16"])
def test_prefill_fused_over_gathered_prefix_small(group, mask, window):
    # The fused prefill: every row's keys before its chunk gathered once a call as 16-bit rows (sinks, dequantized
    # pages of 4 tokens, ring), then one flash-attention launch over them and the chunk; rows of different lengths
    # (padding), several quantization groups a row, a first chunk shorter than the sinks + window
    _prefill_chunks(h=2, gqa=2, d=64, chunks=[(30, 41), (50, 20), (9, 30)], s=3, w=5, ps=4, mask=mask, seed=8,
                    block_n=16, group=group, mask_window=window, gather_prefix=True)
    assert LAST_LAUNCH["gather_prefix"] and LAST_LAUNCH["plan"].ns == 1
    assert LAST_LAUNCH["mask_kind"] == (3 if mask else 0)  # causal and sliding masks: one interval of keys a row


def test_prefill_gather_past_its_budget_keeps_the_split_launches_small(monkeypatch):
    # The gathered prefix is a temporary of the attention op, bounded by GATHER_BYTES_BUDGET: past it the call reads
    # the INT2 pages itself (split launches), with the same result
    from oscar_compile.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "GATHER_BYTES_BUDGET", 20000)  # the 2nd chunk needs 2 x 2 x 30 x 2 x 64 x 2 bytes
    _prefill_chunks(h=2, gqa=2, d=64, chunks=[(25, 30), (30, 20)], s=3, w=5, ps=4, mask=False, seed=10, block_n=16,
                    gather_prefix=True)
    assert not LAST_LAUNCH["gather_prefix"]  # the second chunk's prefix (30 keys a row, 2 rows) is past the budget


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_prefill_fused_with_scattered_mask_small(mask_kind):
    # masks that are not one interval a row (30% of keys hidden at random) are read key by key in the fused launch
    # (a bool mask: by its second launch, which takes the row blocks that are not intervals)
    _run_case(h=1, gqa=2, d=64, lengths=(21, 14), s=2, w=3, ps=4, decode_steps=0, mask_kind=mask_kind, seed=9,
              gather_prefix=True)
    assert LAST_LAUNCH["gather_prefix"] and LAST_LAUNCH["mask_kind"] == (3 if mask_kind == "bool" else 2)


def test_prefill_mixed_interval_and_scattered_mask_rows_small():
    # One bool mask whose rows are intervals (causal) for the first sequence and scattered for the second: with
    # 4 query rows a block, blocks of both kinds, each taken by one of the two launches, none by both or neither
    from oscar_compile.kernels.triton_attention import _mask_bounds

    gen = torch.Generator().manual_seed(14)
    b, h, gqa, d, t = 2, 1, 2, 64, 19
    ref, _ = twin_caches(h, d, b, t + 1, 2, 3, 4, None, torch.float32, "invertible", 0.95, 14, device=DEV)
    pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
    k, v = (torch.randn(b, h, t, d, generator=gen).to(DEV) for _ in range(2))
    ck, cv = store_reference(*ref.store_args(0, k, v, pos))
    q = torch.randn(b, h * gqa, t, d, generator=gen).to(DEV)
    mask = torch.arange(t + 1)[None, :] <= torch.arange(t)[:, None]
    mask = torch.stack([mask, mask & (torch.rand(t, t + 1, generator=gen) > 0.3)])[:, None]
    mask[:, :, :, 0] = True
    flags = _mask_bounds(mask.view(torch.uint8).to(DEV))[..., 2]
    assert flags[0].all() and not flags[1].all()  # both kinds of rows are there
    a = ref.attention_args(0, q, pos, pos.amax(-1) + 1, mask.to(DEV), False, chunk=(ck, cv, pos))
    got = attention_triton(*a, gather_prefix=True, chunk_block_m=4)
    assert LAST_LAUNCH["gather_prefix"] and LAST_LAUNCH["mask_kind"] == 3
    assert rel_error(got, attention_reference(*a)) < ATTN_TOL


def test_decode_with_one_mask_row_for_every_head_small(monkeypatch):
    # A decode step's bool mask [B, 1, 1, L] (what models pass): its rows' bounds are found once and read as two
    # compares a key where a row is one interval (left padding; a window in the middle), key by key where it has
    # holes; the sinks, ring and pages all see it. Against the reference, with odd lengths and a 4-key page.
    # (Bounds only where rows fill the GPU: the threshold is lowered here, and the default path checked too.)
    from oscar_compile.kernels import triton_attention as ta

    monkeypatch.setattr(ta, "MASK_BOUNDS_MIN_PROGRAMS", 0)
    gen = torch.Generator().manual_seed(21)
    b, h, gqa, d = 3, 2, 2, 64
    lengths = (37, 29, 41)
    t = max(lengths)
    ref, _ = twin_caches(h, d, b, t + 1, 2, 5, 4, None, torch.float32, "invertible", 0.95, 21, device=DEV)
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in lengths]).to(DEV)
    k, v = (torch.randn(b, h, t, d, generator=gen).to(DEV) for _ in range(2))
    store_reference(*ref.store_args(0, k, v, pos))
    q = torch.randn(b, h * gqa, 1, d, generator=gen).to(DEV)
    p1 = torch.tensor(lengths, device=DEV)[:, None] - 1
    j = torch.arange(t)
    holes = torch.rand(t, generator=gen) > 0.4
    holes[0] = True
    for rows in ([j >= 3, (j >= 1) & (j < 20), j >= 0], [j >= 3, holes, (j >= 5) & (j < 33)]):
        mask = torch.stack(rows)[:, None, None]
        for causal in (True, False):  # not causal: transformers' decode passes the mask alone
            a = ref.attention_args(0, q, p1, p1[:, 0] + 1, mask.to(DEV), causal)
            got = attention_triton(*a)
            assert LAST_LAUNCH["mask_bounds"]
            assert rel_error(got, attention_reference(*a)) < ATTN_TOL
    # a mask row per head is read key by key (no bounds); so is a shared row where the rows do not fill the GPU
    a = ref.attention_args(0, q, p1, p1[:, 0] + 1, mask.expand(b, h * gqa, 1, t).contiguous().to(DEV), True)
    got = attention_triton(*a)
    assert not LAST_LAUNCH["mask_bounds"]
    assert rel_error(got, attention_reference(*a)) < ATTN_TOL
    monkeypatch.setattr(ta, "MASK_BOUNDS_MIN_PROGRAMS", None)
    a = ref.attention_args(0, q, p1, p1[:, 0] + 1, mask.to(DEV), True)
    got = attention_triton(*a)
    assert not LAST_LAUNCH["mask_bounds"]  # 6 programs, fewer than the SMs (8 off the GPU)
    assert rel_error(got, attention_reference(*a)) < ATTN_TOL


def test_prefill_fused_without_reading_back_under_graph_capture_small(monkeypatch):
    # Under CUDA-graph capture nothing may be read back: the gathered prefix takes a row's whole capacity and the
    # bool mask's intervals are never checked on the host; same result (the GPU suite captures it for real)
    from oscar_compile.kernels import triton_attention

    def no_read_back(*args, **kwargs):
        with pytest.MonkeyPatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
                m.setattr(torch.Tensor, name, lambda self, *a, name=name: pytest.fail(f"{name} under capture"))
            return triton_attention.attention_triton(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "_capturing", lambda device: True)
    monkeypatch.setitem(globals(), "attention_triton", no_read_back)
    _prefill_chunks(h=2, gqa=2, d=64, chunks=[(30, 41), (50, 20)], s=3, w=5, ps=4, mask=True, seed=15,
                    block_n=16, gather_prefix=True)
    assert LAST_LAUNCH["gather_prefix"] and LAST_LAUNCH["mask_kind"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mask", [False, True], ids=["causal", "bool_mask"])
def test_prefill_dense_chunk_bf16_gpu(mask):
    # Llama-3-8B heads, bf16 caches: the plan picks the dense chunk loop by itself, whose tensor-core operands are
    # bf16 (8 mantissa bits for q', k and P, ~2e-3 relative rounding each, against 11 bits in fp16): 1e-2.
    _prefill_chunks(h=8, gqa=4, d=128, chunks=[(300, 1000), (700, 517), (1, 3)], s=64, w=256, ps=16, mask=mask,
                    seed=11, dtype=torch.bfloat16, tol=1e-2)
    assert not LAST_LAUNCH["gather_prefix"]  # the last chunk (3 tokens) splits its keys: the split launches
    _prefill_chunks(h=8, gqa=4, d=128, chunks=[(300, 1000), (700, 517)], s=64, w=256, ps=16, mask=mask,
                    seed=12, dtype=torch.bfloat16, tol=1e-2)
    assert LAST_LAUNCH["gather_prefix"]  # the fused prefill (the plan's choice at this size)
    _prefill_chunks(h=8, gqa=4, d=128, chunks=[(300, 1000), (700, 517)], s=64, w=256, ps=16, mask=mask,
                    seed=12, dtype=torch.bfloat16, tol=1e-2, gather_prefix=False)
    assert LAST_LAUNCH["dense_chunk"] and not LAST_LAUNCH["gather_prefix"]  # the split launches, chunk on its own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_prefill_fused_captured_in_a_cuda_graph_gpu():
    # transformers' reduce-overhead mode captures prefill chunks: the fused prefill records with nothing read back (a
    # row's whole capacity gathered, the mask's intervals never checked on the host), then each replay reads the
    # lengths and mask its buffers hold. Rows: causal, a sliding window (intervals) and a scattered mask (not).
    h, gqa, d, b, chunk, chunks = 8, 4, 128, 3, 512, 4
    total = chunk * chunks
    ref, got = twin_caches(h, d, b, total + 1, 64, 256, 16, None, torch.bfloat16, "orthogonal", 0.95, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(16)
    k_s, v_s = (torch.empty(b, h, chunk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q_s = torch.empty(b, h * gqa, chunk, d, device="cuda", dtype=torch.bfloat16)
    pos_s = torch.empty(b, chunk, device="cuda", dtype=torch.long)
    mask_s = torch.empty(b, 1, chunk, total + 1, device="cuda", dtype=torch.bool)
    keys = torch.arange(total + 1, device="cuda")

    def refill(i):
        for x in (k_s, v_s, q_s):
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        pos_s.copy_(i * chunk + torch.arange(chunk, device="cuda"))
        causal = keys <= pos_s[:, None, :, None]
        causal[1] &= keys > pos_s[1, None, :, None] - 700
        causal[2] &= (torch.rand(causal[2].shape, device="cuda", generator=gen) > 0.2) | (keys == 0)
        mask_s.copy_(causal)

    def step():
        ck, cv = store_triton(*got.store_args(0, k_s, v_s, pos_s))
        return attention_triton(*got.attention_args(0, q_s, pos_s, pos_s.amax(-1) + 1, mask_s, False,
                                                    chunk=(ck, cv, pos_s)))

    def check(out):
        ck, cv = store_reference(*ref.store_args(0, k_s, v_s, pos_s))
        expect = attention_reference(*ref.attention_args(0, q_s, pos_s, pos_s.amax(-1) + 1, mask_s, False,
                                                         chunk=(ck, cv, pos_s)))
        assert rel_error(out, expect) < 1e-2  # bf16 tensor-core operands (test_prefill_dense_chunk_bf16_gpu)

    for i in range(2):  # eagerly: compiles every kernel, the gather's included (the first chunk has no prefix)
        refill(i)
        check(step())
        assert LAST_LAUNCH["gather_prefix"] or i == 0
    refill(2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # recorded, not run
        graph_out = step()
    assert LAST_LAUNCH["gather_prefix"] and LAST_LAUNCH["mask_kind"] == 3
    for i in range(2, chunks):
        refill(i)
        graph.replay()
        check(graph_out)
    _assert_same_cache(ref, got)


LLAMA3_8B_LAYER = dict(num_kv_heads=8, head_dim=128, num_groups=1, num_sinks=64, window=256, page_size=16)


@pytest.mark.parametrize("batch,tokens,max_len", [(64, 8192, 8192), (32, 8192, 8192), (8, 8000, 8192),
                                                  (1, 131072, 131072), (512, 1, 32768), (1, 1, 131072)])
def test_plan_bounds_temporaries_at_serving_scale(batch, tokens, max_len):
    # H200 shapes (132 SMs) that crashed with an illegal memory access (int32 offsets of ~34 GB of partial
    # states) or ran out of memory: temporaries now stay within a constant budget, their offsets in int32.
    geo = CacheGeometry(num_pages=batch * max_len // 16, batch_capacity=batch, max_pages=max_len // 16,
                        **LLAMA3_8B_LAYER)
    plan = plan_attention(batch, 32, tokens, geo, 132)
    assert plan.temp_bytes <= TEMP_BYTES_BUDGET
    assert batch * 8 * plan.m_total * plan.ns * 128 < 2**31
    # every query in exactly one tile; a shorter last tile (planned for its own size) also within the budget
    tiles = plan_tiles(batch, 32, tokens + 36, geo, 132)
    starts = [0] + [t0 + p.tile_tokens for t0, p in tiles]
    assert [t0 for t0, _ in tiles] == starts[:-1] and starts[-1] == tokens + 36
    assert all(p.temp_bytes <= TEMP_BYTES_BUDGET for _, p in tiles)
    if tokens > 1:  # prefill: query blocks fill the GPU, so the keys are not split
        assert (plan.nsplit, plan.nb) == (1, 1)
        assert plan.tile_tokens >= min(tokens, 64)
    else:  # decode: split to fill the GPU
        assert plan.tile_tokens == 1 and (batch > 1 or plan.nsplit > 1)


@pytest.mark.parametrize("batch,max_len", [(1, 4096), (1, 131072), (16, 4096), (32, 8192), (64, 4096), (32, 32768)])
def test_gluon_decode_plan_fills_one_wave(batch, max_len):
    # the Gluon decode kernel's plan on an H200 (132 SMs): one-warp programs when rows x KV heads cover the
    # SMs, else 4-warp programs; every split a whole number of blocks, all programs in one wave
    from oscar_compile.kernels import triton_attention as ta

    geo = CacheGeometry(num_pages=batch * max_len // 16, batch_capacity=batch, max_pages=max_len // 16,
                        **LLAMA3_8B_LAYER)
    plan = plan_attention(batch, 32, 1, geo, 132, page_kernel="gluon")
    cfg = plan.gluon
    assert plan.page_kernel == "gluon" and cfg == (ta.GLUON_WIDE if batch * 8 >= 132 else ta.GLUON_NARROW)
    assert plan.keys_per_split % cfg.keys_per_block == 0
    assert plan.nsplit * plan.keys_per_split >= geo.max_pages * 16  # every page key in some split
    assert batch * 8 * plan.nsplit <= cfg.per_sm * 132 or plan.nsplit == 1  # no second, nearly empty wave
    assert plan.nsplit <= 128
    prefill = plan_attention(batch, 32, 64, geo, 132, page_kernel="gluon")  # more than one token: Triton
    assert prefill.page_kernel == "triton" and prefill.gluon is None
    with pytest.raises(ValueError, match="power of two"):
        ta.GluonConfig(stages=3)


def _row_subset(args: tuple, rows: list[int]) -> tuple:
    """``attention_args`` restricted to some batch rows (rows are independent; the page pools are shared)."""
    (q, pos, lens, kc, km, vc, vm, ks, vs, kr, vr, bt, *rest) = args
    *mid, kch, vch, cpos, debias = rest
    sel = lambda x: x if x is None or x.dim() == 1 and x is not lens else x[rows]  # noqa: E731  ([T] positions: shared)
    return (q[rows], sel(pos), sel(lens), kc, km, vc, vm, ks[rows], vs[rows], kr[rows], vr[rows], bt[rows],
            *mid, sel(kch), sel(vch), sel(cpos), debias)


@pytest.mark.gpu
def test_prefill_past_int32_offsets_gpu():
    # 64 x 8192 tokens x 32 query heads x d 128: the query and output hold 2^31 elements, the bool mask
    # 2^32 bytes once broadcast. This shape crashed with an illegal memory access (int32 offsets of
    # gigabytes of partial states); now it runs in bounded query tiles. Checked on sampled rows.
    b, h, g, d, t = 64, 8, 4, 128, 8192
    cache, _ = twin_caches(h, d, b, t, 64, 256, 16, None, torch.bfloat16, "orthogonal", 0.95, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(b, h, t, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    pos = torch.arange(t, device="cuda")
    ck, cv = store_triton(*cache.store_args(0, k, v, pos))
    del k, v
    q = torch.randn(b, h * g, t, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert q.numel() >= 2**31
    mask = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()[None, None]  # broadcast over batch and heads
    lens = torch.full((b,), t, device="cuda")
    for m, causal in ((None, True), (mask, False)):
        a = cache.attention_args(0, q, pos, lens, m, causal, chunk=(ck, cv, pos))
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = attention_triton(*a)
        # temporaries: the budget plus allocator rounding, far below the 4 GiB output itself
        assert torch.cuda.max_memory_allocated() - before - out.numel() * 2 < TEMP_BYTES_BUDGET * 1.25
        for rows in ([0, 37], [b - 1]):
            ref = attention_reference(*_row_subset(a, rows))
            assert rel_error(out[rows], ref) < ATTN_TOL, rows
        del out


def test_clip_quantile_with_tied_magnitudes_small():
    # integer-valued rows: |x| has many ties, at and around the clip quantile (the kernel finds the
    # quantile by maxima and tie counts, the reference by sorting; they must agree exactly)
    h, d, n = 2, 64, 40
    ref, got = twin_caches(h, d, 1, n, 0, 0, 8, None, torch.float32, "identity", clip=0.9, device=DEV)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randint(-4, 5, (1, h, n, d), generator=gen).float().to(DEV) for _ in range(2))
    pos = torch.arange(n, device=DEV)
    store_reference(*ref.store_args(0, k, v, pos))
    store_triton(*got.store_args(0, k, v, pos))
    for name in ("k_meta", "v_meta", "k_codes", "v_codes"):
        torch.testing.assert_close(getattr(got.layers[0], name), getattr(ref.layers[0], name), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_full_shapes_gpu(d, gqa):
    _run_case(h=4, gqa=gqa, d=d, lengths=(1000, 333, 77), s=64, w=256, ps=16, decode_steps=3, clip=0.95,
              kind="invertible", dtype=torch.bfloat16, seed=d + gqa)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_page_region_with_two_warps_gpu(d):
    # 2-warp page programs, forced at a small batch and chosen by the default at a batch that fills the GPU
    _run_case(h=8, gqa=4, d=d, lengths=(700, 129), s=64, w=256, ps=16, decode_steps=3, clip=0.95,
              kind="invertible", dtype=torch.bfloat16, seed=d, page_warps=2, page_kernel="triton")
    rows = torch.cuda.get_device_properties(0).multi_processor_count // 8 + 1
    lengths = tuple(random.Random(d).randint(1, 600) for _ in range(rows))
    _run_case(h=8, gqa=4, d=d, lengths=lengths, s=64, w=256, ps=16, decode_steps=2, clip=0.95,
              kind="invertible", dtype=torch.bfloat16, seed=d + 1, page_kernel="triton")
    assert LAST_LAUNCH["attention"].metadata.num_warps == 2  # the last decode step took the 2-warp default


def test_pages_in_fragment_order_small():
    # page size 16: the store writes fragment order and the Triton kernel gathers it (d = 64 and 128)
    _run_case(h=1, gqa=4, d=64, lengths=(70, 33), s=3, w=5, ps=16, decode_steps=2, clip=0.9, kind="invertible", seed=11)
    _run_case(h=1, gqa=2, d=128, lengths=(40,), s=0, w=0, ps=32, decode_steps=1, group=64, seed=12)


@pytest.mark.gpu
@pytest.mark.parametrize("d, gqa", [(128, 1), (128, 4), (128, 8), (64, 3), (256, 2)])
@pytest.mark.parametrize("page_kernel", ["gluon", "triton"])
def test_decode_page_kernels_gpu(d, gqa, page_kernel):
    # the Gluon decode kernel (forced: an error if it does not take the decode steps) and the Triton one,
    # over pages in fragment order, odd lengths, padding, a row with no page keys yet
    _run_case(h=8, gqa=gqa, d=d, lengths=(1000, 333, 77, 5000), s=64, w=256, ps=16, decode_steps=3, clip=0.95,
              kind="invertible", dtype=torch.bfloat16, seed=gqa, page_kernel=page_kernel)
    assert LAST_LAUNCH["plan"].page_kernel == page_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(warps=4, stages=1, per_sm=4), dict(warps=1, tiles=2, stages=4, per_sm=12),
                                 dict(warps=2, stages=8, per_sm=8), dict(warps=1, stages=1, per_sm=16)])
def test_gluon_decode_launch_shapes_gpu(cfg, monkeypatch):
    # every launch shape the Gluon kernel offers (register prefetch or a cp.async ring; one warp with the
    # lazy rescale, or several) gives the same answer; odd lengths, a row with no page keys, d 64 and 128
    from oscar_compile.kernels import triton_attention as ta

    monkeypatch.setattr(ta, "GLUON", ta.GluonConfig(**cfg))
    for d, gqa, seed, ps in ((128, 4, 1, 16), (64, 8, 2, 32)):  # page size 32: two tiles a page
        _run_case(h=8, gqa=gqa, d=d, lengths=(1000, 333, 5000, 77), s=64, w=256, ps=ps, decode_steps=2, clip=0.95,
                  kind="invertible", dtype=torch.bfloat16, seed=seed, page_kernel="gluon")
        assert LAST_LAUNCH["plan"].page_kernel == "gluon"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not_causal"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("heads, interval", [(32, False), (1, False), (1, True)],
                         ids=["mask_per_head", "one_mask_row", "one_interval_row"])
def test_gluon_decode_with_bool_mask_and_page_size_32_gpu(heads, interval, wide, causal, monkeypatch):
    # a mask row per query head (read a key and head), or one row every head shares (a model's [B, 1, 1, L]
    # mask): read a key where it has holes, as two bounds where it is one interval (left padding; row 1 sees
    # keys 300..1199 only); both launch shapes (two tiles a block: a key's page is its tile's, page size 32)
    from oscar_compile.kernels import triton_attention as ta

    monkeypatch.setattr(ta, "GLUON", ta.GLUON_WIDE if wide else ta.GLUON_NARROW)
    monkeypatch.setattr(ta, "MASK_BOUNDS_MIN_PROGRAMS", 0 if interval else None)  # bounds at 3 rows too
    gen = torch.Generator().manual_seed(3)
    h, gqa, d = 8, 4, 128
    ref, _ = twin_caches(h, d, 3, 2200, 64, 256, 32, None, torch.bfloat16, "invertible", 0.95, 3, device=DEV)
    lengths = (2100, 400, 1)
    t = max(lengths)
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in lengths]).to(DEV)
    k, v = (torch.randn(3, h, t, d, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    store_reference(*ref.store_args(0, k, v, pos))
    q1 = torch.randn(3, h * gqa, 1, d, generator=gen).to(DEV, torch.bfloat16)
    p1 = torch.tensor(lengths, device=DEV)[:, None] - 1
    if interval:
        j = torch.arange(2200)
        keep = torch.stack([j >= 37, (j >= 300) & (j < 1200), j >= 0])[:, None, None].expand(3, heads, 1, 2200)
    else:
        keep = torch.rand(3, heads, 1, 2200, generator=gen) > 0.3
        keep[..., 0] = True
    # not causal: what transformers' generate passes with its mask (the mask alone hides the future)
    a = ref.attention_args(0, q1, p1, p1[:, 0] + 1, keep.to(DEV), causal)
    out = attention_triton(*a, page_kernel="gluon")
    assert LAST_LAUNCH["plan"].page_kernel == "gluon" and LAST_LAUNCH["mask_bounds"] == (interval and heads == 1)
    assert rel_error(out, attention_reference(*a)) < ATTN_TOL


def test_page_region_warps_default():
    # 2 warps only for decode-sized row blocks (<= 16 rows) when the programs already cover every SM
    sms = _sm_count(torch.device(DEV))
    assert page_region_warps(1, 8, 1, 16, torch.device(DEV)) == (2 if 8 >= sms else 4)
    assert page_region_warps(sms, 1, 1, 16, torch.device(DEV)) == 2
    assert page_region_warps(sms, 8, 2, 32, torch.device(DEV)) == 4  # prefill blocks spill with 2 warps
    assert page_region_warps(1, 1, 1, 16, torch.device(DEV)) == 4


def _random_variant(rng: random.Random, d: int) -> dict:
    """What Triton compiles a kernel for (compile-time constants): heads, GQA ratio, group, page size, ring
    or not, mask kind, cache dtype, clipping or not."""
    return dict(h=rng.choice([1, 2, 4]) if DEV == "cuda" else rng.choice([1, 2]), gqa=rng.choice([1, 4, 8]), d=d,
                group=rng.choice([None, d // 2]), ps=rng.choice([8, 16, 32]), ring=rng.random() < 0.75,
                mask_kind=rng.choice([None, None, "bool", "additive"]),
                dtype=rng.choice([torch.float32, torch.bfloat16]), clipped=rng.random() < 0.67)


def _random_case(rng: random.Random, case: int, variant: dict, max_len: int) -> dict:
    """A random case of ``variant``: lengths, padding, sinks, window, clip ratio, transforms, data."""
    v = dict(variant)
    ring, clipped = v.pop("ring"), v.pop("clipped")
    return dict(v, lengths=tuple(rng.randint(1, max_len) for _ in range(rng.randint(1, 3))),
                s=rng.choice([0, 1, 4, 64]), w=rng.choice([1, 16, 256]) if ring else 0,
                decode_steps=rng.randint(0, 2), clip=rng.choice([0.95, 0.9]) if clipped else 1.0,
                kind=rng.choice(["identity", "orthogonal", "invertible"]), seed=case)


def test_fuzz_small():
    # the GPU fuzz's generator at interpreter sizes (d = 64, <= 60 tokens): masks, groups, clipping,
    # fp32 and bf16 caches, sinks/windows larger than the rows, padding, on every CI run
    rng = random.Random(1234)
    for case in range(12):
        _run_case(**_random_case(rng, case, _random_variant(rng, 64), 60))


# 512 random cases over 48 compile-time variants (3 a shard): Triton compiles a kernel per variant (and per
# divisibility class of the integer arguments), which is the fuzz's cost on the GPU, not the cases.
FUZZ_CASES, FUZZ_SHARDS, FUZZ_VARIANTS = 512, 16, 48


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_fuzz_500_cases_gpu(shard):
    # Sharded: gpu_session.sh runs the 16 shards as parallel processes, so compiles use the host's cores.
    # Each passing case prints a line (run with -s): a shard cut off by a timeout still says how far it got.
    rng = random.Random(0)
    variants = [_random_variant(rng, rng.choice([64, 128, 256])) for _ in range(FUZZ_VARIANTS)]
    cases = [_random_case(rng, case, variants[case % FUZZ_VARIANTS], 300) for case in range(FUZZ_CASES)]
    for i, params in enumerate(cases[shard::FUZZ_SHARDS]):
        try:
            _run_case(**params)
        except AssertionError as e:
            raise AssertionError(f"fuzz case {params}") from e
        print(f"fuzz case ok: shard {shard} case {i}", flush=True)


@pytest.mark.gpu
def test_4000_step_decode_with_cuda_graph_replay():
    """One decode step (store + attention) captured in a CUDA graph and replayed 4,000 times; every
    step is checked against the reference ops run on a twin cache (a degenerating kernel fails here)."""
    h, gqa, d, batch, steps, prefill = 8, 4, 128, 2, 4000, 100
    ref, got = twin_caches(h, d, batch, prefill + steps + 1, 64, 256, 16, None, torch.bfloat16, "orthogonal", 0.95,
                           device="cuda")
    replay_decode_in_cuda_graph(ref, got, prefill, steps, h * gqa, ATTN_TOL)
    _assert_same_cache(ref, got)
