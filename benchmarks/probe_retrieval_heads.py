"""Which heads read the needle? BF16 attention of the answer onto the needle, per layer and KV head.

For each `oscar eval` retrieval prompt (the same prompts: same seed, lengths, depths, tasks, samples), one BF16
forward pass of haystack + question + answer with eager attention; a KV head's score is the attention mass, averaged
over its query heads, that the positions predicting the answer (the question's last token and the answer's tokens
but the last) put on the needle's tokens. Heads that retrieve put much of it there; the rest, almost none. Beside it,
the calibration's induction score (repeated random tokens, no needle) and how well its ranking agrees.

    python benchmarks/probe_retrieval_heads.py --model smollm2-135m --lengths 2048 --samples 6 --depths 0.1,0.5
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from oscar_compile.assets import load_model
from oscar_compile.calibration import induction_scores
from oscar_compile.cli import read_text_arg
from oscar_compile.evaluation import make_retrieval_prompt


def needle_span(prompt, tok) -> tuple[int, int]:
    """[first, last) token positions of the needle sentence in the prompt's context (found by its answer)."""
    ctx = prompt.context_ids[0].tolist()
    ans = prompt.answer_ids[0].tolist()
    hits = [i for i in range(len(ctx) - len(ans) + 1) if ctx[i:i + len(ans)] == ans]
    if not hits:  # the answer tokenizes differently inside the sentence: find its text
        text_pos = [i for i in range(len(ctx)) if prompt.answer in tok.decode(ctx[i:i + 4])]
        hits = text_pos[:1] + text_pos[-1:]
    if not hits:
        raise RuntimeError(f"needle not found for answer {prompt.answer!r}")
    return max(0, hits[0] - 8), min(len(ctx), hits[-1] + len(ans) + 4)


@torch.no_grad()
def head_scores(model, tok, prompts) -> torch.Tensor:
    """[prompts, layers, kv heads] attention mass on the needle."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    out = []
    for p in prompts:
        lo, hi = needle_span(p, tok)
        ids = torch.cat([p.context_ids, p.question_ids, p.answer_ids], 1)
        first = p.context_ids.shape[1] + p.question_ids.shape[1] - 1  # predicts the first answer token
        res = model(ids, output_attentions=True)
        per_layer = []
        for a in res.attentions:  # [1, Hq, T, T]
            mass = a[0, :, first:ids.shape[1] - 1, lo:hi].sum(-1).mean(-1)  # [Hq]
            per_layer.append(mass.view(-1, groups).mean(-1))
        out.append(torch.stack(per_layer))
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--haystack", default="paul-graham")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--depths", default="0.1,0.5")
    ap.add_argument("--tasks", default="passkey,needle")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    model.config._attn_implementation = "eager"
    model.eval()
    haystack, _ = read_text_arg(args.haystack, "--haystack")
    rng = random.Random(args.seed)  # the eval's order: task, length, depth, sample
    prompts = [make_retrieval_prompt(tok, haystack, task, int(length), float(depth), rng)
               for task in args.tasks.split(",") for length in args.lengths.split(",")
               for depth in args.depths.split(",") for _ in range(args.samples)]
    scores = head_scores(model, tok, prompts)
    mean = scores.mean(0)  # [layers, kv heads]
    order = mean.flatten().argsort(descending=True)
    h = mean.shape[1]
    top = [(int(i) // h, int(i) % h, round(mean.flatten()[i].item(), 4)) for i in order[: args.top]]
    print("mean attention mass on the needle, top heads (layer.head):")
    print("  " + "  ".join(f"{a}.{b}:{m:.3f}" for a, b, m in top))
    print("per layer (sum over KV heads):", " ".join(f"{x:.2f}" for x in mean.sum(1).tolist()))
    # what calibration can see without a needle: the induction score on repeated random tokens
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model.config._attn_implementation = "sdpa"
    induction = torch.tensor(induction_scores(model, int(cfg.vocab_size), tok.bos_token_id))
    by_induction = induction.flatten().argsort(descending=True)
    agree = {}
    for k in (4, 8, 16):
        agree[k] = {"overlap": len(set(order[:k].tolist()) & set(by_induction[:k].tolist())),
                    "needle_mass_of_induction_top": round(mean.flatten()[by_induction[:k]].sum().item(), 4),
                    "needle_mass_of_needle_top": round(mean.flatten()[order[:k]].sum().item(), 4)}
    rho = spearman(induction.flatten(), mean.flatten())
    print(f"induction score top heads: " + "  ".join(f"{int(i) // h}.{int(i) % h}:{induction.flatten()[i]:.3f}"
                                                    for i in by_induction[: args.top]))
    print(f"agreement with the needle's ranking: Spearman {rho:.2f}; " + "; ".join(
        f"top {k}: {a['overlap']} shared, needle mass {a['needle_mass_of_induction_top']:.2f} of "
        f"{a['needle_mass_of_needle_top']:.2f}" for k, a in agree.items()))
    if args.out:
        json.dump({"model": args.model, "prompts": len(prompts), "mean_mass": mean.tolist(),
                   "per_prompt": scores.tolist(), "top": top, "induction_scores": induction.tolist(),
                   "spearman": rho, "agreement": agree}, open(args.out, "w"), indent=1)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation (ties broken by order: the scores here are continuous)."""
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


if __name__ == "__main__":
    main()
