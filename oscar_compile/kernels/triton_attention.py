"""Triton ``oscar::attention``: split-KV attention over BF16 sinks, INT2 pages and the BF16 ring.

Beside it, :func:`oscar_compile.kernels.attention.attention_reference` is the oracle (same semantics).

Work decomposition (flash-decoding): one program per (sequence row, KV head, block of query rows,
split). The query rows of a KV head are its whole GQA group times the query tokens (row
``r = t * G + g``), so every loaded KV tile serves all query heads that read it; KV is never
repeated. Splits ``0 .. NSPLIT-1`` share the INT2 page region of the row; the last split takes the
BF16 keys (sinks, the ring and the new chunk). A second kernel merges the splits' partial softmax
states, un-rotates (``o' B_o + mu_v``) and writes the output.

INT2 in registers, never in memory: a ``[BLOCK_N, d/4]`` byte tile is loaded once and expanded to
``[BLOCK_N, d]`` codes with one shift and mask per quarter (a reshape puts quarter ``i`` at channels
``i d/4 ..``, which is what quartered packing means). With one (scale, min) per row (``g = d``)
dequantization folds into the dot products, per key rather than per element::

    q'.k_hat = scale * (q' . c) + min * sum(q')
    P V_hat  = (P * scale) @ c  + (P @ min)

so the inner loop issues only shifts, masks, conversions and two ``tl.dot`` (fp16 tensor cores).
Smaller groups dequantize per element. ``ablate`` switches off stages for measurements
(1: values, 2: key dot, 4: everything but the loads). The query is rotated in-kernel (``q B_q``, one ``d x d`` dot
per program) and the output un-rotated in the merge kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .checks import check_attention

LOG2E = 1.4426950408889634
LAST_LAUNCH: dict = {}  # the compiled kernels of the latest call (register/spill reports in benchmarks)


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
def _unpack_int2(codes, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Packed ``[BLOCK_N, D/4]`` bytes -> codes ``[BLOCK_N, D]`` (uint8): quarter i is ``(byte >> 2i) & 3``.

    Kept in 8 bits until the conversion for the dot (an int32 intermediate costs 4x the registers).
    """
    shifts = (tl.arange(0, 4) * 2).to(tl.uint8)[None, :, None]
    return tl.reshape((codes[:, None, :] >> shifts) & 3, (BLOCK_N, D))


@triton.jit
def _visible(s, j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
             IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
    """Apply causality and the user mask to scores ``s [M, N]`` (already scaled by log2(e)/sqrt(d))."""
    vis = key_ok[None, :]
    if IS_CAUSAL:
        vis = vis & (j[None, :] <= row_pos[:, None])
    if MASK_KIND != 0:
        in_mask = j < mask_len
        mptr = mask_ptr + b * smk_b + row_hq[:, None] * smk_h + row_t[:, None] * smk_t + tl.where(in_mask, j, 0)[None, :] * smk_j
        if MASK_KIND == 1:
            mv = tl.load(mptr, mask=vis & in_mask[None, :], other=0)
            vis = vis & in_mask[None, :] & (mv != 0)
        else:
            mv = tl.load(mptr, mask=vis & in_mask[None, :], other=float("-inf")).to(tl.float32)
            vis = vis & in_mask[None, :] & (mv > float("-inf"))
            s = s + mv * 1.4426950408889634
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One block of the streaming softmax (base 2): weights, the rescale of the running state, new m and l."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero weight
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attn_kernel(
    q_ptr, sq_b, sq_h, sq_t, pos_ptr, sp_b, len_ptr, sl_b,
    c0_ptr, cend_ptr, kch_ptr, vch_ptr, sch_b, sch_t, sch_h,
    kc_ptr, km_ptr, vc_ptr, vm_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, bt_ptr, sbt_b,
    sc_p, sc_s, sc_h, sm_p, sm_s, sm_h, ss_b, ss_t, ss_h, sr_b, sr_t, sr_h,
    bq_ptr, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
    part_m_ptr, part_l_ptr, part_o_ptr,
    T, M_TOTAL, qk_scale, keys_per_split, S, W,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NG: tl.constexpr,
    PS: tl.constexpr, NSPLIT: tl.constexpr, HAS_RING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_CHUNK: tl.constexpr, DT: tl.constexpr, KC: tl.constexpr, ALIGNED: tl.constexpr, ABLATE: tl.constexpr,
):
    D4: tl.constexpr = D // 4
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    m_block = tl.program_id(1)
    split = tl.program_id(2)

    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < M_TOTAL
    row_t = r // G
    row_hq = h * G + r % G
    row_pos = tl.load(pos_ptr + b * sp_b + tl.where(row_ok, row_t, 0), mask=row_ok, other=-1).to(tl.int64)
    length = tl.load(len_ptr + b * sl_b).to(tl.int64)
    if HAS_CHUNK:
        c0 = tl.load(c0_ptr + b).to(tl.int64)
        c_end = tl.load(cend_ptr + b).to(tl.int64)
    else:
        c0 = length
        c_end = length
    page_end = tl.maximum(tl.minimum(length - W, c0), S)  # INT2 keys: [S, page_end)

    # q' = q @ B_q (rotated query), pre-scaled by softmax scale * log2(e) for exp2.
    q_off = b * sq_b + row_hq * sq_h + row_t * sq_t
    qq = _rowmajor_matmul(q_ptr, q_off, row_ok, bq_ptr + h * D * D, BLOCK_M, D, KC) * qk_scale
    qsum = tl.sum(qq, 1)
    qq = qq.to(DT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    nblk = tl.arange(0, BLOCK_N)
    d4 = tl.arange(0, D4)
    dcol = tl.arange(0, D)

    if split < NSPLIT:
        # ---------------- INT2 pages: keys [lo, hi) of the page region
        lo = S + split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, page_end)
        for j0 in range(lo, hi, BLOCK_N):
            j = j0 + nblk
            key_ok = j < hi
            qi = tl.where(key_ok, j - S, 0)
            page = tl.load(bt_ptr + b * sbt_b + qi // PS, mask=key_ok, other=0).to(tl.int64)
            page = tl.where(page >= 0, page, 0)
            rowoff = page * sc_p + (qi % PS) * sc_s + h * sc_h
            metaoff = page * sm_p + (qi % PS) * sm_s + h * sm_h
            if ALIGNED:
                rowoff = tl.multiple_of(rowoff, 16)
            codes = tl.load(kc_ptr + rowoff[:, None] + d4[None, :], mask=key_ok[:, None], other=0)
            if ABLATE == 4:  # loads only: no unpacking, no dots
                s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32) + tl.sum(codes.to(tl.int32), 1).to(tl.float32)[None, :]
            elif NG == 1:
                ks = tl.load(km_ptr + metaoff, mask=key_ok, other=0.0).to(tl.float32)
                kmn = tl.load(km_ptr + metaoff + 1, mask=key_ok, other=0.0).to(tl.float32)
                if ABLATE == 2:
                    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32) + tl.sum(codes.to(tl.int32), 1).to(tl.float32)[None, :]
                else:
                    s = tl.dot(qq, tl.trans(_unpack_int2(codes, BLOCK_N, D).to(DT)))
                s = s * ks[None, :] + qsum[:, None] * kmn[None, :]
            else:
                GS: tl.constexpr = D // NG
                grp = dcol // GS
                sc = tl.load(km_ptr + metaoff[:, None] + grp[None, :], mask=key_ok[:, None], other=0.0).to(tl.float32)
                mn = tl.load(km_ptr + metaoff[:, None] + NG + grp[None, :], mask=key_ok[:, None], other=0.0).to(tl.float32)
                x = (_unpack_int2(codes, BLOCK_N, D).to(tl.float32) * sc + mn).to(DT)
                s = tl.dot(qq, tl.trans(x))
            s = _visible(s, j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
                         IS_CAUSAL, MASK_KIND)
            p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
            acc = acc * alpha[:, None]
            if ABLATE != 1:
                vcodes = tl.load(vc_ptr + rowoff[:, None] + d4[None, :], mask=key_ok[:, None], other=0)
                if ABLATE == 4:
                    acc += tl.sum(tl.sum(vcodes.to(tl.int32), 1), 0).to(tl.float32) * 0.0
                elif NG == 1:
                    vsc = tl.load(vm_ptr + metaoff, mask=key_ok, other=0.0).to(tl.float32)
                    vmn = tl.load(vm_ptr + metaoff + 1, mask=key_ok, other=0.0).to(tl.float32)
                    ps = (p * vsc[None, :]).to(DT)
                    acc = tl.dot(ps, _unpack_int2(vcodes, BLOCK_N, D).to(DT), acc) + tl.sum(p * vmn[None, :], 1)[:, None]
                else:
                    GS2: tl.constexpr = D // NG
                    grp2 = dcol // GS2
                    sc = tl.load(vm_ptr + metaoff[:, None] + grp2[None, :], mask=key_ok[:, None], other=0.0).to(tl.float32)
                    mn = tl.load(vm_ptr + metaoff[:, None] + NG + grp2[None, :], mask=key_ok[:, None], other=0.0).to(tl.float32)
                    x = (_unpack_int2(vcodes, BLOCK_N, D).to(tl.float32) * sc + mn).to(DT)
                    acc = tl.dot(p.to(DT), x, acc)
            m_i = m_new
    else:
        # ---------------- BF16 keys: sinks [0, min(S, L)), then [page_end, L) from the ring or the chunk
        n_sink = tl.minimum(length, S)
        n_bf16 = n_sink + tl.maximum(length - page_end, 0)
        for u0 in range(0, n_bf16, BLOCK_N):
            u = u0 + nblk
            key_ok = u < n_bf16
            j = tl.where(u < n_sink, u, page_end + (u - n_sink))
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
            k = tl.load(kb[:, None] + dcol[None, :], mask=key_ok[:, None], other=0.0).to(DT)
            s = tl.dot(qq, tl.trans(k))
            s = _visible(s, j, key_ok, row_t, row_pos, row_hq, b, mask_ptr, smk_b, smk_h, smk_t, smk_j, mask_len,
                         IS_CAUSAL, MASK_KIND)
            p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
            v = tl.load(vb[:, None] + dcol[None, :], mask=key_ok[:, None], other=0.0).to(DT)
            acc = tl.dot(p.to(DT), v, acc * alpha[:, None])
            m_i = m_new

    # partial softmax state of this split: m, l and the unnormalized output (rotated basis)
    NS: tl.constexpr = NSPLIT + 1
    base = (pid_bh * M_TOTAL + r) * NS + split
    tl.store(part_m_ptr + base, m_i, mask=row_ok)
    tl.store(part_l_ptr + base, l_i, mask=row_ok)
    tl.store(part_o_ptr + base[:, None] * D + dcol[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_kernel(part_m_ptr, part_l_ptr, part_o_ptr, bo_ptr, muv_ptr, out_ptr, so_b, so_h, so_t, pos_ptr, sp_b,
                  M_TOTAL, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
                  NS_P2: tl.constexpr, BLOCK_M: tl.constexpr, KC: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < M_TOTAL
    rbase = (pid_bh * M_TOTAL + r) * NS
    sp = tl.arange(0, NS_P2)
    m = tl.load(part_m_ptr + rbase[:, None] + sp[None, :], mask=row_ok[:, None] & (sp[None, :] < NS), other=float("-inf"))
    m_max = tl.max(m, 1)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    dcol = tl.arange(0, D)
    o = tl.zeros([BLOCK_M, D], tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    for s_i in range(NS):
        m_s = tl.load(part_m_ptr + rbase + s_i, mask=row_ok, other=float("-inf"))
        w_s = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_safe))
        denom += w_s * tl.load(part_l_ptr + rbase + s_i, mask=row_ok, other=0.0)
        o += tl.load(part_o_ptr + (rbase + s_i)[:, None] * D + dcol[None, :], mask=row_ok[:, None], other=0.0) * w_s[:, None]
    row_t = r // G
    pos = tl.load(pos_ptr + b * sp_b + tl.where(row_ok, row_t, 0), mask=row_ok, other=-1)
    has = (denom > 0) & (pos >= 0)
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
    optr = out_ptr + b * so_b + row_hq[:, None] * so_h + row_t[:, None] * so_t + dcol[None, :]
    tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _aligned16(codes: torch.Tensor) -> bool:
    """Rows of packed codes start on 16-byte boundaries (lets the compiler use 16-byte loads)."""
    return codes.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in codes.stride()[:3])


def num_splits(batch: int, kv_heads: int, m_blocks: int, page_keys: int, block_n: int, device) -> int:
    """Splits of the page region so that even one long sequence fills the GPU (from shapes only)."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    base = max(1, batch * kv_heads * m_blocks)
    want = -(-4 * sms // base)  # about four programs per SM
    most = max(1, -(-page_keys // (4 * block_n)))  # at least four key blocks per split
    return int(max(1, min(want, most, 128)))


def attention_triton(q, positions, seq_lens, k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring,
                     block_table, query_transform, output_transform, value_mean, attn_mask, is_causal, scale,
                     k_chunk=None, v_chunk=None, chunk_positions=None, block_n: int | None = None,
                     splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
                     dot_dtype: torch.dtype = torch.float16, ablate: int = 0):
    """Triton ``oscar::attention`` (same arguments and result as :func:`attention_reference`).

    The chunk, when given, must be the row's newest tokens (what ``store`` just returned).
    """
    cache = (k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table)
    geo = check_attention(q, positions, seq_lens, cache, query_transform, output_transform, value_mean, attn_mask,
                          scale, k_chunk, v_chunk, chunk_positions)
    b, hq, t, d = q.shape
    h = geo.num_kv_heads
    g = hq // h
    dev = q.device
    pos = positions.expand(b, t) if positions.dim() == 1 else positions
    lens = seq_lens.expand(b) if seq_lens.numel() == 1 else seq_lens
    m_total = g * t
    block_m = 16 if m_total <= 16 else (32 if m_total <= 32 else 64)
    m_blocks = triton.cdiv(m_total, block_m)
    block_n = block_n or (64 if d > 128 else 128)
    page_keys = geo.max_pages * geo.page_size
    nsplit = splits or num_splits(b, h, m_blocks, page_keys, block_n, dev)
    keys_per_split = triton.cdiv(triton.cdiv(page_keys, nsplit), block_n) * block_n
    ns = nsplit + 1
    part_m = torch.empty(b * h * m_total * ns, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_o = torch.empty(b * h * m_total * ns * d, dtype=torch.float32, device=dev)
    has_chunk = k_chunk is not None
    if has_chunk:
        cpos = chunk_positions.expand(b, k_chunk.shape[1]) if chunk_positions.dim() == 1 else chunk_positions
        c0 = torch.where(cpos >= 0, cpos, torch.iinfo(cpos.dtype).max).amin(-1)
        c_end = cpos.amax(-1) + 1
        kch, vch = k_chunk, v_chunk
    else:
        c0 = c_end = lens
        kch, vch = k_sink, v_sink  # unused
    if attn_mask is not None:
        mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        mask = mask.expand(b, hq, t, mask.shape[-1])
        mask_kind = 1 if mask.dtype == torch.bool else 2
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8) if mask.is_contiguous() else mask.to(torch.uint8)
        smk = mask.stride()
        mask_len = mask.shape[-1]
    else:
        mask, mask_kind, smk, mask_len = q, 0, (0, 0, 0, 0), 0
    # Tensor-core operands: fp16 (codes 0..3 are exact, q' and P keep 11 bits; BF16 cache rows convert
    # exactly within fp16's range). bf16 keeps range for caches with |x| > 65504, at 8 bits.
    dt = tl.bfloat16 if dot_dtype == torch.bfloat16 else tl.float16
    out = torch.empty(b, hq, t, d, dtype=q.dtype, device=dev)
    f32 = lambda x: x.float().contiguous()  # noqa: E731
    LAST_LAUNCH["attention"] = _attn_kernel[(b * h, m_blocks, ns)](
        q, q.stride(0), q.stride(1), q.stride(2), pos, pos.stride(0), lens, lens.stride(0),
        c0, c_end, kch, vch, kch.stride(0), kch.stride(1), kch.stride(2),
        k_codes, k_meta, v_codes, v_meta, k_sink, v_sink, k_ring, v_ring, block_table, block_table.stride(0),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2), k_meta.stride(0), k_meta.stride(1), k_meta.stride(2),
        k_sink.stride(0), k_sink.stride(1), k_sink.stride(2), k_ring.stride(0), k_ring.stride(1), k_ring.stride(2),
        f32(query_transform), mask, smk[0], smk[1], smk[2], smk[3], mask_len,
        part_m, part_l, part_o, t, m_total, scale * LOG2E, keys_per_split, geo.num_sinks, geo.window,
        H=h, G=g, D=d, NG=geo.num_groups, PS=geo.page_size, NSPLIT=nsplit, HAS_RING=geo.window > 0, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind,
        HAS_CHUNK=has_chunk, DT=dt, KC=min(d, 64), ALIGNED=_aligned16(k_codes) and _aligned16(v_codes),
        ABLATE=ablate, num_warps=num_warps, num_stages=num_stages,
    )
    merge_m = 16
    LAST_LAUNCH["merge"] = _merge_kernel[(b * h, triton.cdiv(m_total, merge_m))](
        part_m, part_l, part_o, f32(output_transform), f32(value_mean), out, out.stride(0), out.stride(1),
        out.stride(2), pos, pos.stride(0), m_total, H=h, G=g, D=d, NS=ns, NS_P2=triton.next_power_of_2(ns),
        BLOCK_M=merge_m, KC=min(d, 32),
    )
    return out
