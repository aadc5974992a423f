"""Accuracy harness: every method on exactly the same tokens, through the real quantized cache.

Protocol (DESIGN.md section 6). A single forward pass over a fresh cache never reads the quantized
cache, so every measurement here prefills a context and then feeds tokens one decode step at a
time; every scored token attends to a history that went through the cache as in serving:

* perplexity: prefill ``context`` tokens of real text, feed the next ``decode`` tokens one step at a
  time (teacher forcing), score each step's prediction of the following token;
* retrieval: prefill a haystack of real prose holding a needle (a passkey number or a magic word)
  at some depth, feed the question one token at a time, then generate the answer greedily.

Methods: ``bf16`` (same code path, quantization off), oscar-backend methods given by artifacts
(identity / Hadamard / OSCAR / ours), and ``kivi`` (KIVI-2, reference fake-quantization path).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .backend import oscar_backend
from .baselines import KiviCache, kivi_bits_per_element
from .cache import PagedInt2KVCache
from .hf import kv_geometry


# ----------------------------------------------------------------------------- methods and sessions
@dataclass
class Method:
    """One way of caching KV. ``kind``: bf16 | oscar | kivi."""

    name: str
    kind: str = "oscar"
    artifacts: object = None
    options: dict = field(default_factory=dict)


def bits_per_element(model_config, method: Method, context: int, num_sinks: int, window: int,
                     cache_dtype=torch.bfloat16) -> float:
    """Effective bits per K/V element of one sequence of ``context`` tokens, metadata and BF16 tokens included,
    over every layer. Sliding-window layers hold fewer tokens than the context: ``min(window, context)`` in
    BF16, transformers' own sliding layers and the oscar methods' BF16 rings alike (the default
    ``sliding_storage="ring"``)."""
    from .backend import BackendOptions, resolve_exact_heads, resolve_layer_key_formats, resolve_page_size
    from .hf import sliding_windows
    from .kernels.fp8_ring import fp8_row_bytes

    heads, d = kv_geometry(model_config)
    fp_bits = torch.finfo(cache_dtype).bits
    if method.kind == "kivi":
        return kivi_bits_per_element(context, d, fp_bits=fp_bits, **method.options)
    layers = model_config.num_hidden_layers
    slides = sliding_windows(model_config)
    key_format = method.options.get("key_format", BackendOptions.key_format)  # the backend's layout
    page_size = resolve_page_size(key_format, method.options.get("page_size"))

    ring_format = method.options.get("ring_format", BackendOptions.ring_format)  # the INT2 layers' newest tokens

    def int2_bits(group_size, fmt=key_format):
        cache = PagedInt2KVCache(1, heads, d, max_seq_len=1, num_sinks=num_sinks, window=window, group_size=group_size,
                                 dtype=cache_dtype, device="meta", key_format=fmt, page_size=page_size,
                                 ring_format=ring_format)
        return cache.memory_report(context).bits_per_element

    full = fp_bits if method.kind == "bf16" else int2_bits(method.options.get("group_size"))
    sliding_bits = sum(fp_bits * min(w, context) / context for w in slides.values())
    # full layers kept in BF16 (the backend's bf16_layers) hold every token in 16 bits
    kept = method.options.get("bf16_layers")
    if kept is None:  # the backend's default: the artifact's (its long-context check)
        kept = getattr(method.artifacts, "bf16_layers", ()) if method.artifacts is not None else ()
    dense = len(set(kept) - set(slides)) if method.kind != "bf16" else 0
    # full INT2 layers with their own group size or key format (the backend's layer_group_sizes and
    # layer_key_formats): their bits instead of `full`
    groups = method.options.get("layer_group_sizes") or {}
    formats = resolve_layer_key_formats(method.options.get("layer_key_formats"), method.artifacts, "oscar eval")
    own = set(groups) | set(formats)
    own = {layer for layer in own if layer not in slides and layer not in kept} if method.kind != "bf16" else set()
    extra = sum(int2_bits(groups.get(layer, method.options.get("group_size")), formats.get(layer, key_format)) - full
                for layer in own)
    # retrieval heads kept in BF16 beside a layer's INT2 heads (the backend's exact_heads): their share in 16 bits,
    # or with exact_format="fp8" their sinks in 16 and the rest in FP8 with a 32-bit scale a row (kernels/fp8_ring.py)
    exact = resolve_exact_heads(method.options.get("exact_heads", BackendOptions.exact_heads), method.artifacts,
                                "oscar eval") if method.kind != "bf16" else {}
    exact_bits = fp_bits
    if method.options.get("exact_format", BackendOptions.exact_format) == "fp8":
        sinks = min(num_sinks, context)
        exact_bits = (sinks * fp_bits + (context - sinks) * 8 * fp8_row_bytes(d) / d) / context
    extra += sum(min(len(hs), heads) / heads * (exact_bits - full) for layer, hs in exact.items()
                 if layer not in slides and layer not in kept and layer < layers)
    return (full * (layers - len(slides) - dense) + extra + fp_bits * dense + sliding_bits) / layers


class Session:
    """A model with one method's cache for ``batch`` sequences: ``prefill(ids)``, then ``step(ids)``."""

    def __init__(self, model, method: Method, batch: int, max_len: int, num_sinks: int, window: int,
                 cache_dtype=torch.bfloat16, prefill_chunk: int = 4096):
        from .hf import cache_kwarg

        self.model, self.method, self.batch, self.max_len = model, method, batch, max_len
        self.prefill_chunk = prefill_chunk
        self.kw = cache_kwarg(model)
        if method.kind == "kivi":
            self.fn = model
            self.cache = KiviCache(model.config, **method.options)
        else:
            options = dict(num_sinks=num_sinks, window=window, cache_dtype=cache_dtype, inductor=False)
            options.update(method.options)
            if method.kind == "bf16":
                options["quantize"] = False
            from .hf import OscarCache

            self.fn = torch.compile(model, backend=oscar_backend(method.artifacts, **options))
            self.cache = OscarCache(model, max_cache_len=max_len, max_batch_size=batch)

    def restart(self) -> None:
        """Forget every sequence; keep the compiled graphs (same cache shapes: no recompilation)."""
        if self.method.kind == "kivi":
            self.cache = KiviCache(self.model.config, **self.method.options)
        else:
            self.cache.reset()  # positions restart at 0; the INT2 pages are simply overwritten

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits after the last of ``ids`` (fed in chunks of ``prefill_chunk`` tokens, as serving prefills
        long prompts: each chunk reads the earlier ones from the cache; a sliding layer's ring takes no
        more than a chunk at a time)."""
        if ids.shape[1] == 0:
            raise ValueError("oscar eval: a session call needs at least one token")
        for start in range(0, ids.shape[1], self.prefill_chunk):
            out = self.fn(ids[:, start:start + self.prefill_chunk], **{self.kw: self.cache}, use_cache=True,
                          logits_to_keep=1)  # full logits of a long chunk would be GBs (vocabularies of 262K)
        return out.logits[:, -1].float()


# ----------------------------------------------------------------------------- perplexity
@torch.no_grad()
def token_nll(session: Session, tokens: torch.Tensor, context: int, progress=None) -> torch.Tensor:
    """NLL of each token ``context + 1 .. L - 1`` of ``tokens [B, L]`` (teacher-forced decode): ``[B, steps]``
    float64 on the CPU."""
    b, length = tokens.shape
    if length - context - 1 < 1:
        raise ValueError(f"oscar eval: {length} tokens leave nothing to score after a {context}-token context")
    session(tokens[:, :context])
    steps = range(context, length - 1)
    out = torch.empty(b, len(steps), dtype=torch.float64, device=tokens.device)  # filled on the device: no sync a step
    for i, p in enumerate(progress(steps) if progress else steps):
        logits = session(tokens[:, p : p + 1])
        out[:, i] = torch.nn.functional.cross_entropy(logits, tokens[:, p + 1], reduction="none")
    return out.cpu()


def perplexity_nll(session: Session, tokens: torch.Tensor, context: int, progress=None) -> tuple[float, int]:
    """Sum of NLL and count over tokens ``context + 1 .. L - 1`` of ``tokens [B, L]`` (teacher-forced decode)."""
    nll = token_nll(session, tokens, context, progress)
    return nll.sum().item(), nll.numel()


def paired_delta(nll: torch.Tensor, base: torch.Tensor, block: int = 16) -> dict:
    """A method's NLL against the baseline's on the same tokens (``[B, steps]`` each): the mean difference in
    nats/token, as a perplexity change in percent with a 95% interval.

    Neighbouring tokens' differences are correlated, so the standard error comes from the means of blocks of
    ``block`` consecutive tokens of a sequence (batch means), which are close to independent; per token it
    would be too narrow. Fewer than two blocks: no interval."""
    if nll.shape != base.shape:
        raise ValueError(f"oscar eval: paired NLLs need the same tokens, got shapes {tuple(nll.shape)} and {tuple(base.shape)}")
    d = (nll - base).double()
    mean = d.mean().item()
    n_blocks = d.shape[1] // block
    out = {"delta_nats": mean, "pct": 100 * math.expm1(mean), "blocks": d.shape[0] * n_blocks, "block_tokens": block}
    if d.shape[0] * n_blocks >= 2:
        means = d[:, : n_blocks * block].reshape(d.shape[0] * n_blocks, block).mean(1)
        se = means.std().item() / math.sqrt(means.numel())
        out["ci95_pct"] = [100 * math.expm1(mean - 1.96 * se), 100 * math.expm1(mean + 1.96 * se)]
    return out


# ----------------------------------------------------------------------------- retrieval
_WORDS = ("elephant", "harbor", "violin", "glacier", "lantern", "orchid", "meteor", "saffron", "compass", "falcon",
          "tapestry", "volcano", "marble", "thimble", "canyon", "parsley")


@dataclass
class RetrievalPrompt:
    task: str  # passkey | needle
    length: int  # target total prompt tokens
    depth: float
    context_ids: torch.Tensor  # haystack with the needle, prefilled
    question_ids: torch.Tensor  # fed one token at a time
    answer: str
    answer_ids: torch.Tensor | None = None  # the answer as it follows the question (" 12345"), teacher-forced


def make_retrieval_prompt(tok, haystack: str, task: str, length: int, depth: float, rng: random.Random) -> RetrievalPrompt:
    """A haystack of real prose of about ``length`` tokens with a needle at ``depth`` (0 = start, 1 = end)."""
    if task == "passkey":
        answer = str(rng.randint(10000, 99999))
        needle = f" The pass key is {answer}. Remember it. {answer} is the pass key. "
        question, lead = " What is the pass key?", "The pass key is"
    elif task == "needle":
        answer = rng.choice(_WORDS)
        needle = f" The special magic word is {answer}. Remember the special magic word: {answer}. "
        question, lead = " What is the special magic word?", "The special magic word is"
    else:
        raise ValueError(f"oscar eval: unknown retrieval task {task!r}")
    enc = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    # the classic passkey framing (Mohtashami & Jaggi, 2023): say up front that something is hidden
    head = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + enc(
        "There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n")
    q_ids = enc(question + " " + lead)
    needle_ids = enc(needle)
    budget = length - len(needle_ids) - len(q_ids) - len(head)
    if budget < 1:
        raise ValueError(f"oscar eval: {length} tokens cannot hold the needle ({len(needle_ids)}) and question ({len(q_ids)})")
    start = rng.randint(0, max(0, len(haystack) - 8 * length))
    hay = enc(haystack[start : start + 8 * length])[:budget]
    if len(hay) < budget:
        raise ValueError(f"oscar eval: the haystack text is too short for {length} tokens")
    cut = int(round(depth * len(hay)))
    ids = head + hay[:cut] + needle_ids + hay[cut:]
    return RetrievalPrompt(task, length, depth, torch.tensor([ids]), torch.tensor([q_ids]), answer,
                           torch.tensor([enc(" " + answer)]))


@torch.no_grad()
def _ask(session: Session, prompt: RetrievalPrompt) -> torch.Tensor:
    """Prefill the haystack, then the question one decode step a token (it reads the INT2 history): the logits
    of the first answer token."""
    session(prompt.context_ids)
    logits = None
    for i in range(prompt.question_ids.shape[1]):
        logits = session(prompt.question_ids[:, i : i + 1])
    return logits


@torch.no_grad()
def retrieve(session: Session, prompt: RetrievalPrompt, tok, max_new: int = 8) -> tuple[bool, str, float | None]:
    """Greedy answer to ``prompt`` from a fresh ``session``: (whether it holds the answer, the text, the answer's
    teacher-forced NLL in nats). The NLL (``-log p(answer | prompt)`` over ``answer_ids``) is the continuous
    measure a right-or-wrong answer hides: a method that keeps every answer but halves their probability is
    closer to losing some. It comes from the greedy steps where they spell the answer; otherwise the prompt is
    asked again and the answer fed (one more prefill). None without ``answer_ids``."""
    logits = _ask(session, prompt)
    target = [] if prompt.answer_ids is None else prompt.answer_ids[0].tolist()
    out, nll = [], 0.0
    for _ in range(max_new):
        nxt = int(logits.argmax(-1))
        if len(out) < len(target) and out == target[:len(out)]:  # still on the answer's path
            nll -= logits.log_softmax(-1)[0, target[len(out)]].item()
        out.append(nxt)
        logits = session(logits.new_tensor([[nxt]]).long())
    text = tok.decode(out, skip_special_tokens=True)
    if target and out[:len(target)] != target:  # greedy left the answer: ask again and feed it, the question and
        session.restart()  # the answer as decode steps
        full = torch.cat([prompt.context_ids, prompt.question_ids, prompt.answer_ids], 1)
        nll = token_nll(session, full, prompt.context_ids.shape[1])[0, -len(target):].sum().item()
    return prompt.answer in text, text, (nll if target else None)


# ----------------------------------------------------------------------------- the whole harness
@dataclass
class EvalConfig:
    ppl_contexts: tuple[int, ...] = (512, 2048)
    ppl_decode: int = 64
    ppl_sequences: int = 4
    retrieval_lengths: tuple[int, ...] = (1024, 4096, 8192)
    retrieval_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    retrieval_tasks: tuple[str, ...] = ("passkey", "needle")
    retrieval_samples: int = 1
    num_sinks: int = 64
    window: int = 256
    seed: int = 0
    prefill_chunk: int = 4096


def run_eval(model, tok, methods: list[Method], eval_text: str, haystack_text: str, cfg: EvalConfig,
             progress: bool = True, log=print, checkpoint=None) -> dict:
    """Every method on the same tokens; returns a JSON-able report.

    ``checkpoint(partial_report)``, when given, is called after every method's block, so a long run
    that is interrupted keeps what it measured."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    rows, retrieval = [], []
    ids = tok(eval_text, return_tensors="pt").input_ids[0]
    t0 = time.perf_counter()
    max_ctx = max(cfg.ppl_contexts) if cfg.ppl_contexts else 0
    for context in cfg.ppl_contexts:
        per_method = {}  # name -> (kind, per-token NLL, report row) at this context
        length = context + cfg.ppl_decode + 1
        # the same windows of text for every context length: consecutive blocks of the longest
        block = max_ctx + cfg.ppl_decode + 1
        if ids.numel() < cfg.ppl_sequences * block:
            raise ValueError(f"oscar eval: the evaluation text has {ids.numel()} tokens, fewer than "
                             f"{cfg.ppl_sequences} x {block}")
        tokens = torch.stack([ids[i * block + (max_ctx - context): i * block + (max_ctx - context) + length]
                              for i in range(cfg.ppl_sequences)]).to(device)
        for m in methods:
            torch._dynamo.reset()
            s = Session(model, m, tokens.shape[0], length, cfg.num_sinks, cfg.window, prefill_chunk=cfg.prefill_chunk)
            bar = (lambda it: tqdm(it, desc=f"ppl {m.name} @ {context}", unit="step", leave=False)) if progress else None
            per_token = token_nll(s, tokens, context, bar)
            nll, n = per_token.sum().item(), per_token.numel()
            row = {"metric": "ppl", "method": m.name, "context": context, "ppl": math.exp(nll / n), "nll": nll / n,
                   "tokens": n, "bits_per_element": bits_per_element(model.config, m, length, cfg.num_sinks, cfg.window)}
            per_method[m.name] = (m.kind, per_token, row)
            rows.append(row)
            _attach_paired_deltas(per_method)  # now, so a run stopped later keeps its intervals
            if checkpoint:
                checkpoint(_report(cfg, methods, rows, retrieval, t0, partial=True))
            log(f"ppl  context {context:>6}  {m.name:<20} {row['ppl']:10.3f}   ({row['bits_per_element']:.2f} bits/element)")
    rng = random.Random(cfg.seed)
    prompts = [make_retrieval_prompt(tok, haystack_text, task, length, depth, rng)
               for task in cfg.retrieval_tasks for length in cfg.retrieval_lengths for depth in cfg.retrieval_depths
               for _ in range(cfg.retrieval_samples)]
    longest = max((p.context_ids.shape[1] + p.question_ids.shape[1] for p in prompts), default=0) + 16
    for m in methods:
        torch._dynamo.reset()
        # one compile per method, every prompt
        s = Session(model, m, 1, longest, cfg.num_sinks, cfg.window, prefill_chunk=cfg.prefill_chunk)
        it = tqdm(prompts, desc=f"retrieval {m.name}", leave=False) if progress else prompts
        for p in it:
            s.restart()
            ok, text, answer_nll = retrieve(s, replace(p, context_ids=p.context_ids.to(device),
                                                       question_ids=p.question_ids.to(device),
                                                       answer_ids=p.answer_ids.to(device)), tok)
            retrieval.append({"method": m.name, "task": p.task, "length": p.length, "depth": p.depth, "correct": ok,
                              "answer": p.answer, "generated": text, "answer_nll": answer_nll})
        acc = [r["correct"] for r in retrieval if r["method"] == m.name]
        if acc:
            log(f"retrieval  {m.name:<20} {sum(acc)}/{len(acc)} correct")
        if checkpoint:
            checkpoint(_report(cfg, methods, rows, retrieval, t0, partial=True))
    return _report(cfg, methods, rows, retrieval, t0)


def _attach_paired_deltas(per_method: dict) -> None:
    """Give every method measured at a context its paired difference against bf16 there, once bf16 is measured
    (same tokens: far tighter than either perplexity), and against every quantized method measured before it
    (``vs_methods``: two variants of one method differ by less than either differs from bf16, and the paired
    interval between them is the one that can tell them apart)."""
    base = next((nll for kind, nll, _ in per_method.values() if kind == "bf16"), None)
    for kind, nll, row in per_method.values():
        if base is not None and kind != "bf16" and "vs_bf16" not in row:
            row["vs_bf16"] = paired_delta(nll, base)
        if kind == "bf16" or "vs_methods" in row:
            continue
        row["vs_methods"] = {}
        for other, (other_kind, other_nll, _) in per_method.items():
            if other == row["method"]:
                break  # only the methods measured before it
            if other_kind != "bf16":
                row["vs_methods"][other] = paired_delta(nll, other_nll)


def _report(cfg, methods, rows, retrieval, t0, partial=False) -> dict:
    report = {"config": asdict(cfg), "methods": [{"name": m.name, "kind": m.kind,
                                                  "artifact_method": getattr(m.artifacts, "method", None)}
                                                 for m in methods],
              "perplexity": list(rows), "retrieval": list(retrieval), "seconds": round(time.perf_counter() - t0, 1)}
    if partial:
        report["partial"] = True
    return report


# ----------------------------------------------------------------------------- report
def retrieval_vs_bf16(retrieval: list[dict]) -> list[dict]:
    """Each method's retrieval against BF16's on the same prompts, per length: ``lost`` (BF16 answered, the method
    did not), ``gained`` (the reverse) and ``p``, the exact two-sided sign test on those discordant prompts
    (McNemar's exact test): a method equals BF16's retrieval where it loses none, and differs from it only where
    ``p`` is small. Prompts pair by their order, the same for every method (checked by task, length, depth, answer).
    Where the rows carry the answers' teacher-forced NLL, ``answer_nll`` (:func:`answer_nll_delta`) is the paired
    continuous measure, far more sensitive than right or wrong."""
    key = lambda r: (r["task"], r["length"], r["depth"], r.get("answer"))  # noqa: E731
    base = [r for r in retrieval if r["method"] == "bf16"]
    out = []
    for name in dict.fromkeys(r["method"] for r in retrieval if r["method"] != "bf16"):
        rows = [r for r in retrieval if r["method"] == name]
        for length in sorted({r["length"] for r in rows}):
            a = [r for r in base if r["length"] == length]
            b = [r for r in rows if r["length"] == length]
            if not a or [key(r) for r in a[:len(b)]] != [key(r) for r in b]:
                continue  # no BF16 run of these prompts (or a partial one of others)
            lost = sum(x["correct"] and not y["correct"] for x, y in zip(a, b))
            gained = sum(y["correct"] and not x["correct"] for x, y in zip(a, b))
            n, k = lost + gained, min(lost, gained)
            p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
            row = {"method": name, "length": length, "prompts": len(b), "lost": lost, "gained": gained, "p": p}
            pairs = [(y["answer_nll"], x["answer_nll"]) for x, y in zip(a, b)
                     if x.get("answer_nll") is not None and y.get("answer_nll") is not None]
            if len(pairs) >= 2:
                row["answer_nll"] = answer_nll_delta(pairs)
            out.append(row)
    return out


def answer_nll_delta(pairs: list[tuple[float, float]]) -> dict:
    """The answers' NLL under a method against BF16's on the same prompts (``(method, bf16)`` nats a prompt): the
    mean difference in nats with a 95% interval over prompts (independent prompts: a normal interval), and each
    side's mean answer probability. Positive: the method finds the answers less likely."""
    d = torch.tensor([m - b for m, b in pairs], dtype=torch.float64)
    half = 1.96 * d.std().item() / math.sqrt(d.numel())
    return {"delta_nats": d.mean().item(), "ci95_nats": [d.mean().item() - half, d.mean().item() + half],
            "prompts": d.numel(), "p_answer": math.fsum(math.exp(-m) for m, _ in pairs) / len(pairs),
            "p_answer_bf16": math.fsum(math.exp(-b) for _, b in pairs) / len(pairs)}


def format_report(report: dict) -> str:
    lines = []
    ppl = report["perplexity"]
    if ppl:
        contexts = sorted({r["context"] for r in ppl})
        names = list(dict.fromkeys(r["method"] for r in ppl))
        base = {r["context"]: r["ppl"] for r in ppl if r["method"] == "bf16"}
        lines.append("perplexity (teacher-forced decode; lower is better; in brackets: vs bf16 on the same tokens, "
                     "with the half-width of its 95% interval)")
        lines.append(f"  {'method':<30}" + "".join(f"{'ctx ' + str(c):>22}" for c in contexts) + f"{'bits/elem':>12}")
        for n in names:
            cells = []
            for c in contexts:
                r = next((r for r in ppl if r["method"] == n and r["context"] == c), None)
                rel = f" ({100 * (r['ppl'] / base[c] - 1):+.1f}%)" if r and c in base else ""
                ci = (r or {}).get("vs_bf16", {}).get("ci95_pct")
                if ci:  # the paired interval: half its width
                    rel = f" ({r['vs_bf16']['pct']:+.1f}±{(ci[1] - ci[0]) / 2:.1f}%)"
                cells.append(f"{r['ppl']:.3f}{rel}" if r else "-")
            bits = next(r["bits_per_element"] for r in ppl if r["method"] == n and r["context"] == contexts[-1])
            lines.append(f"  {n:<30}" + "".join(f"{c:>22}" for c in cells) + f"{bits:>12.2f}")
        pairs = [(r["context"], r["method"], other, d) for r in ppl for other, d in r.get("vs_methods", {}).items()
                 if "ci95_pct" in d]
        if pairs:
            lines.append("paired between quantized methods (same tokens; 95% interval)")
            for c, a, b, d in pairs:
                lo, hi = d["ci95_pct"]
                lines.append(f"  ctx {c:>6}  {a} vs {b}: {d['pct']:+.2f}% ({lo:+.2f}..{hi:+.2f})")
    ret = report["retrieval"]
    if ret:
        lengths = sorted({r["length"] for r in ret})
        names = list(dict.fromkeys(r["method"] for r in ret))
        lines.append("retrieval accuracy (passkey + needle, all depths)")
        lines.append(f"  {'method':<30}" + "".join(f"{str(length):>10}" for length in lengths))
        for n in names:
            cells = []
            for length in lengths:
                rs = [r["correct"] for r in ret if r["method"] == n and r["length"] == length]
                cells.append(f"{sum(rs)}/{len(rs)}")
            lines.append(f"  {n:<30}" + "".join(f"{c:>10}" for c in cells))
        paired = retrieval_vs_bf16(ret)
        if paired:
            lines.append("retrieval against bf16 on the same prompts (lost: bf16 answered, the method not; exact "
                         "sign test on the prompts that differ)")
            for d in paired:
                nll = d.get("answer_nll")
                extra = (f"; answer NLL {nll['delta_nats']:+.3f} nats ({nll['ci95_nats'][0]:+.3f}.."
                         f"{nll['ci95_nats'][1]:+.3f}), mean answer probability {nll['p_answer']:.3f} against "
                         f"{nll['p_answer_bf16']:.3f}") if nll else ""
                lines.append(f"  {d['method']:<30} {d['length']:>7}: lost {d['lost']}, gained {d['gained']} of "
                             f"{d['prompts']} (p {d['p']:.2f}){extra}")
    return "\n".join(lines)


def plot_report(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ppl, ret = report["perplexity"], report["retrieval"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    if ppl:
        ctx = max(r["context"] for r in ppl)
        for r in (r for r in ppl if r["context"] == ctx):
            ax.scatter(r["bits_per_element"], r["nll"], s=40)
            ax.annotate(r["method"], (r["bits_per_element"], r["nll"]), fontsize=8, xytext=(4, 2), textcoords="offset points")
        bits = [r["bits_per_element"] for r in ppl if r["context"] == ctx]
        if max(bits) >= 4 * min(bits):  # a log axis only where it spans two octaves: otherwise it has no ticks
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("bits per K/V element (metadata and BF16 tokens included)")
        ax.set_ylabel(f"loss (nats/token), context {ctx}")
        ax.set_title("loss vs bits")
    ax = axes[1]
    if ret:
        names = list(dict.fromkeys(r["method"] for r in ret))
        lengths = sorted({r["length"] for r in ret})
        for n in names:
            accs = [sum(r["correct"] for r in ret if r["method"] == n and r["length"] == L) /
                    max(1, sum(1 for r in ret if r["method"] == n and r["length"] == L)) for L in lengths]
            ax.plot(lengths, accs, marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("retrieval accuracy (passkey + needle, all depths)")
        ax.set_title("retrieval vs context")
        ax.legend(fontsize=8)
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, "no retrieval in this run", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_report(report: dict, directory, stem: str) -> tuple[Path, Path]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    js, png = d / f"{stem}.json", d / f"{stem}.png"
    js.write_text(json.dumps(report, indent=2))
    plot_report(report, png)
    return js, png
