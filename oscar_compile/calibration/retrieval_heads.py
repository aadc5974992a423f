"""Retrieval heads: the few KV heads that copy from far back in the context, found offline by their induction score.

Long-context retrieval (passkey, needle) rests on a handful of heads that attend sharply to one earlier token and
copy it. There INT2 hurts most: a sharp attention averages no rounding error away, and a noisy key can lose its
place among thousands. SmolLM2-135M at 2K (`benchmarks/probe_retrieval_exact.py`): reading keys and values
exactly in the 8 of its 90 KV heads that put the most attention on the needle recovers 90% of the answer NLL the
INT2 cache loses (+1.32 nats against BF16 -> +0.13); exact keys everywhere recover 60%, exact values 64%.

Those heads are induction heads, and an induction head shows itself on any text that repeats: on random tokens
repeated once, a query in the second copy puts its attention on the token after its own first occurrence. The
score of a KV head is that attention mass, averaged over its query heads and positions. It is model-agnostic (one
forward pass through the calibration tracer, no needle, no evaluation text), and on SmolLM2 its top 8 heads hold 7
of the needle's top 8 (Spearman 0.81 over all heads). The backend keeps the chosen heads' keys and values in BF16
(``exact_heads``) and the rest in INT2.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .artifacts import heads_by_layer
from .clipping import attention_probs

# A head is a retrieval head where this much of its attention lands on the induction target (random tokens:
# a head that does not copy puts about 1/position there)...
INDUCTION_FLOOR = 0.1
# ...and at most this share of a model's KV heads is kept in BF16 (the best first): at long contexts it costs
# share x (16 - ~2.8) bits per element, +0.83 at 1/16.
RETRIEVAL_HEAD_SHARE = 1 / 16
# The repeated random sequence: rows x (bos + 2 x span) tokens.
SPAN, ROWS = 256, 4


def induction_batch(vocab_size: int, bos: int | None, span: int = SPAN, rows: int = ROWS, seed: int = 0) -> torch.Tensor:
    """``rows`` sequences of ``span`` random tokens said twice (after ``bos``): ``[rows, (bos) + 2 span]``."""
    g = torch.Generator().manual_seed(seed)
    # skip the first ids (special and byte tokens in most vocabularies)
    lo = min(1000, vocab_size // 4)
    x = torch.randint(lo, vocab_size, (rows, span), generator=g)
    head = torch.full((rows, 1), bos, dtype=torch.long) if bos is not None else x[:, :0]
    return torch.cat([head, x, x], 1)


def induction_scores(model: torch.nn.Module, vocab_size: int, bos: int | None, *, forward: Callable | None = None,
                     span: int = SPAN, rows: int = ROWS, seed: int = 0) -> list[list[float]]:
    """Each layer's per-KV-head induction score (``[layers][kv heads]``): the mean attention a query of the second
    copy puts on the token after its first occurrence, over the queries of the copy and each head's query heads."""
    from .statistics import StatsObserver
    from .tracer import run_observed

    batch = induction_batch(vocab_size, bos, span, rows, seed)
    off = batch.shape[1] - 2 * span
    observer = StatsObserver(heldout_tokens=batch.numel())
    observer.phase = "heldout"  # keep the queries and keys whole
    run_observed(model, [batch], observer, forward=forward, progress=False)
    i = torch.arange(1, span - 1)
    scores = []
    for layer in sorted(observer.heldout):
        h = observer.heldout[layer]
        q, k = torch.cat(h.q), torch.cat(h.k)  # [B, Hq, T, d], [B, H, T, d]
        probs = attention_probs(q, k)  # [B, H, G, T, T]
        mass = probs[..., off + span + i, off + i + 1]  # query: token i of the copy; key: the token after its first
        scores.append([round(float(x), 4) for x in mass.mean(dim=(0, 2, 3))])
    return scores


def select_retrieval_heads(scores: list[list[float]], skip_layers=(), floor: float = INDUCTION_FLOOR,
                           share: float = RETRIEVAL_HEAD_SHARE) -> list[list[int]]:
    """``[[layer, head], ...]``: heads scoring at least ``floor``, the best first, at most ``share`` of all KV heads
    (at least one where any qualifies); ``skip_layers`` (sliding-window or BF16 layers: not INT2) are never chosen."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"oscar: the retrieval heads' share of the KV heads is in (0, 1], got {share!r}")
    total = sum(len(s) for s in scores)
    cap = max(1, int(total * share))
    skip = set(skip_layers)
    ranked = sorted(((s, layer, head) for layer, row in enumerate(scores) for head, s in enumerate(row)
                     if layer not in skip and s >= floor), reverse=True)
    return sorted([layer, head] for _, layer, head in ranked[:cap])


def selection_rule(calibration: dict) -> dict:
    """The ``floor`` and ``share`` an artifact's retrieval heads were chosen with (the defaults where unrecorded)."""
    rule = calibration.get("retrieval_head_rule", {})
    return {"floor": rule.get("floor", INDUCTION_FLOOR), "share": rule.get("share", RETRIEVAL_HEAD_SHARE)}


def retrieval_heads_at(artifacts, share: float) -> dict[int, tuple[int, ...]]:
    """``{layer: KV heads}``: the artifact's retrieval heads re-chosen from its recorded induction scores at another
    ``share`` of the KV heads (same floor; no forward pass). A model whose few INT2 heads are nearly all its memory
    (Gemma 3: 3 global heads of 18) has one head at 1/16; 1/8 keeps two."""
    if not artifacts.has_retrieval_heads:
        raise ValueError("oscar: this artifact has no induction scores (calibrated before 2026-12-06, or with "
                         "retrieval_heads=False): recalibrate to choose retrieval heads by share")
    return heads_by_layer(select_retrieval_heads(artifacts.calibration["induction_scores"], _not_candidates(artifacts),
                                                 selection_rule(artifacts.calibration)["floor"], share))


def _not_candidates(artifacts) -> set[int]:
    """Layers whose heads are never retrieval heads: sliding-window layers and the artifact's BF16 layers."""
    return set(artifacts.sliding_windows) | set(artifacts.bf16_layers)


def induction_inputs(model: torch.nn.Module) -> tuple[int, int | None, int]:
    """``(vocabulary size, BOS id or None, span)`` of the induction batch for ``model``: token ids its input embeddings
    hold, and a span that fits its position embeddings twice (GPT-2's 1024, say). Raises ValueError where the model
    tells neither a ``config.vocab_size`` nor input embeddings."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    sizes = [int(n) for n in (getattr(cfg, "vocab_size", None), getattr(emb, "num_embeddings", None)) if n]
    if not sizes:
        raise ValueError(f"oscar: {type(model).__name__} tells no vocabulary size (no config.vocab_size, no input "
                         "embeddings), so its retrieval heads cannot be measured; pass retrieval_heads=False")
    vocab = min(sizes)
    bos = getattr(cfg, "bos_token_id", None)
    bos = bos[0] if isinstance(bos, (list, tuple)) else bos
    bos = bos if isinstance(bos, int) and 0 <= bos < vocab else None
    from .tracer import model_context_length

    positions = model_context_length(model) or getattr(cfg, "n_positions", None)  # GPT-2 names it n_positions
    span = min(SPAN, (int(positions) - 1) // 2) if positions else SPAN
    return vocab, bos, span


def with_retrieval_heads(model: torch.nn.Module, artifacts, *, forward: Callable | None = None,
                         floor: float = INDUCTION_FLOOR, share: float = RETRIEVAL_HEAD_SHARE):
    """``artifacts`` with ``calibration["induction_scores"]`` and the chosen ``calibration["retrieval_heads"]`` (what
    the backend's ``exact_heads="auto"`` keeps in BF16). Layers the artifact keeps in BF16 or as sliding windows
    are not candidates."""
    vocab, bos, span = induction_inputs(model)
    scores = induction_scores(model, vocab, bos, forward=forward, span=span)
    if len(scores) != len(artifacts.layers):
        raise RuntimeError(f"oscar: induction scores for {len(scores)} layers, the artifact has {len(artifacts.layers)}")
    heads = select_retrieval_heads(scores, _not_candidates(artifacts), floor, share)
    cal = dict(artifacts.calibration, induction_scores=scores, retrieval_heads=heads,
               retrieval_head_rule={"floor": floor, "share": share, "span": span, "rows": ROWS})
    return dataclasses.replace(artifacts, calibration=cal)
