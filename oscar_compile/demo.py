"""``oscar demo``: the main job on a CPU, in a few minutes.

Calibrates SmolLM2-135M (or loads its cached artifacts), compiles it with the oscar backend, shows
what the backend rewrote, generates from a few prompts next to the unquantized model, compares the
KV memory, and measures perplexity through the INT2 cache against BF16 and Hadamard INT2.
"""

from __future__ import annotations

import time

import torch

DEMO_PROMPTS = (
    "Summarize this passage in two sentences.\n\n{passage}",
    "Explain in a few sentences why the sky is blue.",
)


def calibration_text_name() -> str:
    """The Debian handbook (a Debian package) where apt can fetch it, else the Paul Graham essays (PyPI).

    Either is disjoint from the Wikipedia evaluation text.
    """
    import shutil

    from .assets import cache_dir

    if (cache_dir() / "text" / "debian-handbook.txt").exists() or shutil.which("apt-get"):
        return "debian-handbook"
    print("oscar: no apt-get here for the Debian handbook; calibrating on the Paul Graham essays instead")
    return "paul-graham"


def _calibration_rows(seq_len: int) -> int:
    """Sequences a calibration batch: 4 x 512 by default; one sequence a batch from 2048 tokens."""
    return max(1, 2048 // seq_len)


def cached_artifacts_for(model, tok, model_name: str, methods: list[str], tokens: int, progress: bool = True,
                         seq_len: int = 512, check_len: int = 0, check_seqs: int = 2, num_sinks: int = 64,
                         window: int = 256, position_range: int | str | None = "auto", retrieval_heads: bool = True):
    """Artifacts of each method for ``model``, calibrated on the handbook (see :func:`calibration_text_name`)
    in sequences of ``seq_len`` tokens and cached under the user cache dir. The statistics are collected once,
    for the methods not cached. ``check_len``: also check every layer on ``check_seqs`` sequences of that many
    tokens (the handbook's text after the calibration tokens; :func:`~.calibration.check_layers`, with the
    cache's ``num_sinks`` and ``window`` exact), which keeps the outlier layers in BF16; cached apart from the
    unchecked artifacts. ``position_range``: calibration rows start at positions spread over that many
    (:func:`~.calibration.tracer.position_spread_forward`; ``"auto"``: the model's context, ``None``: all at
    position 0); cached apart. ``retrieval_heads``: give the returned artifacts their retrieval heads (measured once
    and saved where missing; the checked ones after the check, which they depend on).

    Returns ``({method: Artifacts}, {methods loaded from the cache})``.
    """
    from .assets import cache_dir, load_text
    from .calibration import (ArtifactError, check_layers, collect_statistics, derive_artifacts, load_artifacts,
                              parse_method, token_batches)
    from .backend import DEFAULT_PAGE_SIZE, BackendOptions
    from .calibration.tracer import resolve_position_range

    position_range = resolve_position_range(model, position_range, seq_len)  # resolved once: it names the cache

    def path(method, checked=False):
        seq = "" if seq_len == 512 else f"-s{seq_len}"
        seq += f"-p{position_range}" if position_range else ""
        check = f"-c{check_len}x{check_seqs}-sw{num_sinks}_{window}" if checked else ""
        # the check measures the backend's key format: per-token checks (before 2026-12-05) keep their old names, and
        # per-channel checks that chose no page range ratios theirs ("-kc32"; "-kc32r" since)
        check += f"-kc{DEFAULT_PAGE_SIZE['channel']}r" if checked and BackendOptions.key_format == "channel" else ""
        return cache_dir() / "artifacts" / f"{model_name}-{parse_method(method).name}-{tokens}{seq}{check}"

    if check_len:
        wanted = list(dict.fromkeys(methods))
        calibrated = [m for m in wanted if parse_method(m).clip_search]  # the check measures the clipped methods
        todo = [m for m in calibrated if not (path(m, True) / "oscar.json").exists()]
        # a checked artifact is complete: its unchecked parent is needed only to check it (so a machine that got the
        # checked artifacts from elsewhere, like the GPU's, need not carry the parents)
        parents = [m for m in wanted if m not in calibrated or m in todo]
        found, cached = cached_artifacts_for(model, tok, model_name, parents, tokens, progress, seq_len,
                                             position_range=position_range, retrieval_heads=False)
        stream = tok(load_text(calibration_text_name()), return_tensors="pt").input_ids[0] if todo else None
        start = tokens + seq_len * _calibration_rows(seq_len)  # past every calibration token (statistics, held out)
        if todo and stream.numel() < start + check_len * check_seqs:
            raise ValueError(f"oscar: the calibration text has {stream.numel()} tokens, too few for a check of "
                             f"{check_seqs} x {check_len} tokens after the {start} calibration tokens")
        for m in calibrated:
            if m in todo:
                batches = [stream[start + i * check_len:start + (i + 1) * check_len][None] for i in range(check_seqs)]
                found[m] = check_layers(model, found[m], batches, num_sinks=num_sinks, window=window, progress=progress)
                found[m].save(path(m, True))
                cached.discard(m)
            else:
                found[m] = load_artifacts(path(m, True))
                found[m].validate(model)
                cached.add(m)
            found[m] = _with_retrieval_heads(model, found[m], path(m, True), progress)
        return {m: found[m] for m in wanted}, cached

    found, cached = {}, set()
    wanted = list(dict.fromkeys(methods))  # unique, in order
    for method in wanted:
        if (path(method) / "oscar.json").exists():
            try:
                art = load_artifacts(path(method))
                art.validate(model)
                found[method] = art
                cached.add(method)
            except ArtifactError as e:
                print(f"oscar: cached artifacts at {path(method)} unusable ({e}); recalibrating")
    missing = [m for m in wanted if m not in found]
    if missing:
        text_name = calibration_text_name()
        tok_ids = tok(load_text(text_name), return_tensors="pt").input_ids[0]
        seq, bs = seq_len, _calibration_rows(seq_len)
        batches = token_batches(tok_ids, seq, bs, max_tokens=tokens + seq * bs)
        stats = collect_statistics(model, batches, data_description=text_name, progress=progress,
                                   position_range=position_range)
        for method in missing:
            found[method] = derive_artifacts(stats, method, progress=progress)
            found[method].save(path(method))
    if retrieval_heads:
        for method in wanted:
            found[method] = _with_retrieval_heads(model, found[method], path(method), progress)
    return found, cached


def _with_retrieval_heads(model, artifacts, directory, progress: bool = True):
    """``artifacts`` with their retrieval heads (the induction scores: one forward pass), measured and saved once for
    an artifact cached before they were (2026-12-06)."""
    from .calibration import with_retrieval_heads

    if artifacts.has_retrieval_heads:
        return artifacts
    if progress:
        print(f"oscar: measuring the retrieval heads of {directory.name} (induction scores)")
    artifacts = with_retrieval_heads(model, artifacts)
    artifacts.save(directory)
    return artifacts


def cached_artifacts(model, tok, model_name: str, method: str, tokens: int, progress: bool = True,
                     position_range: int | str | None = "auto"):
    """One method's artifacts (see :func:`cached_artifacts_for`) and whether they came from the cache."""
    found, cached = cached_artifacts_for(model, tok, model_name, [method], tokens, progress,
                                         position_range=position_range)
    return found[method], method in cached


@torch.no_grad()
def _decode(compiled, model, ids, new_tokens: int, eos=None, feed=None) -> tuple[list[int], list[float], int]:
    """From a fresh cache: greedy tokens up to ``eos`` (``feed`` None) or ``feed``'s tokens fed back
    (teacher-forced): (the tokens, the NLL of each, how many the model's top token agreed with)."""
    from .hf import OscarCache, cache_kwarg

    kw = {cache_kwarg(model): OscarCache(model, max_cache_len=ids.shape[1] + new_tokens + 1), "use_cache": True}
    logits, gen, nll, agree = compiled(ids, **kw).logits[:, -1], [], [], 0
    for i in range(new_tokens if feed is None else len(feed)):
        nxt = int(logits.argmax(-1))
        if feed is not None:
            agree += nxt == feed[i]
            nxt = feed[i]
        elif nxt == eos:
            break
        nll.append(-logits.log_softmax(-1)[0, nxt].item())
        gen.append(nxt)
        logits = compiled(ids.new_tensor([[nxt]]), **kw).logits[:, -1]
    return gen, nll, agree


def run_demo(model_name: str = "smollm2-135m", method: str = "default", calib_tokens: int = 16384,
             num_sinks: int = 16, window: int = 64, new_tokens: int = 40, ppl_context: int = 512, ppl_decode: int = 32) -> int:
    from .assets import load_model, load_text
    from .backend import BackendOptions, oscar_backend, resolve_page_size
    from .evaluation import Method, Session, bits_per_element, perplexity_nll
    from .explainer import explain

    t0 = time.perf_counter()
    print(f"== oscar demo: {model_name} on {torch.get_num_threads()} CPU thread(s)")
    model, tok = load_model(model_name)
    print(f"   weights: 4-bit GGUF (dequantized to fp32); KV cache: INT2 pages + BF16 sinks ({num_sinks}) and "
          f"recent window ({window})")

    print(f"\n== 1. calibration ({method})")
    # the demo serves contexts under 1K tokens: calibrated where they sit, not over the model's 8K positions
    # (32 scored tokens: over 8K +4.3% and a derailed summary, over 1K +1.9%, all at 0 -2.3%; README "Positions")
    art, cached = cached_artifacts(model, tok, model_name, method, calib_tokens, position_range=1024)
    print(("   loaded cached artifacts: " if cached else "   calibrated: ") + art.summary().splitlines()[1])
    ks = [k for k, _ in art.clip_ratios]
    vs = [v for _, v in art.clip_ratios]
    print(f"   clip ratios per layer: keys {min(ks):.2f}..{max(ks):.2f}, values {min(vs):.2f}..{max(vs):.2f}")

    print("\n== 2. what the oscar backend rewrites (prefill and decode graphs)")
    probe = tok("The quick brown fox", return_tensors="pt").input_ids
    report = explain(model, probe, max_new_tokens=1, backend=oscar_backend(art, inductor=False))
    for g in report.graphs:
        kinds = sorted({r.match.write_kind for r in g.rewritten})
        print(f"   graph {g.index}: {len(g.rewritten)}/{g.analysis.num_sdpa} attention calls rewritten "
              f"(cache write: {', '.join(kinds)}), {len(g.unmatched)} left unchanged")
    print("   (`oscar explain --model MODEL --diff` shows every node)")

    print("\n== 3. generation: unquantized cache vs INT2 through the compiled model")
    passage = load_text("wikipedia")[40000:41500]
    for template in DEMO_PROMPTS:
        prompt = template.format(passage=passage)
        if getattr(tok, "chat_template", None):  # an instruct model: its own chat format
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt")
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        else:  # a base model (Gemma 3 270M): plain text that the answer continues
            ids = tok(f"{prompt}\nAnswer:", return_tensors="pt").input_ids
        outs, tokens, forced = {}, {}, {}
        for label, opts in (("bf16", {"quantize": False}), ("INT2", {})):
            torch._dynamo.reset()
            backend = oscar_backend(art, inductor=False, num_sinks=num_sinks, window=window, **opts)
            compiled = torch.compile(model, backend=backend)
            tokens[label], forced[label], _ = _decode(compiled, model, ids, new_tokens, tok.eos_token_id)
            outs[label] = tok.decode(tokens[label], skip_special_tokens=True).strip()
            if label == "INT2" and tokens["bf16"]:  # one greedy sample flips at a near-tie and then diverges:
                _, forced[label], agree = _decode(compiled, model, ids, new_tokens, feed=tokens["bf16"])  # fed BF16's
        # tokens in INT2 pages: those past the sinks and the window, in whole pages for per-channel keys
        quantized = max((c.quantized_tokens(ids.shape[1]) for c in backend.storage.values()), default=0)
        print(f"   prompt ({ids.shape[1]} tokens, {quantized} of them in INT2 pages when decoding starts):")
        print(f"     {template[:60].splitlines()[0]!r}")
        for label, text in outs.items():
            print(f"     {label:>4}: {text!r}")
        if tokens["bf16"]:
            n = len(tokens["bf16"])
            print(f"     INT2 fed BF16's {n} tokens: its top token agrees at {agree}/{n} steps, "
                  f"{sum(forced['INT2']) / n:.2f} nats/token against BF16's {sum(forced['bf16']) / n:.2f}")

    print(f"\n== 4. KV memory (one sequence, all layers, sinks {num_sinks} + window {window} in BF16; the cache's own report)")
    from .cache import PagedInt2KVCache
    from .hf import kv_geometry

    fmt = BackendOptions.key_format  # the backend's layout: keys per channel over pages of 32 by default
    cache = PagedInt2KVCache(model.config.num_hidden_layers, *kv_geometry(model), max_seq_len=1, num_sinks=num_sinks,
                             window=window, key_format=fmt, page_size=resolve_page_size(fmt, None), device="meta")
    for ctx in (1024, 8192):
        print("   " + str(cache.memory_report(ctx)))
    heads = [f"{layer}.{h}" for layer, hs in sorted(art.retrieval_heads.items()) for h in hs]
    if heads:  # the backend's default keeps them in BF16 beside the INT2 heads (exact_heads="auto")
        total = model.config.num_hidden_layers * kv_geometry(model)[0]
        for ctx in (1024, 8192):
            ours = bits_per_element(model.config, Method("oscar", "oscar", art), ctx, num_sinks, window)
            print(f"   with its {len(heads)} retrieval heads of {total} in BF16 ({', '.join(heads)}; the default, "
                  f"exact_heads=None for none): context {ctx}: {ours:.2f} bits/element")
    from .hf import sliding_windows

    slides = len(sliding_windows(model))
    if slides:  # the report above is for full-attention layers; sliding ones hold a BF16 ring
        for ctx in (1024, 8192):
            ours = bits_per_element(model.config, Method("int2"), ctx, num_sinks, window)
            bf16 = bits_per_element(model.config, Method("bf16", "bf16"), ctx, num_sinks, window)
            print(f"   with its {slides} sliding-window layers (BF16 rings; transformers' BF16 keeps each window): "
                  f"context {ctx}: {ours:.2f} bits/element against BF16's {bf16:.2f}")

    print(f"\n== 5. perplexity through the cache (Wikipedia, teacher-forced decode: {ppl_context} tokens of context, "
          f"{ppl_decode} scored decode steps; sinks {num_sinks}, window {window})")
    ids = tok(load_text("wikipedia")[:200000], return_tensors="pt").input_ids[0]
    tokens = ids[: 2 * (ppl_context + ppl_decode + 1)].view(2, -1)
    methods = [Method("bf16", "bf16"), Method("hadamard INT2", "oscar", None, {"rotation": "hadamard"}),
               Method(f"oscar INT2 ({art.method})", "oscar", art)]
    base = None
    for m in methods:
        torch._dynamo.reset()
        s = Session(model, m, tokens.shape[0], tokens.shape[1], num_sinks, window)
        nll, n = perplexity_nll(s, tokens, ppl_context)
        ppl = float(torch.tensor(nll / n).exp())
        base = base or ppl
        bits = bits_per_element(model.config, m, tokens.shape[1], num_sinks, window)
        print(f"   {m.name:<34} ppl {ppl:8.3f} ({100 * (ppl / base - 1):+6.1f}% vs bf16)   {bits:5.2f} bits/element")
    print(f"\ndone in {time.perf_counter() - t0:.0f} s. Full tables: `oscar eval`; see README.md.")
    return 0
