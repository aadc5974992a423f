"""A hand-written Llama in the gpt-fast style: the model owns its KV cache buffers.

Not transformers code: head-major static ``k_cache``/``v_cache`` buffers written with ``index_copy_``,
SDPA with ``enable_gqa`` over the whole buffer and a boolean mask built from the positions (the
GQA-native BF16 decode of DESIGN.md section 6). With the oscar backend every cache write and SDPA is
rewritten, and the backend releases the dense buffers it made dead.

    model = Transformer(ARGS["llama3-8b"]).to("cuda", torch.bfloat16)
    model.setup_caches(batch, max_len)            # dense BF16 buffers
    logits = model(tokens [B, T], input_pos [T])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    rope_base: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


ARGS = {
    "llama3-8b": ModelArgs(128256, 4096, 32, 32, 8, 14336),
    "tiny": ModelArgs(97, 256, 2, 8, 2, 512),  # d 32: CPU checks of the scripts
}


class KVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device, stub: bool = False):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        # stub: one element seen as the whole buffer (zero strides), for a cache too large to allocate; only
        # a rewritten graph (oscar) can use it, as with transformers' OscarCache
        make = (lambda: torch.empty(1, dtype=dtype, device=device).expand(shape)) if stub else \
            (lambda: torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("k_cache", make(), persistent=False)
        self.register_buffer("v_cache", make(), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # input_pos [T], k/v [B, H, T, d]
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, _ = x.shape
        a = self.a
        q, k, v = self.wqkv(x).split([a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], -1)
        q = _rope(q.view(b, t, a.n_heads, a.head_dim), cos, sin).transpose(1, 2)
        k = _rope(k.view(b, t, a.n_kv_heads, a.head_dim), cos, sin).transpose(1, 2)
        v = v.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, a.dim))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention = Attention(a)
        self.w1 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w3 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=False)
        self.attention_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _rope(x, cos, sin):  # x [B, T, H, d], cos/sin [T, d/2]: rotate (even, odd) pairs
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2).type_as(x)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.max_len = 0

    def setup_caches(self, batch: int, max_len: int, stub: bool = False) -> None:
        p = self.output.weight
        for layer in self.layers:
            layer.attention.kv_cache = None  # free the old buffers before allocating new ones
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, self.a.n_kv_heads, max_len, self.a.head_dim, p.dtype, p.device, stub)
        inv = 1.0 / self.a.rope_base ** (torch.arange(0, self.a.head_dim, 2, device=p.device).float() / self.a.head_dim)
        ang = torch.arange(max_len, device=p.device).float()[:, None] * inv[None, :]
        self.register_buffer("rope_cos", ang.cos(), persistent=False)
        self.register_buffer("rope_sin", ang.sin(), persistent=False)
        self.max_len = max_len

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """``tokens [B, T]`` at positions ``input_pos [T]`` -> logits of the last token ``[B, vocab]``."""
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        # key j visible to the query at position p iff j <= p; [1, 1, T, max_len]
        mask = (torch.arange(self.max_len, device=tokens.device)[None, :] <= input_pos[:, None])[None, None]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x[:, -1]))


def init_random(model: Transformer, seed: int = 0) -> Transformer:
    """Random weights of a plausible scale (deterministic given the seed, on the model's device)."""
    gen = torch.Generator(device=model.output.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model
