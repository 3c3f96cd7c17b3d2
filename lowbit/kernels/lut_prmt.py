"""Register-table lookup of 4-bit codes by ``prmt`` (the table of the LUT kernels held in 8 registers).

Used by the register-table LUT GEMM (``lowbit.kernels.lut_wgmma``). (The fragment kernel carried it as an option in
place of its shared-memory pair table in session 13; timed slower at 1-4 tokens, removed in session 14.) A 16-entry table of 16-bit values
(the activation dtype) is split into its low and high bytes, 4 + 4 registers (``L0..L3``, ``H0..H3``: entry e's
low byte is byte e % 4 of ``L[e // 4]``). A code word holds 8 nibbles ``j = 4 bh + 2 rh + h`` (the fragment layout
of ``formats.lut.pack_codes_mma``: row g + 8 rh of the row tile, K pair 2 bh + h of the lane's k-step); per group of
4 nibbles the low 3 bits select a byte of ``{L0, L1}`` and of ``{L2, L3}`` in one ``prmt`` each, the high bit --
expanded to a byte mask by one sign-replicating ``prmt`` of the word and the word << 4 -- picks between them
(``lop3``); the same for the high bytes, and two ``prmt`` interleave low and high bytes into two 16-bit value pairs.
22 integer instructions per 8 codes, no memory access. The 4 pairs of a word are the 4 registers of an
``m16n8k16`` A fragment: (bh 0, rh 0), (bh 0, rh 1), (bh 1, rh 0), (bh 1, rh 1).
"""
from __future__ import annotations

import triton
import triton.language as tl

DECODE_REGS = ".reg .b32 dsa, dsb, dw4, dma, dmb, dx, dy, dlo, dhi, dn;"


def decode_lines(word: str, lo: list[str], hi: list[str], out: list[str]) -> list[str]:
    """PTX lines decoding the code word ``word`` with the byte tables ``lo`` (``L0..L3``) and ``hi`` (``H0..H3``)
    into the 4 value pairs ``out`` (registers or operands, in A-fragment order; low half = nibble h 0). Needs the
    temporaries of ``DECODE_REGS``."""
    lines = [f"and.b32 dsa, {word}, 0x7777;", f"shr.u32 dsb, {word}, 16;", "and.b32 dsb, dsb, 0x7777;",
             f"shl.b32 dw4, {word}, 4;",
             f"prmt.b32 dma, dw4, {word}, 0xD9C8;",  # byte i = sign of nibble i's bit 3 (nibbles 0..3)
             f"prmt.b32 dmb, dw4, {word}, 0xFBEA;"]  # nibbles 4..7
    for sel, mask, o in (("dsa", "dma", out[:2]), ("dsb", "dmb", out[2:])):
        for dst, t in (("dlo", lo), ("dhi", hi)):  # entries 0-7 from {T0, T1}, 8-15 from {T2, T3}; the mask picks
            lines += [f"prmt.b32 dx, {t[0]}, {t[1]}, {sel};", f"prmt.b32 dy, {t[2]}, {t[3]}, {sel};",
                      f"lop3.b32 {dst}, dx, dy, {mask}, 0xD8;"]
        lines += [f"prmt.b32 {o[0]}, dlo, dhi, 0x5140;",  # nibbles (4 bh, 4 bh + 1): rows g
                  f"prmt.b32 {o[1]}, dlo, dhi, 0x7362;"]  # nibbles (4 bh + 2, 4 bh + 3): rows g + 8
    return lines


def byte_table_words(values: list[int]) -> list[int]:
    """Host form of ``_byte_tables`` (which the Gluon kernel's ``_tables`` calls), the tests' reference: the 16-bit bit
    patterns of the 16 entries (missing entries 0) -> the 8 register words ``L0..L3, H0..H3`` as signed int32 values
    (``L[j]`` byte i = low byte of entry ``4 j + i``)."""
    words = [0] * 8
    for e, v in enumerate(values):
        words[e // 4] |= (v & 0xFF) << (8 * (e % 4))
        words[4 + e // 4] |= ((v >> 8) & 0xFF) << (8 * (e % 4))
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


@triton.jit
def _entry_row(e, BITS: tl.constexpr):
    """Row of ``pair_table`` whose first value is table entry e (4-bit: e; 3-bit: the pair index with lo bits
    ``e & 3`` and hi bit ``e >> 2`` of the first code, ``formats.lut.pair_table``)."""
    if BITS == 4:
        return e
    else:
        return (e & 3) + 16 * (e >> 2)


@triton.jit
def _byte_tables(P, BITS: tl.constexpr):
    """The 2**BITS entries (``pairs[row, 0]`` = T[e] in the activation dtype, int16 bits) -> the 8 byte-table
    registers: ``L[j]`` byte i = low byte of T[4 j + i], ``H[j]`` the high bytes (3-bit: ``L2, L3, H2, H3`` = 0,
    never selected: the decoded nibbles' bit 3 is 0)."""
    PI = P.to(tl.pointer_type(tl.int16))
    v = tl.load(PI + 2 * _entry_row(0, BITS)).to(tl.int32) & 0xFFFF  # entry 0 (scalar code throughout, with no
    lo0 = v & 0xFF  # layout-less tl.full: the Gluon kernel calls this helper too)
    hi0 = v >> 8
    lo1 = lo0 * 0
    lo2 = lo1
    lo3 = lo1
    hi1 = lo1
    hi2 = lo1
    hi3 = lo1
    for e in tl.static_range(1, 1 << BITS):
        v = tl.load(PI + 2 * _entry_row(e, BITS)).to(tl.int32) & 0xFFFF
        lb = (v & 0xFF) << (8 * (e % 4))
        hb = (v >> 8) << (8 * (e % 4))
        if e // 4 == 0:
            lo0 |= lb
            hi0 |= hb
        elif e // 4 == 1:
            lo1 |= lb
            hi1 |= hb
        elif e // 4 == 2:
            lo2 |= lb
            hi2 |= hb
        else:
            lo3 |= lb
            hi3 |= hb
    return lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3
