"""The byte order of INT2 codes inside a page: tensor-core fragment order (DESIGN.md section 3).

The logical format of a cache row is "quartered" (:func:`oscar_compile.quant.pack_int2`). Inside a
page, the code pools store the codes of each KV head in *fragment order* instead, chosen so that the
decode kernel (:mod:`.gluon_decode`) reads them with one 16-byte load per thread that already holds
exactly the codes of its ``mma.m16n8k16`` operand fragments, unpacked in registers with no shuffle:

* Pages are cut into groups of 16 slots. For one KV head, the 16 rows of a group (``d/16`` 32-bit words
  each) are read as ``16 d/16`` consecutive words: lane ``L`` of a warp owns words ``L d/32 ...
  (L + 1) d/32 - 1`` (word ``a`` is row ``a // (d/16)``, word ``a % (d/16)`` of that row).
* Lane ``L = 4 g + t``, its word ``wi = hi (d/64) + c64`` (``c64 = channel // 64``), bit ``16 half +
  2 jj`` of that word, with ``jj = 4 j2 + 2 j1 + j0``, holds the code of
    - keys (the MMA's A operand, keys x channels):  slot ``8 hi + g``,           channel ``64 c64 + 32 j2 + 16 j1 + 8 j0 + 2 t + half``;
    - values (the A operand of O^T = V^T P^T, channels x keys): slot ``8 hi + 2 t + half``, channel ``64 c64 + 32 j2 + 16 j1 + 8 j0 + g``.

So in both, a byte holds four codes of one slot (channels ``b, b + 8, b + 16, b + 24`` at bits 0, 2, 4,
6), a key owns whole words and a value whole 16-bit halves: a token is written without touching any
other token's bits. Scales and minimums keep the logical layout (one pair per slot).

This module is the one definition of the permutation: the reference ops read and write pages through
:func:`read_codes` / :func:`write_codes`, the Triton store kernel and both attention kernels compute
the same addresses, and ``tests/kernels/test_fragment_order.py`` checks it against the logical format.
"""

from __future__ import annotations

import functools

import torch

GROUP = 16  # slots per fragment group (the MMA's 16 rows)


def supported(head_dim: int, page_size: int) -> bool:
    """Whether a cache of this geometry can hold fragment order (else it keeps the logical order)."""
    return head_dim % 64 == 0 and page_size % GROUP == 0


@functools.lru_cache(maxsize=16)
def _tables(kind: str, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat byte index in the group block [GROUP rows x d/4 bytes], bit shift)`` of every
    ``(slot, channel)``, each ``[GROUP, d]`` (CPU, int64)."""
    assert kind in ("k", "v") and d % 64 == 0
    words_per_row, words_per_lane, blocks = d // 16, d // 32, d // 64
    flat = torch.empty(GROUP, d, dtype=torch.int64)
    shift = torch.empty(GROUP, d, dtype=torch.int64)
    for g in range(8):
        for t in range(4):
            lane = 4 * g + t
            for hi in range(2):
                for c64 in range(blocks):
                    word = lane * words_per_lane + hi * blocks + c64
                    row, col = divmod(word, words_per_row)
                    for jj in range(8):
                        j2, j1, j0 = jj >> 2, (jj >> 1) & 1, jj & 1
                        for half in range(2):
                            bit = 16 * half + 2 * jj
                            if kind == "k":
                                slot, ch = 8 * hi + g, 64 * c64 + 32 * j2 + 16 * j1 + 8 * j0 + 2 * t + half
                            else:
                                slot, ch = 8 * hi + 2 * t + half, 64 * c64 + 32 * j2 + 16 * j1 + 8 * j0 + g
                            flat[slot, ch] = row * (d // 4) + col * 4 + bit // 8
                            shift[slot, ch] = bit % 8
    return flat, shift


@functools.lru_cache(maxsize=32)
def _tables_on(kind: str, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    flat, shift = _tables(kind, d)
    return flat.to(device), shift.to(device)


def _locate(kind: str, d: int, slots: torch.Tensor, device):
    """Per slot (any shape ``[N]``): (group's first slot ``[N]``, row offset ``[N, d]``, byte ``[N, d]``, shift ``[N, d]``)."""
    flat, shift = _tables_on(kind, d, torch.device(device))
    s = slots % GROUP
    f = flat[s]
    return slots - s, f // (d // 4), f % (d // 4), shift[s]


def read_codes(codes: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, kind: str) -> torch.Tensor:
    """Codes (0..3, uint8) of cache rows ``(pages[i], slots[i])``: ``[N, H, d]`` from a pool in fragment order."""
    _, _, h, q = codes.shape
    d = 4 * q
    base, row, byte, shift = _locate(kind, d, slots.long(), codes.device)
    heads = torch.arange(h, device=codes.device)
    raw = codes[pages.long()[:, None, None], (base[:, None] + row)[:, None, :], heads[None, :, None], byte[:, None, :]]
    return (raw >> shift[:, None, :].to(torch.uint8)) & 3


def write_codes(codes: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, kind: str) -> None:
    """Write codes ``values`` (``[N, H, d]``, 0..3) of rows ``(pages[i], slots[i])`` into a pool in fragment order.

    Every byte of the pool belongs to one slot, so the bytes of a row are assembled whole and stored;
    no other row's codes are read or changed. Rows must be distinct.
    """
    n, h, d = values.shape
    if n == 0:
        return
    # byte e = 8 blk + r of a row holds channels 32 blk + r + 8 q at bits 2q (as the Triton store packs it)
    c = values.to(torch.uint8).view(n, h, d // 32, 4, 8)
    packed = (c[:, :, :, 0] | c[:, :, :, 1] << 2 | c[:, :, :, 2] << 4 | c[:, :, :, 3] << 6).view(n, h, d // 4)
    base_channel = (32 * torch.arange(d // 32)[:, None] + torch.arange(8)).view(-1)  # [d/4], byte e's channel
    group, row, byte, _ = _locate(kind, d, slots.long(), codes.device)
    row, byte = row[:, base_channel], byte[:, base_channel]  # where each of the row's d/4 bytes lives
    heads = torch.arange(h, device=codes.device)
    codes[pages.long()[:, None, None], (group[:, None] + row)[:, None, :], heads[None, :, None], byte[:, None, :]] = packed


def in_fragment_order(codes: torch.Tensor) -> bool:
    """Whether a code pool ``[num_pages, page_size, H, d/4]`` holds fragment order (its geometry allows
    it); pools of other geometries (head_dim 80 or 96, pages of 8 tokens) keep the logical order."""
    return supported(4 * codes.shape[-1], codes.shape[1])


@functools.lru_cache(maxsize=32)
def _page_permutation(kind: str, d: int, device: torch.device) -> torch.Tensor:
    """``[16 d]``: where the code of (slot ``s``, channel ``c``) of a fragment group sits among the group's codes
    unpacked byte by byte (byte ``e`` of the group's ``16 d/4``, one head, gives codes ``4 e .. 4 e + 3`` from
    bits 0, 2, 4, 6)."""
    flat, shift = _tables(kind, d)
    return (4 * flat + shift // 2).reshape(-1).to(device)


def read_page_codes(codes: torch.Tensor, pages: torch.Tensor, kind: str) -> torch.Tensor:
    """Codes (0..3, uint8) of whole pages, logical channel order: ``[*pages.shape, page_size, H, d]``.

    The same values as :func:`read_codes` on every slot of those pages, read a page at a time: one unpack of the
    page's bytes and one fixed permutation per fragment group, instead of four index tensors per code. The CPU
    reference reads a row's whole history every decode step, so this is most of its cost."""
    from ..quant import unpack_int2

    raw = codes[pages.long()]  # [*P, ps, H, d/4]
    if not in_fragment_order(codes):
        return unpack_int2(raw)
    *lead, ps, h, q = raw.shape
    d = 4 * q
    groups = raw.reshape(-1, ps // GROUP, GROUP, h, q).transpose(2, 3)  # [N, groups, H, 16, d/4]
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device)
    unpacked = ((groups[..., None] >> shifts) & 3).reshape(*groups.shape[:3], GROUP * d)  # byte-major, 4 a byte
    ordered = unpacked.index_select(-1, _page_permutation(kind, d, codes.device))  # [N, groups, H, 16 d]
    return ordered.view(*groups.shape[:3], GROUP, d).transpose(2, 3).reshape(*lead, ps, h, d)


def read_rows(codes: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, kind: str) -> torch.Tensor:
    """Logical (quartered) packed rows ``[*pages.shape, H, d/4]`` of cache rows ``(pages, slots)``."""
    if not in_fragment_order(codes):
        return codes[pages, slots]
    from ..quant import pack_int2

    flat = read_codes(codes, pages.reshape(-1), slots.expand_as(pages).reshape(-1), kind)
    return pack_int2(flat).view(*pages.shape, codes.shape[2], codes.shape[3])


def write_rows(codes: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor, kind: str) -> None:
    """Write logical (quartered) packed rows ``packed [N, H, d/4]`` to cache rows ``(pages[i], slots[i])``."""
    if not in_fragment_order(codes):
        codes[pages, slots] = packed
        return
    from ..quant import unpack_int2

    write_codes(codes, pages, slots, unpack_int2(packed), kind)


def logical_pool(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """A whole code pool in the logical (quartered) order (a copy; tests and tools)."""
    if not in_fragment_order(codes):
        return codes.clone()
    n, ps = codes.shape[:2]
    pages = torch.arange(n, device=codes.device).repeat_interleave(ps)
    slots = torch.arange(ps, device=codes.device).repeat(n)
    return read_rows(codes, pages, slots, kind).view(codes.shape)
