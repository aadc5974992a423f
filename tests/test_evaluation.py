import copy
import math
import random
from dataclasses import replace

import pytest
import torch

from oscar_compile.baselines import KiviCache, KiviLayer, kivi_bits_per_element
from oscar_compile.evaluation import (
    paired_delta,
    EvalConfig,
    Method,
    Session,
    bits_per_element,
    format_report,
    retrieval_vs_bf16,
    make_retrieval_prompt,
    perplexity_nll,
    plot_report,
    retrieve,
    token_nll,
)
from oscar_compile.testing import cache_kwarg, make_hf_cache, tiny_model


def test_kivi_layer_keeps_the_residual_and_quantizes_keys_in_token_groups():
    layer = KiviLayer(group=4, residual=6)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 13, 8, generator=gen), torch.randn(1, 2, 13, 8, generator=gen)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)  # this call's tokens are read exactly
    assert layer.k_q.shape[-2] == 4 and layer.k_fp.shape[-2] == 9  # 13 = 4 quantized + 9 (< 6 + 4 ... after flushes)
    assert layer.v_q.shape[-2] == 7 and layer.v_fp.shape[-2] == 6
    k1, v1 = torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen)
    keys, values = layer.update(k1, v1)
    assert keys.shape[-2] == 14 and torch.equal(keys[:, :, -1:], k1)
    # history: the quantized keys changed (2-bit per channel over 4 tokens), the residual did not
    assert not torch.equal(keys[:, :, :4], k[:, :, :4]) and torch.equal(keys[:, :, 4:13], k[:, :, 4:13])
    err = (keys[:, :, :4] - k[:, :, :4]).abs()
    rng = k[:, :, :4].amax(-2, keepdim=True) - k[:, :, :4].amin(-2, keepdim=True)
    assert (err <= rng / 6 + 1e-2).all()  # per-channel group: half a step of (max - min) / 3 (fp16 meta)


def test_kivi_cache_with_a_large_residual_is_exact():
    model = tiny_model("llama")
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    kw = cache_kwarg(model)
    with torch.no_grad():
        ref = model(ids, **{kw: make_hf_cache("dynamic", model, 32, 2)}).logits
        got = model(ids, **{kw: KiviCache(model.config, group=32, residual=128)}).logits
    torch.testing.assert_close(got, ref)
    assert 2.9 < kivi_bits_per_element(1 << 17, 64) < 3.05


def _teacher_forced_reference(model, tokens, context):
    """Direct computation: the same predictions with the uncompiled model and a DynamicCache."""
    kw = cache_kwarg(model)
    cache = make_hf_cache("dynamic", model, tokens.shape[1], tokens.shape[0])
    nll = 0.0
    with torch.no_grad():
        model(tokens[:, :context], **{kw: cache})
        for p in range(context, tokens.shape[1] - 1):
            logits = model(tokens[:, p : p + 1], **{kw: cache}).logits[:, -1]
            nll += torch.nn.functional.cross_entropy(logits, tokens[:, p + 1], reduction="sum").item()
    return nll


def test_teacher_forced_perplexity_matches_a_direct_computation():
    model = tiny_model("qwen2")
    tokens = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(1))
    s = Session(model, Method("bf16", "bf16"), 2, 30, num_sinks=2, window=4, cache_dtype=torch.float32)
    nll, n = perplexity_nll(s, tokens, 20)
    assert n == 2 * 9
    assert math.isclose(nll, _teacher_forced_reference(model, tokens, 20), rel_tol=1e-4)
    # pages of 4: the default per-channel keys quantize whole pages, and pages of 32 would not fill in 30 tokens
    s = Session(model, Method("int2", "oscar", None, {"rotation": "hadamard", "page_size": 4}), 2, 30, num_sinks=2,
                window=4, cache_dtype=torch.float32)
    nll_q, _ = perplexity_nll(s, tokens, 20)
    assert nll_q != nll  # the scored steps read INT2 history


def test_chunked_prefill_scores_like_one_prefill():
    # a 20-token context fed in chunks of 7 (7 + 7 + 6): with quantization off the cache holds the same
    # K/V, so every scored step matches the single-call prefill to fp32 rounding
    model = tiny_model("llama")
    tokens = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(2))
    whole = Session(model, Method("bf16", "bf16"), 2, 30, num_sinks=2, window=4, cache_dtype=torch.float32)
    chunked = Session(model, Method("bf16", "bf16"), 2, 30, num_sinks=2, window=4, cache_dtype=torch.float32,
                      prefill_chunk=7)
    a, b = token_nll(whole, tokens, 20), token_nll(chunked, tokens, 20)
    assert a.shape == (2, 9) and torch.allclose(a, b, atol=1e-5)


class _CharTokenizer:
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        ids = [3 + (ord(c) % 90) for c in text]

        class Out:
            input_ids = torch.tensor([ids]) if return_tensors == "pt" else ids

        return Out()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_retrieval_prompt_places_the_needle_at_the_depth():
    tok = _CharTokenizer()
    hay = "".join(random.Random(0).choice("abcdefgh ") for _ in range(20000))
    where = {}
    for depth in (0.0, 0.5, 1.0):
        p = make_retrieval_prompt(tok, hay, "passkey", 600, depth, random.Random(3))
        ids = p.context_ids[0].tolist()
        assert len(ids) + p.question_ids.shape[1] == 600
        needle = tok(f" The pass key is {p.answer}. Remember it. {p.answer} is the pass key. ").input_ids
        where[depth] = next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)
    assert where[1.0] == len(ids) - len(needle)  # at the end of the haystack
    hay_len = where[1.0] - where[0.0]
    assert abs(where[0.5] - where[0.0] - 0.5 * hay_len) <= 1


def test_retrieve_runs_the_question_through_decode_steps():
    model = tiny_model("llama")
    tok = _CharTokenizer()
    p = make_retrieval_prompt(tok, "xyz " * 3000, "needle", 300, 0.5, random.Random(0))
    s = Session(model, Method("bf16", "bf16"), 1, 310, num_sinks=2, window=4)
    ok, text, nll = retrieve(s, p, tok, max_new=4)
    assert isinstance(ok, bool) and len(text) == 4 and nll > 0


def test_retrieval_answer_nll_matches_a_full_forward_on_both_paths():
    """The answer's NLL through the session (BF16 cache, the question as decode steps) equals the model's own forward
    over prompt + answer, both where greedy spells the answer (read off its steps) and where it does not (the answer
    is fed after asking again). float32 throughout: only summation order differs, hence 1e-4 relative."""
    model = tiny_model("llama")
    tok = _CharTokenizer()
    p = make_retrieval_prompt(tok, "xyz abc " * 1500, "needle", 300, 0.5, random.Random(0))
    s = Session(model, Method("bf16", "bf16"), 1, 320, num_sinks=2, window=4)

    def full_forward_nll(answer_ids):
        ids = torch.cat([p.context_ids, p.question_ids, answer_ids], 1)
        with torch.no_grad():
            logits = model(ids).logits[0, -answer_ids.shape[1] - 1:-1].float()
        return torch.nn.functional.cross_entropy(logits, answer_ids[0], reduction="sum").item()

    _, text, _ = retrieve(s, replace(p, answer_ids=None), tok, max_new=3)
    greedy = torch.tensor([[ord(c) for c in text[:2]]])  # the char tokenizer's decode is chr(id)
    wrong = (greedy + 1) % 90 + 3
    for answer_ids in (greedy, wrong):
        s.restart()
        _, got_text, nll = retrieve(s, replace(p, answer_ids=answer_ids), tok, max_new=3)
        assert got_text == text  # the greedy answer does not depend on the scored one
        assert nll == pytest.approx(full_forward_nll(answer_ids), rel=1e-4)


def test_answer_nll_delta_pairs_prompts():
    from oscar_compile.evaluation import answer_nll_delta

    gen = torch.Generator().manual_seed(0)
    bf = (torch.rand(40, generator=gen, dtype=torch.float64) * 2).tolist()
    worse = [b + 0.3 + 0.05 * float(torch.randn(1, generator=gen)) for b in bf]  # 0.3 nats less likely, tightly
    d = answer_nll_delta(list(zip(worse, bf)))
    assert d["prompts"] == 40 and d["delta_nats"] == pytest.approx(0.3, abs=0.03)
    assert 0.2 < d["ci95_nats"][0] < 0.3 < d["ci95_nats"][1] < 0.4 and d["p_answer"] < d["p_answer_bf16"]


def test_bits_and_report(tmp_path):
    model = tiny_model("llama")
    bf = bits_per_element(model.config, Method("bf16", "bf16"), 4096, 64, 256)
    # the backend's default key format: keys per channel over pages of 32 (2 + 32/32 bits), values per token in one
    # group a row (head_dim 16: 2 + 32/16 bits), plus the BF16 sinks/window share
    default = bits_per_element(model.config, Method("x"), 1 << 17, 64, 256)
    assert bf == 16.0 and 3.5 < default < 3.6
    tok = {"key_format": "token"}  # keys per token as values: 2 + 32/16 bits for both
    int2 = bits_per_element(model.config, Method("x", options=tok), 1 << 17, 64, 256)
    assert 4.0 < int2 < 4.1
    # a layer kept in BF16 (bf16_layers) holds every token in 16 bits
    layers = model.config.num_hidden_layers
    one_dense = bits_per_element(model.config, Method("x", options={"bf16_layers": (0,), **tok}), 1 << 17, 64, 256)
    assert math.isclose(one_dense, (int2 * (layers - 1) + 16) / layers)
    # a retrieval head in BF16 (exact_heads): one of layer 0's 2 KV heads holds every token in 16 bits
    one_head = bits_per_element(model.config, Method("x", options={"exact_heads": {0: [1]}, **tok}), 1 << 17, 64, 256)
    assert math.isclose(one_head, (int2 * (layers - 1) + (int2 + 16) / 2) / layers)
    # ... or in FP8 (exact_format="fp8"): its 64 sinks in 16 bits, the rest in 8 + 32/16 (a scale a row of 16)
    fp8 = {"exact_heads": {0: [1]}, "exact_format": "fp8", **tok}
    one_fp8 = bits_per_element(model.config, Method("x", options=fp8), 1 << 17, 64, 256)
    head_fp8 = (64 * 16 + ((1 << 17) - 64) * 10) / (1 << 17)
    assert math.isclose(one_fp8, (int2 * (layers - 1) + (int2 + head_fp8) / 2) / layers) and one_fp8 < one_head
    # the INT2 layers' rings in FP8 (ring_format="fp8"): the window's 256 tokens (per-token keys: the ring is the
    # window) in 8 + 32/16 bits instead of 16, the 64 sinks still 16; at 4K, where they are 8% of the tokens
    ring8 = bits_per_element(model.config, Method("x", options={"ring_format": "fp8", **tok}), 4096, 64, 256)
    ring16 = bits_per_element(model.config, Method("x", options=tok), 4096, 64, 256)
    assert math.isclose(ring16 - ring8, 256 * (16 - 10) / 4096)
    # a layer with its own group size (layer_group_sizes) counts its own metadata: groups of 4 at head_dim 16 carry
    # 2 x 16 bits per 4 elements, 6 bits more an element than one group a row... unless it is also kept in BF16
    regrouped = bits_per_element(model.config, Method("x", options={"layer_group_sizes": {1: 4}, **tok}), 1 << 17, 64,
                                 256)
    assert math.isclose(regrouped, int2 + 6 * (1 - 320 / (1 << 17)) / layers, rel_tol=1e-6), (regrouped, int2)
    # a layer with its own key format (layer_key_formats) counts its own bits: layer 1 per token among per-channel
    mixed = bits_per_element(model.config, Method("x", options={"layer_key_formats": {1: "token"}}), 1 << 17, 64, 256)
    token_at_32 = bits_per_element(model.config, Method("x", options={"key_format": "token", "page_size": 32}),
                                   1 << 17, 64, 256)
    assert math.isclose(mixed, (default * (layers - 1) + token_at_32) / layers, rel_tol=1e-6) and default < mixed
    both = Method("x", options={"layer_group_sizes": {0: 4}, "bf16_layers": (0,), **tok})
    assert math.isclose(bits_per_element(model.config, both, 1 << 17, 64, 256), one_dense)
    # a sliding layer holds its window in BF16, in transformers' cache and in oscar's ring alike (whatever max_chunk)
    cfg = tiny_model("gemma3").config
    full, sliding = len(cfg.layer_types) - 1, 1
    assert cfg.layer_types.count("sliding_attention") == sliding and cfg.sliding_window == 8
    bf = bits_per_element(cfg, Method("bf16", "bf16"), 1000, 64, 256)
    assert math.isclose(bf, (16 * full + 16 * 8 / 1000) / (full + sliding))
    ours = bits_per_element(cfg, Method("x", options={"max_chunk": 100}), 1000, 64, 256)
    dense = copy.deepcopy(cfg)
    dense.sliding_window = None  # every layer full: INT2 pages with sinks and window
    full_bits = bits_per_element(dense, Method("x"), 1000, 64, 256)
    assert math.isclose(ours, (full_bits * full + 16 * 8 / 1000) / (full + sliding))
    assert math.isclose(bits_per_element(cfg, Method("x"), 1000, 64, 256), ours)
    report = {"config": {}, "perplexity": [
        {"method": "bf16", "context": 512, "ppl": 10.0, "nll": 2.3, "bits_per_element": 16.0},
        {"method": "oscar", "context": 512, "ppl": 10.5, "nll": 2.35, "bits_per_element": 2.3}],
        "retrieval": [{"method": "bf16", "task": "passkey", "length": 1024, "depth": 0.5, "correct": True},
                      {"method": "oscar", "task": "passkey", "length": 1024, "depth": 0.5, "correct": False}]}
    text = format_report(report)
    assert "10.500 (+5.0%)" in text and "0/1" in text and "1/1" in text
    plot_report(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert EvalConfig().num_sinks == 64


def test_run_eval_checkpoints_after_every_method():
    from oscar_compile.evaluation import run_eval

    model = tiny_model("llama")
    tok = _CharTokenizer()
    text = "".join(random.Random(1).choice("abcdefgh ") for _ in range(2000))
    cfg = EvalConfig(ppl_contexts=(24,), ppl_decode=4, ppl_sequences=1, retrieval_lengths=(300,),
                     retrieval_depths=(0.5,), retrieval_tasks=("passkey",), num_sinks=2, window=4)
    methods = [Method("bf16", "bf16"), Method("hadamard", "oscar", None, {"rotation": "hadamard"})]
    seen = []
    report = run_eval(model, tok, methods, text, text, cfg, progress=False, log=lambda *a: None,
                      checkpoint=lambda rep: seen.append((len(rep["perplexity"]), len(rep["retrieval"]), rep["partial"],
                                                          "vs_bf16" in rep["perplexity"][-1])))
    # a method's paired difference against bf16 is in the checkpoint right after it (a stopped run keeps it)
    assert seen == [(1, 0, True, False), (2, 0, True, True), (2, 1, True, True), (2, 2, True, True)]
    assert "partial" not in report and [r["method"] for r in report["perplexity"]] == ["bf16", "hadamard"]


def test_retrieval_seed_draws_other_prompts_and_repeats_its_own():
    # runs with other seeds add up to more prompts (`--retrieval-seed`); the same seed asks the same ones, so a
    # later run of one method pairs with an earlier run's BF16
    from oscar_compile.evaluation import run_eval

    model, tok = tiny_model("llama"), _CharTokenizer()
    text = "".join(random.Random(1).choice("abcdefgh ") for _ in range(2000))

    def answers(seed):
        cfg = EvalConfig(ppl_contexts=(), retrieval_lengths=(300,), retrieval_depths=(0.1, 0.5),
                         retrieval_tasks=("passkey",), retrieval_samples=2, num_sinks=2, window=4, seed=seed)
        report = run_eval(model, tok, [Method("bf16", "bf16")], text, text, cfg, progress=False, log=lambda *a: None)
        assert report["config"]["seed"] == seed
        return [r["answer"] for r in report["retrieval"]]

    first = answers(0)
    assert len(first) == 4 and answers(0) == first
    assert not set(answers(1)) & set(first)  # 5-digit passkeys: a shared one would be a 1-in-10^4 coincidence


def test_paired_delta_interval_covers_a_known_shift_and_uses_blocks():
    gen = torch.Generator().manual_seed(0)
    base = torch.rand(8, 64, generator=gen, dtype=torch.float64) * 3
    shifted = base + 0.01 + 0.02 * torch.randn(8, 64, generator=gen, dtype=torch.float64)
    r = paired_delta(shifted, base)
    assert r["blocks"] == 8 * 4 and r["block_tokens"] == 16
    lo, hi = r["ci95_pct"]
    assert lo < 100 * math.expm1(0.01) < hi and hi - lo < 0.5  # a 1% shift, resolved to well under a point
    assert math.isclose(r["pct"], 100 * math.expm1((shifted - base).mean().item()))
    assert "ci95_pct" not in paired_delta(base[:1, :20], base[:1, :20])  # one block: no interval
    with pytest.raises(ValueError, match="same tokens"):
        paired_delta(base, base[:, :10])


def _quantize_off_vs_eager(device, dtype, window, max_chunk, chunk, context, steps):
    from oscar_compile.testing import gemma3_like_model, quantize_off_vs_eager

    return quantize_off_vs_eager(gemma3_like_model(device, dtype, window), context, steps, max_chunk, chunk)


def test_gemma3_geometry_quantize_off_equals_eager_past_the_ring():
    # a ring of the window (32 tokens); 100-token prompt in chunks of 16 (each with the 31 tokens before it from the
    # store), then 20 steps: fp32, reference ops
    assert _quantize_off_vs_eager("cpu", torch.float32, window=32, max_chunk=16, chunk=16, context=100, steps=20) < 1e-4


@pytest.mark.gpu
def test_gemma3_geometry_quantize_off_equals_eager_past_the_ring_gpu():
    # Gemma 3 270M's window (512, the ring), a 6000-token prompt in chunks of 2000 (each with the 511 tokens before
    # it), Triton kernels in bf16. bf16 logits of two different computations: 3e-2. (The H200 eval of the real
    # model gave BF16 perplexity 1225 at 8K where the CPU gives ~40: this is the check that localises it.)
    assert _quantize_off_vs_eager("cuda", torch.bfloat16, window=512, max_chunk=4096, chunk=2000, context=6000,
                                  steps=16) < 3e-2


def test_method_specs_read_sequence_layers_and_positions_per_method():
    from oscar_compile.cli import _method_specs

    names = ["bf16", "default", "default:p0", "default@1024:L0:p2304", "kivi", "default:g32.4-6.9:g16.5", "default:c32",
             "default:c64:d", "default:d0.5"]
    base, seq, positions, layers, groups, options = _method_specs(names, 512, "auto")
    assert base == {n: b for n, b in zip(names, ["bf16", "default", "default", "default", "kivi", "default", "default",
                                                 "default", "default"])}
    # ':c<tokens>': keys per channel over pages of that many tokens; ':d' / ':d<c>': debiased INT2 scores
    assert options["default:c32"] == {"key_format": "channel", "page_size": 32} and options["default"] == {}
    token = _method_specs(["default:t", "default:t:L0"], 512, "auto")[-1]  # ':t': keys per token, pages of 16
    assert token["default:t"] == token["default:t:L0"] == {"key_format": "token", "page_size": 16}
    assert _method_specs(["default:ka"], 512, "auto")[-1]["default:ka"] == {"layer_key_formats": "auto"}
    assert _method_specs(["default:kr"], 512, "auto")[-1]["default:kr"] == {"key_page_clips": "auto"}  # the check's
    assert _method_specs(["default:kf"], 512, "auto")[-1]["default:kf"] == {"key_page_clips": None}  # full ranges
    assert _method_specs(["default:fb:kf"], 512, "auto")[-1]["default:fb:kf"] == {  # keys with error feedback
        "key_feedback": True, "key_page_clips": None}
    # ':nofb': plain rounding, against the default's feedback ("auto"); the baselines' recipes round plainly unless
    # tagged ':fb'
    fed = _method_specs(["default:nofb", "oscar", "identity:fb", "hadamard"], 512, "auto")[-1]
    off = {"exact_heads": None}  # the baselines keep every head INT2
    assert fed == {"default:nofb": {"key_feedback": False}, "oscar": {"key_feedback": False, **off},
                   "identity:fb": {"key_feedback": True, **off}, "hadamard": {"key_feedback": False, **off}}
    exact = _method_specs(["default:xh", "default:noxh", "oscar:xh"], 512, "auto")[-1]
    assert exact == {"default:xh": {"exact_heads": "auto"}, "default:noxh": {"exact_heads": None},
                     "oscar:xh": {"exact_heads": "auto", "key_feedback": False}}
    # ':xh<share>': the retrieval heads re-chosen at that share of the KV heads; a share outside (0, 1] is refused
    assert _method_specs(["default:xh0.125"], 512, "auto")[-1] == {"default:xh0.125": {"exact_heads": 0.125}}
    # ':x8': the retrieval heads' tokens in FP8; ':r8': the INT2 layers' rings in FP8
    assert _method_specs(["default:xh0.125:x8", "default:r8"], 512, "auto")[-1] == {
        "default:xh0.125:x8": {"exact_heads": 0.125, "exact_format": "fp8"}, "default:r8": {"ring_format": "fp8"}}
    for bad in ("default:xh2", "default:xh0", "default:xh:noxh"):
        with pytest.raises(SystemExit, match="xh"):
            _method_specs([bad], 512, "auto")
    assert options["default:c64:d"] == {"key_format": "channel", "page_size": 64, "score_debias": 1.0}
    assert options["default:d0.5"] == {"score_debias": 0.5}
    # ':g<size>.<layers>': layers with their own group size, the later tag winning for a layer named twice
    assert groups["default:g32.4-6.9:g16.5"] == {4: 32, 5: 16, 6: 32, 9: 32} and groups["default"] == {}
    assert seq["default"] == 512 and seq["default@1024:L0:p2304"] == 1024
    # ':p' overrides --calib-positions for its method only; p0 is every row at position 0 (None)
    assert positions["default"] == "auto" and positions["default:p0"] is None
    assert positions["default@1024:L0:p2304"] == 2304 and layers["default@1024:L0:p2304"] == (0,)
    for bad in ("default:p1:p2", "default:x3", "bf16:p0", "default@x", "default:g32", "default:g0.1", "default:gx.1",
                "bf16:g32.1", "default:c1", "default:c32:c64", "default:t:c32", "default:t:t", "kivi:t", "kivi:c32", "default:ka:t", "default:ka:ka", "default:kr:kr", "default:kr:t", "bf16:kr",
                "default:kr:kf", "default:kf:t", "kivi:kf", "default:fb:fb", "default:fb:t", "bf16:fb",
                "default:fb:nofb", "kivi:nofb", "default:x8:x8", "bf16:x8", "default:r8:r8", "bf16:r8", "default:r16",
                "default:cx", "default:d5", "default:d:d", "bf16:d", "default:dx"):
        with pytest.raises(SystemExit):
            _method_specs([bad], 512, "auto")


def test_paired_deltas_between_quantized_methods_on_the_same_tokens():
    from oscar_compile.evaluation import _attach_paired_deltas

    gen = torch.Generator().manual_seed(0)
    bf = torch.rand(8, 64, generator=gen, dtype=torch.float64) * 3
    a = bf + 0.03 + 0.05 * torch.randn(8, 64, generator=gen, dtype=torch.float64)
    b = a + 0.01 + 0.005 * torch.randn(8, 64, generator=gen, dtype=torch.float64)  # b: 1% worse than a, tightly
    per_method = {}
    for name, kind, nll in (("bf16", "bf16", bf), ("a", "oscar", a), ("kivi", "kivi", a + 0.2), ("b", "oscar", b)):
        per_method[name] = (kind, nll, {"method": name, "context": 64})
        _attach_paired_deltas(per_method)  # as run_eval does, after every method
    rows = {n: r for n, (_, _, r) in per_method.items()}
    assert "vs_methods" not in rows["bf16"] and rows["a"]["vs_methods"] == {}
    assert list(rows["b"]["vs_methods"]) == ["a", "kivi"]  # only those measured before it, bf16 apart
    lo, hi = rows["b"]["vs_methods"]["a"]["ci95_pct"]
    assert lo < 100 * math.expm1(0.01) < hi and hi - lo < 0.3  # tighter than b vs bf16, which a's noise widens
    wide = rows["b"]["vs_bf16"]["ci95_pct"]
    assert wide[1] - wide[0] > 3 * (hi - lo)
    report = {"config": {}, "retrieval": [], "perplexity": [dict(r, ppl=2.0, nll=0.7, bits_per_element=3.0)
                                                             for r in rows.values()]}
    assert "b vs a: +1.0" in format_report(report)


def test_retrieval_against_bf16_pairs_the_same_prompts():
    # 10 prompts of one length: bf16 answers 0-5; "a" answers 0-2 and 8 (lost 3, gained 1: p = 2 * 5/16 = 0.625);
    # "b" answers exactly what bf16 does (lost 0, gained 0, p 1); "c" ran other prompts (answers differ): not paired
    def rows(method, right, answers=range(10)):
        return [{"method": method, "task": "passkey", "length": 1024, "depth": 0.5, "answer": str(a),
                 "correct": i in right} for i, a in enumerate(answers)]

    ret = rows("bf16", range(6)) + rows("a", (0, 1, 2, 8)) + rows("b", range(6)) + rows("c", (0,), range(10, 20))
    got = {d["method"]: d for d in retrieval_vs_bf16(ret)}
    assert set(got) == {"a", "b"}
    assert (got["a"]["lost"], got["a"]["gained"], got["a"]["prompts"]) == (3, 1, 10)
    assert abs(got["a"]["p"] - 0.625) < 1e-12 and got["b"]["lost"] == got["b"]["gained"] == 0 and got["b"]["p"] == 1.0
    text = format_report({"config": {}, "perplexity": [], "retrieval": ret})
    assert "lost 3, gained 1 of 10 (p 0.62)" in text and "lost 0, gained 0 of 10 (p 1.00)" in text
