"""Triton LUT GEMM for 9..128 tokens: the 3/4-bit table in registers (``prmt``), ``tl.dot`` on the tensor cores.

Same product and format as ``lowbit.kernels.lut_gemm`` (FLUTE, seed 002)::

    Y[m, n] = sum_k X[m, k] * T[c[n, k]] * s[k // G, n]

and the same packed codes: the fragment layout of ``formats.lut.pack_codes_mma`` (4-bit, G in 64/128/256; 3-bit,
G in 128/256, merged in registers into the 4-bit word layout first, ``_words3``), so a ``LUTLinear`` holds one copy
of its weight for both kernels. Where the fragment kernel (``_lut_mma_kernel``)
looks every code pair up in a shared-memory table and issues ``mma.sync`` itself -- the right trade at M <= 16,
where its instruction stream is all lookups -- this kernel leaves the multiply to Triton's ``tl.dot`` (wgmma on
Hopper; the activation tile staged in shared memory by Triton's pipeliner, read once per program) and makes the
lookup a pure register computation:

- The 16 table entries in the activation dtype are split into their low and high bytes, 4 + 4 registers
  (``L0..L3``, ``H0..H3``: entry e's low byte is byte e % 4 of ``L[e // 4]``). One code word holds the 8 codes
  of one lane and k-step (``pack_codes_mma``: nibble ``j = 4 bh + 2 rh + h`` = row ``16 rt + g + 8 rh``,
  K ``64 c + 16 t + 4 s + 2 bh + h``). Per group of 4 nibbles: the low 3 bits of each (``& 0x7777``) select a
  byte of ``{L0, L1}`` and of ``{L2, L3}`` in one ``prmt`` each, the high bit -- expanded to a byte mask by one
  sign-replicating ``prmt`` of the word and the word shifted by 4 -- picks between them (``lop3``); the same
  for the high bytes, and two ``prmt`` interleave low and high bytes into the four 16-bit values. 22
  integer instructions per 8 codes, no memory access, no shared memory.
- Per chunk (64 K) and program (``16 RT`` rows), the words are loaded as ``[8 RT, 16]`` (row ``(rt, g)``,
  column ``4 t + s`` = 64 contiguous bytes per row), decoded into two ``[8 RT, 64]`` tiles -- rows ``g`` and
  ``g + 8`` of every row tile, K in natural order -- and each tile is one ``tl.dot`` against the ``[64, BLOCK_M]``
  activation tile ("swap AB": the weights are the wide M side, the tokens the narrow N side).
  3-bit: 128 K per chunk, the two planes merged into ``[8 RT, 32]`` words of the 4-bit layout first.
- FP32 accumulation; the products of one scale group are summed first and scaled once
  (``acc += part * s``, FP32), as in the fragment kernel. The table values are rounded to the activation dtype
  (``formats.lut.pair_table``, the fragment kernel's rounding). The option ``scale_w`` (the kernel's ``SCALE_W``)
  instead rounds ``T[c] * s`` once to the activation dtype, as FLUTE's own kernel and the op's dequantize +
  cuBLAS path (M > 128) do, and runs one flat loop with the accumulator carried, which lets Triton keep wgmma
  groups in flight. Decision (numerics, session 13): the launch config picks it where it was measured faster
  (``wgmma_config``: 3-bit; 4-bit keeps the exact group scaling, faster there once ``REG_A`` removed the
  shared-memory round trip); both roundings stay within the bf16 / fp16 rounding of the weight (rel-L2 to the
  float64 product 2.15e-3 vs 2.23e-3 at NF4 g128, H100).
- ``REG_A`` (64-row tiles; on by default since session 13, at 3 bits up to 32 tokens): Triton otherwise passes
  the decoded tile through shared memory (``local_alloc`` + ``ldmatrix``) to reach the wgmma A-register
  fragment. Each thread already holds the right values under the code words' load layout (4 warps x 8 lanes over
  rows, 4 lanes x CK / 16 words over K); only their indices differ. ``_reg_a`` relabels them (rows
  ``32 i + 8 v + g`` -> ``16 v + 8 i + g``, K ``(CK / 4) t + 4 s + 2 a + b`` -> column ``16 s + 8 a + 2 t + b``),
  the activation tile is gathered in the same column order (4-byte pairs) and the output rows follow the
  relabelling, so the conversion is a register renaming: no ``ldmatrix``, fewer barriers (PTX checked offline
  with ``benchmarks/offline_ptx.py``). 5-20 % faster at 16..128 tokens at 4 bits, up to 18 % at 16..32 tokens
  at 3 bits (H200, ``wgmma_config``).
- ``SMEM_TAB`` (option ``smem_table``; session 23; on by default since session 24 at 4 bits up to 32 tokens and
  on gate_up-sized N up to 64, at 3 bits up to 16, measured in ``wgmma_config``): the decode
  instead looks each code byte up in the fragment kernel's lane-duplicated pair table (32 KB of shared memory past
  Triton's own buffers): shift, one ``LOP3``, one ``ld.shared`` per two codes, 8 integer instructions + 4 loads per
  8 codes instead of 22 integer instructions, the same values (``_lds_decode_asm``). Offline SASS per main loop
  (``benchmarks/offline_ptx.py --decode``), gate_up-sized at 16 / 32 / 64 tokens: 560 / 628 / 738 -> 391 / 457 /
  581. (A 64 KB 'wide' table, entries 256 bytes apart and one ``prmt`` per address, 335 / 390 / 518 SASS, lost or
  tied on the H200 in session 24 and was removed in session 26, as was ``x_perm``: see ``wgmma_config``.)
- Split-K over scale groups with the fragment kernel's deterministic in-kernel reduction (FP32 partials, the
  last program of a tile to arrive sums them in split order).
- ``SILU_MUL`` (session 26; option ``silu_mul``): a fused gate_up whose rows alternate gate / up in blocks of 8
  gives ``silu(gate) * up`` from the two dots' accumulators, element by element, after the reduction.

The interpreter (CPU tests) decodes the nibbles with shifts and a table load (``EMU``); the PTX path is checked
against it and the reference on the GPU (``tests/test_lut_wgmma.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import arg_specialization, cdiv, interpret_mode, resident_ctas
from lowbit.formats.lut import MMA_CHUNK, SILU_BLOCK, mma_shapes
from lowbit.kernels.lut_gemm import (_pick4, _sm_count, _store_pair_table, _workspace, balanced_split,
                                     busiest_sm_groups, fragment_x, gemm_output, mma_table_bytes, out_columns,
                                     planned_split, split_plan)
from lowbit.kernels.lut_prmt import DECODE_REGS, _byte_tables, _entry_row, decode_lines
from lowbit.kernels.silu_mul import silu_mul_f32


def _decode_asm(scaled: str | None = None) -> str:
    """PTX of one code word (8 nibbles, ``$8``) + the 8 byte-table registers (``$9..$12`` low bytes, ``$13..$16``
    high bytes) -> the 8 values in nibble order (16-bit outputs ``$0..$7``; the lookup: ``lut_prmt.decode_lines``).
    ``scaled`` ('bf16' / 'f16'): each value pair is then multiplied by its rows' scale pair (``$17`` rows g, ``$18``
    rows g + 8, the scale in both halves; ``mul.rn``: correctly rounded, the value ``T[c] * s`` of ``scale_w``, one
    packed multiply per 2 weights)."""
    lines = ["{", DECODE_REGS, ".reg .b32 o0, o1, o2, o3;"]
    lines += decode_lines("$8", ["$9", "$10", "$11", "$12"], ["$13", "$14", "$15", "$16"], ["o0", "o1", "o2", "o3"])
    for p in range(4):  # pair p = (bh, rh) = (p // 2, p % 2): nibbles 2 p, 2 p + 1
        if scaled:
            lines.append(f"mul.rn.{'bf16x2' if scaled == 'bf16' else 'f16x2'} o{p}, o{p}, ${17 + p % 2};")
        lines.append(f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, o{p};")
    return "\n".join(lines + ["}"])


def _lds_decode_asm(scaled: str | None = None) -> str:
    """PTX of the ``SMEM_TAB`` decode: one code word (``$8``) -> the same 8 values as ``_decode_asm`` by 4 lookups in
    the fragment kernel's lane-duplicated pair table (``lut_gemm._store_pair_table``: row ``b`` = the pair
    (T[b & 15], T[b >> 4]) of a code byte, entry e of lane l at ``128 e + 4 l``, so a warp's 32 lookups hit 32
    distinct banks), placed at shared offset ``$9`` past Triton's own shared memory. Per code byte: shift,
    and + or with the lane offset (one ``LOP3``), ``ld.shared.b32`` (the uniform table base folds into the
    address): 8 integer instructions + 4 loads per 8 codes against the byte tables' 22 integer instructions.
    ``scaled``: as ``_decode_asm`` (scale pairs ``$10`` rows g, ``$11`` rows g + 8)."""
    lines = ["{", ".reg .b32 t, l, g, o0, o1, o2, o3;", "mov.u32 l, %laneid;", "shl.b32 l, l, 2;",
             "mov.u32 g, global_smem;", "add.u32 g, g, $9;"]
    for b, sh in enumerate(("shl.b32 t, $8, 7;", "shr.u32 t, $8, 1;", "shr.u32 t, $8, 9;", "shr.u32 t, $8, 17;")):
        lines += [sh, "and.b32 t, t, 0x7F80;", "or.b32 t, t, l;", "add.u32 t, t, g;", f"ld.shared.b32 o{b}, [t];"]
    for p in range(4):  # pair p = code byte p = nibbles 2 p, 2 p + 1 = (bh, rh) = (p // 2, p % 2)
        if scaled:
            lines.append(f"mul.rn.{'bf16x2' if scaled == 'bf16' else 'f16x2'} o{p}, o{p}, ${10 + p % 2};")
        lines.append(f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, o{p};")
    return "\n".join(lines + ["}"])


_DECODE_ASM = tl.constexpr(_decode_asm())
_LDS_ASM = tl.constexpr(_lds_decode_asm())
_LDS_BF_SCALED_ASM = tl.constexpr(_lds_decode_asm("bf16"))
_LDS_F_SCALED_ASM = tl.constexpr(_lds_decode_asm("f16"))
_LDS_SCALED_CONS = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 4))
_LDS_CONS = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 2))
_DECODE_BF_SCALED_ASM = tl.constexpr(_decode_asm("bf16"))
_DECODE_F_SCALED_ASM = tl.constexpr(_decode_asm("f16"))
_DECODE_SCALED_CONS = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 11))
_DECODE_CONS = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 9))


@triton.jit
def _run_decode(args, ASM_BF: tl.constexpr, ASM_F: tl.constexpr, CONS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The decode PTX (``ASM_BF`` / ``ASM_F`` by the activation dtype) -> its 8 values per word."""
    if OUT_DTYPE == tl.bfloat16:
        return tl.inline_asm_elementwise(
            ASM_BF, CONS, args, is_pure=True, pack=1,
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                   tl.bfloat16))
    else:
        return tl.inline_asm_elementwise(
            ASM_F, CONS, args, is_pure=True, pack=1,
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16))


@triton.jit
def _scale_pairs(s0, s1, W: tl.constexpr):
    """The rows' scales ``s0`` / ``s1`` ``[R]`` (16-bit) each packed into both halves of a 32-bit word, broadcast to
    ``[R, W]``: the ``mul.rn.{bf16x2,f16x2}`` operands of the scaled decode PTX."""
    R: tl.constexpr = s0.shape[0]
    v0 = s0.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    v1 = s1.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return tl.broadcast_to((v0 | (v0 << 16))[:, None], [R, W]), tl.broadcast_to((v1 | (v1 << 16))[:, None], [R, W])


@triton.jit
def _decode(words, P, tabs, EMU: tl.constexpr, OUT_DTYPE: tl.constexpr, BITS: tl.constexpr, s0, s1,
            SCALE: tl.constexpr, SMEM_TAB: tl.constexpr = 0, tab_off=0):
    """4-bit-layout code words ``[R, W]`` (column = 4 t + s at 4 bits, 8 t + s at 3 bits: ``_words3``) ->
    (rows g, rows g + 8) ``[R, 4 W]`` in the activation dtype, K in natural order. ``SCALE`` (``scale_w``): 1 =
    the values times their rows' scales ``s0`` / ``s1`` ``[R]`` (activation dtype) by Triton's multiply, 2 = inside
    the PTX, each scale packed into both halves of a ``mul.rn.{bf16x2,f16x2}`` operand (the same values).
    ``SMEM_TAB``: the pair-table lookups of ``_lds_decode_asm`` (table at shared offset
    ``tab_off``; 3-bit: the 4-bit-indexed table of ``_store_pair_table(NIBBLES=True)``) in place of the byte-table
    ``prmt`` decode; the same values."""
    R: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    if EMU:
        PI = P.to(tl.pointer_type(OUT_DTYPE))
        n0 = tl.load(PI + 2 * _entry_row(words & 15, BITS))
        n1 = tl.load(PI + 2 * _entry_row((words >> 4) & 15, BITS))
        n2 = tl.load(PI + 2 * _entry_row((words >> 8) & 15, BITS))
        n3 = tl.load(PI + 2 * _entry_row((words >> 12) & 15, BITS))
        n4 = tl.load(PI + 2 * _entry_row((words >> 16) & 15, BITS))
        n5 = tl.load(PI + 2 * _entry_row((words >> 20) & 15, BITS))
        n6 = tl.load(PI + 2 * _entry_row((words >> 24) & 15, BITS))
        n7 = tl.load(PI + 2 * _entry_row((words >> 28) & 15, BITS))
    elif SMEM_TAB > 0:
        off = tl.full([R, W], 0, tl.int32) + tab_off
        if SCALE == 2:
            p0, p1 = _scale_pairs(s0, s1, W)
            n0, n1, n2, n3, n4, n5, n6, n7 = _run_decode([words, off, p0, p1], _LDS_BF_SCALED_ASM, _LDS_F_SCALED_ASM,
                                                         _LDS_SCALED_CONS, OUT_DTYPE)
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = _run_decode([words, off], _LDS_ASM, _LDS_ASM, _LDS_CONS, OUT_DTYPE)
    elif SCALE == 2:
        p0, p1 = _scale_pairs(s0, s1, W)
        lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = tabs
        n0, n1, n2, n3, n4, n5, n6, n7 = _run_decode([words, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, p0, p1],
                                                     _DECODE_BF_SCALED_ASM, _DECODE_F_SCALED_ASM,
                                                     _DECODE_SCALED_CONS, OUT_DTYPE)
    else:
        lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = tabs
        n0, n1, n2, n3, n4, n5, n6, n7 = _run_decode([words, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3],
                                                     _DECODE_ASM, _DECODE_ASM, _DECODE_CONS, OUT_DTYPE)
    # nibble j = 4 bh + 2 rh + h -> tile rh, column 4 (word column) + 2 bh + h
    w0 = tl.reshape(tl.join(tl.join(n0, n4), tl.join(n1, n5)), [R, 4 * W])
    w1 = tl.reshape(tl.join(tl.join(n2, n6), tl.join(n3, n7)), [R, 4 * W])
    if SCALE == 1 or (SCALE == 2 and EMU):
        w0 = _scaled(w0, s0, EMU)
        w1 = _scaled(w1, s1, EMU)
    return w0, w1


@triton.jit
def _scaled(w, s, EMU: tl.constexpr):
    """``w [R, C] * s [R]`` in the activation dtype, correctly rounded (the interpreter's 16-bit float arithmetic is
    not: it multiplies in float32 and rounds once, the same value)."""
    if EMU:
        return (w.to(tl.float32) * s.to(tl.float32)[:, None]).to(w.dtype)
    else:
        return w * s[:, None]


@triton.jit
def _words3(lo, hi):
    """3-bit fragment planes -> 4-bit-layout words ``[R, 32]`` (column 8 t + s, s = k-step 0..7), each nibble
    ``j = 4 bh + 2 rh + h`` = the 3-bit code (bit 3 zero). ``lo`` ``[R, 16]`` (column 4 t + e): byte b = 2 bh + rh
    holds k-step 2 e in its low nibble, 2 e + 1 in its high one, 2 bits per code (h 0 at bits 0-1, h 1 at 2-3);
    ``hi`` ``[R, 8]`` (column 2 t + q): byte b holds the high bits of k-steps 4 q + 2, 4 q + 3, 4 q, 4 q + 1 at bit
    pairs 0-1, 2-3, 4-5, 6-7 (``formats.lut.pack_codes_mma``)."""
    R: tl.constexpr = lo.shape[0]
    ls = tl.reshape(tl.join(lo, lo >> 4), [R, 32])  # column 8 t + 2 e + (s % 2) = 8 t + s
    hs = tl.reshape(tl.join(tl.join(hi >> 4, hi), tl.join(hi >> 6, hi >> 2)), [R, 32])  # (t, q, j = s % 4)
    return ((ls & 0x03030303) | ((ls << 2) & 0x30303030) | ((hs & 0x01010101) << 2)
            | ((hs & 0x02020202) << 5))


@triton.jit
def _chunk_words(q_rows, h_rows, c, ok, BITS: tl.constexpr):
    """The 4-bit-layout code words of chunk c: ``[8 RT, 16]`` (4-bit) or, from the two 3-bit planes, ``[8 RT, 32]``."""
    if BITS == 4:
        return tl.load(q_rows + c * 128, mask=ok, other=0)
    else:
        return _words3(tl.load(q_rows + c * 128, mask=ok, other=0), tl.load(h_rows + c * 64, mask=ok, other=0))


@triton.jit
def _group_words(q_rows, h_rows, c0, ok, CPG: tl.constexpr, BITS: tl.constexpr):
    """The code words of chunks c0 .. c0 + CPG - 1 (at most 4; unused slots repeat chunk c0)."""
    w0 = _chunk_words(q_rows, h_rows, c0, ok, BITS)
    w1 = w0
    w2 = w0
    w3 = w0
    if CPG >= 2:
        w1 = _chunk_words(q_rows, h_rows, c0 + 1, ok, BITS)
    if CPG >= 4:
        w2 = _chunk_words(q_rows, h_rows, c0 + 2, ok, BITS)
        w3 = _chunk_words(q_rows, h_rows, c0 + 3, ok, BITS)
    return w0, w1, w2, w3


@triton.jit
def _next_group_words(q_rows, h_rows, gi, g1, rt_ok, CPG: tl.constexpr, BITS: tl.constexpr):
    """The register double buffer (``PREFETCH``): the code words of group ``gi + 1``, none past the split's last
    group ``g1 - 1`` (called with ``gi = g0 - 1`` for the first group)."""
    return _group_words(q_rows, h_rows, (gi + 1) * CPG, rt_ok[:, None] & (gi + 1 < g1), CPG, BITS)


@triton.jit
def _group_dots(q_rows, h_rows, x_rows, x_ok, kx, K, gi, g1, rt_ok, nw0, nw1, nw2, nw3, P, tabs, TAB_OFF,
                RB: tl.constexpr, BR: tl.constexpr, BLOCK_M: tl.constexpr, CPG: tl.constexpr, CK: tl.constexpr,
                BITS: tl.constexpr, EMU: tl.constexpr, ODT: tl.constexpr, ONE_DOT: tl.constexpr, REG_A: tl.constexpr,
                PREFETCH: tl.constexpr, SMEM_TAB: tl.constexpr, MASK_K: tl.constexpr):
    """One scale group ``gi``'s unscaled FP32 products (``[RB, BLOCK_M]`` rows g, or both halves stacked with
    ``ONE_DOT``; ``[BR, BLOCK_M]`` rows g + 8) of the exact-scaling loop, shared by ``_lut_wgmma_kernel`` and the
    grouped MoE kernel (``moe_grouped._moe_lut_kernel``). ``PREFETCH``: ``nw*`` are this group's words, loaded one
    group ahead, and the next group's are returned in their place (else they pass through). The activation tile:
    ``x_rows + c CK`` under ``x_ok`` (``x_rows`` with the columns ``kx`` built in), or with ``MASK_K`` the row
    pointers ``x_rows`` + ``c CK + kx`` with the columns from ``K`` on masked (x not padded to the group)."""
    p0 = tl.zeros([RB, BLOCK_M], dtype=tl.float32)
    p1 = tl.zeros([BR, BLOCK_M], dtype=tl.float32)
    if PREFETCH:
        cw0, cw1, cw2, cw3 = nw0, nw1, nw2, nw3
        nw0, nw1, nw2, nw3 = _next_group_words(q_rows, h_rows, gi, g1, rt_ok, CPG, BITS)
    for cc in tl.static_range(CPG):
        c = gi * CPG + cc
        if PREFETCH:
            words = _pick4(cc, cw0, cw1, cw2, cw3)
        else:
            words = _chunk_words(q_rows, h_rows, c, rt_ok[:, None], BITS)
        if MASK_K:
            kk = c * CK + kx
            xt = tl.load(x_rows + kk[None, :], mask=x_ok & (kk < K)[None, :], other=0.0)
        else:
            xt = tl.load(x_rows + c * CK, mask=x_ok, other=0.0)
        w0, w1 = _decode(words, P, tabs, EMU, ODT, BITS, 0, 0, 0, SMEM_TAB, TAB_OFF)
        p0, p1 = _tile_dots(w0, w1, xt, p0, p1, ONE_DOT, REG_A)
    return p0, p1, nw0, nw1, nw2, nw3


@triton.jit
def _reg_a(w):
    """``[64, CK]`` decoded tile (row ``32 i + 8 v + g``, K ``(CK / 4) t + 4 s + 2 a + b`` natural, s < CK / 16)
    -> the same values relabelled (row ``16 v + 8 i + g``, column ``16 s + 8 a + 2 t + b``): the indices each
    thread already holds under the code words' load layout (4 warps v x 8 lanes g over rows, 4 lanes t x CK / 16
    words s over K) become those of the wgmma A-register fragment, so no shared-memory round trip is needed."""
    CK: tl.constexpr = w.shape[1]
    w = tl.reshape(w, [2, 4, 8, 4, CK // 16, 2, 2])
    return tl.reshape(tl.permute(w, (1, 0, 2, 4, 5, 3, 6)), [64, CK])


@triton.jit
def _reg_a_row(r):
    """The decoded tile's row behind row ``r`` of the ``_reg_a``-relabelled tile (``16 v + 8 i + g`` ->
    ``32 i + 8 v + g``)."""
    return 32 * ((r // 8) % 2) + 8 * (r // 16) + r % 8


@triton.jit
def _reg_a_k(c, CK: tl.constexpr):
    """The K offset (within a chunk) of column ``c`` of the ``_reg_a``-relabelled tile (``16 s + 8 a + 2 t + b``
    -> ``(CK / 4) t + 4 s + 2 a + b``): the activation tile is gathered in this order."""
    return (CK // 4) * ((c // 2) % 4) + 4 * (c // 16) + 2 * ((c // 8) % 2) + c % 2


@triton.jit
def _tile_dots(w0, w1, xt, a0, a1, ONE_DOT: tl.constexpr, REG_A: tl.constexpr = False):
    """The decoded halves (rows g, g + 8; ``[BR, CK]``) against the activation tile ``xt`` ``[BLOCK_M, CK]``: one dot
    per half into ``a0`` / ``a1``, or (``ONE_DOT``) the halves stacked into one ``[2 BR, CK]`` tile, one dot into
    ``a0`` (``a1`` unused)."""
    if ONE_DOT:
        BR: tl.constexpr = w0.shape[0]
        CK: tl.constexpr = w0.shape[1]
        w01 = tl.reshape(tl.permute(tl.join(w0, w1), (2, 0, 1)), [2 * BR, CK])
        if REG_A:
            w01 = _reg_a(w01)
        a0 = tl.dot(w01, tl.trans(xt), a0)
    else:
        if REG_A:
            w0 = _reg_a(w0)
            w1 = _reg_a(w1)
        a0 = tl.dot(w0, tl.trans(xt), a0)
        a1 = tl.dot(w1, tl.trans(xt), a1)
    return a0, a1


@triton.jit
def _store_tile(yr, a0, a1, n0, n1, nh0, mask0, mask1, ONE_DOT: tl.constexpr, SILU_MUL: tl.constexpr,
                EMU: tl.constexpr):
    """The output tile (``yr``: the tokens' output rows): ``a0`` at rows ``n0`` and (two dots) ``a1`` at ``n1``, or
    with ``SILU_MUL`` ``silu(a0) * a1`` at column ``8 (tile) + g`` of the halved output (``nh0``: the gate rows)."""
    ODT: tl.constexpr = yr.dtype.element_ty
    if SILU_MUL:
        tl.store(yr + ((nh0 // 16) * 8 + nh0 % 8)[:, None], silu_mul_f32(a0, a1, ODT, EMU).to(ODT), mask=mask0)
    else:
        tl.store(yr + n0[:, None], a0.to(ODT), mask=mask0)
        if not ONE_DOT:
            tl.store(yr + n1[:, None], a1.to(ODT), mask=mask1)


@triton.jit(do_not_specialize=["TAB_OFF"])
def _lut_wgmma_kernel(
    # pointers
    X, Q, QH, S, P, Y, WS, LOCKS,
    # sizes
    M, N, NRT, NC, NG, GROUPS_PER_SPLIT, SPLIT_K,
    # strides (unit stride along K for X, along N for S and Y)
    stride_xm, stride_sg, stride_ym,
    # shared offset of the pair table (SMEM_TAB only: Triton's own shared size, set by the launcher)
    TAB_OFF,
    # constexpr flags
    GROUP: tl.constexpr, RT: tl.constexpr, BLOCK_M: tl.constexpr, USE_SPLIT: tl.constexpr, EMU: tl.constexpr,
    PREFETCH: tl.constexpr, ONE_DOT: tl.constexpr, BITS: tl.constexpr = 4, SCALE_W: tl.constexpr = 0,
    REG_A: tl.constexpr = False, SMEM_TAB: tl.constexpr = 0,
    SILU_MUL: tl.constexpr = False,
):
    """Program = ``RT`` row tiles (16 rows) x ``BLOCK_M`` tokens x one split-K range of scale groups.
    ``ONE_DOT``: the two decoded halves are stacked into one ``[16 RT, 64]`` tile (row ``rh * 8 RT + i``) and
    multiplied by one ``tl.dot`` per chunk; otherwise one dot per half.
    ``SCALE_W`` (the 3-bit configs' choice): the decoded tile is multiplied by its rows' group scales in the activation dtype
    (``T[c] * s`` rounded once, as FLUTE's own kernel and dequantize-then-MMA kernels do) and the dots accumulate
    straight into the FP32 accumulator over a flat loop of chunks; with the accumulator carried, Triton pipelines
    the code and activation loads (``cp.async``) and keeps the wgmma groups in flight (``wait_group 3`` instead of
    ``0`` in the sm_90 PTX). ``SCALE_W == 2``: the multiply inside the decode PTX (``mul.rn.bf16x2``, same
    values). ``REG_A``: the decoded tile relabelled into the wgmma A-register fragment (``_reg_a``); tile rows then
    map to weight rows through ``_reg_a_row``, the activation tile's columns to K through ``_reg_a_k``.
    ``SMEM_TAB`` (option ``smem_table``): the codes are looked up in the fragment kernel's lane-duplicated
    pair table, written at the start to shared offset ``TAB_OFF`` (past Triton's own buffers; the launcher raises
    the launch's dynamic shared size by the table's 32 KB), instead of the byte-table ``prmt`` decode.
    ``SILU_MUL`` (two dots only; a fused gate_up whose rows alternate in blocks of 8,
    ``formats.common.interleave_rows(gate, up, 8)``: each 16-row tile's rows g are gate rows, its rows g + 8 the up
    rows of the same columns): the output ``Y [M, N / 2]`` is ``silu(acc0) * acc1`` (``silu_mul_f32``'s roundings),
    element by element -- the two accumulators share their layout, so the epilogue moves nothing -- at column
    ``8 (tile) + g``.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    BR: tl.constexpr = 8 * RT  # (row tile, g) rows per half
    CK: tl.constexpr = 64 if BITS == 4 else 128  # K per chunk (the fragment layout's)
    CPG: tl.constexpr = GROUP // CK  # chunks per scale group
    ODT: tl.constexpr = Y.dtype.element_ty
    i = tl.arange(0, BR)
    rt = pid_n * RT + i // 8
    rt_ok = rt < NRT
    nw0 = rt * 16 + i % 8  # weight rows of the words' rows g (half 1: + 8)
    it = i
    if REG_A and not ONE_DOT:  # tile row -> its words' row
        it = _reg_a_row(i)
    nh0 = (pid_n * RT + it // 8) * 16 + it % 8  # weight rows of half 0 (rows g of each tile)
    n1 = nh0 + 8  # half 1 (rows g + 8)
    n0 = nh0
    if ONE_DOT:  # row rh * BR + i of the stacked tile = weight row 16 rt + 8 rh + g
        r2 = tl.arange(0, 2 * BR)
        if REG_A:
            r2 = _reg_a_row(r2)
        n0 = (pid_n * RT + (r2 % BR) // 8) * 16 + 8 * (r2 // BR) + r2 % 8
        RB: tl.constexpr = 2 * BR
    else:
        RB: tl.constexpr = BR
    q_rows = Q + (rt.to(tl.int64) * (NC * 128) + (i % 8) * 16)[:, None] + tl.arange(0, 16)[None, :]
    h_rows = QH + (rt.to(tl.int64) * (NC * 64) + (i % 8) * 8)[:, None] + tl.arange(0, 8)[None, :]  # 3-bit hi plane
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    kx = tl.arange(0, CK)
    if REG_A:  # the activation columns in the relabelled tile's K order
        kx = _reg_a_k(kx, CK)
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm + kx[None, :]
    if SMEM_TAB > 0:
        tabs = (0, 0, 0, 0, 0, 0, 0, 0)
        if not EMU:
            _store_pair_table(P.to(tl.pointer_type(tl.int32)), BITS, TAB_OFF, BITS == 3)
    else:
        tabs = _byte_tables(P, BITS)  # (unused by the interpreter's decode)
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, NG)
    acc0 = tl.zeros([RB, BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BR, BLOCK_M], dtype=tl.float32)  # (two-dot mode only)
    if SCALE_W > 0:  # scales folded into the decoded tile; one loop over chunks, the accumulator carried across it
        for c in range(g0 * CPG, g1 * CPG):
            words = _chunk_words(q_rows, h_rows, c, rt_ok[:, None], BITS)
            xt = tl.load(x_rows + c * CK, mask=m_ok[:, None], other=0.0)
            sh0 = tl.load(S + (c // CPG) * stride_sg + nw0, mask=nw0 < N, other=0.0).to(ODT)
            sh1 = tl.load(S + (c // CPG) * stride_sg + nw0 + 8, mask=nw0 + 8 < N, other=0.0).to(ODT)
            w0, w1 = _decode(words, P, tabs, EMU, ODT, BITS, sh0, sh1, SCALE_W, SMEM_TAB, TAB_OFF)
            acc0, acc1 = _tile_dots(w0, w1, xt, acc0, acc1, ONE_DOT, REG_A)
    else:
        nw1, nw2, nw3 = nw0, nw0, nw0  # (pass-through values without PREFETCH)
        if PREFETCH:  # the first group's words (register double buffer across groups)
            nw0, nw1, nw2, nw3 = _next_group_words(q_rows, h_rows, g0 - 1, g1, rt_ok, CPG, BITS)
        for gi in range(g0, g1):
            p0, p1, nw0, nw1, nw2, nw3 = _group_dots(
                q_rows, h_rows, x_rows, m_ok[:, None], kx, 0, gi, g1, rt_ok, nw0, nw1, nw2, nw3, P, tabs, TAB_OFF,
                RB, BR, BLOCK_M, CPG, CK, BITS, EMU, ODT, ONE_DOT, REG_A, PREFETCH, SMEM_TAB, False)
            s0 = tl.load(S + gi * stride_sg + n0, mask=n0 < N, other=0.0).to(tl.float32)
            acc0 += p0 * s0[:, None]
            if not ONE_DOT:
                s1 = tl.load(S + gi * stride_sg + n1, mask=n1 < N, other=0.0).to(tl.float32)
                acc1 += p1 * s1[:, None]
    mask0 = (n0 < N)[:, None] & m_ok[None, :]
    mask1 = (n1 < N)[:, None] & m_ok[None, :]
    if USE_SPLIT:
        ws = WS + pid_k.to(tl.int64) * M * N + offs_m[None, :] * N
        tl.store(ws + n0[:, None], acc0, mask=mask0)
        if not ONE_DOT:
            tl.store(ws + n1[:, None], acc1, mask=mask1)
        tl.debug_barrier()  # every thread's partial is written before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(LOCKS + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            t0 = tl.zeros([RB, BLOCK_M], dtype=tl.float32)
            t1 = tl.zeros([BR, BLOCK_M], dtype=tl.float32)
            wsk = WS + offs_m[None, :] * N
            for sk in range(0, SPLIT_K):  # split sk's partials: the pointer advances M * N per split (64-bit)
                t0 += tl.load(wsk + n0[:, None], mask=mask0, other=0.0, cache_modifier=".cg")
                if not ONE_DOT:
                    t1 += tl.load(wsk + n1[:, None], mask=mask1, other=0.0, cache_modifier=".cg")
                wsk += M * N
            _store_tile(Y + offs_m[None, :] * stride_ym, t0, t1, n0, n1, nh0, mask0, mask1, ONE_DOT, SILU_MUL, EMU)
            tl.atomic_xchg(LOCKS + tile, 0, sem="relaxed", scope="gpu")
    else:
        _store_tile(Y + offs_m[None, :] * stride_ym, acc0, acc1, n0, n1, nh0, mask0, mask1, ONE_DOT, SILU_MUL, EMU)


WGMMA_GROUPS = (64, 128, 256)
WGMMA_BITS = (3, 4)  # code widths the op sends here (3-bit timed in session 13: faster than the fragment kernel)
# ``balance`` (split-K evening out the SMs' scale groups, ``lut_gemm.balanced_split`` with the config's ctas_per_sm
# as its tie-break) only where at least this many programs fit per SM (session 14, ``s14_probe_split.json``: with 2
# resident -- 246-255 registers -- it lost, e.g. 4-bit M = 64 qkv 25.0 vs 21.3 us, 3-bit gate_up 92.7 vs 61.2;
# breaking the ties toward the resident count instead lost on o / down at M = 16: 14.3 vs 11.3 us, ``s14_split_ab``)
BALANCE_MIN_RESIDENT = 3
# ... and only where it cuts the busiest SM's scale groups to at most this fraction of the plain rule's: the measure
# ignores how many programs share an SM, so a small predicted gain can be a loss (8192 x 8192 at M = 32: 64 vs 66
# groups predicted, 33.6 vs 30.1 us measured, ``s14_split_ab_fill.json``); every measured win predicted >= 12 %
BALANCE_MIN_GAIN = 0.9
MAX_WGMMA_M = 128  # the op's limit for this kernel (above: dequantize + cuBLAS; M = 128 gate_up 129 vs 219 us, H100)
LAST_COMPILED: dict = {}  # the last launch's compiled kernel (PTX / register inspection in the device scripts)


def wgmma_preferred(M: int, N: int, K: int, bits: int = 4) -> bool:
    """Whether the op takes this kernel over the fragment kernel (3/4-bit 'mma' layout, ``M <= MAX_WGMMA_M``).
    Session-12 probe (H100, us, GEMM alone, `benchmarks/results/h100/s12_probe.json` part h; qkv / o / down /
    gate_up of Llama-3-8B): M = 16 fragment 23.6 / 14.7 / 25.4 / 48.6 vs this 17.4 / 13.6 / 30.6 / 49.6;
    M = 32 30.8 / 27.4 / 47.1 / 71.3 vs 19.4 / 15.5 / 34.7 / 58.4; M = 64 40.1 / 32.0 / 69.3 / 134.0 vs
    25.1 / 19.8 / 49.5 / 67.7. So: from 17 tokens always, at 9..16 where N < 16384 and K < 8192.
    3-bit (session 13, ``s13_probe.json`` part m, this kernel's 3-bit config): M = 16 fragment 20.2 / 17.1 /
    32.5 / 56.1 vs 18.2 / 13.2 / 32.6 / 56.1 (H100); with ``reg_a`` (part o, H200, ``s13_probe_rega3.json``)
    20.4 / 17.1 / 33.3 / 57.2 vs 15.7 / 12.7 / 28.4 / 47.4 -- so 3-bit takes this kernel from 9 tokens on every
    shape. Session 14 (H200, ``s14_probe_split.json``, with the ``balance`` split): 4-bit M = 16 gate_up 42.7 vs the
    fragment kernel's 47.4 (part p, same session), down 26.5 vs 25.3 -- so 4-bit takes it at 9..16 tokens wherever
    K < 8192. Session 24 (H200, ``s24_smem_table.json``), with ``smem_table`` on: 4-bit down / 8192^2 M = 16 25.7 /
    26.9 vs the fragment kernel's 27.6 / 29.0, M = 9 23.7 / 24.7 vs 23.9 / 24.8 -- so 4-bit takes it from 9 tokens on
    every shape too, and gate_up-sized N from 8 (M = 8 33.7 vs fragment 36.7, Gluon 34.7; ``s24_m8_128.json``)."""
    return M >= 9 or (M == 8 and bits == 4 and N >= 16384)


def wgmma_config(M: int, N: int, K: int, group_size: int, bits: int = 4) -> dict:
    """Launch parameters: ``rt`` row tiles of 16 per program, ``block_m`` tokens, split-K to fill ``ctas_per_sm``
    programs per SM, ``one_dot`` (stacked halves), ``scale_w`` (scales folded into the decoded tile), ``reg_a``
    (the decoded tile relabelled into the wgmma A-register fragment; 'auto' = wherever the tile allows).

    4-bit, session-13 probe part n (H200, us, ``s13_probe.json``; ``d8`` = two dots, rt 8; ``o4`` = one dot, rt 4;
    cN = ctas_per_sm; qkv / o / down / gate_up of Llama-3-8B): ``reg_a`` beats the shared-memory round trip of the
    session-12 kernel at every M >= 16 (M = 32 17.2 / 12.6 / 30.7 / 51.8 vs 19.4 / 15.2 / 35.7 / 58.4;
    M = 128 30.8 / 22.7 / 61.3 / 114.1 vs 34.4 / 25.4 / 70.9 / 129.3) and with it ``scale_w`` no longer pays
    (o4 M = 64 o / down 16.6 / 39.8 without, 19.1 / 45.4 with), so 4-bit keeps the exact FP32 group scaling.
    Per shape: from 17 tokens o4 c2 where N <= 4096 or K >= 8192 (o, down), and above 64 tokens wherever
    N < 16384 (qkv M = 128 30.8 vs d8 39.1); d8 otherwise, c2, gate_up-sized N (>= 16384) c4 at 17..32 and
    above 64 tokens (M = 128 114.1 vs c1 119.5), c1 at 33..64 (62.4).

    3-bit (the two code planes merged in registers), session-13 parts k / m (H100): ``scale_w`` with the stacked
    dot wins at every M measured (M = 32 qkv / o / down / gate_up 20.0 / 14.0 / 34.8 / 57.9 vs the 4-bit
    session-12 configs on 3-bit codes 22.8 / 18.5 / 51.2 / 79.5 and the fragment kernel 48.6 / 44.6 / 69.4 /
    100.1), except gate_up-sized N above 32 tokens, where d8 c1 with ``scale_w`` keeps it (M = 64 60.3 vs o4
    77.1). Part o (H200, ``s13_probe_rega3.json``): ``reg_a`` with 4 programs per SM pays up to 32 tokens
    (M = 16 15.7 / 12.7 / 28.4 / 47.4 vs 18.3 / 13.1 / 33.2 / 57.9 without) and loses above (M = 64 gate_up
    86.5 vs 62.2: there Triton pipelines the two code planes through shared memory and reads them back 8 words per
    thread, not in the [8 rows x 4 lanes] layout the relabelling assumes, so a real conversion remains), so it is
    on only there.

    ``balance`` (session 14, both widths up to 64 tokens): the split-K count from ``lut_gemm.balanced_split`` (the
    busiest SM's programs x groups per program, minimised) instead of "enough programs for ctas_per_sm per SM",
    applied where >= ``BALANCE_MIN_RESIDENT`` programs fit (``_resident``). H200, CUDA graphs,
    ``s14_probe_split.json`` / ``s14_split_ab.json``: 4-bit gate_up M = 16 / 32 42.6 / 48.8 vs 47.0 / 51.3 us, down
    M = 64 36.6 vs 39.6; 3-bit qkv M = 64 20.9 vs 25.2; elsewhere within 1-2 %.

    ``maxnreg`` (a register cap, ptxas spills above it), session 14 (H200, ``s14_maxnreg.json``): 128 on the 4-bit
    16-token tile (130 registers without it, no spill with it, 4 programs per SM instead of 3): gate_up 40.4 vs 42.6
    us, o 11.1 vs 11.2, qkv 14.1 vs 14.1; at 32 / 64 tokens the cap spills (28-38 B) and loses (gate_up M = 32 53.9
    vs 49.2, down M = 64 49.6 vs 36.5), so it is set only there.

    ``smem_table`` (4-bit, session 24, H200, ``s24_smem_table.json``, us, qkv / o / down / gate_up / 8192^2): the
    32 KB shared pair table wins up to 32 tokens on every shape (M = 16 14.7 / 12.7 / 25.7 / 37.6 / 26.9 vs
    16.7 / 13.7 / 28.9 / 43.1 / 30.5; M = 32 18.2 / 13.5 / 31.9 / 49.9 / 29.9 vs 19.1 / 13.8 / 32.7 / 51.9 / 32.3)
    and at 33..64 only on gate_up-sized N, whose one program per SM leaves room for the table (55.9 vs 64.5); the
    others lose there (o M = 64 22.6 vs 17.4: 80 KB of shared memory halves the resident programs), and so do all
    at 128 tokens (``s24_m8_128.json``: qkv / o / down 44.2 / 33.1 / 88.0 vs 33.2 / 24.9 / 63.2), so it is off
    there. The 64 KB 'wide' table loses or ties everywhere (M = 16 down 34.5, gate_up 49.0) and ``x_perm``'s
    kernel is slower even with x handed over permuted (``x_perm='given'``, ``s24_xgiven.json``: M = 16 qkv 18.9,
    down 31.0 vs 14.6 / 25.5); both were removed in session 26. 3-bit
    (``s24_3bit.json``): the table wins up to 16 tokens (M = 16 qkv / o / down / gate_up 14.8 / 13.6 / 27.2 / 43.6
    vs 16.2 / 14.1 / 30.9 / 49.1; 8192^2 32.6 vs 32.0) and loses above (M = 32 down 39.3 vs 35.1), so it is on
    there only.

    Launch shape with the table (4-bit, session 24, ``s24_shapes.json``, us, variants of the then-committed config):
    at 16 tokens a split target of 4 programs per SM where K >= 8192 (down / 8192^2 24.3 / 23.8 vs 25.3 / 26.4;
    gate_up 37.6 vs 37.4; qkv / o lose, 15.7 / 15.5 vs 14.8 / 12.7, but take the Gluon kernel there); at 17..32 the
    stacked dot (o4) for N < 16384 (qkv 16.5 vs d8 18.2; o 13.5 and 8192^2 29.7 as before) with 4 programs per SM
    on down-like weights, N <= 4096 with K >= 8192 (28.4 vs 31.3; 8192^2 loses with it, 35.1). gate_up-sized N
    keeps d8 with 4: o4 won there in that run (46.8 vs 49.3) but not in the same-run A/B of the resulting config
    (``s24_reshape.json``, M = 24 / 32 45.3 / 46.6 vs 44.2 / 46.9). That A/B, new vs previous launch, us: qkv M = 24 /
    32 16.2 / 16.4 vs 17.5 / 18.7; down M = 16 / 24 / 32 24.3 / 28.1 / 28.4 vs 25.4 / 31.2 / 31.4; 8192^2 M = 16 23.6
    vs 26.5; o and 8192^2 at 24 / 32 unchanged.

    Session 25 (H200; ``s25_caps.json`` one run, then ``s25_probe.json`` part ``l``, three interleaved repeats
    against the op, medians in us): register caps for one more resident program per SM lose almost everywhere (16
    tokens, 96 registers and 5 programs: qkv / o / gate_up / 8192^2 16.7 / 16.1 / 41.0 / 26.1 vs 14.6 / 12.6 / 37.6
    / 23.6; 64 tokens, 168 registers: on the device the o4 launch already compiles to 168), except the stacked dot
    on down-like weights at 16 tokens (N <= 4096, K >= 8192: 96 registers, 36 B spilled offline, 5 programs per
    SM; 23.36 vs 24.30), now the launch there (``s25_ab.json``, op vs the previous launch, M = 9 / 12 / 16: 22.46 /
    22.62 / 23.23 vs 23.58 / 23.84 / 24.06). The stacked dot on qkv-sized N at 33..64 tokens (d8 before): faster in
    three same-run A/Bs (M = 64 ``s25_probe.json`` 21.79 vs 23.54, ``s25_q.json`` 21.79 vs 23.44 and M = 48 21.28 vs
    22.66, ``s25_q2.json`` through the op 21.79 / 21.10 vs 23.42 / 22.50) and in the model (batch 64, two A/B pairs,
    6.978 / 6.958 vs 6.995 / 7.041 ms); slower in one run (``s25_ab.json``: M = 40 / 48 / 64 29.60 / 24.91 / 25.41
    vs 23.46 / 22.38 / 23.30; reproduced in ``s25_ab_final.json``: 29.55 / 24.94 / 25.44). The cause: that probe
    called the op first at M = 40, where Triton compiles the kernel without the divisible-by-16 specialization of M
    (195 registers offline, 2 programs per SM, against 168 and 3 at M = 48 / 64), and ``_resident`` cached that
    residency for every M, so M = 48 / 64 ran the plain split rule instead of ``balance``'s (now keyed by
    ``launch_key``, the specialization). So the stacked dot takes qkv-sized N at 33..64 tokens where M % 16 == 0
    (measured at 48 and 64), and d8 stays at the other counts (M = 40: 29.55 vs 23.60)."""
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    d8 = dict(rt=8, block_m=bm, num_warps=4, num_stages=3, prefetch=True, one_dot=False, scale_w=False,
              reg_a="auto", ctas_per_sm=2, balance=M <= 64)
    o4 = dict(d8, rt=4, one_dot=True)
    many = N >= 16384
    if bits == 3:
        if M <= 32:
            return dict(o4, scale_w=True, ctas_per_sm=4, smem_table=M <= 16)
        return dict(d8 if many else o4, ctas_per_sm=1 if many else 2, scale_w=True, reg_a=False)
    if M <= 16:  # 130 -> 128 registers, no spill: 4 programs per SM instead of 3 (s14_maxnreg.json)
        if N <= 4096 and K >= 8192:  # down-like: the stacked dot under 96 registers, 5 programs (s25_probe.json)
            return dict(o4, maxnreg=96, smem_table=True, ctas_per_sm=5)
        return dict(d8, maxnreg=128, smem_table=True, ctas_per_sm=4 if K >= 8192 else 2)
    if M <= 32:  # with the table (s24_shapes.json, s24_reshape.json): the stacked dot but on gate_up-sized N, split
        # deeper on long narrow K
        if many:
            return dict(d8, smem_table=True, ctas_per_sm=4)
        return dict(o4, smem_table=True, ctas_per_sm=4 if (N <= 4096 and K >= 8192) else 2)
    if not many:  # the stacked dot (on qkv-sized N at 33..64 tokens too where M % 16 == 0, session 25)
        return o4 if (M > 64 or N <= 4096 or K >= 8192 or M % 16 == 0) else d8
    return dict(d8, ctas_per_sm=1 if M <= 64 else 4, smem_table=M <= 64)


def check_mma_args(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pairs: torch.Tensor, N: int,
                   bits: int, G: int) -> tuple[int, int]:
    """The register-table launchers' shared checks (``x`` bf16/fp16, ``pairs`` the contiguous pair table in x's
    dtype, ``scales`` bf16/fp16, ``qweight`` the int32 words of ``formats.lut.pack_codes_mma`` of an ``[N, K]``
    weight) -> (row tiles, chunks) of the fragment layout."""
    K = x.shape[1]
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bf16 or fp16, got {x.dtype}")
    if pairs.dtype != x.dtype or pairs.shape != (4 ** bits, 2) or not pairs.is_contiguous():
        raise ValueError(f"pairs must be the contiguous pair_table(table, {bits}, x.dtype) [{4 ** bits}, 2]")
    if scales.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"scales must be bf16 or fp16, got {scales.dtype}")
    nrt, nc = mma_shapes(N, K, bits, G)
    if qweight.dtype != torch.int32 or qweight.numel() != nrt * nc * 128:
        raise ValueError(f"qweight must be pack_codes_mma(...) of [{N}, {K}] at {bits} bits ({nrt * nc * 128} int32 "
                         f"words)")
    return nrt, nc


def mma_output(x: torch.Tensor, N: int, G: int, kp: int, name: str, cols: int | None = None):
    """(y ``[M, cols]`` (default N columns), whether y is already final, scale groups, x as the kernels read it:
    ``fragment_x`` up to the padded K ``kp``); 32-bit output offsets checked."""
    M, K = x.shape
    if M * N >= 2 ** 31:
        raise ValueError(f"{name}: M * N = {M * N} needs 64-bit output offsets (< 2**31 supported)")
    y, done = gemm_output(x, N, K, cols)
    return y, done, cdiv(K, G), (x if done else fragment_x(x, kp))


def lut_wgmma_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pairs: torch.Tensor, *,
                     group_size: int, out_features: int, bits: int = 4, qweight_hi: torch.Tensor | None = None,
                     silu_mul: bool = False, **overrides) -> torch.Tensor:
    """Launch ``_lut_wgmma_kernel``. ``qweight`` (+ ``qweight_hi`` at 3 bits) = ``formats.lut.pack_codes_mma(codes,
    bits, G)``, ``pairs`` = ``pair_table(table, bits, x.dtype)``, ``scales`` ``[ceil(K/G), N]``. ``x`` ``[M, K]``
    bf16/fp16 is copied to a zero-padded ``[M, Kp]`` buffer when K is not a multiple of the group or its rows are
    not 16-byte aligned. ``overrides`` replace fields of ``wgmma_config`` (``split_k`` fixes the split;
    ``scale_w``: False, True or 'asm', the kernel's ``SCALE_W`` option 0 / 1 / 2; ``reg_a``: False, True or 'auto'
    = on for 64-row tiles without ``scale_w='asm'``; ``smem_table``: True = the shared-memory pair-table decode,
    ``SMEM_TAB`` (3-bit looks the merged words' bytes up in a 256-entry table built from the 3-bit pairs); the
    defaults: ``wgmma_config``).
    3-bit (G in 128 / 256): the two planes are merged into 4-bit-layout words in registers (``_words3``, ~8
    integer ops per 8 codes) before the same decode (the op dispatches both widths: ``WGMMA_BITS``).
    ``silu_mul``: the weight is a fused gate_up with rows interleaved in blocks of 8 (N a multiple of 16); the
    output is ``[M, N / 2]`` = silu(gate) * up from the kernel's epilogue (``SILU_MUL``, two-dot configs; after a
    stacked-dot launch, one ``kernels.silu_mul`` pass)."""
    M, K = x.shape
    N, G = out_features, group_size
    if bits not in (3, 4) or G not in WGMMA_GROUPS or G % MMA_CHUNK[bits]:
        raise ValueError(f"lut_wgmma_triton needs bits 4 with group_size in {WGMMA_GROUPS} or bits 3 with group_size "
                         f"in (128, 256) (the fragment layout), got bits={bits}, group_size={G}")
    nrt, nc = check_mma_args(x, qweight, scales, pairs, N, bits, G)
    if bits == 3 and (qweight_hi is None or qweight_hi.dtype != torch.int32 or qweight_hi.numel() != nrt * nc * 64):
        raise ValueError(f"qweight_hi must be the high-bit plane of pack_codes_mma(...) of [{N}, {K}] at 3 bits "
                         f"({nrt * nc * 64} int32 words)")
    cfg = wgmma_config(M, N, K, G, bits)
    cfg.update(overrides)
    cols = out_columns(N, silu_mul)
    if silu_mul:
        if cfg.get("one_dot"):  # the epilogue pairs the two dots' accumulators: a stacked-dot launch stays as it is,
            # then one pass (3-bit at <= 32 tokens: d8 with the epilogue lost, batch-16 model 1.57x vs 1.72x bf16)
            from lowbit.kernels.silu_mul import silu_mul_triton

            y = lut_wgmma_triton(x, qweight, scales, pairs, group_size=G, out_features=N, bits=bits,
                                 qweight_hi=qweight_hi, **overrides)
            return silu_mul_triton(y, block=SILU_BLOCK)
    smem_tab = cfg.get("smem_table", False)
    if smem_tab not in (False, True):
        raise ValueError(f"smem_table must be False or True, got {smem_tab!r}")
    y, done, ng, x = mma_output(x, N, G, nc * MMA_CHUNK[bits], "lut_wgmma_triton", cols)
    if done:
        return y
    sw = {False: 0, True: 1, "asm": 2}.get(cfg.get("scale_w", False))
    if sw is None:
        raise ValueError(f"scale_w must be False, True or 'asm', got {cfg.get('scale_w')!r}")
    rt, bm = int(cfg["rt"]), int(cfg["block_m"])
    reg_ok = rt * (16 if cfg.get("one_dot", False) else 8) == 64 and sw != 2
    reg_a = cfg.get("reg_a", "auto")
    if reg_a not in (False, True, "auto"):
        raise ValueError(f"reg_a must be False, True or 'auto', got {reg_a!r}")
    if reg_a is True and not reg_ok:
        raise ValueError("reg_a needs a 64-row tile (rt 8, or rt 4 with one_dot) and scale_w != 'asm'")
    reg_a = reg_ok if reg_a == "auto" else reg_a
    grid_n, grid_m = cdiv(nrt, rt), cdiv(M, bm)
    qh = qweight_hi if bits == 3 else qweight
    kw = dict(GROUP=G, RT=rt, BLOCK_M=bm, EMU=interpret_mode(),
              PREFETCH=bool(cfg.get("prefetch", True)) and not interpret_mode(), ONE_DOT=bool(cfg.get("one_dot", False)),
              BITS=bits, SCALE_W=sw, REG_A=reg_a, num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]))
    if cfg.get("maxnreg"):  # register cap per thread (ptxas spills above it; passed only when set)
        kw["maxnreg"] = int(cfg["maxnreg"])
    if smem_tab:  # passed only when set: the byte-table launches keep their compiled kernels
        kw["SMEM_TAB"] = 1
    split = cfg.get("split_k")
    if split is None and cfg.get("balance") and not interpret_mode():
        occ = _resident(x, qweight, qh, scales, pairs, y, M, N, nrt, nc, ng, kw)
        split = balance_split(grid_n * grid_m, ng, _sm_count(x.device), cfg["ctas_per_sm"], occ)
    split, per, ws, locks = split_plan(split, ng, grid_n * grid_m, cfg["ctas_per_sm"], y, n_cols=N)
    args = (x, qweight, qh, scales, pairs, y, ws, locks, M, N, nrt, nc, ng, per, split, x.stride(0), scales.stride(0),
            y.stride(0))
    grid = (grid_n, grid_m, split)
    kw["USE_SPLIT"] = split > 1
    if silu_mul:  # passed only when set: the plain launches keep their compiled kernels
        kw["SILU_MUL"] = True
    # the table's place: past Triton's own shared memory
    tab_off = table_offset(_lut_wgmma_kernel, args, grid, kw) if smem_tab and not interpret_mode() else 0
    LAST_COMPILED["wgmma"] = _lut_wgmma_kernel[grid](*args, tab_off, **kw)
    LAST_COMPILED["wgmma_split"] = split
    return y


def balance_split(tiles: int, ng: int, sms: int, ctas_per_sm: int, resident: int | None) -> int | None:
    """The ``balance`` option's split count, or None (keep the plain rule): ``lut_gemm.balanced_split`` where at least
    ``BALANCE_MIN_RESIDENT`` programs fit per SM and it cuts the busiest SM's scale groups to at most
    ``BALANCE_MIN_GAIN`` of the plain rule's (``planned_split``)."""
    if resident is None or resident < BALANCE_MIN_RESIDENT:
        return None
    sb = balanced_split(tiles, ng, sms, ctas_per_sm)
    s0 = planned_split(None, ng, tiles, ctas_per_sm, sms)
    if busiest_sm_groups(tiles, ng, sb, sms) <= BALANCE_MIN_GAIN * busiest_sm_groups(tiles, ng, s0, sms):
        return sb
    return None


def _patch_table(k) -> int:
    """Shared byte offset of the pair table in the compiled ``SMEM_TAB`` kernel ``k``: Triton's own shared size,
    rounded up to 128 bytes. The first call per compiled kernel raises its launch's dynamic shared size by the
    table's 32 KB (Triton does not know about the table; as the fragment kernel's launcher does)
    before the module is loaded, so the loader opts in to more than 48 KB where needed; the offset is kept on the
    kernel object."""
    off = getattr(k, "lowbit_table_offset", None)
    if off is not None:
        return off
    if k.module is not None:  # loaded before its shared size could be raised: never, by construction
        raise RuntimeError("smem_table: the kernel was loaded before its shared size was set")
    off = -(-int(k.metadata.shared) // 128) * 128
    smem = off + mma_table_bytes(4)
    k.metadata = k.metadata._replace(shared=smem)
    k._init_handles()
    nwarps, nctas, shared = k.packed_metadata
    if shared < smem:
        k.packed_metadata = (nwarps, nctas, smem)
    k.lowbit_table_offset = off
    return off


def launch_key(fn, args: tuple, kw: dict) -> tuple:
    """What selects a compiled variant of jit function ``fn``: its constexprs and options ``kw`` and Triton's
    specialization of ``args`` (ints equal to 1 or divisible by 16, tensors by device, dtype and 16-byte
    alignment). The caches of per-variant facts (``table_offset``, ``_resident``) are keyed by it: a fact of one
    variant does not hold for another (session 25: the 64-token stacked dot compiles to 195 registers at M = 40 and
    168 at M = 48 / 64, and a residency cached at M = 40 had set the split of every later M)."""
    return fn, tuple(sorted(kw.items())), arg_specialization(args)


_TAB_OFF: dict = {}  # launch key -> the pair table's shared offset (so later calls skip the warmup)


def table_offset(fn, args: tuple, grid: tuple, kw: dict) -> int:
    """The ``TAB_OFF`` argument of an ``SMEM_TAB`` launch of jit function ``fn`` (the Triton or the Gluon
    register-table kernel; ``args`` without it, ``kw`` its constexprs and options): compiled once per launch key --
    the constexprs and Triton's specialization of the arguments (ints equal to 1 or divisible by 16, 16-byte aligned
    pointers) -- and patched by ``_patch_table``."""
    key = launch_key(fn, args, kw)
    off = _TAB_OFF.get(key)
    if off is None:
        off = _TAB_OFF[key] = _patch_table(fn.warmup(*args, 0, grid=grid, **kw))
    return off


_RESIDENT: dict = {}  # compiled split-K variant's key -> its resident programs per SM


def _resident(x, qweight, qh, scales, pairs, y, M, N, nrt, nc, ng, kw) -> int | None:
    """Resident programs per SM of the split-K variant of this launch (compiled once, without launching), which
    gates the ``balance`` option: ``ctas_per_sm`` is only a wish, the registers decide (session 14, ncu at M = 32
    gate_up: 167 registers, 3 programs per SM, not the 4 the split was sized for, so 672 programs ran in 1.7
    waves; ``balance`` gives 896 programs of 8 groups, the busiest SM 7 of them)."""
    key = launch_key(_lut_wgmma_kernel, (x, qweight, qh, scales, pairs, y, M, N, nrt, nc, ng, x.stride(0),
                                         scales.stride(0), y.stride(0)), kw)
    if key not in _RESIDENT:
        ws, locks = _workspace(x.device, 1, 1)  # (compiled against the pointer types only)
        k = _lut_wgmma_kernel.warmup(x, qweight, qh, scales, pairs, y, ws, locks, M, N, nrt, nc, ng, 1, 2,
                                     x.stride(0), scales.stride(0), y.stride(0), 0, USE_SPLIT=True, grid=(1, 1, 1),
                                     **kw)
        if kw.get("SMEM_TAB"):  # the table counts: its shared size is raised (and the module loaded) here
            _patch_table(k)
        k._init_handles()  # (a kernel compiled but never launched has no register count before this)
        _RESIDENT[key] = resident_ctas(k, kw["num_warps"])
    return _RESIDENT[key]
