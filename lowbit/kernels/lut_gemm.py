"""Triton lookup-table weight-only GEMM (FLUTE, seed 002, §3), tuned for Hopper.

Two kernels, one per packed layout of ``lowbit.formats.lut``:

- ``_lut_mma_kernel`` (layout ``'mma'``, ``pack_codes_mma``; 4-bit g >= 64, 3-bit g >= 128): the
  codes are stored offline in ``mma.sync.m16n8k16`` A-fragment order (FLUTE §3.1), each lane's
  16-byte load is its fragments, a lane-duplicated pair table in shared memory turns each code
  byte into a bf16x2/f16x2 register (FLUTE §3.2 without bank conflicts), and the tensor core does
  the multiply-add with float32 accumulation (the token dim padded to 8 per n-tile). One
  instruction stream for M = 1..32: M only adds mma instructions, the lookups are shared.
  Its docstring has the details;
- ``_lut_gemm_kernel`` (layout ``'planar'``, ``pack_codes``; every bits/group): described below.

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
counter to 0 for the next call. One launch, no memset. (Session 16 issued that sum's loads 4 or 8 at a time
instead of one split after the other: bit-equal and no faster, M = 1 o 10.2 vs 9.6 us, down 18.1 vs 17.1 on the H200,
``benchmarks/results/h200/s16_splitk.json``; the serial loop stays.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import arrival_counters, cdiv, interpret_mode, sm_count, stream_scratch, warn_once
from lowbit.formats.lut import SILU_BLOCK, pack_block, packed_k
from lowbit.kernels.act_quant import pdl_enabled, pdl_prologue
from lowbit.kernels.silu_mul import silu_mul_f32

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


def _word4_asm(smem: bool) -> str:
    """PTX decoding all 8 codes of a 4-bit planar word (slot j = bits 4j..4j+3) and looking them
    up: masks put even / odd slots into byte lanes (``lo``, ``hi``), one ``prmt`` per code
    extracts it, then one load per code from the fp32 table -- in shared memory (``smem``: the
    masks pre-scale the code by 4, the address is folded into ``LDS [R+UR]``) or in L1
    (``ld.global.nc``, address by one ``mad.wide``). Outputs $0..$7 = slots 0..7."""
    if smem:
        head = [" .reg .b32 lo, hi, c, z, b;", " mov.b32 z, 0;", " mov.u32 b, global_smem;",
                " shl.b32 lo, $8, 2;", " and.b32 lo, lo, 0x3C3C3C3C;", " shr.u32 hi, $8, 2;",
                " and.b32 hi, hi, 0x3C3C3C3C;"]
        load = "add.u32 c, c, b; ld.shared.f32 ${o}, [c];"
    else:
        head = [" .reg .b32 lo, hi, c, z; .reg .b64 a;", " mov.b32 z, 0;", " and.b32 lo, $8, 0x0F0F0F0F;",
                " shr.u32 hi, $8, 4;", " and.b32 hi, hi, 0x0F0F0F0F;"]
        load = "mad.wide.u32 a, c, 4, $9; ld.global.nc.f32 ${o}, [a];"
    body = [f" prmt.b32 c, {'hi' if j % 2 else 'lo'}, z, 0x444{j // 2}; " + load.format(o=j) for j in range(8)]
    return "\n".join(["{"] + head + body + ["}"])


_NF4_WORD_ASM = tl.constexpr(_word4_asm(False))
_SMEM_WORD_ASM = tl.constexpr(_word4_asm(True))


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
def _lookup_word4(wa, tbase, SMEM: tl.constexpr):
    """All 8 slots of each 4-bit planar word at once (``_word4_asm``), from the shared-memory
    table (``SMEM``) or the L1 one. Returns 8 float32 tensors (slot 0..7), each in the layout of ``wa``."""
    F8: tl.constexpr = (tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32)
    if SMEM:
        r = tl.inline_asm_elementwise(_SMEM_WORD_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,l", [wa, tbase], dtype=F8,
                                      is_pure=True, pack=1)
    else:
        r = tl.inline_asm_elementwise(_NF4_WORD_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,l", [wa, tbase], dtype=F8,
                                      is_pure=True, pack=1)
    return r


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
            s0, s1, s2, s3, s4, s5, s6, s7 = _lookup_word4(wa, tbase, False)
        elif SWORD4:
            s0, s1, s2, s3, s4, s5, s6, s7 = _lookup_word4(wa, tbase, True)
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


# ----------------------------------------------------------------------------- MMA fragment kernel
def _mma_asm(nt: int, bf16: bool, bits: int) -> str:
    """PTX of one pack=4 instance of ``_lut_mma_kernel``'s step (4 int32 code words per lane =
    one 16-byte load): ``KS`` k-steps (4 at 4-bit, 8 at 3-bit) x ``nt`` n-tiles of
    ``mma.sync.m16n8k16`` with f32 accumulation. Per k-step, 4 pair lookups (shift; and + or with
    the lane offset = one LOP3; ``ld.shared`` with the table base folded in) give the 4 bf16x2 /
    f16x2 A registers. 3-bit first merges the 2-bit and 1-bit planes into one byte per pair with a
    single select (``lop3``), see ``formats.lut.pack_codes_mma``.
    Operands: C out (nt x 4) | words 4 | [3-bit: hi words 4] | lane offsets 4 |
    x words (nt x NX x 4: word w of n-tile j at j*4*NX + w) | C in (nt x 4)."""
    ty = "bf16" if bf16 else "f16"
    nx = 2 if bits == 4 else 4  # x tensors per n-tile (8 or 16 words: b0/b1 of each k-step)
    o_w = 4 * nt
    o_h = o_w + 4
    o_l = o_h + (4 if bits == 3 else 0)
    o_x = o_l + 4
    o_c = o_x + 4 * nx * nt
    mask = "0x7F80" if bits == 4 else "0x1F80"
    lines = ["{", ".reg .b32 a0, a1, a2, a3, t, m, u, gs, sel;", "mov.b32 sel, 0x0F0F0F0F;",
             "mov.u32 gs, global_smem;"]
    ks = 4 if bits == 4 else 8
    for s in range(ks):
        lb = f"${o_l}"
        if bits == 4:
            m = f"${o_w + s}"
        else:  # k-step s: lo nibbles of word s // 2 (low / high nibble of each byte), hi bits of word s // 4
            lo, hi = f"${o_w + s // 2}", f"${o_h + 2 * (s // 4)}"
            lo_e = lo if s % 2 == 0 else "u"
            if s % 2:
                lines.append(f"shr.u32 u, {lo}, 4;")
            hsh = {0: None, 1: ("shr", 2), 2: ("shl", 4), 3: ("shl", 2)}[s % 4]
            if hsh is None:
                lines.append(f"lop3.b32 m, {lo_e}, {hi}, sel, 0xE4;")
            else:
                lines.append(f"{hsh[0]}.b32 t, {hi}, {hsh[1]}; lop3.b32 m, {lo_e}, t, sel, 0xE4;")
            m = "m"
        shifts = ("shl.b32 t, {w}, 7;", "shr.u32 t, {w}, 1;", "shr.u32 t, {w}, 9;", "shr.u32 t, {w}, 17;")
        for b, sh in enumerate(shifts):
            lines.append(sh.format(w=m) + f" and.b32 t, t, {mask}; or.b32 t, t, {lb}; add.u32 t, t, gs; "
                         f"ld.shared.b32 a{b}, [t];")
        for j in range(nt):
            d = ", ".join(f"${4 * j + r}" for r in range(4))
            cin = d if s else ", ".join(f"${o_c + 4 * j + r}" for r in range(4))
            b0, b1 = f"${o_x + 4 * nx * j + 2 * s}", f"${o_x + 4 * nx * j + 2 * s + 1}"
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{{d}}}, {{a0, a1, a2, a3}}, "
                         f"{{{b0}, {b1}}}, {{{cin}}};")
    lines.append("}")
    return "\n".join(lines)


def _mma_cons(nt: int, bits: int) -> str:
    nx = 2 if bits == 4 else 4
    return ",".join(["=f"] * (4 * nt) + ["r"] * (12 if bits == 3 else 8) + ["r"] * (4 * nx * nt) + ["f"] * (4 * nt))


def _asm_table():
    out = {}
    for bits in (3, 4):
        for nt in (1, 2, 4):
            out[f"_MMA{bits}_{nt}_BF"] = tl.constexpr(_mma_asm(nt, True, bits))
            out[f"_MMA{bits}_{nt}_F"] = tl.constexpr(_mma_asm(nt, False, bits))
            out[f"_MMA{bits}_{nt}_C"] = tl.constexpr(_mma_cons(nt, bits))
    return out


globals().update(_asm_table())

# x fragments: lane (g, t) reads x[m, kc + 2*NXW*t : + 2*NXW] (NXW/4 16-byte loads; NXW = 8 at
# 4-bit, 16 at 3-bit), word w = (b0, b1) of k-step w // 2; rows m >= M (predicate) read nothing -> 0.
_XFRAG8_ASM = tl.constexpr("""{
 .reg .pred p; setp.ne.s32 p, $12, 0;
 mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
 mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;
 @p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$8];
 @p ld.global.nc.v4.b32 {$4, $5, $6, $7}, [$8+16];
}""")
_XFRAG16_ASM = tl.constexpr("""{
 .reg .pred p; setp.ne.s32 p, $20, 0;
 mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
 mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;
 mov.b32 $8, 0; mov.b32 $9, 0; mov.b32 $10, 0; mov.b32 $11, 0;
 mov.b32 $12, 0; mov.b32 $13, 0; mov.b32 $14, 0; mov.b32 $15, 0;
 @p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$16];
 @p ld.global.nc.v4.b32 {$4, $5, $6, $7}, [$16+16];
 @p ld.global.nc.v4.b32 {$8, $9, $10, $11}, [$16+32];
 @p ld.global.nc.v4.b32 {$12, $13, $14, $15}, [$16+48];
}""")
# 3-bit high-bit plane: the lane's 2 words (8 bytes) -> elements (h0, h0, h1, h1)
_HI_ASM = tl.constexpr("""{
 .reg .pred p; setp.ne.s32 p, $8, 0;
 mov.b32 $0, 0; mov.b32 $2, 0;
 @p ld.global.nc.v2.b32 {$0, $2}, [$4];
 mov.b32 $1, $0; mov.b32 $3, $2;
}""")

# scales of the C registers: elements 0, 1 -> row g, elements 2, 3 -> row g + 8 (address + 16 B)
_SCALE_ASM_BF = tl.constexpr("""{
 .reg .pred p, q; .reg .b16 h, z; .reg .b32 u;
 mov.b16 z, 0; setp.ne.s32 p, $8, 0; setp.ne.s32 q, $10, 0;
 mov.b16 h, 0; @p ld.global.nc.b16 h, [$4]; mov.b32 u, {z, h}; mov.b32 $0, u; mov.b32 $1, u;
 mov.b16 h, 0; @q ld.global.nc.b16 h, [$4+16]; mov.b32 u, {z, h}; mov.b32 $2, u; mov.b32 $3, u;
}""")
_SCALE_ASM_F = tl.constexpr("""{
 .reg .pred p, q; .reg .b16 h; .reg .f32 u;
 setp.ne.s32 p, $8, 0; setp.ne.s32 q, $10, 0;
 mov.b16 h, 0; @p ld.global.nc.b16 h, [$4]; cvt.f32.f16 u, h; mov.b32 $0, u; mov.b32 $1, u;
 mov.b16 h, 0; @q ld.global.nc.b16 h, [$4+16]; cvt.f32.f16 u, h; mov.b32 $2, u; mov.b32 $3, u;
}""")


# cp.async ring of the code words (option RING): each lane copies its own 16-byte fragment vector
# into its own shared-memory slot and later reads back only what it wrote itself, so no barrier is
# needed -- ``cp.async.wait_group`` makes the lane's own copies visible to it. Operands (pack=4):
# outputs $0..$3 (dummy), source address $4, destination offset $8, predicate $12.
def _cp_async_asm(cache_op: str, nbytes: int) -> str:
    """One predicated ``cp.async.<cache_op>`` of ``nbytes`` to the lane's slot, committed as its own group."""
    return ("{\n .reg .pred p; .reg .u32 d; setp.ne.s32 p, $12, 0;\n mov.u32 d, global_smem; add.u32 d, d, $8;\n"
            f" @p cp.async.{cache_op}.shared.global [d], [$4], {nbytes};\n cp.async.commit_group;\n"
            " mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n}")


_CP_ASM = tl.constexpr(_cp_async_asm("cg", 16))


def _ring_read_asm(pending: int) -> str:
    """Wait until at most ``pending`` commit groups of this lane are in flight, then read its slot."""
    return ("{ .reg .u32 d; cp.async.wait_group " + str(pending) + "; mov.u32 d, global_smem; add.u32 d, d, $4; "
            "ld.shared.v4.b32 {$0, $1, $2, $3}, [d]; }")


def _ring_read3_asm(pending: int) -> str:
    """3-bit: the lane's code words ($0..$3) and its 8 bytes of the high-bit plane as (h0, h0, h1, h1) ($4..$7)."""
    return ("{ .reg .u32 d; cp.async.wait_group " + str(pending) + "; mov.u32 d, global_smem; add.u32 d, d, $8; "
            "ld.shared.v4.b32 {$0, $1, $2, $3}, [d]; mov.u32 d, global_smem; add.u32 d, d, $12; "
            "ld.shared.v2.b32 {$4, $6}, [d]; mov.b32 $5, $4; mov.b32 $7, $6; }")


# 3-bit high-bit plane: 8 bytes per lane and row tile (cp.async.ca: .cg copies 16 bytes only)
_CPH_ASM = tl.constexpr(_cp_async_asm("ca", 8))
_RING_RD = {n: tl.constexpr(_ring_read_asm(n)) for n in (0, 1, 2, 3, 4, 6, 7, 12, 14, 28)}
_RD0, _RD1, _RD2, _RD3, _RD4, _RD6, _RD7, _RD12, _RD14, _RD28 = (_RING_RD[n] for n in (0, 1, 2, 3, 4, 6, 7, 12, 14, 28))
_RING_RD3 = {n: tl.constexpr(_ring_read3_asm(n)) for n in (2, 4, 6, 8, 12, 14, 24, 28, 56)}
_RH2, _RH4, _RH6, _RH8, _RH12, _RH14, _RH24, _RH28, _RH56 = (_RING_RD3[n] for n in (2, 4, 6, 8, 12, 14, 24, 28, 56))


@triton.jit
def _ring_issue(Q, q_off, cidx, ok, dst):
    """cp.async of chunk ``cidx``'s code words (16 bytes per lane and row tile) to shared offset ``dst``."""
    addr = Q.to(tl.int64, bitcast=True) + ((q_off + cidx * 128) * 4).to(tl.int64)
    tl.inline_asm_elementwise(_CP_ASM, "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r", [addr, dst, ok.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=4)


@triton.jit
def _ring_issue_hi(QH, rt, lane, NC, cidx, ok, dst):
    """cp.async of chunk ``cidx``'s high-bit plane (3-bit: 8 bytes per lane and row tile) to shared ``dst``."""
    haddr = QH.to(tl.int64, bitcast=True) + ((rt * NC + cidx) * 256 + lane * 8).to(tl.int64)
    tl.inline_asm_elementwise(_CPH_ASM, "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r", [haddr, dst, ok.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=4)


@triton.jit
def _ring_read3(src, hsrc, PENDING: tl.constexpr):
    if PENDING == 2:
        a: tl.constexpr = _RH2
    elif PENDING == 4:
        a: tl.constexpr = _RH4
    elif PENDING == 6:
        a: tl.constexpr = _RH6
    elif PENDING == 8:
        a: tl.constexpr = _RH8
    elif PENDING == 12:
        a: tl.constexpr = _RH12
    elif PENDING == 14:
        a: tl.constexpr = _RH14
    elif PENDING == 24:
        a: tl.constexpr = _RH24
    elif PENDING == 28:
        a: tl.constexpr = _RH28
    else:
        a: tl.constexpr = _RH56
    return tl.inline_asm_elementwise(a, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r", [src, hsrc],
                                     dtype=(tl.int32, tl.int32), is_pure=False, pack=4)


@triton.jit
def _load_scales(S, gi, stride_sg, rt, g, ok, S_BF16: tl.constexpr):
    """Scales of group ``gi`` for the C registers (rows g and g + 8 of each row tile), float32."""
    saddr = S.to(tl.int64, bitcast=True) + ((gi * stride_sg + rt * 16 + g) * 2).to(tl.int64)
    return tl.inline_asm_elementwise(_SCALE_ASM_BF if S_BF16 else _SCALE_ASM_F, "=f,=f,=f,=f,l,l,l,l,r,r,r,r",
                                     [saddr, ok.to(tl.int32)], dtype=tl.float32, is_pure=True, pack=4)


# one 16-byte store of 4 lane copies of a table entry at shared byte offset $1 (also the Gluon LUT kernel's)
PAIR_STORE_PTX = ("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; st.shared.v4.b32 [a], {$2, $2, $2, $2}; "
                  "mov.b32 $0, 0; }")
_PAIR_STORE = tl.constexpr(PAIR_STORE_PTX)


@triton.jit
def _store_pair_table(P, BITS: tl.constexpr, off=0, NIBBLES: tl.constexpr = False):
    """The lane-duplicated pair table (int32 rows of ``P``) into shared memory at byte offset ``off`` (see
    ``_lut_mma_kernel``; the register-table kernel's ``SMEM_TAB`` puts it past Triton's own buffers): lane l's
    copy of entry e at ``off + 128 e + 4 l``, then a barrier. ``NIBBLES`` (3-bit): 256 entries indexed like the
    4-bit table, entry e = the codes (e & 7, (e >> 4) & 7) of one byte of the 4-bit-layout words
    ``lut_wgmma._words3`` builds, read from the 3-bit pair table's row ``formats.lut.pair_table`` indexes them by."""
    if NIBBLES:
        NE: tl.constexpr = 256
    else:
        NE: tl.constexpr = 1 << (2 * BITS)
    f = tl.arange(0, NE * 8)  # 16-byte slot f holds 4 lane copies (lanes 4 (f % 8) ..) of entry f // 8
    if NIBBLES:
        c0 = (f // 8) & 7
        c1 = (f // 128) & 7
        pv = tl.load(P + ((c0 & 3) | ((c1 & 3) << 2) | ((c0 >> 2) << 4) | ((c1 >> 2) << 5)))
    else:
        pv = tl.load(P + f // 8)
    tl.inline_asm_elementwise(
        _PAIR_STORE, "=r,r,r", [f * 16 + off, pv], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _ring_read(src, PENDING: tl.constexpr):
    if PENDING == 0:
        a: tl.constexpr = _RD0
    elif PENDING == 1:
        a: tl.constexpr = _RD1
    elif PENDING == 2:
        a: tl.constexpr = _RD2
    elif PENDING == 3:
        a: tl.constexpr = _RD3
    elif PENDING == 4:
        a: tl.constexpr = _RD4
    elif PENDING == 6:
        a: tl.constexpr = _RD6
    elif PENDING == 7:
        a: tl.constexpr = _RD7
    elif PENDING == 12:
        a: tl.constexpr = _RD12
    elif PENDING == 14:
        a: tl.constexpr = _RD14
    else:
        a: tl.constexpr = _RD28
    return tl.inline_asm_elementwise(a, "=r,=r,=r,=r,r,r,r,r", [src], dtype=tl.int32, is_pure=False, pack=4)


@triton.jit
def _xfrag(X, m, t, stride_xm, kc, M, BITS: tl.constexpr):
    """x fragment words [1, S] (int32 = 2 activations) of rows m for the chunk at K offset kc:
    2 tensors (4-bit) or 4 (3-bit), element e of tensor q = word 4 q + e of the lane."""
    NXW: tl.constexpr = 8 if BITS == 4 else 16
    addr = X.to(tl.int64, bitcast=True) + ((m * stride_xm + kc + 2 * NXW * t) * 2).to(tl.int64)
    ok = (m < M).to(tl.int32)
    if BITS == 4:
        x0, x1 = tl.inline_asm_elementwise(_XFRAG8_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,r,r,r,r", [addr, ok],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=4)
        x2, x3 = x0, x1
    else:
        x0, x1, x2, x3 = tl.inline_asm_elementwise(
            _XFRAG16_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,r,r,r,r", [addr, ok],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=4)
    return x0, x1, x2, x3


@triton.jit
def _xall(X, m0, t, stride_xm, kc, M, BITS: tl.constexpr, NT: tl.constexpr):
    """x fragments of all NT n-tiles of one chunk as one tuple (a0..a3, b0..b3, c0..c3, e0..e3;
    n-tiles beyond NT repeat n-tile 0): with ``XH == 2`` they are loaded one scale group ahead."""
    a0, a1, a2, a3 = _xfrag(X, m0, t, stride_xm, kc, M, BITS)
    b0, b1, b2, b3 = a0, a1, a2, a3
    c0, c1, c2, c3 = a0, a1, a2, a3
    e0, e1, e2, e3 = a0, a1, a2, a3
    if NT >= 2:
        b0, b1, b2, b3 = _xfrag(X, m0 + 8, t, stride_xm, kc, M, BITS)
    if NT >= 4:
        c0, c1, c2, c3 = _xfrag(X, m0 + 16, t, stride_xm, kc, M, BITS)
        e0, e1, e2, e3 = _xfrag(X, m0 + 24, t, stride_xm, kc, M, BITS)
    return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3)


@triton.jit
def _mma_step(words, hi, laneb, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3,
              p0, p1, p2, p3, NT: tl.constexpr, BITS: tl.constexpr, IS_BF16: tl.constexpr):
    """One chunk: NT n-tiles; a*/b*/c*/e* = x words of n-tiles 0..3, p* = C of n-tiles 0..3."""
    F: tl.constexpr = (tl.float32, tl.float32, tl.float32, tl.float32)
    if BITS == 4:
        if NT == 1:
            A1: tl.constexpr = _MMA4_1_BF if IS_BF16 else _MMA4_1_F
            r0 = tl.inline_asm_elementwise(A1, _MMA4_1_C, [words, laneb, a0, a1, p0], dtype=tl.float32, is_pure=True,
                                           pack=4)
            r1, r2, r3 = p1, p2, p3
        elif NT == 2:
            A2: tl.constexpr = _MMA4_2_BF if IS_BF16 else _MMA4_2_F
            r0, r1 = tl.inline_asm_elementwise(A2, _MMA4_2_C, [words, laneb, a0, a1, b0, b1, p0, p1],
                                               dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            r2, r3 = p2, p3
        else:
            A4: tl.constexpr = _MMA4_4_BF if IS_BF16 else _MMA4_4_F
            r0, r1, r2, r3 = tl.inline_asm_elementwise(
                A4, _MMA4_4_C, [words, laneb, a0, a1, b0, b1, c0, c1, e0, e1, p0, p1, p2, p3], dtype=F, is_pure=True,
                pack=4)
    else:
        if NT == 1:
            r0 = tl.inline_asm_elementwise(_MMA3_1_BF if IS_BF16 else _MMA3_1_F, _MMA3_1_C,
                                           [words, hi, laneb, a0, a1, a2, a3, p0], dtype=tl.float32, is_pure=True,
                                           pack=4)
            r1, r2, r3 = p1, p2, p3
        elif NT == 2:
            r0, r1 = tl.inline_asm_elementwise(_MMA3_2_BF if IS_BF16 else _MMA3_2_F, _MMA3_2_C,
                                               [words, hi, laneb, a0, a1, a2, a3, b0, b1, b2, b3, p0, p1],
                                               dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            r2, r3 = p2, p3
        else:
            r0, r1, r2, r3 = tl.inline_asm_elementwise(
                _MMA3_4_BF if IS_BF16 else _MMA3_4_F, _MMA3_4_C,
                [words, hi, laneb, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3, p0, p1, p2, p3],
                dtype=F, is_pure=True, pack=4)
    return r0, r1, r2, r3


@triton.jit
def _emulate_mma(Q, QH, T, X, row, m, M, N, K, stride_xm, cidx, acc, NC, BITS: tl.constexpr, IS_BF16: tl.constexpr,
                 ok=True):
    """Interpreter stand-in for one chunk of one n-tile: C[row, m] += sum over the chunk's K of
    T[code] (rounded to the activation dtype) * x[m, K], codes read back through the fragment layout
    (``formats.lut.pack_codes_mma``) exactly where the kernel's lanes find them."""
    CK: tl.constexpr = 64 if BITS == 4 else 128
    kk = tl.arange(0, CK)[None, None, :]
    row = row[:, :, None]
    m = m[:, :, None]
    tt = kk // (CK // 4)
    s = (kk // 4) % (CK // 16)
    bh = (kk // 2) % 2
    h = kk % 2
    g = (row % 16) % 8
    rh = (row % 16) // 8
    rt = row // 16
    b = bh * 2 + rh
    lane = g * 4 + tt
    if BITS == 4:
        word = tl.load(Q + (rt * NC + cidx) * 128 + lane * 4 + s, mask=(row < N) & ok, other=0)
        code = (word >> (4 * (bh * 4 + rh * 2 + h))) & 15
    else:
        lo = tl.load(Q + (rt * NC + cidx) * 128 + lane * 4 + s // 2, mask=(row < N) & ok, other=0)
        code = (lo >> (8 * b + 4 * (s % 2) + 2 * h)) & 3
        hw = tl.load(QH + (rt * NC + cidx) * 64 + lane * 2 + s // 4, mask=(row < N) & ok, other=0)
        hpos = ((s % 4) + 2) % 4  # k-steps 0, 1, 2, 3 of the word -> bit pairs 2, 3, 0, 1 of the byte
        code = code | (((hw >> (8 * b + 2 * hpos + h)) & 1) << 2)
    tv = tl.load(T + code)
    if IS_BF16:
        tv = tv.to(tl.bfloat16).to(tl.float32)
    else:
        tv = tv.to(tl.float16).to(tl.float32)
    kx = cidx * CK + tt * (CK // 4) + s * 4 + bh * 2 + h
    xv = tl.load(X + m * stride_xm + kx, mask=(m < M) & (kx < K) & ok, other=0.0).to(tl.float32)
    return acc + tl.sum(tv * xv, axis=2)


@triton.jit
def _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, cidx, ok, BITS: tl.constexpr):
    """Code words of chunk ``cidx`` (one 16-byte load per lane) and, 3-bit, the lane's 8 bytes of
    the high-bit plane as elements (h0, h0, h1, h1)."""
    words = tl.load(Q + q_off + cidx * 128, mask=rt_ok & ok, other=0)
    if BITS == 3:
        haddr = QH.to(tl.int64, bitcast=True) + ((rt * NC + cidx) * 256 + lane * 8).to(tl.int64)
        hi = tl.inline_asm_elementwise(_HI_ASM, "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [haddr, (rt_ok & ok).to(tl.int32)],
                                       dtype=tl.int32, is_pure=True, pack=4)
    else:
        hi = words
    return words, hi


@triton.jit
def _pick4(J: tl.constexpr, a0, a1, a2, a3):
    if J == 0:
        r = a0
    elif J == 1:
        r = a1
    elif J == 2:
        r = a2
    else:
        r = a3
    return r


@triton.jit
def _silu_mul_store(Y, a, row, mj, M, N, stride_ym, EMU: tl.constexpr):
    """The ``SILU_MUL`` epilogue of the fragment kernel: C registers ``a`` [R, SW] (register v = i % 4 of a lane
    holds weight row ``row`` = 16 rt + g + 8 (v // 2), token ``mj`` + v % 2) -> ``silu(gate) * up`` at output
    column 8 rt + g: the fused gate_up's rows g are gate and rows g + 8 up (``interleave_rows(.., 8)``), so each
    lane pairs its own registers v and v + 2."""
    R: tl.constexpr = a.shape[0]
    SW: tl.constexpr = a.shape[1]
    gate, up = tl.split(tl.permute(tl.reshape(a, [R, SW // 4, 2, 2]), (0, 1, 3, 2)))
    rg, _r = tl.split(tl.permute(tl.reshape(row, [R, SW // 4, 2, 2]), (0, 1, 3, 2)))
    mg, _m = tl.split(tl.permute(tl.reshape(tl.broadcast_to(mj, [R, SW]), [R, SW // 4, 2, 2]), (0, 1, 3, 2)))
    y = silu_mul_f32(gate, up, Y.dtype.element_ty, EMU)
    tl.store(Y + mg * stride_ym + (rg // 16) * 8 + rg % 8, y.to(Y.dtype.element_ty), mask=(rg < N) & (mg < M))


@triton.jit
def _smem_anchor(W: tl.constexpr):
    """0, computed through a cross-warp reduction so that Triton allocates (and so declares) its shared memory symbol
    ``global_smem``, which the pair table's inline PTX names: Triton emits the symbol only where its own code uses
    shared memory, and the fragment kernel's ``SILU_MUL`` epilogue without split-K has none (ptxas: "Unknown symbol
    'global_smem'"; found by ``tests/test_lut_fuse.py::test_silu_mul_op_fuzz`` on the H200, session 28)."""
    s = tl.sum(tl.full([32 * W], 0, tl.int32) + tl.program_id(0), axis=0)
    return (s < 0).to(tl.int32)


@triton.jit(do_not_specialize=["M", "N", "K", "NRT", "NC", "NG", "GROUPS_PER_SPLIT", "SPLIT_K", "stride_xm",
                               "stride_sg", "stride_ym"])  # every int: see _MMA_PATCHED
def _lut_mma_kernel(
    # pointers
    X, Q, QH, S, P, T, Y, WS, LOCKS,
    # sizes
    M, N, K, NRT, NC, NG, GROUPS_PER_SPLIT, SPLIT_K,
    # strides (unit stride along K for X, along N for S, Y)
    stride_xm, stride_sg, stride_ym,
    # constexpr flags
    BITS: tl.constexpr, GROUP: tl.constexpr, NT: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
    IS_BF16: tl.constexpr, USE_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr,
    S_BF16: tl.constexpr, GU: tl.constexpr, XH: tl.constexpr = 0,  # XH: 0 or 2 (x one group ahead)
    RING: tl.constexpr = 0, RING_BASE: tl.constexpr = 0,  # cp.async ring depth (chunks; 0 = off), its smem offset
    SP: tl.constexpr = False,  # scales of the next group loaded one group ahead
    PDL: tl.constexpr = False,  # programmatic dependent launch (triggers the next one after its wait)
    SILU_MUL: tl.constexpr = False,  # fused gate_up (rows interleaved by 8): Y [M, N / 2] = silu(gate) * up
):
    """Tensor-core LUT GEMM on the fragment layout (``formats.lut.pack_codes_mma``), FLUTE §3.

    Program = ``W * R`` row tiles (16 rows each) x ``8 * NT`` tokens x one split-K range of scale
    groups. Each loop step ("chunk": 64 K at 4-bit, 128 K at 3-bit) loads, per thread, one 16-byte
    vector of code words (``[R, 128 W]`` words per program: element ``(r, i)`` belongs to warp
    ``i // 128``, lane ``(i // 4) % 32``; 3-bit adds 8 bytes of the high-bit plane), looks the code
    pairs up in a lane-duplicated pair table in shared memory (2**(2 BITS) entries x 32 copies:
    entry e of lane l at ``128 e + 4 l``, so a warp's 32 lookups hit 32 distinct banks: FLUTE's
    duplication, §3.2, taken to one copy per bank) and issues ``mma.sync`` (x as the 8-token B
    operand: M = 1 wastes 7/8 of the tensor core, which has time to spare here); the accumulators
    of one scale group are scaled once (``acc += C * s``, float32). The inline PTX keeps every
    tensor in the layout of the code load (element i of a tensor = register of the same lane),
    which is what makes the loaded words the lanes' mma fragments.

    Options (GPU only, off by default until a same-round A/B measures them faster):
    ``XH == 2`` loads the x (B) fragments of the next scale group while the current group computes
    (a register double buffer; without it each chunk's x loads sit right before their mma and every
    L1/L2 latency is exposed, which is what separates M = 16 from M = 1); ``RING = n`` streams the
    code words through a per-lane ``cp.async`` ring of n chunks in shared memory after the table
    (``RING_BASE``): each lane copies and later reads only its own 16 bytes, so ``cp.async.wait_group``
    is the only synchronisation, and n - 1 chunks stay in flight without holding registers; ``SP``
    loads the next group's scales with the current group (otherwise their load sits right before the
    scale FMA, one exposed memory latency per group). (A ``WIDE`` option, session 23, spaced the table's entries 256
    bytes apart (64 KB) so that one ``prmt`` builds each lookup address: offline SASS of the M = 1 launch's loop 278
    -> 213 instructions, yet on the H200 it lost at 1..8 tokens (session 24, ``s24_frag_wide.json``, us: M = 1 down
    22.4 vs 17.9, gate_up 30.9 vs 26.3; M = 8 qkv 20.0 vs 14.4) and tied at 16 -- the 64 KB table halves the
    resident programs -- and was removed in session 26.)
    (The register-table decode of ``lowbit.kernels.lut_prmt``
    in place of the pair lookups was built in session 13 and removed in session 14: bit-equal but slower where the
    op uses this kernel, H200 ``s14_probe_prmt.json``: 4-bit M = 1 down 27.9 vs 17.4 us, gate_up 42.5 vs 24.3.)

    ``PDL`` (Hopper, session 9, the runner's batch-1 decode chain): the kernel is a programmatic
    dependent launch; the pair table (and, with ``PREFETCH``, the first code words: weights never depend
    on the previous kernel) is loaded before ``griddepcontrol.wait``, so that set-up overlaps the previous
    kernel's tail; X, the workspace and Y are touched only after the wait. (A residual add in the
    epilogue was tried in session 9: bit-equal to torch's add but compiled to a slower 61-register
    schedule, M = 1 down 27.7 vs 19.5 us on the H200, ``lut_residual_probe_s9e.json``; removed.)
    ``SILU_MUL`` (session 26): a fused gate_up's ``silu(gate) * up`` in the epilogue, each lane pairing its C
    registers v / v + 2 (``_silu_mul_store``). Faster than the GEMM + a SiLU*mul pass alone (H200, gate_up M = 1:
    28.9 vs 31.1 us, ``s26_probe2.json``; batch-1 model without PDL 0.4409 vs 0.4452 ms per two-layer step + head,
    ``model_s26_b1_nopdl.json``) but not in the runner's PDL chain, where the pass's early trigger lets ``down``'s
    set-up overlap it: 0.4422 / 0.4395 vs 0.4354 / 0.4325 ms with the trigger after the main loop, 0.4495 with the
    early trigger (``down``'s programs then wait on the SMs while this grid still places programs), 0.4401 at exit
    (``model_s26_b1_*.json``); the GEMM + pass matches the unfused chain (0.4354 vs 0.4344,
    ``model_s26_b1_fragpass.json``). So the op uses it only without ``pdl``.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    SW: tl.constexpr = 128 * W
    CK: tl.constexpr = 64 if BITS == 4 else 128  # K per chunk
    i = tl.arange(0, SW)[None, :]
    rr = tl.arange(0, R)[:, None]
    lane = (i // 4) % 32
    g = lane // 4
    t = lane % 4
    v = i % 4
    rt = pid_n * (W * R) + rr * W + i // 128  # [R, SW]
    rt_ok = rt < NRT
    q_off = rt * (NC * 128) + i % 128
    row = rt * 16 + g + 8 * (v // 2)  # row of C register v
    m0 = pid_m * (8 * NT) + g  # x rows of the B fragments (n-tile j adds 8 j)
    mc = pid_m * (8 * NT) + 2 * t + (v % 2)  # token of C register v (n-tile j adds 8 j)
    laneb = lane * 4
    if SILU_MUL and not USE_SPLIT and not INTERPRET:  # the table's PTX needs Triton's shared memory symbol
        laneb += _smem_anchor(W)
    if not INTERPRET and RING == 0:  # (with RING the first copies are issued first, table after them)
        _store_pair_table(P, BITS, 0)
    CPG: tl.constexpr = GROUP // CK
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, NG)
    acc0 = tl.zeros([R, SW], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    PF: tl.constexpr = PREFETCH and not INTERPRET
    if PF:  # registers double buffer: the next group's words are in flight while this group computes
        w0, u0 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, g0 * CPG, g0 < g1, BITS)
        w1, u1, w2, u2, w3, u3 = w0, u0, w0, u0, w0, u0
        if CPG >= 2:
            w1, u1 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, g0 * CPG + 1, g0 < g1, BITS)
        if CPG >= 4:
            w2, u2 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, g0 * CPG + 2, g0 < g1, BITS)
            w3, u3 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, g0 * CPG + 3, g0 < g1, BITS)
    pdl_prologue(PDL)  # nothing above reads X or the workspace
    if XH == 2:  # x fragments of the next group in flight with the current group's mma
        kx0 = tl.where(g0 < g1, g0 * CPG, 0) * CK
        xn0 = _xall(X, m0, t, stride_xm, kx0, M, BITS, NT)
        xn1 = xn0
        if CPG >= 2:
            xn1 = _xall(X, m0, t, stride_xm, kx0 + CK, M, BITS, NT)
    if RING > 0:  # chunks c0 .. c0 + RING - 2 in flight before the loop (GU == 1, no PREFETCH)
        rc0 = g0 * CPG
        nch = (g1 - g0) * CPG
        # layout anchor: the inline asm below must see each lane's 4 words as its 4 consecutive elements
        # (the layout Triton gives the 16-byte code load); with no load among their operands the ring ops
        # would get the default one-element-per-thread layout (R12: misaligned cp.async). This load never
        # executes (K < 0 is false) and reads as 0; its layout propagates to every ring operand.
        lz = tl.load(Q + q_off + g0 * CPG * 128, mask=rt_ok & (K < 0), other=0)
        rdst = RING_BASE + (rr * SW + (i // 4) * 4) * 4 + lz  # this lane's 16 bytes in slot 0
        hdst = RING_BASE + RING * R * SW * 4 + (rr * (SW // 4) + i // 4) * 8 + lz  # 3-bit: hi plane, slot 0
        for sidx in tl.static_range(RING - 1):
            _ring_issue(Q, q_off, rc0 + sidx, rt_ok & (sidx < nch), rdst + sidx * (R * SW * 4))
            if BITS == 3:
                _ring_issue_hi(QH, rt, lane, NC, rc0 + sidx, rt_ok & (sidx < nch), hdst + sidx * (R * SW * 2))
        _store_pair_table(P, BITS, 0)  # while the first chunks are in flight (the ring lies after the table)
    if SP:  # the first group's scales (GU == 1, GPU only)
        s_nxt = _load_scales(S, g0, stride_sg, rt, g, (row < N) & (g0 < g1), S_BF16)
    CH: tl.constexpr = GU * CPG  # chunks per loop step
    UNR: tl.constexpr = GU > 1 and not INTERPRET and not PF
    for gs in range(g0, g1, GU):
        if UNR:  # all CH chunks' loads first: CH x R 16-byte loads per lane in flight at once
            v0, h0 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, gs * CPG, True, BITS)
            v1, v2, v3, v4, v5, v6, v7 = v0, v0, v0, v0, v0, v0, v0
            h1, h2, h3, h4, h5, h6, h7 = h0, h0, h0, h0, h0, h0, h0
            if CH > 1:
                v1, h1 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, gs * CPG + 1, gs + 1 // CPG < g1, BITS)
            if CH > 2:
                v2, h2 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, gs * CPG + 2, gs + 2 // CPG < g1, BITS)
                v3, h3 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, gs * CPG + 3, gs + 3 // CPG < g1, BITS)
            if CH > 4:
                v4, h4 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, gs * CPG + 4, gs + 4 // CPG < g1, BITS)
                v5, h5 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, gs * CPG + 5, gs + 5 // CPG < g1, BITS)
                v6, h6 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, gs * CPG + 6, gs + 6 // CPG < g1, BITS)
                v7, h7 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, gs * CPG + 7, gs + 7 // CPG < g1, BITS)
            # make every word depend on all loads (z == 0 at run time, K < 0 never holds): ptxas must
            # issue all CH x R loads before the first lookup instead of sinking them into the compute
            z = (v0 ^ v1 ^ v2 ^ v3 ^ v4 ^ v5 ^ v6 ^ v7 ^ h0 ^ h2 ^ h4 ^ h6) & tl.where(K < 0, -1, 0)
            v0, v1, v2, v3, v4, v5, v6, v7 = v0 + z, v1 + z, v2 + z, v3 + z, v4 + z, v5 + z, v6 + z, v7 + z
        for uu in tl.static_range(GU):
            gi = gs + uu
            gok = gi < g1  # the last step may cover fewer than GU groups: their scales read as 0
            p0 = tl.zeros([R, SW], dtype=tl.float32)
            p1 = p0
            p2 = p0
            p3 = p0
            if PF:
                cw0, cu0, cw1, cu1, cw2, cu2, cw3, cu3 = w0, u0, w1, u1, w2, u2, w3, u3
                nxt = gi + 1 < g1
                w0, u0 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, (gi + 1) * CPG, nxt, BITS)
                if CPG >= 2:
                    w1, u1 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, (gi + 1) * CPG + 1, nxt, BITS)
                if CPG >= 4:
                    w2, u2 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, (gi + 1) * CPG + 2, nxt, BITS)
                    w3, u3 = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, (gi + 1) * CPG + 3, nxt, BITS)
            if SP:
                s_cur = s_nxt
                s_nxt = _load_scales(S, gi + 1, stride_sg, rt, g, (row < N) & (gi + 1 < g1), S_BF16)
            if XH == 2:  # this group's x fragments were loaded one group ago; load the next group's
                xq0, xq1 = xn0, xn1
                kxn = tl.where(gi + 1 < g1, (gi + 1) * CPG, 0) * CK
                xn0 = _xall(X, m0, t, stride_xm, kxn, M, BITS, NT)
                xn1 = xn0
                if CPG >= 2:
                    xn1 = _xall(X, m0, t, stride_xm, kxn + CK, M, BITS, NT)
            for cc in tl.static_range(CPG):
                cidx = gi * CPG + cc
                if INTERPRET:
                    p0 = _emulate_mma(Q, QH, T, X, row, mc, M, N, K, stride_xm, cidx, p0, NC, BITS, IS_BF16, gok)
                    if NT >= 2:
                        p1 = _emulate_mma(Q, QH, T, X, row, mc + 8, M, N, K, stride_xm, cidx, p1, NC, BITS, IS_BF16,
                                          gok)
                    if NT >= 4:
                        p2 = _emulate_mma(Q, QH, T, X, row, mc + 16, M, N, K, stride_xm, cidx, p2, NC, BITS, IS_BF16,
                                          gok)
                        p3 = _emulate_mma(Q, QH, T, X, row, mc + 24, M, N, K, stride_xm, cidx, p3, NC, BITS, IS_BF16,
                                          gok)
                else:
                    if RING > 0:
                        kk = (gi - g0) * CPG + cc
                        _ring_issue(Q, q_off, rc0 + kk + RING - 1, rt_ok & (kk + RING - 1 < nch),
                                    rdst + ((kk + RING - 1) % RING) * (R * SW * 4))
                        if BITS == 3:
                            _ring_issue_hi(QH, rt, lane, NC, rc0 + kk + RING - 1, rt_ok & (kk + RING - 1 < nch),
                                           hdst + ((kk + RING - 1) % RING) * (R * SW * 2))
                            words, hi = _ring_read3(rdst + (kk % RING) * (R * SW * 4),
                                                    hdst + (kk % RING) * (R * SW * 2), (RING - 1) * R * 2)
                        else:
                            words = _ring_read(rdst + (kk % RING) * (R * SW * 4), (RING - 1) * R)
                            hi = words
                    elif PF:
                        words = _pick4(cc, cw0, cw1, cw2, cw3)
                        hi = _pick4(cc, cu0, cu1, cu2, cu3)
                    elif UNR:
                        words = _pick8(uu * CPG + cc, v0, v1, v2, v3, v4, v5, v6, v7)
                        hi = _pick8(uu * CPG + cc, h0, h1, h2, h3, h4, h5, h6, h7)
                    else:
                        words, hi = _load_chunk(Q, QH, q_off, rt, lane, rt_ok, NC, cidx, gok, BITS)
                    if XH > 0:
                        if cc == 0:
                            xq = xq0
                        else:
                            xq = xq1
                        a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3 = xq
                    else:
                        kc = tl.where(gok, cidx, 0) * CK  # x reads stay inside the padded row
                        a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3 = _xall(
                            X, m0, t, stride_xm, kc, M, BITS, NT)
                    p0, p1, p2, p3 = _mma_step(words, hi, laneb, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                                               e0, e1, e2, e3, p0, p1, p2, p3, NT, BITS, IS_BF16)
            if INTERPRET:
                s = tl.load(S + gi * stride_sg + row, mask=(row < N) & gok, other=0.0).to(tl.float32)
            elif SP:
                s = s_cur
            else:
                saddr = S.to(tl.int64, bitcast=True) + ((gi * stride_sg + rt * 16 + g) * 2).to(tl.int64)
                s = tl.inline_asm_elementwise(_SCALE_ASM_BF if S_BF16 else _SCALE_ASM_F,
                                              "=f,=f,=f,=f,l,l,l,l,r,r,r,r", [saddr, ((row < N) & gok).to(tl.int32)],
                                              dtype=tl.float32, is_pure=True, pack=4)
            acc0 += p0 * s
            if NT >= 2:
                acc1 += p1 * s
            if NT >= 4:
                acc2 += p2 * s
                acc3 += p3 * s
    if RING > 0:  # no copy may land in Triton's scratch after the loop (all are predicated; be sure)
        _ring_read(rdst, 0)
    if not INTERPRET:
        tl.debug_barrier()  # the table's bytes are Triton's scratch from here on
    for j in tl.static_range(NT):
        if j == 0:
            a = acc0
        elif j == 1:
            a = acc1
        elif j == 2:
            a = acc2
        else:
            a = acc3
        mj = mc + 8 * j
        out_mask = (row < N) & (mj < M)
        if USE_SPLIT:
            ws_off = mj * N + row
            tl.store(WS + pid_k * M * N + ws_off, a, mask=out_mask)
        elif SILU_MUL:
            _silu_mul_store(Y, a, row, mj, M, N, stride_ym, INTERPRET)
        else:
            tl.store(Y + mj * stride_ym + row, a.to(Y.dtype.element_ty), mask=out_mask)
    if USE_SPLIT:
        tl.debug_barrier()  # every thread's partial is written before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(LOCKS + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for j in tl.static_range(NT):
                mj = mc + 8 * j
                out_mask = (row < N) & (mj < M)
                ws_off = mj * N + row
                tot = tl.zeros([R, SW], dtype=tl.float32)
                for sk in range(0, SPLIT_K):
                    tot += tl.load(WS + sk * M * N + ws_off, mask=out_mask, other=0.0, cache_modifier=".cg")
                if SILU_MUL:
                    _silu_mul_store(Y, tot, row, mj, M, N, stride_ym, INTERPRET)
                else:
                    tl.store(Y + mj * stride_ym + row, tot.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(LOCKS + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _lut_dequant_mma_kernel(
    Q, QH, S, T, W, Offsets,
    N, K, NC, stride_sg, stride_wn,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERTS: tl.constexpr = False,
):
    """W[n, k] = T[c] * s from the fragment layout (the M > MAX_KERNEL_M path): each output
    element finds its code word (``formats.lut.pack_codes_mma``) by index arithmetic; stores are
    coalesced along K, the word reads hit L1 (8 or 16 elements share a word). ``EXPERTS`` (session 41, the MoE
    prefill path): grid axis 2 = expert ``e``; ``Q`` / ``QH`` / ``S`` / ``T`` are int64 tables of the experts'
    tensors' addresses (``moe_grouped.address_table``), ``W`` is ``[E, N, K]``, and an expert that owns no rows
    (``Offsets[e + 1] == Offsets[e]``) writes nothing."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    CK: tl.constexpr = 64 if BITS == 4 else 128
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    ok = (n < N) & (k < K)
    if EXPERTS:
        e = tl.program_id(2)
        ok = ok & (tl.load(Offsets + e + 1) > tl.load(Offsets + e))
        Q = tl.multiple_of(tl.load(Q + e).to(tl.pointer_type(tl.int32)), 16)
        QH = tl.multiple_of(tl.load(QH + e).to(tl.pointer_type(tl.int32)), 16)
        S = tl.multiple_of(tl.load(S + e).to(tl.pointer_type(W.dtype.element_ty)), 16)
        T = tl.multiple_of(tl.load(T + e).to(tl.pointer_type(tl.float32)), 16)
        W += e.to(tl.int64) * N * K
    rt = n // 16
    c = k // CK
    r = k % CK
    s = (r // 4) % (CK // 16)
    b = ((r // 2) % 2) * 2 + (n % 16) // 8
    h = r % 2
    base = (rt * NC + c) * 32 + (n % 8) * 4 + r // (CK // 4)  # (row tile, chunk, lane)
    if BITS == 4:
        word = tl.load(Q + base * 4 + s, mask=ok, other=0)
        code = (word >> (8 * b + 4 * h)) & 15
    else:
        lo = tl.load(Q + base * 4 + s // 2, mask=ok, other=0)
        hw = tl.load(QH + base * 2 + s // 4, mask=ok, other=0)
        code = ((lo >> (8 * b + 4 * (s % 2) + 2 * h)) & 3) | (((hw >> (8 * b + 2 * (((s % 4) + 2) % 4) + h)) & 1) << 2)
    sc = tl.load(S + (k // GROUP) * stride_sg + n, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(T + code, mask=ok, other=0.0) * sc
    tl.store(W + n * stride_wn + k, w.to(W.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- configs
LAST_COMPILED: dict = {}  # the last launched compiled kernel (PTX / register reports in benchmarks)


def _workspace(device, numel_ws: int, numel_locks: int):
    """float32 partials and int32 arrival counters of the split-K launches, per device and stream
    (``_utils.stream_scratch`` / ``_utils.arrival_counters``: the counters are zero between calls)."""
    return (stream_scratch("lut", device, numel_ws, torch.float32),
            arrival_counters("lut", device, numel_locks))


def out_columns(N: int, silu_mul: bool) -> int:
    """The output columns of an ``N``-row weight: N, or N / 2 for a fused gate_up (``silu_mul``: gate / up rows
    interleaved in blocks of ``SILU_BLOCK``; N must be a multiple of 2 ``SILU_BLOCK``)."""
    if silu_mul and N % (2 * SILU_BLOCK):
        raise ValueError(f"silu_mul needs out_features a multiple of {2 * SILU_BLOCK} (gate/up rows interleaved by "
                         f"{SILU_BLOCK}), got {N}")
    return N // 2 if silu_mul else N


def gemm_output(x: torch.Tensor, N: int, K: int, cols: int | None = None) -> tuple[torch.Tensor, bool]:
    """The ``[M, cols]`` output (default ``N`` columns) in x's dtype, and whether it is already final without a launch
    (no rows or columns: empty; K = 0: zeros)."""
    M = x.shape[0]
    y = torch.empty((M, N if cols is None else cols), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y, True
    if K == 0:
        return y.zero_(), True
    return y, False


def planned_split(split: int | None, units: int, tiles: int, ctas_per_sm: int, sms: int) -> int:
    """The split count ``split_plan`` launches: ``split`` (None: enough programs for ``ctas_per_sm`` per SM) clamped to
    [1, units] and reduced to the fewest splits with the same units per split (no empty range)."""
    if split is None:
        split = cdiv(ctas_per_sm * sms, tiles)
    split = max(1, min(int(split), units))
    return cdiv(units, cdiv(units, split))


def split_plan(split: int | None, units: int, tiles: int, ctas_per_sm: int, y: torch.Tensor,
               n_cols: int | None = None):
    """Split-K over ``units`` (loop steps or scale groups) for ``tiles`` output tiles of ``y`` [M, N]: ``split``
    (None: enough programs for ``ctas_per_sm`` per SM) clamped to [1, units] with no empty range -> (split, units per
    split, FP32 workspace, counters); the workspace and counters are ``y`` itself (unused) without a split.
    ``n_cols``: the partials' columns where they differ from y's (an epilogue that halves them: SiLU*mul)."""
    split = planned_split(split, units, tiles, ctas_per_sm, _sm_count(y.device))
    per = cdiv(units, split)
    if split == 1:
        return 1, per, y, y
    ws, locks = _workspace(y.device, split * y.shape[0] * (n_cols or y.shape[1]), tiles)
    return split, per, ws, locks


def _sm_count(device) -> int:
    return sm_count(device, 4)


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
    y, done = gemm_output(x, N, K)
    if done:
        return y
    num_iters = packed_k(K, bits) // pack_block(bits)
    grid_n, grid_m = cdiv(N, bn), cdiv(M, bm)
    split, per, ws, locks = split_plan(cfg.get("split_k"), num_iters, grid_n * grid_m, cfg["ctas_per_sm"], y)
    qh = qweight_hi if qweight_hi is not None else qweight
    if lookup == "pair":
        if pairs is None or pairs.shape != (4 ** bits, 2) or pairs.dtype != x.dtype:
            raise ValueError(f"lookup='pair' needs pairs = formats.lut.pair_table(table, {bits}, x.dtype)")
        pairs = pairs.contiguous().view(torch.int32)
    try:
        LAST_COMPILED["gemm"] = _lut_gemm_kernel[(grid_n, grid_m, split)](
            x, qweight, qh, scales, table, pairs if pairs is not None else table, y, ws, locks,
            M, N, K, num_iters, per, split, 0,
            x.stride(0), qweight.stride(0), qh.stride(0), scales.stride(0), y.stride(0),
            BITS=bits, GROUP=group_size, LOOKUP=LOOKUPS[lookup], USE_DOT=cfg["use_dot"],
            USE_SPLIT=split > 1, BLOCK_M=bm, BLOCK_N=bn, DOT_F32=interpret_mode(),
            IS_BF16=x.dtype == torch.bfloat16, JOIN_K=cfg.get("join", False), PREFETCH=cfg.get("prefetch", False),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    except triton.runtime.errors.OutOfResources as exc:
        # a config that does not fit this GPU (r1: flute-nf3 at batch 64 asked for 264 KB of shared
        # memory): retry smaller -- one pipeline stage, then half the tile -- before giving up
        smaller = _smaller_config(cfg)
        if smaller is None:
            raise
        warn_once(f"lut_gemm: {exc}; retrying with {smaller}")
        smaller.pop("split_k", None)
        return lut_gemm_triton(x, qweight, qweight_hi, scales, table, bits=bits, group_size=group_size,
                               out_features=out_features, lookup=lookup, pairs=pairs, **smaller)
    return y


def _smaller_config(cfg: dict) -> dict | None:
    """Next config to try after OutOfResources (shared memory or registers), None when minimal."""
    c = dict(cfg)
    if c.get("num_stages", 1) > 1:
        c["num_stages"] = 1
    elif c.get("join"):
        c["join"] = False
    elif c["block_n"] > 16:
        c["block_n"] //= 2
    elif c.get("use_dot") and c["block_m"] > 16:
        c["block_m"] //= 2
    else:
        return None
    return c


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


# launch keys whose compiled kernel got its dynamic shared size raised for the pair table. The key
# must identify the compiled kernel: every int argument of ``_lut_mma_kernel`` is in do_not_specialize
# (S9: a specialized int argument compiled an unpatched variant, and its table writes ran out of bounds)
_MMA_PATCHED: set = set()
MMA_GROUPS = {4: (64, 128, 256), 3: (128, 256)}  # group sizes the fragment kernel takes (chunk: 64 / 128 K)


def split_guard(M: int, N: int, K: int) -> bool:
    """True when the split-K workspace offsets (split * M * N, at most 8x the groups) could overflow int32."""
    return M * N * max(1, cdiv(K, 64)) >= 2 ** 31


def mma_table_bytes(bits: int) -> int:
    """Shared memory of the lane-duplicated pair table: 2**(2 bits) entries x 32 lanes x 4 bytes."""
    return (1 << (2 * bits)) * 32 * 4


def busiest_sm_groups(tiles: int, ng: int, split: int, sms: int) -> int:
    """Scale groups the busiest SM runs when ``tiles`` output tiles are split ``split`` ways over ``ng`` groups and
    the programs are handed out round-robin: ``ceil(tiles * split / sms) * ceil(ng / split)`` (``balanced_split``'s
    measure of a launch)."""
    return cdiv(tiles * split, sms) * cdiv(ng, split)


def balanced_split(tiles: int, ng: int, sms: int, ctas_per_sm: int) -> int:
    """Split-K count that balances the SMs (option ``balance``): programs are handed out round-robin,
    so the busiest SM runs ``ceil(tiles * s / sms)`` programs of ``ceil(ng / s)`` groups each; pick
    the s minimising that product (the run time of a memory-bound launch), among splits that give
    at least ``sms`` and at most ``max(4 * ctas_per_sm, 8) * sms`` programs; ties -> the one nearest
    ``ctas_per_sm * sms`` programs. Example (H200, 132 SMs): gate_up M=1 r2 w8 (112 tiles, 32 groups)
    gets 8 (896 programs, 28 groups on the busiest SM vs 27.2 on average) where the ctas_per_sm rule
    gives 3 (336 programs, 33 groups: 82% balance)."""
    best = None
    for s in range(1, ng + 1):
        n = tiles * s
        if s > 1 and (n > max(4 * ctas_per_sm, 8) * sms or cdiv(ng, s) == cdiv(ng, s - 1)):
            continue
        if n < sms and s < ng and tiles * ng >= sms:
            continue
        key = (busiest_sm_groups(tiles, ng, s, sms), abs(n - ctas_per_sm * sms))
        if best is None or key < best[0]:
            best = (key, s)
    return best[1] if best else 1


# the 4-bit fragment kernel's 8-warp launches up to 16 tokens (picked by shape in ``mma_config``)
_R2_W8 = dict(r=2, num_warps=8, ctas_per_sm=2, prefetch=False, gu=1)  # the M = 1 launch of rounds r4-r6
_PF_W8 = dict(r=1, num_warps=8, ctas_per_sm=4, prefetch=True, xh=2, gu=1)  # ``pf``
_RING_W8 = dict(r=1, num_warps=8, ctas_per_sm=2, ring=4, xh=2, sp=True, balance=True, gu=1, prefetch=False)  # ``ring``


def mma_config(M: int, N: int, K: int, bits: int, group_size: int) -> dict:
    """Launch parameters of the fragment kernel (nt = n-tiles of 8 tokens)."""
    nt = 1 if M <= 8 else (2 if M <= 16 else 4)
    # M <= 8: r4/r5 sweeps (H200, us gate_up/down/8192^2): 4-bit r2 w8 cps2 26.3/19.4/19.9 (r1 w4 cps8:
    # 39/29/31), 3-bit r1 w4 cps8 27.2/18.0/18.7; time ~ 12.5 us + bytes / 4.4 TB/s, i.e. latency-bound
    # per loop step. gu > 1 (all loads of gu groups issued first) measured slower in r6 (gate_up 36-46 us): off
    if bits == 4 and M <= 8:
        # Session 22 (H200, same run, ``benchmarks/results/h200/s22_lut_fragment_small_m.json``, us, M = 1 / 2 / 4 / 8)
        # against the r6 row below (``r2 w8 cps2 gu1``, the only M <= 8 launch before):
        #   gate_up: 26.4 / 27.4 / 30.7 / 39.1; with ``pf`` (r1 w8 cps4 prefetch xh2) 30.5 / 31.1 / 32.0 / 36.8
        #   down:    19.5 / 21.3 / 26.6 / 39.3; ``pf`` 18.1 / 18.4 / 19.3 / 22.7      (8192^2 likewise:
        #            20.1 / 21.1 / 24.2 / 32.6 -> 18.6 / 19.0 / 19.8 / 23.3)
        #   qkv / o: 12.1 / 13.2 / 17.3 / 27.9 and 10.9 / 11.9 / 14.2 / 30.6; ``ring`` (the 9..16-token launch:
        #            r1 w8 cps2 ring4 xh2 sp balance) 12.0 / 12.2 / 12.6 / 14.5 and 10.3 / 10.3 / 10.7 / 11.8
        if N >= 16384:  # r6 sweep row "r2 w8 cps2 gu1": 26.4/19.5/20.0 us (gate_up/down/8192^2)
            return dict(nt=nt, **(_R2_W8 if M <= 4 else _PF_W8))
        return dict(nt=nt, **(_PF_W8 if K >= 8192 else _RING_W8))
    if M <= 8:  # r6 sweep row "lut3 r1 cps8 gu1": 27.7/18.2/18.8 us
        return dict(nt=nt, r=1, num_warps=4, ctas_per_sm=8, prefetch=False, gu=1)
    if bits == 4 and M <= 32:
        # R14 sweep (H200, same run, us gate_up / down / 8192^2; `benchmarks/results/h200/lut_sweep.json`),
        # against the R5 default (r1 w8 cps4 pf: M=16 64.7/42.0/38.6, M=32 87.2/62.1/58.7 in R14's table):
        # M=16  pf xh2: 50.3/38.8/37.0; cps2 ring4 xh2 sp bal: 56.5/27.5/29.1
        # M=32  pf xh2: 81.4/58.1/53.3; cps2 ring4 xh2:        76.0/60.0/56.1
        # -> many row tiles (N >= 16384: gate_up) and few (down, 8192^2) take different variants.
        # ``ring``/``xh``/``sp`` are GPU-only (the interpreter runs the plain loop, same numerics).
        # Session 8 probe (H200, same run, us gate_up / down / 8192^2, `benchmarks/results/h200/lut_variants_s8_probe.json`):
        # M=32 with 4 warps per program: gate_up r2 w4 72.3 vs 76.0 (r1 w8), down / 8192^2 r1 w4 48.0 / 50.8
        # vs 57.6 / 53.2; M=16 unchanged (r1 w4 48.1 / 33.1 / 35.4 vs 49.8 / 27.4 / 28.4).
        many = N >= 16384
        if M <= 16:
            return dict(nt=nt, **(_PF_W8 if many else _RING_W8))
        if many:
            return dict(nt=nt, r=2, num_warps=4, ctas_per_sm=2, ring=4, xh=2, gu=1, prefetch=False)
        return dict(nt=nt, r=1, num_warps=4, ctas_per_sm=4, prefetch=True, xh=2, gu=1)
    if bits == 4:
        # M = 33..64 (MAX_KERNEL_M), session 8 probe, us gate_up / down / 8192^2 at M=64: r2 w4 ring4 xh2
        # 134.8 / 88.2 / 86.9, r1 w4 pf xh2 139.7 / 72.0 / 71.0, old default r1 w8 pf 151.3 / 90.1 / 96.7
        # (r5: M=16 64.4/41.9/37.8 (r1 w4 cps8: 66/50/48); M=32 85.6/61.2/57.3 (91/66/64))
        if N >= 16384:
            return dict(nt=nt, r=2, num_warps=4, ctas_per_sm=4, ring=4, xh=2, gu=1, prefetch=False)
        return dict(nt=nt, r=1, num_warps=4, ctas_per_sm=4, prefetch=True, xh=2, gu=1)
    return dict(nt=nt, r=1, num_warps=4, ctas_per_sm=8, prefetch=False, gu=1)  # 3-bit: prefetch no gain (r5)


def fragment_x(x: torch.Tensor, kp: int) -> torch.Tensor:
    """``x`` [M, K] as the fragment-layout kernels read it: 16-byte vectors up to the padded K ``kp`` -- a zero-padded
    ``[M, kp]`` copy when K < kp or the rows are not 16-byte aligned, else ``x`` itself."""
    M, K = x.shape
    if kp != K or x.stride(-1) != 1 or (M > 1 and x.stride(0) % 8) or x.data_ptr() % 16:
        xp = torch.zeros((M, kp), device=x.device, dtype=x.dtype)
        xp[:, :K] = x
        return xp
    return x


def lut_mma_triton(x: torch.Tensor, qweight: torch.Tensor, qweight_hi: torch.Tensor | None, scales: torch.Tensor,
                   pairs: torch.Tensor, table: torch.Tensor, *, bits: int, group_size: int, out_features: int,
                   pdl: bool = False, silu_mul: bool = False, **overrides) -> torch.Tensor:
    """Launch ``_lut_mma_kernel``. ``qweight`` (+ ``qweight_hi`` at 3-bit) = ``formats.lut.pack_codes_mma``;
    ``pairs`` = ``pair_table(table, bits, x.dtype)``; ``scales`` [ceil(K/G), N]. ``x`` [M, K] is
    copied to a zero-padded [M, Kp] buffer when K is not a multiple of the group or its rows are not
    16-byte aligned (the fragment loads read 16-byte vectors up to Kp). ``pdl``: launch as a
    programmatic dependent launch (Hopper; ignored elsewhere; kernel docstring). ``silu_mul``: a fused gate_up
    (rows interleaved in blocks of 8, N a multiple of 16) -> ``[M, N / 2]`` = silu(gate) * up (``SILU_MUL``)."""
    M, K = x.shape
    N = out_features
    cols = out_columns(N, silu_mul)
    G = group_size
    if bits not in MMA_GROUPS or G not in MMA_GROUPS[bits]:
        raise ValueError(f"the fragment kernel needs bits in (3, 4) and group_size in {MMA_GROUPS.get(bits)}, "
                         f"got bits={bits}, group_size={G}")
    cfg = mma_config(M, N, K, bits, G)
    cfg.update(overrides)
    nt, r, nw = cfg["nt"], cfg["r"], cfg["num_warps"]
    y, done = gemm_output(x, N, K, cols)
    if done:
        return y
    ng = cdiv(K, G)
    kp = ng * G
    ck = 64 if bits == 4 else 128
    nrt, nc = cdiv(N, 16), kp // ck
    if qweight.numel() != nrt * nc * 128 or (bits == 3 and (qweight_hi is None or qweight_hi.numel() != nrt * nc * 64)):
        raise ValueError(f"qweight must be pack_codes_mma(...) of [{N}, {K}] ({nrt * nc * 128} words)")
    if qweight.numel() >= 2 ** 31 or split_guard(M, N, K):
        raise ValueError("lut_mma_triton: the weight is too large for 32-bit offsets; use layout='planar'")
    if scales.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"scales must be bf16 or fp16, got {scales.dtype}")
    x = fragment_x(x, kp)
    grid_n, grid_m = cdiv(nrt, nw * r), cdiv(M, 8 * nt)
    split = cfg.get("split_k")
    if split is None and cfg.get("balance"):
        split = balanced_split(grid_n * grid_m, ng, _sm_count(x.device), cfg["ctas_per_sm"])
    split, per, ws, locks = split_plan(split, ng, grid_n * grid_m, cfg["ctas_per_sm"], y, n_cols=N)
    pw = pairs.contiguous().view(torch.int32).reshape(-1)
    qh = qweight_hi if qweight_hi is not None else qweight
    grid = (grid_n, grid_m, split)
    args = (x, qweight, qh, scales, pw, table, y, ws, locks, M, N, K, nrt, nc, ng, per, split,
            x.stride(0), scales.stride(0), y.stride(0))
    gu = min(int(cfg.get("gu", 1)), 8 // (G // ck))  # at most 8 chunks (loads) per loop step
    if gu not in (1, 2, 4, 8):
        raise ValueError(f"gu (groups per loop step) must be 1, 2, 4 or 8, got {gu}")
    # ring: cp.async ring of the code words, that many chunks deep (gu == 1; replaces prefetch) -- GPU only
    ring = int(cfg.get("ring", 0)) if (gu == 1 and not interpret_mode()) else 0
    if ring not in (0, 2, 4, 8):
        raise ValueError(f"ring must be 0, 2, 4 or 8, got {ring}")
    pf = bool(cfg.get("prefetch", False)) and gu == 1 and not ring
    # xh: x fragments loaded one scale group ahead (2; register double buffer) -- GPU only, gu == 1, <= 2 chunks/group
    xh = int(cfg.get("xh", 0)) if (gu == 1 and G // ck <= 2 and not interpret_mode()) else 0
    if xh not in (0, 2):
        raise ValueError(f"xh must be 0 or 2, got {xh}")
    kw = dict(BITS=bits, GROUP=G, NT=nt, R=r, W=nw, IS_BF16=x.dtype == torch.bfloat16, USE_SPLIT=split > 1,
              INTERPRET=interpret_mode(), PREFETCH=pf, S_BF16=scales.dtype == torch.bfloat16, GU=gu, num_warps=nw,
              num_stages=1)
    if xh:  # passed only when set: the default launch (and its compiled kernel) stays as measured
        kw["XH"] = xh
    pdl = pdl and pdl_enabled(x, True)
    if pdl:
        kw.update(PDL=True, launch_pdl=True)
    sp = bool(cfg.get("sp", False)) and gu == 1 and not interpret_mode()
    if sp:  # scales one group ahead
        kw["SP"] = True
    smem = mma_table_bytes(bits)
    if silu_mul:  # passed only when set: the default launch stays as measured
        kw["SILU_MUL"] = True
    if ring:
        kw["RING"], kw["RING_BASE"] = ring, smem
        smem += ring * r * nw * (512 if bits == 4 else 768)  # 16 (+ 8 at 3-bit) bytes per lane, row tile, slot
    if not interpret_mode():
        # ints are not specialized (do_not_specialize): the compiled kernel depends only on the
        # constexprs and the 16-byte alignment of the pointers
        key = (x.device.index, bits, nt, r, nw, G, x.dtype, scales.dtype, split > 1, pf, gu, xh, ring, sp,
               pdl, silu_mul, tuple(a.data_ptr() % 16 == 0 for a in args[:9]))
        if key not in _MMA_PATCHED:  # the pair table lives in dynamic shared memory Triton does not
            # know about: raise the launch's dynamic shared size to hold it (compile once, patch)
            k = _lut_mma_kernel.warmup(*args, grid=grid, **kw)
            if smem > 48 * 1024 and k.module is None and k.metadata.shared < smem:
                # above 48 KB the loader must opt in to the larger dynamic size: it does when the metadata asks
                k.metadata = k.metadata._replace(shared=smem)
            k._init_handles()
            nwarps, nctas, shared = k.packed_metadata
            if shared < smem:
                k.packed_metadata = (nwarps, nctas, smem)
            _MMA_PATCHED.add(key)
    LAST_COMPILED["mma"] = _lut_mma_kernel[grid](*args, **kw)
    return y


def lut_dequant_mma_triton(qweight, qweight_hi, scales, table, *, bits: int, group_size: int, out_features: int,
                           in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized weight [N, K] in ``dtype`` from the fragment layout (large-M path, cuBLAS after)."""
    N, K = out_features, in_features
    w = torch.empty((N, K), device=qweight.device, dtype=dtype)
    if N == 0 or K == 0:
        return w
    nc = qweight.numel() // (128 * cdiv(N, 16))
    bn, bk = 16, 256
    qh = qweight_hi if qweight_hi is not None else qweight
    _lut_dequant_mma_kernel[(cdiv(N, bn), cdiv(K, bk))](
        qweight, qh, scales, table, w, None, N, K, nc, scales.stride(0), w.stride(0),
        BITS=bits, GROUP=group_size, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return w


def lut_dequant_mma_experts_triton(qweight: list[torch.Tensor], qweight_hi: list[torch.Tensor] | None,
                                   scales: list[torch.Tensor], table: list[torch.Tensor], offsets: torch.Tensor, *,
                                   bits: int, group_size: int, out_features: int, in_features: int,
                                   dtype: torch.dtype) -> torch.Tensor:
    """``lut_dequant_mma_triton`` for ``E`` experts in one launch (session 41, the MoE prefill form): per-expert lists
    of the fragment-layout buffers (one shape and stride each: ``lowbit.nn.moe._uniform``; ``qweight_hi`` None at 4
    bits), scales in ``dtype``, float32 tables; ``offsets`` int32 ``[E + 1]`` of their routed rows -> ``[E, N, K]``
    in ``dtype`` (experts without rows left unwritten)."""
    from lowbit.kernels.moe_grouped import address_table

    E, N, K = len(qweight), out_features, in_features
    w = torch.empty((E, N, K), device=offsets.device, dtype=dtype)
    if E and N and K:
        bn, bk = 16, 256
        nc = qweight[0].numel() // (128 * cdiv(N, 16))
        tables = [address_table(f) for f in (qweight, qweight_hi or qweight, scales, table)]
        _lut_dequant_mma_kernel[(cdiv(N, bn), cdiv(K, bk), E)](
            *tables, w, offsets, N, K, nc, scales[0].stride(0), K,
            BITS=bits, GROUP=group_size, BLOCK_N=bn, BLOCK_K=bk, EXPERTS=True, num_warps=4)
    return w
