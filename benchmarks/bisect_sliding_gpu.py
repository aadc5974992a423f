"""Bisect a wrong sliding-window result on the GPU: the Gemma-3-geometry quantize-off check under several
kernel switches and sizes, each in its own process (the kernel switches are read at import)."""
import json
import os
import subprocess
import sys

EVAL = {"chunk": 4096, "context": 8192, "batch": 8, "sinks": 64, "recent": 256}
VARIANTS = [  # name, env, kwargs (the defaults in one(): window 512, 6000-token prompt in chunks of 2000, batch 2)
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

    from oscar_compile.testing import gemma3_like_model, quantize_off_vs_eager

    a = dict(dtype="bfloat16", window=512, max_chunk=4096, chunk=2000, context=6000, steps=16, batch=2, sinks=4,
             recent=8, layers=2, hidden=128)
    a.update(kwargs)
    model = gemma3_like_model("cuda", getattr(torch, a["dtype"]), a["window"], a["layers"], a["hidden"])
    print("RESULT", quantize_off_vs_eager(model, a["context"], a["steps"], a["max_chunk"], a["chunk"], a["batch"],
                                          a["sinks"], a["recent"]))


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
