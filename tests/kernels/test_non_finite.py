"""Non-finite keys and values: one behaviour for the reference ops and the Triton kernels.

A NaN or inf stays in the sequence row that produced it (its attention outputs become NaN, as BF16
attention's would) and never reaches another row, nor a later sequence that reuses the row. Nothing is
checked on the host. The Triton kernels run in the interpreter here (tiny shapes) and natively on a GPU.
"""

import pytest
import torch

from oscar_compile.kernels.attention import attention_reference
from oscar_compile.kernels.store import store_reference
from oscar_compile.testing import twin_caches

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on NaN, in the interpreter

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, GQA, D, S, W, PS = 1, 2, 64, 2, 3, 8
LENGTHS = (20, 9)  # row 0 reaches its pages; row 1 is shorter, so a gather over row 0's length pads it
NAN_KEY_POSITIONS = (5, 17)  # 5 goes to a page in the prefill, 17 sits in the ring until a decode step evicts it
INF_VALUE_POSITION = 9  # and the last decode step's key stays in the ring


def _impls(name):
    if name == "reference":
        return store_reference, attention_reference
    from oscar_compile.kernels.triton_attention import attention_triton
    from oscar_compile.kernels.triton_store import store_triton

    return store_triton, attention_triton


def _data(poison: bool):
    gen = torch.Generator().manual_seed(0)
    t = max(LENGTHS)
    k, v = (torch.randn(len(LENGTHS), H, t, D, generator=gen) for _ in range(2))
    q = torch.randn(len(LENGTHS), H * GQA, 3, D, generator=gen)  # one query per decode step
    k1, v1 = (torch.randn(len(LENGTHS), H, 3, D, generator=gen) for _ in range(2))
    if poison:
        k[0, 0, list(NAN_KEY_POSITIONS), 7] = float("nan")
        v[0, 0, INF_VALUE_POSITION, 3] = float("inf")
        k1[0, 0, 2, 0] = float("nan")
    return [x.to(DEV) for x in (k, v, q, k1, v1)]


def _run(impl, cache, k, v, q, k1, v1, lengths=LENGTHS):
    """Prefill rows of ``lengths`` (padded), then three decode steps; the outputs of each step ``[B, Hq, 3, d]``."""
    store, attention = _impls(impl)
    t = k.shape[2]
    pos = torch.stack([torch.where(torch.arange(t) < n, torch.arange(t), -1) for n in lengths]).to(DEV)
    store(*cache.store_args(0, k, v, pos))
    outs = []
    for step in range(3):
        p1 = torch.tensor(lengths, device=DEV)[:, None] + step
        store(*cache.store_args(0, k1[:, :, step : step + 1], v1[:, :, step : step + 1], p1))
        outs.append(attention(*cache.attention_args(0, q[:, :, step : step + 1], p1, p1[:, 0] + 1)))
    return torch.cat(outs, dim=2)


def _caches():
    return twin_caches(H, D, len(LENGTHS), 64, S, W, PS, None, torch.float32, "orthogonal", 0.9, device=DEV)


def _row(cache, row):
    """Everything the cache holds for ``row`` (its sink, ring and pages; the block table is the identity)."""
    layer = cache.layers[0]
    pages = cache.block_table[row][cache.block_table[row] >= 0].long()
    return [layer.k_sink[row], layer.v_sink[row], layer.k_ring[row], layer.v_ring[row], layer.k_codes[pages],
            layer.k_meta[pages], layer.v_codes[pages], layer.v_meta[pages]]


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_nan_stays_in_its_row(impl):
    clean_cache, dirty_cache = _caches()
    clean = _run(impl, clean_cache, *_data(poison=False))
    dirty = _run(impl, dirty_cache, *_data(poison=True))
    # Row 1 is untouched: the same bytes in the cache, the same outputs.
    for a, b in zip(_row(clean_cache, 1), _row(dirty_cache, 1)):
        assert torch.equal(a, b)
    torch.testing.assert_close(dirty[1], clean[1], rtol=0, atol=0)
    # The quantized NaN keys (position 5 from the prefill, 17 evicted by the second decode step) carry NaN
    # metadata; the finite key rows around them do not.
    meta = dirty_cache.layers[0].k_meta
    bt = dirty_cache.block_table[0].long()
    for p, poisoned in ((4, False), (5, True), (17, True), (18, False)):
        j = p - S
        assert bool(torch.isnan(meta[bt[j // PS], j % PS]).all()) == poisoned, p


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_row_with_nan_keys_attends_to_nan(impl):
    cache = _caches()[0]
    out = _run(impl, cache, *_data(poison=True))
    assert torch.isnan(out[0]).all()  # NaN, as BF16 attention gives; not finite garbage, not zeros


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_nan_does_not_reach_a_later_sequence_in_the_same_row(impl):
    fresh_cache, reused_cache = _caches()
    _run(impl, reused_cache, *_data(poison=True))
    pages = set(reused_cache.block_table.flatten().tolist())
    reused_cache.reset()
    for row in range(len(LENGTHS)):
        reused_cache.allocate(row, 64)
    assert set(reused_cache.block_table.flatten().tolist()) == pages  # the same pages, still holding NaN rows
    k, v, q, k1, v1 = _data(poison=False)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(k.shape, generator=gen).to(DEV) for _ in range(2))  # a new sequence
    # Row 0 now shorter than sinks + window: ring slots it never writes still hold the NaN key of the last run.
    lengths = (1, 9)
    expected = _run(impl, fresh_cache, k, v, q, k1, v1, lengths)
    got = _run(impl, reused_cache, k, v, q, k1, v1, lengths)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
