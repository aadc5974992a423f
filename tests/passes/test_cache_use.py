"""What ordinary use and ordinary mistakes get: a full cache, a new batch, many cache sizes, grad mode.

One test per case of issue 15 (non-finite values: tests/kernels/test_non_finite.py). The compiled models
run the rewritten graph eagerly (``inductor=False``) except where Inductor is the point (grad mode).
"""

import logging

import pytest
import torch
from transformers import DynamicCache, StaticCache

import oscar_compile
from oscar_compile import CacheCapacityError, OscarCache, PagedInt2KVCache
from oscar_compile.ops import InferenceOnlyError
from oscar_compile.testing import cache_kwarg, tiny_model

OPTS = dict(num_sinks=2, window=3, page_size=4)  # short sequences reach the INT2 pages


def _ids(batch, t, seed=0):
    return torch.randint(3, 97, (batch, t), generator=torch.Generator().manual_seed(seed))


def _storage_snapshot(backend):
    return [t.clone() for c in backend.storage.values() for layer in c.layers for t in layer.tensors()]


def _make_cache(kind, model, length, batch=1):
    if kind == "oscar":
        return OscarCache(model, max_cache_len=length)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return DynamicCache(config=model.config)  # grows: the backend's max_seq_len is its capacity


@pytest.mark.parametrize("kind", ["oscar", "static", "dynamic"])
def test_writing_past_the_cache_raises_before_anything_is_written(kind):
    model = tiny_model("llama")
    oscar_compile.compile(model, inductor=False, max_seq_len=48, **OPTS)
    kw = cache_kwarg(model)
    cache = _make_cache(kind, model, 48)
    ids = _ids(1, 40)
    with torch.no_grad():
        out = model(ids, **{kw: cache}, use_cache=True)
        for _ in range(8):  # positions 40..47: the cache is now full
            out = model(out.logits[:, -1:].argmax(-1), **{kw: cache}, use_cache=True)
        before = _storage_snapshot(model.oscar_backend)
        with pytest.raises(CacheCapacityError, match=r"position 48 needs 49 positions, but the cache holds 48 tokens"):
            model(out.logits[:, -1:].argmax(-1), **{kw: cache}, use_cache=True)
    for a, b in zip(before, _storage_snapshot(model.oscar_backend)):
        assert torch.equal(a, b)
    if kind != "dynamic":
        assert int(cache.layers[0].cumulative_length) == 48  # the failed step did not advance it either


def test_generate_with_too_small_an_oscar_cache_raises_and_a_reset_cache_still_works():
    """The issue's case: 40-token prompt, 20 new tokens, max_cache_len=48 (generate returned garbage)."""
    model = tiny_model("llama")
    ref = tiny_model("llama")
    ids = _ids(1, 40)
    oscar_compile.compile(model, inductor=False, quantize=False)
    cache = OscarCache(model, max_cache_len=48)
    with pytest.raises(CacheCapacityError, match=r"OscarCache\(model, max_cache_len=\.\.\.\)"):
        model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=20, do_sample=False)
    cache.reset()
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=9, do_sample=False)  # fits exactly
    assert torch.equal(out, ref.generate(ids, max_new_tokens=9, do_sample=False))


def test_paged_cache_checks_every_row_before_writing_any():
    cache = PagedInt2KVCache(1, 2, 16, max_batch_size=2, max_seq_len=16, num_sinks=2, window=4, page_size=4,
                             identity_block_table=True)
    k = torch.randn(2, 2, 1, 16)
    assert cache.capacity_tokens == 18  # 2 sinks + 4 window + 3 pages x 4
    with pytest.raises(CacheCapacityError, match="row 1: position 18 is past the end"):
        cache.store(0, k, k, torch.tensor([[3], [18]]))  # row 0 fits, row 1 does not
    assert all((t == 0).all() for t in cache.layers[0].tensors())


def test_oscar_cache_takes_its_batch_from_the_first_input_and_refuses_a_larger_one():
    model = tiny_model("llama")
    ref = tiny_model("llama")
    oscar_compile.compile(model, inductor=False, quantize=False)
    kw = cache_kwarg(model)
    cache = OscarCache(model, max_cache_len=64)
    assert cache.max_batch_size is None
    ids = _ids(2, 9)
    out = model.generate(ids, **{kw: cache}, max_new_tokens=4, do_sample=False)
    assert cache.max_batch_size == 2
    assert torch.equal(out, ref.generate(ids, max_new_tokens=4, do_sample=False))
    cache.reset()
    with pytest.raises(ValueError, match=r"holds 2 sequence\(s\).*got a batch of 3"):
        model.generate(_ids(3, 9), **{kw: cache}, max_new_tokens=4, do_sample=False)
    cache.reset()
    out = model.generate(ids[:1], **{kw: cache}, max_new_tokens=4, do_sample=False)  # a smaller batch fits
    assert torch.equal(out, ref.generate(ids[:1], max_new_tokens=4, do_sample=False))
    with torch.no_grad(), pytest.raises(ValueError, match="cannot continue them; call cache.reset"):
        model(ids[:, :1], **{kw: cache}, use_cache=True)  # 2 rows cannot continue 1 sequence


def test_one_compiled_model_serves_caches_of_many_sizes_and_batches(caplog):
    model = tiny_model("llama")
    ref = tiny_model("llama")
    oscar_compile.compile(model, inductor=False, quantize=False)
    backend, kw = model.oscar_backend, cache_kwarg(model)
    graphs = []
    with caplog.at_level(logging.INFO, logger="oscar_compile"):
        for length, batch, new in ((64, 1, 12), (96, 1, 3), (80, 2, 3), (200, 2, 3), (72, 1, 3), (5000, 1, 3),
                                   (64, 2, 12)):
            ids = _ids(batch, 9, seed=length)
            out = model.generate(ids, **{kw: OscarCache(model, max_cache_len=length)}, max_new_tokens=new,
                                 do_sample=False)
            assert torch.equal(out, ref.generate(ids, max_new_tokens=new, do_sample=False)), (length, batch)
            graphs.append(len(backend.graphs))
    # A prefill and a decode graph per bucket: static sizes first (twelve decode steps compile one graph),
    # then symbolic lengths up to 4096 tokens, batches of 2 to 4 rows, lengths up to 8192 tokens. Sizes
    # within a bucket compile nothing (200 x 2 and 72 x 1, then 64 x 2 for twelve steps).
    assert graphs[0] == 2 and graphs[2] == graphs[3] == graphs[4] and graphs[-1] == graphs[-2] <= 8
    assert "new INT2 storage" in caplog.text and "x 4096 tokens" in caplog.text and "x 8192 tokens" in caplog.text
    # Storage per layer: exact for the static first graphs (1 x 64), then one per bucket: 1 x 4096, 4 x 4096
    # (batches of 2 to 4) and 1 x 8192.
    assert len(backend.storage) == 4 * model.config.num_hidden_layers


def test_a_forward_in_grad_mode_runs_and_a_backward_says_inference_only():
    model = tiny_model("llama")
    ids = _ids(1, 9)
    with torch.no_grad():
        ref = model(ids).logits
    oscar_compile.compile(model, quantize=False)  # with Inductor: it builds a training graph in grad mode
    assert torch.is_grad_enabled()
    out = model(ids, **{cache_kwarg(model): OscarCache(model, max_cache_len=32)}, use_cache=True)
    torch.testing.assert_close(out.logits, ref, rtol=1e-5, atol=1e-5)
    assert out.logits.requires_grad
    with pytest.raises(InferenceOnlyError, match="inference-only.*torch.no_grad"):
        out.logits.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_full_cache_raises_on_cuda_without_a_sync_per_step(mode):
    """On CUDA (Triton kernels: head_dim 64), eagerly and under CUDA graphs: the host raises at the first
    position past the cache, and no decode step before it synchronizes with the GPU in oscar's code."""
    import warnings

    import transformers

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().eval()
    # pages of 16: the least the Triton kernels take with per-channel keys (pages of 4 would run on the reference,
    # which synchronizes); the first page completes at position 20, inside the watched steps
    oscar_compile.compile(model, mode=mode, **{**OPTS, "page_size": 16})
    cache = OscarCache(model, max_cache_len=24)
    kw = cache_kwarg(model)
    with torch.no_grad():
        tok = model(_ids(2, 16).cuda(), **{kw: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(3):  # positions 16..18: compile (and record) the decode graph
            tok = model(tok, **{kw: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(5):  # positions 19..23: the last one fills the cache
                    tok = model(tok, **{kw: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ours = [w for w in caught if "synchroniz" in str(w.message) and "oscar_compile" in (w.filename or "")]
        assert not ours, [(w.filename, w.lineno) for w in ours]
        with pytest.raises(CacheCapacityError, match="position 24 needs 25 positions, but the cache holds 24"):
            model(tok, **{kw: cache}, use_cache=True)
    assert int(cache.layers[0].cumulative_length) == 24


def test_a_counter_made_in_inference_mode_is_reused_only_there():
    # an inference tensor refuses in-place updates outside inference mode: a cache made outside never takes one
    model = tiny_model("llama")
    with torch.inference_mode():
        made = OscarCache(model, max_cache_len=8)
        counter = made.layers[0].cumulative_length
        assert counter.is_inference()
    del made
    outside = OscarCache(model, max_cache_len=8)
    assert all(not layer.cumulative_length.is_inference() for layer in outside.layers)
    outside.layers[0].cumulative_length.add_(1)  # what a compiled call does
    with torch.inference_mode():
        again = OscarCache(model, max_cache_len=8)
        assert again.layers[0].cumulative_length is counter and int(counter) == 0


@pytest.mark.gpu
def test_a_new_cache_records_no_cuda_graph_again():
    """Under reduce-overhead, a generate on a second cache (the first one gone) replays the CUDA graphs the first
    recorded: its position counters are the first's (a fresh one re-recorded every graph: 3.8 s instead of 0.65 s
    to the first token at 16 x 4K on the H100). Counted as the graph nodes Inductor's CUDA-graph trees create."""
    import transformers
    from torch._inductor import cudagraph_trees

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().eval()
    oscar_compile.compile(model, mode="reduce-overhead", **{**OPTS, "page_size": 16})
    ids = _ids(2, 20).cuda()
    recorded = []
    init = cudagraph_trees.CUDAGraphNode.__init__

    def counting(self, *args, **kwargs):
        recorded.append(1)
        init(self, *args, **kwargs)

    cudagraph_trees.CUDAGraphNode.__init__ = counting
    try:
        outs = []
        for _ in range(3):  # compile and record; then a new cache twice
            before = len(recorded)
            outs.append(model.generate(ids, past_key_values=OscarCache(model, max_cache_len=32), max_new_tokens=6,
                                       do_sample=False))
            new = len(recorded) - before
        assert recorded and new == 0, f"the third cache's generate recorded {new} CUDA graphs again"
        assert torch.equal(outs[1], outs[2])
    finally:
        cudagraph_trees.CUDAGraphNode.__init__ = init


def test_a_sequence_continued_by_a_graph_for_other_sizes_moves_to_its_storage(caplog):
    """Prefill and decode of one cache may run graphs compiled at different times, with different storages:
    here a one-token generate compiles only a symbolic-length prefill, so the next 64-token cache prefills
    there (4096-token storage) and decodes with the older static graph (64-token storage)."""
    model = tiny_model("llama")
    oscar_compile.compile(model, inductor=False, **OPTS)
    kw = cache_kwarg(model)
    ids = _ids(1, 9)
    for length, new in ((64, 3), (96, 1)):
        model.generate(ids, **{kw: OscarCache(model, max_cache_len=length)}, max_new_tokens=new, do_sample=False)
    with caplog.at_level(logging.INFO, logger="oscar_compile"):
        got = model.generate(ids, **{kw: OscarCache(model, max_cache_len=64)}, max_new_tokens=6, do_sample=False)
    assert "moving 1 rows of 9 tokens" in caplog.text
    ref_cache = OscarCache(model, max_cache_len=64)  # the same cache size, decoded by one storage only
    model.oscar_backend.reset()
    torch._dynamo.reset()
    assert torch.equal(got, model.generate(ids, **{kw: ref_cache}, max_new_tokens=6, do_sample=False))


def test_two_caches_interleaved_on_one_backend_are_refused():
    model = tiny_model("llama")
    oscar_compile.compile(model, inductor=False, **OPTS)
    kw = cache_kwarg(model)
    a, b = OscarCache(model, max_cache_len=32), OscarCache(model, max_cache_len=32)
    with torch.no_grad():
        model(_ids(1, 5), **{kw: a}, use_cache=True)
        model(_ids(1, 5, seed=1), **{kw: b}, use_cache=True)  # the same storage: a's rows are gone
        with pytest.raises(RuntimeError, match="another cache wrote this cache's INT2 storage"):
            model(_ids(1, 1), **{kw: a}, use_cache=True)
        model(_ids(1, 1), **{kw: b}, use_cache=True)  # b continues
        a.reset()
        model(_ids(1, 5), **{kw: a}, use_cache=True)  # and a starts again


def test_a_new_cache_reuses_the_position_counters_of_a_gone_one():
    """Counters are static graph inputs: at a new address every CUDA graph re-records (seconds a request under
    reduce-overhead, and no CUDA graphs at all past Inductor's re-record limit). A cache takes those of a cache
    that is gone, even one freed only by the cycle collector (the first, whose call compiled), starting afresh;
    caches alive together never share one."""
    model = tiny_model("llama")
    oscar_compile.compile(model, inductor=False, **OPTS)
    ids = _ids(2, 9)

    def generate(cache):
        return model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)

    first = OscarCache(model, max_cache_len=32)
    expected = generate(first)
    addresses = [layer.cumulative_length.data_ptr() for layer in first.layers]
    del first
    for _ in range(2):
        cache = OscarCache(model, max_cache_len=32)
        assert [layer.cumulative_length.data_ptr() for layer in cache.layers] == addresses
        assert all(int(layer.cumulative_length) == 0 for layer in cache.layers)
        assert torch.equal(generate(cache), expected)  # nothing of the previous cache's positions carried over
        assert int(cache.layers[0].cumulative_length) == 13
        other = OscarCache(model, max_cache_len=32)
        assert not {layer.cumulative_length.data_ptr() for layer in other.layers} & set(addresses)
        del cache, other
