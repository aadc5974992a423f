"""Chunked prefill (``oscar_compile.compile(..., prefill_chunk_size=n)``): a long prompt prefilled in chunks
through transformers' own chunked prefill; every chunk reads the earlier ones from the cache."""

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

import oscar_compile
from oscar_compile import OscarCache
from oscar_compile.testing import hadamard_reference_cache, reference_attention, rel_error, tiny_model

PROMPT, NEW, CHUNK = 13, 6, 4  # chunks of 4, 4, 4 and 1 tokens
OPTS = dict(num_sinks=2, window=3, page_size=4)  # short sequences reach the INT2 pages


def _ids():
    return torch.randint(3, 97, (2, PROMPT), generator=torch.Generator().manual_seed(0))


def _generate(model, cache, chunk):
    model.generation_config.prefill_chunk_size = chunk
    out = model.generate(_ids(), past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("chunk", [None, CHUNK], ids=["whole", "chunked"])
def test_chunked_prefill_without_quantization_is_exact(chunk):
    ref_tokens, ref_logits = _generate(tiny_model("llama"), DynamicCache(), None)
    model = tiny_model("llama")
    oscar_compile.compile(model, quantize=False, inductor=False, prefill_chunk_size=chunk)
    assert model.generation_config.prefill_chunk_size == chunk
    tokens, logits = _generate(model, OscarCache(model, max_cache_len=32, max_batch_size=2), chunk)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)  # fp32: summation order only


def test_chunked_int2_prefill_equals_the_ops_called_chunk_by_chunk():
    model = tiny_model("llama")
    oscar_compile.compile(model, inductor=False, prefill_chunk_size=CHUNK, **OPTS)
    tokens, logits = _generate(model, OscarCache(model, max_cache_len=32, max_batch_size=2), CHUNK)

    eager = tiny_model("llama")
    cache = hadamard_reference_cache(eager, 2, 32, **OPTS)
    AttentionInterface.register("oscar_reference_chunked", reference_attention(cache))
    eager.config._attn_implementation = "oscar_reference_chunked"
    ref_tokens, ref_logits = _generate(eager, DynamicCache(), CHUNK)
    # the same chunks through the same ops: only fp32 summation order differs
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    # and chunking really changed what the prompt read (later chunks see earlier ones in INT2)
    eager.config._attn_implementation = "sdpa"
    _, whole = _generate(eager, DynamicCache(), None)
    assert rel_error(logits, whole) > 1e-4
