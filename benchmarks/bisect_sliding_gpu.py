"""Bisect a wrong sliding-window result on the GPU: the Gemma-3-geometry quantize-off check under several
kernel switches and sizes, each in its own process (the kernel switches are read at import)."""
import json
import os
import subprocess
import sys

EVAL = {"chunk": 4096, "context": 8192, "batch": 8, "sinks": 64, "recent": 256}
VARIANTS = [  # name, env, kwargs
    ("baseline 6000/2000 b2", {}, {}),
    ("chunk 4096", {}, {"chunk": 4096}),
    ("batch 8", {}, {"batch": 8}),
    ("sinks 64 window 256", {}, {"sinks": 64, "recent": 256}),
    ("context 8192", {}, {"context": 8192}),
    ("eval geometry", {}, EVAL),
    ("eval geometry, reference ops", {"OSCAR_KERNELS": "reference"}, EVAL),
    ("eval geometry, 18 layers h640", {}, {**EVAL, "layers": 18, "hidden": 640}),
]


def one(kwargs):
    import torch

    import transformers

    from oscar_compile.evaluation import Method, Session
    from oscar_compile.testing import rel_error

    a = dict(dtype="bfloat16", window=512, max_chunk=4096, chunk=2000, context=6000, steps=16, batch=2, sinks=4,
             recent=8, layers=2, hidden=128)
    a.update(kwargs)
    dtype = getattr(torch, a["dtype"])
    layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * (a["layers"] // 6) if a["layers"] >= 6 \
        else ["sliding_attention", "full_attention"]
    cfg = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=a["hidden"], intermediate_size=2 * a["hidden"],
                                        num_hidden_layers=len(layer_types), num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                                        sliding_window=a["window"], max_position_embeddings=32768,
                                        layer_types=layer_types, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval().to("cuda", dtype)
    n, ctx = a["steps"], a["context"]
    ids = torch.randint(1, 512, (a["batch"], ctx + n), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        ref = model(ids).logits.float()
    s = Session(model, Method("bf16", "bf16", options={"max_chunk": a["max_chunk"]}), a["batch"], ctx + n,
                num_sinks=a["sinks"], window=a["recent"], cache_dtype=dtype, prefill_chunk=a["chunk"])
    got = [s(ids[:, :ctx])] + [s(ids[:, p:p + 1]) for p in range(ctx, ctx + n - 1)]
    got = torch.stack(got, 1)
    want = ref[:, ctx - 1: ctx + n - 1]
    c = lambda x: x - x.mean(-1, keepdim=True)  # noqa: E731
    print("RESULT", rel_error(c(got), c(want)), "first step", rel_error(c(got[:, 0]), c(want[:, 0])),
          "last", rel_error(c(got[:, -1]), c(want[:, -1])))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(json.loads(sys.argv[1]))
        sys.exit()
    procs = []
    for name, env, kw in VARIANTS:
        p = subprocess.Popen([sys.executable, __file__, json.dumps(kw)], env={**os.environ, **env},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append((name, p))
    for name, p in procs:
        out = p.communicate()[0]
        res = [l for l in out.splitlines() if l.startswith("RESULT")]
        print(f"{name:34s} {res[0] if res else 'FAILED: ' + out[-1500:]}", flush=True)
