"""exact_heads: a layer's retrieval heads in a BF16 companion, the others in INT2, through the compiled model."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from oscar_compile import oscar_backend
from oscar_compile.backend import BackendOptions, resolve_exact_heads
from oscar_compile.cache import PagedInt2KVCache
from oscar_compile.calibration.retrieval_heads import induction_batch, select_retrieval_heads
from oscar_compile.testing import make_hf_cache, prefill_and_decode, rel_error

OPTS = dict(num_sinks=2, window=3, page_size=4, inductor=False)  # short sequences still reach the INT2 pages
STEPS = 6


def _one_layer_model(silenced_heads=(), head_dim=16):
    """One attention layer (6 query heads, 2 KV heads: query heads 0-2 read KV head 0, 3-5 KV head 1) whose output
    projection ignores ``silenced_heads`` (query heads): the logits then see only the other heads' attention."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=6 * head_dim, intermediate_size=192, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        w = model.model.layers[0].self_attn.o_proj.weight  # [hidden, heads x head_dim]
        for h in silenced_heads:
            w[:, h * head_dim:(h + 1) * head_dim] = 0
    return model


def _ids(device="cpu"):
    """The prompts every test here runs: 2 rows of 13 tokens, the same each call."""
    return torch.randint(3, 97, (2, 13), generator=torch.Generator().manual_seed(0)).to(device)


def _run(model, **options):
    torch._dynamo.reset()
    ids = _ids(model.device)
    backend = oscar_backend(**OPTS, **options)
    out = prefill_and_decode(torch.compile(model, backend=backend), ids, make_hf_cache("oscar", model, 32, 2), STEPS)
    return out, backend


def test_exact_head_reads_bf16_and_int2_head_reads_int2():
    # KV head 1 exact. Seen through KV head 1 only (query heads 0-2 silenced), the logits are BF16's; seen through
    # KV head 0 only, they are the all-INT2 run's (INT2 rounds each head on its own: same codes either way).
    # fp32 model, fp32 rows: only summation order differs (1e-4)
    through_exact = _one_layer_model(silenced_heads=(0, 1, 2))
    exact = prefill_and_decode(through_exact, _ids(), make_hf_cache("dynamic", through_exact, 32, 2), STEPS)
    split, backend = _run(through_exact, exact_heads={0: [1]})
    (cache,) = backend.storage.values()
    assert cache.num_kv_heads == 1 and cache.exact.exact_heads == (1,) and not cache.exact.cache.quantize
    assert cache.nbytes > sum(t.numel() * t.element_size() for t in cache.layers[0].tensors())  # counts the companion
    all_int2, _ = _run(through_exact)
    torch.testing.assert_close(split, exact, rtol=1e-4, atol=1e-4)
    assert rel_error(all_int2, exact) > 1e-3  # INT2 really changes that head

    through_int2 = _one_layer_model(silenced_heads=(3, 4, 5))
    split, _ = _run(through_int2, exact_heads={0: [1]})
    all_int2, _ = _run(through_int2)
    torch.testing.assert_close(split, all_int2, rtol=1e-4, atol=1e-4)


def test_every_head_exact_is_a_bf16_layer():
    model = _one_layer_model()
    exact = prefill_and_decode(model, _ids(), make_hf_cache("dynamic", model, 32, 2), STEPS)
    got, backend = _run(model, exact_heads={0: [0, 1]})
    (cache,) = backend.storage.values()
    assert not cache.quantize and cache.exact is None
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("whole_layer", [False, True], ids=["companion", "whole-layer"])
def test_exact_heads_in_fp8_hold_their_tokens_in_fp8_rows(whole_layer, device):
    # exact_format="fp8": the exact heads' ring (every token after the sinks) in FP8 rows with a scale each, whether
    # they sit in a companion beside INT2 heads or make up the whole layer. Seen through the exact head only, the
    # logits are BF16's up to e4m3 rounding of keys and values (3 mantissa bits: a few % a value, ~1% on logits
    # that average many), and nearer BF16 than INT2 is. On CUDA the Triton kernels run (head_dim 64: their
    # smallest); their fp16 tensor-core operands add ~1e-3, well inside the bound
    heads = [0, 1] if whole_layer else [1]
    head_dim = 64 if device == "cuda" else 16
    model = _one_layer_model(silenced_heads=() if whole_layer else (0, 1, 2), head_dim=head_dim).to(device)
    ids = _ids(device)
    exact = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), STEPS)
    fp8, backend = _run(model, exact_heads={0: heads}, exact_format="fp8")
    (cache,) = backend.storage.values()
    held = cache if whole_layer else cache.exact.cache
    assert held.ring_format == "fp8" and held.layers[0].k_ring.dtype == torch.uint8
    assert (cache.exact is None) == whole_layer and not held.quantize
    all_int2, _ = _run(model)
    assert 0 < rel_error(fp8, exact) < 0.015 and rel_error(fp8, exact) < rel_error(all_int2, exact) / 4
    with pytest.raises(ValueError, match="exact_format must be one of"):
        oscar_backend(exact_format="fp4")


def test_exact_heads_option_is_checked():
    assert resolve_exact_heads(None) == {} and resolve_exact_heads("auto") == {}  # no artifact: none
    assert resolve_exact_heads({3: [2, 0, 2]}) == {3: (0, 2)}
    # the default keeps an artifact's retrieval heads exact ("auto"); None keeps every head INT2
    art = SimpleNamespace(retrieval_heads={1: (0,)})
    assert BackendOptions.exact_heads == "auto" and resolve_exact_heads(BackendOptions.exact_heads, art) == {1: (0,)}
    assert resolve_exact_heads(None, art) == {}
    for bad in ({0: []}, {0: [-1]}, {-1: [0]}, {0: 1}, "all"):
        with pytest.raises(ValueError, match="exact_heads"):
            oscar_backend(exact_heads=bad)


def test_companion_rows_move_with_the_cache():
    # reorder (beam search) and copy_rows_to (another storage) move the exact heads' rows too
    opts = dict(max_batch_size=3, max_seq_len=16, page_size=4, num_sinks=1, window=2, identity_block_table=True,
                dtype=torch.float32, key_format="channel")
    a, b = PagedInt2KVCache(1, 1, 16, **opts), PagedInt2KVCache(1, 1, 16, **opts)
    ca, cb = a.keep_heads_exact((0,), (1,)), b.keep_heads_exact((0,), (1,))
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 1, 11, 16, generator=gen), torch.randn(3, 1, 11, 16, generator=gen)
    ca.store(0, k, v, torch.arange(11))
    ring = ca.layers[0].k_ring.clone()
    a.reorder_rows(torch.tensor([2, 0, 1]))
    torch.testing.assert_close(ca.layers[0].k_ring, ring[[2, 0, 1]])
    a.copy_rows_to(b, 3, 11)
    torch.testing.assert_close(cb.layers[0].k_ring[:, :11], ca.layers[0].k_ring[:, :11])
    with pytest.raises(ValueError, match="cannot move"):
        a.copy_rows_to(PagedInt2KVCache(1, 1, 16, **opts), 3, 11)  # no companion there
    with pytest.raises(ValueError, match="disjoint"):
        PagedInt2KVCache(1, 1, 16, **opts).keep_heads_exact((0,), (0,))


def test_retrieval_heads_are_the_best_induction_scores_within_the_share():
    scores = [[0.02, 0.5], [0.3, 0.05], [0.9, 0.12]]
    assert select_retrieval_heads(scores, share=1 / 3) == [[0, 1], [2, 0]]  # 2 of 6 heads, the best two
    assert select_retrieval_heads(scores, skip_layers=(2,), share=1 / 3) == [[0, 1], [1, 0]]
    assert select_retrieval_heads(scores, floor=0.95) == []
    assert select_retrieval_heads(scores, share=0.01) == [[2, 0]]  # at least one where any qualifies
    batch = induction_batch(500, 1, span=8, rows=2)
    assert batch.shape == (2, 17) and (batch[:, 0] == 1).all() and torch.equal(batch[:, 1:9], batch[:, 9:])


def test_exact_heads_share_rechooses_from_the_artifacts_induction_scores():
    # Gemma 3's shape: three INT2 layers of one KV head among sliding ones; 1/16 keeps one head, a share keeps more
    scores = [[0.0], [0.36], [0.0], [0.15], [0.01], [0.096]]
    art = SimpleNamespace(has_retrieval_heads=True, sliding_windows={0: 512, 2: 512, 4: 512}, bf16_layers=(),
                          calibration={"induction_scores": scores, "retrieval_head_rule": {"floor": 0.1}})
    assert resolve_exact_heads(1 / 16, art) == {1: (0,)}
    assert resolve_exact_heads(1 / 3, art) == {1: (0,), 3: (0,)}  # layer 5 is under the floor, sliding ones skipped
    art.bf16_layers = (1,)
    assert resolve_exact_heads(1 / 3, art) == {3: (0,)}  # a BF16 layer is no candidate
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"share .* \(0, 1\]"):
            resolve_exact_heads(share, art)
    with pytest.raises(ValueError, match="no induction scores"):
        resolve_exact_heads(0.125, SimpleNamespace(has_retrieval_heads=False))
    with pytest.raises(ValueError, match="pass the artifact"):
        oscar_backend(exact_heads=0.125)


def test_tensor_parallel_rank_keeps_its_share_of_the_exact_heads():
    # a rank holding KV heads 2-3 of a layer (its k_proj shard's offset; tensor_parallel.first_kv_heads) keeps global
    # head 3 exact as its local head 1, and a rank without any of a layer's exact heads splits nothing
    model = _one_layer_model(silenced_heads=(0, 1, 2))
    ids = _ids()
    exact = prefill_and_decode(model, ids, make_hf_cache("dynamic", model, 32, 2), STEPS)
    for global_heads, first, local in (([3], 2, (1,)), ([1], 2, None)):
        torch._dynamo.reset()
        backend = oscar_backend(**OPTS, exact_heads={0: global_heads})
        backend._first_kv_heads = {0: first}
        got = prefill_and_decode(torch.compile(model, backend=backend), ids, make_hf_cache("oscar", model, 32, 2), STEPS)
        (cache,) = backend.storage.values()
        assert (cache.exact.exact_heads if cache.exact else None) == local
        if local:  # seen through the exact head only: BF16's logits
            torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
