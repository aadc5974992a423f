"""Dense K/V buffers of a hand-written decoder: released once the rewrite made them dead, never read after."""

import pytest
import torch

import oscar_compile
from oscar_compile import UnsupportedGraphError
from oscar_compile.ops import UnrewrittenCacheError
from oscar_compile.testing import TinyDecoder

PROMPT, STEPS = 7, 5


def _run(model, ids):
    logits = [model(ids, torch.arange(PROMPT))]
    tok = logits[-1][:, -1:].argmax(-1)
    for p in range(PROMPT, PROMPT + STEPS):
        logits.append(model(tok, torch.tensor([p])))
        tok = logits[-1][:, -1:].argmax(-1)
    return torch.cat(logits, 1)


def _buffers(model):
    return [t for blk in model.blocks for t in (blk.k_cache, blk.v_cache)]


@torch.no_grad()
def test_dead_dense_caches_are_released_and_results_unchanged():
    model = TinyDecoder()
    ids = torch.randint(3, 97, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    eager = _run(model, ids)
    dense = sum(t.untyped_storage().nbytes() for t in _buffers(model))
    oscar_compile.compile(model, quantize=False, inductor=False)
    got = _run(model, ids)
    # fp32 model, quantize off: the rewritten graphs compute what the model computes (summation order aside)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    assert all(t.untyped_storage().nbytes() == 0 for t in _buffers(model))
    assert model.oscar_backend.released.nbytes == dense > 0
    assert model.causal.untyped_storage().nbytes() > 0  # other buffers (read by the graph) are kept


@torch.no_grad()
def test_released_buffers_are_never_read_eagerly_or_by_an_unrewritten_graph():
    model = TinyDecoder()
    ids = torch.randint(3, 97, (2, PROMPT))
    oscar_compile.compile(model, quantize=False, inductor=False)
    model(ids, torch.arange(PROMPT))
    assert model.oscar_backend.released
    # an eager forward (what a Dynamo fallback runs) would read freed memory: refused with a clear error
    model._compiled_call_impl = None
    with pytest.raises(UnrewrittenCacheError, match="released its dense K/V buffers"):
        model(ids, torch.arange(PROMPT))
    # a later graph that reads a released buffer without rewriting it is refused at compile time
    peek = torch.compile(lambda: model.blocks[0].k_cache.sum(), backend=model.oscar_backend)
    with pytest.raises(Exception, match="released after an earlier graph") as e:
        peek()
    assert isinstance(e.value, UnsupportedGraphError) or isinstance(e.value.__cause__, UnsupportedGraphError) \
        or "UnsupportedGraphError" in str(e.value)


@torch.no_grad()
def test_release_can_be_switched_off():
    model = TinyDecoder()
    oscar_compile.compile(model, quantize=False, inductor=False, release_dead_caches=False)
    model(torch.randint(3, 97, (2, PROMPT)), torch.arange(PROMPT))
    assert not model.oscar_backend.released
    assert all(t.untyped_storage().nbytes() > 0 for t in _buffers(model))


@pytest.mark.gpu
@torch.no_grad()
def test_release_under_inductor_and_cuda_graphs_gpu():
    # The decode graph is compiled (and captured in CUDA graphs) after the prefill graph released the
    # buffers: its placeholders are storage-less tensors, which neither Inductor nor the graph capture may read.
    model = TinyDecoder(dim=256, heads=4, kv_heads=2).cuda()
    ids = torch.randint(3, 97, (2, PROMPT), device="cuda")
    pos = lambda *p: torch.tensor(p, device="cuda")  # noqa: E731
    eager = [model(ids, pos(*range(PROMPT)))] + [model(ids[:, :1], pos(p)) for p in range(PROMPT, PROMPT + STEPS)]
    oscar_compile.compile(model, quantize=False, mode="reduce-overhead")
    got = [model(ids, pos(*range(PROMPT))).clone()] + [model(ids[:, :1], pos(p)).clone() for p in range(PROMPT, PROMPT + STEPS)]
    assert all(t.untyped_storage().nbytes() == 0 for t in _buffers(model))
    # fp16 tensor-core operands in the attention kernel: ~1e-3 relative
    for g, e in zip(got, eager):
        assert (g - e).norm() / e.norm() < 1e-2
