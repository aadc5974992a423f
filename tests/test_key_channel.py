"""Per-channel keys (``key_format="channel"``): keys quantized per channel over each page's tokens.

The reference ops against the float64 oracle (which quantizes whole pages itself), chunking invariance,
the ring that holds the page being filled, capacity, non-finite keys, the memory accounting, and the
backend end to end.
"""

from types import SimpleNamespace

import pytest
import torch

import oscar_compile  # noqa: F401  (registers torch.ops.oscar)
from oscar_compile import CacheCapacityError, PagedInt2KVCache
from oscar_compile.kernels.checks import is_channel_key_meta
from oscar_compile.quant import dequantize_int2, quantize_int2_channels
from oscar_compile.testing import CacheOracle, decode_against_oracle, random_transforms, rel_error


def _cache(h=2, d=64, batch=3, max_len=200, sinks=5, window=12, page=8, **kw):
    return PagedInt2KVCache(1, h, d, max_batch_size=batch, max_seq_len=max_len, num_sinks=sinks, window=window,
                            page_size=page, dtype=torch.float32, key_format="channel", **kw)


def test_quantize_int2_channels_round_trip():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 13, 64, generator=gen) * torch.rand(64, generator=gen) * 5  # 13 tokens, channels of any range
    x[..., 7] = 1.5  # a constant channel: scale 0, every code 0, back exactly
    packed, scale, mn = quantize_int2_channels(x)
    assert packed.shape == (3, 2, 13, 16) and scale.shape == mn.shape == (3, 2, 64)
    back = dequantize_int2(packed, scale[..., None, :], mn[..., None, :], group_size=1)
    # round to nearest: half a step per element, plus fp16 rounding of (scale, min) (~1e-3 relative)
    step = scale.float()[..., None, :]
    assert ((back - x).abs() <= step / 2 + 2e-3 * x.abs().amax(-2, keepdim=True) + 1e-6).all()
    assert torch.equal(back[..., 7], torch.full_like(back[..., 7], 1.5))
    assert torch.allclose(scale.float(), (x.amax(-2) - x.amin(-2)) / 3, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("gqa,kind", [(2, "orthogonal"), (1, "invertible")])
def test_attention_matches_float64_oracle_over_prefill_and_decode(gqa, kind):
    """Prefill of rows of different lengths (not multiples of the page), then 100 decode steps: every row
    crosses several page boundaries, so pages are written from the ring, from the chunk and from both."""
    gen = torch.Generator().manual_seed(gqa)
    h, d = 2, 64
    prefill = [37, 3, 70]
    cache = _cache(h, d)
    cache.set_transforms(0, random_transforms(h, d, kind, gen, clip=0.95))
    oracle = CacheOracle(cache)
    scale = d**-0.5
    t = max(prefill)
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in prefill])
    k, v = torch.randn(3, h, t, d, generator=gen) + 2, torch.randn(3, h, t, d, generator=gen)  # keys with a mean
    q = torch.randn(3, h * gqa, t, d, generator=gen)
    for row, n in enumerate(prefill):
        cache.allocate(row, n)
    oracle.append_batch(k, v, prefill)
    kt, vt = cache.store(0, k, v, pos)
    out = cache.attention(0, q, pos, is_causal=True, scale=scale)
    exact = cache.attention(0, q, pos, is_causal=True, scale=scale, chunk=(kt, vt, pos))
    # float32 cache and SDPA against float64: ~1e-6 measured; INT2 codes are bit-identical (same rounding), so
    # any bookkeeping error (wrong page, wrong ring slot) shows up as O(1)
    for row, n in enumerate(prefill):
        assert rel_error(out[row, :, :n], oracle.attention(row, q[row, :, :n], torch.arange(n), scale)) < 1e-4
        assert rel_error(exact[row, :, :n], oracle.attention(row, q[row, :, :n], torch.arange(n), scale, chunk=n)) < 1e-4
    lengths, worst = decode_against_oracle(cache, oracle, list(prefill), 100, h * gqa, scale, gen, key_offset=2.0)
    assert min(lengths) > 5 + 12 + 3 * 8  # every row wrote several pages
    assert worst < 1e-4, worst


def test_keys_really_go_per_channel():
    """The key pages hold what per-channel quantization of whole pages gives, not per-token rows."""
    gen = torch.Generator().manual_seed(3)
    h, d, n = 1, 64, 60
    cache = _cache(h, d, batch=1, sinks=4, window=8, page=16)
    cache.allocate(0, n)
    k = torch.randn(1, h, n, d, generator=gen) * torch.linspace(0.1, 10, d)  # channels of very different ranges
    cache.store(0, k, torch.randn(1, h, n, d, generator=gen), torch.arange(n))
    assert cache.pages_for(n) == 3 and cache.quantized_tokens(n) == 48  # 60 - 4 - 8 = 48: three whole pages
    layer = cache.layers[0]
    assert is_channel_key_meta(layer.k_codes, layer.k_meta) and tuple(layer.k_meta.shape[1:]) == (1, h, 2 * d)
    from oscar_compile.kernels.attention import gather_history
    from oscar_compile.kernels.checks import check_cache

    geo = check_cache(*layer.tensors(), cache.block_table)
    keys = gather_history(geo, layer.k_codes, layer.k_meta, layer.k_sink, layer.k_ring, cache.block_table,
                          torch.tensor([n]), n, "k")[0]
    pages = k[0].transpose(0, 1)[4:52].reshape(3, 16, h, d).transpose(1, 2)
    packed, scale, mn = quantize_int2_channels(pages)
    want = dequantize_int2(packed, scale[..., None, :], mn[..., None, :], group_size=1).transpose(1, 2).reshape(48, h, d)
    assert torch.equal(keys[4:52], want)
    assert torch.equal(keys[52:], k[0, :, 52:].transpose(0, 1))  # the ring: 8 window tokens + 0 of a new page
    # per-token rows of the same keys lose the small channels: per-channel error is smaller (measured 107 vs 183)
    from oscar_compile.quant import quantize_int2

    rows = dequantize_int2(*quantize_int2(k[0].transpose(0, 1)[4:52]))
    assert (want - pages.transpose(1, 2).reshape(48, h, d)).norm() * 1.5 < (rows - k[0].transpose(0, 1)[4:52]).norm()


def test_chunked_prefill_gives_the_same_cache_as_one_shot():
    gen = torch.Generator().manual_seed(11)
    h, d, n = 2, 32, 90
    k, v = torch.randn(1, h, n, d, generator=gen), torch.randn(1, h, n, d, generator=gen)
    tr = random_transforms(h, d, "orthogonal", gen, clip=0.9)
    caches = []
    for chunks in ([n], [10, 1, 33, 46], [7] * 12 + [6], [1] * n):
        cache = PagedInt2KVCache(1, h, d, max_seq_len=128, num_sinks=4, window=16, page_size=8, key_format="channel")
        cache.set_transforms(0, tr)
        cache.allocate(0, n)
        start = 0
        for c in chunks:
            cache.store(0, k[:, :, start : start + c], v[:, :, start : start + c], torch.arange(start, start + c))
            start += c
        caches.append(cache)
    live = torch.arange(4 + caches[0].quantized_tokens(n), n) % caches[0].ring_len  # ring slots of the row's window
    for other in caches[1:]:
        for name in ("k_codes", "k_meta", "v_codes", "v_meta", "k_sink", "v_sink"):
            assert torch.equal(getattr(caches[0].layers[0], name), getattr(other.layers[0], name)), name
        for name in ("k_ring", "v_ring"):  # other slots hold tokens already in pages: never read
            assert torch.equal(getattr(caches[0].layers[0], name)[:, live], getattr(other.layers[0], name)[:, live]), name


def test_ring_capacity_and_memory():
    cache = _cache(h=2, d=64, batch=1, max_len=100, sinks=4, window=10, page=16)
    assert cache.ring_len == 10 + 15 and cache.layers[0].k_ring.shape[1] == 25
    assert cache.max_pages == (100 - 14) // 16 == 5
    assert cache.capacity_tokens == 4 + 25 + 5 * 16 >= 100
    for length, pages in ((14, 0), (29, 0), (30, 1), (45, 1), (46, 2)):
        assert cache.pages_for(length) == pages
    rep = cache.memory_report(4 + 25 + 5 * 16)
    # keys 2 + 32/16 = 4 bits, values 2 + 32/64 = 2.5 bits an element in the pages; sinks and ring in fp32
    want = (29 * 2 * 64 * 4 * 2 + 80 * 2 * 64 * (4 + 2.5) / 8) / (109 * 2 * 64 * 2) * 8
    assert rep.bits_per_element == pytest.approx(want)
    assert cache.page_bits_per_element == pytest.approx((4 + 2.5) / 2)
    cache.allocate(0, 100)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 110, 64, generator=gen), torch.randn(1, 2, 110, 64, generator=gen)
    with pytest.raises(CacheCapacityError):
        cache.store(0, k, v, torch.arange(110))
    assert (cache.layers[0].k_sink == 0).all()  # nothing written
    cache.store(0, k[:, :, :100], v[:, :, :100], torch.arange(100))  # up to the length it was allocated for


def test_nan_key_poisons_its_page_and_row_only():
    gen = torch.Generator().manual_seed(2)
    h, d, n = 1, 64, 40
    cache = _cache(h, d, batch=2, sinks=2, window=6, page=8)
    for row in range(2):
        cache.allocate(row, n)
    k, v = torch.randn(2, h, n, d, generator=gen), torch.randn(2, h, n, d, generator=gen)
    k[0, 0, 5, 3] = float("nan")  # position 5: the first page of row 0
    cache.store(0, k, v, torch.arange(n))
    assert torch.isnan(cache.layers[0].k_meta[cache.block_table[0, 0].long()]).all()
    out = cache.attention(0, torch.randn(2, h, 1, d, generator=gen), torch.tensor([[n - 1], [n - 1]]))
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


def test_opcheck_with_channel_keys():
    gen = torch.Generator().manual_seed(0)
    h, d = 2, 64
    cache = _cache(h, d, batch=2, max_len=64, sinks=3, window=5, page=4)
    cache.set_transforms(0, random_transforms(h, d, "orthogonal", gen))
    for row in range(2):
        cache.allocate(row, 30)
    k, v = (torch.randn(2, h, 29, d, generator=gen) for _ in range(2))
    cache.store(0, k, v, torch.arange(29))
    k, v = (torch.randn(2, h, 1, d, generator=gen) for _ in range(2))
    step = torch.tensor([[29], [29]])
    torch.library.opcheck(torch.ops.oscar.store.default, cache.store_args(0, k, v, step))
    q = torch.randn(2, 2 * h, 1, d, generator=gen)
    torch.library.opcheck(torch.ops.oscar.attention.default, cache.attention_args(0, q, step))


def test_bad_key_format():
    with pytest.raises(ValueError, match="key_format"):
        PagedInt2KVCache(1, 1, 64, key_format="channels")
    with pytest.raises(ValueError, match="page_size"):
        PagedInt2KVCache(1, 1, 64, page_size=1, key_format="channel")
    with pytest.raises(ValueError, match="key_format"):
        oscar_compile.oscar_backend(key_format="row")
    for bad in (0, -16, 8.0, True):
        with pytest.raises(ValueError, match="page_size"):
            oscar_compile.oscar_backend(page_size=bad)


def test_backend_defaults_to_channel_keys_over_pages_of_32():
    """Keys per channel over pages of 32 are the backend's default (they beat per-token keys on the GPU's eval);
    the page size follows the key format unless given, and ``oscar memory`` and the eval's bits follow the backend."""
    from oscar_compile.evaluation import Method, bits_per_element
    from oscar_compile.testing import tiny_model

    o = oscar_compile.oscar_backend().options
    assert (o.key_format, o.page_size) == ("channel", 32)
    assert oscar_compile.oscar_backend(key_format="token").options.page_size == 16
    assert oscar_compile.oscar_backend(page_size=64).options.page_size == 64
    cfg = tiny_model("llama").config
    bits = {name: bits_per_element(cfg, Method("x", options=opts), 1 << 17, 64, 256)
            for name, opts in (("default", {}), ("channel32", {"key_format": "channel", "page_size": 32}),
                               ("token", {"key_format": "token"}))}
    assert bits["default"] == bits["channel32"] < bits["token"]  # head_dim 16: keys 3 bits against 4


def test_backend_with_channel_keys_equals_the_ops_called_directly():
    """A compiled tiny model with ``key_format="channel"``: its logits are those of the same model whose attention
    calls the ops on a per-channel cache of its own, and differ from per-token keys (the option reached the cache)."""
    from transformers import AttentionInterface

    from oscar_compile import oscar_backend
    from oscar_compile.backend import BackendOptions, resolve_key_page_clips
    from oscar_compile.testing import hadamard_reference_cache, make_hf_cache, prefill_and_decode, reference_attention, tiny_model

    opts = dict(num_sinks=2, window=3, page_size=4)
    model = tiny_model("llama")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    runs = {}
    for key_format in ("channel", "token"):
        torch._dynamo.reset()
        backend = oscar_backend(inductor=False, key_format=key_format, **opts)
        runs[key_format] = prefill_and_decode(torch.compile(model, backend=backend), ids,
                                              make_hf_cache("oscar", model, 32, 2), 8)
        assert {c.key_format for c in backend.storage.values()} == {key_format}
    cache = hadamard_reference_cache(model, 2, 32, key_format="channel", **opts)
    AttentionInterface.register("oscar_reference_channel", reference_attention(cache))
    model.config._attn_implementation = "oscar_reference_channel"
    try:
        ref = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), 8)
    finally:
        model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(runs["channel"], ref, rtol=1e-4, atol=1e-4)  # same ops; fp32 summation order differs
    assert rel_error(runs["channel"], runs["token"]) > 1e-3

    # layer_key_formats: each layer's storage takes its own format; every layer per token is key_format="token"
    for formats, want in (({1: "token"}, ["channel", "token"]), ({0: "token", 1: "token"}, ["token", "token"])):
        torch._dynamo.reset()
        backend = oscar_backend(inductor=False, layer_key_formats=formats, **opts)
        mixed = prefill_and_decode(torch.compile(model, backend=backend), ids, make_hf_cache("oscar", model, 32, 2), 8)
        assert [c.key_format for _, c in sorted(backend.storage.items(), key=lambda kv: kv[0][0][1])] == want
        if want == ["token", "token"]:
            torch.testing.assert_close(mixed, runs["token"], rtol=1e-5, atol=1e-5)  # the same ops on the same data
        else:
            assert rel_error(mixed, runs["channel"]) > 1e-4 and rel_error(mixed, runs["token"]) > 1e-4
    for bad in ({0: "row"}, {-1: "token"}, {"0": "token"}, "all", [0]):
        with pytest.raises(ValueError, match="layer_key_formats"):
            oscar_backend(layer_key_formats=bad)

    # key_page_clips: a layer's ratio reaches its storage's store (its key_clip argument) and changes its logits;
    # the ratio 1 is the full range (the default without a checked artifact)
    torch._dynamo.reset()
    backend = oscar_backend(inductor=False, key_page_clips={1: 0.7}, **opts)
    narrowed = prefill_and_decode(torch.compile(model, backend=backend), ids, make_hf_cache("oscar", model, 32, 2), 8)
    caches = [c for _, c in sorted(backend.storage.items(), key=lambda kv: kv[0][0][1])]
    assert [c.store_key_clip(c.transforms[0]) for c in caches] == [1.0, 0.7]
    assert rel_error(narrowed, runs["channel"]) > 1e-4
    torch._dynamo.reset()
    backend = oscar_backend(inductor=False, key_page_clips={0: 1.0, 1: 1.0}, **opts)
    full = prefill_and_decode(torch.compile(model, backend=backend), ids, make_hf_cache("oscar", model, 32, 2), 8)
    torch.testing.assert_close(full, runs["channel"], rtol=1e-6, atol=1e-6)
    # the default is "auto": the artifact's ratios, none without an artifact (or with an unchecked one)
    assert BackendOptions.key_page_clips == "auto" and oscar_backend().options.key_page_clips == {}
    assert oscar_backend(key_page_clips=None).options.key_page_clips == {}
    checked = SimpleNamespace(key_page_clips={0: 0.8, 1: 0.9})
    assert resolve_key_page_clips(BackendOptions.key_page_clips, checked) == {0: 0.8, 1: 0.9}
    assert resolve_key_page_clips(None, checked) == {}
    # keys rounded with error feedback: the ratios the check chose for them, where it chose any
    fed = SimpleNamespace(key_page_clips={0: 0.8, 1: 0.9}, feedback_page_clips={0: 1.0, 1: 0.7})
    assert resolve_key_page_clips("auto", fed, feedback=True) == {0: 1.0, 1: 0.7}
    assert resolve_key_page_clips("auto", fed) == {0: 0.8, 1: 0.9}
    assert resolve_key_page_clips("auto", checked, feedback=True) == {0: 0.8, 1: 0.9}
    for bad in ({0: 0.0}, {0: 1.5}, {-1: 0.9}, {0: True}, "all", [0.9]):
        with pytest.raises(ValueError, match="key_page_clips"):
            oscar_backend(key_page_clips=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("page, tol", [(32, 5e-3), (8, 1e-4)])
def test_cuda_gives_what_the_cpu_gives_for_channel_keys(page, tol):
    """On CUDA pages of 16, 32, ... tokens run the Triton kernels (fp16 tensor-core operands: 5e-3, as every Triton
    attention test); smaller pages fall back to the reference (float32 cache; summation order differs: 1e-4)."""
    gen = torch.Generator().manual_seed(4)
    h, d, n = 2, 64, 90
    outs = []
    for device in ("cpu", "cuda"):
        cache = _cache(h, d, batch=2, max_len=128, sinks=4, window=16, page=page, device=device)
        cache.set_transforms(0, random_transforms(h, d, "orthogonal", torch.Generator().manual_seed(0)))
        for row in range(2):
            cache.allocate(row, n + 1)
        k, v = (torch.randn(2, h, n, d, generator=gen).to(device) for _ in range(2))
        cache.store(0, k, v, torch.arange(n, device=device))
        q = torch.randn(2, 2 * h, 1, d, generator=gen).to(device)
        k1, v1 = (torch.randn(2, h, 1, d, generator=gen).to(device) for _ in range(2))
        step = torch.full((2, 1), n, device=device)
        cache.store(0, k1, v1, step)
        outs.append(cache.attention(0, q, step).cpu())
        gen = torch.Generator().manual_seed(4)  # the same data on both devices
    assert rel_error(outs[1], outs[0]) < tol


def test_smallest_sliding_storage_counts_channel_key_bytes():
    """``sliding_storage="smallest"`` compares a sliding layer's ring with the INT2 storage it would otherwise get:
    with per-channel keys that is whole pages, a ring longer by a page, and one scale and minimum per channel. The
    sliding ring is its window (512 here), whatever ``max_chunk``."""
    from oscar_compile.backend import BackendOptions, _ring_is_smaller
    from oscar_compile.cache import row_bytes

    o = BackendOptions(key_format="channel", page_size=32, window=256, num_sinks=64, max_chunk=4096)
    h, d, bf = 1, 256, torch.bfloat16
    for max_len in (2048, 8192, 32768, 131072):
        cache = PagedInt2KVCache(1, h, d, max_seq_len=max_len, page_size=32, key_format="channel", device="meta")
        int2 = cache.memory_report(max_len).int2_bytes  # keys and values of one row, as the cache counts them
        ring = 2 * row_bytes(h, d, min(512, max_len), 0, d, bf, torch.float16)
        assert _ring_is_smaller(o, h, d, bf, 512, max_len, None) == (ring < int2)
        assert _ring_is_smaller(o, h, d, bf, 512, max_len, None)  # 512 BF16 tokens against 64 + 256 + INT2 pages
    # a window of 4096 against 2K tokens of INT2 (the ring is capped at the cache's length: BF16 throughout)
    assert not _ring_is_smaller(o, h, d, bf, 4096, 2048, None)


def test_key_feedback_reaches_the_store_and_needs_its_factors(tmp_path):
    """``key_feedback=True``: each layer's factor (calibrated, saved and loaded with the artifact) is the store's
    ``key_feedback`` argument, so the logits move against plain rounding (the option reached the kernels); without an
    artifact, with one calibrated before the factors existed, or with per-token keys, it is refused, and the default
    ("auto") is off there and on otherwise."""
    from dataclasses import replace

    from oscar_compile import calibrate, load_artifacts, oscar_backend
    from oscar_compile.testing import make_hf_cache, prefill_and_decode, tiny_model

    opts = dict(num_sinks=2, window=3, page_size=4)
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(1)
    art = calibrate(model, [torch.randint(3, 97, (2, 48), generator=gen) for _ in range(3)], progress=False)
    assert art.has_key_feedback
    art = load_artifacts(art.save(tmp_path / "art"))  # the factors survive the files
    assert art.has_key_feedback and all(torch.equal(t.key_feedback, t.key_feedback.triu()) for t in art.layers)
    ids = torch.randint(3, 97, (2, 21), generator=gen)
    logits = {}
    for feedback in (False, True):
        torch._dynamo.reset()
        backend = oscar_backend(art, inductor=False, key_feedback=feedback, **opts)
        logits[feedback] = prefill_and_decode(torch.compile(model, backend=backend), ids,
                                              make_hf_cache("oscar", model, 40, 2), 6)
        for c in backend.storage.values():
            got = c.store_key_feedback(c.transforms[0])
            assert (got is not None) == feedback
    assert rel_error(logits[True], logits[False]) > 1e-5
    old = replace(art, layers=[replace(t, key_feedback=None) for t in art.layers])
    # the default ("auto"): on where the artifact carries its factors and keys are per channel, else off
    assert oscar_backend(art, inductor=False, **opts).options.key_feedback is True
    for off in (dict(artifacts=old), dict(artifacts=None), dict(artifacts=art, key_format="token")):
        assert oscar_backend(inductor=False, **off).options.key_feedback is False
    for bad, match in ((dict(artifacts=None), "none was given"), (dict(artifacts=old), "recalibrate"),
                       (dict(artifacts=art, key_format="token"), "key_format='channel'"),
                       (dict(artifacts=art, key_feedback="yes"), "'auto', True or False")):
        with pytest.raises(ValueError, match=match):
            oscar_backend(**{"key_feedback": True, **bad})
