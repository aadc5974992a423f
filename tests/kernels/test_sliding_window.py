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
from oscar_compile.kernels.triton_attention import attention_triton
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


def test_sliding_layer_reference_matches_full_history_attention():
    # prompt chunks of 5 with a window of 7, then decoding far past the window (lengths 40 and 29)
    _run(store_reference, attention_reference, window=7, chunks=5, lengths=(40, 29), tol=1e-5)


def test_sliding_layer_triton_kernels_match_full_history_attention():
    _run(store_triton, attention_triton, window=6, chunks=4, lengths=(23, 17), tol=5e-3, seed=1)


@pytest.mark.gpu
def test_sliding_layer_triton_kernels_at_model_shapes_gpu():
    # bf16 storage, head_dim 128, GQA 4, a 300-token window filled by 256-token prompt chunks, rows of
    # different lengths decoding ~900 steps past it. bf16 inputs round keys/values (2^-8 relative): 2e-2.
    _run(store_triton, attention_triton, window=300, chunks=256, lengths=(1500, 1100), tol=2e-2, seed=2,
         h=8, gqa=4, d=128, dtype=torch.bfloat16)


def test_sliding_layer_memory_does_not_grow_with_context():
    def nbytes(max_len):
        return PagedInt2KVCache(1, 2, 64, max_batch_size=2, max_seq_len=max_len, sliding_window=512, max_chunk=256,
                                identity_block_table=True).nbytes
    assert nbytes(4096) == nbytes(131072)
    full = PagedInt2KVCache(1, 2, 64, max_batch_size=2, max_seq_len=131072, identity_block_table=True).nbytes
    assert nbytes(131072) < full / 5


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
