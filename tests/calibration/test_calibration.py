import dataclasses
import json

import pytest
import torch

import oscar_compile
from oscar_compile.calibration import ArtifactError, calibrate, load_artifacts, parse_method
from oscar_compile.calibration.clipping import attention_probs, key_error, search_clip, value_error
from oscar_compile.calibration.rotations import bit_reversal_permutation, derive_transforms
from oscar_compile.calibration.statistics import StatsObserver
from oscar_compile.cli import main as cli_main
from oscar_compile.testing import FAMILIES, TinyDecoder, make_hf_cache, prefill_and_decode, tiny_model


def _qkv(gen, b=3, hkv=2, g=3, t=20, d=16):
    return (torch.randn(b, hkv * g, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen) + 0.5,
            torch.randn(b, hkv, t, d, generator=gen))


def test_statistics_match_a_direct_batch_computation():
    gen = torch.Generator().manual_seed(0)
    obs = StatsObserver(skip_first=2)
    batches = [_qkv(gen) for _ in range(3)]
    for q, k, v in batches:
        obs.record(0, q, k, v, torch.arange(q.shape[2]))
    st = obs.layers[0]
    # direct: all tokens at positions >= 2, per KV head, in float64
    q = torch.cat([x[0] for x in batches]).double()[:, :, 2:]
    k = torch.cat([x[1] for x in batches]).double()[:, :, 2:]
    v = torch.cat([x[2] for x in batches]).double()[:, :, 2:]
    qg = q.reshape(q.shape[0], 2, 3, -1, 16)
    s_q = torch.einsum("bhgtd,bhgte->hde", qg, qg) / (qg.shape[0] * 3 * qg.shape[3])
    torch.testing.assert_close(st.query_second_moment, s_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.key_mean, k.mean((0, 2)), rtol=1e-12, atol=1e-12)
    n = k.shape[0] * k.shape[2]
    torch.testing.assert_close(st.key_second_moment(), torch.einsum("bhtd,bhte->hde", k, k) / n, rtol=1e-12, atol=1e-12)
    cov = torch.einsum("bhtd,bhte->hde", k - k.mean((0, 2), keepdim=True), k - k.mean((0, 2), keepdim=True)) / n
    torch.testing.assert_close(st.key_second_moment(about=st.key_mean), cov, rtol=1e-10, atol=1e-12)
    assert st.token_count == n and st.query_count == n * 3
    # S_v: one pass, each batch weighted with the running S_q (including itself)
    expect = torch.zeros(2, 16, 16, dtype=torch.float64)
    wsum = torch.zeros(2, dtype=torch.float64)
    for i in range(3):
        qs = qg[: 3 * (i + 1)]
        running = torch.einsum("bhgtd,bhgte->hde", qs, qs) / (qs.shape[0] * 3 * qs.shape[3])
        kb, vb = k[3 * i: 3 * i + 3], v[3 * i: 3 * i + 3]
        w = torch.einsum("bhtd,hde,bhte->bht", kb, running, kb)
        expect += torch.einsum("bht,bhtd,bhte->hde", w, vb, vb)
        wsum += w.sum((0, 2))
    torch.testing.assert_close(st.weighted_value_second_moment(), expect / wsum[:, None, None], rtol=1e-10, atol=1e-12)


def test_bit_reversal_permutation():
    assert bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert sorted(bit_reversal_permutation(64).tolist()) == list(range(64))


def _planted(seed, b, noise=0.05):
    """Queries in a rank-4 subspace (plus ``noise``); keys with two outlier channels and a large mean."""
    gen = torch.Generator().manual_seed(seed)
    d = 64
    basis = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(99)))[0][:, :4].T
    q = torch.randn(b, 2, 96, 4, generator=gen) @ (basis * 3) + noise * torch.randn(b, 2, 96, d, generator=gen)
    chan = torch.ones(d)
    chan[[3, 17]] = 8.0
    k = torch.randn(b, 1, 96, d, generator=gen) * chan + 2.0
    v = torch.randn(b, 1, 96, d, generator=gen) * torch.linspace(0.2, 3, d)
    return q, k, v


def test_oscar_rotations_orthogonal_and_better_than_hadamard_and_identity_on_planted_structure():
    obs = StatsObserver(skip_first=0)
    for seed in range(4):
        obs.record(0, *_planted(seed, 4), torch.arange(96))
    q, k, v = _planted(100, 2)  # held out
    probs = attention_probs(q, k)
    errs = {}
    for method in ("identity", "hadamard", "oscar", "oscar+mean+scale"):
        tr = derive_transforms(obs.layers[0], parse_method(method))
        eye = torch.eye(64)
        if method != "oscar+mean+scale":  # pure rotations are orthogonal
            for a in (tr.key_transform[0], tr.value_transform[0]):
                assert (a.double() @ a.double().T - eye.double()).abs().max() < 1e-6
        tr.validate(1, 64)  # query/output matrices invert the key/value ones
        errs[method] = (key_error(q, k, tr, 1.0), value_error(probs, v, tr, 1.0))
    for i in (0, 1):
        assert errs["oscar"][i] < errs["hadamard"][i] and errs["oscar"][i] < errs["identity"][i], errs
    assert errs["oscar+mean+scale"][0] < errs["oscar"][0] / 5, errs  # query-aware scaling: far smaller logit error


def test_bounded_query_scaling_keeps_its_range_and_q_dot_k():
    # The planted queries live in 4 of 64 directions (plus 5% noise): unbounded, the quiet 60 get scales ~14x smaller
    # than the rest, and a query that reaches them later (a longer context turns RoPE pairs further) is amplified by
    # the inverse. +scale8 keeps max / min within 8 (around the geometric mean); queries get the inverse either way.
    obs = StatsObserver(skip_first=0)
    for seed in range(4):
        obs.record(0, *_planted(seed, 4), torch.arange(96))
    spread = {}
    for method in ("oscar+mean+scale", "oscar+mean+scale8"):
        tr = derive_transforms(obs.layers[0], parse_method(method))
        tr.validate(1, 64)
        s = torch.linalg.svdvals(tr.key_transform[0].double())
        spread[method] = float(s.max() / s.min())
        q = torch.randn(5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        k = torch.randn(7, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        qt, kt = q @ tr.query_transform[0].double(), k @ tr.key_transform[0].double()
        # exact but for the float32 storage of the transforms (~1e-7 relative, times their condition number)
        torch.testing.assert_close(qt @ kt.T, q @ k.T, rtol=1e-4, atol=1e-4 * float((q @ k.T).abs().max()))
    assert spread["oscar+mean+scale"] > 12 and spread["oscar+mean+scale8"] <= 8 * (1 + 1e-6), spread
    assert parse_method("oscar+mean+scale8").name == "oscar+mean+scale8"
    with pytest.raises(ValueError, match="R > 1"):
        parse_method("oscar+scale0.5")


def test_key_scale_spans_are_recorded():
    # Queries in 4 of 64 directions with 0.5% noise: the other 60 nearly silent, their key scales tiny; the span
    # (max / min of the key transform's singular values) is what the artifact records; +scale8 bounds it
    from oscar_compile.calibration.tracer import key_scale_spans

    obs = StatsObserver(skip_first=0)
    for seed in range(4):
        obs.record(0, *_planted(seed, 4, noise=0.005), torch.arange(96))
    wide = key_scale_spans([derive_transforms(obs.layers[0], parse_method("oscar+mean+scale"))])
    bounded = key_scale_spans([derive_transforms(obs.layers[0], parse_method("oscar+mean+scale8"))])
    assert wide[0] > 32 and bounded[0] <= 8.0001, (wide, bounded)


def _degenerate(jitter=0.0):
    """Queries +-3 x each of 4 orthonormal directions in turn (their second moment exactly isotropic there, so any basis
    of those 4 is an eigenbasis; ``jitter`` adds that much noise), keys of very unequal variances in that subspace."""
    d, gen = 64, torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(99)))[0]
    signs = torch.tensor([3.0, -3.0]).repeat_interleave(4).repeat(12)  # 96 tokens
    q = (signs[:, None] * basis[:, torch.arange(96) % 4].T).expand(4, 2, 96, d).double()
    q = q + jitter * torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    std = torch.cat([torch.tensor([3.0, 0.3, 1.5, 0.6]), torch.linspace(0.3, 3, d - 4)])
    k = (torch.randn(4, 1, 96, d, generator=gen) * std) @ basis.T
    v = torch.randn(4, 1, 96, d, generator=gen)
    return q, k.double(), v.double()


def test_geometric_mean_scaling_is_exact_and_well_posed():
    # +gm keeps q.k exact and cuts the logit error like +scale on the planted structure; and where S_q's eigenvalues
    # coincide, a perturbation of 1e-6 of the statistics moves +scale's key Gram matrix A A^T by O(1) (its
    # eigenbasis is arbitrary there) but +gm's by next to nothing (a continuous function of the statistics)
    obs = StatsObserver(skip_first=0)
    for seed in range(4):
        obs.record(0, *_planted(seed, 4), torch.arange(96))
    q, k, v = _planted(100, 2)
    errs = {}
    for method in ("oscar+mean", "oscar+mean+scale", "oscar+mean+gm", "oscar+mean+gm8"):
        tr = derive_transforms(obs.layers[0], parse_method(method))
        tr.validate(1, 64)
        errs[method] = key_error(q, k, tr, 1.0)
    assert errs["oscar+mean+gm"] < errs["oscar+mean"] / 5 and errs["oscar+mean+gm8"] < errs["oscar+mean"] / 2, errs
    assert torch.linalg.svdvals(derive_transforms(obs.layers[0], parse_method("oscar+mean+gm8")).key_transform[0]
                                .double()).aminmax() is not None

    grams = {}
    for label, jitter in (("plain", 0.0), ("perturbed", 1e-6)):  # the moments move by ~1e-6 relative
        obs = StatsObserver(skip_first=0)
        obs.record(0, *_degenerate(jitter), torch.arange(96))
        for method in ("oscar+mean+scale", "oscar+mean+gm"):
            a = derive_transforms(obs.layers[0], parse_method(method)).key_transform[0].double()
            grams[label, method] = a @ a.T
    moved = {m: float((grams["plain", m] - grams["perturbed", m]).abs().max() / grams["plain", m].abs().max())
             for m in ("oscar+mean+scale", "oscar+mean+gm")}
    assert moved["oscar+mean+gm"] < 1e-3 and moved["oscar+mean+scale"] > 0.1, moved


def test_eigenbasis_is_canonical_under_rounding():
    # eigh returns u or -u, and any basis of a zero eigenvalue's subspace, as rounding goes: the artifact then moved
    # with the thread count (Gemma 3 270M: stored keys 150% apart). Signs and the null-space basis are now fixed.
    from oscar_compile.calibration.rotations import sorted_eigenbasis

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(200, 16, generator=gen, dtype=torch.float64)
    x[:, [2, 9, 11]] = 0  # channels that are exactly zero (Gemma 3's RoPE pairs of zero query channels)
    m = (x.T @ x)[None]
    noise = 1e-13 * torch.randn(16, 16, generator=gen, dtype=torch.float64)
    m2 = m + (noise + noise.T)[None]
    (la, ua), (lb, ub) = sorted_eigenbasis(m), sorted_eigenbasis(m2)
    torch.testing.assert_close(ua, ub, rtol=0, atol=1e-9)
    torch.testing.assert_close(ua @ torch.diag_embed(la) @ ua.transpose(-1, -2), m, rtol=1e-10, atol=1e-8)
    null = ua[0, :, -3:].abs()  # the zero eigenvalues' basis: the zero channels themselves
    assert torch.allclose(null[[2, 9, 11]].sum(0), torch.ones(3, dtype=torch.float64)) and null.sum() - 3 < 1e-9


def test_clip_search_picks_the_grid_minimum():
    obs = StatsObserver(skip_first=0)
    obs.record(0, *_planted(0, 4), torch.arange(96))
    q, k, v = _planted(7, 2)
    tr = derive_transforms(obs.layers[0], parse_method("oscar"))
    kc, vc, errors = search_clip([q], [k], [v], tr)
    assert errors["key_error"][kc] == min(errors["key_error"].values())
    assert errors["value_error"][vc] == min(errors["value_error"].values())


def test_relative_errors_are_recorded_and_an_outlier_layer_is_flagged():
    # Two layers with the same keys and values: queries of norm 0.5 (logits ~0.5 nat apart: a soft attention) and of
    # norm 10 (logits ~10 nats apart: a peaked one). INT2 keys make the same relative logit error in both, but only the
    # peaked layer's attention output moves by its whole size (Qwen2.5-Coder-0.5B's layer 0); the calibration
    # records the output error, and the summary flags that layer.
    from oscar_compile.calibration.clipping import relative_errors
    from oscar_compile.calibration.tracer import CalibrationStats, derive_artifacts

    gen = torch.Generator().manual_seed(5)
    b, h, g, t, d = 2, 2, 3, 96, 64
    q = torch.randn(b, h * g, t, d, generator=gen)
    k = torch.randn(b, h, t, d, generator=gen) + 0.5
    v = torch.randn(b, h, t, d, generator=gen)
    obs = StatsObserver(skip_first=0)
    for phase in ("stats", "heldout"):
        obs.phase = phase
        obs.record(0, 0.5 * q, k, v, torch.arange(t))
        obs.record(1, 10 * q, k, v, torch.arange(t))
    fp = {"architecture": "planted", "num_layers": 2, "num_q_heads": h * g, "num_kv_heads": h, "head_dim": d}
    art = derive_artifacts(CalibrationStats(obs, fp, {}), "oscar+mean")  # no query-aware scaling
    errs = art.calibration["heldout_relative_error"]
    assert len(errs) == 2 and all(0 < e < 1 for e in errs[0]), errs
    assert errs[1][0] > 0.5 and errs[1][0] > 4 * errs[0][0], errs  # the peaked layer's keys
    assert errs[1][1] == pytest.approx(errs[0][1], rel=0.5)  # values: the same data, the same error
    assert "<- an outlier" in art.summary().splitlines()[-1]
    assert relative_errors([0.5 * q], [k], [v], art.layers[0]) == pytest.approx(tuple(errs[0]), rel=1e-3)
    # beside them the key error per channel over pages of 32 (the backend's default format): the peaked layer's
    # keys stand out there too, and the summary shows the column
    chan = art.calibration["heldout_channel_key_error"]
    assert len(chan) == 2 and 0 < chan[0] < 1 and chan[1] > 4 * chan[0], chan
    assert chan[0] == pytest.approx(relative_errors([0.5 * q], [k], [v], art.layers[0], key_page=32)[0], rel=1e-3)
    assert "keys per channel" in art.summary()
    # a window of BF16 keys (the cache's ring) only lowers the error, to 0 where it covers every key
    windowed = relative_errors([10 * q], [k], [v], art.layers[1], window=32)
    assert 0 < windowed[0] < errs[1][0] and 0 < windowed[1] < errs[1][1]
    # (keys: the exact logits in the rotated basis, against the model basis's: fp32 rounding)
    assert relative_errors([10 * q], [k], [v], art.layers[1], window=t) == pytest.approx((0.0, 0.0), abs=1e-4)


def test_outlier_layers_are_chosen_by_ratio_floor_and_cap():
    from oscar_compile.calibration import select_bf16_layers

    errors = [[0.1, 0.1]] * 15 + [[1.07, 0.12]]
    assert select_bf16_layers(errors) == [15]  # 10x the median keys' error, above the floor
    assert select_bf16_layers([[0.01, 0.01]] * 15 + [[0.2, 0.01]]) == []  # 20x, but small in itself
    assert select_bf16_layers([[0.1, 0.1]] * 8 + [[0.3, 0.1]]) == []  # above the floor, only 3x
    many = [[0.1, 0.1]] * 12 + [[0.6, 0.1], [0.1, 0.9], [1.5, 0.1], [0.5, 0.1]]
    assert select_bf16_layers(many) == [13, 14]  # at most one in eight layers: the two worst ratios
    assert select_bf16_layers(many, max_layers=4) == [12, 13, 14, 15] and select_bf16_layers([]) == []


def test_long_context_check_records_errors_and_the_backend_keeps_its_layers(tmp_path, monkeypatch):
    # check_layers runs the model on long sequences with the artifact's transforms: per-layer errors recorded (as
    # the calibration's own held-out ones, on other tokens), outliers chosen; the artifact carries them through
    # save/load to a backend, whose bf16_layers default to them (() turns them off)
    from oscar_compile.calibration import check as check_module
    from oscar_compile.calibration import check_layers

    model = tiny_model("llama")
    art = calibrate(model, _batches(), method="default", progress=False)
    long = [torch.randint(3, 90, (1, 80), generator=torch.Generator().manual_seed(9))]
    checked = check_layers(model, art, long, num_sinks=2, window=8, progress=False)  # 80 tokens: reach INT2
    errs = checked.calibration["check_relative_error"]
    assert len(errs) == 2 and all(0 < e < 2 for pair in errs for e in pair)
    # keys as the backend stores them by default: per channel over pages of 32 (2 whole pages of the 78 after the
    # sinks); per-token keys give other key errors, the same value errors
    assert checked.calibration["check_key_format"] == ["channel", 32]
    # ...each layer's page range ratio (the option key_page_clips="auto"): the grid's least key error, recorded apart;
    # the recorded errors stay the full ranges' (the default storage); with the grid cut to the full range, every
    # ratio is 1, its key error the full range's
    from oscar_compile.calibration.clipping import PAGE_CLIP_GRID

    clips, clipped = checked.key_page_clips, checked.calibration["check_page_clip_key_error"]
    assert set(clips) == {0, 1} and all(r in PAGE_CLIP_GRID for r in clips.values())
    with monkeypatch.context() as m:
        m.setattr(check_module, "PAGE_CLIP_GRID", (1.0,))
        full = check_layers(model, art, long, num_sinks=2, window=8, progress=False)
    assert full.key_page_clips == {0: 1.0, 1: 1.0} and full.calibration["check_relative_error"] == errs
    assert full.calibration["check_page_clip_key_error"] == [e[0] for e in errs]
    for layer in (0, 1):
        assert clipped[layer] < errs[layer][0] if clips[layer] < 1.0 else clipped[layer] == errs[layer][0]
    assert any(r < 1.0 for r in clips.values())  # random tiny-model keys: some page range narrows
    # ...and, for keys rounded with error feedback (key_feedback=True), each layer's own ratio and its key error; none
    # where the artifact has no factors, whose other choices stay the same; the summary reports the comparison
    from dataclasses import replace

    fed = checked.calibration["check_feedback_key_error"]
    assert len(fed) == 2 and all(e > 0 for e in fed)  # (this tiny model's queries are near isotropic: little gain)
    fed_clips = checked.feedback_page_clips
    assert set(fed_clips) == {0, 1} and all(r in PAGE_CLIP_GRID for r in fed_clips.values())
    assert "keys with error feedback" in checked.summary()
    unfed = replace(art, layers=[replace(t, key_feedback=None) for t in art.layers])
    unfed_checked = check_layers(model, unfed, long, num_sinks=2, window=8, progress=False)
    assert "check_feedback_key_error" not in unfed_checked.calibration and unfed_checked.feedback_page_clips == {}
    assert unfed_checked.key_page_clips == checked.key_page_clips  # the choices without feedback do not change
    # ...and the same keys per token, for layer_key_formats="auto": the layers where per token is clearly better
    token_key = checked.calibration["check_token_key_error"]
    assert len(token_key) == 2 and all(e > 0 for e in token_key)
    assert checked.token_key_layers == tuple(i for i in range(2) if token_key[i] < 0.75 * errs[i][0])
    monkeypatch.setattr(check_module, "TOKEN_KEY_RATIO", 100.0)  # every layer qualifies
    every = check_layers(model, art, long, num_sinks=2, window=8, progress=False)
    assert every.token_key_layers == (0, 1)
    auto = oscar_compile.oscar_backend(every, layer_key_formats="auto").options.layer_key_formats
    assert auto == {0: "token", 1: "token"} and oscar_compile.oscar_backend(every).options.layer_key_formats == {}
    token = check_layers(model, art, long, num_sinks=2, window=8, key_format="token", progress=False)
    token_errs = token.calibration["check_relative_error"]
    assert token.calibration["check_key_format"] == ["token", 16] and token.key_page_clips == {}
    assert [e[1] for e in token_errs] == [e[1] for e in errs] and [e[0] for e in token_errs] != [e[0] for e in errs]
    with pytest.raises(ValueError, match="key_format"):
        check_layers(model, art, long, key_format="row", progress=False)
    assert checked.calibration["check_tokens"] == 80 and "bf16_layers" not in art.calibration  # a copy
    planted = check_layers(model, art, long, num_sinks=2, window=8, progress=False, factor=0.0, floor=0.0, max_layers=1)
    assert len(planted.bf16_layers) == 1  # every layer qualifies: the worst one is kept
    # retrieval heads measured before the check are chosen again without the layer it keeps in BF16 (the scores stay)
    scored = dataclasses.replace(art, calibration=dict(art.calibration, induction_scores=[[0.5, 0.4], [0.6, 0.3]],
                                                       retrieval_heads=[[1, 0]]))
    rechecked = check_layers(model, scored, long, num_sinks=2, window=8, progress=False, factor=0.0, floor=0.0,
                             max_layers=1)
    other = 1 - rechecked.bf16_layers[0]
    assert rechecked.retrieval_heads == {other: (0,)}  # 1/16 of 4 heads: one, the best outside the BF16 layer
    planted.save(tmp_path)
    again = load_artifacts(tmp_path)
    assert again.bf16_layers == planted.bf16_layers and "kept in BF16: [" in again.summary()
    for option, kept in ((None, set(planted.bf16_layers)), ((), set())):
        torch._dynamo.reset()
        backend = oscar_compile.oscar_backend(again, inductor=False, num_sinks=1, window=2, bf16_layers=option)
        prefill_and_decode(torch.compile(model, backend=backend), _batches(1)[0], make_hf_cache("oscar", model, 40, 2), 2)
        assert {key[0][1] for key, c in backend.storage.items() if not c.quantize} == kept
    with pytest.raises(ValueError, match="non-empty"):
        check_layers(model, art, [torch.zeros(0, dtype=torch.long)], progress=False)
    # sliding-window layers keep exact BF16 rings in the backend: no error, never chosen
    gemma = tiny_model("gemma3")
    g_art = calibrate(gemma, _batches(), method="default", progress=False)
    g = check_layers(gemma, g_art, long, num_sinks=2, window=8, progress=False, factor=0.0, floor=0.0, max_layers=4)
    slides = set(g_art.sliding_windows)
    assert slides and all((e is None) == (i in slides) for i, e in enumerate(g.calibration["check_relative_error"]))
    assert g.bf16_layers and not set(g.bf16_layers) & slides


def test_round_trip_pages_quantizes_whole_pages_per_channel():
    from oscar_compile.calibration.clipping import round_trip_pages

    x = torch.randn(2, 3, 75, 16, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.1, 4, 16)
    y = round_trip_pages(x, 16, start=5)  # pages [5, 21), ..., [53, 69); tokens 0-4 and 69-74 exact
    assert torch.equal(y[..., :5, :], x[..., :5, :]) and torch.equal(y[..., 69:, :], x[..., 69:, :])
    pages = x[..., 5:69, :].unflatten(-2, (4, 16))
    lo, hi = pages.amin(-2, keepdim=True), pages.amax(-2, keepdim=True)
    got = y[..., 5:69, :].unflatten(-2, (4, 16))
    # four levels a channel a page: every element within half a step (plus fp16 rounding of scale and min)
    step = (hi - lo) / 3
    assert ((got - pages).abs() <= step / 2 + 1e-2 * (hi - lo) + 1e-3).all()
    assert all(got[..., c].unique().numel() <= 4 * 2 * 3 * 4 for c in range(16))  # per (row, head, page): 4 levels
    assert (got - pages).abs().max() > 0  # really quantized
    assert torch.equal(round_trip_pages(x[..., :20, :], 16, start=5), x[..., :20, :])  # no whole page yet


def test_method_names():
    assert parse_method("default").name == "oscar+kmean+vauto+scale"
    assert parse_method("oscar+mean+scale").name == "oscar+mean+scale"
    assert parse_method("oscar+vauto").name == "oscar+vauto" and parse_method("oscar+kmean+vmean").name == "oscar+mean"
    assert parse_method("oscar").clip_search and not parse_method("hadamard").clip_search
    assert parse_method("hadamard+clip").name == "hadamard+clip"
    assert parse_method("oscar-clip").name == "oscar-clip"
    with pytest.raises(ValueError, match="base must be"):
        parse_method("rotate")
    with pytest.raises(ValueError, match="needs the oscar eigenbasis"):
        parse_method("hadamard+scale")


def _batches(n=4, b=2, t=24):
    return [torch.randint(3, 90, (b, t), generator=torch.Generator().manual_seed(i)) for i in range(n)]


@pytest.mark.parametrize("family", FAMILIES + ("qwen2-window", "gemma3"))  # 24-token batches pass the window (8)
def test_calibrate_each_family_and_compile_with_the_artifact(family, tmp_path):
    model = tiny_model(family)
    art = calibrate(model, _batches(), method="default", progress=False, data_description="random tokens")
    assert len(art.layers) == model.config.num_hidden_layers and art.calibration["tokens"] == 3 * 2 * 24
    # the induction scores of every KV head (random weights: rarely a retrieval head), in a batch its positions hold
    scores = art.calibration["induction_scores"]
    assert art.has_retrieval_heads and len(scores) == len(art.layers) and all(0 <= x <= 1 for s in scores for x in s)
    for k_clip, v_clip in art.clip_ratios:
        assert 0 < k_clip <= 1 and 0 < v_clip <= 1
    art.save(tmp_path)
    again = load_artifacts(tmp_path)
    again.validate(model)
    # pages of 4: the 24-token prompt reaches INT2 pages (the default per-channel pages of 32 would not fill)
    backend = oscar_compile.oscar_backend(again, inductor=False, num_sinks=1, window=2, page_size=4)
    logits = prefill_and_decode(torch.compile(model, backend=backend), _batches(1)[0], make_hf_cache("oscar", model, 40, 2), 3)
    assert torch.isfinite(logits).all()
    assert all(len(g.rewritten) == model.config.num_hidden_layers for g in backend.graphs)


def test_position_offsets_spread_rows_over_the_served_range():
    from oscar_compile.calibration.tracer import position_offsets

    off = position_offsets(0, 64, 512, 32768)
    assert off[0] == 0 and off.min() >= 0 and off.max() <= 32768 - 512
    assert len(set(off.tolist())) == 64  # every row somewhere else
    hist = torch.histc(off.double(), bins=4, min=0, max=32768 - 512)
    assert hist.min() >= 12  # evenly spread (golden-ratio sequence), not clustered: 16 a quarter, +-4
    # batch after batch continues the same sequence
    parts = torch.cat([position_offsets(0, 3, 512, 32768), position_offsets(3, 5, 512, 32768)])
    assert torch.equal(parts, position_offsets(0, 8, 512, 32768))
    assert torch.equal(position_offsets(0, 4, 512, 512), torch.zeros(4, dtype=torch.long))


def test_calibration_rows_run_at_spread_positions_through_the_models_rope():
    # The rows are moved by position_ids only: values (no RoPE) are the same tensors, keys and queries are turned
    # by RoPE (same norms, so the same traces, different second-moment matrices); nothing else changes.
    from oscar_compile.calibration import collect_statistics

    model = tiny_model("llama")
    batches = _batches()
    at0 = collect_statistics(model, batches, position_range=None, progress=False)
    spread = collect_statistics(model, batches, position_range=256, progress=False)
    auto = collect_statistics(model, batches, progress=False)
    assert at0.info["position_range"] is None and spread.info["position_range"] == 256
    assert auto.info["position_range"] == model.config.max_position_embeddings == 256
    a, b = at0.observer.layers[0], spread.observer.layers[0]
    assert torch.equal(a.value_moment, b.value_moment) and torch.equal(a.value_sum, b.value_sum)
    # float32 RoPE at other angles: norms agree to rounding
    trace = lambda m: torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)  # noqa: E731
    torch.testing.assert_close(trace(b.key_moment), trace(a.key_moment), rtol=1e-5, atol=0)
    torch.testing.assert_close(trace(b.query_moment), trace(a.query_moment), rtol=1e-5, atol=0)
    assert (b.key_moment - a.key_moment).abs().max() > 1e-2 * a.key_moment.abs().max()
    # a forward of one's own need not take position_ids: "auto" leaves its rows at position 0
    own = collect_statistics(model, batches, forward=lambda m, x: m(x), progress=False)
    assert own.info["position_range"] is None
    with pytest.raises(ValueError, match="shorter than a calibration sequence"):
        collect_statistics(model, batches, position_range=8, progress=False)


def test_artifact_calibrated_at_position_0_only_warns_on_load(tmp_path):
    art = calibrate(tiny_model("llama"), _batches(), progress=False)
    art.save(tmp_path)
    load_artifacts(tmp_path)  # this version's artifacts: no warning (pytest would show it; checked below)
    manifest = json.loads((tmp_path / "oscar.json").read_text())
    del manifest["calibration"]["position_range"]  # as written before the rows were spread
    (tmp_path / "oscar.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="Recalibrate"):
        load_artifacts(tmp_path)


def test_calibrate_hand_written_decoder(caplog):
    model = TinyDecoder()
    art = calibrate(model, _batches(), forward=lambda m, x: m(x, torch.arange(x.shape[1])), progress=False)
    assert len(art.layers) == 2 and art.fingerprint["num_kv_heads"] == 2 and art.fingerprint["head_dim"] == 16
    # no vocabulary to draw random tokens from: no retrieval heads (every head INT2), and it says so
    assert not art.has_retrieval_heads and "tells no vocabulary size" in caplog.text


def test_calibrate_sequence_major_cache_equals_head_major():
    # the same model with [B, L, H, d] buffers: the tracer sees the same keys and values (transposed back)
    arts = [calibrate(TinyDecoder(layout=layout, write="index_copy"), _batches(), progress=False,
                      forward=lambda m, x: m(x, torch.arange(x.shape[1]), 0)) for layout in ("head", "seq")]
    assert len(arts[1].layers) == 2
    for a, b in zip(arts[0].layers, arts[1].layers):
        for name in a._tensor_names():
            torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-5, atol=1e-6)
        assert (a.key_clip, a.value_clip) == (b.key_clip, b.value_clip)


def test_calibration_is_deterministic():
    model = tiny_model("qwen2")
    a = calibrate(model, _batches(), progress=False)
    b = calibrate(model, _batches(), progress=False)
    for ta, tb in zip(a.layers, b.layers):
        assert torch.equal(ta.key_transform, tb.key_transform) and ta.key_clip == tb.key_clip


def test_sign_pattern_and_clip_chosen_by_held_out_error():
    # Equivalent eigenvector sign patterns quantize differently (Gemma 3 at 8K: +3.6% to +20% perplexity): each
    # layer keeps, for keys and for values, the pattern whose best clip ratio has the least held-out error
    from oscar_compile.calibration import collect_statistics, derive_artifacts
    from oscar_compile.calibration.tracer import SIGN_TRIALS

    stats = collect_statistics(tiny_model("qwen2"), _batches(), progress=False)
    art = derive_artifacts(stats, "default")
    obs, spec = stats.observer, parse_method("default")
    assert len(art.calibration["sign_seeds"]) == len(art.layers) == len(art.calibration["value_centred"])
    for layer, (key_seed, value_seed) in enumerate(art.calibration["sign_seeds"]):
        h = obs.heldout[layer]
        centred = art.calibration["value_centred"][layer]
        trial = {(s, c): derive_transforms(obs.layers[layer], dataclasses.replace(spec, value_mean=c), s, s)
                 for s in range(SIGN_TRIALS) for c in (True, False)}
        errs = {t: search_clip(h.q, h.k, h.v, tr, None, obs.skip_first)[2] for t, tr in trial.items()}
        assert key_seed == min(range(SIGN_TRIALS), key=lambda s: (min(errs[s, True]["key_error"].values()), s))
        best_value = min(min(e["value_error"].values()) for e in errs.values())  # over signs and centring
        assert min(errs[value_seed, centred]["value_error"].values()) == best_value
        chosen = art.layers[layer]
        assert torch.equal(chosen.key_transform, trial[key_seed, True].key_transform)
        assert torch.equal(chosen.value_transform, trial[value_seed, centred].value_transform)
        assert torch.equal(chosen.value_mean, trial[value_seed, centred].value_mean)


def _secondary_sinks_stats(sinks: bool, seed: int = 0):
    """Statistics of one synthetic layer whose values have a shared mean; with ``sinks``, every 8th token attracts a
    large share of the attention (its key leans the way the queries do) and has a small value, the same one each
    time: the attention-sink tokens away from the start of real text (SmolLM2's " the" in layers 3-10: values of
    norm 0.6-1.1 against a median of 4.5, cosine 0.97-0.99 between occurrences)."""
    from oscar_compile.calibration.tracer import CalibrationStats

    g = torch.Generator().manual_seed(seed)
    h, hq, t, d = 1, 2, 128, 32
    obs = StatsObserver(skip_first=1, heldout_tokens=10**6)
    mean_v, direction, sink_v = 0.5 * torch.randn(d, generator=g), torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)
    for phase in ("stats", "stats", "heldout"):
        obs.phase = phase
        q = torch.randn(1, hq, t, d, generator=g) + 0.7 * direction
        k = torch.randn(1, h, t, d, generator=g)
        v = mean_v + torch.randn(1, h, t, d, generator=g)
        if sinks:
            at = torch.arange(5, t, 8)
            k[:, :, at] += 0.7 * direction
            v[:, :, at] = sink_v + 0.02 * torch.randn(1, h, len(at), d, generator=g)
        obs.record(0, q, k, v, torch.arange(t))
    return CalibrationStats(obs, {}, {})


@pytest.mark.parametrize("sinks", [True, False])
def test_vauto_stores_values_uncentred_where_sink_tokens_make_centring_worse(sinks):
    from oscar_compile.calibration import derive_artifacts
    from oscar_compile.calibration.clipping import relative_errors

    stats = _secondary_sinks_stats(sinks)
    # a fixed rotation (Hadamard), so that only the centring differs between the three
    auto = derive_artifacts(stats, "hadamard+kmean+vauto+clip")
    centred = derive_artifacts(stats, "hadamard+mean+clip")
    uncentred = derive_artifacts(stats, "hadamard+kmean+clip")
    # centring turns the sinks' small, repeated value into a row of about the mean's size whose INT2 error is the
    # same at every occurrence, so their weight adds it up in every output (0.40 against 0.23 here); without sinks,
    # centring takes the shared mean out of every row (0.16 against 0.19)
    assert auto.calibration["value_centred"] == [not sinks]
    h = stats.observer.heldout[0]
    value_err = {name: relative_errors(h.q, h.k, h.v, a.layers[0], None, 1)[1]
                 for name, a in (("auto", auto), ("centred", centred), ("uncentred", uncentred))}
    better, worse = ("uncentred", "centred") if sinks else ("centred", "uncentred")
    assert value_err["auto"] == value_err[better] < 0.9 * value_err[worse], value_err


def test_vauto_needs_the_held_out_search():
    with pytest.raises(ValueError, match="needs the held-out search"):
        parse_method("hadamard+vauto")
    assert parse_method("hadamard+vauto+clip").value_mean == "auto"


def test_artifact_errors_name_the_problem(tmp_path):
    model = tiny_model("llama")
    art = calibrate(model, _batches(), method="oscar+mean", progress=False)
    d = art.save(tmp_path / "a")
    loaded = load_artifacts(d)
    assert loaded.method == "oscar+mean" and loaded.clip_ratios == art.clip_ratios
    for x, y in zip(loaded.layers, art.layers):
        assert torch.equal(x.key_transform, y.key_transform) and torch.equal(x.value_mean, y.value_mean)

    with pytest.raises(ArtifactError, match="missing"):
        load_artifacts(tmp_path / "nowhere")
    manifest = json.loads((d / "oscar.json").read_text())
    (d / "oscar.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ArtifactError, match="format version 99"):
        load_artifacts(d)
    (d / "oscar.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_artifacts(d)
    (d / "oscar.json").write_text(json.dumps(manifest))
    raw = bytearray((d / "oscar.safetensors").read_bytes())
    raw[-5] ^= 0xFF
    (d / "oscar.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="does not match its manifest"):
        load_artifacts(d)

    other = tiny_model("llama", seed=1)  # same shapes, other weights
    with pytest.raises(ArtifactError, match="attention weights differ"):
        art.validate(other)
    with pytest.raises(ArtifactError, match="attention weights differ"):
        oscar_compile.compile(other, art)
    other_shape = tiny_model("gpt2")  # 4 KV heads, not 2
    with pytest.raises(ArtifactError, match="KV heads of dim"):
        art.layer_transforms(0, 2, 32)
    backend = oscar_compile.oscar_backend(art, inductor=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="4 KV heads of dim 16, the artifact was made for 2"):
        prefill_and_decode(torch.compile(other_shape, backend=backend), _batches(1)[0],
                           make_hf_cache("oscar", other_shape, 40, 2), 1)


def test_cli_calibrate(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    rc = cli_main(["calibrate", "--model", "tiny:llama", "--data", str(data), "--tokens", "256", "--seq-len", "32",
                   "--batch-size", "2", "--method", "oscar", "--check-len", "96", "--sinks", "2", "--window", "8",
                   "--out", str(tmp_path / "art")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "layer  key clip  value clip" in out and "wrote" in out and "long-context check on 192 tokens" in out
    art = load_artifacts(tmp_path / "art")
    assert art.method == "oscar" and art.calibration["tokens"] == 256
    assert len(art.calibration["check_relative_error"]) == 2 and art.calibration["check_seq_len"] == 96
    short = tmp_path / "short.txt"
    short.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    with pytest.raises(SystemExit, match="--check-len 0 skips it"):  # too little text for the default check
        cli_main(["calibrate", "--model", "tiny:llama", "--data", str(short), "--tokens", "256", "--seq-len", "32",
                  "--batch-size", "2", "--out", str(tmp_path / "art2")])


def test_text_arguments_and_disjoint_evaluation(tmp_path):
    from oscar_compile.cli import overlapping, read_text_arg

    f = tmp_path / "mine.txt"
    f.write_text("a user's own evaluation text. " * 50)
    assert read_text_arg(str(f), "--text") == (f.read_text(), "mine.txt")
    with pytest.raises(SystemExit, match="neither a file nor one of"):
        read_text_arg(str(tmp_path / "missing.txt"), "oscar eval: --text")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(SystemExit, match="is empty"):
        read_text_arg(str(tmp_path / "empty.txt"), "oscar eval: --text")
    calib = "".join(f"sentence {i} of the calibration corpus. " for i in range(400))
    assert overlapping(calib[5000:9000], "prefix " + calib + " suffix")  # a piece of it
    assert not overlapping("".join(f"other text {i}. " for i in range(400)), calib)


def test_cached_artifacts_with_a_long_context_check(tmp_path, monkeypatch):
    # the eval's artifacts: calibrated once, checked on the calibration text past the calibration tokens, the checked
    # copy cached apart (the unchecked one stays as it was), and loaded from the cache the second time
    import types

    import oscar_compile.assets as assets
    import oscar_compile.demo as demo

    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "calibration_text_name", lambda: "synthetic")
    stream = torch.randint(3, 90, (6500,), generator=torch.Generator().manual_seed(3))  # 3 batches of 2048, a check
    monkeypatch.setattr(assets, "load_text", lambda name: "unused")
    tok = lambda text, return_tensors: types.SimpleNamespace(input_ids=stream[None])  # noqa: E731
    model = tiny_model("llama")
    kw = dict(seq_len=64, check_len=96, check_seqs=2, num_sinks=2, window=8, progress=False)
    found, cached = demo.cached_artifacts_for(model, tok, "tiny", ["default"], 4096, **kw)
    art = found["default"]
    assert not cached and len(art.calibration["check_relative_error"]) == 2 and art.calibration["check_tokens"] == 192
    names = sorted(p.name for p in (tmp_path / "artifacts").iterdir())
    # rows spread over the tiny model's 256 positions ("auto"), so the names say so
    # "-kc32": checked with keys per channel over pages of 32 (the backend's default)
    assert names == ["tiny-oscar+kmean+vauto+scale-4096-s64-p256", "tiny-oscar+kmean+vauto+scale-4096-s64-p256-c96x2-sw2_8-kc32r"]
    again, cached = demo.cached_artifacts_for(model, tok, "tiny", ["default"], 4096, **kw)
    assert cached == {"default"} and again["default"].calibration["check_relative_error"] == art.calibration["check_relative_error"]
    # the checked artifact alone (the GPU machine's, carried from here) loads without its unchecked parent, which is
    # neither needed nor recalibrated
    import shutil

    shutil.rmtree(tmp_path / "artifacts" / names[0])
    alone, cached = demo.cached_artifacts_for(model, tok, "tiny", ["default"], 4096, **kw)
    assert cached == {"default"} and alone["default"].calibration["check_tokens"] == 192
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == names[1:]
    with pytest.raises(ValueError, match="too few for a check"):
        demo.cached_artifacts_for(model, tok, "tiny", ["default"], 4096, **dict(kw, check_len=4000))


def test_retrieval_heads_are_measured_saved_and_kept_exact_by_the_backend(tmp_path, monkeypatch):
    # induction scores are attention masses (in [0, 1], one per layer and KV head); with a planted induction head
    # (layer 1's KV head 0 at 0.9, the rest near 0) with_retrieval_heads records the scores and picks it, the artifact
    # keeps it through save/load, and exact_heads="auto" splits that layer's storage
    from oscar_compile.calibration import induction_scores, with_retrieval_heads
    from oscar_compile.calibration.retrieval_heads import SPAN

    model = tiny_model("llama")
    art = calibrate(model, _batches(), method="default", progress=False, data_description="random tokens",
                    retrieval_heads=False)
    scores = induction_scores(model, 97, 1, span=8, rows=2)
    assert len(scores) == 2 and all(len(s) == 2 and all(0 <= x <= 1 for x in s) for s in scores)
    import oscar_compile.calibration.retrieval_heads as rh

    monkeypatch.setattr(rh, "induction_scores", lambda *a, **k: [[0.01, 0.02], [0.9, 0.03]])  # the planted head
    planted = with_retrieval_heads(model, art)
    # the span that fits the model's 256 positions twice, after the BOS token
    assert planted.retrieval_heads == {1: (0,)} and planted.calibration["retrieval_head_rule"]["span"] == min(SPAN, 127)
    planted.save(tmp_path)
    again = load_artifacts(tmp_path)
    assert again.retrieval_heads == {1: (0,)} and again.has_retrieval_heads and not art.has_retrieval_heads
    backend = oscar_compile.oscar_backend(again, inductor=False, num_sinks=1, window=2, page_size=4, exact_heads="auto")
    logits = prefill_and_decode(torch.compile(model, backend=backend), _batches(1)[0], make_hf_cache("oscar", model, 40, 2), 3)
    assert torch.isfinite(logits).all()
    split = {key[0][1]: c.exact.exact_heads if c.exact else None for key, c in backend.storage.items()}
    assert split == {0: None, 1: (0,)}
    assert "layer 1 head 0 (0.90)" in again.summary()
