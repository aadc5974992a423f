import logging

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

import oscar_compile
from oscar_compile import LayerTransforms, OscarCache, PagedInt2KVCache, UnsupportedGraphError, oscar_backend
from oscar_compile.backend import BackendOptions
from oscar_compile.testing import (
    FAMILIES,
    SLIDING_FAMILIES,
    TinyDecoder,
    hadamard_reference_cache,
    make_hf_cache,
    prefill_and_decode,
    reference_attention,
    register_reference_attention,
    rel_error,
    tiny_model,
)

STEPS = 6


def _ids(batch=2, t=9, seed=0):
    return torch.randint(3, 97, (batch, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cache_kind", ["oscar", "static", "dynamic"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_attention_is_rewritten_and_exact_without_quantization(family, cache_kind):
    model = tiny_model(family)
    ids = _ids()
    ref = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), STEPS)
    backend = oscar_backend(quantize=False, inductor=False)
    compiled = torch.compile(model, backend=backend)
    got = prefill_and_decode(compiled, ids, make_hf_cache(cache_kind, model, 32, 2), STEPS)
    layers = model.config.num_hidden_layers
    assert len(backend.graphs) >= 2  # prefill and decode
    for g in backend.graphs:
        assert len(g.rewritten) == layers and not g.unmatched
    # fp32 model, BF16 storage off (quantize=False keeps fp32 rows): only summation order differs.
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_int2_compiled_logits_equal_the_ops_called_directly(family):
    opts = dict(num_sinks=2, window=3, page_size=4)  # short sequences still reach the INT2 pages
    model = tiny_model(family)
    cfg = model.config
    ids = _ids()
    backend = oscar_backend(inductor=False, **opts)
    got = prefill_and_decode(torch.compile(model, backend=backend), ids, make_hf_cache("oscar", model, 32, 2), STEPS)

    cache = hadamard_reference_cache(model, 2, 32, **opts)
    AttentionInterface.register("oscar_reference", reference_attention(cache))
    model.config._attn_implementation = "oscar_reference"
    ref = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), STEPS)
    model.config._attn_implementation = "sdpa"
    bf16 = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), STEPS)
    # Same quantization on the same values: only fp32 summation order differs.
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert rel_error(got, bf16) > 1e-3  # and INT2 really was used


def test_bf16_layers_keep_every_token_of_those_layers_exact():
    # bf16_layers=(0,): layer 0's storage has no INT2 pages (quantize off), the others do; logits differ from a
    # run with every layer in INT2, and from BF16 (INT2 was used elsewhere)
    opts = dict(num_sinks=2, window=3, page_size=4, inductor=False)
    model = tiny_model("llama")
    ids = _ids()
    runs = {}
    for layers in ((), (0,), (0, 1)):
        torch._dynamo.reset()
        backend = oscar_backend(bf16_layers=layers, **opts)
        runs[layers] = prefill_and_decode(torch.compile(model, backend=backend), ids,
                                          make_hf_cache("oscar", model, 32, 2), STEPS)
        kept = {key[0][1]: c.quantize for key, c in backend.storage.items()}
        assert kept == {i: i not in layers for i in range(model.config.num_hidden_layers)}
    exact = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), STEPS)
    assert rel_error(runs[(0,)], runs[()]) > 1e-4 and rel_error(runs[(0,)], exact) > 1e-4
    torch.testing.assert_close(runs[(0, 1)], exact, rtol=1e-4, atol=1e-4)  # every layer BF16 (fp32 here): exact
    with pytest.raises(ValueError, match="bf16_layers"):
        oscar_backend(bf16_layers=0)


def test_layer_group_sizes_give_those_layers_their_own_groups():
    # layer_group_sizes={1: 4}: layer 1's storage has groups of 4 channels (4 (scale, min) pairs a row at head_dim 16),
    # the others one group a row; finer groups in a layer change the logits, and bring them closer to exact
    opts = dict(num_sinks=2, window=3, page_size=4, inductor=False)
    model = tiny_model("llama")
    ids = _ids()
    runs = {}
    for groups in ({}, {1: 4}, {0: 4, 1: 4}):
        torch._dynamo.reset()
        backend = oscar_backend(layer_group_sizes=groups, **opts)
        runs[len(groups)] = prefill_and_decode(torch.compile(model, backend=backend), ids,
                                               make_hf_cache("oscar", model, 32, 2), STEPS)
        got = {key[0][1]: c.group_size for key, c in backend.storage.items()}
        assert got == {i: groups.get(i, model.config.head_dim) for i in range(model.config.num_hidden_layers)}
    exact = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), STEPS)
    assert rel_error(runs[1], runs[0]) > 1e-4
    assert rel_error(runs[2], exact) < rel_error(runs[0], exact), [rel_error(r, exact) for r in runs.values()]
    with pytest.raises(ValueError, match="layer_group_sizes"):
        oscar_backend(layer_group_sizes={0: "32"})


def _int2_and_ops_reference(model: TinyDecoder, run, **compile_kw):
    """``run`` through the INT2 backend, and through the oscar ops called directly (``model.reference``)."""
    torch._dynamo.reset()
    opts = dict(num_sinks=1, window=2, page_size=4)
    int2 = run(torch.compile(model, backend=oscar_backend(inductor=False, **opts), **compile_kw))
    model.reference = PagedInt2KVCache(2, 2, 16, max_batch_size=2, max_seq_len=64, dtype=torch.float32,
                                       key_format=BackendOptions.key_format, **opts)  # the backend's key format
    for layer in range(2):
        model.reference.set_transforms(layer, LayerTransforms.hadamard(2, 16))
        model.reference.allocate(0, 64), model.reference.allocate(1, 64)
    try:
        return int2, run(model)
    finally:
        model.reference = None


def test_hand_written_decoder_with_its_own_buffers():
    model = TinyDecoder()
    ids = _ids(2, 7)

    def run(m):
        logits = [m(ids, torch.arange(7))]
        tok = logits[-1][:, -1:].argmax(-1)
        for p in range(7, 7 + STEPS):
            logits.append(m(tok, torch.tensor([p])))
            tok = logits[-1][:, -1:].argmax(-1)
        return torch.cat(logits, 1)

    with torch.no_grad():
        eager = run(model)
        backend = oscar_backend(quantize=False, inductor=False)
        exact = run(torch.compile(model, backend=backend))
        torch.testing.assert_close(exact, eager, rtol=1e-5, atol=1e-5)
        assert [len(g.rewritten) for g in backend.graphs] == [2, 2]
        assert {r.match.write_kind for g in backend.graphs for r in g.rewritten} == {"setitem"}

        int2, ref = _int2_and_ops_reference(model, run)
    torch.testing.assert_close(int2, ref, rtol=1e-4, atol=1e-4)
    assert rel_error(int2, eager) > 1e-3


_IDIOM_KIND = {"setitem": "setitem", "index_copy": "index_copy_", "index_put": "index_put_", "slice": "setitem"}


@pytest.mark.parametrize("layout, write", [("seq", "setitem"), ("seq", "index_copy"), ("seq", "index_put"), ("head", "index_put"),
                                           ("seq", "slice"), ("head", "index_copy"), ("head", "slice")])
def test_hand_written_cache_layouts_and_write_idioms(layout, write):
    # sequence-major buffers [B, L, H, d] read through transpose(1, 2), and every write idiom along the
    # sequence dim: rewritten, exact without quantization, and the ops called directly with it
    model = TinyDecoder(layout=layout, write=write)
    ids = _ids(2, 7, seed=3)

    def run(m):
        logits = [m(ids, torch.arange(7), 0)]
        tok = logits[-1][:, -1:].argmax(-1)
        for p in range(7, 7 + 3):
            logits.append(m(tok, torch.tensor([p]), p))
            tok = logits[-1][:, -1:].argmax(-1)
        return torch.cat(logits, 1)

    with torch.no_grad():
        eager = run(model)
        backend = oscar_backend(quantize=False, inductor=False)
        exact = run(torch.compile(model, backend=backend, dynamic=False))
        torch.testing.assert_close(exact, eager, rtol=1e-5, atol=1e-5)
        rewritten = [r for g in backend.graphs for r in g.rewritten]
        assert rewritten and all(len(g.rewritten) == 2 for g in backend.graphs)
        assert {r.match.write_kind for r in rewritten} == {_IDIOM_KIND[write]}
        assert {r.match.layout for r in rewritten} == {"sequence-major" if layout == "seq" else "head-major"}

        int2, ref = _int2_and_ops_reference(model, run, dynamic=False)
    # same ops, same order: only float reassociation differs
    torch.testing.assert_close(int2, ref, rtol=1e-4, atol=1e-4)
    assert rel_error(int2, eager) > 1e-3


def test_attention_without_sdpa_is_left_alone_with_its_cause():
    # Gemma 2 (logit soft-capping) has no SDPA path in transformers: eager attention, nothing to rewrite
    import transformers

    from oscar_compile.testing import _COMMON

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma2Config(**_COMMON, head_dim=16, sliding_window=64), attn_implementation="eager").eval()
    report = oscar_compile.explain(model, _ids(1, 5), max_new_tokens=2, cache="static")
    assert report.num_rewritten == 0 and report.num_unmatched > 0
    assert "no scaled_dot_product_attention call" in report.summary() and "eager" in report.summary()


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
@pytest.mark.parametrize("prompt", [5, 13])  # shorter and longer than the window (8); 10 decode steps pass it
def test_sliding_window_layers_through_oscar_cache(family, prompt):
    # the model's own sliding masks over absolute positions: quantize-off equals eager, INT2 equals the ops
    model = tiny_model(family)
    ids = _ids(2, prompt, seed=prompt)
    ref = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), 10)
    backend = oscar_backend(quantize=False, inductor=False)
    got = prefill_and_decode(torch.compile(model, backend=backend), ids, make_hf_cache("oscar", model, 32, 2), 10)
    assert all(len(g.rewritten) == 2 and not g.unmatched for g in backend.graphs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    torch._dynamo.reset()
    opts = dict(num_sinks=2, window=3, page_size=4)  # pages, sinks and ring all reach past the model's window
    backend = oscar_backend(inductor=False, **opts)
    int2 = prefill_and_decode(torch.compile(model, backend=backend), ids, make_hf_cache("oscar", model, 32, 2), 10)
    register_reference_attention("oscar_reference_masked", hadamard_reference_cache(model, 2, 32, **opts))
    model.config._attn_implementation = "oscar_reference_masked"
    try:  # a DynamicCache without the config keeps every key (no sliding layers): positions stay absolute
        ops_ref = prefill_and_decode(model, ids, DynamicCache(), 10)
    finally:
        model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(int2, ops_ref, rtol=1e-4, atol=1e-4)  # same ops; fp32 summation order differs
    assert rel_error(int2, ref) > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(SLIDING_FAMILIES))
def test_sliding_windows_read_from_the_config_as_transformers_does(family):
    from transformers import StaticCache
    from transformers.cache_utils import StaticSlidingWindowLayer

    from oscar_compile.hf import sliding_windows
    from oscar_compile.testing import tiny_config, tiny_sliding_config

    config = tiny_sliding_config(family) if family in SLIDING_FAMILIES else tiny_config(family)
    layers = StaticCache(config=config, max_cache_len=4).layers
    assert set(sliding_windows(config)) == {i for i, layer in enumerate(layers) if isinstance(layer, StaticSlidingWindowLayer)}


@pytest.mark.parametrize("family", ["mistral-window", "gemma3"])
def test_sliding_window_layers_get_storage_bounded_by_their_window(family):
    # an attached model's sliding layers: a BF16 ring of their window and no pages (smaller than INT2 pages for a
    # cache of 512; a prefill chunk of up to max_chunk = 16 tokens, twice the window, gets the window before it
    # from the store), so they stay exact; quantize-off equals eager, and INT2 equals eager wherever
    # every layer slides (mistral-window)
    from oscar_compile.hf import sliding_windows

    model = tiny_model(family)  # window 8
    ids = _ids(2, 13, seed=4)
    ref = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 64, 2), 20)
    windows = sliding_windows(model)
    assert windows and set(windows.values()) == {8}
    for quantize in (False, True):
        torch._dynamo.reset()
        oscar_compile.compile(model, quantize=quantize, inductor=False, max_chunk=16, num_sinks=2, window=3, page_size=4)
        got = prefill_and_decode(model, ids, make_hf_cache("oscar", model, 512, 2), 20)
        backend = model.oscar_backend
        rings = {key[0][1]: c for key, c in backend.storage.items() if c.sliding_window}
        assert set(rings) == set(windows)
        assert all(c.max_pages == 0 and c.num_sinks == 0 and c.window == 8 for c in rings.values())
        if not quantize or len(windows) == model.config.num_hidden_layers:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        else:  # the prefill attends to itself exactly; decode reads the full layer's INT2 pages
            torch.testing.assert_close(got[:, :13], ref[:, :13], rtol=1e-4, atol=1e-4)
            assert rel_error(got, ref) > 1e-3
        with pytest.raises(oscar_compile.CacheCapacityError, match="max_chunk=16"):
            prefill_and_decode(model, _ids(2, 17, seed=5), make_hf_cache("oscar", model, 512, 2), 0)
    model.oscar_backend.detach()


def test_artifact_carries_sliding_windows_to_a_backend_without_the_model(tmp_path):
    # calibration records the windows: torch.compile(model, backend=oscar_backend(artifacts)) bounds them too
    from oscar_compile.calibration.artifacts import load_artifacts

    model = tiny_model("gemma3")
    batches = list(torch.randint(1, model.config.vocab_size, (3, 2, 20), generator=torch.Generator().manual_seed(0)))
    oscar_compile.calibrate(model, batches, progress=False).save(tmp_path / "art")
    artifacts = load_artifacts(tmp_path / "art")
    assert artifacts.sliding_windows == {0: 8}
    backend = oscar_backend(artifacts, inductor=False, max_chunk=16)
    prefill_and_decode(torch.compile(model, backend=backend), _ids(2, 13), make_hf_cache("oscar", model, 512, 2), 3)
    rings = {key[0][1] for key, c in backend.storage.items() if c.sliding_window == 8 and c.max_pages == 0}
    assert rings == {0} and any(c.max_pages > 0 for c in backend.storage.values())
    # a cache of 8 tokens: by default the ring still (8 tokens, exact); with sliding_storage="smallest" INT2 pages
    # for the whole cache (1 of 8 tokens BF16, keys per token) are smaller, and the layer keeps pages
    for storage, ring in (("ring", True), ("smallest", False)):
        torch._dynamo.reset()
        backend = oscar_backend(artifacts, inductor=False, max_chunk=16, num_sinks=0, window=1, page_size=4,
                                key_format="token", sliding_storage=storage)
        prefill_and_decode(torch.compile(model, backend=backend), _ids(2, 5), make_hf_cache("oscar", model, 8, 2), 3)
        assert any(c.sliding_window == 8 and c.window == 8 for c in backend.storage.values()) == ring
    with pytest.raises(ValueError, match="sliding_storage"):
        oscar_backend(sliding_storage="pages")


def test_static_cache_sliding_layer_is_refused_not_silently_wrong():
    # transformers' StaticCache writes a sliding layer by index_copy_ until its window is full, then by
    # roll + copy_: the later graph would read a buffer whose tokens went to INT2 storage
    model = tiny_model("qwen2-window")
    compiled = torch.compile(model, backend=oscar_backend(quantize=False, inductor=False))
    with pytest.raises(Exception, match="contradicts an earlier graph"):
        prefill_and_decode(compiled, _ids(2, 5), make_hf_cache("static", model, 32, 2), 10)


def test_inductor_fullgraph_generate_with_oscar_cache():
    model = tiny_model("llama")
    ids = _ids(1, 9)
    eager_ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    oscar_compile.compile(model, fullgraph=True, quantize=False)
    cache = OscarCache(model, max_cache_len=32)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, eager_ref)
    backend = model.oscar_backend
    assert len(backend.graphs) >= 2 and all(len(g.rewritten) == 2 for g in backend.graphs)


def test_oscar_cache_owns_no_bf16_storage():
    model = tiny_model("llama")
    cache = OscarCache(model, max_cache_len=4096, max_batch_size=8)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            assert t.shape == (1, 2, 4096, 16)  # expanded to each input's batch inside the graph
            assert t.untyped_storage().nbytes() == t.element_size()  # one element, whatever the shape
    with pytest.raises(oscar_compile.ops.UnrewrittenCacheError, match="compiled with oscar_backend"):
        model(_ids(8, 3), past_key_values=cache)


def test_named_backend_is_registered():
    assert "oscar" in torch._dynamo.list_backends()
    from oscar_compile.backend import default_backend

    model = tiny_model("llama")
    before = len(default_backend().graphs)
    prefill_and_decode(torch.compile(model, backend="oscar"), _ids(), make_hf_cache("oscar", model, 32, 2), 1)
    assert len(default_backend().graphs) > before


def test_unsupported_pattern_falls_back_with_a_reason():
    class Encoder(torch.nn.Module):  # attention over fresh tensors: no cache to quantize
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    out = torch.compile(Encoder(), backend=oscar_backend(inductor=False))(q, k, v)
    torch.testing.assert_close(out, Encoder()(q, k, v), rtol=0, atol=0)  # untouched, same answer
    report = oscar_compile.explain(Encoder(), q, k, v)
    assert report.num_rewritten == 0
    (u,) = report.graphs[0].unmatched
    assert u.kind == "attention" and "not from a [batch, heads, seq, dim] cache" in u.reason or "no write" in u.reason

    def dropout_on_cache(buf, pos, k, q):
        buf.index_copy_(2, pos, k)
        return torch.nn.functional.scaled_dot_product_attention(q, buf[:, :, :4], buf[:, :, :4], dropout_p=0.5)

    report = oscar_compile.explain(dropout_on_cache, torch.zeros(1, 2, 8, 8), torch.arange(4), torch.randn(1, 2, 4, 8),
                                   torch.randn(1, 2, 4, 8))
    reasons = [u.reason for u in report.graphs[0].unmatched]
    assert any("dropout_p=0.5" in r for r in reasons)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="dropout") as err:
        oscar_compile.explain(dropout_on_cache, torch.zeros(1, 2, 8, 8), torch.arange(4), torch.randn(1, 2, 4, 8),
                              torch.randn(1, 2, 4, 8), backend=oscar_backend(inductor=False, strict=True))
    assert isinstance(err.value.inner_exception, UnsupportedGraphError)


def test_unmatched_read_of_an_oscar_cache_stub_raises():
    stub = torch.empty(1).expand(1, 2, 8, 8)

    def wrong_dim_write(buf, pos, k, q):
        buf.index_copy_(3, pos, k)  # writes along head_dim: not a cache write oscar models
        kk = torch.ops.oscar.cache_read_guard(buf)
        return torch.nn.functional.scaled_dot_product_attention(q, kk, kk, is_causal=True)

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="holds no BF16 data") as err:
        oscar_compile.explain(wrong_dim_write, stub, torch.arange(8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))
    assert isinstance(err.value.inner_exception, UnsupportedGraphError)


def test_summaries_go_to_the_oscar_compile_logger(caplog):
    model = tiny_model("qwen3")
    with caplog.at_level(logging.INFO, logger="oscar_compile"):
        oscar_compile.explain(model, _ids(), max_new_tokens=1)
    text = caplog.text
    assert "graph 0: 2 attention call(s), 2 rewritten" in text and "graph 1" in text


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_cuda_generate_with_triton_kernels(mode):
    """On CUDA the rewritten graph runs the Triton kernels (head_dim 64), under CUDA graphs too."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().eval()
    ids = _ids(2, 40).cuda()
    ref = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 128, 2), 20)
    oscar_compile.compile(model, mode=mode, quantize=False)
    got = prefill_and_decode(model, ids, OscarCache(model, max_cache_len=128, max_batch_size=2), 20)
    # fp16 tensor-core operands inside the kernel: ~1e-3 relative
    assert rel_error(got, ref) < 1e-2
    model._compiled_call_impl = None
    torch._dynamo.reset()
    oscar_compile.compile(model, mode=mode, num_sinks=4, window=8)
    int2 = prefill_and_decode(model, ids, OscarCache(model, max_cache_len=128, max_batch_size=2), 20)
    assert torch.isfinite(int2).all() and 1e-3 < rel_error(int2, ref) < 0.5
