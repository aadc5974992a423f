"""The ``oscar`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _memory(args) -> int:
    from .backend import resolve_page_size
    from .cache import PagedInt2KVCache

    args.page_size = resolve_page_size(args.key_format, args.page_size, "oscar memory")
    for d in args.head_dim:
        cache = PagedInt2KVCache(args.layers, args.kv_heads, d, max_seq_len=1, page_size=args.page_size,
                                 num_sinks=args.sinks, window=args.window, group_size=args.group_size,
                                 key_format=args.key_format, device="meta")
        keys = ", keys per channel over each page" if args.key_format == "channel" else ""
        print(f"head_dim {d}, {args.kv_heads} KV heads, {args.layers} layers, sinks {args.sinks}, window {args.window}, "
              f"page {args.page_size}, group {cache.group_size}{keys}:")
        for ctx in args.context:
            print("  " + str(cache.memory_report(ctx)))
    return 0


def _demo(args) -> int:
    if args.synthetic:
        return _demo_random(args)
    from .demo import run_demo

    return run_demo(args.model, args.method, calib_tokens=args.calib_tokens, num_sinks=args.sinks, window=args.window,
                    new_tokens=args.new_tokens)


def read_text_arg(value: str, what: str) -> tuple[str, str]:
    """``value`` names a packaged text or a file: ``(text, description)``; an error names ``what``."""
    from .assets import TEXTS, load_text

    if value in TEXTS:
        return load_text(value), value
    path = Path(value)
    if not path.is_file():
        raise SystemExit(f"{what} {value} is neither a file nor one of {', '.join(TEXTS)}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise SystemExit(f"{what} {value} is empty")
    return text, path.name


def overlapping(a: str, b: str, samples: int = 32, width: int = 200) -> bool:
    """Whether ``b`` contains any of ``samples`` evenly spaced ``width``-character pieces of ``a``."""
    if len(a) < width:
        return a.strip() != "" and a in b
    step = max(1, (len(a) - width) // max(1, samples - 1))
    return any(a[i:i + width] in b for i in range(0, len(a) - width + 1, step))


def _eval(args) -> int:
    from .assets import cache_dir, load_model, load_text
    from .backend import BackendOptions, resolve_exact_heads, resolve_key_feedback
    from .demo import cached_artifacts_for, calibration_text_name
    from .evaluation import EvalConfig, Method, format_report, run_eval, save_report

    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    eval_text, eval_desc = read_text_arg(args.text, "oscar eval: --text")
    haystack, _ = read_text_arg(args.haystack, "oscar eval: --haystack")
    calib_name = calibration_text_name()
    if args.text == calib_name or overlapping(eval_text, load_text(calib_name)):
        raise SystemExit(f"oscar eval: the evaluation text {eval_desc} overlaps the calibration text ({calib_name}); "
                         "calibration and evaluation must be disjoint")
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("oscar eval: --device cuda, but torch sees no CUDA device")
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    model, tok = load_model(args.model)  # float32 on the CPU: calibration and the artifact hash see these weights
    names = args.methods.split(",")
    base, seq_of, positions_of, bf16_layers, group_sizes, read_options = _method_specs(names, args.calib_seq_len,
                                                                                       args.calib_positions)
    calibrated = [n for n in names if base[n] not in ("bf16", "kivi")]
    artifacts = {}
    for seq, positions in dict.fromkeys((seq_of[n], positions_of[n]) for n in calibrated):
        group = [n for n in calibrated if (seq_of[n], positions_of[n]) == (seq, positions)]
        # cached per (model, method, tokens, sequence length, positions) like the demo's: a second eval run does not
        # recalibrate
        found, _ = cached_artifacts_for(model, tok, args.model, [base[n] for n in group], args.calib_tokens, seq_len=seq,
                                        check_len=args.check_len, check_seqs=args.check_seqs, num_sinks=args.sinks,
                                        window=args.window, position_range=positions)
        artifacts.update({n: found[base[n]] for n in group})
    for n in calibrated:  # before any method runs: a refusal an hour in wastes the hour
        if read_options[n].get("key_feedback") and not artifacts[n].has_key_feedback:
            raise SystemExit(f"oscar eval: {n!r} rounds keys with error feedback, but its cached artifact was "
                             "calibrated before the artifacts carried the feedback factors (2026-12-06): remove it "
                             f"from {cache_dir() / 'artifacts'} to recalibrate")
    model.to(device=device, dtype=dtype)
    methods = []
    for n in names:
        if n == "bf16":
            methods.append(Method("bf16", "bf16"))
        elif n == "kivi":
            methods.append(Method("kivi-2", "kivi", options={"group": 32, "residual": 128}))
        else:
            label = f"{n} ({artifacts[n].method})" if base[n] == "default" else n
            options = {"group_size": args.group_size} if args.group_size else {}
            if bf16_layers[n]:
                options["bf16_layers"] = bf16_layers[n]
            elif artifacts[n].bf16_layers:  # the long-context check's outliers (--check-len)
                options["bf16_layers"] = artifacts[n].bf16_layers
                label += f" BF16 L{','.join(map(str, artifacts[n].bf16_layers))}"
            if group_sizes[n]:
                options["layer_group_sizes"] = group_sizes[n]
                for size in sorted(set(group_sizes[n].values())):
                    label += f" g{size} L{','.join(str(k) for k, g in sorted(group_sizes[n].items()) if g == size)}"
            if read_options[n].get("key_format") == "token":
                label += " keys per token"
            elif read_options[n].get("page_size"):
                label += f" keys per channel x{read_options[n]['page_size']}"
            if read_options[n].get("layer_key_formats") == "auto":
                label += f" keys per token L{','.join(map(str, artifacts[n].token_key_layers)) or ' none'}"
            if read_options[n].get("key_page_clips", "") == "auto":
                label += " narrowed page ranges"
            elif "key_page_clips" in read_options[n]:
                label += " full page ranges"
            if resolve_key_feedback(read_options[n].get("key_feedback", BackendOptions.key_feedback),
                                    read_options[n].get("key_format", BackendOptions.key_format), artifacts[n]):
                label += " key feedback"
            elif base[n] == "default" and artifacts[n].has_key_feedback:
                label += " plain key rounding"
            exact = resolve_exact_heads(read_options[n].get("exact_heads", BackendOptions.exact_heads), artifacts[n])
            if exact:
                label += " exact heads " + ",".join(f"{a}.{h}" for a, hs in sorted(exact.items()) for h in hs)
                if read_options[n].get("exact_format") == "fp8":
                    label += " in fp8"
            if read_options[n].get("score_debias"):
                label += f" debias {read_options[n]['score_debias']:g}"
            options.update(read_options[n])
            methods.append(Method(label + (f" g{args.group_size}" if args.group_size else ""), "oscar", artifacts[n],
                                  options))
    cfg = EvalConfig(ppl_contexts=ints(args.ppl_contexts), ppl_decode=args.ppl_decode, ppl_sequences=args.ppl_sequences,
                     retrieval_lengths=ints(args.retrieval_lengths), retrieval_samples=args.retrieval_samples,
                     retrieval_depths=tuple(float(x) for x in args.retrieval_depths.split(",") if x),
                     retrieval_tasks=tuple(x for x in args.retrieval_tasks.split(",") if x),
                     num_sinks=args.sinks, window=args.window, prefill_chunk=args.prefill_chunk,
                     seed=args.retrieval_seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f"{args.name or args.model}.partial.json"

    def checkpoint(rep):  # an interrupted run keeps what it measured
        partial.write_text(json.dumps(dict(rep, model=args.model), indent=1))

    report = run_eval(model, tok, methods, eval_text, haystack, cfg, checkpoint=checkpoint)
    report["model"] = args.model
    report["eval_text"] = eval_desc
    report["weights"] = f"4-bit GGUF, dequantized to {str(dtype).removeprefix('torch.')} (the packaged model)"
    report["device"] = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    report["calibration"] = next((a.calibration for a in artifacts.values()), {"tokens": args.calib_tokens})
    report["clip_ratios"] = {n: a.clip_ratios for n, a in artifacts.items()}
    print(format_report(report))
    js, png = save_report(report, args.out, args.name or args.model)
    partial.unlink(missing_ok=True)
    print(f"wrote {js} and {png}")
    return 0


def _demo_random(args) -> int:
    """Prefill + decode through the paged INT2 cache on random data; compare with BF16 attention."""
    import torch
    import torch.nn.functional as F

    from .cache import PagedInt2KVCache
    from .testing import random_transforms, rel_error

    torch.manual_seed(0)
    layers, h, gqa, d = 2, 3, 3, 64  # SmolLM2-135M attention geometry
    prefill, steps = args.prefill, args.steps
    total = prefill + steps
    cache = PagedInt2KVCache(layers, h, d, max_seq_len=total, num_sinks=64, window=256)
    print(cache)
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        cache.set_transforms(layer, random_transforms(h, d, "orthogonal", gen))
    k_all = torch.randn(1, h, total, d, dtype=torch.bfloat16)
    v_all = torch.randn(1, h, total, d, dtype=torch.bfloat16)
    q_all = torch.randn(1, h * gqa, total, d, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    cache.allocate(0, prefill)
    for layer in range(layers):
        cache.store(layer, k_all[:, :, :prefill], v_all[:, :, :prefill], torch.arange(prefill))
    errs = []
    for p in range(prefill, total):
        cache.allocate(0, p + 1)
        pos = torch.tensor([p])
        for layer in range(layers):
            cache.store(layer, k_all[:, :, p : p + 1], v_all[:, :, p : p + 1], pos)
            out = cache.attention(layer, q_all[:, :, p : p + 1], pos)
        ref = F.scaled_dot_product_attention(q_all[:, :, p : p + 1], k_all[:, :, : p + 1], v_all[:, :, : p + 1], enable_gqa=True)
        errs.append(rel_error(out, ref))
    dt = time.perf_counter() - t0
    print(f"{steps} decode steps over {layers} layers in {dt:.1f} s; relative error of INT2 attention vs BF16 "
          f"(random data, the worst case for a rotation): mean {sum(errs) / len(errs):.3f}, last {errs[-1]:.3f}")
    for ctx in (total, 4096, 32768):
        print("  " + str(cache.memory_report(ctx)))
    return 0


def _load_for_cli(name: str):
    """A model by name: a known packaged model, a checkpoint dir, a .gguf, or ``tiny:<family>`` (random)."""
    if name.startswith("tiny:"):
        from .testing import tiny_model

        return tiny_model(name.split(":", 1)[1]), None
    from .assets import load_model

    return load_model(name)


def _explain(args) -> int:
    import torch

    from .explainer import explain

    model, tok = _load_for_cli(args.model)
    if tok is not None:
        ids = tok(args.prompt, return_tensors="pt").input_ids
    else:
        ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    report = explain(model, ids, max_new_tokens=args.new_tokens, cache=args.cache)
    print(report.summary())
    layers = getattr(model.config, "num_hidden_layers", None)
    for g in report.graphs:
        print(f"graph {g.index}: {len(g.rewritten)}/{layers} layers rewritten")
    if args.diff:
        print(report.diff())
    if args.graphs:
        for g in report.graphs:
            print(f"=== graph {g.index} before\n{g.before}\n=== graph {g.index} after\n{g.after}")
    return 0 if report.num_rewritten else 1


def _method_specs(names: list[str], calib_seq_len: int, calib_positions: str):
    """``oscar eval --methods``: each name's base method, calibration sequence length, calibration positions, layers
    kept in BF16 and layers with their own group size. "method@S": calibrated in sequences of S tokens (default
    ``calib_seq_len``); "method:L0:L5": layers 0 and 5 kept in BF16 (the backend's bf16_layers); "method:p2048":
    calibration rows spread over 2048 positions (p0: all at position 0), overriding ``--calib-positions`` for that
    method, so several spreads share one run's tokens and its bf16; "method:g32.4-10.20": groups of 32 channels in
    layers 4 to 10 and 20 (the backend's layer_group_sizes); "method:c32": keys per channel over pages of 32
    tokens (the backend's key_format="channel", page_size=32; the default); "method:t": keys per token (the backend's
    key_format="token", pages of 16); "method:ka": keys per token in the layers the long-context check chose
    (the backend's layer_key_formats="auto"); "method:kr": per-channel keys over page ranges narrowed by the
    ratios the long-context check chose (the backend's key_page_clips="auto", the default since 2026-12-05);
    "method:kf": per-channel keys over every channel's full range in a page (key_page_clips=None);
    "method:fb": per-channel keys rounded with error feedback (the backend's key_feedback=True; "auto", the default,
    does so where the artifact carries the factors; the baselines identity, hadamard and oscar round plainly unless
    tagged so); "method:nofb": plain rounding (key_feedback=False); "method:xh": the artifact's retrieval heads kept
    in BF16 (the backend's exact_heads="auto", the default since 2026-12-06; the baselines keep every head INT2
    unless tagged so); "method:xh0.125": the retrieval heads re-chosen from the artifact's induction scores at that
    share of the KV heads (exact_heads=0.125); "method:noxh": every head INT2 (exact_heads=None); "method:x8": the
    retrieval heads' tokens in FP8 with a scale each instead of BF16 (exact_format="fp8"); "method:r8": the INT2
    layers' newest tokens (the ring) in FP8 (ring_format="fp8");
    "method:d" ("method:d0.5"): INT2 scores debiased by 1 (0.5) times half their rounding noise's variance (the
    backend's score_debias). The key-format, range and debias tags come back as each method's backend options."""
    from .backend import DEFAULT_PAGE_SIZE

    base, seq_of, positions_of, bf16_layers, group_sizes = {}, {}, {}, {}, {}
    read_options = {}
    usage = ("':L<layer>' keeps a layer in BF16, ':p<tokens>' spreads the calibration rows, ':g<size>.<layers>' "
             "(e.g. g32.4-10.20) gives layers their own group size, ':c<tokens>' quantizes keys per channel over "
             "pages of that many tokens (the default: c32), ':t' per token, ':ka' per token in the layers the "
             "long-context check chose, ':kr' per channel over the check's narrowed page ranges (the default), ':kf' "
             "over full page ranges, ':fb' rounds per-channel keys with error feedback (the default's where the artifact "
             "has its factors), ':nofb' plainly, ':xh' keeps the retrieval heads in BF16 (the default; ':xh<share>' "
             "re-chooses them at that share of the KV heads, e.g. xh0.125), ':noxh' none, ':x8' stores them in FP8, ':r8' the INT2 layers' rings in FP8, and "
             "':d' "
             "(':d<c>', c in (0, 4]) debiases INT2 scores (an oscar method only, e.g. default:L0:p2048:g32.7:c32:d)")
    for n in names:
        head, *tags = n.split(":")
        base[n], _, seq = head.partition("@")
        layer_tags = [t for t in tags if t.startswith("L") and t[1:].isdigit()]
        position_tags = [t for t in tags if t.startswith("p") and t[1:].isdigit()]
        group_tags = [t for t in tags if t.startswith("g")]
        channel_tags = [t for t in tags if t.startswith("c") and t[1:].isdigit() and int(t[1:]) >= 2]
        debias_tags = [t for t in tags if _tag_value(t, "d", 4.0, bare=1.0) is not None]
        channel_tags += [t for t in tags if t == "t"]  # a key format either way: at most one of c<tokens> and t
        auto_tags = [t for t in tags if t == "ka"]  # per-token keys in the check's token_key_layers
        # per-channel keys over the check's narrowed page ranges (the default) or over full ranges
        range_tags = [t for t in tags if t in ("kr", "kf")]
        # per-channel keys rounded with error feedback (the default's, where the artifact has factors) or not
        feedback_tags = [t for t in tags if t in ("fb", "nofb")]
        # retrieval heads in BF16 (exact_heads), at the artifact's share or another ("xh0.125"), or none
        exact_tags = [t for t in tags if t in ("xh", "noxh") or _tag_value(t, "xh", 1.0) is not None]
        fp8_tags = [t for t in tags if t == "x8"]  # the retrieval heads' tokens in FP8 (exact_format)
        ring_tags = [t for t in tags if t == "r8"]  # the INT2 layers' rings in FP8 (ring_format)
        read_options[n] = {}
        if fp8_tags:
            read_options[n]["exact_format"] = "fp8"
        if ring_tags:
            read_options[n]["ring_format"] = "fp8"
        if exact_tags:
            t = exact_tags[0]
            read_options[n]["exact_heads"] = "auto" if t == "xh" else None if t == "noxh" else _tag_value(t, "xh", 1.0)
        elif base[n] in ("identity", "hadamard", "oscar"):
            read_options[n]["exact_heads"] = None  # the baselines' recipes: every head INT2
        if feedback_tags:
            read_options[n]["key_feedback"] = feedback_tags[0] == "fb"
        elif base[n] in ("identity", "hadamard", "oscar"):
            read_options[n]["key_feedback"] = False  # the baselines' recipes: no error feedback (ours)
        if range_tags:
            read_options[n]["key_page_clips"] = "auto" if range_tags[0] == "kr" else None
        if auto_tags:
            read_options[n]["layer_key_formats"] = "auto"
        if channel_tags == ["t"]:
            read_options[n].update(key_format="token", page_size=DEFAULT_PAGE_SIZE["token"])
        elif len(channel_tags) == 1:  # more than one: refused below
            read_options[n].update(key_format="channel", page_size=int(channel_tags[0][1:]))
        if debias_tags:
            read_options[n]["score_debias"] = _tag_value(debias_tags[0], "d", 4.0, bare=1.0)
        if (len(layer_tags) + len(position_tags) + len(group_tags) + len(channel_tags) + len(debias_tags)
                + len(auto_tags) + len(range_tags) + len(feedback_tags) + len(exact_tags) + len(fp8_tags)
                + len(ring_tags) != len(tags)
                or len(position_tags) > 1 or len(channel_tags) > 1 or len(debias_tags) > 1 or len(auto_tags) > 1
                or len(range_tags) > 1 or len(feedback_tags) > 1 or len(exact_tags) > 1 or len(fp8_tags) > 1
                or len(ring_tags) > 1
                or ((auto_tags or range_tags or feedback_tags == ["fb"]) and channel_tags == ["t"])
                or (tags and base[n] in ("bf16", "kivi"))):
            raise SystemExit(f"oscar eval: --methods {','.join(names)}: in {n!r}, {usage}")
        try:
            seq_of[n] = int(seq or calib_seq_len)
        except ValueError:
            raise SystemExit(f"oscar eval: --methods {','.join(names)}: in name@S, S is a calibration sequence "
                             "length in tokens")
        bf16_layers[n] = tuple(int(t[1:]) for t in layer_tags)
        positions_of[n] = _positions_arg(position_tags[0][1:] if position_tags else calib_positions)
        group_sizes[n] = {}
        for t in group_tags:  # g<size>.<layer or first-last>...; a later tag wins for a layer named twice
            size, *spans = t[1:].split(".")
            try:
                g = int(size)
                layers = [x for a, _, b in (sp.partition("-") for sp in spans) for x in range(int(a), int(b or a) + 1)]
            except ValueError:
                g, layers = 0, []
            if g <= 0 or not layers:
                raise SystemExit(f"oscar eval: --methods {','.join(names)}: in {n!r}, {usage}")
            group_sizes[n].update(dict.fromkeys(layers, g))
    return base, seq_of, positions_of, bf16_layers, group_sizes, read_options


def _tag_value(tag: str, prefix: str, upper: float, bare: float | None = None) -> float | None:
    """The number a method tag carries after ``prefix``, in (0, ``upper``]: ``d0.5`` -> 0.5 (debias), ``xh0.125`` ->
    0.125 (retrieval-head share); ``bare`` for the prefix alone (``d`` -> 1.0); None where the tag is not one."""
    if not tag.startswith(prefix):
        return None
    if len(tag) == len(prefix):
        return bare
    try:
        c = float(tag[len(prefix):])
    except ValueError:
        return None
    return c if 0.0 < c <= upper else None


def _positions_arg(value: str):
    """``--calib-positions``/``--positions``: "auto", or a token count (0: none)."""
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise SystemExit(f"oscar: a position range is 'auto' or a number of tokens, not {value!r}")
    if n < 0:
        raise SystemExit(f"oscar: a position range must be >= 0, not {n}")
    return n or None


def _tokenize(tok, model, text: str):
    import torch

    if tok is not None:
        return tok(text, return_tensors="pt").input_ids[0]
    vocab = model.config.vocab_size  # tiny random models have no tokenizer: bytes, folded into the vocab
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % (vocab - 3) + 3


def _calibrate(args) -> int:
    import time

    from .calibration import check_layers, collect_statistics, derive_artifacts, token_batches, with_retrieval_heads

    t0 = time.perf_counter()
    model, tok = _load_for_cli(args.model)
    text, desc = read_text_arg(args.data, "oscar calibrate: --data")
    ids = _tokenize(tok, model, text)
    per_batch = args.seq_len * args.batch_size
    need = args.tokens + per_batch  # plus one held-out batch for the clip search
    check = args.check_len * args.check_seqs
    if args.check_len < 0 or args.check_seqs < 1:
        raise SystemExit("oscar calibrate: --check-len must be >= 0 and --check-seqs >= 1")
    if check and ids.numel() < need + check:
        raise SystemExit(f"oscar calibrate: {desc} has {ids.numel()} tokens, fewer than the {need} to calibrate on "
                         f"plus the {check} of the long-context check (--check-len 0 skips it)")
    if ids.numel() < need:
        print(f"oscar calibrate: {desc} has {ids.numel()} tokens, fewer than the {need} asked for: using all of it")
    batches = token_batches(ids, args.seq_len, args.batch_size, max_tokens=need)
    stats = collect_statistics(model, batches, data_description=desc, skip_first=args.skip_first,
                               position_range=_positions_arg(args.positions))
    artifacts = derive_artifacts(stats, args.method, group_size=args.group_size, progress=True)
    if check and artifacts.options.get("clip_grid"):  # the clipped methods: the check measures their clips
        start = need  # after every calibration token
        long = [ids[start + i * args.check_len:start + (i + 1) * args.check_len][None] for i in range(args.check_seqs)]
        artifacts = check_layers(model, artifacts, long, num_sinks=args.sinks, window=args.window)
    artifacts = with_retrieval_heads(model, artifacts)  # after the check: its BF16 layers are not candidates
    out = artifacts.save(args.out)
    print(artifacts.summary())
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oscar", description="2-bit KV-cache quantization for LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main job: calibrate, compile, generate and measure SmolLM2 on the CPU")
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--method", default="default")
    demo.add_argument("--calib-tokens", type=int, default=16384)
    demo.add_argument("--sinks", type=int, default=16, help="BF16 sink tokens (small so short prompts reach INT2)")
    demo.add_argument("--window", type=int, default=64, help="BF16 recent window")
    demo.add_argument("--new-tokens", type=int, default=40)
    demo.add_argument("--synthetic", action="store_true", help="random data through the cache only (no model)")
    demo.add_argument("--prefill", type=int, default=300, help=argparse.SUPPRESS)
    demo.add_argument("--steps", type=int, default=100, help=argparse.SUPPRESS)
    demo.set_defaults(func=_demo)

    ev = sub.add_parser("eval", help="accuracy of every method on the same tokens: perplexity, retrieval, bits")
    ev.add_argument("--model", default="smollm2-135m")
    ev.add_argument("--text", default="wikipedia", help="evaluation text: a file, or a packaged text (wikipedia, ...); "
                    "must not overlap the calibration text")
    ev.add_argument("--haystack", default="paul-graham", help="filler text of the retrieval prompts: a file or a packaged text")
    ev.add_argument("--methods", default="bf16,kivi,identity,hadamard,oscar,default")
    ev.add_argument("--calib-tokens", type=int, default=32768)
    ev.add_argument("--check-len", type=int, default=2048,
                    help="check every layer of the calibrated methods on sequences this long, as `oscar calibrate` "
                         "does (0: none); the outliers then stay in BF16 (the artifact's bf16_layers)")
    ev.add_argument("--check-seqs", type=int, default=2)
    ev.add_argument("--calib-seq-len", type=int, default=512,
                    help="calibration sequence length; a method written name@S overrides it (e.g. default@4096)")
    ev.add_argument("--calib-positions", default="auto",
                    help="calibration rows start at positions spread over this many tokens, the context served (auto: "
                         "the model's max_position_embeddings; 0: every row at position 0, as before 2026-12-04)")
    ev.add_argument("--ppl-contexts", default="512,2048")
    ev.add_argument("--ppl-decode", type=int, default=64)
    ev.add_argument("--ppl-sequences", type=int, default=4)
    ev.add_argument("--retrieval-lengths", default="1024,4096,8192")
    ev.add_argument("--retrieval-samples", type=int, default=1)
    ev.add_argument("--retrieval-depths", default="0.1,0.5,0.9")
    ev.add_argument("--retrieval-tasks", default="passkey,needle")
    ev.add_argument("--retrieval-seed", type=int, default=0,
                    help="seed of the prompts' draws: another seed asks other prompts, so runs add up to more prompts")
    ev.add_argument("--group-size", type=int, default=None,
                    help="channels per (scale, min) pair of the INT2 methods (default: head_dim, one pair a row)")
    ev.add_argument("--sinks", type=int, default=64)
    ev.add_argument("--window", type=int, default=256)
    ev.add_argument("--device", default="auto",
                    help="cpu, cuda (auto: cuda when available); on CUDA the Triton kernels run")
    ev.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="model weights during evaluation (auto: bfloat16 on CUDA, float32 on the CPU)")
    ev.add_argument("--prefill-chunk", type=int, default=4096, help="prompts are prefilled in chunks of this many tokens")
    ev.add_argument("--out", default="oscar-eval")
    ev.add_argument("--name", default=None, help="file stem of the JSON and plot")
    ev.set_defaults(func=_eval)

    mem = sub.add_parser("memory", help="KV-cache memory of the INT2 format at given context lengths")
    mem.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    mem.add_argument("--kv-heads", type=int, default=1)
    mem.add_argument("--layers", type=int, default=1)
    mem.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072])
    mem.add_argument("--sinks", type=int, default=64)
    mem.add_argument("--window", type=int, default=256)
    mem.add_argument("--key-format", default="channel", choices=["token", "channel"],
                     help="channel (the backend's default): keys quantized per channel over each page's tokens "
                          "(2 + 32/page bits); token: per token in groups of channels, as values")
    mem.add_argument("--page-size", type=int, default=None,
                     help="tokens a page (default: 32 per channel, 16 per token)")
    mem.add_argument("--group-size", type=int, default=None)
    mem.set_defaults(func=_memory)

    exp = sub.add_parser("explain", help="show which attention calls and cache writes oscar rewrites, and why not")
    exp.add_argument("--model", default="smollm2-135m", help="packaged model name, checkpoint dir, .gguf, or tiny:<family>")
    exp.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    exp.add_argument("--cache", default="oscar", choices=["oscar", "static", "dynamic"])
    exp.add_argument("--new-tokens", type=int, default=1, help="decode steps after the prefill (each shape is a graph)")
    exp.add_argument("--diff", action="store_true", help="print the graphs before/after as a unified diff")
    exp.add_argument("--graphs", action="store_true", help="print the full graphs before and after")
    exp.set_defaults(func=_explain)

    cal = sub.add_parser("calibrate", help="derive OSCAR rotations and clip ratios for a model; write an artifact")
    cal.add_argument("--model", default="smollm2-135m", help="packaged model name, checkpoint dir, .gguf, or tiny:<family>")
    cal.add_argument("--data", default="debian-handbook", help="a text file, or a packaged text (debian-handbook, ...)")
    cal.add_argument("--tokens", type=int, default=32768, help="calibration tokens (one more batch is held out)")
    cal.add_argument("--method", default="default", help="identity | hadamard | oscar[+kmean|+vmean|+vauto|+mean][+scale][+clip|-clip]; default: oscar+kmean+vauto+scale")
    cal.add_argument("--seq-len", type=int, default=512)
    cal.add_argument("--batch-size", type=int, default=4)
    cal.add_argument("--group-size", type=int, default=None)
    cal.add_argument("--skip-first", type=int, default=4, help="leading positions (attention sinks) left out of the statistics")
    cal.add_argument("--positions", default="auto",
                     help="rows start at positions spread over this many tokens, the context the artifact serves "
                          "(auto: the model's max_position_embeddings; 0: every row at position 0)")
    cal.add_argument("--check-len", type=int, default=2048,
                     help="check every layer on sequences this long after calibrating (0: no check); outlier layers are "
                          "kept in BF16 (the artifact's bf16_layers); use about the context you serve")
    cal.add_argument("--check-seqs", type=int, default=2, help="sequences of the long-context check")
    cal.add_argument("--sinks", type=int, default=64, help="BF16 sinks of the cache the check assumes")
    cal.add_argument("--window", type=int, default=256, help="BF16 window of the cache the check assumes")
    cal.add_argument("--out", required=True, help="artifact directory to write")
    cal.set_defaults(func=_calibrate)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
