"""Attention kernel variants against the reference on one case with INT2 pages (GPU).

    python benchmarks/check_attention_variants.py
"""

import torch

from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.store import store_reference
from oscar_compile.kernels.triton_attention import attention_triton
from oscar_compile.testing import rel_error, twin_caches


def main():
    h, g, d, b, n = 8, 4, 128, 2, 700
    c, _ = twin_caches(h, d, b, n + 8, 64, 256, 16, dtype=torch.bfloat16, clip=0.95, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    store_reference(*c.store_args(0, k, v, torch.arange(n, device="cuda")))
    q = torch.randn(b, h * g, 1, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    p1 = torch.full((b, 1), n - 1, device="cuda")
    args = c.attention_args(0, q, p1)
    ref = attention_reference(*args)
    for unpack in ("ops", "asm"):
        for dt in (torch.float16, torch.bfloat16):
            out = attention_triton(*args, unpack=unpack, dot_dtype=dt)
            print(f"unpack={unpack:<4} dot={str(dt)[6:]:<9} rel error {rel_error(out, ref):.2e}", flush=True)


if __name__ == "__main__":
    main()
