"""The fragment byte order of INT2 pages (kernels/fragment_order.py) against the logical format.

The reference ops, the Triton store and both attention kernels must agree on where every code lives:
here the permutation itself (a bijection with the documented properties), the reference round trip,
and the Triton store's bytes against the reference store's, byte for byte (interpreter on CPU).
"""

import pytest
import torch

from oscar_compile.kernels import fragment_order
from oscar_compile.quant import pack_int2, unpack_int2


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_permutation_is_a_bijection_with_whole_bytes_per_slot(d, kind):
    flat, shift = fragment_order._tables(kind, d)
    bit = flat * 8 + shift
    assert bit.unique().numel() == fragment_order.GROUP * d  # every bit pair of the group block used once
    for byte in flat.unique():
        slot, ch = (flat == byte).nonzero(as_tuple=True)
        # one slot's four channels b, b + 8, b + 16, b + 24 at bits 0, 2, 4, 6 (what the store assembles)
        assert slot.unique().numel() == 1
        b = int(ch.min())
        assert sorted(zip((ch - b).tolist(), shift[slot, ch].tolist())) == [(0, 0), (8, 2), (16, 4), (24, 6)]
    if kind == "k":  # a key owns whole 32-bit words; a value whole 16-bit halves
        assert torch.equal((flat // 4).view(16, -1).sort(1).values[:, ::4], (flat // 4).view(16, -1).sort(1).values[:, 3::4])
    else:
        assert torch.equal((flat // 2).view(16, -1).sort(1).values[:, ::2], (flat // 2).view(16, -1).sort(1).values[:, 1::2])


def test_fragment_order_applies_only_where_the_geometry_allows():
    assert fragment_order.supported(128, 16) and fragment_order.supported(64, 32)
    assert not fragment_order.supported(96, 16) and not fragment_order.supported(128, 8)


@pytest.mark.parametrize("d, ps", [(64, 16), (128, 32), (96, 16), (128, 8)])
def test_rows_round_trip_and_touch_nothing_else(d, ps):
    gen = torch.Generator().manual_seed(d + ps)
    codes = torch.randint(0, 256, (5, ps, 3, d // 4), dtype=torch.uint8, generator=gen)
    before = codes.clone()
    pages = torch.tensor([4, 0, 2, 4, 1, 3])
    slots = torch.tensor([0, ps - 1, 7, 9 % ps, 15 % ps, ps // 2])
    for kind in ("k", "v"):
        rows = pack_int2(torch.randint(0, 4, (6, 3, d), dtype=torch.uint8, generator=gen))
        fragment_order.write_rows(codes, pages, slots, rows, kind)
        assert torch.equal(fragment_order.read_rows(codes, pages, slots, kind), rows)
        # every other row of the pool kept its codes
        others = torch.ones(5, ps, dtype=torch.bool)
        others[pages, slots] = False
        keep_p, keep_s = others.nonzero(as_tuple=True)
        assert torch.equal(fragment_order.read_rows(codes, keep_p, keep_s, kind),
                           fragment_order.read_rows(before, keep_p, keep_s, kind))
        codes.copy_(before)


def test_logical_pool_reads_every_row():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (3, 16, 2, 32), dtype=torch.uint8, generator=gen)
    logical = fragment_order.logical_pool(codes, "v")
    assert torch.equal(unpack_int2(logical[2, 5]), fragment_order.read_codes(codes, torch.tensor([2]), torch.tensor([5]), "v")[0])
    assert not torch.equal(logical, codes)  # a real permutation, not the identity


@pytest.mark.parametrize("d, ps", [(64, 16), (128, 32), (256, 48), (96, 16), (128, 8)])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_whole_pages_read_the_same_codes_as_row_by_row(d, ps, kind):
    """read_page_codes (the CPU reference's history read) against read_codes slot by slot, on random bytes of
    fragment-order pools (d a multiple of 64, pages of 16-slot groups) and logical ones (96, pages of 8)."""
    gen = torch.Generator().manual_seed(d * ps)
    codes = torch.randint(0, 256, (6, ps, 3, d // 4), dtype=torch.uint8, generator=gen)
    pages = torch.tensor([[5, 0, 3], [2, 2, 4]])  # a page twice, out of order
    got = fragment_order.read_page_codes(codes, pages, kind)
    assert got.shape == (2, 3, ps, 3, d) and got.dtype == torch.uint8
    flat_pages = pages[..., None].expand(2, 3, ps).reshape(-1)
    slots = torch.arange(ps).repeat(6)
    if fragment_order.in_fragment_order(codes):
        want = fragment_order.read_codes(codes, flat_pages, slots, kind)
    else:
        want = unpack_int2(codes[flat_pages, slots])
    assert torch.equal(got.reshape(-1, 3, d), want)
