"""Triton ``oscar::store``: transform, round, clip, quantize, pack and write, in one launch.

Beside it, :func:`oscar_compile.kernels.store.store_reference` is the oracle (same semantics).

One program handles ``BLOCK_T`` tokens (consecutive in the flattened ``B x T``: a chunk of one row, or the decode
token of ``BLOCK_T`` rows), one KV head and one side (keys or values):

1. ``y = (x - mu) @ A`` (``tl.dot`` against the head's ``d x d`` matrix, fp32-accurate ``tf32x3``), rounded to the
   cache dtype; written to the returned chunk ``[B, T, H, d]``.
2. Destination by position ``p`` (``L`` = the row's newest position + 1, ``first`` its oldest new one):
   ``p < S`` -> sink; ``p`` the last chunk position of its ring slot (``p >= L - W``) -> ring slot
   ``p % W``, after quantizing the slot's old occupant (the old position ``q = p - W k`` just below
   ``first``) into its page; otherwise (evicted within the chunk) -> its page directly.
   Each ring slot has exactly one such writer per launch, so eviction reads never race a write.
3. Quantize: clip each row at the ``clip`` quantile of ``|y|`` (the few largest values by repeated
   maxima and tie counts; no sort), ``scale = (max - min) / 3``
   and ``min`` per group rounded to the metadata dtype, ``code = floor((y - min) / scale + 0.5)``,
   four codes a byte, quartered (``tl.reshape`` to ``[BLOCK_T, 4, d/4]``, shift, sum).

Per-channel keys (``key_format="channel"``) take three launches: the one above transforms the chunk and writes
its sinks only (``CHUNK_ONLY``); ``_flush_pages_kernel`` quantizes the whole pages the call completes (keys per
channel over the page's tokens, values per token), reading their tokens from the ring or the transformed chunk;
``_ring_kernel`` then writes the chunk's newest tokens into the ring, whose slots the pages may have just read.

Writes into a page the block table does not own (``-1``), past the block table or past the pool are dropped:
the kernel cannot raise, so it never writes out of bounds, and capacity errors are raised on the host
(:mod:`oscar_compile.passes.capacity` for compiled models, the reference's checks otherwise).
A token row holding a NaN or inf is quantized with NaN scale and minimum (it dequantizes to NaN),
exactly as the reference stores it: the non-finite value stays in its own row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import fragment_order
from .checks import check_store
from .sliding import history_layout, history_len, place_history, read_history

LAST_LAUNCH: dict = {}  # the compiled kernel of the latest call (register/spill reports in benchmarks)


@triton.jit
def _fragment_byte(slot, e, sc_s, D: tl.constexpr, KIND: tl.constexpr):
    """Byte offset (from the page's first row of this head) of byte ``e = 8 blk + r`` of row ``slot`` in
    fragment order: the byte of base channel ``32 blk + r`` (:mod:`.fragment_order`; KIND 0 keys, 1 values)."""
    blk = e // 8
    r = e % 8
    s = slot % 16
    hi = s // 8
    if KIND == 0:  # slot 8 hi + g, channel 64 c64 + 32 j2 + 2 t + half (+ 8 j0 + 16 j1 within the byte)
        g = s % 8
        t = r // 2
        half = r % 2
    else:  # slot 8 hi + 2 t + half, channel 64 c64 + 32 j2 + g
        g = r
        t = (s % 8) // 2
        half = s % 2
    word = (4 * g + t) * (D // 32) + hi * (D // 64) + blk // 2
    row = slot - s + word // (D // 16)
    return row * sc_s + (word % (D // 16)) * 4 + 2 * half + blk % 2


@triton.jit
def _quantize_store(y, keep, qidx, codes_ptr, meta_ptr, bt_ptr, b, h, stride_bt_b,
                    sc_p, sc_s, sc_h, sm_p, sm_s, sm_h,
                    clip_lo, clip_frac, MAX_PAGES, NUM_PAGES,
                    PS: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                    NG: tl.constexpr, HAS_CLIP: tl.constexpr, FRAG: tl.constexpr, KIND: tl.constexpr,
                    CHANNEL: tl.constexpr = False, fb_ptr=None, FEEDBACK: tl.constexpr = False):
    """Quantize rows ``y [BLOCK_T, D]`` (fp32) where ``keep``; row r goes to quantized index ``qidx[r]``.

    ``CHANNEL``: the rows are one whole page (``BLOCK_T == PS``, all kept), quantized per channel over its tokens
    (one (scale, min) per channel, written once for the page at ``meta[page, 0, h]``); with ``HAS_CLIP`` each
    channel's range narrows to ``clip_frac`` of its width about its midpoint. ``FEEDBACK``: the page's channels are
    rounded in order on that grid, each token's rounding error pushed onto its later channels by the row of the
    head's ``d x d`` factor at ``fb_ptr`` (:func:`oscar_compile.quant.quantize_int2_channels`, same operations)."""
    if tl.sum(keep.to(tl.int32), 0) > 0:  # most decode steps quantize nothing (the token goes to the ring)
        # Before clipping (the GPU's min/max drop NaN): x - x is 0 only for finite x.
        finite = tl.min(((y - y) == 0.0).to(tl.int32), axis=1) > 0
        meta_ty = meta_ptr.dtype.element_ty
        if CHANNEL:
            # a page holding a NaN/inf dequantizes to NaN for this head, as the reference stores it
            page_finite = tl.min(finite.to(tl.int32), axis=0) > 0
            mn = tl.min(y, axis=0)
            mx = tl.max(y, axis=0)
            width = mx - mn
            if HAS_CLIP:  # quant.quantize_int2_channels' float32 operations, in its order
                width = width * clip_frac
                mn = (mx + mn) * 0.5 - width * 0.5
            scale = tl.div_rn(width, tl.full(mx.shape, 3.0, tl.float32)).to(meta_ty).to(tl.float32)
            mn = mn.to(meta_ty).to(tl.float32)
            inv = tl.where(scale > 0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
            if FEEDBACK:
                cols = tl.arange(0, D)
                for i in range(D):
                    pick = (cols == i)[None, :]
                    xi = tl.sum(tl.where(pick, y, 0.0), axis=1)  # channel i of every token
                    mi = tl.sum(tl.where(cols == i, mn, 0.0), axis=0)
                    si = tl.sum(tl.where(cols == i, scale, 0.0), axis=0)
                    ii = tl.sum(tl.where(cols == i, inv, 0.0), axis=0)
                    qi = mi + tl.minimum(tl.maximum(tl.floor((xi - mi) * ii + 0.5), 0.0), 3.0) * si
                    u = tl.load(fb_ptr + h * D * D + i * D + cols)  # zero before the diagonal
                    err = tl.div_rn(xi - qi, tl.load(fb_ptr + h * D * D + i * D + i))
                    later = (cols > i)[None, :]
                    y = tl.where(pick, qi[:, None], tl.where(later, y - err[:, None] * u[None, :], y))
            c = tl.floor((y - mn[None, :]) * inv[None, :] + 0.5)
            c = tl.minimum(tl.maximum(c, 0.0), 3.0).to(tl.int32)
        elif HAS_CLIP:
            # The clip quantile interpolates between the sorted |y| at clip_lo and clip_lo + 1. Both are
            # among the few largest values, so walk the distinct values from the top instead of sorting:
            # each step takes the row's maximum and how many entries equal it (ties count once per entry,
            # as in a sort), so rank n of the descending order is found without argmax.
            rem = tl.abs(y)
            n_top = D - 1 - clip_lo  # descending rank of sorted[clip_lo]; >= 1 since clip < 1
            seen = tl.zeros([BLOCK_T], tl.int32)
            top = tl.zeros([BLOCK_T], tl.float32)
            above = tl.zeros([BLOCK_T], tl.float32)
            for _ in range(n_top + 1):
                v = tl.max(rem, axis=1)
                hit = rem == v[:, None]
                cnt = tl.sum(hit.to(tl.int32), axis=1)
                top = tl.where((seen <= n_top) & (n_top < seen + cnt), v, top)
                above = tl.where((seen <= n_top - 1) & (n_top - 1 < seen + cnt), v, above)
                rem = tl.where(hit, -1.0, rem)
                seen += cnt
            # top = sorted[clip_lo], above = sorted[clip_lo + 1]
            t = (top + clip_frac * (above - top))[:, None]
            y = tl.minimum(tl.maximum(y, -t), t)
        if not CHANNEL:
            GS: tl.constexpr = D // NG
            yg = tl.reshape(y, (BLOCK_T, NG, GS))
            mn = tl.min(yg, axis=2)
            mx = tl.max(yg, axis=2)
            # IEEE divisions like torch's (the GPU's default fp32 division is approximate)
            scale = tl.div_rn(mx - mn, tl.full(mx.shape, 3.0, tl.float32)).to(meta_ty).to(tl.float32)
            mn = mn.to(meta_ty).to(tl.float32)
            inv = tl.where(scale > 0, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
            c = tl.floor((yg - mn[:, :, None]) * inv[:, :, None] + 0.5)
            c = tl.minimum(tl.maximum(c, 0.0), 3.0).to(tl.int32)
        if FRAG:  # byte e = 8 blk + r holds channels 32 blk + r + 8 q at bits 2q (fragment_order.py)
            c = tl.reshape(c, (BLOCK_T, D // 32, 4, 8))
            shifts = (tl.arange(0, 4) * 2)[None, None, :, None]
            packed = tl.reshape(tl.sum(c << shifts, axis=2), (BLOCK_T, D // 4)).to(tl.uint8)
        else:  # quartered: byte i holds channels i + q d/4 at bits 2q
            c = tl.reshape(c, (BLOCK_T, 4, D // 4))
            shifts = (tl.arange(0, 4) * 2)[None, :, None]
            packed = tl.sum(c << shifts, axis=1).to(tl.uint8)  # bits are disjoint: sum == or

        logical = qidx // PS
        ok = keep & (qidx >= 0) & (logical < MAX_PAGES)
        page = tl.load(bt_ptr + b * stride_bt_b + tl.where(ok, logical, 0), mask=ok, other=-1)
        # rows as [BLOCK_T, 1] from here on: Triton 3.6's layout pass fails on these selects in 1-D (logical order,
        # rows of several batch rows)
        ok = (ok & (page >= 0) & (page < NUM_PAGES))[:, None]
        page = tl.where(ok, page[:, None], 0).to(tl.int64)
        slot = tl.where(ok, (qidx % PS)[:, None], 0).to(tl.int64)
        d4 = tl.arange(0, D // 4)[None, :]
        if FRAG:
            byte_off = _fragment_byte(slot, d4, sc_s, D, KIND)
            tl.store(codes_ptr + page * sc_p + h * sc_h + byte_off, packed, mask=ok)
        else:
            tl.store(codes_ptr + page * sc_p + slot * sc_s + h * sc_h + d4, packed, mask=ok)
        if CHANNEL:  # every row of the page names the same page: its metadata once, from the first row
            first_row = tl.arange(0, BLOCK_T)[:, None] == 0
            page0 = tl.max(tl.where(ok & first_row, page, -1), axis=0)  # [1]; -1: the page is not owned
            col = tl.arange(0, D)[None, :]
            mbase = meta_ptr + tl.maximum(page0, 0)[:, None] * sm_p + h * sm_h
            own = (page0 >= 0)[:, None]
            tl.store(mbase + col, tl.where(page_finite, scale, float("nan")).to(meta_ty)[None, :], mask=own)
            tl.store(mbase + D + col, tl.where(page_finite, mn, float("nan")).to(meta_ty)[None, :], mask=own)
        else:
            g = tl.arange(0, NG)[None, :]
            mbase = meta_ptr + page * sm_p + slot * sm_s + h * sm_h
            tl.store(mbase + g, tl.where(finite[:, None], scale, float("nan")).to(meta_ty), mask=ok)
            tl.store(mbase + NG + g, tl.where(finite[:, None], mn, float("nan")).to(meta_ty), mask=ok)


@triton.jit
def round_to_e4m3(y):
    """fp32 ``y`` rounded to the nearest float8_e4m3fn value (ties to even, clamped to +-448), still fp32: its
    conversion to e4m3 is then exact on the GPU and in the interpreter (which rounds some values just below a
    power of two the wrong way). Normal values drop 20 mantissa bits on the integer bits; below 2^-6 the e4m3 grid
    is uniform (steps of 2^-9), where adding and removing 1.5 * 2^14 rounds in fp32 arithmetic."""
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, (y + 24576.0) - 24576.0, normal)


@triton.jit
def store_fp8_rows(row_ptr, y, ok, D: tl.constexpr):
    """FP8 ring rows (:mod:`.fp8_ring`) from fp32 ``y [N, D]`` at the uint8 row starts ``row_ptr [N]`` where ``ok``:
    ``D`` e4m3 codes of ``y / scale``, then the fp32 ``scale = max|y| / 448`` (NaN for a row holding a NaN or inf,
    which then decodes to NaN, as the reference's rows do)."""
    row_ptr = tl.multiple_of(row_ptr, 4)  # rows of d + 4 bytes start on 4 bytes: word stores
    finite = tl.sum(((y != y) | (tl.abs(y) == float("inf"))).to(tl.int32), 1) == 0
    scale = tl.math.div_rn(tl.max(tl.abs(y), 1), tl.full([1], 448.0, tl.float32))  # correctly rounded, as torch
    scale = tl.where(finite, scale, float("nan"))
    codes = round_to_e4m3(tl.math.div_rn(y, tl.where(scale > 0, scale, 1.0)[:, None])).to(tl.float8e4nv)
    tl.store(row_ptr[:, None] + tl.arange(0, D)[None, :], codes.to(tl.uint8, bitcast=True), mask=ok[:, None])
    tl.store((row_ptr + D).to(tl.pointer_type(tl.float32)), scale, mask=ok)


@triton.jit
def load_fp8_rows(row_ptr, ok, D: tl.constexpr):
    """fp32 ``[N, D]`` of the FP8 ring rows at ``row_ptr [N]`` (uint8 row starts); 0 where not ``ok``."""
    row_ptr = tl.multiple_of(row_ptr, 4)  # rows of d + 4 bytes start on 4 bytes: word loads, not byte loads
    codes = tl.load(row_ptr[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0)
    scale = tl.load((row_ptr + D).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    # The select is needed: on an H100 (Triton 3.6) the skipped rows came out of the loads' `other` non-finite in
    # registers (stored, they read 0), and the store's quantizer then wrote NaN metadata for the rows it evicted.
    return tl.where(ok[:, None], codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None], 0.0)


@triton.jit
def _store_side(x_ptr, sx_b, sx_h, sx_t, a_ptr, mu_ptr, out_ptr,
                codes_ptr, meta_ptr, sink_ptr, ring_ptr, bt_ptr,
                b, h, t, p, inb, valid, first, last, stride_bt_b,
                sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, ss_b, ss_t, ss_h, sr_b, sr_t, sr_h,
                so_b, so_t, so_h, clip_lo, clip_frac, S, W, MAX_PAGES, NUM_PAGES,
                PS: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, HAS_CLIP: tl.constexpr,
                HAS_RING: tl.constexpr, FRAG: tl.constexpr, KIND: tl.constexpr, CHUNK_ONLY: tl.constexpr,
                RING_FP8: tl.constexpr):
    col = tl.arange(0, D)
    D4: tl.constexpr = D // 4
    c4 = tl.arange(0, D4)
    # y = (x - mu) @ A, blocked over the input channels so no D x D tile sits in registers
    y = tl.zeros([BLOCK_T, D], tl.float32)
    for kq in tl.static_range(4):
        xk = tl.load(x_ptr + b[:, None] * sx_b + h * sx_h + t[:, None] * sx_t + kq * D4 + c4[None, :], mask=inb[:, None], other=0.0)
        xk = xk.to(tl.float32) - tl.load(mu_ptr + h * D + kq * D4 + c4)[None, :]
        ak = tl.load(a_ptr + h * D * D + (kq * D4 + c4)[:, None] * D + col[None, :])
        y = tl.dot(xk, ak, y, input_precision="tf32x3")  # fp32-accurate on tensor cores
    cache_ty = sink_ptr.dtype.element_ty
    yc = y.to(cache_ty)
    out_rows = out_ptr + b[:, None] * so_b + t[:, None] * so_t + h * so_h + col[None, :]
    tl.store(out_rows, yc, mask=inb[:, None])
    # Every region holds (and quantizes) the cache-dtype rounded row. Read it back: the reshapes of the
    # quantizer then start from a plain load layout, not the dot's accumulator layout.
    tl.debug_barrier()
    y = tl.load(out_rows, mask=inb[:, None], other=0.0).to(tl.float32)

    length = last + 1
    in_sink = valid & (p < S)
    tl.store(sink_ptr + b[:, None] * ss_b + tl.where(in_sink, p, 0)[:, None] * ss_t + h * ss_h + col[None, :], yc,
             mask=in_sink[:, None])
    if CHUNK_ONLY:  # per-channel keys: the pages (_flush_pages_kernel) and the ring (_ring_kernel) come after
        pass
    elif HAS_RING:
        w1 = tl.maximum(W, 1)
        ring_final = valid & (p >= S) & (p >= length - W)
        slot = tl.where(ring_final, p % w1, 0)
        # the slot's old occupant: the largest position congruent to p below this call's first position
        q = p - W * ((p - first) // w1 + 1)
        evict = ring_final & (q >= S)
        if RING_FP8:  # FP8 rows with a scale each (fp8_ring.py)
            ring_start = ring_ptr + b * sr_b + slot * sr_t + h * sr_h
            old = load_fp8_rows(ring_start, evict, D)
        else:
            ring_row = ring_ptr + b[:, None] * sr_b + slot[:, None] * sr_t + h * sr_h + col[None, :]
            old = tl.load(ring_row, mask=evict[:, None], other=0.0).to(tl.float32)
        _quantize_store(old, evict, q - S, codes_ptr, meta_ptr, bt_ptr, b, h, stride_bt_b,
                        sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, clip_lo, clip_frac, MAX_PAGES, NUM_PAGES,
                        PS, BLOCK_T, D, NG, HAS_CLIP, FRAG, KIND)
        tl.debug_barrier()
        if RING_FP8:
            store_fp8_rows(ring_start, y, ring_final, D)  # y: the cache-dtype row in fp32
        else:
            tl.store(ring_row, yc, mask=ring_final[:, None])
        to_page = valid & (p >= S) & ~ring_final
        _quantize_store(y, to_page, p - S, codes_ptr, meta_ptr, bt_ptr, b, h, stride_bt_b,
                        sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, clip_lo, clip_frac, MAX_PAGES, NUM_PAGES,
                        PS, BLOCK_T, D, NG, HAS_CLIP, FRAG, KIND)
    else:
        to_page = valid & (p >= S)
        _quantize_store(y, to_page, p - S, codes_ptr, meta_ptr, bt_ptr, b, h, stride_bt_b,
                        sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, clip_lo, clip_frac, MAX_PAGES, NUM_PAGES,
                        PS, BLOCK_T, D, NG, HAS_CLIP, FRAG, KIND)


# Per-call sizes and per-layer clip indices are not specialised (no recompiles on new prompt lengths).
@triton.jit(do_not_specialize=["sp_b", "stride_bt_b", "T", "ROWS", "S", "W", "kclip_lo", "vclip_lo", "NUM_PAGES"])
def _store_kernel(k_ptr, v_ptr, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                  pos_ptr, sp_b, first_ptr, last_ptr, T, ROWS,
                  ak_ptr, muk_ptr, av_ptr, muv_ptr, kout_ptr, vout_ptr,
                  kc_ptr, km_ptr, vc_ptr, vm_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, bt_ptr, stride_bt_b,
                  sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, ss_b, ss_t, ss_h, sr_b, sr_t, sr_h, so_b, so_t, so_h,
                  kclip_lo, kclip_frac, vclip_lo, vclip_frac, S, W, MAX_PAGES, NUM_PAGES, NH,
                  PS: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr, NG: tl.constexpr,
                  K_CLIP: tl.constexpr, V_CLIP: tl.constexpr, HAS_RING: tl.constexpr, FRAG: tl.constexpr,
                  CHUNK_ONLY: tl.constexpr = False, RING_FP8: tl.constexpr = False):
    # A program takes BLOCK_T consecutive (batch row, token) pairs of the flattened B x T tokens: a prefill
    # chunk's tokens of one row, or one decode token of each of BLOCK_T rows (so a decode step reads each
    # head's d x d matrix once per 16 rows, not once per row). Keys and values in separate programs (grid
    # axis 1 = side * NH + head): at small batch each program's serial chain is the latency.
    r = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # k/v of a large batch pass 2^31 elements
    inb = r < ROWS
    b = tl.where(inb, r // T, 0)
    t = r % T
    h = tl.program_id(1) % NH
    p = tl.load(pos_ptr + b * sp_b + t, mask=inb, other=-1).to(tl.int64)
    valid = inb & (p >= 0)
    first = tl.load(first_ptr + b, mask=inb, other=0).to(tl.int64)
    last = tl.load(last_ptr + b, mask=inb, other=0).to(tl.int64)
    if tl.program_id(1) < NH:
        _store_side(k_ptr, sk_b, sk_h, sk_t, ak_ptr, muk_ptr, kout_ptr, kc_ptr, km_ptr, ks_ptr, kr_ptr, bt_ptr,
                    b, h, t, p, inb, valid, first, last, stride_bt_b, sc_p, sc_s, sc_h, sm_p, sm_s, sm_h,
                    ss_b, ss_t, ss_h, sr_b, sr_t, sr_h, so_b, so_t, so_h, kclip_lo, kclip_frac, S, W, MAX_PAGES,
                    NUM_PAGES, PS, BLOCK_T, D, NG, K_CLIP, HAS_RING, FRAG, 0, CHUNK_ONLY, RING_FP8)
    else:
        _store_side(v_ptr, sv_b, sv_h, sv_t, av_ptr, muv_ptr, vout_ptr, vc_ptr, vm_ptr, vs_ptr, vr_ptr, bt_ptr,
                    b, h, t, p, inb, valid, first, last, stride_bt_b, sc_p, sc_s, sc_h, sm_p, sm_s, sm_h,
                    ss_b, ss_t, ss_h, sr_b, sr_t, sr_h, so_b, so_t, so_h, vclip_lo, vclip_frac, S, W, MAX_PAGES,
                    NUM_PAGES, PS, BLOCK_T, D, NG, V_CLIP, HAS_RING, FRAG, 1, CHUNK_ONLY, RING_FP8)


@triton.jit
def whole_pages_len(length, S, WE, PS: tl.constexpr):
    """Page tokens of a row holding ``length`` tokens (:func:`checks.quantized_len`, whole pages)."""
    return tl.maximum(length - S - WE, 0) // PS * PS


@triton.jit
def _flush_side(out_ptr, so_b, so_t, so_h, ring_ptr, sr_b, sr_t, sr_h, codes_ptr, meta_ptr, bt_ptr, stride_bt_b,
                b, h, t, from_ring, q, j, sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, clip_lo, clip_frac, W, MAX_PAGES,
                NUM_PAGES, PS: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, HAS_CLIP: tl.constexpr,
                FRAG: tl.constexpr, KIND: tl.constexpr, CHANNEL: tl.constexpr, fb_ptr=None,
                FEEDBACK: tl.constexpr = False, RING_FP8: tl.constexpr = False):
    col = tl.arange(0, D)[None, :]
    if RING_FP8:  # FP8 rows with a scale each (fp8_ring.py)
        ring_row = ring_ptr + b * sr_b + tl.where(from_ring, q % W, 0) * sr_t + h * sr_h
        out_rows = out_ptr + b * so_b + tl.where(from_ring, 0, t)[:, None] * so_t + h * so_h + col
        chunk = tl.load(out_rows, mask=~from_ring[:, None], other=0.0).to(tl.float32)
        y = tl.where(from_ring[:, None], load_fp8_rows(ring_row, from_ring, D), chunk)
    else:  # as it ran on the GPU before the FP8 rows (65dba96): the same PTX
        ring_rows = ring_ptr + b * sr_b + tl.where(from_ring, q % W, 0)[:, None] * sr_t + h * sr_h + col
        out_rows = out_ptr + b * so_b + tl.where(from_ring, 0, t)[:, None] * so_t + h * so_h + col
        y = tl.where(from_ring[:, None], tl.load(ring_rows, mask=from_ring[:, None], other=0.0),
                     tl.load(out_rows, mask=~from_ring[:, None], other=0.0)).to(tl.float32)
    bb = b + tl.zeros([PS], tl.int64)
    _quantize_store(y, j >= 0, j, codes_ptr, meta_ptr, bt_ptr, bb, h, stride_bt_b, sc_p, sc_s, sc_h, sm_p, sm_s, sm_h,
                    clip_lo, clip_frac, MAX_PAGES, NUM_PAGES, PS, PS, D, NG, HAS_CLIP, FRAG, KIND, CHANNEL, fb_ptr,
                    FEEDBACK)


@triton.jit(do_not_specialize=["so_b", "stm_b", "S", "W", "WE", "vclip_lo", "NUM_PAGES"])
def _flush_pages_kernel(kout_ptr, vout_ptr, so_b, so_t, so_h, tmap_ptr, stm_b, first_ptr, last_ptr,
                        kc_ptr, km_ptr, vc_ptr, vm_ptr, kr_ptr, vr_ptr, bt_ptr, stride_bt_b,
                        sc_p, sc_s, sc_h, skm_p, skm_h, svm_p, svm_s, svm_h, sr_b, sr_t, sr_h,
                        vclip_lo, vclip_frac, kratio, S, W, WE, MAX_PAGES, NUM_PAGES, NH,
                        PS: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, V_CLIP: tl.constexpr,
                        FRAG: tl.constexpr, HAS_TMAP: tl.constexpr = True, K_RANGE: tl.constexpr = False,
                        fb_ptr=None, FEEDBACK: tl.constexpr = False, RING_FP8: tl.constexpr = False):
    """Per-channel keys: the pages this call completes, one page of one row, head and side a program.

    A row holding ``L`` tokens keeps ``quantized_len(L)`` of them in pages (whole pages). The pages between the
    row's count before the call (``first`` tokens) and after it (``last + 1``) are written now, from their
    tokens' cache-dtype rows: those of earlier calls still in the ring (it holds ``W = WE + PS - 1``), the rest
    from this call's transformed chunk (``tmap``: position - first -> chunk index; without ``HAS_TMAP``, a decode
    step, the chunk is its one token). Runs before the ring takes this call's tokens (:func:`_ring_kernel`), which
    may overwrite the slots read here. ``K_RANGE``: keys' channel ranges narrow to ``kratio`` of their width.
    ``FEEDBACK``: keys rounded with error feedback (``fb_ptr``: ``[H, d, d]`` factors, see :func:`_quantize_store`)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(2) % NH
    first = tl.load(first_ptr + b).to(tl.int64)
    last = tl.load(last_ptr + b).to(tl.int64)
    if last >= 0:  # a row of padding only writes nothing
        lo = whole_pages_len(first, S, WE, PS)
        j0 = lo + tl.program_id(1) * PS
        if j0 < whole_pages_len(last + 1, S, WE, PS):
            j = j0 + tl.arange(0, PS)  # quantized indices of the page's tokens
            q = S + j  # their positions
            from_ring = q < first
            if HAS_TMAP:
                t = tl.load(tmap_ptr + b * stm_b + tl.where(from_ring, 0, q - first), mask=~from_ring,
                            other=0).to(tl.int64)
            else:
                t = tl.zeros([PS], tl.int64)
            if tl.program_id(2) < NH:
                _flush_side(kout_ptr, so_b, so_t, so_h, kr_ptr, sr_b, sr_t, sr_h, kc_ptr, km_ptr, bt_ptr, stride_bt_b,
                            b, h, t, from_ring, q, j, sc_p, sc_s, sc_h, skm_p, 0, skm_h, 0, kratio, W, MAX_PAGES,
                            NUM_PAGES, PS, D, NG, K_RANGE, FRAG, 0, True, fb_ptr, FEEDBACK, RING_FP8)
            else:
                _flush_side(vout_ptr, so_b, so_t, so_h, vr_ptr, sr_b, sr_t, sr_h, vc_ptr, vm_ptr, bt_ptr, stride_bt_b,
                            b, h, t, from_ring, q, j, sc_p, sc_s, sc_h, svm_p, svm_s, svm_h, vclip_lo, vclip_frac, W,
                            MAX_PAGES, NUM_PAGES, PS, D, NG, V_CLIP, FRAG, 1, False, RING_FP8=RING_FP8)


@triton.jit(do_not_specialize=["sp_b", "T", "ROWS", "S", "W", "WE"])
def _ring_kernel(kout_ptr, vout_ptr, so_b, so_t, so_h, pos_ptr, sp_b, last_ptr, kr_ptr, vr_ptr, sr_b, sr_t, sr_h,
                 T, ROWS, S, W, WE, NH, PS: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
                 RING_FP8: tl.constexpr = False):
    """This call's tokens into the ring (per-channel keys, after :func:`_flush_pages_kernel`): those past the row's
    pages (at most the newest ``W``), slot ``p % W``; one writer a slot, as the reference writes it."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = r < ROWS
    b = tl.where(inb, r // T, 0)
    t = r % T
    h = tl.program_id(1) % NH
    p = tl.load(pos_ptr + b * sp_b + t, mask=inb, other=-1).to(tl.int64)
    last = tl.load(last_ptr + b, mask=inb, other=0).to(tl.int64)
    ring_final = inb & (p >= S + whole_pages_len(last + 1, S, WE, PS))
    col = tl.arange(0, D)[None, :]
    src = b[:, None] * so_b + t[:, None] * so_t + h * so_h + col
    if RING_FP8:  # FP8 rows with a scale each (fp8_ring.py), from the cache-dtype row
        dst = b * sr_b + tl.where(ring_final, p % W, 0) * sr_t + h * sr_h  # the slot's row start
        out_ptr = kout_ptr if tl.program_id(1) < NH else vout_ptr
        ring_ptr = kr_ptr if tl.program_id(1) < NH else vr_ptr
        x = tl.load(out_ptr + src, mask=ring_final[:, None], other=0.0)
        store_fp8_rows(ring_ptr + dst, x.to(tl.float32), ring_final, D)
    else:  # as it ran on the GPU before the FP8 rows (65dba96): the same PTX
        final = ring_final[:, None]
        dst = b[:, None] * sr_b + tl.where(final, p[:, None] % W, 0) * sr_t + h * sr_h + col
        if tl.program_id(1) < NH:
            tl.store(kr_ptr + dst, tl.load(kout_ptr + src, mask=final), mask=final)
        else:
            tl.store(vr_ptr + dst, tl.load(vout_ptr + src, mask=final), mask=final)


def _clip_args(ratio: float, d: int) -> tuple[int, float, bool]:
    if ratio >= 1.0:
        return 0, 0.0, False
    pos = ratio * (d - 1)
    lo = int(math.floor(pos))
    return lo, pos - lo, True


def store_triton(k, v, positions, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
                 key_transform, key_mean, value_transform, value_mean, key_clip, value_clip, key_feedback=None):
    """Triton ``oscar::store`` (same arguments and results as :func:`store_reference`)."""
    cache = (k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table)
    geo = check_store(k, v, positions, cache, key_transform, key_mean, value_transform, value_mean, key_clip,
                      value_clip, key_feedback)
    b, h, t, d = k.shape
    same_meta = geo.key_channel or v_meta.stride() == k_meta.stride()  # per-channel key metadata: its own strides
    if (v_codes.stride() != k_codes.stride() or not same_meta or v_sink.stride() != k_sink.stride()
            or v_ring.stride() != k_ring.stride()):
        raise ValueError("oscar: the Triton store needs key and value cache tensors with the same strides")
    pos = positions.expand(b, t) if positions.dim() == 1 else positions
    first = torch.where(pos >= 0, pos, torch.iinfo(pos.dtype).max).amin(dim=-1)
    last = pos.amax(dim=-1)
    k_out = torch.empty(b, t, h, d, dtype=k_sink.dtype, device=k.device)
    v_out = torch.empty_like(k_out)
    n = history_len(geo.drops_evicted, geo.window, t)
    # a cache without pages: the ring's tokens before the chunk, read now (the launch below overwrites their slots)
    layout = history_layout(pos, n) if n else None
    history = (read_history(layout, k_sink, k_ring), read_history(layout, v_sink, v_ring)) if n else None
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kl, kf, kc = _clip_args(key_clip, d)  # per-token keys; per-channel keys take key_clip as their page range ratio
    vl, vf, vc = _clip_args(value_clip, d)
    block_t = 16
    f32 = lambda x: x.float().contiguous()  # noqa: E731
    warps = 8 if d >= 256 else 4
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    grid = (triton.cdiv(b * t, block_t), 2 * h)  # keys: heads 0..h-1, values: h..2h-1
    LAST_LAUNCH["store"] = _store_kernel[grid](
        k, v, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        pos, pos.stride(0), first, last, t, b * t,
        f32(key_transform), f32(key_mean), f32(value_transform), f32(value_mean), k_out, v_out,
        k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, bt, bt.stride(0),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2), k_meta.stride(0), k_meta.stride(1), k_meta.stride(2),
        k_sink.stride(0), k_sink.stride(1), k_sink.stride(2), k_ring.stride(0), k_ring.stride(1), k_ring.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2), kl, kf, vl, vf, geo.num_sinks, geo.window, geo.max_pages,
        geo.num_pages, h,
        PS=geo.page_size, BLOCK_T=block_t, D=d, NG=geo.num_groups, K_CLIP=kc and not geo.key_channel, V_CLIP=vc,
        HAS_RING=geo.window > 0,
        FRAG=fragment_order.in_fragment_order(k_codes), num_warps=warps, CHUNK_ONLY=geo.key_channel,
        RING_FP8=geo.ring_fp8,
    )
    if geo.key_channel:
        _store_pages_then_ring(geo, pos, first, last, k_out, v_out, k_codes, k_meta, v_codes, v_meta, k_ring, v_ring,
                               bt, vl, vf, vc, float(key_clip), key_feedback)
    if history is not None:  # returned in front of the chunk (kernels/sliding.py)
        return place_history(layout, history[0], k_out), place_history(layout, history[1], v_out)
    return k_out, v_out


def _store_pages_then_ring(geo, pos, first, last, k_out, v_out, k_codes, k_meta, v_codes, v_meta, k_ring, v_ring, bt,
                           vclip_lo, vclip_frac, v_clip, key_range=1.0, key_feedback=None):
    """Per-channel keys, after the chunk was transformed (and its sinks written): the pages the call completes,
    then the ring (two launches: a page may read a ring slot that this call's tokens overwrite)."""
    b, t, h, d = k_out.shape
    ps = geo.page_size
    if t > 1:  # chunk index of each new position (position - first): padding may sit anywhere in a row
        tmap = torch.zeros(b, t + 1, dtype=torch.int32, device=pos.device)
        idx = torch.where(pos >= 0, pos - first[:, None], t).long().clamp_(0, t)  # consecutive: < t
        tmap.scatter_(1, idx, torch.arange(t, dtype=torch.int32, device=pos.device).expand(b, t).contiguous())
    else:  # a decode step's chunk is its one token: no map (four fewer launches a layer and step)
        tmap = pos
    LAST_LAUNCH["flush"] = _flush_pages_kernel[(b, triton.cdiv(t, ps), 2 * h)](
        k_out, v_out, k_out.stride(0), k_out.stride(1), k_out.stride(2), tmap, tmap.stride(0), first, last,
        k_codes, k_meta, v_codes, v_meta, k_ring, v_ring, bt, bt.stride(0),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2), k_meta.stride(0), k_meta.stride(2),
        v_meta.stride(0), v_meta.stride(1), v_meta.stride(2), k_ring.stride(0), k_ring.stride(1), k_ring.stride(2),
        vclip_lo, vclip_frac, key_range, geo.num_sinks, geo.window, geo.evict_window, geo.max_pages, geo.num_pages,
        h, PS=ps, D=d, NG=geo.num_groups, V_CLIP=v_clip, FRAG=fragment_order.in_fragment_order(k_codes),
        HAS_TMAP=t > 1, K_RANGE=key_range < 1.0, num_warps=8 if d * ps >= 8192 else 4,
        fb_ptr=None if key_feedback is None else key_feedback.float().contiguous(), FEEDBACK=key_feedback is not None,
        RING_FP8=geo.ring_fp8,
    )
    block_t = 16
    _ring_kernel[(triton.cdiv(b * t, block_t), 2 * h)](
        k_out, v_out, k_out.stride(0), k_out.stride(1), k_out.stride(2), pos, pos.stride(0), last, k_ring, v_ring,
        k_ring.stride(0), k_ring.stride(1), k_ring.stride(2), t, b * t, geo.num_sinks, geo.window, geo.evict_window,
        h, PS=ps, BLOCK_T=block_t, D=d, num_warps=4, RING_FP8=geo.ring_fp8,
    )
