"""A long-context check of calibrated artifacts: which layers do not survive INT2 at the served length.

The clip search holds out sequences as long as the calibration's (512 tokens by default). Some layers only
fail at longer contexts: Qwen2.5-Coder-0.5B's layer 0 keys give a 0.40 relative attention-output error at
512 tokens (tied worst with layer 16, median 0.28) but 1.07 at 2K (the other layers 0.02-0.25), where they
cost ~+15% perplexity by themselves. This check runs the model on a few long sequences (disjoint from the
statistics), measures every layer's held-out error with the artifact's own transforms and clips, and marks
the outliers to be kept in BF16 (``Artifacts.bf16_layers``, read by the backend's ``bf16_layers``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch

from .artifacts import Artifacts
from .clipping import PAGE_CLIP_GRID, lower_medians, relative_errors
from .retrieval_heads import select_retrieval_heads, selection_rule as _selection_rule
from .statistics import StatsObserver

# A layer is an outlier where its key or value error is this many times the layers' (lower) median error...
OUTLIER_FACTOR = 4.0
# ...and at least this large in itself (relative RMS error of the attention output): a layer at 0.05 among
# layers at 0.01 is not worth 7x its bytes.
OUTLIER_FLOOR = 0.25
# With per-channel keys, a layer whose key error per token is below this fraction of its per-channel one is a
# candidate to keep per-token keys (``token_key_layers``; the backend's layer_key_formats="auto"). SmolLM2-135M at
# 8K (probe_layer_error.py): per channel halves the key error of layers 3-10 but doubles layer 18's (0.25 vs 0.10).
TOKEN_KEY_RATIO = 0.75


def select_bf16_layers(errors: list, factor: float = OUTLIER_FACTOR, floor: float = OUTLIER_FLOOR,
                       max_layers: int | None = None) -> list[int]:
    """Layers whose ``[key, value]`` error is ``factor`` x the lower median of its kind and at least ``floor``;
    the worst (by that ratio) first, at most ``max_layers`` (default: one in eight layers, at least one). A None
    entry is a layer with no INT2 (a sliding-window layer's exact ring): counted in the eight, never chosen."""
    if not any(e is not None for e in errors):
        return []
    med = [max(m, 1e-12) for m in lower_medians(errors)]
    ratio = {i: max(e[j] / med[j] for j in (0, 1) if e[j] >= floor) for i, e in enumerate(errors)
             if e is not None and any(e[j] >= floor for j in (0, 1))}
    out = sorted((i for i, r in ratio.items() if r >= factor), key=lambda i: -ratio[i])
    cap = max(1, len(errors) // 8) if max_layers is None else max_layers
    return sorted(out[:cap])


def check_layers(model: torch.nn.Module, artifacts: Artifacts, batches: Iterable[torch.Tensor], *,
                 num_sinks: int | None = None, window: int | None = None, forward: Callable | None = None,
                 factor: float = OUTLIER_FACTOR, floor: float = OUTLIER_FLOOR, max_layers: int | None = None,
                 key_format: str | None = None, page_size: int | None = None, progress: bool = True) -> Artifacts:
    """``artifacts`` with each layer's error on ``batches`` (long token sequences, ``[B, T]``) recorded in
    ``calibration["check_relative_error"]`` (``[key, value]`` relative RMS error of the attention output with
    INT2 keys / INT2 values, as ``heldout_relative_error``; None for a sliding-window layer, whose exact BF16 ring
    the backend keeps) and the outlier layers in ``calibration["bf16_layers"]``.

    Each query reads its keys as a decode step of a cache of its position + 1 tokens would: ``num_sinks`` sinks and
    its last ``window`` keys exact (default: the backend's 64 and 256), the rest INT2, keys in the backend's
    ``key_format`` and ``page_size`` unless given (default: per channel over pages of 32). The sequences should be as
    long as the contexts served, and disjoint from the evaluation text.

    With per-channel keys the check also chooses each layer's page range ratio (``key_page_clips``, from
    ``PAGE_CLIP_GRID``, the one with the least key error, recorded in ``check_page_clip_key_error``; what the
    backend's default ``key_page_clips="auto"`` stores). The recorded key errors and the choices below stay at full
    ranges, the larger errors (the evaluated artifacts chose their BF16 layers so). It also measures each layer's
    keys per token (``check_token_key_error``) and lists the layers where that error is below ``TOKEN_KEY_RATIO``
    times the per-channel one (``token_key_layers``): what the backend's ``layer_key_formats="auto"`` keeps per
    token. Where the artifact carries error-feedback factors, it also chooses each layer's page range ratio for keys
    rounded with them (``feedback_page_clips``, what ``key_feedback=True`` stores with ``key_page_clips="auto"``) and
    records the key error there (``check_feedback_key_error``)."""
    from ..backend import BackendOptions, resolve_page_size
    from .tracer import run_observed

    num_sinks = BackendOptions.num_sinks if num_sinks is None else num_sinks
    window = BackendOptions.window if window is None else window
    key_format = BackendOptions.key_format if key_format is None else key_format
    if key_format not in ("token", "channel"):
        raise ValueError(f"oscar check: key_format must be 'token' or 'channel', got {key_format!r}")
    page_size = resolve_page_size(key_format, page_size, "oscar check")
    key_page = page_size if key_format == "channel" else 0

    batches = list(batches)
    if not batches:
        raise ValueError("oscar check: no sequences to check the layers on")
    if not all(isinstance(b, torch.Tensor) and b.dim() == 2 and b.numel() for b in batches):
        raise ValueError("oscar check: each batch must be a non-empty [B, T] tensor of token ids")
    artifacts.validate(model)
    tokens = sum(b.numel() for b in batches)
    observer = StatsObserver(heldout_tokens=tokens)
    observer.phase = "heldout"  # keep every query, key and value whole
    run_observed(model, batches, observer, forward=forward, progress=progress, desc="oscar check")
    if sorted(observer.heldout) != list(range(len(artifacts.layers))):
        raise RuntimeError(f"oscar check: attention was seen in layers {sorted(observer.heldout)}, the artifact has "
                           f"{len(artifacts.layers)}")
    group = artifacts.options.get("group_size")
    sliding = artifacts.sliding_windows  # kept as exact BF16 rings by the backend: never INT2, not candidates
    errors, token_key_errors, page_clips, clipped_key_errors = [], {}, [], []
    feedback_clips, feedback_key_errors = [], []  # with error feedback: each layer's own best ratio, its error
    grid = tuple(r for r in PAGE_CLIP_GRID if r < 1.0) if key_page else ()
    for layer, tr in enumerate(artifacts.layers):
        h = observer.heldout.pop(layer)  # long sequences' activations: free them as we go
        if layer in sliding:
            errors.append(None)
            page_clips.append(None)
            clipped_key_errors.append(None)
            feedback_clips.append(None)
            feedback_key_errors.append(None)
            continue
        # with per-channel keys, the same keys per token too (where they do clearly better, layer_key_formats="auto"
        # keeps them so), per channel at each narrower page range and, where the artifact has its factors, rounded
        # with error feedback at every ratio: all on one set of attention weights
        fed = key_page and tr.key_feedback is not None
        key, value, *rest = (round(e, 4) for e in relative_errors(
            h.q, h.k, h.v, tr, group, num_sinks, window, key_page, other_key_pages=(0,) if key_page else (),
            page_clips=grid, feedback_clips=(1.0, *grid) if fed else ()))
        if key_page:
            token_key_errors[layer] = rest[0]
            ratios = (1.0, *grid)
            best = lambda errs: min(zip(ratios, errs), key=lambda re: re[1])  # noqa: E731 (ties: the wider range)
            ratio, clipped = best((key, *rest[1:1 + len(grid)]))
            page_clips.append(ratio)
            clipped_key_errors.append(clipped)
            # with error feedback the best ratio may differ (feedback moves values toward the range's ends): its own
            ratio, clipped = best(rest[1 + len(grid):]) if fed else (None, None)
            feedback_clips.append(ratio)
            feedback_key_errors.append(clipped)
        errors.append([key, value])
    chosen = select_bf16_layers(errors, factor, floor, max_layers)
    token_layers = sorted(layer for layer, e in token_key_errors.items()
                          if layer not in chosen and e < TOKEN_KEY_RATIO * errors[layer][0])
    cal = dict(artifacts.calibration, check_relative_error=errors, check_tokens=tokens,
               check_seq_len=int(batches[0].shape[1]), check_sinks_window=[num_sinks, window],
               check_key_format=[key_format, page_size], bf16_layers=chosen)
    if "induction_scores" in cal:  # retrieval heads measured before: the layers now kept in BF16 are no candidates
        cal["retrieval_heads"] = select_retrieval_heads(cal["induction_scores"], set(sliding) | set(chosen),
                                                        **_selection_rule(cal))
    if key_page:
        cal.update(check_token_key_error=[token_key_errors.get(i) for i in range(len(errors))],
                   token_key_layers=token_layers, key_page_clips=page_clips,
                   check_page_clip_key_error=clipped_key_errors)
        if any(r is not None for r in feedback_clips):
            cal.update(feedback_page_clips=feedback_clips, check_feedback_key_error=feedback_key_errors)
    return dataclasses.replace(artifacts, calibration=cal)
