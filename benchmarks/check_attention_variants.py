"""Attention kernel variants against the reference on one case with INT2 pages (GPU).

    python benchmarks/check_attention_variants.py
"""

import torch

from oscar_compile import PagedInt2KVCache
from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.store import store_reference
from oscar_compile.kernels.triton_attention import attention_triton
from oscar_compile.testing import random_transforms, rel_error


def main():
    h, g, d, b, n = 8, 4, 128, 2, 700
    c = PagedInt2KVCache(1, h, d, max_batch_size=b, max_seq_len=n + 8, num_sinks=64, window=256, page_size=16,
                         dtype=torch.bfloat16, device="cuda")
    c.set_transforms(0, random_transforms(h, d, "orthogonal", torch.Generator().manual_seed(0), clip=0.95))
    for r in range(b):
        c.allocate(r, n + 8)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    tr = c.transforms[0]
    pos = torch.arange(n, device="cuda")
    store_reference(k, v, pos, *c.layers[0].tensors(), c.block_table, tr.key_transform, tr.key_mean,
                    tr.value_transform, tr.value_mean, tr.key_clip, tr.value_clip)
    q = torch.randn(b, h * g, 1, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    p1 = torch.full((b, 1), n - 1, device="cuda")
    args = (q, p1, p1[:, 0] + 1, *c.layers[0].tensors(), c.block_table, tr.query_transform, tr.output_transform,
            tr.value_mean, None, False, d**-0.5)
    ref = attention_reference(*args)
    for unpack in ("ops", "asm"):
        for dt in (torch.float16, torch.bfloat16):
            out = attention_triton(*args, unpack=unpack, dot_dtype=dt)
            print(f"unpack={unpack:<4} dot={str(dt)[6:]:<9} rel error {rel_error(out, ref):.2e}", flush=True)


if __name__ == "__main__":
    main()
