"""Triton ``oscar::attention``: split-KV attention over BF16 sinks, INT2 pages and the BF16 ring.

Beside it, :func:`oscar_compile.kernels.attention.attention_reference` is the oracle (same semantics).

Work decomposition (flash-decoding): one program per (sequence row, KV head, block of query rows,
split). The query rows of a KV head are its whole GQA group times the query tokens (row
``r = t * G + g``), so every loaded KV tile serves all query heads that read it; KV is never
repeated. Splits ``0 .. NSPLIT-1`` share the INT2 page region of the row; the last ones take the
BF16 keys (sinks, the ring and the new chunk), in ``NB`` splits of their own. A second kernel merges the splits' partial softmax
states, un-rotates (``o' B_o + mu_v``) and writes the output.

INT2 in registers, never in memory: the code pools are read as int32 words (``[BLOCK_N, d/16]``
tiles, 16-byte vector loads) and expanded to ``[BLOCK_N, d]`` codes in registers (quartered
packing puts channel ``i d/4 + c`` in byte ``c`` at bits ``2i``). On the GPU the expansion is PTX
(shift, lop3 with the bits of 1024, packed subtract: no integer-to-float conversions) in an order
that needs no shuffles; the page loop works in that channel order throughout. The page loop is
pipelined by hand: block ``i+1``'s codes and block ``i+2``'s block-table entries are in flight
while block ``i`` is computed. With one (scale, min) per row (``g = d``) dequantization folds into
the dot products, per key rather than per element::

    q'.k_hat = scale * (q' . c) + min * sum(q')
    P V_hat  = (P * scale) @ c  + (P @ min)

so the inner loop issues only the unpacking and two ``tl.dot`` (fp16 tensor cores). Smaller groups
dequantize per element.

Prefill (a chunk of many query tokens) takes another route when it can: every row's keys before its chunk are
gathered once as 16-bit rows (sinks, dequantized pages, ring: ``_gather_prefix_kernel``), and one flash-attention
launch a query tile (``_prefill_kernel``) runs over them and over the chunk, one partial state a row. The split
launches below remain for decode and for what the gather does not take (see :func:`_gathered_prefix`).

Split launches: the query is rotated once per row (``q B_q``), the INT2
pages and the BF16 keys run as two launches of the split kernel (registers of their own; a prefill chunk's own
keys get a third, REGION 2, over their contiguous rows), and the merge kernel combines the splits and un-rotates
the output. ``ablate`` switches off stages for
measurements (1: values, 2: key dot, 4: everything but the loads). Triton's own software pipelining
in place of the hand prefetch was measured slower on the H200 and removed
(results/decode_attention_h200_probe_pipeline.json, configs ``pipeline``; commit 419d305 has the code).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import fragment_order
from .checks import channel_pages_supported, check_attention
from .sliding import positions_with_history
from .triton_store import load_fp8_rows, whole_pages_len

log = logging.getLogger("oscar_compile.kernels")

LOG2E = 1.4426950408889634
LAST_LAUNCH: dict = {}  # the latest call: its compiled kernels (register/spill reports) and "plan" (AttentionPlan)


@triton.jit
def _rowmajor_matmul(x_ptr, x_off, x_mask, m_ptr, BLOCK_M: tl.constexpr, D: tl.constexpr, KC: tl.constexpr):
    """``X @ M`` for rows ``X [BLOCK_M, D]`` at ``x_ptr + x_off[:, None] + col`` and ``M [D, D]`` fp32.

    Blocked over ``KC`` input channels so no ``D x D`` tile is live at once (head_dim 256 fits).
    """
    col = tl.arange(0, D)
    kc = tl.arange(0, KC)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for k0 in tl.static_range(0, D, KC):
        xk = tl.load(x_ptr + x_off[:, None] + k0 + kc[None, :], mask=x_mask[:, None], other=0.0).to(tl.float32)
        mk = tl.load(m_ptr + (k0 + kc)[:, None] * D + col[None, :])
        acc = tl.dot(xk, mk, acc, input_precision="tf32x3")  # fp32-accurate on tensor cores
    return acc


@triton.jit
def _page_of(bt_ptr, b, sbt_b, j, hi, S, PS: tl.constexpr):
    """Physical page of each key ``j`` of the page region (0 where out of range or unowned)."""
    ok = j < hi
    page = tl.load(bt_ptr + b * sbt_b + tl.where(ok, j - S, 0) // PS, mask=ok, other=0).to(tl.int64)
    return tl.where(page >= 0, page, 0)


@triton.jit
def _page_end(length, c0, S, W, PS: tl.constexpr, KCH: tl.constexpr):
    """End of the INT2 keys a row reads, ``[S, page_end)``: its page tokens (:func:`checks.quantized_len`; ``W`` the
    ring's length, whole pages with per-channel keys, ``KCH``), never past the chunk's first position ``c0``."""
    if KCH:
        q_end = S + whole_pages_len(length, S, W - PS + 1, PS)
    else:
        q_end = length - W
    return tl.maximum(tl.minimum(q_end, c0), S)


@triton.jit
def _key_channels(km_ptr, bt_ptr, b, sbt_b, j0, hi, S, h, sm_p, sm_h, uperm, PS: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Per-channel keys: the (scale, min) of the block of keys from ``j0``, in the unpacked channel order ``uperm``,
    fp32: ``[NP, D]`` each for a page-aligned block of ``NP`` whole pages, ``[D]`` for a block within one page;
    zeros for pages from ``hi`` on."""
    NP: tl.constexpr = (BLOCK_N + PS - 1) // PS
    first = j0 + PS * tl.arange(0, NP)  # each page's first key (``j0`` for a block within a page)
    page = _page_of(bt_ptr, b, sbt_b, first, hi, S, PS)
    base = km_ptr + page[:, None] * sm_p + h * sm_h + uperm[None, :]
    ok = (first[:, None] + uperm[None, :] * 0) < hi  # a full-shape mask: `vector & scalar bool` fails in Triton
    # 3.9's interpreter
    sc = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    mn = tl.load(base + D, mask=ok, other=0.0).to(tl.float32)
    if BLOCK_N <= PS:
        sc = tl.reshape(sc, (D,))
        mn = tl.reshape(mn, (D,))
    return sc, mn


@triton.jit
def _channel_of(u, D: tl.constexpr, FRAG: tl.constexpr):
    """True channel of unpacked position ``16 w + i`` (bit pair ``i`` of word ``w``, see :func:`_unpack_words`).

    Pair ``j = i // 2`` of a word holds bits ``2j`` (even ``i``) and ``16 + 2j`` (odd ``i``). Logical
    order: byte ``j // 4 + 2 (i % 2)`` of the word, quarter ``j % 4``. Fragment order (the words
    :func:`_load_page_block` assembles): word ``w = t d/64 + c64``, channel ``64 c64 + 32 j2 + 16 j1 +
    8 j0 + 2 t + i % 2`` (``j = 4 j2 + 2 j1 + j0``, :mod:`.fragment_order`).
    """
    w = u // 16
    i = u % 16
    j = i // 2
    if FRAG:
        return 64 * (w % (D // 64)) + 32 * (j // 4) + 16 * ((j // 2) % 2) + 8 * (j % 2) + 2 * (w // (D // 64)) + i % 2
    return (j % 4) * (D // 4) + 4 * w + j // 4 + 2 * (i % 2)


@triton.jit
def _load_page_block(kc_ptr, km_ptr, vc_ptr, vm_ptr, page, j, hi, S, h, sc_p, sc_s, sc_h, sm_p, sm_s, sm_h,
                     PS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, NG: tl.constexpr,
                     ALIGNED: tl.constexpr, FRAG: tl.constexpr, KCH: tl.constexpr = False):
    """Packed codes (int32 words, ``[BLOCK_N, D/16]``) and metadata of keys ``j``: ``[BLOCK_N, 2]``
    (scale, min) for one group a row, else ``[BLOCK_N, D, 2]`` (each unpacked position's group's).
    ``KCH`` (per-channel keys): the keys' metadata is the page's (:func:`_key_channels`); ``km`` is the values'.

    Fragment order (:mod:`.fragment_order`): a key owns 8 whole words of its 16-slot group (gathered);
    a value owns 16-bit halves of 16 words, two of which make one word here (``g = 2m`` low, ``2m + 1`` high).
    """
    ok = j < hi
    slot = tl.where(ok, j - S, 0) % PS
    metaoff = page * sm_p + slot * sm_s + h * sm_h
    w = tl.arange(0, D // 16)
    if FRAG:
        s = slot % 16
        grp = (page * sc_p + (slot - s) * sc_s + h * sc_h)[:, None]  # the group's first row, in words
        t = (w // (D // 64))[None, :]
        c64 = (w % (D // 64))[None, :]
        kword = (4 * (s % 8)[:, None] + t) * (D // 32) + (s // 8)[:, None] * (D // 64) + c64
        kw = tl.load(kc_ptr + grp + (kword // (D // 16)) * sc_s + kword % (D // 16), mask=ok[:, None], other=0)
        vword = (4 * (2 * t) + ((s % 8) // 2)[:, None]) * (D // 32) + (s // 8)[:, None] * (D // 64) + c64
        vword2 = vword + 4 * (D // 32)  # g = 2m + 1
        v_lo = tl.load(vc_ptr + grp + (vword // (D // 16)) * sc_s + vword % (D // 16), mask=ok[:, None], other=0)
        v_hi = tl.load(vc_ptr + grp + (vword2 // (D // 16)) * sc_s + vword2 % (D // 16), mask=ok[:, None], other=0)
        sh = (16 * (s % 2)).to(tl.int32)[:, None]
        vw = (((v_lo >> sh) & 0xFFFF) | (((v_hi >> sh) & 0xFFFF) << 16)).to(tl.int32)
    else:
        rowoff = page * sc_p + slot * sc_s + h * sc_h  # in words
        if ALIGNED:
            rowoff = tl.multiple_of(rowoff, 4)  # 16-byte rows: vector loads
        kw = tl.load(kc_ptr + rowoff[:, None] + w[None, :], mask=ok[:, None], other=0)
        vw = tl.load(vc_ptr + rowoff[:, None] + w[None, :], mask=ok[:, None], other=0)
    if NG == 1:
        g2 = tl.arange(0, 2)
        vm = tl.load(vm_ptr + metaoff[:, None] + g2[None, :], mask=ok[:, None], other=0.0)
        if KCH:
            km = vm
        else:
            km = tl.load(km_ptr + metaoff[:, None] + g2[None, :], mask=ok[:, None], other=0.0)
    else:
        grp = _channel_of(tl.arange(0, D), D, FRAG) // (D // NG)
        moff = metaoff[:, None] + grp[None, :]
        vm = tl.join(tl.load(vm_ptr + moff, mask=ok[:, None], other=0.0),
                     tl.load(vm_ptr + moff + NG, mask=ok[:, None], other=0.0))
        if KCH:
            km = vm
        else:
            km = tl.join(tl.load(km_ptr + moff, mask=ok[:, None], other=0.0),
                         tl.load(km_ptr + moff + NG, mask=ok[:, None], other=0.0))
    return kw, km, vw, vm


# PTX for one packed word -> its 16 codes as 16-bit floats without integer-to-float conversions: pair j
# takes bits 2j..2j+1 into the low half and 16+2j.. into the high half, ORs in the bits of a magic number
# M (1024 in fp16: 0x6400; 128 in bf16: 0x4300, where M + code is exact), subtracts M (packed) and splits
# the word into two registers. Subtracting here rather than folding -M * scale into the minimum: the
# folded form lost ~3 bits in the tensor-core accumulation (rel. error 6.8e-3 vs 1.3e-3 on the H200).
def _unpack_asm(magic: int, sub: str) -> str:
    body = "".join(f"shr.b32 t, $16, {2 * j};\nlop3.b32 t, t, 0x00030003, {magic:#010x}, 0xea;\n"
                   f"{sub} t, t, m;\nmov.b32 {{${2 * j}, ${2 * j + 1}}}, t;\n" for j in range(8))
    return "{\n.reg .b32 t, m;\n" + f"mov.b32 m, {magic:#010x};\n" + body + "}"


_UNPACK_FP16_ASM = tl.constexpr(_unpack_asm(0x64006400, "sub.f16x2"))
_UNPACK_BF16_ASM = tl.constexpr(_unpack_asm(0x43004300, "sub.rn.bf16x2"))
_UNPACK_CONSTRAINTS = tl.constexpr(",".join(["=h"] * 16 + ["r"]))


@triton.jit
def _unpack_words(words, BLOCK_N: tl.constexpr, D: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed int32 words ``[BLOCK_N, D/16]`` -> codes as ``DT`` ``[BLOCK_N, D]`` in the unpacked order
    (position ``16 w + i``, channel :func:`_channel_of`). ``USE_ASM``: PTX, else shifts, masks and
    conversions (the interpreter runs no PTX). Both give the exact codes 0..3."""
    if USE_ASM:
        if DT == tl.float16:
            o = tl.inline_asm_elementwise(_UNPACK_FP16_ASM, _UNPACK_CONSTRAINTS, [words], dtype=(tl.float16,) * 16,
                                          is_pure=True, pack=1)
        else:
            o = tl.inline_asm_elementwise(_UNPACK_BF16_ASM, _UNPACK_CONSTRAINTS, [words], dtype=(tl.bfloat16,) * 16,
                                          is_pure=True, pack=1)
        # stack the 16 outputs on new minor dims, most significant bit of i first (tl.join appends a dim)
        a0 = tl.join(o[0], o[8])
        a1 = tl.join(o[1], o[9])
        a2 = tl.join(o[2], o[10])
        a3 = tl.join(o[3], o[11])
        a4 = tl.join(o[4], o[12])
        a5 = tl.join(o[5], o[13])
        a6 = tl.join(o[6], o[14])
        a7 = tl.join(o[7], o[15])
        b0 = tl.join(a0, a4)
        b1 = tl.join(a1, a5)
        b2 = tl.join(a2, a6)
        b3 = tl.join(a3, a7)
        c0 = tl.join(b0, b2)
        c1 = tl.join(b1, b3)
        return tl.reshape(tl.join(c0, c1), (BLOCK_N, D))
    else:
        i = tl.arange(0, 16)
        shifts = 2 * (i // 2) + 16 * (i % 2)
        codes = (words[:, :, None] >> shifts[None, None, :]) & 3  # [BLOCK_N, D/16, 16]
        return tl.reshape(codes, (BLOCK_N, D)).to(DT)


@triton.jit
def _meta(meta):
    """(scale, min) in fp32: ``[BLOCK_N]`` each for one group a row, else ``[BLOCK_N, D]``."""
    sc, mn = tl.split(meta)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant_dot_keys(qq, qsum, qsq, kw, km, debias, BLOCK_N: tl.constexpr, D: tl.constexpr, NG: tl.constexpr,
                      DT: tl.constexpr, USE_ASM: tl.constexpr, DEBIAS: tl.constexpr = False):
    """Scores ``q' . k_hat`` for a block of INT2 keys (scaled query ``qq`` in unpacked order, ``qsum = sum(q')``).
    ``DEBIAS``: minus ``debias * sum_c (q'_c step_c)^2`` (``qsq = sum(q'^2)``; ``debias`` carries the constants)."""
    sc, mn = _meta(km)
    codes = _unpack_words(kw, BLOCK_N, D, DT, USE_ASM)
    if NG == 1:  # one (scale, min) per key: dequantize after the dot, per key
        s = tl.dot(qq, tl.trans(codes))
        s = s * sc[None, :] + qsum[:, None] * mn[None, :]
        if DEBIAS:
            s -= debias * qsq[:, None] * (sc * sc)[None, :]
    else:
        x = codes.to(tl.float32) * sc + mn
        s = tl.dot(qq, tl.trans(x.to(DT)))
        if DEBIAS:
            qf = qq.to(tl.float32)
            s -= debias * tl.dot(qf * qf, tl.trans(sc * sc), input_precision="tf32")
    return s


@triton.jit
def _dequant_dot_key_channels(qq, kw, sc, mn, debias, BLOCK_N: tl.constexpr, D: tl.constexpr, DT: tl.constexpr,
                              USE_ASM: tl.constexpr, DEBIAS: tl.constexpr = False):
    """Scores for a block of one page's per-channel INT2 keys: ``q'.k_hat = (q' * scale) . c + q' . min`` (the
    page's scale folded into the query, once a block, so the inner product stays one ``tl.dot`` on the codes).
    ``DEBIAS``: minus ``debias * sum_c (q'_c scale_c)^2``, one value a query row for the whole page."""
    codes = _unpack_words(kw, BLOCK_N, D, DT, USE_ASM)
    qf = qq.to(tl.float32)
    qs = qf * sc[None, :]
    s = tl.dot(qs.to(DT), tl.trans(codes))
    bias = tl.sum(qf * mn[None, :], 1)
    if DEBIAS:
        bias -= debias * tl.sum(qs * qs, 1)
    return s + bias[:, None]


@triton.jit
def _dequant_dot_key_pages(qq, kw, sc, mn, debias, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NP: tl.constexpr,
                           D: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr, DEBIAS: tl.constexpr = False,
                           FOLD: tl.constexpr = True):
    """:func:`_dequant_dot_key_channels` for a block of ``NP`` whole pages (``sc``, ``mn``: ``[NP, D]``), so a block
    of several small pages costs one softmax step, not one a page. ``FOLD``: each page's scale folded into its own
    copy of the query, one batched ``tl.dot`` (``[NP, M, D] x [NP, D, P]``); else the keys dequantized
    (``c * scale + min``, the page's row broadcast over its keys) and one plain dot."""
    codes = tl.reshape(_unpack_words(kw, BLOCK_N, D, DT, USE_ASM), (NP, BLOCK_N // NP, D))
    if FOLD:
        # [NP, M, D] in DT, not fp32 (half the registers): the product of two DT numbers rounded once to DT, as an
        # fp32 product would be (exact in fp32) before its rounding to the dot's operand type
        qs = qq.to(DT)[None, :, :] * sc.to(DT)[:, None, :]
        s3 = tl.dot(qs, tl.permute(codes, (0, 2, 1)))  # [NP, M, P]
        bias = tl.sum(qq.to(tl.float32)[None, :, :] * mn[:, None, :], 2)  # [NP, M]
        if DEBIAS:
            qsf = qs.to(tl.float32)
            bias -= debias * tl.sum(qsf * qsf, 2)
        s = tl.reshape(tl.permute(s3 + bias[:, :, None], (1, 0, 2)), (BLOCK_M, BLOCK_N))
    else:
        k = tl.reshape(codes.to(tl.float32) * sc[:, None, :] + mn[:, None, :], (BLOCK_N, D))
        s = tl.dot(qq, tl.trans(k.to(DT)))
        if DEBIAS:
            qf = qq.to(tl.float32)
            qsq = tl.sum(qf[None, :, :] * qf[None, :, :] * (sc * sc)[:, None, :], 2)  # [NP, M]
            s -= debias * tl.reshape(tl.broadcast_to(tl.permute(qsq, (1, 0))[:, :, None],
                                                     (BLOCK_M, NP, BLOCK_N // NP)), (BLOCK_M, BLOCK_N))
    return s


@triton.jit
def _dequant_dot_values(p, vw, vm, acc, BLOCK_N: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, DT: tl.constexpr,
                        USE_ASM: tl.constexpr):
    """``acc + P V_hat`` for a block of INT2 values (output in unpacked order)."""
    sc, mn = _meta(vm)
    codes = _unpack_words(vw, BLOCK_N, D, DT, USE_ASM)
    if NG == 1:
        acc = tl.dot((p * sc[None, :]).to(DT), codes, acc)
        acc = acc + tl.sum(p * mn[None, :], 1)[:, None]
    else:
        x = codes.to(tl.float32) * sc + mn
        acc = tl.dot(p.to(DT), x.to(DT), acc)
    return acc


@triton.jit
def _visibility(j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
                IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    """Which keys ``j`` each query row sees (``[M, N]`` bool) and the additive mask's bias in log2 units
    (``0.0`` without one)."""
    vis = key_ok[None, :]
    if IS_CAUSAL:
        vis = vis & (j[None, :] <= row_pos[:, None])
    bias = 0.0
    if MASK_KIND != 0:
        in_mask = j < mask_len
        mptr = mask_ptr + b * smk_b + row_hq[:, None] * smk_h + row_t[:, None] * smk_t + tl.where(in_mask, j, 0)[None, :] * smk_j
        if MASK_KIND == 1:
            mv = tl.load(mptr, mask=vis & in_mask[None, :], other=0)
            vis = vis & in_mask[None, :] & (mv != 0)
        else:
            mv = tl.load(mptr, mask=vis & in_mask[None, :], other=float("-inf")).to(tl.float32)
            vis = vis & in_mask[None, :] & (mv > float("-inf"))
            bias = mv * 1.4426950408889634
    return vis, bias


@triton.jit
def _visible(s, j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
             IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    """Apply causality and the user mask to scores ``s [M, N]`` (already scaled by log2(e)/sqrt(d))."""
    vis, bias = _visibility(j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
                            IS_CAUSAL, MASK_KIND)
    return tl.where(vis, s + bias, float("-inf"))


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One block of the streaming softmax (base 2): weights, the rescale of the running state, new m and l."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero weight
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _key_visibility(j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len, m_first,
                    m_last, m_holes, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_BOUNDS: tl.constexpr):
    """:func:`_visibility` of the BF16-key launch's blocks, padding rows dropped. ``MASK_BOUNDS``: a row of one
    interval ``[m_first, m_last]`` takes two compares a key and no mask byte (the byte loads are predicated off); a
    row with holes (``m_holes``) a byte a key and row. Branch-free: a branch in the loop body can keep Triton from
    pipelining the loads."""
    if MASK_BOUNDS:
        vis_i, _ = _visibility(j, key_ok & (j >= m_first) & (j <= m_last), row_t, row_pos, row_hq, b,
                               mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len, IS_CAUSAL, 0)
        vis_b, bias = _visibility(j, key_ok & m_holes, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h,
                                  smk_t, smk_j, mask_len, IS_CAUSAL, MASK_KIND)
        vis = tl.where(m_holes, vis_b, vis_i)
    else:
        vis, bias = _visibility(j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j,
                                mask_len, IS_CAUSAL, MASK_KIND)
    return vis & (row_pos >= 0)[:, None], bias  # padding rows: their output is zero


@triton.jit
def _plain_key_block(qq, m_i, l_i, acc, kb, vb, key_ok, vis, bias, D: tl.constexpr, DT: tl.constexpr,
                     ALIGNED: tl.constexpr):
    """One block of 16-bit key and value rows (row starts ``kb``, ``vb``) into the streaming softmax."""
    dcol = tl.arange(0, D)
    if ALIGNED:
        kb = tl.multiple_of(kb, 16)
        vb = tl.multiple_of(vb, 16)
    k = tl.load(kb[:, None] + dcol[None, :], mask=key_ok[:, None], other=0.0).to(DT)
    v = tl.load(vb[:, None] + dcol[None, :], mask=key_ok[:, None], other=0.0).to(DT)
    s = tl.where(vis, tl.dot(qq, tl.trans(k)) + bias, float("-inf"))
    p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
    return m_new, l_i, tl.dot(p.to(DT), v, acc * alpha[:, None])


@triton.jit
def _fp8_key_block(qq, m_i, l_i, acc, kp, vp, in_ring, vis, bias, D: tl.constexpr, DT: tl.constexpr):
    """One block of FP8 ring rows (row starts ``kp``, ``vp``: ``D`` e4m3 codes, then an fp32 scale; fp8_ring.py) into
    the streaming softmax, scales applied outside the dots: scores are ``(q . codes) * key scale``, and the values'
    dot takes ``p * value scale / block max`` (in [0, 1], as p) with the block's largest value scale after it. The
    codes enter the tensor cores as they are (e4m3 is exact in fp16 and bf16): no per-element product, no fp32 tile.
    Rows not read (``~in_ring``) are zeroed by selects: on an H100 the loads' ``other`` left them non-finite in
    registers (:func:`load_fp8_rows`)."""
    dcol = tl.arange(0, D)
    kp = tl.multiple_of(kp, 4)  # rows of d + 4 bytes start on 4 bytes: word loads
    vp = tl.multiple_of(vp, 4)
    kc = tl.load(kp[:, None] + dcol[None, :], mask=in_ring[:, None], other=0)
    vc = tl.load(vp[:, None] + dcol[None, :], mask=in_ring[:, None], other=0)
    ksc = tl.load((kp + D).to(tl.pointer_type(tl.float32)), mask=in_ring, other=0.0)
    vsc = tl.where(in_ring, tl.load((vp + D).to(tl.pointer_type(tl.float32)), mask=in_ring, other=0.0), 0.0)
    s = tl.dot(qq, tl.trans(kc.to(tl.float8e4nv, bitcast=True).to(DT))) * ksc[None, :]
    s = tl.where(vis & in_ring[None, :], s + bias, float("-inf"))
    p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
    vmax = tl.max(vsc, 0)
    vmax = tl.where(vmax > 0, vmax, 1.0)
    w = (p * (vsc / vmax)[None, :]).to(DT)
    v = tl.where(in_ring[:, None], vc, 0).to(tl.float8e4nv, bitcast=True).to(DT)
    return m_new, l_i, acc * alpha[:, None] + tl.dot(w, v) * vmax


@triton.jit
def _fp8_ring_keys(qq, m_i, l_i, acc, u_lo, u_hi, n_sink, page_end, c0, c_end, b, h, ks_ptr, vs_ptr, kr_ptr, vr_ptr,
                   kch_ptr, vch_ptr, ss_b, ss_t, ss_h, sr_b, sr_t, sr_h, sch_b, sch_t, sch_h, W, row_t, row_pos,
                   row_hq, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len, m_first, m_last, m_holes,
                   BLOCK_N: tl.constexpr, D: tl.constexpr, DT: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   MASK_KIND: tl.constexpr, MASK_BOUNDS: tl.constexpr, CHUNK: tl.constexpr,
                   SKIP_EMPTY: tl.constexpr, ALIGNED: tl.constexpr):
    """The BF16-key launch's keys ``u`` in ``[u_lo, u_hi)`` of a cache whose ring is FP8: the sinks (``u < n_sink``,
    16-bit rows), the ring's FP8 rows (key ``j = page_end + u - n_sink``), and, with ``CHUNK``, the chunk's keys
    ``[c0, c_end)`` from the chunk (16-bit, exact: a decode step's own token) instead of the ring. Each in a loop of
    its own, so no block loads both kinds of rows and selects between them."""
    nblk = tl.arange(0, BLOCK_N)
    sink_hi = tl.minimum(u_hi, n_sink)
    for u0 in range(u_lo, sink_hi, BLOCK_N):
        j = u0 + nblk
        key_ok = j < sink_hi
        vis, bias = _key_visibility(j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j,
                                    mask_len, m_first, m_last, m_holes, IS_CAUSAL, MASK_KIND, MASK_BOUNDS)
        row = b * ss_b + tl.where(key_ok, j, 0) * ss_t + h * ss_h
        m_i, l_i, acc = _plain_key_block(qq, m_i, l_i, acc, ks_ptr + row, vs_ptr + row, key_ok, vis, bias, D, DT,
                                         ALIGNED)
    w1 = tl.maximum(W, 1)
    for u0 in range(tl.maximum(u_lo, n_sink), u_hi, BLOCK_N):
        u = u0 + nblk
        key_ok = u < u_hi
        j = page_end + (u - n_sink)
        vis, bias = _key_visibility(j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j,
                                    mask_len, m_first, m_last, m_holes, IS_CAUSAL, MASK_KIND, MASK_BOUNDS)
        in_ring = key_ok
        if CHUNK:
            in_ring = in_ring & ((j < c0) | (j >= c_end))
        run = True
        if SKIP_EMPTY:
            run = tl.max(tl.max((vis & in_ring[None, :]).to(tl.int32), 1), 0) > 0
        if run:
            row = b * sr_b + tl.where(in_ring, j % w1, 0) * sr_t + h * sr_h
            m_i, l_i, acc = _fp8_key_block(qq, m_i, l_i, acc, kr_ptr + row, vr_ptr + row, in_ring, vis, bias, D, DT)
    if CHUNK:  # the chunk's keys past the sinks, within this split: u of key j is n_sink + j - page_end
        cu_lo = tl.maximum(u_lo, n_sink + tl.maximum(c0, page_end) - page_end)
        cu_hi = tl.minimum(u_hi, n_sink + c_end - page_end)
        for u0 in range(cu_lo, cu_hi, BLOCK_N):
            u = u0 + nblk
            key_ok = u < cu_hi
            j = page_end + (u - n_sink)
            vis, bias = _key_visibility(j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j,
                                        mask_len, m_first, m_last, m_holes, IS_CAUSAL, MASK_KIND, MASK_BOUNDS)
            row = b * sch_b + tl.where(key_ok, j - c0, 0) * sch_t + h * sch_h
            m_i, l_i, acc = _plain_key_block(qq, m_i, l_i, acc, kch_ptr + row, vch_ptr + row, key_ok, vis, bias, D,
                                             DT, ALIGNED)
    return m_i, l_i, acc


@triton.jit
def _row_block(pid_bh, m_block, pos_ptr, sp_b, len_ptr, sl_b, c0_ptr, cend_ptr, M_TOTAL, H: tl.constexpr,
               G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Query rows ``r`` of block ``m_block`` of (sequence row ``b``, KV head ``h``): their token, query head and
    position, and the row's length and chunk ``[c0, c_end)`` (int64, for offsets into the user's tensors).
    Padding rows of the last block point at token 0: every address they form stays inside the tensors (the mask
    loads of a non-causal decode are not otherwise guarded by row_ok; on the GPU they faulted)."""
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < M_TOTAL
    row_t = tl.where(row_ok, r // G, 0).to(tl.int64)
    row_hq = h * G + r % G
    row_pos = tl.load(pos_ptr + b * sp_b + row_t, mask=row_ok, other=-1).to(tl.int64)
    length = tl.load(len_ptr + b * sl_b).to(tl.int64)
    if HAS_CHUNK:
        c0 = tl.load(c0_ptr + b).to(tl.int64)
        c_end = tl.load(cend_ptr + b).to(tl.int64)
    else:
        c0 = length
        c_end = length
    return b, h, r, row_ok, row_t, row_hq, row_pos, length, c0, c_end


@triton.jit
def _store_state(part_m_ptr, part_l_ptr, part_o_ptr, base, row_ok, m_i, l_i, acc, cols, D: tl.constexpr):
    """A split's partial softmax state of its rows: m, l and the unnormalized output (rotated basis, ``cols``)."""
    tl.store(part_m_ptr + base, m_i, mask=row_ok)
    tl.store(part_l_ptr + base, l_i, mask=row_ok)
    tl.store(part_o_ptr + base[:, None] * D + cols[None, :], acc, mask=row_ok[:, None])


# Sizes that change from call to call (prompt length, split counts, sinks/window in use) are not
# specialised: Triton would otherwise compile a variant per value class (1, multiple of 16, other) of
# each, i.e. recompile on new prompt lengths while serving. So are strides that follow those sizes (positions,
# block table, mask rows); the other strides keep their specialisation (vector loads).
@triton.jit(do_not_specialize=["M_TOTAL", "ROWS", "NQ", "s_mrow", "L"])
def _query_kernel(q_ptr, sq_b, sq_h, sq_t, bq_ptr, qq_ptr, M_TOTAL, ROWS, qk_scale, NQ, mrow_ptr, s_mrow, mb_ptr, L,
                  H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, KC: tl.constexpr,
                  MASK_BLOCK: tl.constexpr):
    """``q' = q B_q * scale * log2(e)`` once per row (not once per split), in the tensor-core dtype.

    A program takes ``BLOCK_M`` rows of one KV head across batch rows (row ``i`` = batch ``i // M_TOTAL``,
    query row ``i % M_TOTAL``): a decode step has only G rows per batch row, and one program per
    (batch row, KV head) read ``B_q`` for 4 useful rows of 16 (H200, 64 x 4K: 11.8 us).
    Programs past ``NQ`` (column 0 only) find the bounds of a decode step's bool mask rows (``_row_bounds``), beside
    the queries instead of in a launch of their own (~10 us a layer at 93 x 32K, mostly launch and latency)."""
    if tl.program_id(0) < NQ:
        _rotate_rows(q_ptr, sq_b, sq_h, sq_t, bq_ptr, qq_ptr, M_TOTAL, ROWS, qk_scale, H, G, D, BLOCK_M, KC)
    elif tl.program_id(1) == 0:
        _row_bounds(mrow_ptr, s_mrow, mb_ptr, tl.program_id(0) - NQ, L, MASK_BLOCK)


@triton.jit
def _rotate_rows(q_ptr, sq_b, sq_h, sq_t, bq_ptr, qq_ptr, M_TOTAL, ROWS, qk_scale, H: tl.constexpr, G: tl.constexpr,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, KC: tl.constexpr):
    h = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < ROWS
    i = tl.where(row_ok, i, 0)
    b = (i // M_TOTAL).to(tl.int64)  # q may pass 2^31 elements (64 x 32 heads x 8K x 128)
    r = i % M_TOTAL
    q_off = b * sq_b + (h * G + r % G) * sq_h + (r // G) * sq_t
    qq = _rowmajor_matmul(q_ptr, q_off, row_ok, bq_ptr + h * D * D, BLOCK_M, D, KC) * qk_scale
    dcol = tl.arange(0, D)
    tl.store(qq_ptr + ((b * H + h) * M_TOTAL + r)[:, None] * D + dcol[None, :], qq.to(qq_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit(do_not_specialize=["sp_b", "sbt_b", "smk_b", "smk_h", "smk_t", "M_TOTAL", "keys_per_split",
                               "bf16_per_split", "S", "W", "NSPLIT", "NS", "mask_len"])
def _attn_kernel(
    qq_ptr, pos_ptr, sp_b, len_ptr, sl_b,
    c0_ptr, cend_ptr, kch_ptr, vch_ptr, sch_b, sch_t, sch_h,
    kc_ptr, km_ptr, vc_ptr, vm_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, bt_ptr, sbt_b,
    sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, ss_b, ss_t, ss_h, sr_b, sr_t, sr_h,
    mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
    part_m_ptr, part_l_ptr, part_o_ptr,
    M_TOTAL, keys_per_split, bf16_per_split, S, W, NSPLIT, NS, mb_ptr, smb_b, skm_p, skm_h, debias,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, PS: tl.constexpr, HAS_RING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_CHUNK: tl.constexpr, DT: tl.constexpr, KC: tl.constexpr, ALIGNED: tl.constexpr, ABLATE: tl.constexpr,
    USE_ASM: tl.constexpr, REGION: tl.constexpr, FRAG: tl.constexpr, DENSE_CHUNK: tl.constexpr = False,
    CDT: tl.constexpr = tl.float16, SKIP_EMPTY: tl.constexpr = True, MASK_BOUNDS: tl.constexpr = False,
    KCH: tl.constexpr = False, DEBIAS: tl.constexpr = False, KFOLD: tl.constexpr = True, RING_FP8: tl.constexpr = False,
):
    """One split of one row block: REGION 0 = INT2 pages (splits ``0 .. NSPLIT-1``), 1 = BF16 keys
    (splits ``NSPLIT ..``). Two launches, so each region's code gets registers of its own.
    Offsets into the user's tensors (queries, masks, chunks) are int64; the partial states are bounded
    by the launcher's temporary budget, so their offsets stay int32."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(2) + REGION * NSPLIT if REGION < 2 else NS - 1  # REGION 2 (the chunk): the last state
    b, h, r, row_ok, row_t, row_hq, row_pos, length, c0, c_end = _row_block(
        pid_bh, tl.program_id(1), pos_ptr, sp_b, len_ptr, sl_b, c0_ptr, cend_ptr, M_TOTAL, H, G, BLOCK_M, HAS_CHUNK)
    page_end = _page_end(length, c0, S, W, PS, KCH)  # INT2 keys: [S, page_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    nblk = tl.arange(0, BLOCK_N)
    dcol = tl.arange(0, D)
    # q' (rotated, scaled by softmax scale * log2(e) for exp2), from the query kernel
    qrow = qq_ptr + (pid_bh * M_TOTAL + r)[:, None] * D
    if REGION == 0:
        # The page region works in the unpacked channel order (no shuffles after unpacking): it reads the
        # query's channels in that order and writes its partial output back to channel order at the end.
        uperm = _channel_of(dcol, D, FRAG)
        qq = tl.load(qrow + uperm[None, :], mask=row_ok[:, None], other=0.0)
        qsum = tl.sum(qq.to(tl.float32), 1)
        qsq = tl.sum(qq.to(tl.float32) * qq.to(tl.float32), 1)  # for DEBIAS (unused otherwise: compiled away)
        # ---------------- INT2 pages: keys [lo, hi) of the page region.
        # Software pipelined by hand: while block i is computed, block i+1's codes and metadata are
        # in flight, and so is block i+2's block-table entry (loads issue without waiting; only a use
        # waits). The packed tiles are small (d/16 words a key), so the extra registers are few.
        lo = S + split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, page_end)
        page_n = _page_of(bt_ptr, b, sbt_b, lo + nblk, hi, S, PS)
        # value metadata strides: with per-channel keys (KCH) k_meta has a layout of its own (skm_p, skm_h)
        kw, km, vw, vm = _load_page_block(kc_ptr, km_ptr, vc_ptr, vm_ptr, page_n, lo + nblk, hi, S, h,
                                          sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, PS, BLOCK_N, D, NG, ALIGNED, FRAG, KCH)
        # per-channel keys (KCH): the block's pages' key scales and minimums, one block ahead like the codes; a
        # block is part of one page or NP whole pages
        NP: tl.constexpr = (BLOCK_N + PS - 1) // PS
        if KCH:
            ksc, kmn = _key_channels(km_ptr, bt_ptr, b, sbt_b, lo, hi, S, h, skm_p, skm_h, uperm, PS, D, BLOCK_N)
        page_n = _page_of(bt_ptr, b, sbt_b, lo + BLOCK_N + nblk, hi, S, PS)
        for j0 in range(lo, hi, BLOCK_N):
            kw_n, km_n, vw_n, vm_n = _load_page_block(kc_ptr, km_ptr, vc_ptr, vm_ptr, page_n, j0 + BLOCK_N + nblk,
                                                      hi, S, h, sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, PS, BLOCK_N,
                                                      D, NG, ALIGNED, FRAG, KCH)
            if KCH:
                ksc_n, kmn_n = _key_channels(km_ptr, bt_ptr, b, sbt_b, j0 + BLOCK_N, hi, S, h, skm_p, skm_h, uperm,
                                             PS, D, BLOCK_N)
            page_n = _page_of(bt_ptr, b, sbt_b, j0 + 2 * BLOCK_N + nblk, hi, S, PS)
            j = j0 + nblk
            key_ok = j < hi
            if ABLATE == 2 or ABLATE == 4:  # no key unpacking and dot (4: nothing but the loads)
                s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32) + tl.sum((kw & 1).to(tl.float32), 1)[None, :]
            elif KCH and BLOCK_N > PS:
                s = _dequant_dot_key_pages(qq, kw, ksc, kmn, debias, BLOCK_M, BLOCK_N, NP, D, DT, USE_ASM, DEBIAS,
                                           KFOLD)
            elif KCH:
                s = _dequant_dot_key_channels(qq, kw, ksc, kmn, debias, BLOCK_N, D, DT, USE_ASM, DEBIAS)
            else:
                s = _dequant_dot_keys(qq, qsum, qsq, kw, km, debias, BLOCK_N, D, NG, DT, USE_ASM, DEBIAS)
            s = _visible(s, j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
                         IS_CAUSAL, MASK_KIND)
            p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
            acc = acc * alpha[:, None]
            if ABLATE == 4:
                acc += (tl.sum(tl.sum((vw & 1).to(tl.float32), 1), 0) + tl.sum(tl.sum(vm, 1), 0).to(tl.float32)
                        + tl.sum(tl.sum(km, 1), 0).to(tl.float32)) * 0.0
            elif ABLATE != 1:
                acc = _dequant_dot_values(p, vw, vm, acc, BLOCK_N, D, NG, DT, USE_ASM)
            m_i = m_new
            kw, km, vw, vm = kw_n, km_n, vw_n, vm_n
            if KCH:
                ksc, kmn = ksc_n, kmn_n
    elif REGION == 2:
        # ---------------- the chunk's own keys [max(c0, S), c_end) (prefill; sink positions inside the chunk are read
        # by REGION 1): contiguous rows, the flash-attention loop of _flash_rows
        uperm = dcol
        qc = tl.load(qrow + dcol[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32).to(CDT)
        m_i, l_i, acc = _flash_rows(qc, m_i, l_i, acc, kch_ptr, vch_ptr, b * sch_b + h * sch_h, sch_t, c0,
                                    tl.maximum(c0, S), tl.minimum(c_end, length), row_t, row_pos, row_hq, b, mask_ptr,
                                    smk_b, smk_h, smk_t, smk_j, mask_len, BLOCK_N, D, IS_CAUSAL, MASK_KIND, CDT)
    else:
        # ---------------- BF16 keys: sinks [0, min(S, L)), then [page_end, L) from the ring or the chunk
        uperm = dcol
        qq = tl.load(qrow + dcol[None, :], mask=row_ok[:, None], other=0.0)
        n_sink = tl.minimum(length, S)
        # DENSE_CHUNK (prefill): this loop takes the sinks and the ring keys before the chunk, REGION 2 the chunk
        bf16_end = tl.minimum(c0, length) if DENSE_CHUNK else length
        n_bf16 = n_sink + tl.maximum(bf16_end - page_end, 0)
        u_lo = (split - NSPLIT) * bf16_per_split  # this split's share of the BF16 keys
        u_hi = tl.minimum(u_lo + bf16_per_split, n_bf16)
        if IS_CAUSAL:  # keys past the block's newest query position are never visible: stop there
            j_max = tl.max(tl.where(row_ok, row_pos, -1), 0)
            u_hi = tl.minimum(u_hi, tl.where(j_max < n_sink, j_max + 1, n_sink + tl.maximum(j_max + 1 - page_end, 0)))
        m_first = 0
        m_last = 0
        m_holes = nblk < 0
        if MASK_BOUNDS:  # a bool row every head shares, with its (first, last, one interval) bounds (decode)
            m_first = tl.load(mb_ptr + b * smb_b)
            m_last = tl.load(mb_ptr + b * smb_b + 1)
            m_holes = (nblk * 0 + tl.load(mb_ptr + b * smb_b + 2)) == 0  # a vector: `vector & scalar bool` fails
            # in Triton 3.9's interpreter
        if RING_FP8:  # sinks, FP8 ring rows and the chunk in loops of their own (_fp8_ring_keys)
            m_i, l_i, acc = _fp8_ring_keys(
                qq, m_i, l_i, acc, u_lo, u_hi, n_sink, page_end, c0, c_end, b, h, ks_ptr, vs_ptr, kr_ptr, vr_ptr,
                kch_ptr, vch_ptr, ss_b, ss_t, ss_h, sr_b, sr_t, sr_h, sch_b, sch_t, sch_h, W, row_t, row_pos, row_hq,
                mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len, m_first, m_last, m_holes, BLOCK_N, D, DT, IS_CAUSAL,
                MASK_KIND, MASK_BOUNDS, HAS_CHUNK and not DENSE_CHUNK, SKIP_EMPTY, ALIGNED)
        else:
            for u0 in range(u_lo, u_hi, BLOCK_N):
                u = u0 + nblk
                key_ok = u < u_hi
                j = tl.where(u < n_sink, u, page_end + (u - n_sink))
                vis, bias = _key_visibility(j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t,
                                            smk_j, mask_len, m_first, m_last, m_holes, IS_CAUSAL, MASK_KIND,
                                            MASK_BOUNDS)
                # A block no row sees (the upper triangle of a masked prefill, padding) costs no loads or dots. A
                # decode step sees every block (SKIP_EMPTY off): without the branch the loads can be pipelined.
                run = True
                if SKIP_EMPTY:
                    run = tl.max(tl.max(vis.to(tl.int32), 1), 0) > 0
                if run:
                    in_sink = key_ok & (j < S)
                    in_chunk = key_ok & ~in_sink & (j >= c0) & (j < c_end)
                    in_ring = key_ok & ~in_sink & ~in_chunk
                    if HAS_RING:
                        ring_slot = tl.where(in_ring, j % tl.maximum(W, 1), 0)
                    else:
                        ring_slot = j * 0
                    row_s = b * ss_b + tl.where(in_sink, j, 0) * ss_t + h * ss_h
                    row_r = b * sr_b + ring_slot * sr_t + h * sr_h
                    kb = tl.where(in_sink, ks_ptr + row_s, kr_ptr + row_r)
                    vb = tl.where(in_sink, vs_ptr + row_s, vr_ptr + row_r)
                    if HAS_CHUNK:
                        row_c = b * sch_b + tl.where(in_chunk, j - c0, 0) * sch_t + h * sch_h
                        kb = tl.where(in_chunk, kch_ptr + row_c, kb)
                        vb = tl.where(in_chunk, vch_ptr + row_c, vb)
                    if ALIGNED:  # rows start on 16 bytes (all three buffers): vector loads despite the select
                        kb = tl.multiple_of(kb, 16)
                        vb = tl.multiple_of(vb, 16)
                    # values are issued with the keys, not after the softmax (no change measured on the H200 at
                    # 64 x 4K: the compiler had already hoisted the load). Written out, not _plain_key_block's call:
                    # through the call, sm_90 lost the selected pointers' vector loads (29 -> 141 ld.global) and
                    # spilled 788 bytes at d = 128 (2026-12-07, Triton 3.7's ptxas)
                    k = tl.load(kb[:, None] + dcol[None, :], mask=key_ok[:, None], other=0.0).to(DT)
                    v = tl.load(vb[:, None] + dcol[None, :], mask=key_ok[:, None], other=0.0).to(DT)
                    s = tl.where(vis, tl.dot(qq, tl.trans(k)) + bias, float("-inf"))
                    p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
                    acc = tl.dot(p.to(DT), v, acc * alpha[:, None])
                    m_i = m_new
    _store_state(part_m_ptr, part_l_ptr, part_o_ptr, (pid_bh * M_TOTAL + r) * NS + split, row_ok, m_i, l_i, acc,
                 uperm, D)


@triton.jit
def _flash_rows(qc, m_i, l_i, acc, k_ptr, v_ptr, base, s_t, origin, c_lo, c_hi, row_t, row_pos, row_hq, b, mask_ptr,
                smk_b, smk_h, smk_t, smk_j, mask_len, BLOCK_N: tl.constexpr, D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                MASK_KIND: tl.constexpr, CDT: tl.constexpr, MASK_I32: tl.constexpr = False):
    """Flash attention of query rows ``qc`` over contiguous 16-bit key rows ``j`` in ``[c_lo, c_hi)`` at
    ``k_ptr + base + (j - origin) s_t`` (and ``v_ptr``): the rows' own type on the tensor cores, no conversion and
    no branch in the loop, so the loads go straight to shared memory and pipeline. ``MASK_I32``: the mask's offsets
    within a batch row fit int32 (half the registers of its [M, N] offset tile)."""
    nblk = tl.arange(0, BLOCK_N)
    dcol = tl.arange(0, D)
    c_lo = c_lo.to(tl.int64)
    c_hi = c_hi.to(tl.int64)
    mrow_t = row_t.to(tl.int32) if MASK_I32 else row_t  # the mask's operands: int32 offsets from the row's base
    mask_ptr = mask_ptr + b * smk_b
    mb = 0
    if IS_CAUSAL:
        c_hi = tl.minimum(c_hi, tl.max(row_pos, 0) + 1)
    if MASK_KIND == 3:
        # a bool mask whose every row is one interval of visible keys (causal, sliding window, padding), given as
        # (first, last) a row by _mask_bounds: two compares a key, and the loop runs over the block's union only
        bounds = mask_ptr + row_hq * smk_h + row_t * smk_t
        lo = tl.where(row_pos >= 0, tl.load(bounds), 2**31 - 1).to(tl.int64)
        hi = tl.where(row_pos >= 0, tl.load(bounds + smk_j), -1).to(tl.int64)
        c_lo = tl.maximum(c_lo, tl.min(lo, 0))
        c_hi = tl.minimum(c_hi, tl.max(hi, 0) + 1)
    elif MASK_KIND != 0:
        # The keys a mask leaves visible to these rows (an upper triangle, a sliding window's far past) bound the
        # loop: one pass over the mask tiles (bytes, in L2) instead of a branch around each block's dots.
        first = c_hi
        last = c_lo - 1
        for j0 in range(c_lo, c_hi, BLOCK_N):
            j = j0 + nblk
            vis, _ = _visibility(j.to(tl.int32) if MASK_I32 else j, j < c_hi, mrow_t, row_pos, row_hq, mb, mask_ptr,
                                 smk_b, smk_h, smk_t, smk_j,
                                 mask_len, IS_CAUSAL, MASK_KIND)
            seen = tl.max((vis & (row_pos >= 0)[:, None]).to(tl.int32), 0) > 0
            first = tl.minimum(first, tl.min(tl.where(seen, j, c_hi), 0))
            last = tl.maximum(last, tl.max(tl.where(seen, j, c_lo - 1), 0))
        c_lo = first
        c_hi = last + 1
    for j0 in range(c_lo, c_hi, BLOCK_N):
        j = j0 + nblk
        key_ok = j < c_hi
        row = base + tl.where(key_ok, j - origin, 0) * s_t
        k = tl.load(k_ptr + row[:, None] + dcol[None, :], mask=key_ok[:, None], other=0.0).to(CDT)
        v = tl.load(v_ptr + row[:, None] + dcol[None, :], mask=key_ok[:, None], other=0.0).to(CDT)
        if MASK_KIND == 3:
            vis = key_ok[None, :] & (j[None, :] >= lo[:, None]) & (j[None, :] <= hi[:, None])
            if IS_CAUSAL:
                vis = vis & (j[None, :] <= row_pos[:, None])
            bias = 0.0
        else:
            vis, bias = _visibility(j.to(tl.int32) if MASK_I32 else j, key_ok, mrow_t, row_pos, row_hq, mb, mask_ptr,
                                    smk_b, smk_h, smk_t, smk_j, mask_len, IS_CAUSAL, MASK_KIND)
        vis = vis & (row_pos >= 0)[:, None]
        s = tl.where(vis, tl.dot(qc, tl.trans(k)) + bias, float("-inf"))
        p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
        acc = tl.dot(p.to(CDT), v, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["sp_b", "smk_b", "smk_h", "smk_t", "M_TOTAL", "mask_len"])
def _prefill_kernel(qq_ptr, pos_ptr, sp_b, len_ptr, sl_b, c0_ptr, cend_ptr, kch_ptr, vch_ptr, sch_b, sch_t, sch_h,
                    kp_ptr, vp_ptr, sp2_b, sp2_t, sp2_h, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
                    part_m_ptr, part_l_ptr, part_o_ptr, M_TOTAL, flag_ptr, sf_b, sf_h, sf_t, H: tl.constexpr,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_CHUNK: tl.constexpr, CDT: tl.constexpr,
                    MASK_I32: tl.constexpr = False, TILES: tl.constexpr = 0):
    """A prefill's row block in one launch: the keys before the chunk ``[0, min(c0, L))`` as 16-bit rows gathered by
    :func:`_gather_prefix_kernel` (sinks, dequantized pages, ring), then the chunk's own keys ``[c0, c_end)``; one
    partial state a row (the merge kernel un-rotates it).

    ``TILES``: 0 every row block; 1 only blocks whose mask rows are all one interval (``flag_ptr`` nonzero), 2 only
    the others. A bool mask runs as two launches, 1 with its intervals and 2 key by key, and nothing is read back
    to choose (CUDA-graph capture allows no sync)."""
    pid_bh = tl.program_id(0)
    b, h, r, row_ok, row_t, row_hq, row_pos, length, c0, c_end = _row_block(
        pid_bh, tl.program_id(1), pos_ptr, sp_b, len_ptr, sl_b, c0_ptr, cend_ptr, M_TOTAL, H, G, BLOCK_M, HAS_CHUNK)
    run = True
    if TILES != 0:
        flags = tl.load(flag_ptr + b * sf_b + row_hq * sf_h + row_t * sf_t, mask=row_ok & (row_pos >= 0), other=1)
        # TILES 2 takes the blocks where some row is not one interval (their mask read key by key), 1 the others
        run = (tl.min(flags, 0) == 0) == (TILES == 2)
    if run:
        _prefill_rows(qq_ptr, pid_bh, b, h, r, row_ok, row_t, row_hq, row_pos, length, c0, c_end, kch_ptr, vch_ptr,
                      sch_b, sch_t, sch_h, kp_ptr, vp_ptr, sp2_b, sp2_t, sp2_h, mask_ptr, smk_b, smk_h, smk_t, smk_j,
                      mask_len, part_m_ptr, part_l_ptr, part_o_ptr, M_TOTAL, D, BLOCK_M, BLOCK_N, IS_CAUSAL,
                      MASK_KIND, HAS_CHUNK, CDT, MASK_I32)


@triton.jit
def _prefill_rows(qq_ptr, pid_bh, b, h, r, row_ok, row_t, row_hq, row_pos, length, c0, c_end, kch_ptr, vch_ptr,
                  sch_b, sch_t, sch_h, kp_ptr, vp_ptr, sp2_b, sp2_t, sp2_h, mask_ptr, smk_b, smk_h, smk_t, smk_j,
                  mask_len, part_m_ptr, part_l_ptr, part_o_ptr, M_TOTAL, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_CHUNK: tl.constexpr,
                  CDT: tl.constexpr, MASK_I32: tl.constexpr):
    """The body of :func:`_prefill_kernel` for one row block: prefix rows, then the chunk, then its partial state."""
    dcol = tl.arange(0, D)
    qc = tl.load(qq_ptr + (pid_bh * M_TOTAL + r)[:, None] * D + dcol[None, :], mask=row_ok[:, None],
                 other=0.0).to(tl.float32).to(CDT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    m_i, l_i, acc = _flash_rows(qc, m_i, l_i, acc, kp_ptr, vp_ptr, b * sp2_b + h * sp2_h, sp2_t, 0, c0 * 0,
                                tl.minimum(c0, length), row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t,
                                smk_j, mask_len, BLOCK_N, D, IS_CAUSAL, MASK_KIND, CDT, MASK_I32)
    if HAS_CHUNK:
        m_i, l_i, acc = _flash_rows(qc, m_i, l_i, acc, kch_ptr, vch_ptr, b * sch_b + h * sch_h, sch_t, c0, c0,
                                    tl.minimum(c_end, length), row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h,
                                    smk_t, smk_j, mask_len, BLOCK_N, D, IS_CAUSAL, MASK_KIND, CDT, MASK_I32)
    _store_state(part_m_ptr, part_l_ptr, part_o_ptr, pid_bh * M_TOTAL + r, row_ok, m_i, l_i, acc, dcol, D)  # one a row


@triton.jit(do_not_specialize=["L", "s_row"])
def _mask_rows_kernel(mask_ptr, s_row, out_ptr, L, BLOCK: tl.constexpr):
    _row_bounds(mask_ptr, s_row, out_ptr, tl.program_id(0), L, BLOCK)


@triton.jit
def _row_bounds(mask_ptr, s_row, out_ptr, row, L, BLOCK: tl.constexpr):
    """First and last visible key of one bool mask row, and whether every key between them is visible."""
    row = row.to(tl.int64)
    first = L
    last = -1
    count = 0
    for j0 in range(0, L, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = tl.load(mask_ptr + row * s_row + j, mask=j < L, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(m, j, L), 0))
        last = tl.maximum(last, tl.max(tl.where(m, j, -1), 0))
        count += tl.sum(m.to(tl.int32), 0)
    tl.store(out_ptr + 3 * row, first)
    tl.store(out_ptr + 3 * row + 1, last)
    tl.store(out_ptr + 3 * row + 2, (count == 0) | (count == last - first + 1))


def _mask_bounds(mask4: torch.Tensor) -> torch.Tensor:
    """``(first, last, one_interval)`` of every row of a bool (uint8) mask ``[b, h, t, L]`` as int32 ``[b, h, t, 3]``:
    its first and last visible key, and whether every key between them is visible. One pass over the mask, nothing
    read back (the fused prefill launches once for blocks of interval rows and once for the rest)."""
    lead, n = mask4.shape[:-1], mask4.shape[-1]
    rows = _mask_rows(mask4)
    out = torch.empty(rows.shape[0], 3, dtype=torch.int32, device=mask4.device)
    if rows.shape[0]:
        block = _mask_block(n)
        _mask_rows_kernel[(rows.shape[0],)](rows, rows.stride(0), out, n, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out.reshape(*lead, 3)


def _mask_rows(mask4: torch.Tensor) -> torch.Tensor:
    """A uint8 mask ``[..., L]`` as ``[R, L]`` rows of unit stride (a view where it can be: a broadcast row keeps
    stride 0), what the bounds programs read."""
    rows = mask4.reshape(-1, mask4.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _mask_block(n: int) -> int:
    """Bytes of a mask row a bounds program reads a step: few wide steps (a decode step reads the row once a layer,
    and 1 KB steps made it ~1 ms of a 36 ms step at 93 rows x 32K)."""
    return min(8192, max(1024, triton.next_power_of_2(n)))


@triton.jit(do_not_specialize=["sbt_b", "S", "W", "P"])
def _gather_prefix_kernel(len_ptr, sl_b, c0_ptr, kc_ptr, km_ptr, vc_ptr, vm_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr,
                          bt_ptr, sbt_b, sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, ss_b, ss_t, ss_h, sr_b, sr_t, sr_h,
                          ko_ptr, vo_ptr, so_b, so_t, so_h, S, W, P, skm_p, skm_h, H: tl.constexpr, D: tl.constexpr,
                          NG: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CHUNK: tl.constexpr,
                          ALIGNED: tl.constexpr, FRAG: tl.constexpr, KCH: tl.constexpr = False,
                          RING_FP8: tl.constexpr = False):
    """The keys and values of row ``b``, KV head ``h`` before its chunk, ``[0, min(c0, L))``, as 16-bit rows
    ``[B, P, H, D]`` in channel order: sinks and ring rows copied, page rows dequantized (``min + code * scale`` in
    fp32, as the page kernels compute them) and rounded once to the scratch's type. ``sm_*``: the values' metadata
    strides; ``skm_*`` the keys' where they are per channel (``KCH``: one (scale, min) per channel and page)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    length = tl.load(len_ptr + b * sl_b).to(tl.int64)
    c0 = tl.load(c0_ptr + b).to(tl.int64) if HAS_CHUNK else length
    prefix_end = tl.minimum(tl.minimum(c0, length), P)
    page_end = _page_end(length, c0, S, W, PS, KCH)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if tl.program_id(1) * BLOCK_N < prefix_end:
        dcol = tl.arange(0, D)
        row = b * so_b + tl.where(j < prefix_end, j, 0) * so_t + h * so_h
        in_page = (j >= S) & (j < tl.minimum(page_end, prefix_end))
        if tl.max(in_page.to(tl.int32), 0) > 0:
            jp = tl.where(in_page, j, S)  # keys outside the page region read (and then drop) the first page slot
            page = _page_of(bt_ptr, b, sbt_b, jp, page_end, S, PS)
            kw, km, vw, vm = _load_page_block(kc_ptr, km_ptr, vc_ptr, vm_ptr, page, jp, page_end,
                                              S, h, sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, PS, BLOCK_N, D, NG, ALIGNED,
                                              FRAG, KCH)
            chan = _channel_of(dcol, D, FRAG)
            if KCH:  # each key's page's (scale, min) per channel, in the unpacked order of its codes
                kmeta = km_ptr + page[:, None] * skm_p + h * skm_h + chan[None, :]
                km = tl.join(tl.load(kmeta, mask=in_page[:, None], other=0.0),
                             tl.load(kmeta + D, mask=in_page[:, None], other=0.0))
                _dequant_store(kw, km, ko_ptr + row[:, None] + chan[None, :], in_page[:, None], BLOCK_N, D, 0)
            else:
                _dequant_store(kw, km, ko_ptr + row[:, None] + chan[None, :], in_page[:, None], BLOCK_N, D, NG)
            _dequant_store(vw, vm, vo_ptr + row[:, None] + chan[None, :], in_page[:, None], BLOCK_N, D, NG)
        in_sink = j < tl.minimum(S, prefix_end)
        in_ring = (j >= S) & (j >= page_end) & (j < prefix_end)
        plain = in_sink | in_ring
        if tl.max(plain.to(tl.int32), 0) > 0:
            src_s = b * ss_b + tl.where(in_sink, j, 0) * ss_t + h * ss_h
            src_r = b * sr_b + tl.where(in_ring, j % tl.maximum(W, 1), 0) * sr_t + h * sr_h
            ks = tl.load(ks_ptr + src_s[:, None] + dcol[None, :], mask=in_sink[:, None], other=0.0)
            vs = tl.load(vs_ptr + src_s[:, None] + dcol[None, :], mask=in_sink[:, None], other=0.0)
            if RING_FP8:  # FP8 rows with a scale each (fp8_ring.py)
                kr = load_fp8_rows(kr_ptr + src_r, in_ring, D)
                vr = load_fp8_rows(vr_ptr + src_r, in_ring, D)
            else:
                kr = tl.load(kr_ptr + src_r[:, None] + dcol[None, :], mask=in_ring[:, None], other=0.0)
                vr = tl.load(vr_ptr + src_r[:, None] + dcol[None, :], mask=in_ring[:, None], other=0.0)
            kx = tl.where(in_sink[:, None], ks.to(tl.float32), kr.to(tl.float32))
            vx = tl.where(in_sink[:, None], vs.to(tl.float32), vr.to(tl.float32))
            tl.store(ko_ptr + row[:, None] + dcol[None, :], kx.to(ko_ptr.dtype.element_ty), mask=plain[:, None])
            tl.store(vo_ptr + row[:, None] + dcol[None, :], vx.to(vo_ptr.dtype.element_ty), mask=plain[:, None])


@triton.jit
def _dequant_store(words, meta, ptrs, ok, BLOCK_N: tl.constexpr, D: tl.constexpr, NG: tl.constexpr):
    codes = _unpack_words(words, BLOCK_N, D, tl.float32, False)  # exact 0..3 in fp32
    sc, mn = _meta(meta)
    if NG == 1:
        x = codes * sc[:, None] + mn[:, None]
    else:
        x = codes * sc + mn
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["sp_b", "M_TOTAL", "ROWS", "NS"])
def _merge_kernel(part_m_ptr, part_l_ptr, part_o_ptr, bo_ptr, muv_ptr, out_ptr, so_b, so_h, so_t, pos_ptr, sp_b,
                  M_TOTAL, ROWS, NS, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, KC: tl.constexpr, SB: tl.constexpr):
    """Combine the splits' partial softmax states of ``BLOCK_M`` rows, un-rotate and write the output.

    Rows are those of one KV head across batch rows, as in :func:`_query_kernel` (``B_o`` is read once
    for 16 rows, not for a decode step's 4). Splits are read ``SB`` at a time (``[BLOCK_M, SB, D]``
    tiles): a batch-1 decode has ~70 splits, and one load round trip per split cost 34 us of 207 at
    1 x 128K on the H200 (25 us in tiles)."""
    h = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < ROWS
    i = tl.where(row_ok, i, 0)
    b = (i // M_TOTAL).to(tl.int64)  # the output may pass 2^31 elements
    r = i % M_TOTAL
    # the partial states are bounded by the launcher's temporary budget: int32 offsets
    rbase = (((i // M_TOTAL) * H + h) * M_TOTAL + r) * NS
    # No reductions inside the loops (accumulate elementwise, reduce once after): Triton 3.6 asserts in
    # OptimizeThreadLocality on a loop-carried reduction over a 3-D tile (d = 64).
    sb = tl.arange(0, 64)
    m_run = tl.full([BLOCK_M, 64], float("-inf"), tl.float32)
    for s0 in range(0, NS, 64):
        ok = row_ok[:, None] & (s0 + sb < NS)[None, :]
        m_run = tl.maximum(m_run, tl.load(part_m_ptr + rbase[:, None] + s0 + sb[None, :], mask=ok, other=float("-inf")))
    m_max = tl.max(m_run, 1)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    dcol = tl.arange(0, D)
    si = tl.arange(0, SB)
    o3 = tl.zeros([BLOCK_M, SB, D], tl.float32)
    den2 = tl.zeros([BLOCK_M, SB], tl.float32)
    for s0 in range(0, NS, SB):
        ok = row_ok[:, None] & (s0 + si < NS)[None, :]
        idx = rbase[:, None] + s0 + si[None, :]  # [BLOCK_M, SB]
        m_s = tl.load(part_m_ptr + idx, mask=ok, other=float("-inf"))
        w_s = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_safe[:, None]))
        den2 += w_s * tl.load(part_l_ptr + idx, mask=ok, other=0.0)
        o3 += tl.load(part_o_ptr + idx[:, :, None] * D + dcol[None, None, :], mask=ok[:, :, None], other=0.0) * w_s[:, :, None]
    o = tl.sum(o3, 1)
    denom = tl.sum(den2, 1)
    row_t = r // G
    pos = tl.load(pos_ptr + b * sp_b + row_t, mask=row_ok, other=-1)
    # zeros for padding and rows that see no key; a NaN row (non-finite keys/values) stays NaN, as in BF16 attention
    has = ((denom > 0) | (denom != denom)) & (pos >= 0)
    o = o / tl.where(has, denom, 1.0)[:, None]
    # un-rotate: o' @ B_o, blocked over KC input channels (staged through a scratch row of part_o)
    scratch = part_o_ptr + rbase * D  # this row's split-0 slot, already consumed above
    tl.debug_barrier()
    tl.store(scratch[:, None] + dcol[None, :], o, mask=row_ok[:, None])
    tl.debug_barrier()
    out = _rowmajor_matmul(part_o_ptr, rbase * D, row_ok, bo_ptr + h * D * D, BLOCK_M, D, KC)
    out = out + tl.load(muv_ptr + h * D + dcol)[None, :]
    out = tl.where(has[:, None], out, 0.0)
    row_hq = h * G + r % G
    optr = out_ptr + (b * so_b + row_hq * so_h + row_t * so_t)[:, None] + dcol[None, :]
    tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# "asm": PTX magic-number unpacking; "ops": shifts, masks and conversions. Read once, not per call.
DEFAULT_UNPACK = os.environ.get("OSCAR_TRITON_UNPACK", "asm")
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs no PTX: plain shifts instead


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Decode steps with at least this many (row, KV head) programs read a bool mask shared by every head as its rows'
# bounds (None: the SM count); tests lower it to take that path at small sizes.
MASK_BOUNDS_MIN_PROGRAMS: int | None = None


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 off the GPU: the interpreter's split heuristics)."""
    return _num_sms(device.index or 0) if device.type == "cuda" and torch.cuda.is_available() else 8


def _aligned16(*tensors: torch.Tensor) -> bool:
    """Every row (last dim, contiguous) starts on a 16-byte boundary: lets the compiler use 16-byte loads."""
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1
               and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


def _as_words(codes: torch.Tensor) -> torch.Tensor:
    """The uint8 code pool seen as int32 words (4 bytes each): word loads instead of byte loads."""
    try:
        return codes.view(torch.int32)
    except RuntimeError as e:
        raise ValueError(f"oscar: the Triton attention needs code pools whose rows are whole 4-byte words "
                         f"(got shape {tuple(codes.shape)}, strides {codes.stride()}): {e}") from None


def num_splits(batch: int, kv_heads: int, m_blocks: int, page_keys: int, block_n: int, sms: int) -> int:
    """Splits of the Triton page region so that even one long sequence fills the GPU's ``sms`` SMs (from
    shapes only; the Gluon kernel's are :meth:`GluonConfig.splits`)."""
    base = max(1, batch * kv_heads * m_blocks)
    # About two programs per SM (two fit at ~250 registers). Four, the earlier choice, measured slower on
    # the H200 (results/decode_attention_h200_probe.json, half the splits: 1 x 128K 181 vs 207 us,
    # 1 x 32K 80 vs 87, 32 x 32K 1101 vs 1111, 64 x 4K 348 vs 344).
    want = -(-2 * sms // base)
    most = max(1, -(-page_keys // (4 * block_n)))  # at least four key blocks per split
    return int(max(1, min(want, most, 128)))


def page_region_warps(batch: int, kv_heads: int, page_m_blocks: int, page_m: int, device, key_pages: bool = False) -> int:
    """Warps of a page-region program. 2 when decode rows (<= 16 a program) already give every SM a
    program without splitting: 4 programs of 2 warps fit an SM where 2 of 4 do, so more key blocks are
    in flight (H200: 32 x 32K 946 vs 1109 us, 32 x 8K 280 vs 309, 64 x 4K 293 vs 330). 4 otherwise: at
    batch 1 the splits are short and 2 warps were slower (1 x 128K 191 vs 166 us), and 32-row prefill
    blocks spill with 2 warps. ``key_pages`` (per-channel keys, 4+ pages a block): 4, 2 spill (sm_90 ptxas: 255
    registers and 512 bytes of spills for blocks of 4 pages of 32 at d = 128, none with 4 warps). Blocks of 2 pages
    keep 2 warps where rows fill the GPU (H100, 32 x 8K: 409 us, 4 warps 511)."""
    return 2 if page_m <= 16 and not key_pages and batch * kv_heads * page_m_blocks >= _sm_count(device) else 4


# Bytes of the temporaries one launch group may hold (the rotated queries and the splits' partial
# softmax states, [rows x splits x d] fp32). A long prompt is processed in query tiles that fit: without
# this bound the partials of a 64 x 8K prefill were ~34 GB and their int32 offsets overflowed (H200).
TEMP_BYTES_BUDGET = 256 * 2**20


@dataclass(frozen=True)
class AttentionPlan:
    """How one ``oscar::attention`` call is cut into launches (from shapes only: nothing is read back).

    Query tokens are processed ``tile_tokens`` at a time; within a tile, ``m_total = G * tile_tokens``
    query rows per (row, KV head) in blocks of ``block_m`` (``page_m`` for the page region), the page
    region in ``nsplit`` key splits and the BF16 keys in ``nb`` splits of their own.
    """

    tile_tokens: int
    m_total: int
    block_m: int
    m_blocks: int
    page_m: int
    page_m_blocks: int
    block_n: int
    nsplit: int
    keys_per_split: int
    bf16_per_split: int
    nb: int
    temp_bytes: int  # what one tile allocates (qq + partial states)
    page_kernel: str = "triton"  # which kernel reads the INT2 pages: "gluon" (decode, gluon_decode.py), "triton" or "none"
    gluon: GluonConfig | None = None  # the Gluon kernel's launch shape (page_kernel "gluon")
    nc: int = 0  # 1: the chunk's own keys in a launch of their own (REGION 2, prefill), with the last partial state

    @property
    def ns(self) -> int:
        return self.nsplit + self.nb + self.nc


BF16_BLOCK_N = 64
# Per-channel keys: keys a block of the page region by head_dim, (few programs, programs filling the GPU): several
# whole pages (:func:`_dequant_dot_key_pages`) or part of one; None: one page a block. H100, d = 128, pages of 32
# (decode_attention_h100_key_formats_blocks.json): blocks of 4 pages beat 1 page at batch 1 (1 x 128K 224 vs 326 us) but
# spilled at batch 32 with the 2-warp programs, where 2 pages were best (32 x 8K 409 vs 489 vs 516 us). (The Gluon
# kernel reads decode steps' pages of 32+: this serves prefill, pages of 16 and debiased scores.)
CHANNEL_BLOCK_N: dict[int, tuple[int, int]] | None = {64: (128, 128), 128: (128, 64), 256: (64, 64)}


@dataclass(frozen=True)
class GluonConfig:
    """Launch shape of the Gluon decode kernel: warps a program, 16-key tiles a warp and block, code
    blocks in flight (1: registers, one block ahead; 2/4/8: a cp.async ring in shared memory), and
    about how many programs an SM gets (the split count)."""

    warps: int = 1
    tiles: int = 1
    stages: int = 2
    per_sm: int = 16

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8) or self.tiles not in (1, 2, 4) or self.stages not in (1, 2, 4, 8) \
                or self.per_sm < 1:
            raise ValueError(f"oscar: Gluon launch shape {self}: warps 1/2/4/8, tiles 1/2/4, stages 1 (registers) or "
                             "2/4/8 (a power of two: the shared-memory ring), per_sm >= 1")

    @property
    def keys_per_block(self) -> int:
        return self.warps * self.tiles * 16

    def splits(self, programs: int, page_keys: int, sms: int) -> int:
        """Splits of each of ``programs`` (rows x KV heads): as many as fill every SM's ``per_sm`` slots in
        one wave (rounding up would start a second, nearly empty wave: 9 splits at 32 x 32K took 364 us
        where 8 took 307), at least four blocks a split, at most 128 (the merge reads them all)."""
        most = max(1, page_keys // (4 * self.keys_per_block))
        return int(max(1, min(self.per_sm * sms // max(1, programs), most, 128)))


# H200 (results/gluon_decode_h200_pipeline.json, gluon_decode_h200_budget.json): one-warp programs (their softmax
# state is rescaled only when a running max grows), codes two blocks deep through shared memory. Two 16-key tiles a
# block (two independent MMA chains a warp) and ~12 programs an SM: the kernel alone, 93 x 32K 831 us against 922
# with one tile and ~16 an SM, 319 x 8K 681 against 797, 32 x 32K 289 against 307, 32 x 8K 81 against 84. Four
# tiles were 2-4% faster alone but in the model took 44.4 ms of a 32K decode step against 32.2 (measured while the
# bool mask was still read a key and head; 183 registers against 148 with this Triton's ptxas, not the device's).
# But at batch 1 ~12 an SM means ~128 splits, and merging them cost 20 us of 93 at
# 1 x 128K (results/decode_attention_h200.json): fewer rows x KV heads than SMs take 4-warp programs.
GLUON_WIDE = GluonConfig(warps=1, tiles=2, stages=2, per_sm=12)
GLUON_NARROW = GluonConfig(warps=4, tiles=1, stages=1, per_sm=4)
# Per-channel keys: the page-scaled query takes registers (234 against 156 with sm_90 ptxas): 8 one-warp programs fit
# an SM, not 12
GLUON_WIDE_KEY_CHANNEL = GluonConfig(warps=1, tiles=2, stages=2, per_sm=8)
# OSCAR_GLUON_CONFIG='{"warps": 2, ...}' forces one launch shape for every call (benchmarks, profiling; read once).
GLUON = GluonConfig(**json.loads(os.environ["OSCAR_GLUON_CONFIG"])) if os.environ.get("OSCAR_GLUON_CONFIG") else None


def gluon_config(programs: int, sms: int, key_channel: bool = False) -> GluonConfig:
    """The Gluon kernel's launch shape for ``programs`` (rows x KV heads) on ``sms`` SMs."""
    return GLUON or ((GLUON_WIDE_KEY_CHANNEL if key_channel else GLUON_WIDE) if programs >= sms else GLUON_NARROW)


# "auto": the Gluon kernel for the decode steps it takes, else "triton" everywhere (read once).
PAGE_KERNEL = os.environ.get("OSCAR_PAGE_KERNEL", "auto")
# The Gluon kernel reads per-channel keys in pages of 32+ (each warp's B operand the query scaled by its page's scale)
# unless OSCAR_GLUON_KEY_CHANNEL=0 (read once). H100, d = 128, pages of 32 (results/decode_attention_h100_channel_gluon
# .json): 1 x 128K 122 us against 199-325 for the Triton page kernel and 189 for BF16; 32 x 8K 143 against 497-603 and
# 361; 32 x 32K 421 against 1855-2257 and 1379.
GLUON_KEY_CHANNEL = os.environ.get("OSCAR_GLUON_KEY_CHANNEL", "1") == "1"


@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=1)
def _gluon_decode():
    """The Gluon module, or None where this Triton has no Gluon (the Triton kernel then reads the pages)."""
    try:
        from . import gluon_decode
        return gluon_decode
    except Exception as e:  # an older Triton: no triton.experimental.gluon, or a different API
        log.info("oscar: Gluon decode kernel unavailable (%s: %s); the Triton kernel reads the pages", type(e).__name__, e)
        return None


def choose_page_kernel(q, geo, k_codes, k_meta, t: int, mask_kind: int, dot_dtype, want: str | None = None) -> str:
    """``"gluon"`` where the Gluon decode kernel takes this call (fragment-ordered pages, head_dim 64/128/256, a GQA
    group of at most 8, one (scale, min) fp16 pair a row, one query token, no additive mask, sm_80+), else ``"triton"``."""
    want = want or PAGE_KERNEL
    if want == "triton" or q.device.type != "cuda" or _INTERPRET:
        return "triton"
    reasons = [why for bad, why in (
        (not fragment_order.in_fragment_order(k_codes), "pages not in fragment order"),
        (geo.head_dim not in (64, 128, 256), f"head_dim {geo.head_dim}"),
        (q.shape[1] // geo.num_kv_heads > 8, "GQA group > 8"),
        (geo.key_channel and not GLUON_KEY_CHANNEL, "per-channel keys (OSCAR_GLUON_KEY_CHANNEL off)"),
        (geo.key_channel and geo.page_size < 32, "per-channel keys in pages under 32"),  # a warp's 2 tiles: one page
        (geo.num_groups != 1 or k_meta.dtype != torch.float16, "metadata not one fp16 pair a row"),
        (mask_kind == 2, "additive mask"),
        (t != 1, "more than one query token"),
        (dot_dtype != torch.float16, "bf16 dot"),
        (_capability(q.device.index or 0) < (8, 0), "GPU older than sm_80"),
    ) if bad]
    if not reasons and _gluon_decode() is None:
        reasons.append("no Gluon in this Triton")
    if reasons:
        if want == "gluon" and reasons != ["more than one query token"]:  # forced: prefill still takes Triton
            raise ValueError(f"oscar: the Gluon decode kernel does not take this call: {', '.join(reasons)}")
        _log_choice("triton", tuple(reasons))
        return "triton"
    _log_choice("gluon", ())
    return "gluon"


@functools.lru_cache(maxsize=64)
def _log_choice(kernel: str, reasons: tuple) -> None:
    log.info("oscar: INT2 page region of decode steps read by the %s kernel%s", kernel,
             f" ({', '.join(reasons)})" if reasons else "")


def _plan_tile(b: int, h: int, g: int, tq: int, chunk_len: int, d: int, geo, sms: int, block_n: int,
               splits: int | None, page_kernel: str = "triton", fused: bool = False) -> AttentionPlan:
    m_total = g * tq
    block_m = 16 if m_total <= 16 else (32 if m_total <= 32 else 64)
    m_blocks = triton.cdiv(m_total, block_m)
    # The page region takes at most 32 query rows a program: with 64 the unpacked codes become a wgmma
    # operand whose shared layout Triton 3.6/3.7 reject for d = 64 ("Illegal shared layout"), and d = 128
    # spills. Each launch indexes the partial state by query row, so the two regions may block rows differently.
    page_m = min(block_m, 32)
    page_m_blocks = triton.cdiv(m_total, page_m)
    page_keys = geo.max_pages * geo.page_size
    # Query blocks alone fill the GPU (prefill): splitting the keys would only add partial states to merge.
    filled = b * h * m_blocks >= 2 * sms
    # A prefill chunk's own keys (contiguous rows) get a flash-attention launch of their own (REGION 2); the BF16
    # launch then reads only the sinks and the ring (gathered rows)
    nc = 1 if filled and not splits and chunk_len >= 16 else 0
    bf16_keys = max(1, geo.num_sinks + geo.window + (0 if nc else chunk_len))  # sinks, ring and the new chunk
    page_kernel = page_kernel if tq == 1 else "triton"  # the Gluon kernel takes one query token a row
    gluon = gluon_config(b * h, sms, geo.key_channel) if page_kernel == "gluon" else None
    if geo.drops_evicted:  # no pages (a sliding-window layer's ring-only storage): no page region at all
        nsplit, gluon, page_kernel = 0, None, "none"
    elif splits:
        nsplit = int(splits)
    elif gluon is not None:
        nsplit = gluon.splits(b * h, page_keys, sms)
    elif filled:
        nsplit = 1
    else:
        nsplit = num_splits(b, h, page_m_blocks, page_keys, block_n, sms)
    unit = gluon.keys_per_block if gluon is not None else block_n  # whole blocks a split
    if geo.key_channel:  # whole pages a split, whole blocks a page or whole pages a block (both powers of two)
        unit = max(unit, geo.page_size)
    keys_per_split = triton.cdiv(triton.cdiv(page_keys, max(nsplit, 1)), unit) * unit
    if filled and not splits:
        bf16_per_split = triton.cdiv(bf16_keys, BF16_BLOCK_N) * BF16_BLOCK_N
    else:
        # The BF16 keys get splits of their own, each about as many bytes as a page split (a BF16 key is ~7x
        # an INT2 one), so at short contexts they are not the tail. At small batch that is too few programs
        # (8 at batch 1: latency-bound), so also aim for ~2 per SM.
        fill = triton.cdiv(bf16_keys, max(1, 2 * sms // (b * h * m_blocks)))
        # A cache whose ring holds more keys than its pages (a BF16 companion holding every token: its one page is
        # never filled) is all BF16 keys: split them only to fill the GPU, or its 4K keys take 65 splits to merge.
        ring_bound = geo.num_sinks + geo.window >= page_keys
        per_page_split = max(keys_per_split // 7, 1) if nsplit and not ring_bound else fill
        bf16_per_split = triton.cdiv(min(per_page_split, fill), BF16_BLOCK_N) * BF16_BLOCK_N
    nb = triton.cdiv(bf16_keys, bf16_per_split)
    rows = b * h * m_total
    if fused:  # the fused prefill (_prefill_kernel): one launch, one partial state a row
        nsplit, nb, nc, page_kernel, gluon = 0, 0, 1, "none", None
    temp = rows * d * 2 + rows * (nsplit + nb + nc) * (d + 2) * 4  # qq (fp16) + partial o, m, l (fp32)
    return AttentionPlan(tq, m_total, block_m, m_blocks, page_m, page_m_blocks, block_n, nsplit, keys_per_split,
                         bf16_per_split, nb, temp, page_kernel, gluon, nc)


def channel_block_n(b: int, h: int, g: int, t: int, d: int, page: int, sms: int) -> int:
    """Keys a block of the page region reads with per-channel keys. A decode step: several whole pages
    (:data:`CHANNEL_BLOCK_N`, by whether its ``b x h`` programs fill the ``sms`` SMs; None: one page). A prefill
    tile: within one page, as before blocks of pages (a prefill's 32-row blocks of 4 pages of 32 spill 476 bytes at
    d = 128, sm_90 ptxas)."""
    if CHANNEL_BLOCK_N is None:
        return page
    if t != 1:
        return min(64 if d > 128 else 128, page)
    few, many = CHANNEL_BLOCK_N.get(d, (page, page))
    return few if b * h * triton.cdiv(g, 16) < sms else many


def plan_attention(b: int, hq: int, t: int, geo, device, block_n: int | None = None, splits: int | None = None,
                   budget: int = TEMP_BYTES_BUDGET, chunk_len: int | None = None,
                   page_kernel: str = "triton", fused: bool = False) -> AttentionPlan:
    """The launch plan of an attention call with ``b`` rows of ``t`` query tokens of ``hq`` heads.

    Temporaries stay within ``budget`` bytes whatever ``b x t``: a prompt whose partial states would not
    fit is processed in query tiles (a decode step, one token a row, is one tile up to huge batches).
    """
    h, d = geo.num_kv_heads, geo.head_dim
    g = hq // h
    sms = _sm_count(device) if isinstance(device, torch.device) else int(device)
    if geo.key_channel and not block_n:
        block_n = channel_block_n(b, h, g, t, d, geo.page_size, sms)
    block_n = block_n or (64 if d > 128 else 128)
    chunk_len = t if chunk_len is None else chunk_len
    tq = max(t, 1)
    plan = _plan_tile(b, h, g, tq, chunk_len, d, geo, sms, block_n, splits, page_kernel, fused)
    for _ in range(8):  # shrinking a tile can add splits (fewer rows): re-plan until it fits
        if plan.temp_bytes <= budget or tq == 1:
            break
        tq = max(1, min(tq - 1, tq * budget // plan.temp_bytes))
        if tq > 16:
            tq -= tq % 16  # whole 64-row blocks at GQA 4
        plan = _plan_tile(b, h, g, tq, chunk_len, d, geo, sms, block_n, splits, page_kernel, fused)
    if plan.temp_bytes > budget and tq > 1:  # pragma: no cover - the loop converges in 2-3 steps
        raise RuntimeError(f"oscar: no query tile of {b} x {hq} heads fits {budget} bytes of temporaries")
    return plan


def plan_tiles(b: int, hq: int, t: int, geo, device, block_n: int | None = None, splits: int | None = None,
               budget: int = TEMP_BYTES_BUDGET, chunk_len: int | None = None,
               page_kernel: str = "triton", fused: bool = False) -> list[tuple[int, AttentionPlan]]:
    """``(first query token, plan)`` of every query tile of a call: whole tiles of the first plan, then the
    rest planned for its own size (it may split its keys differently)."""
    plan = plan_attention(b, hq, t, geo, device, block_n, splits, budget, chunk_len, page_kernel, fused)
    tiles, t0 = [], 0
    while t0 < t:
        tile = plan if t - t0 >= plan.tile_tokens else plan_attention(b, hq, t - t0, geo, device, block_n, splits,
                                                                     budget, chunk_len, page_kernel, fused)
        tiles.append((t0, tile))
        t0 += tile.tile_tokens
    return tiles


def attention_triton(q, positions, seq_lens, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring,
                     block_table, query_transform, output_transform, value_mean, attn_mask, is_causal, scale,
                     k_chunk=None, v_chunk=None, chunk_positions=None, debias: float = 0.0, block_n: int | None = None,
                     splits: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                     dot_dtype: torch.dtype = torch.float16, ablate: int = 0, unpack: str | None = None,
                     maxnreg: int | None = None, page_warps: int | None = None, bf16_warps: int | None = None,
                     temp_budget: int = TEMP_BYTES_BUDGET, page_kernel: str | None = None,
                     dense_chunk: bool | None = None, chunk_block_m: int | None = None, chunk_warps: int | None = None,
                     gather_prefix: bool | None = None, bf16_splits: int | None = None, channel_fold: bool = True):
    """Triton ``oscar::attention`` (same arguments and result as :func:`attention_reference`).

    ``page_kernel``: ``"gluon"``, ``"triton"`` or None (:data:`PAGE_KERNEL`, by default the Gluon decode
    kernel wherever it takes the call, :func:`choose_page_kernel`). The other options tune the Triton kernel.

    The chunk, when given, must be the row's newest tokens (what ``store`` just returned).
    """
    cache = (k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table)
    geo = check_attention(q, positions, seq_lens, cache, query_transform, output_transform, value_mean, attn_mask,
                          scale, k_chunk, v_chunk, chunk_positions, debias)
    b, hq, t, d = q.shape
    if geo.key_channel and not channel_pages_supported(geo.page_size):
        raise ValueError(f"oscar: the Triton attention reads per-channel keys in pages of 16, 32, 64, ... tokens (a "
                         f"block of keys is one page's), got pages of {geo.page_size}")
    h = geo.num_kv_heads
    g = hq // h
    dev = q.device
    out = torch.empty(b, hq, t, d, dtype=q.dtype, device=dev)
    if b == 0 or t == 0:
        return out
    pos = positions.expand(b, t) if positions.dim() == 1 else positions
    lens = seq_lens.expand(b) if seq_lens.numel() == 1 else seq_lens
    # A decode step's chunk is its new token, which the store also wrote to the ring (or a sink): read there, the
    # BF16 launch drops the chunk's pointer selects and the call the reductions that find the chunk's bounds (four
    # small launches a layer). Forced chunk modes (dense_chunk) keep it.
    # An FP8 ring holds the token rounded: it is read from the chunk, exactly, as the reference reads it.
    ring_chunk = (k_chunk is not None and t == 1 and geo.window > 0 and dense_chunk is None and not ablate
                  and not geo.ring_fp8)
    LAST_LAUNCH["chunk_from_ring"] = ring_chunk
    if ring_chunk:
        k_chunk = v_chunk = chunk_positions = None
    has_chunk = k_chunk is not None
    chunk_len = k_chunk.shape[1] if has_chunk else 0
    if attn_mask is not None:
        mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        mask_kind = 1 if mask.dtype == torch.bool else 2
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)  # same bytes, any strides: never materialise a broadcast mask
        mask_rows = mask  # before broadcasting: what _mask_bounds reads
        mask = mask.expand(b, hq, t, mask.shape[-1])  # stride 0 where it broadcasts
        mask_len = mask.shape[-1]
    else:
        mask, mask_kind, mask_len = None, 0, 0
    key_mask = None  # the bool mask itself, where the fused prefill reads it as intervals (mask_kind 3)
    kernel = "triton" if ablate or debias > 0 else choose_page_kernel(q, geo, k_codes, k_meta, t, mask_kind, dot_dtype,
                                                                       page_kernel)  # Gluon: no debias
    tiles = plan_tiles(b, hq, t, geo, dev, block_n, splits, temp_budget, chunk_len=chunk_len, page_kernel=kernel)
    if dense_chunk is not None and has_chunk and not ablate:  # forced either way (tests, measurements)
        every = triton.cdiv(geo.num_sinks + geo.window + (0 if dense_chunk else chunk_len), BF16_BLOCK_N) * BF16_BLOCK_N
        tiles = [(t0, p if p.nc == int(dense_chunk) else
                  dataclasses.replace(p, bf16_per_split=every, nb=1, nc=int(dense_chunk))) for t0, p in tiles]
    if bf16_splits and not ablate:  # forced (measurements): the sinks, ring and chunk keys in this many splits
        tiles = [(t0, dataclasses.replace(
            p, nb=bf16_splits, bf16_per_split=triton.cdiv(triton.cdiv(max(1, geo.num_sinks + geo.window + chunk_len),
                                                                      bf16_splits), BF16_BLOCK_N) * BF16_BLOCK_N))
                 for t0, p in tiles]
    LAST_LAUNCH["plan"] = tiles[0][1]
    if has_chunk:
        cpos = positions_with_history(chunk_positions, b, chunk_len)  # with the window before it (no pages)
        c0 = torch.where(cpos >= 0, cpos, torch.iinfo(cpos.dtype).max).amin(-1)
        c_end = cpos.amax(-1) + 1
        kch, vch = k_chunk, v_chunk
    else:
        c0 = c_end = lens
        kch, vch = k_sink, v_sink  # unused
    # Tensor-core operands: fp16 (codes 0..3 are exact, q' and P keep 11 bits; BF16 cache rows convert
    # exactly within fp16's range). bf16 keeps range for caches with |x| > 65504, at 8 bits.
    kw, vw = _as_words(k_codes), _as_words(v_codes)
    use_asm = (unpack or DEFAULT_UNPACK) == "asm" and dev.type == "cuda" and not _INTERPRET
    dt = tl.bfloat16 if dot_dtype == torch.bfloat16 else tl.float16
    f32 = lambda x: x.float().contiguous()  # noqa: E731
    bq, bo, muv = f32(query_transform), f32(output_transform), f32(value_mean)
    # an FP8 ring's rows (d + 4 bytes) are read apart from the 16-bit rows, whose loads the hint is for
    aligned = _aligned16(k_codes, v_codes, k_sink, v_sink, kch, vch, *(() if geo.ring_fp8 else (k_ring, v_ring)))
    frag = fragment_order.in_fragment_order(k_codes)
    prefix = None
    # 16-bit chunks only: 32-bit rows staged through shared memory by two pipelined loops do not fit it at d = 256
    # (360 KB for fp32 on the H200); fp32 caches (the CPU's, tests) keep the split launches
    # debiased scores need each INT2 key's step: the page kernel has it, the gathered (dequantized) rows do not
    if gather_prefix is not False and not ablate and not debias > 0 and (
            gather_prefix or (tiles[0][1].nc and kch.element_size() == 2)):
        # rows in the chunk's 16-bit type, so both loops of the fused launch feed the tensor cores without conversion
        rows_dtype = kch.dtype if kch.dtype in (torch.bfloat16, torch.float16) else dot_dtype
        prefix = _gathered_prefix(geo, lens, c0, has_chunk, kw, k_meta, vw, v_meta, k_sink, v_sink, k_ring, v_ring,
                                  block_table, h, d, rows_dtype, aligned, frag)
    LAST_LAUNCH["gather_prefix"] = prefix is not None
    if prefix is not None:  # the fused prefill: one launch a query tile, one partial state a row
        tiles = plan_tiles(b, hq, t, geo, dev, block_n, splits, temp_budget, chunk_len=chunk_len, fused=True)
        LAST_LAUNCH["plan"] = tiles[0][1]
        if mask_kind == 1:  # a bool mask of one interval a row (what models pass) is read as two bounds a row
            bounds = _mask_bounds(mask_rows).expand(b, hq, t, 3)
            mask, key_mask, mask_kind = bounds, mask, 3
    LAST_LAUNCH["mask_kind"] = mask_kind
    LAST_LAUNCH["mask_bounds"] = False  # set by a decode launch that reads a bool mask's row bounds
    # One set of temporaries for every tile, as large as the largest tile needs (a shorter last tile may
    # split its keys more; each plan is within the budget, so their maximum is too).
    rows = max(b * h * p.m_total for _, p in tiles)
    states = max(b * h * p.m_total * p.ns for _, p in tiles)
    qq = torch.empty(rows, d, dtype=dot_dtype, device=dev)
    part_m = torch.empty(states, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_o = torch.empty(states * d, dtype=torch.float32, device=dev)
    for t0, tile in tiles:
        t1 = t0 + tile.tile_tokens
        tmask = None if mask is None else mask[:, :, t0:t1]
        if prefix is not None:
            tkeys = None if key_mask is None else key_mask[:, :, t0:t1]
            _launch_prefill_tile(tile, q[:, :, t0:t1], pos[:, t0:t1], lens, c0, c_end, kch, vch, prefix, tmask,
                                 tkeys, mask_kind, mask_len, bq, bo, muv, is_causal, scale, qq, part_m, part_l, part_o,
                                 out[:, :, t0:t1], h, g, d, dt, has_chunk, chunk_block_m, chunk_warps or num_warps)
            continue
        _launch_tile(tile, q[:, :, t0:t1], pos[:, t0:t1], lens, c0, c_end, kch, vch, kw, k_meta, vw, v_meta,
                     k_sink, v_sink, k_ring, v_ring, block_table, tmask, mask_kind, mask_len, bq, bo, muv, is_causal,
                     scale, qq, part_m, part_l, part_o, out[:, :, t0:t1], geo, h, g, d, dt, use_asm, aligned, ablate,
                     num_warps, num_stages, maxnreg, page_warps, bf16_warps, has_chunk, frag, chunk_block_m,
                     chunk_warps, debias, channel_fold)
    return out


# Bytes of 16-bit key and value rows a prefill call may gather at once (every row's keys before its chunk): 64 x 8K
# (the second 4K chunk) takes 1.1 GB, 1 x 128K 0.5 GB; under CUDA-graph capture (a row's whole capacity) 64 x 8K
# takes 2.2 GB. Past it the split launches read the INT2 pages themselves.
GATHER_BYTES_BUDGET = 4 * 2**30


def _capturing(device: torch.device) -> bool:
    """Whether this call is being captured into a CUDA graph (nothing may be read back to the host)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _gathered_prefix(geo, lens, c0, has_chunk, kw, k_meta, vw, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
                     h, d, rows_dtype, aligned, frag):
    """Every row's keys and values before its chunk as 16-bit rows (``(k, v)`` of ``[B, P, H, d]``: sinks and ring
    copied, pages dequantized), for the fused prefill; None where the split launches must read the cache instead:
    a ring-only (sliding-window) cache, or rows past :data:`GATHER_BYTES_BUDGET`.

    The rows are as many as the longest prefix, read back (one sync a call, against milliseconds of prefill
    attention); under CUDA-graph capture, which allows no sync, as many as the cache holds a row (the kernels read
    each row's own prefix length on the device)."""
    if geo.drops_evicted:
        return None
    b = lens.shape[0]
    if _capturing(kw.device):
        p = geo.capacity
    else:
        p = max(int(torch.minimum(c0, lens).max()) if has_chunk else int(lens.max()), 0)
    if 2 * b * p * h * d * 2 > GATHER_BYTES_BUDGET:
        return None
    k = torch.empty(b, max(p, 1), h, d, dtype=rows_dtype, device=kw.device)  # a first chunk has no prefix: no rows
    v = torch.empty_like(k)
    block = 32
    if p == 0:
        return k, v
    _gather_prefix_kernel[(b * h, triton.cdiv(p, block))](
        lens, lens.stride(0), c0, kw, k_meta, vw, v_meta, k_sink, v_sink, k_ring, v_ring, block_table,
        block_table.stride(0), kw.stride(0), kw.stride(1), kw.stride(2), v_meta.stride(0), v_meta.stride(1),
        v_meta.stride(2), k_sink.stride(0), k_sink.stride(1), k_sink.stride(2), k_ring.stride(0), k_ring.stride(1),
        k_ring.stride(2), k, v, k.stride(0), k.stride(1), k.stride(2), geo.num_sinks, geo.window, p,
        k_meta.stride(0), k_meta.stride(2), H=h, D=d,
        NG=geo.num_groups, PS=geo.page_size, BLOCK_N=block, HAS_CHUNK=has_chunk, ALIGNED=aligned, FRAG=frag,
        KCH=geo.key_channel, RING_FP8=geo.ring_fp8, num_warps=4)
    return k, v


def _rotate_queries(plan, q, bq, qq, rows, scale, h, g, d, mask_rows=None, bounds=None):
    """``qq = q B_q * scale * log2(e)``: the query rows of a tile, rotated once (not once per split). With
    ``mask_rows`` (a uint8 ``[R, L]`` view, unit stride), the same launch writes their bounds to ``bounds`` ``[R, 3]``
    (see :func:`_mask_bounds`)."""
    nq = triton.cdiv(rows, plan.block_m)
    n_mask, length = (0, 0) if mask_rows is None else mask_rows.shape
    _query_kernel[(nq + n_mask, h)](q, q.stride(0), q.stride(1), q.stride(2), bq, qq, plan.m_total, rows,
                                    scale * LOG2E, nq, qq if mask_rows is None else mask_rows,
                                    0 if mask_rows is None else mask_rows.stride(0), qq if bounds is None else bounds,
                                    length, H=h, G=g, D=d, BLOCK_M=plan.block_m, KC=min(d, 64),
                                    MASK_BLOCK=_mask_block(length))


def _rows_type(dtype: torch.dtype, dt):
    """Tensor-core operand type for 16-bit key rows: their own type (no conversion before the tensor cores); ``dt``
    for other rows, and in the interpreter, whose bf16 arithmetic is wrong (DESIGN.md section 5)."""
    return dt if _INTERPRET else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, dt)


def _launch_prefill_tile(plan, q, pos, lens, c0, c_end, kch, vch, prefix, mask, key_mask, mask_kind, mask_len, bq, bo,
                         muv, is_causal, scale, qq, part_m, part_l, part_o, out, h, g, d, dt, has_chunk, block_m=None,
                         warps=None):
    """The fused prefill of one query tile: rotate queries, one flash-attention launch over the gathered prefix and
    the chunk (one partial state a row), merge (un-rotate). A bool mask read as intervals (``mask_kind`` 3, ``mask``
    the ``(first, last, one_interval)`` bounds) takes a second launch for the row blocks where some row is not one
    interval, which reads ``key_mask`` key by key; each launch skips the other's blocks."""
    b = q.shape[0]
    m_total = plan.m_total
    rows = b * m_total
    _rotate_queries(plan, q, bq, qq, rows, scale, h, g, d)
    pk, pv = prefix
    cdt = _rows_type(pk.dtype, dt)
    bm = block_m or plan.block_m
    if mask_kind == 3:
        flags = mask[..., 2]
        launches = [(mask, 3, 1), (key_mask, 1, 2)]
    else:
        flags, launches = q, [(mask, mask_kind, 0)]  # flags unread (TILES 0): any tensor with 3 strides
    for m, kind, tiles in launches:
        smk = m.stride() if m is not None else (0, 0, 0, 0)
        # a mask's offsets within one batch row (heads x queries x keys) in int32 when they fit
        mask_i32 = m is not None and sum((n - 1) * st for n, st in zip(m.shape[1:], m.stride()[1:])) < 2**31
        LAST_LAUNCH["attention"] = _prefill_kernel[(b * h, triton.cdiv(m_total, bm))](
            qq, pos, pos.stride(0), lens, lens.stride(0), c0, c_end, kch, vch, kch.stride(0), kch.stride(1),
            kch.stride(2), pk, pv, pk.stride(0), pk.stride(1), pk.stride(2), q if m is None else m, smk[0], smk[1],
            smk[2], smk[3], mask_len, part_m, part_l, part_o, m_total, flags, flags.stride(0), flags.stride(1),
            flags.stride(2), H=h, G=g, D=d, BLOCK_M=bm, BLOCK_N=BF16_BLOCK_N, IS_CAUSAL=bool(is_causal),
            MASK_KIND=kind, HAS_CHUNK=has_chunk, CDT=cdt, MASK_I32=mask_i32, TILES=tiles, num_warps=warps or 4)
    for name in ("attention_bf16", "attention_chunk"):
        LAST_LAUNCH.pop(name, None)
    _merge(part_m, part_l, part_o, bo, muv, out, pos, rows, m_total, 1, h, g, d)


def _launch_tile(plan, q, pos, lens, c0, c_end, kch, vch, kw, k_meta, vw, v_meta, k_sink, v_sink, k_ring, v_ring,
                 block_table, mask, mask_kind, mask_len, bq, bo, muv, is_causal, scale, qq, part_m, part_l, part_o,
                 out, geo, h, g, d, dt, use_asm, aligned, ablate, num_warps, num_stages, maxnreg, page_warps, bf16_warps,
                 has_chunk, frag, chunk_block_m=None, chunk_warps=None, debias=0.0, channel_fold=True):
    """The launches of one query tile: rotate queries, page region (Gluon or Triton), BF16 keys, the chunk's own
    keys (prefill), merge."""
    b = q.shape[0]
    dense_chunk = bool(plan.nc) and has_chunk
    m_total, ns = plan.m_total, plan.ns
    smk = mask.stride() if mask is not None else (0, 0, 0, 0)
    rows = b * m_total  # a KV head's query rows, over all batch rows
    bounds = None
    min_rows = _sm_count(q.device) if MASK_BOUNDS_MIN_PROGRAMS is None else MASK_BOUNDS_MIN_PROGRAMS
    if mask_kind == 1 and smk[1] == 0 and plan.tile_tokens == 1 and not ablate and b * h >= min_rows:
        # a decode step's bool mask row, shared by every head (a model's [B, 1, 1, L]): its visible interval,
        # found once and read by the page and BF16 launches as two bounds a row where the row is one interval.
        # Only where rows fill the GPU: finding the bounds is one program a row (a 128K row alone took ~25 us a
        # layer, more than reading the mask a byte a key saves at batch 1).
        # (found by the query launch: no launch of their own)
        mask_rows = _mask_rows(mask[:, :1, :1])
        bounds = torch.empty(b, 3, dtype=torch.int32, device=q.device)
    LAST_LAUNCH["mask_bounds"] = bounds is not None
    _rotate_queries(plan, q, bq, qq, rows, scale, h, g, d, None if bounds is None else mask_rows, bounds)
    args = (
        qq, pos, pos.stride(0), lens, lens.stride(0),
        c0, c_end, kch, vch, kch.stride(0), kch.stride(1), kch.stride(2),
        kw, k_meta, vw, v_meta, k_sink, v_sink, k_ring, v_ring, block_table, block_table.stride(0),
        kw.stride(0), kw.stride(1), kw.stride(2), v_meta.stride(0), v_meta.stride(1), v_meta.stride(2),
        k_sink.stride(0), k_sink.stride(1), k_sink.stride(2), k_ring.stride(0), k_ring.stride(1), k_ring.stride(2),
        q if mask is None else mask, smk[0], smk[1], smk[2], smk[3], mask_len,
        part_m, part_l, part_o, m_total, plan.keys_per_split, plan.bf16_per_split, geo.num_sinks, geo.window,
        plan.nsplit, ns, lens if bounds is None else bounds, 0 if bounds is None else bounds.stride(0),
        k_meta.stride(0), k_meta.stride(2), debias / (24 * LOG2E),  # q' carries scale * log2(e): see DEBIAS
    )
    meta = dict(H=h, G=g, D=d, NG=geo.num_groups, PS=geo.page_size, HAS_RING=geo.window > 0,
                IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind, HAS_CHUNK=has_chunk, DT=dt, KC=min(d, 64),
                ALIGNED=aligned, ABLATE=ablate, USE_ASM=use_asm, FRAG=frag, num_stages=num_stages,
                KCH=geo.key_channel, DEBIAS=debias > 0, RING_FP8=geo.ring_fp8)
    page_opts = {"maxnreg": maxnreg} if maxnreg else {}  # a register cap trades spills for CTAs per SM
    page_opts["KFOLD"] = bool(channel_fold)  # per-channel keys in blocks of whole pages: _dequant_dot_key_pages
    # warps: page_warps for the page region alone, else num_warps for both regions, else the heuristic
    page_opts["num_warps"] = page_warps or num_warps or page_region_warps(b, h, plan.page_m_blocks, plan.page_m, q.device,
                                                                          geo.key_channel and plan.block_n >= 4 * geo.page_size)
    cdt = _rows_type(kch.dtype, dt)  # the chunk launch's operands
    if dense_chunk and plan.nb != 1:  # pragma: no cover - the plan gives a prefill one BF16 split
        raise ValueError("oscar: the chunk's own launch needs the BF16 keys in one split (a prefill plan)")
    LAST_LAUNCH["dense_chunk"] = dense_chunk
    LAST_LAUNCH["attention_bf16"] = _attn_kernel[(b * h, plan.m_blocks, plan.nb)](
        *args, REGION=1, BLOCK_M=plan.block_m, BLOCK_N=BF16_BLOCK_N, num_warps=bf16_warps or num_warps or 4,
        DENSE_CHUNK=dense_chunk, CDT=cdt, SKIP_EMPTY=plan.tile_tokens > 1, MASK_BOUNDS=bounds is not None, **meta)
    if plan.nsplit == 0:  # no pages
        LAST_LAUNCH.pop("attention", None)
    elif plan.page_kernel == "gluon":
        cfg = plan.gluon
        LAST_LAUNCH["attention"] = _gluon_decode().launch_pages(
            (b * h, plan.nsplit), qq, pos, lens, c0, kw, k_meta if geo.key_channel else k_meta.view(torch.int32), vw,
            v_meta.view(torch.int32), block_table, q if mask is None else mask, smk, mask_len, part_m, part_l, part_o,
            plan.keys_per_split, geo.num_sinks, geo.window, ns, h, g, d, geo.page_size, has_chunk, mask_kind,
            is_causal, num_warps=cfg.warps, tiles=cfg.tiles, stages=cfg.stages, mask_bounds=bounds,
            key_channel=geo.key_channel)
    else:
        LAST_LAUNCH["attention"] = _attn_kernel[(b * h, plan.page_m_blocks, plan.nsplit)](
            *args, REGION=0, BLOCK_M=plan.page_m, BLOCK_N=plan.block_n, **meta, **page_opts)
    if dense_chunk:
        cm = chunk_block_m or plan.block_m
        LAST_LAUNCH["attention_chunk"] = _attn_kernel[(b * h, triton.cdiv(m_total, cm), 1)](
            *args, REGION=2, BLOCK_M=cm, BLOCK_N=BF16_BLOCK_N, num_warps=chunk_warps or num_warps or 4,
            DENSE_CHUNK=True, CDT=cdt, **meta)
    else:
        LAST_LAUNCH.pop("attention_chunk", None)
    _merge(part_m, part_l, part_o, bo, muv, out, pos, rows, m_total, ns, h, g, d)


def _merge(part_m, part_l, part_o, bo, muv, out, pos, rows, m_total, ns, h, g, d):
    merge_m = 16
    # A decode step (one row block) merges many splits (~66 at batch 1) in few programs: read twice as
    # many splits a step with twice the warps (same registers a thread). H200, 1 x 128K: the merge took
    # 25 us of 98 with 4 splits a step.
    decode = m_total <= merge_m
    LAST_LAUNCH["merge"] = _merge_kernel[(triton.cdiv(rows, merge_m), h)](
        part_m, part_l, part_o, bo, muv, out, out.stride(0), out.stride(1), out.stride(2), pos, pos.stride(0),
        m_total, rows, ns, H=h, G=g, D=d, BLOCK_M=merge_m, KC=min(d, 32), SB=max(1, (1024 if decode else 512) // d),
        num_warps=8 if decode else 4,
    )
