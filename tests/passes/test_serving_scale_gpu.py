"""Prefill + decode through the backend at serving sizes (GPU only), checked on sampled rows.

A two-layer model with Llama-3-8B heads (d 128, GQA 4) runs a 16 x 4096 and a 1 x 32768 prompt through
the oscar backend with the Triton kernels. Rows are independent, so a few sampled rows are re-run through
the reference ops (a PagedInt2KVCache called from transformers' attention interface, eager), and with
quantization off through the model's own SDPA.
"""

import pytest
import torch
from transformers import AttentionInterface

import oscar_compile
from oscar_compile import OscarCache
from oscar_compile.testing import (
    hadamard_reference_cache,
    make_hf_cache,
    prefill_and_decode,
    reference_attention,
    rel_error,
)

STEPS = 3


def _model(max_len):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=2048, intermediate_size=2048, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=max_len,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def _reference_int2(model, ids, max_len, **opts):
    """Logits of ``ids`` through the reference ops on a cache of their own (Hadamard, the backend's default)."""
    cache = hadamard_reference_cache(model, ids.shape[0], max_len, torch.bfloat16, "cuda", **opts)
    AttentionInterface.register("oscar_reference_gpu", reference_attention(cache))
    model.config._attn_implementation = "oscar_reference_gpu"
    try:
        return prefill_and_decode(model, ids, make_hf_cache("dynamic", model, max_len, ids.shape[0]), STEPS)
    finally:
        model.config._attn_implementation = "sdpa"


@pytest.mark.gpu
@pytest.mark.parametrize("batch,prompt", [(16, 4096), (1, 32768)], ids=["16x4096", "1x32768"])
def test_serving_scale_prefill_and_decode_gpu(batch, prompt):
    max_len = prompt + STEPS + 1
    model = _model(max_len)
    ids = torch.randint(3, 1000, (batch, prompt), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    rows = sorted({0, batch // 2, batch - 1})

    oscar_compile.compile(model, quantize=False, inductor=False)
    off = prefill_and_decode(model, ids, OscarCache(model, max_cache_len=max_len, max_batch_size=batch), STEPS)
    model._compiled_call_impl = None
    torch._dynamo.reset()
    oscar_compile.compile(model, inductor=False)
    int2 = prefill_and_decode(model, ids, OscarCache(model, max_cache_len=max_len, max_batch_size=batch), STEPS)
    model._compiled_call_impl = None
    torch._dynamo.reset()
    assert torch.isfinite(off).all() and torch.isfinite(int2).all()

    sdpa = prefill_and_decode(model, ids[rows], make_hf_cache("dynamic", model, max_len, len(rows)), STEPS)
    # bf16 model; the kernel's fp16 tensor-core operands and another summation order: ~1e-2 on logits
    assert rel_error(off[rows], sdpa) < 2e-2
    ref = _reference_int2(model, ids[rows], max_len, num_sinks=64, window=256, page_size=16)
    # the same quantizer on the same values; codes at rounding ties may differ (Triton's fp32 transform)
    assert rel_error(int2[rows], ref) < 3e-2
    assert rel_error(int2[rows], sdpa) > rel_error(int2[rows], ref)  # INT2 really was used
