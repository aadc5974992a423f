"""Localise a wrong perplexity of a packaged model on the GPU: eager fp32, eager bf16 and the oscar quantize-off
session (Triton kernels, or the reference ops under OSCAR_KERNELS=reference) on the same tokens."""
import math
import os
import sys
import torch

from oscar_compile.assets import load_model, load_text
from oscar_compile.evaluation import Method, Session, token_nll

name, context, steps, batch = sys.argv[1], int(sys.argv[2]), 32, 2
only_session = os.environ.get("OSCAR_KERNELS") == "reference"
model, tok = load_model(name)
ids = tok(load_text("wikipedia"), return_tensors="pt").input_ids[0]
n = context + steps + 1
tokens = torch.stack([ids[i * n:(i + 1) * n] for i in range(batch)]).cuda()


def eager_nll(m):
    with torch.no_grad():
        lg = m(tokens, logits_to_keep=steps + 1).logits.float()[:, :-1]
    return torch.nn.functional.cross_entropy(lg.transpose(1, 2), tokens[:, context + 1:], reduction="none").cpu()


rows = []
if not only_session:
    model.cuda()
    rows.append(("eager fp32", eager_nll(model)))
model.to(device="cuda", dtype=torch.bfloat16)
if not only_session:
    rows.append(("eager bf16", eager_nll(model)))
tag = "reference ops" if only_session else "triton"
s = Session(model, Method("bf16", "bf16"), batch, n, num_sinks=64, window=256)
rows.append((f"session bf16 {tag}", token_nll(s, tokens, context)))
for label, nll in rows:
    print(f"{label:30s} ppl {math.exp(nll.double().mean()):10.3f}  per-seq {[round(math.exp(x), 2) for x in nll.double().mean(1).tolist()]}")
