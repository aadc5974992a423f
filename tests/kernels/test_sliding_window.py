"""Sliding-window layers: a ring-only cache (no sinks, no pages) whose memory does not grow with the context.

The oracle is plain BF16-semantics attention over the whole history with the sliding mask (a query at
``i`` sees keys ``i - W < j <= i``). Nothing is quantized in such a layer, so with identity transforms
and fp32 storage the reference op must match it to fp32 rounding (1e-5), and the Triton kernels (fp16
tensor-core operands, fp32 accumulation) within the usual 5e-3 relative error.
"""

import pytest
import torch

from oscar_compile import CacheCapacityError, PagedInt2KVCache
from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.store import store_reference
from oscar_compile.kernels.triton_attention import LAST_LAUNCH, attention_triton
from oscar_compile.kernels.triton_store import store_triton
from oscar_compile.testing import rel_error

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sliding_oracle(q, k_all, v_all, positions, window, gqa):
    """SDPA over the full history ``k_all [B, H, L, d]`` with the sliding mask; zeros for padding queries."""
    b, _, t, _ = q.shape
    j = torch.arange(k_all.shape[2], device=q.device)
    pos = positions[:, None, :, None]
    keep = (j <= pos) & (j > pos - window)
    keep = keep | (pos < 0)  # padding rows: any keys, zeroed below
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k_all.float(), v_all.float(), attn_mask=keep,
                                                           enable_gqa=True)
    return torch.where(positions[:, None, :, None] >= 0, out, 0.0)


def _run(store_fn, attn_fn, window, chunks, lengths, tol, seed=0, h=2, gqa=2, d=64, dtype=torch.float32):
    """Prefill rows of different ``lengths`` in calls of ``chunks`` tokens, then decode one token at a time;
    every call's output against the oracle over the full history."""
    gen = torch.Generator().manual_seed(seed)
    batch, max_len = len(lengths), max(lengths)
    cache = PagedInt2KVCache(1, h, d, max_batch_size=batch, max_seq_len=max_len, page_size=4, sliding_window=window,
                             max_chunk=chunks, identity_block_table=True, dtype=dtype, device=DEV)
    k_all = torch.randn(batch, h, max_len, d, generator=gen).to(DEV, dtype)
    v_all = torch.randn(batch, h, max_len, d, generator=gen).to(DEV, dtype)
    q_all = torch.randn(batch, h * gqa, max_len, d, generator=gen).to(DEV, dtype)
    prompt = min(lengths) // 2  # then each row decodes to its own length (shorter rows pad)
    starts = list(range(0, prompt, chunks)) + list(range(prompt, max_len))
    ends = [min(s + chunks, prompt) for s in starts if s < prompt] + [s + 1 for s in range(prompt, max_len)]
    for t0, t1 in zip(starts, ends):
        ar = torch.arange(t0, t1, device=DEV)
        pos = torch.stack([torch.where(ar < n, ar, -1) for n in lengths])
        sel = slice(t0, t1)
        chunk = store_fn(*cache.store_args(0, k_all[:, :, sel], v_all[:, :, sel], pos))
        mask = cache.sliding_mask(pos, t1)
        out = attn_fn(*cache.attention_args(0, q_all[:, :, sel], pos, None, mask, False, d**-0.5, (*chunk, pos)))
        want = _sliding_oracle(q_all[:, :, sel], k_all[:, :, :t1], v_all[:, :, :t1], pos, window, gqa)
        assert rel_error(out.float(), want) < tol, (t0, t1)
    return cache


@pytest.mark.parametrize("window, chunks", [(7, 5), (5, 12), (6, 6)])
def test_sliding_layer_reference_matches_full_history_attention(window, chunks):
    # prompt chunks shorter than, longer than and as long as the window (the ring holds the window only: a chunk's
    # write overwrites what its first queries see, which store returns with the chunk), then decoding far past the
    # window (lengths 40 and 29: a first chunk with no history, a second whose history starts mid-ring)
    _run(store_reference, attention_reference, window=window, chunks=chunks, lengths=(40, 29), tol=1e-5)


# (6, 14): a second prompt chunk of 14 with 5 tokens of history (19 chunk rows)
@pytest.mark.parametrize("window, chunks, lengths", [(6, 4, (23, 17)), (4, 9, (27, 22)), (6, 14, (60, 56))])
def test_sliding_layer_triton_kernels_match_full_history_attention(window, chunks, lengths):
    _run(store_triton, attention_triton, window=window, chunks=chunks, lengths=lengths, tol=5e-3, seed=1)


def test_sliding_layer_chunk_launch_reads_the_window_before_the_chunk():
    # The chunk's own flash launch, which the GPU's plan gives a 16-bit chunk of 16 or more rows, forced for the
    # prompt chunks (14 tokens, the second with 5 of history) in fp16. (Forced on decode steps as well, it crashes the
    # interpreter for this ring-only cache, also before this storage: decode takes the ring path instead.)
    dense = []

    def attn(*args, **kwargs):
        prompt = args[0].shape[2] > 1
        out = attention_triton(*args, **kwargs, dense_chunk=True if prompt else None)
        if prompt:
            dense.append((args[0].shape[2], LAST_LAUNCH["plan"].nc))
        return out

    _run(store_triton, attn, window=6, chunks=14, lengths=(60, 56), tol=5e-3, seed=4, dtype=torch.float16)
    assert dense == [(14, 1), (14, 1)] and LAST_LAUNCH["chunk_from_ring"]  # the last call: a decode step


def test_sliding_layer_store_returns_the_window_before_a_chunk():
    # a ring of the window only; a chunk of T > 1 comes back as [B, W - 1 + T, H, d]: each row's stored tokens
    # before it (as many as exist), the chunk, then padding, so its first real position sits at entry 0
    from oscar_compile.kernels.sliding import positions_with_history

    gen = torch.Generator().manual_seed(5)
    cache = PagedInt2KVCache(1, 1, 8, max_batch_size=2, max_seq_len=64, sliding_window=4, max_chunk=8,
                             dtype=torch.float32, identity_block_table=True)
    assert cache.window == 4 and cache.layers[0].k_ring.shape[1] == 4
    k = torch.randn(2, 1, 10, 8, generator=gen)
    cache.store(0, k[:, :, :2], k[:, :, :2], torch.arange(2))  # rows at 0, 1
    pos = torch.tensor([[2, 3, 4], [2, 3, -1]])  # the second row is one token shorter
    kt, _ = cache.store(0, k[:, :, 2:5], k[:, :, 2:5], pos)
    assert kt.shape == (2, 3 + 3, 1, 8)
    want_pos = torch.tensor([[0, 1, 2, 3, 4, -1], [0, 1, 2, 3, -1, -1]])
    assert torch.equal(positions_with_history(pos, 2, 6), want_pos)
    for b in range(2):
        for i, p in enumerate(want_pos[b].tolist()):
            if p >= 0:
                torch.testing.assert_close(kt[b, i, 0], k[b, 0, p])  # identity transforms, fp32: exact
    one, _ = cache.store(0, k[:1, :, 5:6], k[:1, :, 5:6], torch.tensor([5]))  # a decode step: no history
    assert one.shape == (1, 1, 1, 8)


@pytest.mark.gpu
def test_sliding_layer_triton_kernels_at_model_shapes_gpu():
    # bf16 storage, head_dim 128, GQA 4, a 300-token window filled by 256-token prompt chunks, rows of
    # different lengths decoding ~900 steps past it. bf16 inputs round keys/values (2^-8 relative): 2e-2.
    _run(store_triton, attention_triton, window=300, chunks=256, lengths=(1500, 1100), tol=2e-2, seed=2,
         h=8, gqa=4, d=128, dtype=torch.bfloat16)
    # Gemma 3's window (512) under a 2000-token prompt chunk, head_dim 256, GQA 4 (the chunk 4x the ring)
    _run(store_triton, attention_triton, window=512, chunks=2000, lengths=(4200, 2900), tol=2e-2, seed=3,
         h=1, gqa=4, d=256, dtype=torch.bfloat16)


def test_sliding_layer_memory_does_not_grow_with_context():
    def nbytes(max_len):
        return PagedInt2KVCache(1, 2, 64, max_batch_size=2, max_seq_len=max_len, sliding_window=512, max_chunk=256,
                                identity_block_table=True).nbytes
    assert nbytes(4096) == nbytes(131072)
    full = PagedInt2KVCache(1, 2, 64, max_batch_size=2, max_seq_len=131072, identity_block_table=True).nbytes
    assert nbytes(131072) < full / 5
    # the ring is the window: as many BF16 bytes as a BF16 cache's sliding layer (k and v, 2 rows x 2 heads x 64)
    ring = 2 * 2 * 512 * 2 * 64 * 2
    assert ring <= nbytes(4096) < 1.1 * ring


def test_sliding_layer_refuses_a_call_longer_than_its_chunk():
    cache = PagedInt2KVCache(1, 1, 64, max_batch_size=1, max_seq_len=64, sliding_window=8, max_chunk=4)
    k = torch.randn(1, 1, 5, 64)
    with pytest.raises(CacheCapacityError, match="max_chunk=4"):
        cache.store(0, k, k, torch.arange(5))


def test_sliding_layer_attention_masks_itself_without_a_mask():
    # PagedInt2KVCache.attention builds the sliding mask when the caller gives none
    gen = torch.Generator().manual_seed(3)
    cache = PagedInt2KVCache(1, 1, 64, max_batch_size=1, max_seq_len=32, sliding_window=3, max_chunk=2,
                             dtype=torch.float32, identity_block_table=True)
    k_all, v_all = torch.randn(2, 1, 1, 20, 64, generator=gen)
    for t in range(20):
        pos = torch.tensor([[t]])
        chunk = cache.store(0, k_all[:, :, t : t + 1], v_all[:, :, t : t + 1], pos)
        q = torch.randn(1, 1, 1, 64, generator=gen)
        out = cache.attention(0, q, pos, chunk=(*chunk, pos))
        want = _sliding_oracle(q, k_all[:, :, : t + 1], v_all[:, :, : t + 1], pos, 3, 1)
        assert rel_error(out, want) < 1e-5, t
