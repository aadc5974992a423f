"""The torch.compile backend: rewrite attention to the INT2 cache, then hand the graph to Inductor.

    backend = oscar_backend(artifacts)          # or oscar_backend() for a Hadamard fallback rotation
    model.compile(backend=backend)              # in place, so model.generate() uses it
    cache = backend.new_cache(model, max_cache_len=4096)   # an OscarCache: no BF16 buffers at all
    model.generate(ids, past_key_values=cache, max_new_tokens=64)

The backend owns the INT2 storage. Every matched attention is bound to a *slot* named by its layer:
the layer number in the cache tensor's source path (``...layers[3].keys`` -> layer 3) or, for a
cache created inside the graph, the order of the attention call. Graphs compiled for prefill and
for decode therefore share their slots. One backend serves one sequence batch per cache size at a time
(sequential ``generate`` calls are fine; a cache continued after another cache of its size wrote the
storage raises). Sizes, buckets and capacity checks: :meth:`OscarBackend._storage_for`,
:mod:`oscar_compile.passes.capacity`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from . import ops
from .cache import LayerTransforms, PagedInt2KVCache, row_bytes
from .kernels.fp8_ring import RING_FORMATS
from .passes.capacity import guard_writes, plan_checks
from .passes.matcher import AttentionMatch, GraphAnalysis, analyze, cache_sources
from .passes.release import ReleasedBuffers
from .passes.rewrite import Rewritten, rewrite

log = logging.getLogger("oscar_compile.backend")


def _graph_logger() -> logging.Logger:
    """Graphs before/after go to a torch logging artifact named ``oscar`` (composes with TORCH_LOGS)."""
    try:
        from torch._logging._internal import getArtifactLogger, register_artifact

        register_artifact("oscar", "oscar-compile: each graph before and after the attention rewrite", visible=True)
        return getArtifactLogger(__name__, "oscar")
    except Exception:  # private torch API moved: fall back to a plain child logger
        return logging.getLogger("oscar_compile.backend.graphs")


graph_log = _graph_logger()

ROTATIONS = ("hadamard", "identity")
MIN_ROWS = 4  # smallest storage batch for a symbolic batch size


class UnsupportedGraphError(RuntimeError):
    """A graph that must be rewritten (it reads an OscarCache, or strict mode) could not be."""


@dataclass
class CompiledGraph:
    """What the backend did to one graph (for :func:`oscar_compile.explain`)."""

    index: int
    analysis: GraphAnalysis
    rewritten: list[Rewritten]
    before: str
    after: str

    @property
    def unmatched(self):
        return self.analysis.unmatched


@dataclass
class BackendOptions:
    num_sinks: int = 64
    window: int = 256
    page_size: int | None = None  # None: DEFAULT_PAGE_SIZE[key_format] (32 for per-channel keys, 16 per token)
    group_size: int | None = None
    rotation: str = "hadamard"  # fallback when no artifact is given
    quantize: bool = True  # False: keep every token in the BF16 ring (same code path, no INT2)
    max_seq_len: int = 4096  # caches that grow (torch.cat) hold this many; smallest storage for symbolic lengths
    cache_dtype: torch.dtype | None = None  # sinks/ring dtype; default: the model's KV dtype
    meta_dtype: torch.dtype = torch.float16
    inductor: bool = True  # False: run the rewritten graph eagerly (fast to compile, for tests)
    strict: bool = False  # raise if any attention call is left unmatched
    validate: bool = True  # propagate fake tensors through the rewritten graph before compiling
    # Free the dense K/V buffers a model owns (registered buffers) once every graph's reads and writes of
    # them were rewritten; only for a model attached by oscar_compile.compile, which then refuses eager calls.
    release_dead_caches: bool = True
    # {layer: window} of sliding-window layers (keys limited to the last `window` positions): their storage is
    # a BF16 ring of `window` tokens, no pages, bounded whatever the context (as a BF16 cache's). None: from the
    # artifact (recorded at calibration) or the config of a model attached by oscar_compile.compile; else every
    # layer gets INT2 pages (correct through the model's own sliding masks, but memory grows with the context).
    sliding_windows: dict | None = None
    # most tokens one call writes to a sliding-window layer (prefill longer prompts in chunks): bounds the chunk its
    # store returns with the window before it (B x (window - 1 + max_chunk) tokens a layer, a temporary)
    max_chunk: int = 4096
    # "ring": every sliding layer keeps its exact BF16 ring (at most the cache's length). "smallest": INT2 pages
    # instead where they take fewer bytes (a large window, a short cache); that quantizes half or more of what
    # those layers attend to, and cost Gemma 3 270M +15% perplexity at 2K tokens (+3% with rings).
    sliding_storage: str = "ring"
    # Layers whose keys and values stay in BF16 (the ring holds every token, no INT2 pages): for a layer whose
    # INT2 error the calibration measures as an outlier (Qwen2.5-Coder-0.5B's layer 0 at 2K tokens). Each costs
    # ~7x that layer's INT2 bytes; ``bits_per_element`` in the eval counts it. None: the artifact's (its
    # long-context check, ``oscar_compile.calibration.check_layers``), else none; () keeps every layer INT2.
    bf16_layers: tuple | None = None
    # {layer: group_size}: finer (scale, min) groups for the layers whose INT2 error dominates, ``group_size`` for the
    # rest (a group of 32 channels costs a head_dim-64 layer 0.5 bits an element more than one group a row). The
    # artifact's clip ratios were searched at its own group size.
    layer_group_sizes: dict | None = None
    # "channel" (default since 2026-12-05): keys per channel over each page's ``page_size`` tokens in the artifact's
    # basis (2 + 32 / page_size bits: 3 over pages of 32; the ring grows by page_size - 1 tokens). On the H100
    # (Gemma 3 270M, 16K scored tokens at 2K, 8K at 8K) it was -0.3% (-0.8..+0.2) and -1.8% (-2.8..-0.8)
    # perplexity against per-token keys and retrieved 15/24 and 10/24 needles against 10/24 and 4/24 (BF16:
    # 17/24, 10/24). "token": keys per token in groups of ``group_size`` channels, as values: 2.28 bits an
    # element at 128K and head_dim 128 against 2.66 (7.0x smaller than BF16 instead of 6.0x), full-depth decode
    # 1.12x faster (64 x 8K, H100).
    # On CUDA the Triton kernels take per-channel keys for pages of 16, 32, ... tokens (the reference any size).
    key_format: str = "channel"
    # {layer: "token" | "channel"}: layers whose keys take another format than ``key_format`` (same page size).
    # "auto": per-token keys for the artifact's ``token_key_layers`` (the long-context check's layers whose keys
    # lose clearly less per token); None: every layer ``key_format``. Not yet measured end to end (2026-12-05).
    layer_key_formats: dict | str | None = None
    # Per-channel keys: each channel's range over a page narrows to a layer's ratio of its width about its midpoint
    # (tokens outside take the end codes). "auto" (default): the ratios the artifact's long-context check chose on the
    # attention output (none for an unchecked artifact: full ranges); a dict {layer: ratio in (0, 1]}; None: full
    # ranges. Default since 2026-12-05: on the H100 it lowered perplexity against full ranges on the held-out
    # Qwen2.5-Coder-0.5B by 1.6% (2K) and 3.2% (8K), on SmolLM2-135M by 0.55% (2K), and cost Gemma 3 270M 0.34% at
    # 2K (eval_*_h100_*_ranges.json, eval_qwen2.5-coder-0.5b_h100_*_heldout.json).
    key_page_clips: dict | str | None = "auto"
    # Attention lowers each INT2 key's score by this times half its rounding noise's variance (PagedInt2KVCache's
    # score_debias): the noise otherwise inflates the INT2 keys' share of the attention. 0: off.
    score_debias: float = 0.0
    # Per-channel keys rounded with error feedback in the stored basis (quant.feedback_factor: each channel's rounding
    # error pushed onto the channels after it, weighted by the calibration queries' second moment), so the scores
    # lose less for the same bits. With key_page_clips="auto" it takes the page range ratios the long-context check
    # chose for keys rounded so (Artifacts.feedback_page_clips). "auto" (default since 2026-12-06): on where the
    # artifact carries the factors (calibrated since 2026-12-06, Artifacts.has_key_feedback) and keys are per
    # channel, else off; True: on, refused without factors; False: off. On the H100 against plain rounding, same
    # tokens (eval_*_h100_*k_feedback.json): SmolLM2 -0.09% (2K), -0.54% (8K, -1.02..-0.06); Qwen2.5-Coder-0.5B
    # (held out) -0.31% (2K), +0.53% (8K, -0.12..+1.19), -1.47% (32K, -2.81..-0.11); Gemma 3 270M -0.21% (2K),
    # -0.03% (8K), +0.02% (32K); pooled -0.16% (-0.29..-0.03); none worse beyond its interval. A prefill chunk's
    # store costs 2.4-2.6x (4K tokens, 64 rows, H100); a decode step nothing measurable.
    key_feedback: bool | str = "auto"
    # {layer: KV heads} kept in BF16 beside the layer's INT2 heads: retrieval heads, which copy one far token with a
    # sharp attention that averages no rounding error away (calibration/retrieval_heads.py). "auto": the artifact's
    # retrieval_heads (the heads with the highest induction score, at most 1/16 of them), none for an artifact
    # without induction scores; a float share in (0, 1]: the artifact's induction scores re-ranked at that share
    # (1/8 gives Gemma 3 its second global head: answer NLL at 2K +0.20 -> -0.08 nats, perplexity at 32K +1.01% ->
    # +0.10% against BF16, for 2.14 bits an element instead of 1.40; README); None or {}: every
    # head INT2. A head in BF16 costs ~13 bits an element more of its pages; ``bits_per_element`` in the eval counts
    # it. Layers in BF16 or with sliding windows are left alone.
    # Measured 2026-12-06 (README, Accuracy): the answer NLL against BF16 from +1.32 to +0.05 nats on SmolLM2 at 2K,
    # +0.16 to +0.06 on the held-out Qwen2.5-Coder-0.5B; +0.7-0.8 bits an element at 8K. The default since
    # 2026-12-06 (late), once its speed was known: on the H100 (Llama-3-8B shape, 8 layers, 1/16 of the heads) time
    # to first token +8% (16 x 4K) and +15% (64 x 8K), decode -18% and -16% against every head INT2, storage +25%
    # (the 4x slower first token measured before was every new cache re-recording the CUDA graphs, fixed by
    # hf._CounterPool); not yet measured at full depth or 1 x 128K. None: every head INT2, the most compression.
    exact_heads: dict | str | float | None = "auto"
    # How the exact_heads (and layers whose every KV head is one) hold their tokens after the sinks: "bf16", or "fp8":
    # FP8 e4m3 with an fp32 scale a token and head (kernels/fp8_ring.py), 8 + 32 / head_dim bits instead of 16. Gemma 3
    # 270M at 2K (CPU, 32 x 64) with exact_heads=1/8: -0.20% perplexity against BF16 in FP8, -0.11% in BF16, the
    # default (one BF16 head) +0.47%, for 4.43, 5.28 and 4.66 bits; answer NLL -0.045 nats over 32 prompts (README).
    # Not yet run on a GPU (2026-12-06: no device started).
    exact_format: str = "bf16"
    # How INT2 layers hold their newest tokens (the ring: the window, and with per-channel keys the page being filled)
    # after the sinks: "bf16" (the cache dtype), or "fp8" as exact_format's. Sliding-window layers keep theirs in the
    # cache dtype. Added 2026-12-07: tested against the reference in the interpreter, not yet run on a GPU. At 2K
    # (CPU, 32 x 64), paired against the default: SmolLM2 +0.10% (-0.17..+0.37) perplexity for 4.64 bits instead of
    # 5.60, Gemma 3 -0.02% (-0.13..+0.08) for 4.54 instead of 4.66 (its sliding-window layers keep 16-bit rings),
    # Qwen2.5-Coder-0.5B (held out, 16 x 64) +0.19% (-0.19..+0.56) for 5.22 instead of 6.14. Three models at 2K on
    # the CPU, never on a GPU: the default stays "bf16".
    ring_format: str = "bf16"


DEFAULT_PAGE_SIZE = {"channel": 32, "token": 16}  # tokens a page, by key format (BackendOptions.page_size=None)


def resolve_page_size(key_format: str, page_size: int | None, who: str = "oscar") -> int:
    """``page_size``, or the key format's default where it is None. A page holds at least one token (the cache refuses
    fewer than two for per-channel keys, which are quantized over a page's tokens)."""
    if page_size is None:
        return DEFAULT_PAGE_SIZE[key_format]
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"{who}: page_size must be a positive int (tokens a page), got {page_size!r}")
    return page_size


def _is_layer(k) -> bool:
    return isinstance(k, int) and not isinstance(k, bool) and k >= 0


def _layer_map(value, valid, what: str, who: str) -> dict:
    """``value`` as a ``{layer index: setting}`` dict, every setting passing ``valid``; else a ValueError saying
    ``what`` the option maps layers to."""
    if not isinstance(value, dict) or not all(_is_layer(k) and valid(v) for k, v in value.items()):
        raise ValueError(f"{who}: {what}, got {value!r}")
    return dict(value)


def resolve_key_page_clips(clips, artifacts=None, who: str = "oscar_backend", feedback: bool = False) -> dict:
    """``{layer: page range ratio}`` from the ``key_page_clips`` option: a dict (checked), "auto" (the default: the
    artifact's ``key_page_clips``, none without one) or None (none: every channel's full range)."""
    if clips is None:
        return {}
    if clips == "auto":
        if artifacts is None:
            return {}
        # keys rounded with error feedback: the ratios the check chose for them, where it did
        return dict((feedback and getattr(artifacts, "feedback_page_clips", None)) or artifacts.key_page_clips)
    ratio = lambda r: isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 < r <= 1.0  # noqa: E731
    clips = _layer_map(clips, ratio, "key_page_clips maps layer indices to ratios in (0, 1] (or is 'auto' or None)",
                       who)
    return {k: float(r) for k, r in clips.items()}


def resolve_key_feedback(feedback, key_format: str, artifacts=None, who: str = "oscar_backend") -> bool:
    """Whether keys are rounded with error feedback, from the ``key_feedback`` option: "auto" (the default: where
    the artifact carries its factors and keys are per channel), True (refused without them) or False."""
    if not (isinstance(feedback, bool) or feedback == "auto"):
        raise ValueError(f"{who}: key_feedback is 'auto', True or False, got {feedback!r}")
    if feedback == "auto":
        return key_format == "channel" and artifacts is not None and artifacts.has_key_feedback
    if feedback and key_format != "channel":
        raise ValueError(f"{who}: key_feedback=True rounds keys stored per channel: it needs key_format='channel', "
                         f"got {key_format!r}")
    if feedback and not (artifacts is not None and artifacts.has_key_feedback):
        raise ValueError(f"{who}: key_feedback=True needs an artifact with its error-feedback factors "
                         + ("(none was given)" if artifacts is None else
                            "(this one was calibrated before 2026-12-06: recalibrate)"))
    return feedback


def resolve_exact_heads(heads, artifacts=None, who: str = "oscar_backend") -> dict:
    """``{layer: sorted KV heads}`` from the ``exact_heads`` option: a dict (checked), "auto" (the artifact's
    retrieval heads), a share in (0, 1] (the artifact's induction scores re-ranked at that share of the KV heads)
    or None (none)."""
    if heads is None:
        return {}
    if isinstance(heads, str) and heads == "auto":
        return dict(artifacts.retrieval_heads) if artifacts is not None else {}
    if isinstance(heads, float):
        from .calibration.retrieval_heads import retrieval_heads_at

        if artifacts is None:
            raise ValueError(f"{who}: exact_heads={heads!r} re-chooses an artifact's retrieval heads at that share: "
                             "pass the artifact")
        try:
            return retrieval_heads_at(artifacts, heads)
        except ValueError as e:
            raise ValueError(f"{who}: exact_heads={heads!r}: {e}") from None
    ok = lambda hs: (isinstance(hs, (tuple, list)) and len(hs) > 0  # noqa: E731
                     and all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hs))
    checked = _layer_map(heads, ok, "exact_heads maps layer indices to non-empty lists of KV head indices (or is "
                         "'auto', or a float share of the KV heads in (0, 1])", who)
    return {layer: tuple(sorted(set(hs))) for layer, hs in checked.items()}


def resolve_layer_key_formats(formats, artifacts=None, who: str = "oscar_backend") -> dict:
    """``{layer: key format}`` from the ``layer_key_formats`` option: a dict (checked), "auto" (per-token keys for
    the artifact's ``token_key_layers``) or None (none)."""
    if formats is None:
        return {}
    if formats == "auto":
        return {layer: "token" for layer in (artifacts.token_key_layers if artifacts is not None else ())}
    return _layer_map(formats, lambda f: f in ("token", "channel"),
                      "layer_key_formats maps layer indices to 'token' or 'channel' (or is 'auto')", who)


class OscarBackend:
    """A ``torch.compile`` backend; create with :func:`oscar_backend`."""

    def __init__(self, artifacts=None, observer=None, **options):
        unknown = set(options) - set(BackendOptions.__dataclass_fields__)
        if unknown:
            raise TypeError(f"oscar_backend: unknown options {sorted(unknown)}; valid: {sorted(BackendOptions.__dataclass_fields__)}")
        self.options = BackendOptions(**options)
        if self.options.sliding_storage not in ("ring", "smallest"):
            raise ValueError(f"oscar_backend: sliding_storage must be 'ring' or 'smallest', got {self.options.sliding_storage!r}")
        if self.options.key_format not in ("token", "channel"):
            raise ValueError(f"oscar_backend: key_format must be 'token' or 'channel', got {self.options.key_format!r}")
        self.options.page_size = resolve_page_size(self.options.key_format, self.options.page_size, "oscar_backend")
        if self.options.rotation not in ROTATIONS:
            raise ValueError(f"oscar_backend: rotation must be one of {ROTATIONS}, got {self.options.rotation!r}")
        layers = self.options.bf16_layers
        if layers is None:
            layers = artifacts.bf16_layers if artifacts is not None else ()
        if isinstance(layers, int) or not all(isinstance(x, int) and x >= 0 for x in layers):
            raise ValueError(f"oscar_backend: bf16_layers must be layer indices (a tuple of ints >= 0), got {layers!r}")
        self.options.bf16_layers = tuple(sorted(set(layers)))
        self.options.layer_group_sizes = _layer_map(
            self.options.layer_group_sizes or {}, lambda g: isinstance(g, int) and not isinstance(g, bool) and g > 0,
            "layer_group_sizes maps layer indices to group sizes (ints > 0)", "oscar_backend")
        self.options.layer_key_formats = resolve_layer_key_formats(self.options.layer_key_formats, artifacts)
        self.options.key_feedback = resolve_key_feedback(self.options.key_feedback, self.options.key_format, artifacts)
        self.options.key_page_clips = resolve_key_page_clips(self.options.key_page_clips, artifacts,
                                                             feedback=self.options.key_feedback)
        self.options.exact_heads = resolve_exact_heads(self.options.exact_heads, artifacts)
        if self.options.exact_format not in RING_FORMATS:
            raise ValueError(f"oscar_backend: exact_format must be one of {RING_FORMATS} (how retrieval heads hold "
                             f"their tokens), got {self.options.exact_format!r}")
        if self.options.ring_format not in RING_FORMATS:
            raise ValueError(f"oscar_backend: ring_format must be one of {RING_FORMATS} (how INT2 layers hold their "
                             f"newest tokens), got {self.options.ring_format!r}")
        self.artifacts = artifacts
        if self.options.sliding_windows is None and artifacts is not None and artifacts.sliding_windows:
            self.options.sliding_windows = artifacts.sliding_windows  # recorded at calibration
        self.observer = observer  # observe mode (calibration): record what would be stored, rewrite nothing
        self.storage: dict[tuple, PagedInt2KVCache] = {}
        self.graphs: list[CompiledGraph] = []
        self.released = ReleasedBuffers()
        # cache tensors by Dynamo source: "int2" once a graph rewrote their writes (they stop receiving tokens),
        # "dense" once a graph wrote or read them unrewritten; a graph mixing the two is refused (_check_ownership)
        self._cache_use: dict[str, str] = {}
        self._model = None  # weakref to the model attached by oscar_compile.compile (owner of releasable buffers)
        self._first_kv_heads: dict[int, int] = {}  # tensor parallelism: layer -> first KV head this rank holds

    # ------------------------------------------------------------------ torch.compile entry
    def __call__(self, gm: fx.GraphModule, example_inputs, **kwargs):
        mode = kwargs.pop("mode", None)
        config_patches = dict(kwargs.pop("options", None) or {})
        kwargs.pop("dynamic", None)
        kwargs.pop("fullgraph", None)
        record = self.transform(gm, example_inputs)
        checks = self._host_checks(gm, record)
        if not self.options.inductor:
            return guard_writes(gm.forward, checks)
        from torch._inductor.compile_fx import compile_fx

        if mode in ("reduce-overhead", "max-autotune") and "triton.cudagraphs" not in config_patches:
            config_patches["triton.cudagraphs"] = True
        return guard_writes(compile_fx(gm, example_inputs, config_patches=config_patches or None), checks)

    def _host_checks(self, gm: fx.GraphModule, record: CompiledGraph):
        """Capacity checks the compiled graph runs behind, on the host (passes/capacity.py): a write past the
        end of the cache raises before anything runs, eagerly or under CUDA graphs, with no device read."""
        return plan_checks(gm, record.rewritten, self.options.max_seq_len)

    def transform(self, gm: fx.GraphModule, example_inputs=None) -> CompiledGraph:
        """Analyze and rewrite ``gm`` in place; returns the record kept in ``self.graphs``."""
        before = gm.code
        analysis = analyze(gm)
        must = [u for u in analysis.unmatched if u.stub]
        if must or (self.options.strict and analysis.unmatched):
            bad = must or analysis.unmatched
            raise UnsupportedGraphError(
                "oscar: cannot rewrite "
                + "; ".join(f"{u.kind} {u.node.name}: {u.reason}" for u in bad)
                + ("" if not must else " - this graph reads an OscarCache, which holds no BF16 data, so it cannot "
                   "fall back to the model's own attention")
            )
        if self.observer is not None:
            from .passes.observe import insert_observers

            self._refuse_released_uses(gm, example_inputs)
            insert_observers(gm, analysis, self.observer.record, lambda m: self._slot(m)[2])
            record = CompiledGraph(len(self.graphs), analysis, [], before, gm.code)
            self.graphs.append(record)
            return record
        if self.artifacts is not None:
            self._check_artifact_layers(analysis)
        self._check_ownership(analysis)
        rewritten = rewrite(gm, analysis, self._storage_for)
        self._refuse_released_uses(gm, example_inputs)
        if self.options.validate and example_inputs is not None:
            _validate(gm, example_inputs)
        self._release_dead_caches(gm, example_inputs, rewritten)
        record = CompiledGraph(len(self.graphs), analysis, rewritten, before, gm.code)
        self.graphs.append(record)
        self._log(record)
        return record

    # ------------------------------------------------------------------ dense buffers made dead
    def attach(self, model: torch.nn.Module) -> None:
        """Let this backend free ``model``'s own dense K/V buffers once the rewrite has made them dead
        (``release_dead_caches``), and refuse eager forwards from then on (they would read freed memory)."""
        import weakref

        self._model = weakref.ref(model)
        from .tensor_parallel import first_kv_heads, tensor_parallel_size

        if tensor_parallel_size(model) > 1:  # which KV heads of each layer this rank holds, from its k_proj shards
            from .hf import kv_geometry

            self._first_kv_heads = first_kv_heads(model, kv_geometry(model)[1])
        if self.options.sliding_windows is None:
            from .hf import sliding_windows

            self.options.sliding_windows = sliding_windows(model)
        released = self.released

        def refuse_eager(module, args):
            # is_compiling() first: inside a compiled forward the hook is traced away without a guard.
            if not torch.compiler.is_compiling() and released:
                raise ops.UnrewrittenCacheError(
                    f"oscar: {type(module).__name__} ran eagerly, but oscar_backend released its dense K/V buffers "
                    f"({', '.join(released.names()[:4])}{', ...' if len(released.names()) > 4 else ''}: "
                    f"{released.nbytes / 2**30:.2f} GiB) after rewriting every read and write of them to its INT2 "
                    "cache. Call it through the compiled model (a Dynamo fallback to eager, e.g. after too many "
                    "recompiles, also lands here), or compile with release_dead_caches=False to keep them."
                )

        self.detach()
        self._eager_guard = model.register_forward_pre_hook(refuse_eager)

    def detach(self) -> None:
        """Stop refusing eager forwards of the attached model (use it only if its buffers were not released,
        or were reallocated: gpt-fast's ``setup_caches``)."""
        guard = getattr(self, "_eager_guard", None)
        if guard is not None:
            guard.remove()
        self._eager_guard = None

    def _release_dead_caches(self, gm: fx.GraphModule, example_inputs, rewritten: list[Rewritten]) -> None:
        model = self._model() if self._model is not None else None
        if not (self.options.release_dead_caches and model is not None and example_inputs is not None):
            return
        candidates = {n for r in rewritten if r.match.write_kind != "cat"
                      for n in (r.match.key_write.buffer, r.match.value_write.buffer)}
        owned = {id(b) for b in model.buffers()}
        for rec in self.released.release_dead(gm, example_inputs, candidates, owned):
            log.info("oscar: released %s (%.1f MiB): every read and write of it now goes to the INT2 cache",
                     rec.name, rec.nbytes / 2**20)

    def _check_ownership(self, analysis: GraphAnalysis) -> None:
        """Refuse a graph that would read or write a cache tensor densely after another graph moved its tokens
        to INT2 storage, or the reverse: one of the two would miss the other's tokens. (transformers'
        StaticCache sliding-window layers write with ``index_copy_`` until the window is full, then by
        roll + ``copy_``, which oscar does not rewrite: without this check the later steps would attend to
        a buffer that never received a token.)"""
        int2, dense = cache_sources(analysis)
        clash = sorted((int2 & {s for s, u in self._cache_use.items() if u == "dense"})
                       | (dense & {s for s, u in self._cache_use.items() if u == "int2"}))
        if clash:
            raise UnsupportedGraphError(
                f"oscar: this graph uses the cache tensor(s) {', '.join(clash[:4])} in a way that contradicts an "
                "earlier graph: one of them moved its writes to oscar's INT2 cache and the other reads or writes the "
                "tensor itself, so one would miss the other's tokens (a sliding-window layer of transformers' "
                "StaticCache does this once its window is full). Use OscarCache (sliding-window layers "
                "included), or see `oscar explain` for why the attention was not rewritten.")
        self._cache_use.update({s: "int2" for s in int2})
        self._cache_use.update({s: "dense" for s in dense})

    def _refuse_released_uses(self, gm: fx.GraphModule, example_inputs) -> None:
        if example_inputs is None or not self.released:
            return
        bad = self.released.uses(gm, example_inputs)
        if bad:
            raise UnsupportedGraphError(
                "oscar: this graph uses dense K/V buffers that oscar released after an earlier graph rewrote them "
                "(they hold no memory now): " + "; ".join(bad[:4]) + ". Check `oscar explain` for why its attention "
                "was not rewritten, or compile with release_dead_caches=False."
            )

    # ------------------------------------------------------------------ storage
    def _slot(self, m: AttentionMatch) -> tuple[Any, str, int]:
        layer = m.source_layer
        if layer is not None:
            return ("layer", layer), f"layer {layer}", layer
        if m.source is not None:
            return ("source", m.source), f"source {m.source}", m.index
        return ("layer", m.index), f"layer {m.index}", m.index

    def _storage_for(self, m: AttentionMatch) -> tuple[PagedInt2KVCache, int, str]:
        """The INT2 storage of ``m``'s slot for its batch and cache length.

        A static size gets storage of exactly that size. A symbolic one (Dynamo makes a size symbolic once it
        changes between calls: a second cache size, a second batch size) gets a bucket, the next power of two
        (at least 4 rows, at least ``max_seq_len`` tokens), and the guard ``size <= bucket`` joins the graph's
        guards: a larger cache compiles once more (``TORCH_LOGS=recompiles`` names the guard) and no call
        outgrows its storage. One storage per slot and size (static) or bucket (symbolic), so their number is
        bounded by the sizes the model saw; they stay allocated while a graph using them lives (see :meth:`reset`).
        When Dynamo continues a sequence with a graph of another storage, the host moves its rows first
        (:mod:`~oscar_compile.passes.capacity`).
        """
        key, name, layer = self._slot(m)
        meta_val = (m.key_write.node if m.key_write.kind == "cat" else m.key_write.buffer).meta["example_value"]
        dtype = self.options.cache_dtype or meta_val.dtype
        device = meta_val.device
        length = m.max_len if m.max_len is not None else self.options.max_seq_len
        rows, max_len = _bucket(m.batch, MIN_ROWS), _bucket(length, self.options.max_seq_len)
        for size, bucket in ((m.batch, rows), (length, max_len)):
            if not isinstance(size, int) and not size <= bucket:  # installs the guard; the example fits
                raise UnsupportedGraphError(f"oscar: {name}: size {size} does not fit its bucket of {bucket}")
        full_key = (key, (m.num_kv_heads, m.head_dim, dtype, str(device)), rows, max_len)
        if full_key not in self.storage:
            o = self.options
            sliding = (o.sliding_windows or {}).get(layer) if key[0] == "layer" else None
            group = o.layer_group_sizes.get(layer, o.group_size) if key[0] == "layer" else o.group_size
            if (sliding is not None and o.sliding_storage == "smallest"
                    and not _ring_is_smaller(o, m.num_kv_heads, m.head_dim, dtype, sliding, max_len, group)):
                sliding = None  # INT2 pages for the whole cache take fewer bytes (a large window, a short cache)
            quantize = o.quantize and not (key[0] == "layer" and layer in o.bf16_layers)
            int2_heads, exact, whole_layer_exact = tuple(range(m.num_kv_heads)), (), False
            if quantize and sliding is None and key[0] == "layer" and layer in o.exact_heads:
                first = self._first_kv_heads.get(layer, 0)  # tensor parallelism: this rank's heads
                exact = tuple(h - first for h in o.exact_heads[layer] if first <= h < first + m.num_kv_heads)
                int2_heads = tuple(h for h in int2_heads if h not in exact)
                if not int2_heads:  # every head exact: the layer is a BF16 (or FP8: exact_format) layer
                    quantize, int2_heads, exact, whole_layer_exact = False, exact, (), True
            cache = PagedInt2KVCache(
                1, len(int2_heads), m.head_dim, max_batch_size=rows, max_seq_len=max_len, page_size=o.page_size,
                num_sinks=o.num_sinks, window=o.window, group_size=group, identity_block_table=True,
                quantize=quantize, sliding_window=sliding, max_chunk=o.max_chunk,
                key_format=o.layer_key_formats.get(layer, o.key_format) if key[0] == "layer" else o.key_format,
                score_debias=o.score_debias, dtype=dtype,
                meta_dtype=o.meta_dtype, device=device,
                ring_format=o.exact_format if whole_layer_exact else o.ring_format if quantize and sliding is None
                else "bf16",
            )
            tr = self._transforms(layer, m.num_kv_heads, m.head_dim)
            if key[0] == "layer" and layer in o.key_page_clips:
                tr = replace(tr, key_page_clip=o.key_page_clips[layer])
            if not (o.key_feedback and key[0] == "layer"):
                tr = replace(tr, key_feedback=None)
            if exact:
                tr = tr.select(int2_heads)
                cache.keep_heads_exact(int2_heads, exact, ring_format=o.exact_format).set_transforms(
                    0, LayerTransforms.identity(len(exact), m.head_dim, device=device))
            cache.set_transforms(0, tr)
            self.storage[full_key] = cache
            log.info("oscar: %s: new INT2 storage for %d row(s) x %d tokens (batch %s, cache length %s), %.2f MiB; "
                     "this backend holds %d storages, %.2f MiB", name, rows, max_len, m.batch, length,
                     cache.nbytes / 2**20, len(self.storage), self.kv_bytes / 2**20)
        return self.storage[full_key], 0, name

    def _check_artifact_layers(self, analysis: GraphAnalysis) -> None:
        """Before compiling: every matched layer must exist in the artifact with the same shapes."""
        for m in analysis.matches:
            layer = self._slot(m)[2]
            self.artifacts.layer_transforms(layer, m.num_kv_heads, m.head_dim, self._first_kv_heads.get(layer))

    def _transforms(self, layer: int, heads: int, d: int) -> LayerTransforms:
        if self.artifacts is not None:
            return self.artifacts.layer_transforms(layer, heads, d, self._first_kv_heads.get(layer))
        if self.options.rotation == "identity":
            return LayerTransforms.identity(heads, d)
        return LayerTransforms.hadamard(heads, d)

    # ------------------------------------------------------------------ user helpers
    def new_cache(self, model_or_config, max_cache_len: int, max_batch_size: int | None = None, dtype=None, device=None):
        """An :class:`~oscar_compile.OscarCache` for ``model`` (no BF16 storage; use with this backend)."""
        from .hf import OscarCache

        return OscarCache(model_or_config, max_cache_len=max_cache_len, max_batch_size=max_batch_size, dtype=dtype, device=device)

    @property
    def kv_bytes(self) -> int:
        """Bytes of INT2 KV storage this backend allocated (all slots)."""
        return sum(c.nbytes for c in self.storage.values())

    def reset(self) -> None:
        """Drop the INT2 storage and the records of the graphs that use it (their graph modules hold it).
        Graphs Dynamo still caches keep theirs alive: to free the memory, also ``torch._dynamo.reset()``."""
        self.storage.clear()
        self.graphs.clear()
        self._cache_use.clear()

    def _log(self, rec: CompiledGraph) -> None:
        if log.isEnabledFor(logging.INFO):
            from .explainer import format_graph_summary

            log.info("oscar graph %d:\n%s", rec.index, format_graph_summary(rec))
        if graph_log.isEnabledFor(logging.DEBUG):
            from .explainer import graph_diff

            graph_log.debug("oscar graph %d before/after:\n%s", rec.index, graph_diff(rec.before, rec.after))


def _hint(size) -> int:
    """The value a symbolic size had in the example inputs."""
    hint = size.node.hint
    if hint is None:
        raise UnsupportedGraphError(f"oscar: size {size} has no example value (data-dependent); cannot size storage")
    return int(hint)


def _bucket(size, floor: int) -> int:
    """Storage for ``size``: itself when static; for a symbolic size its example rounded up to a power of two
    >= ``floor`` (a symbolic size is >= 2, so a bucket of 2 would pin it to exactly 2)."""
    if isinstance(size, int):
        return size
    return max(floor, 1 << (_hint(size) - 1).bit_length())


def _validate(gm: fx.GraphModule, example_inputs) -> None:
    """Run the rewritten graph on fake tensors: shape or dtype errors surface now, not as wrong answers."""
    from torch._dynamo.utils import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [fake_mode.from_tensor(x, static_shapes=False) if isinstance(x, torch.Tensor) and not
              isinstance(x, torch._subclasses.FakeTensor) else x for x in example_inputs]
    with fake_mode:
        # Buffers we registered are real tensors; let the fake mode wrap them.
        prev = fake_mode.allow_non_fake_inputs
        fake_mode.allow_non_fake_inputs = True
        try:
            FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)
        finally:
            fake_mode.allow_non_fake_inputs = prev


def oscar_backend(artifacts=None, **options) -> OscarBackend:
    """A ``torch.compile`` backend that puts the KV cache of any model in INT2.

    Args:
        artifacts: calibration artifacts (:func:`oscar_compile.load_artifacts`); ``None`` uses the
            fallback ``rotation`` for every layer.
        **options: see :class:`BackendOptions` (``num_sinks``, ``window``, ``page_size``, ``group_size``,
            ``rotation``, ``quantize``, ``max_seq_len``, ``cache_dtype``, ``meta_dtype``, ``inductor``,
            ``strict``, ``validate``).
    """
    return OscarBackend(artifacts, **options)


_DEFAULT_BACKEND: OscarBackend | None = None


def default_backend() -> OscarBackend:
    """The process-wide backend behind ``torch.compile(..., backend="oscar")`` (default options)."""
    global _DEFAULT_BACKEND
    if _DEFAULT_BACKEND is None:
        _DEFAULT_BACKEND = OscarBackend()
    return _DEFAULT_BACKEND


def oscar_entry_point(gm, example_inputs, **kwargs):
    """The named backend ``"oscar"``. One shared instance, so prefill and decode graphs share storage."""
    return default_backend()(gm, example_inputs, **kwargs)


RECOMPILE_LIMIT = 64  # graphs per compiled function that oscar_compile.compile lets Dynamo keep


def _ring_is_smaller(o: BackendOptions, heads: int, d: int, dtype: torch.dtype, sliding: int, max_len: int,
                     group_size: int | None) -> bool:
    """Whether a sliding-window layer's BF16 ring (``sliding`` tokens) takes fewer bytes than the storage the
    layer would otherwise get for ``max_len`` tokens (sinks, window and INT2 pages of the layer's ``group_size``;
    all BF16 without quantization): a window of 4096 costs as much as ~23K tokens in INT2 at head_dim 128."""
    group = group_size or d
    ring = row_bytes(heads, d, min(sliding, max_len), 0, group, dtype, o.meta_dtype)
    if not o.quantize:
        return ring < row_bytes(heads, d, max_len, 0, group, dtype, o.meta_dtype)
    # the INT2 storage as the cache counts it (keys and values: its ring, whole pages for per-channel keys)
    int2 = PagedInt2KVCache(1, heads, d, max_seq_len=max_len, page_size=o.page_size, num_sinks=o.num_sinks,
                            window=o.window, group_size=group, key_format=o.key_format,
                            score_debias=o.score_debias, dtype=dtype,
                            meta_dtype=o.meta_dtype, device="meta")
    return 2 * ring < int2.memory_report(max_len).int2_bytes


def compile(model, artifacts=None, *, fullgraph: bool = False, mode: str | None = None, dynamic=None,
            prefill_chunk_size: int | None = None, **options):
    """Compile ``model`` in place with the oscar backend and return it (``model.generate`` then uses it).

    ``prefill_chunk_size``: ``generate`` prefills long prompts in chunks of this many tokens
    (transformers' ``generation_config.prefill_chunk_size``): activations and the attention mask then
    scale with the chunk, not the prompt. Each chunk reads the earlier ones from the INT2 cache.
    A model that owns dense K/V buffers (a hand-written decoder) gets them released once the rewrite
    has made them dead (``release_dead_caches``, default on); eager forwards are refused from then on.

    ``torch.compile(model)`` returns a wrapper whose ``generate`` still calls the uncompiled model;
    this uses ``nn.Module.compile`` instead, and tells transformers not to wrap the model in a second
    ``torch.compile`` of its own during ``generate`` (that one would not rewrite attention).
    The backend is available as ``model.oscar_backend``.

    Each cache-size bucket (see :meth:`OscarBackend._storage_for`) compiles a prefill and a decode graph,
    and Dynamo stops compiling a function after ``torch._dynamo.config.recompile_limit`` graphs (8 by
    default: four buckets); this raises that process-wide limit to at least :data:`RECOMPILE_LIMIT`.
    """
    if artifacts is not None:
        artifacts.validate(model)
    backend = oscar_backend(artifacts, **options)
    backend.attach(model)
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
    if getattr(config, limit) < RECOMPILE_LIMIT:
        log.info("oscar: raising torch._dynamo.config.%s from %d to %d (a prefill and a decode graph per "
                 "cache-size bucket)", limit, getattr(config, limit), RECOMPILE_LIMIT)
        setattr(config, limit, RECOMPILE_LIMIT)
    model.compile(backend=backend, fullgraph=fullgraph, mode=mode, dynamic=dynamic)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.disable_compile = True
        if prefill_chunk_size is not None:
            model.generation_config.prefill_chunk_size = int(prefill_chunk_size)
    model.oscar_backend = backend
    return model
