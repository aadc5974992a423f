import expecttest
import torch

import oscar_compile
from oscar_compile.cli import main as cli_main
from oscar_compile.testing import TinyDecoder, tiny_model


def _ids(t=9):
    return torch.randint(3, 90, (1, t), generator=torch.Generator().manual_seed(0))


class TestExplain(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_static_cache_prefill_and_decode_summary(self):
        report = oscar_compile.explain(tiny_model("llama"), _ids(), max_new_tokens=1, cache="static")
        self.assertExpectedInline(report.summary(), """\
graph 0: 2 attention call(s), 2 rewritten, 0 attention / 0 cache write(s) left unchanged
    #  sdpa node              slot       cache write  q/kv heads    d  queries  mask      causal scale
    0  attn_output            layer 0    index_copy_  6/2          16  9        none      yes    0.25
    1  attn_output_5          layer 1    index_copy_  6/2          16  9        none      yes    0.25
graph 1: 2 attention call(s), 2 rewritten, 0 attention / 0 cache write(s) left unchanged
    #  sdpa node              slot       cache write  q/kv heads    d  queries  mask      causal scale
    0  attn_output            layer 0    index_copy_  6/2          16  1        bool      no     0.25
    1  attn_output_5          layer 1    index_copy_  6/2          16  1        bool      no     0.25""")

    def test_exact_heads_summary(self):
        # a layer whose retrieval heads stay in BF16 (exact_heads) says which heads are which
        backend = oscar_compile.oscar_backend(inductor=False, exact_heads={1: [0]})
        report = oscar_compile.explain(tiny_model("llama"), _ids(), max_new_tokens=1, cache="oscar", backend=backend)
        self.assertExpectedInline(report.summary().splitlines()[3], """    1  attn_output_5          layer 1    index_copy_  6/2          16  9        bool      no     0.25      KV heads 0 BF16, 1 INT2""")

    def test_dynamic_cache_summary(self):
        report = oscar_compile.explain(tiny_model("gpt2"), _ids(), max_new_tokens=1, cache="dynamic")
        self.assertExpectedInline(report.summary(), """\
graph 0: 2 attention call(s), 2 rewritten, 0 attention / 0 cache write(s) left unchanged
    #  sdpa node              slot       cache write  q/kv heads    d  queries  mask      causal scale
    0  attn_output            layer 0    cat          4/4          16  9        none      yes    0.25
    1  attn_output_5          layer 1    cat          4/4          16  9        none      yes    0.25
graph 1: 2 attention call(s), 2 rewritten, 0 attention / 0 cache write(s) left unchanged
    #  sdpa node              slot       cache write  q/kv heads    d  queries  mask      causal scale
    0  attn_output            layer 0    cat          4/4          16  1        none      no     0.25
    1  attn_output_5          layer 1    cat          4/4          16  1        none      no     0.25""")

    def test_hand_written_decoder_summary_and_diff(self):
        model = TinyDecoder(batch=1)
        report = oscar_compile.explain(model, _ids(5), torch.arange(5))
        self.assertExpectedInline(report.summary(), """\
graph 0: 2 attention call(s), 2 rewritten, 0 attention / 0 cache write(s) left unchanged
    #  sdpa node              slot       cache write  q/kv heads    d  queries  mask      causal scale
    0  o                      layer 0    setitem      4/2          16  5        bool      no     0.25
    1  o_1                    layer 1    setitem      4/2          16  5        bool      no     0.25""")
        diff = report.diff()
        self.assertIn("_buffers_k_cache_[(slice(None, None, None), slice(None, None, None), l_input_pos_)] = k", diff)
        self.assertIn("torch.ops.oscar.store.default(", diff)
        self.assertIn("torch.ops.oscar.attention.default(", diff)
        self.assertNotIn("scaled_dot_product_attention", report.after(0))

    def test_sliding_window_model_summary(self):
        # Gemma 3: a local (sliding, bool mask) and a global layer, q/k norms, query_pre_attn_scalar scale
        report = oscar_compile.explain(tiny_model("gemma3"), _ids(12), max_new_tokens=1, cache="oscar")
        self.assertExpectedInline(report.summary(), """\
graph 0: 2 attention call(s), 2 rewritten, 0 attention / 0 cache write(s) left unchanged
    #  sdpa node              slot       cache write  q/kv heads    d  queries  mask      causal scale
    0  attn_output            layer 0    index_copy_  6/2          16  12       bool      no     0.2041
    1  attn_output_5          layer 1    index_copy_  6/2          16  12       bool      no     0.2041
graph 1: 2 attention call(s), 2 rewritten, 0 attention / 0 cache write(s) left unchanged
    #  sdpa node              slot       cache write  q/kv heads    d  queries  mask      causal scale
    0  attn_output            layer 0    index_copy_  6/2          16  1        bool      no     0.2041
    1  attn_output_5          layer 1    index_copy_  6/2          16  1        bool      no     0.2041""")

    def test_sequence_major_cache_summary(self):
        model = TinyDecoder(batch=1, layout="seq", write="slice")
        report = oscar_compile.explain(model, _ids(5), torch.arange(5), 0)
        self.assertExpectedInline(report.summary(), """\
graph 0: 2 attention call(s), 2 rewritten, 0 attention / 0 cache write(s) left unchanged
    #  sdpa node              slot       cache write  q/kv heads    d  queries  mask      causal scale
    0  o                      layer 0    setitem [B,T,H,d] 4/2          16  5        bool      no     0.25
    1  o_1                    layer 1    setitem [B,T,H,d] 4/2          16  5        bool      no     0.25""")

    def test_unmatched_reasons(self):
        def extra_read(kb, vb, pos, k, q):
            kb.index_copy_(2, pos, k)
            vb.index_copy_(2, pos, k)
            a = torch.nn.functional.scaled_dot_product_attention(q, kb, vb, is_causal=True)
            return a + kb.sum()  # the cache is read outside attention too

        def same_tensor(buf, pos, k, q):
            buf.index_copy_(2, pos, k)
            return torch.nn.functional.scaled_dot_product_attention(q, buf, buf, is_causal=True)

        args = (torch.arange(4), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
        report = oscar_compile.explain(extra_read, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), *args)
        self.assertExpectedInline(report.summary(), """\
graph 0: 1 attention call(s), 0 rewritten, 1 attention / 2 cache write(s) left unchanged
  left unchanged: attention a: the cache tensor l_kb_ is also used by sum_1 = sum(l_kb_); rewriting would change that use
  left unchanged: cache write index_copy_: kept because the attention reading it (a) is kept
  left unchanged: cache write index_copy__1: kept because the attention reading it (a) is kept""")
        report = oscar_compile.explain(same_tensor, torch.zeros(1, 2, 4, 8), *args)
        self.assertExpectedInline(report.summary(), """\
graph 0: 1 attention call(s), 0 rewritten, 1 attention / 1 cache write(s) left unchanged
  left unchanged: attention scaled_dot_product_attention: key and value read the same tensor
  left unchanged: cache write index_copy_: kept because the attention reading it (scaled_dot_product_attention) is kept""")

    def test_cli_explain(self):
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli_main(["explain", "--model", "tiny:qwen2", "--cache", "oscar"])
        self.assertEqual(rc, 0)
        text = out.getvalue()
        self.assertIn("graph 0: 2/2 layers rewritten", text)
        self.assertIn("graph 1: 2/2 layers rewritten", text)


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else None
