"""Triton lookup-table weight-only GEMM (FLUTE, seed 002, §3), tuned for Hopper.

    Y[m, n] = sum_k X[m, k] * T[c[n, k]] * s[k // G, n]

- X ``[M, K]`` bf16 or fp16 (row stride free, unit K stride), Y ``[M, N]`` in X's dtype.
- codes: the planar packed layout of ``lowbit.formats.lut`` (4-bit: int32 ``[N, Kq/8]``; 2-bit:
  int32 ``[N, Kq/16]``; 3-bit: int64 low-2-bit plane ``[N, Kq/32]`` + int32 high-bit plane
  ``[N, Kq/32]``; Kq = K rounded up to the packing block).
- scales ``[ceil(K/G), N]`` bf16/fp16 (group-major); table T float32 ``[2**BITS]``.
- Accumulation in float32 (FMA path: products in float32; dot path: operands in X's dtype).

One loop step reads one packing block (``16 * PER`` codes, 64 bytes per row and plane) of
``BLOCK_N`` rows with 16-byte loads. The planar layout puts the codes of the K slice
``[16 j, 16 j + 16)`` in slot ``j`` of the block's 16 words, so each slot is one shift and mask
away, in the layout of the load (no reshape, no shared memory). Codes are looked up (``LOOKUP``):

- ``0`` "global": an inline-PTX ``ld.global.nc`` gather from the 64-byte fp32 table (L1-resident;
  all lanes hit one 128-byte line). 4-bit words are decoded 8 codes at a time: two masks put
  even/odd slots in byte lanes and one ``prmt`` per code extracts it;
- ``4`` "smem": the table copied to the first 64 bytes of the kernel's shared memory
  (``global_smem``) and read with ``ld.shared``: 16 fp32 entries in 16 banks, so lanes never
  conflict (same entry = broadcast) -- FLUTE's bank-conflict answer (§3.2) without duplication --
  and the address is ``code * 4`` folded into the LDS immediate. FMA path only (Triton uses no
  shared memory inside that loop; a barrier separates the table from Triton's epilogue scratch);
- ``3`` "pair": FLUTE's vectorized table (§3.2): one 32-bit load returns the values of two
  adjacent slots (bf16/fp16 pair), from ``formats.lut.pair_table``; best for 3-bit (64 entries,
  2 L1 lines), not for 4-bit (256 entries, 8 lines: 8 wavefronts per warp load);
- ``1`` "select": the 2**BITS entries in registers and a binary tree of ``tl.where``;
- ``2`` "affine": ``T[0] + code * (T[1] - T[0])``, exact only for a uniform table (RTN INT).
``lookup="load"`` (the default) picks smem (FMA, 4-bit), pair (FMA, 2/3-bit) or global (dot).
Why inline PTX: a plain ``tl.load(T + code)`` gets its own layout from Triton's coalescing pass
and the 64-bit pointers were converted to it through shared memory with two barriers per slot
(measured 2x slower than cuBLAS bf16 at M = 1).

Scales are not multiplied per weight: the products of one group (or one block, if the group
is longer) are summed first and the sum is scaled once (``acc += part * s``), in float32.

Two inner products, chosen by ``USE_DOT``:

- FMA path (M = 1 decode): a ``[BLOCK_N, 16]`` float32 accumulator on CUDA cores, reduced along
  K once at the end; no tensor-core padding; the next block's codes are loaded into registers
  while the current block is looked up (``PREFETCH``);
- dot path: ``part[BLOCK_N, BLOCK_M] = dot(T[c], X^T)`` over one scale group ("swap AB": the
  looked-up tile is the 64-row A operand in the activation dtype, the tokens are the narrow
  side, so M = 1..16 pads only to 16), then ``acc += part * s``. With ``JOIN_K`` the group's
  16-wide slot tiles are joined in registers into one A operand (X rows loaded in the matching
  bit-reversed order): one layout conversion and 2 barriers per step instead of 17.
  The table values are rounded to the activation dtype (bf16: 8 bits of mantissa) before the
  dot; the reference rounds nothing, the difference is inside the bf16 tolerance.

Split-K (FLUTE uses Stream-K, §3.3): the K steps are cut into ``SPLIT_K`` ranges (grid axis 2)
so that small-N / small-M problems launch enough programs to cover every SM several times.
Each program writes a float32 partial ``[BLOCK_M, BLOCK_N]`` to a workspace, then increments the
tile's counter; the program that arrives last sums the ``SPLIT_K`` partials in split order
(deterministic, float32: FLUTE reduces partials in fp16, we do not) and writes Y, then resets the
counter to 0 for the next call. One launch, no memset.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode
from lowbit.formats.lut import pack_block, packed_k

LOOKUPS = {"global": 0, "select": 1, "affine": 2, "pair": 3, "smem": 4}


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _tab(T, I: tl.constexpr, NT: tl.constexpr):
    return tl.load(T + (I % NT))


@triton.jit
def _mux2(c, BIT: tl.constexpr, a, b):
    return tl.where((c & BIT) != 0, b, a)


@triton.jit
def _select_lookup(c, T, BITS: tl.constexpr):
    """Binary select tree over the code bits; table entries are scalars (registers)."""
    NT: tl.constexpr = 1 << BITS
    v0 = _mux2(c, 1, _tab(T, 0, NT), _tab(T, 1, NT))
    v1 = _mux2(c, 1, _tab(T, 2, NT), _tab(T, 3, NT))
    r = _mux2(c, 2, v0, v1)
    if BITS >= 3:
        v2 = _mux2(c, 1, _tab(T, 4, NT), _tab(T, 5, NT))
        v3 = _mux2(c, 1, _tab(T, 6, NT), _tab(T, 7, NT))
        r = _mux2(c, 4, r, _mux2(c, 2, v2, v3))
        if BITS == 4:
            v4 = _mux2(c, 1, _tab(T, 8, NT), _tab(T, 9, NT))
            v5 = _mux2(c, 1, _tab(T, 10, NT), _tab(T, 11, NT))
            v6 = _mux2(c, 1, _tab(T, 12, NT), _tab(T, 13, NT))
            v7 = _mux2(c, 1, _tab(T, 14, NT), _tab(T, 15, NT))
            hi = _mux2(c, 4, _mux2(c, 2, v4, v5), _mux2(c, 2, v6, v7))
            r = _mux2(c, 8, r, hi)
    return r


@triton.jit
def _gather(T, tbase, idx, IS_F32: tl.constexpr, INTERPRET: tl.constexpr):
    """``T[idx]`` (32-bit entries), one load per element *in the layout of ``idx``*.

    A plain ``tl.load(T + idx)`` gets its own layout from Triton's coalescing pass, and the
    64-bit pointers are converted to it through shared memory with barriers (measured on H200:
    0.12 ms for gate_up at M = 1, 2x slower than cuBLAS bf16). The inline PTX keeps the layout
    and forms the address with one ``mad.wide.u32`` (IMAD.WIDE, FMA pipe) from ``tbase`` (the
    table address as int64, made non-uniform so ptxas does not turn it into two ALU LEAs).
    ``ld.global.nc``: the table is read-only and stays in L1 (64 bytes for 16 fp32)."""
    if INTERPRET:
        v = tl.load(T + idx)
    elif IS_F32:
        v = tl.inline_asm_elementwise(
            "{ .reg .b64 a; mad.wide.u32 a, $1, 4, $2; ld.global.nc.f32 $0, [a]; }",
            "=f,r,l", [idx, tbase], dtype=tl.float32, is_pure=True, pack=1)
    else:
        v = tl.inline_asm_elementwise(
            "{ .reg .b64 a; mad.wide.u32 a, $1, 4, $2; ld.global.nc.b32 $0, [a]; }",
            "=r,r,l", [idx, tbase], dtype=tl.int32, is_pure=True, pack=1)
    return v


_NF4_WORD_ASM = tl.constexpr("""{
 .reg .b32 lo, hi, c, z; .reg .b64 a;
 mov.b32 z, 0;
 and.b32 lo, $8, 0x0F0F0F0F;
 shr.u32 hi, $8, 4;
 and.b32 hi, hi, 0x0F0F0F0F;
 prmt.b32 c, lo, z, 0x4440; mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 $0, [a];
 prmt.b32 c, hi, z, 0x4440; mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 $1, [a];
 prmt.b32 c, lo, z, 0x4441; mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 $2, [a];
 prmt.b32 c, hi, z, 0x4441; mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 $3, [a];
 prmt.b32 c, lo, z, 0x4442; mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 $4, [a];
 prmt.b32 c, hi, z, 0x4442; mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 $5, [a];
 prmt.b32 c, lo, z, 0x4443; mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 $6, [a];
 prmt.b32 c, hi, z, 0x4443; mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 $7, [a];
}""")


_SMEM_WORD_ASM = tl.constexpr("""{
 .reg .b32 lo, hi, c, z, b;
 mov.b32 z, 0;
 mov.u32 b, global_smem;
 shl.b32 lo, $8, 2;
 and.b32 lo, lo, 0x3C3C3C3C;
 shr.u32 hi, $8, 2;
 and.b32 hi, hi, 0x3C3C3C3C;
 prmt.b32 c, lo, z, 0x4440; add.u32 c, c, b; ld.shared.f32 $0, [c];
 prmt.b32 c, hi, z, 0x4440; add.u32 c, c, b; ld.shared.f32 $1, [c];
 prmt.b32 c, lo, z, 0x4441; add.u32 c, c, b; ld.shared.f32 $2, [c];
 prmt.b32 c, hi, z, 0x4441; add.u32 c, c, b; ld.shared.f32 $3, [c];
 prmt.b32 c, lo, z, 0x4442; add.u32 c, c, b; ld.shared.f32 $4, [c];
 prmt.b32 c, hi, z, 0x4442; add.u32 c, c, b; ld.shared.f32 $5, [c];
 prmt.b32 c, lo, z, 0x4443; add.u32 c, c, b; ld.shared.f32 $6, [c];
 prmt.b32 c, hi, z, 0x4443; add.u32 c, c, b; ld.shared.f32 $7, [c];
}""")


@triton.jit
def _smem_table_store(T, BITS: tl.constexpr):
    """Copy the 2**BITS table entries to the first 64 bytes of the kernel's shared memory
    (``global_smem``, Triton's dynamic shared buffer; FMA path only, where Triton itself uses
    shared memory only after the main loop). 16 fp32 entries sit in 16 distinct banks: lanes
    reading different entries never conflict, lanes reading the same entry are broadcast, the
    answer FLUTE gets from duplicating its pair table (§3.2)."""
    i = tl.arange(0, 16)
    t = tl.load(T + i, mask=i < (1 << BITS), other=0.0)
    tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; st.shared.f32 [a], $2; mov.b32 $0, 0; }",
        "=r,r,f", [i * 4, t], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _smem_lookup(c):
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a, b; mov.u32 b, global_smem; shl.b32 a, $1, 2; add.u32 a, a, b; ld.shared.f32 $0, [a]; }",
        "=f,r", [c], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _smem_word4(wa):
    return tl.inline_asm_elementwise(
        _SMEM_WORD_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r", [wa],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True, pack=1)


@triton.jit
def _lookup_word4(wa, tbase):
    """All 8 slots of each 4-bit word at once: masks split even/odd slots into byte lanes,
    one ``prmt`` per code extracts it (1 ALU op instead of shift + mask), one IMAD.WIDE and one
    L1 load look it up. Returns 8 float32 tensors (slot 0..7), each in the layout of ``wa``."""
    return tl.inline_asm_elementwise(
        _NF4_WORD_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,l", [wa, tbase],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True, pack=1)


@triton.jit
def _pick8(J: tl.constexpr, s0, s1, s2, s3, s4, s5, s6, s7):
    if J == 0:
        r = s0
    elif J == 1:
        r = s1
    elif J == 2:
        r = s2
    elif J == 3:
        r = s3
    elif J == 4:
        r = s4
    elif J == 5:
        r = s5
    elif J == 6:
        r = s6
    else:
        r = s7
    return r


@triton.jit
def _lookup(c, T, tbase, BITS: tl.constexpr, LOOKUP: tl.constexpr, INTERPRET: tl.constexpr):
    if LOOKUP == 0 or (LOOKUP == 4 and INTERPRET):
        v = _gather(T, tbase, c, True, INTERPRET)
    elif LOOKUP == 4:
        v = _smem_lookup(c)
    elif LOOKUP == 1:
        v = _select_lookup(c, T, BITS)
    else:
        t0 = tl.load(T)
        v = t0 + c.to(tl.float32) * (tl.load(T + 1) - t0)
    return v


@triton.jit
def _load_block(Q, QH, offs_n, n_mask, it, stride_qn, stride_qhn, BITS: tl.constexpr, valid=True):
    """The 16 words of packing block ``it`` for rows ``offs_n``: (wa, wb) [BLOCK_N, 16]
    (3-bit: wa = int64 low-2-bit plane, wb = int32 high-bit plane; else wb is wa)."""
    offs_w = it * 16 + tl.arange(0, 16)
    mask = n_mask[:, None] & valid
    wa = tl.load(Q + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask, other=0)
    if BITS == 3:
        wb = tl.load(QH + offs_n[:, None] * stride_qhn + offs_w[None, :], mask=mask, other=0)
    else:
        wb = wa
    return wa, wb


@triton.jit
def _slot_codes(wa, wb, J: tl.constexpr, BITS: tl.constexpr):
    """Codes of slot J (K slice [16 J, 16 J + 16) of the block), int32 [BLOCK_N, 16]."""
    if BITS == 3:
        c = ((wa >> (2 * J)) & 3).to(tl.int32) | (((wb >> J) & 1) << 2)
    else:
        c = (wa >> (BITS * J)) & ((1 << BITS) - 1)
    return c


@triton.jit
def _pair_lookup(wa, wb, J: tl.constexpr, T2, t2base, BITS: tl.constexpr, IS_BF16: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Slots J and J+1 with one 32-bit load from the pair table (``formats.lut.pair_table``)."""
    if BITS == 3:
        idx = ((wa >> (2 * J)) & 15).to(tl.int32) | (((wb >> J) & 3) << 4)
    else:
        idx = (wa >> (BITS * J)) & ((1 << (2 * BITS)) - 1)
    r = _gather(T2, t2base, idx, False, INTERPRET)
    if IS_BF16:  # bf16 -> fp32 is a 16-bit shift
        v0 = (r << 16).to(tl.float32, bitcast=True)
        v1 = (r & -65536).to(tl.float32, bitcast=True)
    else:
        v0 = (r & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        v1 = (r >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return v0, v1


@triton.jit
def _slot_product(part, v, X, offs_m, m_mask, pid_m, stride_xm, k0, K,
                  FIRST: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """part (+)= T[c] (x) X[:, k0:k0+16] for one slot: dot [BLOCK_N, BLOCK_M] or FMA [BLOCK_N, 16]."""
    offs_k = k0 + tl.arange(0, 16)
    k_mask = offs_k < K
    if USE_DOT:
        x = tl.load(X + offs_m[None, :] * stride_xm + offs_k[:, None],
                    mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        if DOT_F32:  # interpreter: its bf16 dot is wrong (triton 3.6); same rounding of T
            vx = v.to(x.dtype).to(tl.float32)
            x = x.to(tl.float32)
            if FIRST:
                part = tl.dot(vx, x, input_precision="ieee")
            else:
                part = tl.dot(vx, x, part, input_precision="ieee")
        else:
            if FIRST:
                part = tl.dot(v.to(x.dtype), x)
            else:
                part = tl.dot(v.to(x.dtype), x, part)
    else:
        x = tl.load(X + pid_m * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if FIRST:
            part = v * x[None, :]
        else:
            part += v * x[None, :]
    return part


@triton.jit
def _slot_value(J: tl.constexpr, wa, wb, T, tbase, BITS: tl.constexpr, LOOKUP: tl.constexpr, WORDV: tl.constexpr,
                INTERPRET: tl.constexpr, s0, s1, s2, s3, s4, s5, s6, s7):
    if WORDV:
        v = _pick8(J, s0, s1, s2, s3, s4, s5, s6, s7)
    else:
        v = _lookup(_slot_codes(wa, wb, J, BITS), T, tbase, BITS, LOOKUP, INTERPRET)
    return v


@triton.jit
def _flush_dot(J0: tl.constexpr, SPF: tl.constexpr, wa, wb, T, tbase, X, offs_m, m_mask, stride_xm, kb, K,
               BITS: tl.constexpr, LOOKUP: tl.constexpr, WORDV: tl.constexpr, INTERPRET: tl.constexpr,
               s0, s1, s2, s3, s4, s5, s6, s7):
    """One dot over the SPF slots of a scale group: the slot tiles are joined in registers into
    one [BLOCK_N, 16 * SPF] A operand (one layout conversion and one K = 16 * SPF wgmma chain
    per group instead of SPF). ``tl.join`` nests the slots, so column c of the tile holds word
    w = c // SPF of slot bitreverse(c % SPF); X rows are loaded in that order."""
    v0 = _slot_value(J0, wa, wb, T, tbase, BITS, LOOKUP, WORDV, INTERPRET, s0, s1, s2, s3, s4, s5, s6, s7)
    v1 = _slot_value(J0 + 1, wa, wb, T, tbase, BITS, LOOKUP, WORDV, INTERPRET, s0, s1, s2, s3, s4, s5, s6, s7)
    BN: tl.constexpr = v0.shape[0]
    if SPF == 2:
        tile = tl.reshape(tl.join(v0, v1), [BN, 32])
    else:
        v2 = _slot_value(J0 + 2, wa, wb, T, tbase, BITS, LOOKUP, WORDV, INTERPRET, s0, s1, s2, s3, s4, s5, s6, s7)
        v3 = _slot_value(J0 + 3, wa, wb, T, tbase, BITS, LOOKUP, WORDV, INTERPRET, s0, s1, s2, s3, s4, s5, s6, s7)
        if SPF == 4:
            tile = tl.reshape(tl.join(tl.join(v0, v1), tl.join(v2, v3)), [BN, 64])
        else:
            v4 = _slot_value(J0 + 4, wa, wb, T, tbase, BITS, LOOKUP, WORDV, INTERPRET, s0, s1, s2, s3, s4, s5, s6, s7)
            v5 = _slot_value(J0 + 5, wa, wb, T, tbase, BITS, LOOKUP, WORDV, INTERPRET, s0, s1, s2, s3, s4, s5, s6, s7)
            v6 = _slot_value(J0 + 6, wa, wb, T, tbase, BITS, LOOKUP, WORDV, INTERPRET, s0, s1, s2, s3, s4, s5, s6, s7)
            v7 = _slot_value(J0 + 7, wa, wb, T, tbase, BITS, LOOKUP, WORDV, INTERPRET, s0, s1, s2, s3, s4, s5, s6, s7)
            tile = tl.reshape(tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)),
                                      tl.join(tl.join(v4, v5), tl.join(v6, v7))), [BN, 128])
    c = tl.arange(0, SPF * 16)
    r = c % SPF
    if SPF == 2:
        slot = r
    elif SPF == 4:
        slot = ((r & 1) << 1) | (r >> 1)
    else:
        slot = ((r & 1) << 2) | (r & 2) | (r >> 2)
    offs_k = kb + (J0 + slot) * 16 + c // SPF
    x = tl.load(X + offs_m[None, :] * stride_xm + offs_k[:, None],
                mask=m_mask[None, :] & (offs_k < K)[:, None], other=0.0)
    if INTERPRET:  # the interpreter's bf16 dot is wrong (triton 3.6); same rounding of T
        part = tl.dot(tile.to(x.dtype).to(tl.float32), x.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(tile.to(x.dtype), x)
    return part


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _lut_gemm_kernel(
    # pointers
    X, Q, QH, S, T, T2, Y, WS, LOCKS,
    # sizes
    M, N, K, NUM_ITERS, ITERS_PER_SPLIT, SPLIT_K, ZERO,
    # strides (unit stride along K for X, Q, QH; along N for S, Y)
    stride_xm, stride_qn, stride_qhn, stride_sg, stride_ym,
    # constexpr flags
    BITS: tl.constexpr, GROUP: tl.constexpr, LOOKUP: tl.constexpr, USE_DOT: tl.constexpr,
    USE_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, IS_BF16: tl.constexpr, JOIN_K: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    it0 = pid_k * ITERS_PER_SPLIT
    it1 = tl.minimum(it0 + ITERS_PER_SPLIT, NUM_ITERS)
    PER: tl.constexpr = 32 if BITS == 3 else 32 // BITS  # slots per word
    PB: tl.constexpr = 16 * PER  # codes per packing block (one loop step)
    FLUSH: tl.constexpr = GROUP if GROUP < PB else PB  # codes per scale multiply
    SPF: tl.constexpr = FLUSH // 16  # slots per flush
    NG = tl.cdiv(K, GROUP)
    offs_s = tl.arange(0, 16)
    # table addresses as per-thread int64 (ZERO == 0 at run time, unknown to the compiler)
    tbase = (T.to(tl.int64, bitcast=True) + (offs_n * ZERO).to(tl.int64))[:, None]
    t2base = (T2.to(tl.int64, bitcast=True) + (offs_n * ZERO).to(tl.int64))[:, None]
    WORD4: tl.constexpr = BITS == 4 and LOOKUP == 0 and not DOT_F32
    JOIN: tl.constexpr = JOIN_K and USE_DOT and LOOKUP != 3 and (SPF == 2 or SPF == 4 or SPF == 8)
    SWORD4: tl.constexpr = BITS == 4 and LOOKUP == 4 and not DOT_F32
    if LOOKUP == 4 and not DOT_F32:
        _smem_table_store(T, BITS)

    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    if PREFETCH:  # registers double buffer: block it+1 is in flight while block it is computed
        na, nb = _load_block(Q, QH, offs_n, n_mask, it0, stride_qn, stride_qhn, BITS, it0 < it1)
    for it in range(it0, it1):
        if PREFETCH:
            wa, wb = na, nb
            na, nb = _load_block(Q, QH, offs_n, n_mask, it + 1, stride_qn, stride_qhn, BITS, it + 1 < it1)
        else:
            wa, wb = _load_block(Q, QH, offs_n, n_mask, it, stride_qn, stride_qhn, BITS)
        if WORD4:
            s0, s1, s2, s3, s4, s5, s6, s7 = _lookup_word4(wa, tbase)
        elif SWORD4:
            s0, s1, s2, s3, s4, s5, s6, s7 = _smem_word4(wa)
        else:  # unused placeholders
            s0, s1, s2, s3, s4, s5, s6, s7 = wa, wa, wa, wa, wa, wa, wa, wa
        for f in tl.static_range(PB // FLUSH):
            part = acc  # placeholder, replaced by the first slot (FIRST=True ignores it)
            if JOIN:
                part = _flush_dot(f * SPF, SPF, wa, wb, T, tbase, X, offs_m, m_mask, stride_xm, it * PB, K,
                                  BITS, LOOKUP, WORD4 or SWORD4, DOT_F32, s0, s1, s2, s3, s4, s5, s6, s7)
            else:
                for p in tl.static_range(SPF // 2):
                    j = f * SPF + 2 * p
                    if WORD4 or SWORD4:
                        v0 = _pick8(j, s0, s1, s2, s3, s4, s5, s6, s7)
                        v1 = _pick8(j + 1, s0, s1, s2, s3, s4, s5, s6, s7)
                    elif LOOKUP == 3:
                        v0, v1 = _pair_lookup(wa, wb, j, T2, t2base, BITS, IS_BF16, DOT_F32)
                    else:
                        v0 = _lookup(_slot_codes(wa, wb, j, BITS), T, tbase, BITS, LOOKUP, DOT_F32)
                        v1 = _lookup(_slot_codes(wa, wb, j + 1, BITS), T, tbase, BITS, LOOKUP, DOT_F32)
                    k0 = it * PB + j * 16
                    part = _slot_product(part, v0, X, offs_m, m_mask, pid_m, stride_xm, k0, K, p == 0, USE_DOT,
                                         DOT_F32)
                    part = _slot_product(part, v1, X, offs_m, m_mask, pid_m, stride_xm, k0 + 16, K, False, USE_DOT,
                                         DOT_F32)
            g = (it * PB + f * FLUSH) // GROUP
            s = tl.load(S + g * stride_sg + offs_n, mask=n_mask & (g < NG), other=0.0).to(tl.float32)
            acc += part * s[:, None]
    if LOOKUP == 4:
        tl.debug_barrier()  # the table's bytes are Triton's scratch from here on
    if not USE_DOT:
        acc = tl.sum(acc, axis=1, keep_dims=True)  # [BLOCK_N, 1]; BLOCK_M == 1 here

    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
    if USE_SPLIT:
        ws_off = offs_m[None, :] * N + offs_n[:, None]
        tl.store(WS + pid_k * M * N + ws_off, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(LOCKS + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for sk in range(0, SPLIT_K):
                tot += tl.load(WS + sk * M * N + ws_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(LOCKS + tile, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def _lut_dequant_kernel(
    Q, QH, S, T, W,
    N, K,
    stride_qn, stride_qhn, stride_sg, stride_wn,
    BITS: tl.constexpr, GROUP: tl.constexpr, LOOKUP: tl.constexpr, BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """W[n, k] = T[c] * s for one [BLOCK_N, packing block] tile (the large-M path feeds cuBLAS)."""
    pid_n = tl.program_id(0)
    it = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    PER: tl.constexpr = 32 if BITS == 3 else 32 // BITS
    PB: tl.constexpr = 16 * PER
    wa, wb = _load_block(Q, QH, offs_n, n_mask, it, stride_qn, stride_qhn, BITS)
    for j in tl.static_range(PER):
        offs_k = it * PB + j * 16 + tl.arange(0, 16)
        g = (it * PB + j * 16) // GROUP
        s = tl.load(S + g * stride_sg + offs_n, mask=n_mask & (g < tl.cdiv(K, GROUP)), other=0.0).to(tl.float32)
        w = _lookup(_slot_codes(wa, wb, j, BITS), T, T.to(tl.int64, bitcast=True), BITS, LOOKUP, INTERPRET) * s[:, None]
        tl.store(W + offs_n[:, None] * stride_wn + offs_k[None, :], w.to(W.dtype.element_ty),
                 mask=n_mask[:, None] & (offs_k < K)[None, :])


# ----------------------------------------------------------------------------- configs
_WORKSPACE: dict = {}
LAST_COMPILED: dict = {}  # the last launched compiled kernel (PTX / register reports in benchmarks)


def _workspace(device, numel_ws: int, numel_locks: int):
    """Per-device float32 partials and int32 counters (counters stay zero between calls)."""
    key = (device.type, device.index)
    ws, locks = _WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < numel_ws:
        ws = torch.empty(max(numel_ws, 1 << 16), device=device, dtype=torch.float32)
    if locks is None or locks.numel() < numel_locks:
        locks = torch.zeros(max(numel_locks, 1 << 12), device=device, dtype=torch.int32)
    _WORKSPACE[key] = (ws, locks)
    return ws, locks


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_config(M: int, N: int, K: int, bits: int, group_size: int, device) -> dict:
    """Launch parameters by problem size (chosen from the H200 sweeps of rounds r2/r3, see
    docs/sections/lut.md). ``ctas_per_sm`` sets split-K: enough programs for that many per SM."""
    if M == 1:
        return dict(use_dot=False, block_m=1, block_n=64, num_warps=4, num_stages=1,
                    ctas_per_sm=16 if bits == 4 else 8, prefetch=False)
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    return dict(use_dot=True, block_m=bm, block_n=64, num_warps=4, num_stages=2,
                ctas_per_sm=8 if M <= 16 else 4, join=False)


def lut_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, qweight_hi: torch.Tensor | None,
                    scales: torch.Tensor, table: torch.Tensor, *, bits: int, group_size: int,
                    out_features: int, lookup: str = "load", pairs: torch.Tensor | None = None,
                    **overrides) -> torch.Tensor:
    """Launch ``_lut_gemm_kernel``. ``x`` [M, K] bf16/fp16 with unit K stride; layouts in
    ``lowbit.formats.lut``. ``overrides`` replace fields of ``default_config`` (benchmarks sweep
    them; ``split_k`` fixes the split)."""
    M, K = x.shape
    N = out_features
    cfg = default_config(M, N, K, bits, group_size, x.device)
    cfg.update(overrides)
    bm, bn = cfg["block_m"], cfg["block_n"]
    if not cfg["use_dot"] and bm != 1:
        raise ValueError("the FMA path needs block_m == 1")
    if lookup == "load":  # the best table for the path (measured): shared memory (FMA, 4-bit),
        # pair table in L1 (FMA, 2/3-bit), L1 (dot)
        fma = not cfg["use_dot"] and cfg["num_stages"] == 1
        if fma and bits != 4 and pairs is not None and pairs.dtype == x.dtype:
            lookup = "pair"
        else:
            lookup = "smem" if fma else "global"
    if lookup == "smem" and (cfg["use_dot"] or cfg["num_stages"] != 1):
        lookup = "global"  # the shared-memory table is only safe where Triton uses no smem in the loop
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    num_iters = packed_k(K, bits) // pack_block(bits)
    grid_n, grid_m = cdiv(N, bn), cdiv(M, bm)
    split = cfg.get("split_k")
    if split is None:
        target = cfg["ctas_per_sm"] * _sm_count(x.device)
        split = max(1, min(num_iters, cdiv(target, grid_n * grid_m)))
    split = max(1, min(int(split), num_iters))
    per = cdiv(num_iters, split)
    split = cdiv(num_iters, per)  # no empty ranges
    if split > 1:
        ws, locks = _workspace(x.device, split * M * N, grid_n * grid_m)
    else:
        ws, locks = y, y  # unused
    qh = qweight_hi if qweight_hi is not None else qweight
    if lookup == "pair":
        if pairs is None or pairs.shape != (4 ** bits, 2) or pairs.dtype != x.dtype:
            raise ValueError(f"lookup='pair' needs pairs = formats.lut.pair_table(table, {bits}, x.dtype)")
        pairs = pairs.contiguous().view(torch.int32)
    LAST_COMPILED["gemm"] = _lut_gemm_kernel[(grid_n, grid_m, split)](
        x, qweight, qh, scales, table, pairs if pairs is not None else table, y, ws, locks,
        M, N, K, num_iters, per, split, 0,
        x.stride(0), qweight.stride(0), qh.stride(0), scales.stride(0), y.stride(0),
        BITS=bits, GROUP=group_size, LOOKUP=LOOKUPS[lookup], USE_DOT=cfg["use_dot"],
        USE_SPLIT=split > 1, BLOCK_M=bm, BLOCK_N=bn, DOT_F32=interpret_mode(),
        IS_BF16=x.dtype == torch.bfloat16, JOIN_K=cfg.get("join", False), PREFETCH=cfg.get("prefetch", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y


def lut_dequant_triton(qweight, qweight_hi, scales, table, *, bits: int, group_size: int, out_features: int,
                       in_features: int, dtype: torch.dtype, lookup: str = "load") -> torch.Tensor:
    """Dequantized weight [N, K] in ``dtype`` (the M > MAX_KERNEL_M path hands it to cuBLAS)."""
    N, K = out_features, in_features
    w = torch.empty((N, K), device=qweight.device, dtype=dtype)
    if N == 0 or K == 0:
        return w
    bn = 32
    qh = qweight_hi if qweight_hi is not None else qweight
    _lut_dequant_kernel[(cdiv(N, bn), packed_k(K, bits) // pack_block(bits))](
        qweight, qh, scales, table, w, N, K,
        qweight.stride(0), qh.stride(0), scales.stride(0), w.stride(0),
        BITS=bits, GROUP=group_size, LOOKUP=LOOKUPS["global" if lookup in ("load", "smem", "pair") else lookup],
        BLOCK_N=bn, INTERPRET=interpret_mode(), num_warps=4,
    )
    return w
