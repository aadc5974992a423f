"""Random sessions of the API a server uses, checked against transformers' own cache semantics.

Each example makes a new :class:`OscarCache` (random length, batch given or taken from the first input) and
runs one to three ``generate`` calls on it through one compiled model per mode: a fresh request (after
``cache.reset()``) or a continuation of the previous one (the same cache, its output plus a new prompt), with
random prompt lengths, new-token counts, left padding and beam search. Expected:

* a call that needs more positions than the cache holds raises ``CacheCapacityError`` (transformers'
  ``StaticCache`` raises there too), a batch larger than the cache's raises ``ValueError``; the cache stays
  usable after either;
* otherwise, with quantization off, the tokens of eager transformers with its ``DynamicCache`` (the same
  calls, the same continuations); with quantization on, the tokens of the same eager model whose attention
  calls the oscar ops directly on an INT2 cache of its own (``reference_attention``).

``derandomize`` keeps the examples fixed from run to run; the count keeps the test near two minutes on a
2-core CPU (Dynamo compiles a graph pair per size bucket; the compiled models are reused across examples).
"""

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.masking_utils import sdpa_mask

import oscar_compile
from oscar_compile import CacheCapacityError, LayerTransforms, OscarCache, PagedInt2KVCache
from oscar_compile.testing import cache_kwarg, reference_attention, tiny_model

# a few tokens reach the INT2 pages; keys per channel over each page (the backend's default, named for the oracle)
OPTS = dict(num_sinks=2, window=3, page_size=4, key_format="channel")
ORACLE_LEN = 96
_MODELS: dict = {}


class _Oracle:
    """The eager reference of the quantized mode: transformers attention replaced by the oscar ops on ``int2``."""

    def __init__(self, model):
        self.model, self.int2 = model, None
        AttentionInterface.register("oscar_property_oracle", lambda *a, **k: reference_attention(self.int2)(*a, **k))
        AttentionMaskInterface.register("oscar_property_oracle", sdpa_mask)  # else an unknown name gets no mask
        model.config._attn_implementation = "oscar_property_oracle"

    def fresh(self, rows: int) -> None:
        cfg = self.model.config
        h, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        self.int2 = PagedInt2KVCache(cfg.num_hidden_layers, h, d, max_batch_size=rows, max_seq_len=ORACLE_LEN,
                                     dtype=torch.float32, **OPTS)
        for layer in range(cfg.num_hidden_layers):
            self.int2.set_transforms(layer, LayerTransforms.hadamard(h, d))
        for row in range(rows):
            self.int2.allocate(row, ORACLE_LEN)


class _ReorderedWith(DynamicCache):
    """A DynamicCache whose beam-search reorder also moves the oracle's INT2 rows."""

    def __init__(self, config, oracle):
        super().__init__(config=config)
        self.oracle = oracle

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.oracle.int2.reorder_rows(beam_idx)


def _models():
    if not _MODELS:
        _MODELS["eager"] = tiny_model("llama")
        _MODELS["oracle"] = _Oracle(tiny_model("llama"))
        _MODELS[False] = oscar_compile.compile(tiny_model("llama"), inductor=False, quantize=False)
        _MODELS[True] = oscar_compile.compile(tiny_model("llama"), inductor=False, **OPTS)
    return _MODELS


calls = st.fixed_dictionaries(dict(
    fresh=st.booleans(),  # reset and start new sequences, or continue the previous ones
    batch=st.integers(1, 3),
    beams=st.sampled_from([1, 1, 2]),
    prompt=st.integers(1, 8),
    new=st.integers(1, 5),
    pad=st.lists(st.integers(0, 7), min_size=3, max_size=3),  # left padding per row (below the prompt length)
    seed=st.integers(0, 2**16),
))
sessions = st.fixed_dictionaries(dict(
    given_batch=st.sampled_from([None, 2, 6]),
    slack=st.integers(-2, 16),  # cache length beyond what the first call needs (negative: too short)
    calls=st.lists(calls, min_size=1, max_size=3),
))


def _prompt(call):
    gen = torch.Generator().manual_seed(call["seed"])
    ids = torch.randint(3, 97, (call["batch"], call["prompt"]), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(call["batch"]):
        pad = min(call["pad"][row], call["prompt"] - 1)
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


# One test per mode: Dynamo keeps the graphs of both compiled models under one code object (transformers'
# forward wrapper), and torch 2.11 counts them against one recompile limit (the autouse fixture resets Dynamo
# between tests). 150 examples each.
@pytest.mark.parametrize("quantize", [False, True], ids=["bf16", "int2"])
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(session=sessions)
def test_random_sessions_match_transformers(quantize, session):
    session = dict(session, quantize=quantize)
    m = _models()
    compiled = m[session["quantize"]]
    reference = m["oracle"].model if session["quantize"] else m["eager"]
    kw = cache_kwarg(compiled)
    first = session["calls"][0]
    length = max(1, first["prompt"] + first["new"] - 1 + session["slack"])
    cache = OscarCache(compiled, max_cache_len=length, max_batch_size=session["given_batch"])
    holds = session["given_batch"]  # rows the cache takes (set by the first input when not given)
    prev = None  # (output ids, attention mask, reference cache) of the sequences the cache holds
    for call in session["calls"]:
        continued = not call["fresh"] and prev is not None
        if continued:  # the same sequences: their output and a new prompt (no beams: rows would change)
            out, out_mask, ref_cache = prev
            call = dict(call, batch=out.shape[0], beams=1)
            more, more_mask = _prompt(dict(call, pad=[0, 0, 0]))
            generated = torch.ones_like(out_mask[:, :1]).expand(-1, out.shape[1] - out_mask.shape[1])
            ids, mask = torch.cat([out, more], 1), torch.cat([out_mask, generated, more_mask], 1)
            rows = call["batch"]
        else:
            ids, mask = _prompt(call)
            rows = call["batch"] * call["beams"]
            cache.reset()
            if session["quantize"]:
                m["oracle"].fresh(rows)
            ref_cache = _ReorderedWith(reference.config, m["oracle"]) if session["quantize"] else \
                DynamicCache(config=reference.config)
        event(f"quantize {session['quantize']}, {'continued' if continued else 'fresh'}, {call['beams']} beam(s)")
        args = dict(attention_mask=mask, max_new_tokens=call["new"], min_new_tokens=call["new"], do_sample=False,
                    num_beams=call["beams"])
        if holds is not None and rows > holds:
            event("batch larger than the cache's: refused")
            with pytest.raises(ValueError, match=f"holds {holds} sequence.*batch of {rows}"):
                compiled.generate(ids, **{kw: cache}, **args)
            prev = None
            continue
        holds = holds or rows
        if ids.shape[1] + call["new"] - 1 > length:
            event("cache too short: refused")
            with pytest.raises(CacheCapacityError, match=f"holds {length} tokens per sequence"):
                compiled.generate(ids, **{kw: cache}, **args)
            prev = None
            continue
        got = compiled.generate(ids, **{kw: cache}, **args)
        want = reference.generate(ids, **{kw: ref_cache}, **args)
        assert torch.equal(got, want), (session, call)
        prev = (got, mask, ref_cache) if call["beams"] == 1 else None
