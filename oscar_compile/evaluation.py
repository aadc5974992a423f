"""Teacher-forced decode evaluation through the compiled backend.

A single forward pass over a fresh cache never reads the quantized cache (every token attends to
its own chunk exactly), which makes every cache format look identical. Here each sequence is
prefilled with ``context`` tokens, then the next ``decode`` tokens are fed one decode step at a
time; each step's prediction of the following token is scored. So every scored token attends to
a history that went through the INT2 cache exactly as in serving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backend import OscarBackend, oscar_backend
from .cache import PagedInt2KVCache


@dataclass
class EvalResult:
    name: str
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int
    bits_per_element: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


@torch.no_grad()
def teacher_forced_nll(model, tokens: torch.Tensor, context: int, backend: OscarBackend, progress=None) -> tuple[float, int]:
    """Sum of NLL and count over tokens ``context + 1 .. context + decode`` of ``tokens [B, L]``.

    ``L = context + decode + 1``. The model is compiled with ``backend`` and runs on an OscarCache.
    """
    from .hf import OscarCache
    from .testing import cache_kwarg

    b, length = tokens.shape
    decode = length - context - 1
    if decode < 1:
        raise ValueError(f"oscar eval: {length} tokens leave nothing to score after a {context}-token context")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    cache = OscarCache(model, max_cache_len=length, max_batch_size=b)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    compiled(tokens[:, :context], **kw)
    nll, count = 0.0, 0
    steps = range(decode)
    if progress is not None:
        steps = progress(steps)
    for i in steps:
        p = context + i
        logits = compiled(tokens[:, p : p + 1], **kw).logits[:, -1].float()
        nll += torch.nn.functional.cross_entropy(logits, tokens[:, p + 1], reduction="sum").item()
        count += b
    torch._dynamo.reset()
    return nll, count


def bits_per_element(model_config, context: int, num_sinks: int, window: int, group_size=None,
                     cache_dtype=torch.bfloat16, quantize: bool = True) -> float:
    """Effective bits per K/V element of one sequence of ``context`` tokens, metadata and BF16 tokens included."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if not quantize:
        return float(torch.finfo(cache_dtype).bits)
    cache = PagedInt2KVCache(1, heads, d, max_seq_len=1, num_sinks=num_sinks, window=window, group_size=group_size,
                             dtype=cache_dtype, device="meta")
    return cache.memory_report(context).bits_per_element


def evaluate_methods(model, tokens: torch.Tensor, context: int, methods: dict, *, num_sinks: int, window: int,
                     cache_dtype=torch.bfloat16, progress: bool = True) -> list[EvalResult]:
    """``methods``: name -> artifacts (or ``None`` with backend options in a dict ``{"options": {...}}``)."""
    results = []
    for name, spec in methods.items():
        spec = spec if isinstance(spec, dict) else {"artifacts": spec}
        options = dict(num_sinks=num_sinks, window=window, cache_dtype=cache_dtype, inductor=False)
        options.update(spec.get("options", {}))
        backend = oscar_backend(spec.get("artifacts"), **options)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = lambda it: tqdm(it, desc=f"{name} (sinks {num_sinks}, window {window})", unit="step", leave=False)  # noqa: E731
        nll, count = teacher_forced_nll(model, tokens, context, backend, progress=bar)
        bits = bits_per_element(model.config, tokens.shape[1], num_sinks, window, options.get("group_size"),
                                cache_dtype, options.get("quantize", True))
        results.append(EvalResult(name, nll / count, count, bits))
    return results
