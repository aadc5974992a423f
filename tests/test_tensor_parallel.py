"""Tensor parallelism on CPU: transformers' ``tp_plan="auto"`` over ``torch.distributed`` (gloo), spawned ranks.

One process calibrates the whole model and computes the references; each rank loads the model split by
KV head, the same artifact, compiles with oscar and runs a prefill plus teacher-forced decode steps (fixed
tokens, so a near-tie cannot send the ranks and the reference down different paths). Quantization off:
equal to the single-process eager model (fp32 rounding: 1e-5). INT2: equal to the single-process INT2
model (the same per-head transforms and ops, so only summation order differs: 1e-4).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import oscar_compile
from oscar_compile import OscarCache
from oscar_compile.calibration.artifacts import ArtifactError, load_artifacts
from oscar_compile.hf import cache_kwarg

PROMPT, STEPS = 9, 6


def _tiny_llama(path):
    import transformers

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def _tokens():
    return torch.randint(1, 96, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(7))


def _forced_logits(model, cache, ids):
    """Logits of a prefill of ``ids[:, :PROMPT]`` then one step per following token (teacher forcing)."""
    kw = cache_kwarg(getattr(model, "_orig_mod", model))
    out = [model(ids[:, :PROMPT], **{kw: cache}, use_cache=True).logits.clone()]
    for t in range(PROMPT, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], **{kw: cache}, use_cache=True).logits.clone())
    return torch.cat(out, 1)


def _compiled_logits(model, artifacts, quantize):
    torch._dynamo.reset()
    # dynamic=False: Dynamo cannot trace the DTensor embedding with symbolic sizes (torch 2.13)
    oscar_compile.compile(model, artifacts, quantize=quantize, inductor=False, num_sinks=2, window=3, page_size=4,
                          dynamic=False)
    logits = _forced_logits(model, OscarCache(model, max_cache_len=32, max_batch_size=2), _tokens())
    model.oscar_backend.detach()
    return logits


def _rank(rank, world, port, path):
    import transformers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        artifacts = load_artifacts(os.path.join(path, "artifacts"))
        want = torch.load(os.path.join(path, "reference.pt"))

        def load():
            return transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()

        model = load()
        assert model.model.layers[0].self_attn.k_proj.weight.to_local().shape[0] == 4 * 16 // world
        with torch.no_grad():
            exact = _compiled_logits(model, artifacts, quantize=False)
            torch.testing.assert_close(exact, want["eager"], rtol=1e-5, atol=1e-5)
            backend = model.oscar_backend
            assert backend._first_kv_heads == {0: rank * 4 // world, 1: rank * 4 // world}
            assert all(len(g.rewritten) == 2 for g in backend.graphs)
            assert all(c.num_kv_heads == 4 // world for c in backend.storage.values())

            int2 = _compiled_logits(load(), artifacts, quantize=True)
            torch.testing.assert_close(int2, want["int2"], rtol=1e-4, atol=1e-4)

            # without the model, the backend cannot know which heads this rank holds: it refuses, loudly
            torch._dynamo.reset()
            bare = torch.compile(load(), backend=oscar_compile.oscar_backend(artifacts, inductor=False), dynamic=False)
            with pytest.raises(Exception, match="tensor parallelism compile with oscar_compile.compile"):
                _forced_logits(bare, OscarCache(bare, max_cache_len=32, max_batch_size=2), _tokens())
            # calibration runs in one process on the whole model
            with pytest.raises(ValueError, match="one process"):
                oscar_compile.calibrate(load(), [_tokens()] * 3, progress=False)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_ranks_match_the_single_process_model(tmp_path, world):
    import transformers

    path = str(tmp_path)
    _tiny_llama(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batches = list(torch.randint(1, 96, (4, 2, 24), generator=torch.Generator().manual_seed(3)))
    artifacts = oscar_compile.calibrate(model, batches, progress=False)
    artifacts.save(os.path.join(path, "artifacts"))
    with torch.no_grad():
        from transformers import DynamicCache

        eager = _forced_logits(model, DynamicCache(), _tokens())
        int2 = _compiled_logits(model, load_artifacts(os.path.join(path, "artifacts")), quantize=True)
    assert (int2 - eager).abs().max() > 1e-4  # INT2 is in use: the comparison below is not quantization-off again
    torch.save({"eager": eager, "int2": int2}, os.path.join(path, "reference.pt"))
    mp.spawn(_rank, args=(world, _free_port(), path), nprocs=world)


def test_artifact_slices_heads_and_refuses_a_shard_outside_it(tmp_path):
    from oscar_compile.calibration.artifacts import Artifacts
    from oscar_compile.cache import LayerTransforms

    layer = LayerTransforms.hadamard(4, 16)
    layer.key_mean = torch.arange(4.0)[:, None].expand(4, 16).contiguous()  # tells the heads apart
    art = Artifacts("test", [layer], {"architecture": "x", "num_layers": 1, "num_q_heads": 8, "num_kv_heads": 4,
                                      "head_dim": 16, "attention_weights_sha256": ""})
    part = art.layer_transforms(0, 2, 16, first_head=2)
    assert torch.equal(part.key_mean[:, 0], torch.tensor([2.0, 3.0]))
    with pytest.raises(ArtifactError, match="tensor-parallel shard from KV head 3"):
        art.layer_transforms(0, 2, 16, first_head=3)
    with pytest.raises(ArtifactError, match="oscar_compile.compile"):
        art.layer_transforms(0, 2, 16)
