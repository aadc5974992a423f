"""``calibrate(model, batches)``: trace, accumulate statistics, derive transforms, search clip ratios."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..backend import DEFAULT_PAGE_SIZE, OscarBackend
from .artifacts import Artifacts, model_fingerprint
from ..quant import feedback_factor
from .clipping import CLIP_GRID, attention_probs, relative_errors, search_clip
from .rotations import derive_transforms, parse_method
from .statistics import StatsObserver

log = logging.getLogger("oscar_compile.calibration")


def hf_forward(model, batch: torch.Tensor, position_ids: torch.Tensor | None = None):
    """One calibration forward of a transformers causal LM: a prefill into a fresh DynamicCache.

    Built without the config, so every layer is a plain growing one: a sliding-window layer's own cache
    crops to its window (an update the matcher does not model), while the model's masks still apply the
    window over absolute positions. ``position_ids`` (``[B, T]``) place the tokens elsewhere than 0..T-1
    for the model's position encoding only (masks follow the cache positions)."""
    from transformers import DynamicCache

    from ..hf import cache_kwarg

    inner = getattr(model, "_orig_mod", model)
    extra = {} if position_ids is None else {"position_ids": position_ids}
    return model(batch, **{cache_kwarg(inner): DynamicCache()}, use_cache=True, **extra)


def model_context_length(model) -> int | None:
    """The context a model's config says it serves (``max_position_embeddings``), or None."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(cfg, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def resolve_position_range(model, position_range: int | str | None, seq_len: int,
                           own_forward: bool = False) -> int | None:
    """The position range calibration rows are spread over, or None (every row at position 0).

    ``"auto"``: the model config's ``max_position_embeddings``, unless rows run through a ``forward`` of one's
    own (it need not take ``position_ids``) or already reach the whole context. An explicit range shorter than
    a row is an error."""
    if position_range == "auto":
        position_range = None if own_forward else model_context_length(model)
        if position_range and position_range <= seq_len:
            return None
    if position_range and position_range < seq_len:
        raise ValueError(f"oscar calibrate: position_range {position_range} is shorter than a calibration "
                         f"sequence ({seq_len} tokens)")
    return position_range or None


def position_offsets(first_row: int, rows: int, seq_len: int, position_range: int) -> torch.Tensor:
    """Start positions of calibration rows ``first_row .. first_row + rows - 1``, spread evenly (golden-ratio
    sequence) over ``[0, position_range - seq_len]``; row 0 starts at 0."""
    span = max(position_range - seq_len, 0)
    idx = torch.arange(first_row, first_row + rows, dtype=torch.float64)
    return torch.floor(torch.frac(idx * 0.6180339887498949) * (span + 1)).long()


def position_spread_forward(position_range: int, base: Callable = hf_forward) -> Callable:
    """A calibration ``forward`` that runs each row at its own start position (:func:`position_offsets`).

    Why: queries and keys are recorded after the model's rotary position encoding, which turns a channel
    pair by an angle that grows with the position. Rows at positions 0..511 see the low-frequency pairs
    barely turned, so a basis fitted on them does not fit the keys at position 30000: the same text's INT2
    key error grew 2-7x when moved there (``benchmarks/probe_layer_error.py --shifts``). Moving a whole row
    changes no attention score (RoPE depends on relative positions only), so the statistics stay those of
    real attention, now over every position a served context reaches."""
    state = {"row": 0}

    def forward(model, batch):
        b, t = batch.shape
        offsets = position_offsets(state["row"], b, t, position_range).to(batch.device)
        state["row"] += b
        return base(model, batch, position_ids=offsets[:, None] + torch.arange(t, device=batch.device)[None])

    return forward


@dataclass
class CalibrationStats:
    """What one calibration pass collected; any method's artifacts can be derived from it."""

    observer: StatsObserver
    fingerprint: dict
    info: dict


def run_observed(model: torch.nn.Module, batches: list, observer: StatsObserver, *, forward: Callable | None = None,
                 progress: bool = True, desc: str = "oscar calibrate", phase_of: Callable | None = None) -> None:
    """Run ``model`` on ``batches`` with the backend in observe mode feeding ``observer`` (nothing is rewritten);
    ``phase_of(i)``, if given, is the observer's phase for batch ``i``. The observe-mode graphs are dropped after,
    so the model's next compile starts clean."""
    compiled = torch.compile(model, backend=OscarBackend(observer=observer, inductor=False, validate=False))
    forward = forward or hf_forward
    device = next(model.parameters()).device
    iterator = batches
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(batches, desc=desc, unit="batch")
    with torch.no_grad():
        for i, batch in enumerate(iterator):
            if phase_of is not None:
                observer.phase = phase_of(i)
            forward(compiled, batch.to(device))
    torch._dynamo.reset()


def collect_statistics(
    model: torch.nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    heldout_batches: int = 1,
    skip_first: int = 4,
    forward: Callable | None = None,
    data_description: str = "",
    progress: bool = True,
    position_range: int | str | None = "auto",
) -> CalibrationStats:
    """Run ``model`` on ``batches`` in observe mode and accumulate the per-layer statistics.

    Every attention call is found by the backend's matcher (no per-model hooks): the model runs
    unchanged and the post-RoPE queries, keys and values the cache would store are accumulated per
    (layer, KV head) in float64. The last ``heldout_batches`` batches are kept whole for the clip
    search instead. ``forward(model, batch)`` runs one batch (default: a transformers prefill into a
    fresh ``DynamicCache``). Positions ``< skip_first`` (attention sinks) are left out of the statistics.
    ``position_range``: run the rows at start positions spread over ``[0, position_range)`` (the context the
    artifact will serve; see :func:`position_spread_forward`); ``None`` runs every row from position 0;
    ``"auto"`` (default): the model config's ``max_position_embeddings`` with the default ``forward``, and
    ``None`` with a ``forward`` of one's own (which then need not take ``position_ids``).
    """
    from ..tensor_parallel import tensor_parallel_size

    if tensor_parallel_size(model) > 1:
        raise ValueError("oscar: calibrate the whole model in one process (loaded without tp_plan): under tensor "
                         "parallelism each rank sees only its own heads. Every rank then loads the same artifact; "
                         "oscar_compile.compile(model, artifacts) gives each rank the transforms of the heads it holds.")
    batches = list(batches)
    if len(batches) <= heldout_batches:
        raise ValueError(f"oscar calibrate: {len(batches)} batch(es) cannot hold out {heldout_batches} for the clip "
                         "search and still leave data for the statistics")
    observer = StatsObserver(skip_first=skip_first)
    t0 = time.perf_counter()
    position_range = resolve_position_range(model, position_range, batches[0].shape[-1], forward is not None)
    if position_range:
        forward = position_spread_forward(position_range, forward or hf_forward)
    first_heldout = len(batches) - heldout_batches
    run_observed(model, batches, observer, forward=forward, progress=progress,
                 phase_of=lambda i: "heldout" if i >= first_heldout else "stats")
    tokens = sum(b.numel() for b in batches[:first_heldout])
    heldout = sum(b.numel() for b in batches[first_heldout:])
    if not observer.layers:
        raise RuntimeError("oscar calibrate: no attention call was matched in the model: run `oscar explain` to see why")
    layers = sorted(observer.layers)
    if layers != list(range(len(layers))):
        raise RuntimeError(f"oscar calibrate: attention layers {layers} are not numbered 0..{len(layers) - 1}")
    expected = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if isinstance(expected, int) and len(layers) != expected:
        raise RuntimeError(f"oscar calibrate: attention was matched in {len(layers)} of the model's {expected} layers "
                           f"(layers {len(layers)}..{expected - 1} missing): run `oscar explain` to see why")
    first = observer.layers[0]
    fingerprint = model_fingerprint(model, len(layers), first.num_q_heads, first.num_kv_heads, first.head_dim)
    info = {"data": data_description, "tokens": tokens, "heldout_tokens": heldout, "batches": len(batches),
            "batch_shape": list(batches[0].shape), "skip_first": skip_first, "position_range": position_range,
            "seconds": round(time.perf_counter() - t0, 1)}
    return CalibrationStats(observer, fingerprint, info)


# Sign patterns of the eigenvectors tried per layer (keys and values each), the least held-out error kept
SIGN_TRIALS = 4


def key_scale_spans(transforms) -> list[float]:
    """Span (max / min) of each layer's key scales: the singular values of its key transform, worst head. Recorded in
    the artifact (``calibration.key_scale_span``): a wide span means directions the calibration queries barely
    reached, which a longer context may reach (Gemma 3 270M: 24-55x on its full-attention layers; SmolLM2: 5-15x)."""
    spans = []
    for tr in transforms:
        sv = torch.linalg.svdvals(tr.key_transform.double())
        spans.append(round(float((sv.amax(-1) / sv.amin(-1).clamp_min(1e-30)).max()), 2))
    return spans


def with_key_feedback(tr, layer_stats, damp: float = 0.01):
    """``tr`` with ``key_feedback``: :func:`~oscar_compile.quant.feedback_factor` of the calibration queries' second
    moment in the stored basis (``B_q^T E[q q^T] B_q``, ``B_q`` the query transform); ``tr`` unchanged (no factor)
    for a layer whose queries were never observed."""
    if layer_stats.query_count == 0:
        return tr
    bq = tr.query_transform.double()
    moment = bq.transpose(-1, -2) @ layer_stats.query_second_moment.to(bq) @ bq
    try:
        return dataclasses.replace(tr, key_feedback=feedback_factor(moment, damp))
    except RuntimeError:  # torch.linalg errors: not positive definite even damped (degenerate queries)
        return tr


def derive_artifacts(stats: CalibrationStats, method: str = "default", *, group_size: int | None = None,
                     clip_grid=CLIP_GRID, progress: bool = False) -> Artifacts:
    """Transforms and clip ratios of ``method`` from collected statistics (``progress``: a bar over the layers,
    whose sign-pattern and clip searches take seconds each on a CPU)."""
    spec = parse_method(method)
    obs = stats.observer
    transforms = []
    seeds = []
    errors = []  # [key, value] relative held-out RMS error of each layer at its chosen transforms and clips
    channel_key_errors = []  # the key error of each layer with keys per channel over pages (the backend's default)
    centred_values = []  # whether each layer stores v - mu_v (+vauto chooses per layer)
    layers = range(len(obs.layers))
    if progress and spec.clip_search:
        from tqdm.auto import tqdm

        layers = tqdm(layers, desc=f"oscar derive {spec.name}", unit="layer")
    for layer in layers:
        if not spec.clip_search:
            transforms.append(derive_transforms(obs.layers[layer], spec))
            continue
        h = obs.heldout.get(layer)
        if h is None or not h.q:
            raise ValueError("oscar calibrate: the clip search needs held-out batches (heldout_batches >= 1)")
        # the eigenvectors' sign pattern and the clip ratios, keys and values each, by held-out error; for
        # +vauto also whether values are stored centred (the key side does not depend on it)
        best_k = best_v = None  # (held-out error, seed, clip ratio, transforms[, values centred])
        value_means = (True, False) if spec.value_mean == "auto" else (spec.value_mean,)
        probs = [attention_probs(q, k) for q, k in zip(h.q, h.k)]  # the same for every trial: computed once
        for seed in range(SIGN_TRIALS if spec.base == "oscar" else 1):
            for i, centred in enumerate(value_means):
                tr = derive_transforms(obs.layers[layer], dataclasses.replace(spec, value_mean=centred), seed, seed)
                sides = ("key", "value") if i == 0 else ("value",)
                kc, vc, err = search_clip(h.q, h.k, h.v, tr, group_size, obs.skip_first, clip_grid, sides, probs)
                if kc is not None and (best_k is None or err["key_error"][kc] < best_k[0]):
                    best_k = (err["key_error"][kc], seed, kc, tr)
                if best_v is None or err["value_error"][vc] < best_v[0]:
                    best_v = (err["value_error"][vc], seed, vc, tr, bool(centred))
        # keys (and queries) of the best key trial, values (and outputs) of the best value trial: they are independent
        tr = dataclasses.replace(best_k[3], value_transform=best_v[3].value_transform, value_mean=best_v[3].value_mean,
                                 output_transform=best_v[3].output_transform, key_clip=best_k[2], value_clip=best_v[2])
        centred_values.append(best_v[4])
        seeds.append([best_k[1], best_v[1]])
        # per-token keys (what the clip search minimized) and, beside them, per-channel keys over pages at full
        # ranges (what the backend stores by default; its page ranges are chosen later, by the long-context check)
        ek, ev, ec = relative_errors(h.q, h.k, h.v, tr, group_size, obs.skip_first,
                                     other_key_pages=(DEFAULT_PAGE_SIZE["channel"],))
        errors.append([round(ek, 4), round(ev, 4)])
        channel_key_errors.append(round(ec, 4))
        transforms.append(tr)
    # every method: the factor of error-feedback rounding for per-channel keys (the backend's key_feedback option)
    transforms = [with_key_feedback(tr, obs.layers[i]) for i, tr in enumerate(transforms)]
    info = dict(stats.info)
    if seeds:
        info["sign_seeds"] = seeds  # [key, value] sign pattern of each layer (rotations._fixed_signs)
        info["heldout_relative_error"] = errors
        info["heldout_channel_key_error"] = channel_key_errors
        info["value_centred"] = centred_values
    if spec.query_scaling:
        info["key_scale_span"] = key_scale_spans(transforms)
    return Artifacts(
        method=spec.name, layers=transforms, fingerprint=stats.fingerprint, calibration=info,
        options={"group_size": group_size, "clip_grid": list(clip_grid) if spec.clip_search else None,
                 "method_spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__}},
    )


def calibrate(
    model: torch.nn.Module,
    batches: Iterable[torch.Tensor],
    method: str = "default",
    *,
    heldout_batches: int = 1,
    skip_first: int = 4,
    group_size: int | None = None,
    clip_grid=CLIP_GRID,
    forward: Callable | None = None,
    data_description: str = "",
    progress: bool = True,
    position_range: int | str | None = "auto",
    retrieval_heads: bool = True,
) -> Artifacts:
    """Calibrate ``model`` on token ``batches`` (``[B, T]`` LongTensors) and return :class:`Artifacts`.

    :func:`collect_statistics` then :func:`derive_artifacts`; see both. ``retrieval_heads``: also measure each KV
    head's induction score (one forward pass of random tokens said twice) and record the heads the backend keeps in
    BF16 by default (:func:`~.retrieval_heads.with_retrieval_heads`). Deterministic, and reproducible across
    machines and thread counts to rounding (eigenvector signs and zero-eigenvalue bases are fixed, see
    :func:`~.rotations.sorted_eigenbasis`); a clip ratio whose held-out errors tie can still differ.
    """
    stats = collect_statistics(model, batches, heldout_batches=heldout_batches, skip_first=skip_first,
                               forward=forward, data_description=data_description, progress=progress,
                               position_range=position_range)
    artifacts = derive_artifacts(stats, method, group_size=group_size, clip_grid=clip_grid, progress=progress)
    if retrieval_heads:
        from .retrieval_heads import induction_inputs, with_retrieval_heads

        try:
            induction_inputs(model)
        except ValueError as e:  # a hand-written model without a vocabulary to draw from: every head stays INT2
            log.warning("%s (calibrated without them)", e)
            return artifacts
        artifacts = with_retrieval_heads(model, artifacts, forward=forward)
    return artifacts


def token_batches(token_ids: list[int] | torch.Tensor, seq_len: int, batch_size: int, max_tokens: int | None = None):
    """Cut a token stream into ``[batch_size, seq_len]`` batches (drops the ragged end)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if max_tokens is not None:
        ids = ids[:max_tokens]
    per = seq_len * batch_size
    n = ids.numel() // per
    if n == 0:
        raise ValueError(f"oscar: {ids.numel()} tokens do not fill one batch of {batch_size} x {seq_len}")
    return list(ids[: n * per].view(n, batch_size, seq_len))
