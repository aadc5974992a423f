"""Gluon decode kernel of the INT2 page region (sm_80+, head_dim 64/128/256, GQA group <= 8, one query a row).

It replaces the page-region launch of :mod:`.triton_attention` for decode steps; the query rotation,
the BF16 keys (sinks, ring, chunk) and the merge stay there, and this kernel writes the same partial
softmax state (``m``, ``l``, unnormalised ``o`` per split). The PyTorch reference stays the oracle.

Design (issue 16; TurboMind's and Marlin's ideas, our code):

* **Keys and values on the MMA's large side.** ``S^T = K Q^T`` with 16 keys on ``mma.m16n8k16``'s M
  side and the GQA group's query heads on N = 8, then ``O^T = V^T P^T`` with channels on M: a group of
  4 heads wastes half of N instead of 3/4 of M.
* **Fragment-ordered codes** (:mod:`.fragment_order`): each thread loads 16 bytes a 16-key tile that
  are exactly its A-operand fragment; unpacking happens in registers and the layout conversion that
  assembles the operand moves no data (``convert_layout(..., assert_trivial=True)``).
* **Subnormal unpack**: one AND leaves the code at bit offset ``2k`` of an fp16 half as the exact
  subnormal ``4^k c 2^-24`` (tensor cores take fp16 subnormals): ``4^-k`` is folded into the query
  (keys) or the output rows (values), ``2^24`` into the scale; one instruction per code pair. The
  magic-number variant (``lop3`` into the mantissa of 1024, then an ``fma``) stays behind ``SUBNORMAL=False``.
* **Scale and minimum outside the MMA** (one pair per row): ``s = scale (c . q) + min sum(q)`` and
  ``O += (P scale) c + sum(P min)``; the MMAs run on raw codes.
* **Two launch shapes** (``GluonConfig`` in :mod:`.triton_attention`): one-warp programs, whose online
  softmax rescales its state only when a running max grows (a warp-uniform branch), with the codes
  ``STAGES`` blocks ahead through a ``cp.async`` ring in shared memory (each thread reads back only what
  it copied); or several warps a program, each streaming its own tiles with register prefetch and
  combining once at the end. Block-table entries are loaded a block ahead of the codes they address.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# cp.async global -> shared: ``async_copy_global_to_shared`` in Triton 3.6, ``async_load`` from 3.7 on
_copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


def _unpack_asm(subnormal: bool) -> str:
    """PTX: one word -> its 16 codes as fp16 pairs, output ``2 jj + half`` = bits ``16 half + 2 jj``.

    ``subnormal``: an AND leaves the code at bit offset ``2k`` of a half as the fp16 subnormal
    ``4^k c 2^-24``, exact; the kernel folds ``4^-k`` into the query (keys) or the output rows (values) and
    ``2^24`` into the scale. Otherwise (magic number): ``lop3`` gives ``1024 + 4^k c`` and one ``fma``
    makes it ``c``, exact, at twice the instructions.
    """
    scale = {0: 0x3C00, 1: 0x3400, 2: 0x2C00, 3: 0x2400}  # 4^-k in fp16
    offset = {0: 0xE400, 1: 0xDC00, 2: 0xD400, 3: 0xCC00}  # -1024 * 4^-k
    lines = ["{", ".reg .b32 t, s, f, o;", "shr.b32 s, $16, 8;"]
    for jj in range(8):
        k = jj % 4
        src = "$16" if jj < 4 else "s"
        mask = 0x00030003 << (2 * k)
        if subnormal:
            lines += [f"and.b32 t, {src}, {mask:#010x};"]
        else:
            lines += [f"lop3.b32 t, {src}, {mask:#010x}, 0x64006400, 0xea;",
                      f"mov.b32 f, {scale[k] * 0x10001:#010x};", f"mov.b32 o, {offset[k] * 0x10001:#010x};",
                      "fma.rn.f16x2 t, t, f, o;"]
        lines += [f"mov.b32 {{${2 * jj}, ${2 * jj + 1}}}, t;"]
    return "\n".join(lines + ["}"])


UNPACK_ASM = gl.constexpr(_unpack_asm(False))
UNPACK_ASM_SUBNORMAL = gl.constexpr(_unpack_asm(True))
UNPACK_CONSTRAINTS = gl.constexpr(",".join(["=h"] * 16 + ["r"]))
SUBNORMAL_UNIT = gl.constexpr(2.0**24)  # 1 / the fp16 subnormal step
# Per-channel keys: the page-scaled query is multiplied by this before its rounding to fp16 (q' * 4^-3 * scale can
# fall below fp16's normal range, 6e-5) and the scores divided by it; 64 * |q' scale| stays far below fp16's maximum.
KEY_FOLD = gl.constexpr(64.0)


@gluon.jit
def _unpack(words, NW: gl.constexpr, NT: gl.constexpr, D: gl.constexpr, KIND: gl.constexpr, A_OP: gl.constexpr,
            SUBNORMAL: gl.constexpr):
    """Words ``[NT * NW, D]`` (tile row ``nt NW + w``, word ``lane d/32 + wi``) -> the A operand of the keys
    ``[NW, NT 16, D]`` (KIND 0) or of the values ``[NW, D, NT 16]`` (KIND 1): codes 0..3 in fp16, or
    ``4^k c 2^-24`` with ``k = (channel // 8) % 4`` if SUBNORMAL."""
    C64: gl.constexpr = D // 64
    w5 = gl.reshape(words, [NT, NW, 8, 4, 2 * C64])  # nt, w, g, t, wi = hi C64 + c64
    if SUBNORMAL:
        o = gl.inline_asm_elementwise(UNPACK_ASM_SUBNORMAL, UNPACK_CONSTRAINTS, [w5], dtype=(gl.float16,) * 16,
                                      is_pure=True, pack=1)
    else:
        o = gl.inline_asm_elementwise(UNPACK_ASM, UNPACK_CONSTRAINTS, [w5], dtype=(gl.float16,) * 16, is_pure=True,
                                      pack=1)
    # join appends a minor dim: (half), then j0, j1, j2
    x0 = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])), gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
    x1 = gl.join(gl.join(gl.join(o[8], o[9]), gl.join(o[10], o[11])),
                 gl.join(gl.join(o[12], o[13]), gl.join(o[14], o[15])))
    x = gl.join(x0, x1)  # [NT, NW, 8, 4, 2 C64, half, j0, j1, j2]
    x = gl.reshape(x, [NT, NW, 8, 4, 2, C64, 2, 2, 2, 2])  # wi -> (hi, c64)
    # dims: 0 nt, 1 w, 2 g, 3 t, 4 hi, 5 c64, 6 half, 7 j0, 8 j1, 9 j2
    if KIND == 0:  # keys: slot (nt, hi, g), channel (c64, j2, j1, j0, t, half)
        x = gl.permute(x, [1, 0, 4, 2, 5, 9, 8, 7, 3, 6])
        x = gl.reshape(x, [NW, NT * 16, D])
    else:  # values: channel (c64, j2, j1, j0, g), slot (nt, hi, t, half)
        x = gl.permute(x, [1, 5, 9, 8, 7, 2, 0, 4, 3, 6])
        x = gl.reshape(x, [NW, D, NT * 16])
    return gl.convert_layout(x, A_OP, assert_trivial=True)


@gluon.jit
def _code_weight(channel):
    """``4^-k`` for the channels ``channel``: a byte holds channels ``b, b+8, b+16, b+24`` at bits 0, 2, 4, 6."""
    return gl.exp2(-2.0 * ((channel // 8) % 4).to(gl.float32))


@gluon.jit
def _meta_pair(m):
    """An int32 (scale | min << 16, fp16 each) -> (scale, min) in fp32."""
    sc = (m & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    mn = (m >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    return sc, mn


@gluon.jit
def _div_mod(x, PS: gl.constexpr):
    """``(x // PS, x % PS)`` of positions ``x >= 0``: unsigned, so a power-of-two page size is a shift and a mask
    (signed division by a constant takes three instructions, a signed remainder five)."""
    u = x.to(gl.uint32)
    return (u // PS).to(gl.int32), (u % PS).to(gl.int32)


@gluon.jit
def _tile_pages(j0, hi, S, bt_row, wr, PS: gl.constexpr):
    """The page of each 16-key tile of the block at ``j0`` (0 past ``hi``), from the row's block table."""
    tj = j0 + wr * 16  # tile row r starts at key j0 + 16 r (a multiple of 16 past S)
    tok = tj < hi
    return gl.maximum(gl.load(bt_row + _div_mod(gl.where(tok, tj - S, 0), PS)[0], mask=tok, other=0), 0)


@gluon.jit
def _code_offsets(j0, hi, S, tpage, sc_p, sc_s, wr, word_in_group, PS: gl.constexpr, WIDE: gl.constexpr):
    """Word offsets ``[NT NW, D]`` of the codes of the block at ``j0`` in a pool, and which rows are keys.

    ``tpage``: the tiles' pages (:func:`_tile_pages`, loaded a block earlier so that the code loads
    do not wait for the block table). Positions are int32 (a cache holds < 2^31 keys); page offsets are
    int32 unless a pool has 2^31 words or more (WIDE). The head's offset is in the base pointers.
    """
    tj = j0 + wr * 16
    tok = tj < hi
    tq = gl.where(tok, tj - S, 0)
    if WIDE:
        tpage = tpage.to(gl.int64)
    if PS == 16:  # a tile is a whole page (tiles start at multiples of 16 past S)
        off = tpage * sc_p
    else:
        off = tpage * sc_p + _div_mod(tq, PS)[1] * sc_s
    return gl.expand_dims(off, 1) + word_in_group, gl.expand_dims(tok, 1)


@gluon.jit
def _load_meta(j0, hi, S, tpage, bt_row, km_ptr, vm_ptr, sm_p, sm_s, key_in_block, wr, PS: gl.constexpr,
               NW: gl.constexpr, NT: gl.constexpr, KEYS: gl.constexpr, WIDE: gl.constexpr, KCH: gl.constexpr = False):
    """The keys' and values' (scale | min) words ``[NW, NT 16]`` of the block at ``j0`` (``KCH``, per-channel keys:
    the values' twice; the keys' are a page's, :func:`_key_page_meta`).

    A key's page is its tile's (tiles start at multiples of 16 past ``S`` and a page holds a multiple of 16
    keys): reused from ``tpage`` rather than loaded from the block table again, a key at a time."""
    key = j0 + key_in_block
    kok = key < hi
    kq = gl.where(kok, key - S, 0)
    if NT == 1:  # warp w's keys are tile w's: its page is already loaded (no second block-table load)
        kpage = gl.expand_dims(gl.convert_layout(tpage, gl.SliceLayout(1, KEYS)), 1)
    elif NW == 1 and PS % 16 == 0:
        # one warp: every thread holds all NT tile pages in registers (tile rows are not spread over lanes), so
        # picking tile nt's is a thread-local reduction, then a select a key
        kt = key_in_block // 16
        kpage = gl.zeros_like(key_in_block)
        for nt in gl.static_range(NT):
            kpage = gl.where(kt == nt, gl.sum(gl.where(wr == nt, tpage, 0), axis=0), kpage)
    else:
        kpage = gl.maximum(gl.load(bt_row + _div_mod(kq, PS)[0], mask=kok, other=0), 0)
    if WIDE:
        kpage = kpage.to(gl.int64)
    if PS == 16:  # a tile is a whole page: the slot is the key's place in its tile
        moff = kpage * sm_p + (key_in_block % 16) * sm_s
    else:
        moff = kpage * sm_p + _div_mod(kq, PS)[1] * sm_s
    vm = gl.load(vm_ptr + moff, mask=kok, other=0)
    km = vm
    if not KCH:
        km = gl.load(km_ptr + moff, mask=kok, other=0)
    return km, vm


@gluon.jit
def _key_page_meta(j0, hi, S, bt_row, km_h, skm_p, qw, qc, PS: gl.constexpr, D: gl.constexpr):
    """Per-channel keys: the (scale, min) ``[NW, D]`` (fp16, channel order) of the page of each warp's keys in the
    block at ``j0``. Warp ``w``'s first tile starts at key ``j0 + 16 w``, and all its tiles lie in that page (the
    launcher's condition: one tile a warp, or one warp whose tiles fit a page)."""
    first = j0 + 16 * qw
    ok = first < hi
    page = gl.maximum(gl.load(bt_row + _div_mod(gl.where(ok, first - S, 0), PS)[0], mask=ok, other=0), 0)
    off = gl.expand_dims(page.to(gl.int64) * skm_p, 1) + gl.expand_dims(qc, 0)
    ok2 = gl.expand_dims(ok, 1) & gl.expand_dims(qc >= 0, 0)
    sc = gl.load(km_h + off, mask=ok2, other=0.0)  # fp16 until used: half the registers of the block ahead
    mn = gl.load(km_h + off + D, mask=ok2, other=0.0)
    return sc, mn


@gluon.jit
def _key_page_query(q, cw, sc, mn, B_OP: gl.constexpr, HEADS: gl.constexpr, FOLD: gl.constexpr):
    """The B operand of a block of per-channel keys: the query ``q`` ``[NW, D, 8]`` times each warp's page scale (and
    the code weights ``cw``, and ``FOLD``, which keeps small products out of fp16's subnormal range; the scores are
    divided by it), and the bias ``q . min_page`` ``[NW, 8]``."""
    qf = q.to(gl.float32)
    qk = (qf * gl.expand_dims(sc.to(gl.float32) * gl.expand_dims(cw, 0) * FOLD, 2)).to(gl.float16)
    bias = gl.sum(qf * gl.expand_dims(mn.to(gl.float32), 2), axis=1)
    return gl.convert_layout(qk, B_OP), gl.convert_layout(bias, HEADS)


@gluon.jit
def _page_loop(q_op, qsum, kc_h, vc_h, km_h, vm_h, bt_row, mask_ptr, b, h, smk_b, smk_h, smk_j, mask_len,
               sc_p, sc_s, sm_p, sm_s, lo, hi, S, row_pos, first, wr, word_in_group, key_in_block, heads,
               G: gl.constexpr, D: gl.constexpr, PS: gl.constexpr, NW: gl.constexpr, NT: gl.constexpr,
               MASK_KIND: gl.constexpr, SUBNORMAL: gl.constexpr, WIDE: gl.constexpr, STAGES: gl.constexpr,
               MASK_HEADS: gl.constexpr, MMA: gl.constexpr, WL: gl.constexpr, q, cw, skm_p, qw, qc, KCH: gl.constexpr):
    """The online softmax over the page keys ``[lo, hi)`` of one (row, KV head): its state ``(m, l, sum P min, O)``.

    MASK_KIND 0: no mask; 1: a bool mask read a byte a key (and head, MASK_HEADS); 3: the row's visible keys are
    the interval ``[first, hi)`` (a bool mask row of one interval, its bounds read once; the caller takes its last
    key and the query's position into ``hi``). ``MMA``, ``WL``: the kernel's accumulator and code-word layouts.
    ``KCH`` (per-channel keys, ``km_h`` their page metadata): the query ``q`` (``[NW, D, 8]``, code weights ``cw``)
    scaled by each warp's page scale is the keys' B operand, a block at a time."""
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    KEYS: gl.constexpr = gl.SliceLayout(2, MMA)
    HEADS: gl.constexpr = gl.SliceLayout(1, MMA)
    BLOCK: gl.constexpr = NW * NT * 16
    m_i = gl.full([NW, 8], float("-inf"), gl.float32, HEADS)
    l_acc = gl.zeros([NW, NT * 16, 8], gl.float32, MMA)
    pm_acc = gl.zeros([NW, NT * 16, 8], gl.float32, MMA)
    o = gl.zeros([NW, D, 8], gl.float32, MMA)
    # software pipelined by hand: block i+1's metadata (and codes, STAGES == 1) and block i+2's pages are
    # loaded before block i is computed, so that no load waits for the block-table load it depends on;
    # with STAGES > 1 the codes travel by cp.async through a ring of STAGES blocks in shared memory (each
    # thread reads back only the bytes it copied itself)
    tpage = _tile_pages(lo, hi, S, bt_row, wr, PS)
    kmeta, vmeta = _load_meta(lo, hi, S, tpage, bt_row, km_h, vm_h, sm_p, sm_s, key_in_block, wr, PS, NW, NT, KEYS,
                              WIDE, KCH)
    if KCH:  # a block ahead, like the per-key metadata
        ksc_p, kmn_p = _key_page_meta(lo, hi, S, bt_row, km_h, skm_p, qw, qc, PS, D)
    tpage_n = _tile_pages(lo + BLOCK, hi, S, bt_row, wr, PS)
    if STAGES == 1:
        waddr, wok = _code_offsets(lo, hi, S, tpage, sc_p, sc_s, wr, word_in_group, PS, WIDE)
        # no ``other``: any bits are valid codes, and keys past ``hi`` are masked out of S and P
        kwords = gl.load(kc_h + waddr, mask=wok)
        vwords = gl.load(vc_h + waddr, mask=wok)
    else:
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        kbuf = gl.allocate_shared_memory(gl.int32, [STAGES, NT * NW, D], SMEM)
        vbuf = gl.allocate_shared_memory(gl.int32, [STAGES, NT * NW, D], SMEM)
        for st in gl.static_range(STAGES - 1):
            j_st = lo + st * BLOCK
            waddr, wok = _code_offsets(j_st, hi, S, _tile_pages(j_st, hi, S, bt_row, wr, PS), sc_p, sc_s, wr,
                                       word_in_group, PS, WIDE)
            _copy_to_shared(kbuf.index(st), kc_h + waddr, mask=wok)
            _copy_to_shared(vbuf.index(st), vc_h + waddr, mask=wok)
            async_copy.commit_group()
        tpage_c = _tile_pages(lo + (STAGES - 1) * BLOCK, hi, S, bt_row, wr, PS)
    it = 0
    for j0 in range(lo, hi, BLOCK):
        tpage_nn = _tile_pages(j0 + 2 * BLOCK, hi, S, bt_row, wr, PS)
        km_n, vm_n = _load_meta(j0 + BLOCK, hi, S, tpage_n, bt_row, km_h, vm_h, sm_p, sm_s, key_in_block, wr, PS, NW, NT,
                                KEYS, WIDE, KCH)
        if KCH:
            ksc_pn, kmn_pn = _key_page_meta(j0 + BLOCK, hi, S, bt_row, km_h, skm_p, qw, qc, PS, D)
        if STAGES == 1:
            waddr, wok = _code_offsets(j0 + BLOCK, hi, S, tpage_n, sc_p, sc_s, wr, word_in_group, PS, WIDE)
            kw_n = gl.load(kc_h + waddr, mask=wok)
            vw_n = gl.load(vc_h + waddr, mask=wok)
        else:
            tpage_cn = _tile_pages(j0 + STAGES * BLOCK, hi, S, bt_row, wr, PS)
            waddr, wok = _code_offsets(j0 + (STAGES - 1) * BLOCK, hi, S, tpage_c, sc_p, sc_s, wr, word_in_group, PS,
                                       WIDE)
            st_in = (it + STAGES - 1) % STAGES
            _copy_to_shared(kbuf.index(st_in), kc_h + waddr, mask=wok)
            _copy_to_shared(vbuf.index(st_in), vc_h + waddr, mask=wok)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)  # block i has landed
            kwords = kbuf.index(it % STAGES).load(WL)
            vwords = vbuf.index(it % STAGES).load(WL)
            tpage_c = tpage_cn
        key = j0 + key_in_block
        if MASK_KIND == 3:  # one interval of visible keys, [first, hi): the caller folded its last key into hi
            kok = (key < hi) & (key >= first)
        else:
            kok = (key < hi) & (key <= row_pos)
        if MASK_KIND == 1 and not MASK_HEADS:  # one mask row for every head (a model's usual mask): a load a key
            kin = key < mask_len
            mv = gl.load(mask_ptr + b * smk_b + gl.where(kin, key, 0) * smk_j, mask=kok & kin, other=0)
            kok = kok & kin & (mv != 0)
        ksc, kmn = _meta_pair(kmeta)
        vsc, vmn = _meta_pair(vmeta)
        if SUBNORMAL:
            ksc = ksc * SUBNORMAL_UNIT

        k_op = _unpack(kwords, NW, NT, D, 0, A_OP, SUBNORMAL)
        if KCH:
            qk_op, kbias = _key_page_query(q, cw, ksc_p, kmn_p, B_OP, HEADS, KEY_FOLD)
            s = mma_v2(k_op, qk_op, gl.zeros([NW, NT * 16, 8], gl.float32, MMA))
            unit = 1.0 / KEY_FOLD
            if SUBNORMAL:
                unit = SUBNORMAL_UNIT / KEY_FOLD
            s = s * unit + gl.expand_dims(kbias, 1)
        else:
            s = mma_v2(k_op, q_op, gl.zeros([NW, NT * 16, 8], gl.float32, MMA))
            s = s * gl.expand_dims(ksc, 2) + gl.expand_dims(kmn, 2) * gl.expand_dims(qsum, 1)
        vis = gl.expand_dims(kok, 2)
        if MASK_KIND == 1 and MASK_HEADS:
            key3 = gl.expand_dims(key, 2)
            in_mask = key3 < mask_len
            mptr = mask_ptr + b * smk_b + (h * G + gl.expand_dims(gl.expand_dims(heads, 0), 1)) * smk_h \
                + gl.where(in_mask, key3, 0) * smk_j
            hmask = gl.expand_dims(gl.expand_dims(heads, 0), 1) < G
            mv = gl.load(mptr, mask=vis & in_mask & hmask, other=0)
            vis = vis & in_mask & (mv != 0)
        s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        v_op = _unpack(vwords, NW, NT, D, 1, A_OP, SUBNORMAL)
        if NW == 1:
            # one warp a program: the state is rescaled only when some head's running max grew, which
            # after the first blocks is rare (the test is a warp reduction, the branch warp-uniform)
            if gl.max(gl.max((m_new > m_i).to(gl.int32), axis=1), axis=0) > 0:
                alpha = gl.expand_dims(gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new)), 1)
                l_acc = l_acc * alpha
                pm_acc = pm_acc * alpha
                o = o * alpha
                m_i = m_new
            p = gl.exp2(s - gl.expand_dims(gl.where(m_i == float("-inf"), 0.0, m_i), 1))
            # a hidden key has s = -inf, so p = 0 exactly (the running max is finite or taken as 0), and its
            # metadata is finite (0 past hi): no select on p
            l_acc = l_acc + p
            pm_acc = pm_acc + p * gl.expand_dims(vmn, 2)
            pv = (p * gl.expand_dims(vsc, 2)).to(gl.float16)
            o = mma_v2(v_op, gl.convert_layout(pv, B_OP), o)
        else:
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.expand_dims(gl.exp2(m_i - m_safe), 1)
            p = gl.exp2(s - gl.expand_dims(m_safe, 1))
            l_acc = l_acc * alpha + p
            pm_acc = pm_acc * alpha + p * gl.expand_dims(vmn, 2)  # p = 0 for hidden keys (see above)
            pv = (p * gl.expand_dims(vsc, 2)).to(gl.float16)
            o = mma_v2(v_op, gl.convert_layout(pv, B_OP), o * alpha)
            m_i = m_new
        kmeta, vmeta, tpage_n = km_n, vm_n, tpage_nn
        if KCH:
            ksc_p, kmn_p = ksc_pn, kmn_pn
        if STAGES == 1:
            kwords, vwords = kw_n, vw_n
        it += 1

    return m_i, l_acc, pm_acc, o


@gluon.jit
def _page_decode_kernel(
    qq_ptr, pos_ptr, sp_b, len_ptr, sl_b, c0_ptr, kc_ptr, km_ptr, vc_ptr, vm_ptr, bt_ptr, sbt_b,
    sc_p, sc_s, sm_p, sm_s, mask_ptr, smk_b, smk_h, smk_j, mask_len, mb_ptr, smb_b,
    part_m_ptr, part_l_ptr, part_o_ptr, keys_per_split, S, W, NS,
    H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, PS: gl.constexpr, NW: gl.constexpr, NT: gl.constexpr,
    HAS_CHUNK: gl.constexpr, MASK_KIND: gl.constexpr, IS_CAUSAL: gl.constexpr, SUBNORMAL: gl.constexpr,
    WIDE: gl.constexpr, STAGES: gl.constexpr, MASK_HEADS: gl.constexpr = True, MASK_BOUNDS: gl.constexpr = False,
    skm_p=0, skm_h=0, KCH: gl.constexpr = False,
):
    """One split of one (row, KV head): keys ``[S + split * keys_per_split, ...)`` of the page region.

    ``kc_ptr``/``vc_ptr``: the code pools as int32 words (fragment order); ``km_ptr``/``vm_ptr``: the
    metadata as int32 (scale | min << 16); strides in those units. ``qq``: the rotated, scaled queries
    ``[B H G, D]`` fp16 (row ``pid_bh G + n``). A bool mask (MASK_KIND 1) is read a key and head, or a key
    where every head shares its row (``MASK_HEADS`` off: head stride 0). ``KCH``: per-channel keys, ``km_ptr`` their
    fp16 page metadata ``[pages, 1, H, 2 D]`` (strides ``skm_p``, ``skm_h``), ``sm_*`` the values'; the page region
    ends at the last whole page.
    """
    gl.static_assert(D == 64 or D == 128 or D == 256)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    KEYS: gl.constexpr = gl.SliceLayout(2, MMA)  # [NW, NT 16]
    HEADS: gl.constexpr = gl.SliceLayout(1, MMA)  # [NW, 8]
    WL: gl.constexpr = gl.BlockedLayout([1, D // 32], [1, 32], [NW, 1], [1, 0])  # [NT NW, D] words
    QL: gl.constexpr = gl.BlockedLayout([1, 4, 1], [1, 4, 8], [NW, 1, 1], [1, 2, 0])  # [NW, D, 8]
    BLOCK: gl.constexpr = NW * NT * 16

    pid_bh = gl.program_id(0)
    b = (pid_bh // H).to(gl.int64)
    h = pid_bh % H
    split = gl.program_id(1)
    length = gl.load(len_ptr + b * sl_b).to(gl.int32)
    if HAS_CHUNK:
        c0 = gl.load(c0_ptr + b).to(gl.int32)
    else:
        c0 = length
    if KCH:  # whole pages (checks.quantized_len): the ring holds W + PS - 1 tokens
        q_end = S + gl.maximum(length - S - (W - PS + 1), 0) // PS * PS
    else:
        q_end = length - W
    page_end = gl.maximum(gl.minimum(q_end, c0), S)
    lo = S + split * keys_per_split
    hi = gl.minimum(lo + keys_per_split, page_end)

    # the query heads of this KV head as the B operand (Q^T, D x 8; heads >= G are zero), once
    qn = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, QL)))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, QL)))
    qw = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, QL)))
    qoff = (pid_bh * G + gl.expand_dims(gl.expand_dims(qn, 0), 1)) * D + gl.expand_dims(gl.expand_dims(qc, 0), 2) \
        + gl.expand_dims(gl.expand_dims(qw, 1), 2) * 0
    qmask = (gl.expand_dims(gl.expand_dims(qn, 0), 1) < G) & (qoff >= 0)
    q = gl.load(qq_ptr + qoff, mask=qmask, other=0.0)
    q_plain = q  # per-channel keys scale it by each block's page scales
    qsum = gl.convert_layout(gl.sum(q.to(gl.float32), axis=1), HEADS)  # [NW, 8]
    if SUBNORMAL:  # channel c's codes come out as 4^k c 2^-24: the query takes the 4^-k (exact, a power of 2)
        q = (q.to(gl.float32) * gl.expand_dims(gl.expand_dims(_code_weight(qc), 0), 2)).to(gl.float16)
    q_op = gl.convert_layout(q, B_OP)

    # index tensors: words [NT NW, D] and keys [NW, NT 16]
    wr = gl.arange(0, NT * NW, layout=gl.SliceLayout(1, WL))
    wc = gl.arange(0, D, layout=gl.SliceLayout(0, WL))
    word_in_group = gl.expand_dims((wc // (D // 16)) * sc_s + wc % (D // 16), 0)
    kw_ = gl.arange(0, NW, layout=gl.SliceLayout(1, KEYS))
    kk = gl.arange(0, NT * 16, layout=gl.SliceLayout(0, KEYS))
    key_in_block = (gl.expand_dims(kk // 16, 0) * NW + gl.expand_dims(kw_, 1)) * 16 + gl.expand_dims(kk % 16, 0)
    heads = gl.arange(0, 8, layout=gl.SliceLayout(0, HEADS))
    bt_row = bt_ptr + b * sbt_b
    kc_h, vc_h = kc_ptr + h * (D // 16), vc_ptr + h * (D // 16)
    if KCH:
        km_h = km_ptr + h * skm_h
    else:
        km_h = km_ptr + h
    vm_h = vm_ptr + h
    cw = gl.full([D], 1.0, gl.float32, gl.SliceLayout(0, gl.SliceLayout(2, QL)))
    if SUBNORMAL:
        cw = _code_weight(qc)

    if IS_CAUSAL:  # a decode query sees keys up to its own position (all page keys, but for odd positions)
        row_pos = gl.load(pos_ptr + b * sp_b).to(gl.int32)
    else:
        row_pos = page_end

    if MASK_KIND == 1 and not MASK_HEADS and MASK_BOUNDS:
        # a bool mask row every head shares (a model's [B, 1, 1, L]) with its bounds: where it is one interval of
        # visible keys (what models pass), two compares a key (MASK_KIND 3, a loop of its own); else a byte a key.
        # (Three calls: one `if interval:` with a compile-time False on the other paths crashes Triton 3.6's backend.)
        first = gl.load(mb_ptr + b * smb_b)
        last = gl.load(mb_ptr + b * smb_b + 1)
        if gl.load(mb_ptr + b * smb_b + 2) != 0:
            # the interval narrows the split: whole blocks before it are skipped, and keys past it (or past the
            # query's position) are neither loaded nor compared; a key costs the two compares of an unmasked call
            lo_i = lo + gl.maximum(first - lo, 0) // BLOCK * BLOCK
            hi_i = gl.minimum(gl.minimum(hi, last + 1), row_pos + 1)
            m_i, l_acc, pm_acc, o = _page_loop(
                q_op, qsum, kc_h, vc_h, km_h, vm_h, bt_row, mask_ptr, b, h, smk_b, smk_h, smk_j, mask_len,
                sc_p, sc_s, sm_p, sm_s, lo_i, hi_i, S, row_pos, first, wr, word_in_group, key_in_block, heads,
                G, D, PS, NW, NT, 3, SUBNORMAL, WIDE, STAGES, MASK_HEADS, MMA, WL, q_plain, cw, skm_p, qw, qc, KCH)
        else:
            m_i, l_acc, pm_acc, o = _page_loop(
                q_op, qsum, kc_h, vc_h, km_h, vm_h, bt_row, mask_ptr, b, h, smk_b, smk_h, smk_j, mask_len,
                sc_p, sc_s, sm_p, sm_s, lo, hi, S, row_pos, first, wr, word_in_group, key_in_block, heads,
                G, D, PS, NW, NT, 1, SUBNORMAL, WIDE, STAGES, MASK_HEADS, MMA, WL, q_plain, cw, skm_p, qw, qc, KCH)
    else:
        m_i, l_acc, pm_acc, o = _page_loop(
            q_op, qsum, kc_h, vc_h, km_h, vm_h, bt_row, mask_ptr, b, h, smk_b, smk_h, smk_j, mask_len,
            sc_p, sc_s, sm_p, sm_s, lo, hi, S, row_pos, 0, wr, word_in_group, key_in_block, heads,
            G, D, PS, NW, NT, MASK_KIND, SUBNORMAL, WIDE, STAGES, MASK_HEADS, MMA, WL, q_plain, cw, skm_p, qw,
            qc, KCH)
    # combine the warps, then write this split's partial state (rotated basis, channel order)
    if SUBNORMAL:  # value channel c came out as 4^k c 2^-24
        oc_ = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        o = o * gl.expand_dims(gl.expand_dims(_code_weight(oc_) * SUBNORMAL_UNIT, 0), 2)
    o = o + gl.expand_dims(gl.sum(pm_acc, axis=1), 1)
    l_w = gl.sum(l_acc, axis=1)
    m_all = gl.max(m_i, axis=0)
    m_all_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
    wgt = gl.exp2(m_i - gl.expand_dims(m_all_safe, 0))  # [NW, 8]
    l_all = gl.sum(l_w * wgt, axis=0)
    o_all = gl.sum(o * gl.expand_dims(wgt, 1), axis=0)  # [D, 8]
    base = (pid_bh * G + heads) * NS + split
    gl.store(part_m_ptr + base, m_all, mask=heads < G)
    gl.store(part_l_ptr + base, l_all, mask=heads < G)
    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    on = gl.arange(0, 8, layout=gl.SliceLayout(0, OL))
    oc = gl.arange(0, D, layout=gl.SliceLayout(1, OL))
    obase = (pid_bh * G + on) * NS + split
    gl.store(part_o_ptr + gl.expand_dims(obase, 0) * D + gl.expand_dims(oc, 1), o_all,
             mask=gl.expand_dims(on < G, 0) & gl.expand_dims(oc >= 0, 1))


def launch_pages(grid, qq, pos, lens, c0, kw, km, vw, vm, block_table, mask, mask_strides, mask_len, part_m, part_l,
                 part_o, keys_per_split, S, W, NS, H, G, D, PS, has_chunk, mask_kind, is_causal, num_warps=4, tiles=1,
                 subnormal=True, stages=1, mask_bounds=None, key_channel=False):
    """Launch :func:`_page_decode_kernel` (arguments as the Triton page region's; pools as int32 views).

    ``mask_bounds``: ``(first, last, one_interval)`` int32 ``[B, 3]`` of a bool mask whose rows every head
    shares (``triton_attention._mask_bounds``); where a row is one interval the kernel reads its bounds instead
    of a byte a key. Without it such a mask is read a byte a key."""
    use_bounds = mask_kind == 1 and mask_strides[1] == 0 and mask_bounds is not None
    bounds = mask_bounds if use_bounds else lens
    if key_channel and not (tiles == 1 or (num_warps == 1 and tiles * 16 <= PS)):
        raise ValueError(f"oscar: the Gluon decode kernel reads per-channel keys with one 16-key tile a warp, or one "
                         f"warp whose tiles fit a page (got {num_warps} warps x {tiles} tiles, pages of {PS})")
    meta_strides = (vm if key_channel else km).stride()  # the per-key metadata's (per-channel keys: the values')
    return _page_decode_kernel[grid](
        qq, pos, pos.stride(0), lens, lens.stride(0), c0, kw, km, vw, vm, block_table, block_table.stride(0),
        kw.stride(0), kw.stride(1), meta_strides[0], meta_strides[1],
        mask, mask_strides[0], mask_strides[1], mask_strides[3], mask_len, bounds, bounds.stride(0),
        part_m, part_l, part_o, keys_per_split, S, W, NS,
        H=H, G=G, D=D, PS=PS, NW=num_warps, NT=tiles, HAS_CHUNK=has_chunk, MASK_KIND=mask_kind,
        IS_CAUSAL=bool(is_causal), SUBNORMAL=bool(subnormal), WIDE=max(kw.numel(), km.numel()) >= 2**31,
        STAGES=stages, MASK_HEADS=mask_kind == 1 and mask_strides[1] != 0, MASK_BOUNDS=use_bounds, num_warps=num_warps,
        skm_p=km.stride(0) if key_channel else 0, skm_h=km.stride(2) if key_channel else 0, KCH=bool(key_channel),
    )
