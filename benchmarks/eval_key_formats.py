"""Key formats end to end, by fake quantization on a real model (an experiment before any kernel work).

The model runs eagerly with a transformers cache that stores what the oscar cache would read back: sinks and
the newest ``window`` tokens exact, every older value an INT2 round trip in the artifact's basis (per row, its
clip ratio), every older key in one of these formats, also in the artifact's basis:

* ``row``: the cache's format (one scale and min per token over all channels, the artifact's clip ratio);
  ``row64``/``row32``: groups of 64/32 channels;
* ``chan64``/``chan32``: one scale and min per channel over 64/32 consecutive tokens (KIVI's axis), quantized
  once a whole group has left the window (the tokens of an incomplete group stay exact, as KIVI's residual);
* ``bf16``: nothing quantized.

Reported per format: perplexity of teacher-forced decode after ``context`` tokens (paired against the first
format), and passkey/needle retrieval at ``context`` (12 prompts, as ``oscar eval`` builds them).

    python benchmarks/eval_key_formats.py MODEL ARTIFACT_DIR CONTEXT SEQUENCES DECODE row,row64,chan64 [RETRIEVAL_LEN or -] [OUT.json]

NO_RETRIEVAL=1 skips retrieval (a 2K prompt is ~50 s a format on one CPU thread).
"""
import sys, json, math, random, time, torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from oscar_compile.assets import load_model, load_text
from oscar_compile.calibration.artifacts import load_artifacts
from oscar_compile.quant import quantize_int2, dequantize_int2
from oscar_compile.evaluation import paired_delta, make_retrieval_prompt
from probe_key_noise import per_channel_round_trip

def rt_rows(x, clip, gs=None):
    return dequantize_int2(*quantize_int2(x, gs, clip), gs)

def rt_chan(x):  # x [B, H, N, d]: per channel over the N tokens (probe_key_noise's round trip, one group)
    return per_channel_round_trip(x.flatten(0, 1), x.shape[2], 0).view_as(x)

class FQLayer(DynamicLayer):
    def __init__(self, tr, mode, sinks, window):
        super().__init__()
        self.tr, self.mode, self.S, self.W = tr, mode, sinks, window
        self.kq = self.vq = 0  # tokens [S, kq) of keys / values are quantized
        self.k = self.v = None
        if tr is not None:
            self.kB, self.vB = tr.key_transform.double(), tr.value_transform.double()
            self.kBi, self.vBi = torch.linalg.inv(self.kB).float(), torch.linalg.inv(self.vB).float()
            self.kB, self.vB = self.kB.float(), self.vB.float()
    def _rot(self, x, B, mu): return torch.einsum("bhtd,hde->bhte", x.float() - mu[None, :, None], B)
    def _back(self, x, Bi, mu): return torch.einsum("bhte,hed->bhtd", x, Bi) + mu[None, :, None]
    def update(self, key_states, value_states, *args, **kwargs):
        keys = key_states if self.k is None else torch.cat([self.k, key_states], -2)
        values = value_states if self.v is None else torch.cat([self.v, value_states], -2)
        self.k, self.v = keys.clone(), values.clone()
        self.keys, self.values, self.is_initialized = keys, values, True
        if self.tr is None or self.mode == "bf16":
            return keys, values
        n = self.k.shape[-2]; end = n - self.W; tr = self.tr
        self.kq = max(self.kq, self.S); self.vq = max(self.vq, self.S)
        if end > self.vq:  # values: per row, as the cache stores them
            sl = slice(self.vq, end)
            self.v[:, :, sl] = self._back(rt_rows(self._rot(self.v[:, :, sl], self.vB, tr.value_mean), tr.value_clip), self.vBi, tr.value_mean).to(self.v.dtype)
            self.vq = end
        if self.mode.startswith("row"):
            gs = int(self.mode[4:]) if self.mode != "row" else None
            if end > self.kq:
                sl = slice(self.kq, end)
                self.k[:, :, sl] = self._back(rt_rows(self._rot(self.k[:, :, sl], self.kB, tr.key_mean), tr.key_clip, gs), self.kBi, tr.key_mean).to(self.k.dtype)
                self.kq = end
        else:  # chanN: whole groups of N tokens once they left the window; the rest of the way stays exact
            N = int(self.mode[4:])
            while end - self.kq >= N:
                sl = slice(self.kq, self.kq + N)
                self.k[:, :, sl] = self._back(rt_chan(self._rot(self.k[:, :, sl], self.kB, tr.key_mean)), self.kBi, tr.key_mean).to(self.k.dtype)
                self.kq += N
        return keys, values
    def get_seq_length(self): return 0 if self.k is None else self.k.shape[-2]

class FQCache(DynamicCache):
    def __init__(self, config, art, mode, sinks=64, window=256):
        super().__init__(config=config)
        cfg = config.get_text_config()
        h = cfg.num_key_value_heads; d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = [FQLayer(None if (art is None or i in art.sliding_windows) else art.layer_transforms(i, h, d), mode, sinks, window)
                       for i in range(cfg.num_hidden_layers)]

@torch.no_grad()
def run(model, cache_fn, ids):
    cache = cache_fn()
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].float()

@torch.no_grad()
def nll(model, cache_fn, tokens, context):
    cache, logits = run(model, cache_fn, tokens[:, :context])
    res = []
    for p in range(context, tokens.shape[1] - 1):
        logits = model(tokens[:, p:p + 1], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        res.append(torch.nn.functional.cross_entropy(logits, tokens[:, p + 1], reduction="none"))
    return torch.stack(res, 1).double()

@torch.no_grad()
def retrieve(model, cache_fn, prompt, tok, max_new=8):
    cache, logits = run(model, cache_fn, prompt.context_ids)
    for i in range(prompt.question_ids.shape[1]):
        logits = model(prompt.question_ids[:, i:i+1], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    out = []
    for _ in range(max_new):
        nxt = logits.argmax(-1, keepdim=True); out.append(int(nxt))
        logits = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    text = tok.decode(out, skip_special_tokens=True)
    return prompt.answer in text

model_name, art_dir, context, nseq, ndec, modes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6].split(",")
rlen = int(sys.argv[7]) if len(sys.argv) > 7 and sys.argv[7] != "-" else context
model, tok = load_model(model_name); model.eval()
art = load_artifacts(art_dir)
ids = tok(load_text("wikipedia"), return_tensors="pt").input_ids[0]
block = context + ndec + 1
tokens = torch.stack([ids[i * block:(i + 1) * block] for i in range(nseq)])
rng = random.Random(0)
hay = load_text("paul-graham")
prompts = [make_retrieval_prompt(tok, hay, task, rlen, depth, rng) for task in ("passkey", "needle") for depth in (0.1, 0.5, 0.9) for _ in range(2)]
res, base = {}, None
for mode in modes:
    t0 = time.time()
    fn = lambda: FQCache(model.config, art, mode)
    chunks = [nll(model, fn, tokens[i:i + 8], context) for i in range(0, nseq, 8)]
    x = torch.cat(chunks)
    if base is None: base = x
    r = {"ppl": math.exp(x.mean().item()), "tokens": x.numel()}
    if mode != modes[0]: r["vs_" + modes[0]] = paired_delta(x, base)
    if not __import__("os").environ.get("NO_RETRIEVAL"): r["retrieval"] = sum(retrieve(model, fn, p, tok) for p in prompts)
    res[mode] = r
    print(mode, json.dumps(r), f"{time.time() - t0:.0f}s", flush=True)
out = sys.argv[8] if len(sys.argv) > 8 else None
if out:
    json.dump({"model": model_name, "artifact": art_dir, "context": context, "sequences": nseq, "decode": ndec, "formats": res}, open(out, "w"), indent=1)
