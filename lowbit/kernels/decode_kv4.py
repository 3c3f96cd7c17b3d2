"""Decode attention over the paged INT4 KV cache (split-KV flash-decoding), FireQ §1.6 / QServe KV4.

Math (per sequence b, KV head h; G = Hq/Hkv query heads share h; TQ in 1..4 new query tokens)::

    rows m = (g, t), m = g*TQ + t          (all G*TQ rows of one KV head in ONE program: they
                                            share every K/V tile that program loads)
    q'_m   = q[b, h*G+g, t] * crs_q[h]      (CRS inverse on Q, post-RoPE; optional)
    S[m,n] = sm_scale * k_scale[n] * (q'_m . code_k[n] - k_zero[n] * sum(q'_m))
    P      = softmax_n(S) over keys n <= L_b - TQ + t (causal among the TQ new tokens)
    O[m,:] = sum_n P[m,n] * v_scale[n] * (code_v[n,:] - v_zero[n])

The per-token scales multiply *columns* of the score tile and of P, so dequantization in the
inner loop is only "nibble -> fp16": codes are turned into fp16 with the magic-number trick
(``0x6400 | nibble`` is the fp16 number 1024 + nibble; subtract 1024, or 1032 for signed codes
after ``byte ^ 0x88`` maps two's complement to offset binary). Both dots run on tensor cores
in fp16 with fp32 accumulation: Q is normalised per row by its absmax (its scale multiplies S),
P * v_scale is at most 448/7 so fp16 holds it. Even and odd channels (low and high nibbles)
are two dots each, so no interleave is needed: ``S = Qe Ke^T + Qo Ko^T``, ``O_e = P Ve``,
``O_o = P Vo``.

Cache layout (``lowbit.nn.kv_cache.PagedKVCache``): codes ``uint8 [num_pages, Hkv, PAGE, D/2]``,
scales ``[num_pages, Hkv, PAGE]`` (float8_e4m3fn, bf16 or fp32), zero points ``uint8
[num_pages, Hkv, PAGE]`` (``ZERO_POINT``); ``page_table int32 [B, max_pages]``; ``lengths int32
[B]`` count every cached token *including* the TQ new ones (appended before the call). A block
of BLOCK_N keys always lies in one page (PAGE % BLOCK_N == 0), so one page-table read per block
and the code loads are unmasked 16-byte vectors; the scales of keys past the length are masked
to 0 and their scores to -inf, so stale page memory never reaches the output.

Split-KV: grid ``(B * Hkv, NUM_SPLITS)``; split s handles keys ``[s*SPLIT_LEN, (s+1)*SPLIT_LEN)``
and writes its un-normalised fp32 accumulator, running max (log2 domain) and denominator (real
rows only); a second kernel combines the splits (all splits of a row read at once, not in a
serial loop). With one split the first kernel writes O directly. Accumulation fp32; exp2 with
``sm_scale * log2(e)`` folded into the Q row scale (one FFMA per score). The split count fills
the last wave of resident programs (occupancy read from the compiled kernel after its first
launch; ``choose_splits``): every split costs the same, so 2.06 waves cost as much as 3.

Variants (constexpr flags, one kernel): ``TRANS`` loop orientation (queries-major mma.sync,
default; tokens-major puts tokens in M and uses wgmma with 4 warps); ``LAZY`` skips the
accumulator rescale in blocks where no row max grew (alpha is then exactly 1: same result);
``QK8``: Q rounded to INT8 per row (``floor(q * 127 / absmax + 0.5)``) and K codes as the int8
numbers 16 * code (``(w << 4) & 0xF0F0F0F0`` / ``w & 0xF0F0F0F0``, exact; zero-point codes as
16 * (u - 8), the 8 moved into the rank-1 zero correction), so QK^T runs on the INT8 tensor cores
with int32 accumulation and K costs 3 instructions per 8 codes instead of 12. FireQ specifies an
8-bit Q for attention (FP8 E4M3 in its prefill); for decode we use INT8 per row, which keeps 7
bits of mantissa-equivalent precision instead of 3 and needs no int4 -> fp8 lookup. Blocks that
every query row sees whole run without masks; the split's last partial block and the causal
diagonal of the TQ new tokens (at most two blocks) run masked after them.

``QK8 == 2`` (the default): Q as two INT8 planes, ``u = q * 127 / absmax``, ``hi = floor(u + 0.5)``,
``lo = floor((u - hi) * 254 + 0.5)``, and ``S = 254 * (hi . k) + (lo . k)`` in int32 (exact): the
INT8 tensor cores at fp16-Q accuracy (one plane loses precision when a few Q channels are outliers:
+5e-2 output rel-L2 with 4 channels x20 on the GPU, two planes 2.7e-4 vs 2.6e-4 for fp16 Q).

On Hopper the same numerics (QK8 >= 1) run in a Gluon kernel (``_decode_kv4_gluon_kernel`` at the
end of this file) where G*TQ <= 8 and D is 64/128; this Triton kernel is the fallback and the
interpreter-tested path. Measured reason (device round 7, H200, B=16, 32/8 heads, D=128): L=8k
0.0598 ms Gluon vs 0.0781 ms here with the same numerics (0.0941 ms with fp16 Q), L=32k 0.197 vs 0.261.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lowbit._utils import arg_specialization, resident_ctas, sm_count
from lowbit.kernels.act_quant import abs_or_inf, amax_floor

LOG2E = 1.4426950408889634
# Defaults = the fastest correct fp16-Q configuration of the device sweep (B=16, L=8k).
DEFAULT_TRANS = False  # query rows as the MMA M dimension (mma.sync, one warp: no cross-warp softmax)
DEFAULT_ASM = True  # packed PTX nibble conversion (GPU only; the interpreter uses the int16 path)
DEFAULT_WARPS, DEFAULT_STAGES, DEFAULT_BLOCK_N = 1, 3, 16
DEFAULT_MAXNREG = 128  # register cap per thread: 16 one-warp programs per SM (the compiler alone takes 168)
DEFAULT_MIN_WAVES = 0.95  # split count: ~one full wave of resident programs (R6 sweep: 0.95 beat 1.9 and 2.9)
# key blocks per split at least (caps the split count), unless that leaves fewer than ``SHORT_MIN_PROGRAMS``
# programs per SM: then down to one block per split (session 9). The model area's B=1 sweep (H200, Hq 32 / Hkv 8,
# D 128, gluon kernel with 32-key blocks, us per call in a CUDA graph; rounds S9a/S9c/S9f/S9g,
# benchmarks/results/h200/kv4_split_sweep_s9_before.json) read at L=1025:
# 9 splits (the 4-block cap) 9.35-9.69 us, 16 splits 8.3-9.1, 32 splits 7.6-8.1; at L=8193: 64-65 splits
# 11.0-11.8 us. Model round S9i: a plain 1-block cap (~250 splits at 8k) lost 10% at B=1 ctx 8k
# (fireq 326 vs 362 tok/s) while gaining 3% at ctx 1k (370 vs 359); this rule takes only the short-context gain:
# S9j, same run: auto = 33 splits at L=1025, 7.59 us; ctx 8k unchanged (65 splits); B=1 ctx 1k fireq 375 vs 365 tok/s
# with the old cap (+sp0), qserve 337 vs 330, fireq+head 405 vs 399 (the run's noise gauge, fireq+fk, read 361).
MIN_SPLIT_BLOCKS = 4
SHORT_MIN_PROGRAMS = 2
DEFAULT_LAZY = True  # skip the accumulator rescale when no row max grew (exact)
DEFAULT_QK8 = 2  # Q as two INT8 planes (~15 bits) x INT8 16*code K on the INT8 tensor cores (see the docstring)


@triton.jit
def _nibbles_to_f16(c, XOR: tl.constexpr, OFFSET: tl.constexpr):
    """uint8 codes -> (low nibble, high nibble) as fp16 integers (signed if XOR == 0x88)."""
    u = c.to(tl.int16) ^ XOR
    lo = ((u & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - OFFSET
    hi = (((u >> 4) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - OFFSET
    return lo, hi


# Packed conversion of 4 code bytes per 32-bit register, two fp16 lanes per instruction: prmt
# spreads bytes (b0, b1) and (b2, b3) into the low byte of each 16-bit half, one lop3 keeps the
# nibble and puts it into the mantissa of fp16 1024.0 -- for signed codes it also flips the
# nibble's top bit (two's complement -> offset binary): ``(t & 0xF) ^ 0x6408`` -- and one
# sub.f16x2 (low nibbles: 1024 + u) or fma.f16x2 (high nibbles: 1024 + 16 u, times 1/16) leaves
# the exact integer code. One single-output asm per nibble half, so Triton may hoist the layout
# conversion to the MMA operand above it (codes cross shared memory as bytes).
_ASM_LO = """{{
.reg .b32 t0, t1, a0, a1, k1;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
lop3.b32 a0, t0, 0x000F000F, {m}, 0x6A;
lop3.b32 a1, t1, 0x000F000F, {m}, 0x6A;
mov.b32 k1, {off};
sub.f16x2 $0, a0, k1;
sub.f16x2 $1, a1, k1;
}}"""
_ASM_HI = """{{
.reg .b32 t0, t1, a0, a1, k1, k2;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
lop3.b32 a0, t0, 0x00F000F0, {m}, 0x6A;
lop3.b32 a1, t1, 0x00F000F0, {m}, 0x6A;
mov.b32 k1, 0x2C002C00;
mov.b32 k2, {off};
fma.rn.f16x2 $0, a0, k1, k2;
fma.rn.f16x2 $1, a1, k1, k2;
}}"""
ASM_LO_S = tl.constexpr(_ASM_LO.format(m="0x64086408", off="0x64086408"))
ASM_HI_S = tl.constexpr(_ASM_HI.format(m="0x64806480", off="0xD480D480"))
ASM_LO_U = tl.constexpr(_ASM_LO.format(m="0x64006400", off="0x64006400"))
ASM_HI_U = tl.constexpr(_ASM_HI.format(m="0x64006400", off="0xD400D400"))


@triton.jit
def _nibbles_to_f16_asm(c, ZERO_POINT: tl.constexpr):
    """Same result as ``_nibbles_to_f16`` with packed PTX (GPU only; the interpreter has no asm)."""
    if ZERO_POINT:
        lo = tl.inline_asm_elementwise(ASM_LO_U, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(ASM_HI_U, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
    else:
        lo = tl.inline_asm_elementwise(ASM_LO_S, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(ASM_HI_S, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
    return lo, hi


# One asm, both nibble halves (4 code bytes in, 8 fp16 out): the prmt spreading is shared and the
# offset-binary xor is folded into the lop3 (``(t & 0xF) | 0x6400`` then ``^ 8`` is one
# ``(t & 0xF) ^ 0x6408``): 10 instructions per 8 values instead of 16. Two outputs keep Triton from
# hoisting the MMA-operand layout conversion above it, so the codes are converted in the layout
# they were loaded in (16-byte vectors) and cross shared memory as fp16 (ldmatrix), not bytes.
_ASM_BOTH = """{{
.reg .b32 t0, t1, a0, a1, a2, a3, k1, k2, k3;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 a0, t0, 0x000F000F, {mlo}, 0x6A;
lop3.b32 a1, t1, 0x000F000F, {mlo}, 0x6A;
lop3.b32 a2, t0, 0x00F000F0, {mhi}, 0x6A;
lop3.b32 a3, t1, 0x00F000F0, {mhi}, 0x6A;
mov.b32 k1, {off};
mov.b32 k2, 0x2C002C00;
mov.b32 k3, {offh};
sub.f16x2 $0, a0, k1;
sub.f16x2 $1, a1, k1;
fma.rn.f16x2 $2, a2, k2, k3;
fma.rn.f16x2 $3, a3, k2, k3;
}}"""
ASM_BOTH_S = tl.constexpr(_ASM_BOTH.format(mlo="0x64086408", mhi="0x64806480", off="0x64086408", offh="0xD480D480"))
ASM_BOTH_U = tl.constexpr(_ASM_BOTH.format(mlo="0x64006400", mhi="0x64006400", off="0x64006400", offh="0xD400D400"))

# ``VSUB`` (session 27, Gluon kernel): the codes as fp16 *subnormals*, no offset arithmetic. A 16-bit pattern ``u``
# (u < 1024) is the fp16 number u * 2^-24 exactly, so the low nibble masked in place is u * 2^-24 and the high nibble
# (left at bits 4-7) 16 u * 2^-24 = u * 2^-20: 2 ``prmt`` + 4 ``lop3`` per 8 values instead of 10 instructions (the
# ``sub`` / ``fma`` pairs go). The tensor core multiplies subnormal fp16 operands exactly (products and sums in fp32,
# far above fp32's subnormal range), so ``P V`` comes out as 2^-24 (or 2^-20) * sum P' u; the epilogue scales it back
# by the power of two and subtracts the offset (8 for signed codes after the ``^ 8`` to offset binary, the zero point
# for QServe's codes) times sum P', accumulated beside the row sums from the same rounded fp16 P'. The subtraction is
# of two fp32 sums of one size order (u in [0, 15] against 8), not the 1024-sized magic-number offset.
_ASM_SUB = """{{
.reg .b32 t0, t1;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 $0, t0, 0x000F000F, {xlo}, 0x6A;
lop3.b32 $1, t1, 0x000F000F, {xlo}, 0x6A;
lop3.b32 $2, t0, 0x00F000F0, {xhi}, 0x6A;
lop3.b32 $3, t1, 0x00F000F0, {xhi}, 0x6A;
}}"""
ASM_SUB_S = tl.constexpr(_ASM_SUB.format(xlo="0x00080008", xhi="0x00800080"))
ASM_SUB_U = tl.constexpr(_ASM_SUB.format(xlo="0x00000000", xhi="0x00000000"))


@triton.jit
def _convert_both(c, XOR: tl.constexpr, OFFSET: tl.constexpr, ZERO_POINT: tl.constexpr, ASM: tl.constexpr):
    """Same result as ``_convert``; with ASM one two-output asm (see ``_ASM_BOTH``)."""
    if ASM:
        if ZERO_POINT:
            lo, hi = tl.inline_asm_elementwise(ASM_BOTH_U, "=r,=r,=r,=r,r", [c], dtype=(tl.float16, tl.float16),
                                               is_pure=False, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(ASM_BOTH_S, "=r,=r,=r,=r,r", [c], dtype=(tl.float16, tl.float16),
                                               is_pure=False, pack=4)
    else:
        lo, hi = _nibbles_to_f16(c, XOR, OFFSET)
    return lo, hi


# INT8 codes for the INT8 tensor-core QK^T (QK8): a nibble moved into the high half of a byte is
# the int8 number 16 * code (two's complement nibble: exact), so low nibbles are
# ``(w << 4) & 0xF0F0F0F0`` and high nibbles ``w & 0xF0F0F0F0`` -- 3 instructions per 8 codes
# instead of 12 for fp16. Unsigned (zero-point) codes also flip bit 7 (one lop3): 16 * (u - 8).
ASM_I8_LO_S = tl.constexpr("{ .reg .b32 t; shl.b32 t, $1, 4; and.b32 $0, t, 0xF0F0F0F0; }")
ASM_I8_HI_S = tl.constexpr("and.b32 $0, $1, 0xF0F0F0F0;")
ASM_I8_LO_U = tl.constexpr("{ .reg .b32 t; shl.b32 t, $1, 4; lop3.b32 $0, t, 0xF0F0F0F0, 0x80808080, 0x6A; }")
ASM_I8_HI_U = tl.constexpr("lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6A;")


@triton.jit
def _convert_i8(c, ZERO_POINT: tl.constexpr, ASM: tl.constexpr):
    """uint8 codes -> (16 * low code, 16 * high code) as int8 (minus 8 first if ZERO_POINT)."""
    if ASM:
        if ZERO_POINT:
            lo = tl.inline_asm_elementwise(ASM_I8_LO_U, "=r,r", [c], dtype=tl.int8, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(ASM_I8_HI_U, "=r,r", [c], dtype=tl.int8, is_pure=True, pack=4)
        else:
            lo = tl.inline_asm_elementwise(ASM_I8_LO_S, "=r,r", [c], dtype=tl.int8, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(ASM_I8_HI_S, "=r,r", [c], dtype=tl.int8, is_pure=True, pack=4)
    else:
        X: tl.constexpr = 0x80 if ZERO_POINT else 0
        u = c.to(tl.int32)
        lo = ((u << 4) & 0xF0) ^ X
        hi = (u & 0xF0) ^ X
        lo = (lo - ((lo >> 7) << 8)).to(tl.int8)
        hi = (hi - ((hi >> 7) << 8)).to(tl.int8)
    return lo, hi


@triton.jit
def _convert(c, XOR: tl.constexpr, OFFSET: tl.constexpr, ZERO_POINT: tl.constexpr, ASM: tl.constexpr):
    if ASM:
        lo, hi = _nibbles_to_f16_asm(c, ZERO_POINT)
    else:
        lo, hi = _nibbles_to_f16(c, XOR, OFFSET)
    return lo, hi


@triton.jit
def split_rows(LENS, SPLIT_LEN, Hkv, G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr):
    """Grid ``(B * Hkv, NUM_SPLITS)`` of the split-KV decode kernels (this one and
    ``lowbit.kernels.decode_float``): this program's sequence b, KV head h, length L, key range
    ``[start, end)`` and its query rows ``m = g * TQ + t`` (``row_ok``: m < G * TQ)."""
    pid_bh = tl.program_id(0)
    sid = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    L = tl.load(LENS + b)
    start = sid * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, L)
    m_idx = tl.arange(0, BLOCK_M)
    g = m_idx // TQ
    t = m_idx % TQ
    row_ok = m_idx < G * TQ
    return pid_bh, sid, b, h, L, start, end, m_idx, g, t, row_ok


@triton.jit
def _prologue(Q, LENS, CRSQ, qk_scale, SPLIT_LEN, Hkv, stride_qb, stride_qh, stride_qt,
              G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
              ZERO_POINT: tl.constexpr, HAS_CRS: tl.constexpr, QK8: tl.constexpr):
    """Shared by both loop orientations: program ids, split bounds, and Q as two fp16 tiles
    ``[BLOCK_M, HALF]`` (even / odd channels) normalised per row by their absmax, whose scale
    (times ``sm_scale * log2 e``) is returned as ``row_scale``; ``qsum`` is the row sum of the
    fp16 Q (zero-point correction), ``qpos`` the absolute position of each query row."""
    pid_bh, sid, b, h, L, start, end, m_idx, g, t, row_ok = split_rows(LENS, SPLIT_LEN, Hkv, G, TQ, BLOCK_M)
    j = tl.arange(0, HALF)
    d = tl.arange(0, 2 * HALF)
    q_ptr = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt
    q = tl.load(q_ptr + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)  # contiguous rows
    if HAS_CRS:
        q = q * tl.load(CRSQ + h * 2 * HALF + d)[None, :]
    qe, qo = tl.split(tl.reshape(q, [BLOCK_M, HALF, 2]))  # even / odd channels
    qmax = tl.maximum(tl.max(abs_or_inf(qe), axis=1), tl.max(abs_or_inf(qo), axis=1))
    qmax = amax_floor(qmax, 1e-30)  # NaN for a non-finite query row: its scores and output are NaN
    if QK8 == 2:  # two INT8 planes: q * 127 / absmax = hi + lo / 254 (~15 bits); see _q8_planes
        qe16, qe_lo = _q8_planes(qe, qmax)
        qo16, qo_lo = _q8_planes(qo, qmax)
        row_scale = qmax * (qk_scale / (127.0 * 16.0 * 254.0))
        if ZERO_POINT:  # in units of the int32 dot: 16 * (254 * sum(hi) + sum(lo))
            qsum = 16.0 * (254.0 * (tl.sum(qe16.to(tl.float32), axis=1) + tl.sum(qo16.to(tl.float32), axis=1))
                           + tl.sum(qe_lo.to(tl.float32), axis=1) + tl.sum(qo_lo.to(tl.float32), axis=1))
        else:
            qsum = tl.zeros([BLOCK_M], tl.float32)
    elif QK8:  # Q in INT8 per row (127 / absmax, round half up); K codes as int8 16 * code
        qe16 = tl.floor(qe / qmax[:, None] * 127.0 + 0.5).to(tl.int8)
        qo16 = tl.floor(qo / qmax[:, None] * 127.0 + 0.5).to(tl.int8)
        qe_lo, qo_lo = qe16, qo16  # unused
        row_scale = qmax * (qk_scale / (127.0 * 16.0))
        if ZERO_POINT:  # in units of the int32 dot: 16 * sum(q8)
            qsum = 16.0 * (tl.sum(qe16.to(tl.float32), axis=1) + tl.sum(qo16.to(tl.float32), axis=1))
        else:
            qsum = tl.zeros([BLOCK_M], tl.float32)
    else:
        qe16 = (qe / qmax[:, None]).to(tl.float16)
        qo16 = (qo / qmax[:, None]).to(tl.float16)
        qe_lo, qo_lo = qe16, qo16  # unused
        row_scale = qmax * qk_scale  # includes sm_scale * log2(e)
        if ZERO_POINT:
            qsum = tl.sum(qe16.to(tl.float32), axis=1) + tl.sum(qo16.to(tl.float32), axis=1)
        else:
            qsum = tl.zeros([BLOCK_M], tl.float32)
    qpos = L - TQ + t  # absolute position of query row m
    return pid_bh, sid, b, h, start, end, m_idx, g, t, row_ok, j, qe16, qo16, qe_lo, qo_lo, row_scale, qsum, qpos


@triton.jit
def _q8_planes(x, qmax):
    """Q as two INT8 planes (QK8 == 2): ``u = x * 127 / absmax``, ``hi = floor(u + 0.5)``,
    ``lo = floor((u - hi) * 254 + 0.5)``, both in [-127, 127]; ``254 * hi + lo`` carries ~15 bits
    (fp16 Q: 11), and ``254 * (q8_hi . k) + (q8_lo . k)`` stays below 2^31 for D <= 256."""
    u = x / qmax[:, None] * 127.0
    hi = tl.floor(u + 0.5)
    lo = tl.floor((u - hi) * 254.0 + 0.5)
    return hi.to(tl.int8), lo.to(tl.int8)


@triton.jit
def _epilogue(acc_e, acc_o, m_i, l_i, O, OP, MP, LP, pid_bh, sid, b, h, m_idx, g, t, row_ok, j,
              stride_ob, stride_oh, stride_ot, G: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr):
    """acc_e / acc_o ``[BLOCK_M, HALF]``: un-normalised even / odd output channels. With SPLIT
    the partials (fp32 acc, running max, denominator) go to the workspace for the combine."""
    if SPLIT:
        base = (pid_bh * tl.num_programs(1) + sid) * m_idx.shape[0]
        tl.store(MP + base + m_idx, m_i, mask=row_ok)
        tl.store(LP + base + m_idx, l_i, mask=row_ok)
        o_ptr = OP + (base + m_idx)[:, None] * (2 * HALF) + 2 * j[None, :]
        tl.store(o_ptr, acc_e, mask=row_ok[:, None])  # padding rows are never written nor read
        tl.store(o_ptr + 1, acc_o, mask=row_ok[:, None])
    else:
        inv = tl.where(l_i == 0, 0.0, 1.0 / l_i)  # NaN l (a NaN scale read) stays NaN
        o_ptr = O + b * stride_ob + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + 2 * j[None, :]
        tl.store(o_ptr, (acc_e * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(o_ptr + 1, (acc_o * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _scale_rows(acc_e, acc_o, l_i, alpha, AXIS: tl.constexpr):
    """Multiply the accumulators (rows along AXIS) and the denominators by alpha."""
    if AXIS == 0:  # if/else, not an early return: Triton compiles the code after a constexpr-if return
        acc_e, acc_o = acc_e * alpha[:, None], acc_o * alpha[:, None]
    else:
        acc_e, acc_o = acc_e * alpha[None, :], acc_o * alpha[None, :]
    return acc_e, acc_o, l_i * alpha


@triton.jit
def _rescale(acc_e, acc_o, l_i, m_i, m_new, m_safe, AXIS: tl.constexpr, LAZY: tl.constexpr):
    """Online-softmax rescale of the accumulators by alpha = 2^(m_old - m_new). With LAZY the
    multiply is skipped when no row max grew in this block (then alpha == 1 exactly: same result,
    fewer FMULs once the running max has settled, which is most blocks of a long context)."""
    if LAZY:
        grew = tl.max((m_new > m_i).to(tl.int32), axis=0)
        if grew > 0:
            acc_e, acc_o, l_i = _scale_rows(acc_e, acc_o, l_i, tl.exp2(m_i - m_safe), AXIS)
    else:
        acc_e, acc_o, l_i = _scale_rows(acc_e, acc_o, l_i, tl.exp2(m_i - m_safe), AXIS)
    return acc_e, acc_o, l_i


@triton.jit
def _qm_step(acc_e, acc_o, m_i, l_i, KC, KS, KZ, VC, VS, VZ, page, n0, end, h, j, qe16, qo16, qe_lo, qo_lo,
             row_scale, qsum, qpos,
             stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, ZERO_POINT: tl.constexpr, ASM: tl.constexpr,
             LAZY: tl.constexpr, MASK: tl.constexpr, QK8: tl.constexpr):
    """One block of BLOCK_N keys (one page), queries-major. MASK=False for blocks that every
    query row sees completely (no length or causal masking: no compare/select per score)."""
    XOR: tl.constexpr = 0 if ZERO_POINT else 0x88
    OFFSET: tl.constexpr = 1024.0 if ZERO_POINT else 1032.0
    n_off = tl.arange(0, BLOCK_N)
    tok = (n0 % PAGE) + n_off
    c_off = page * stride_cp + h * stride_ch + tok[:, None] * stride_cn + j[None, :]
    s_off = page * stride_sp + h * stride_sh + tok
    kc = tl.load(KC + c_off)
    vc = tl.load(VC + c_off)
    if MASK:
        kpos = n0 + n_off
        key_ok = kpos < end
        ks = tl.load(KS + s_off, mask=key_ok, other=0.0).to(tl.float32)
        vs = tl.load(VS + s_off, mask=key_ok, other=0.0).to(tl.float32)
    else:
        ks = tl.load(KS + s_off).to(tl.float32)
        vs = tl.load(VS + s_off).to(tl.float32)
    if QK8:
        k_lo, k_hi = _convert_i8(kc, ZERO_POINT, ASM)
        x = tl.dot(qo16, tl.trans(k_hi), tl.dot(qe16, tl.trans(k_lo), out_dtype=tl.int32), out_dtype=tl.int32)
        if QK8 == 2:  # low plane: 254 * (hi . k) + (lo . k), exact in int32
            x = tl.dot(qo_lo, tl.trans(k_hi), tl.dot(qe_lo, tl.trans(k_lo), x * 254, out_dtype=tl.int32),
                       out_dtype=tl.int32)
        x = x.to(tl.float32)
    else:
        k_lo, k_hi = _convert(kc, XOR, OFFSET, ZERO_POINT, ASM)
        x = tl.dot(qo16, tl.trans(k_hi), tl.dot(qe16, tl.trans(k_lo)))
    if ZERO_POINT:
        if MASK:
            kz = tl.load(KZ + s_off, mask=key_ok, other=0).to(tl.float32)
        else:
            kz = tl.load(KZ + s_off).to(tl.float32)
        if QK8:
            kz = kz - 8.0  # the int8 codes are 16 * (u - 8)
        x = x - qsum[:, None] * kz[None, :]
    x = x * ks[None, :]  # scores / row_scale (row_scale > 0 keeps the row order)
    if MASK:
        ok = key_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        x = tl.where(ok, x, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(x, axis=1) * row_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(x * row_scale[:, None] - m_safe[:, None])  # one FFMA per score
    acc_e, acc_o, l_i = _rescale(acc_e, acc_o, l_i, m_i, m_new, m_safe, 0, LAZY)
    l_i += tl.sum(p, axis=1)
    pv16 = (p * vs[None, :]).to(tl.float16)
    v_lo, v_hi = _convert_both(vc, XOR, OFFSET, ZERO_POINT, ASM)
    acc_e = tl.dot(pv16, v_lo, acc_e)
    acc_o = tl.dot(pv16, v_hi, acc_o)
    if ZERO_POINT:
        if MASK:
            vz = tl.load(VZ + s_off, mask=key_ok, other=0).to(tl.float32)
        else:
            vz = tl.load(VZ + s_off).to(tl.float32)
        zs = tl.sum(pv16.to(tl.float32) * vz[None, :], axis=1)
        acc_e -= zs[:, None]
        acc_o -= zs[:, None]
    return acc_e, acc_o, m_new, l_i


@triton.jit
def _loop_queries_major(KC, KS, KZ, VC, VS, VZ, PT, b, h, start, end, j, qe16, qo16, qe_lo, qo_lo, row_scale, qsum, qpos,
                        stride_cp, stride_ch, stride_cn, stride_sp, stride_sh, stride_ptb,
                        BLOCK_M: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                        ZERO_POINT: tl.constexpr, ASM: tl.constexpr, LAZY: tl.constexpr, QK8: tl.constexpr):
    """TRANS=False: query rows are the MMA M dimension: ``S = Q K^T``, ``O = (P * v_scale) V``.
    Blocks every query row sees whole run unmasked; the rest (the split's last partial block
    and the causal diagonal of the TQ new tokens: at most two blocks) run masked after them."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_e = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_o = tl.zeros([BLOCK_M, HALF], tl.float32)
    lim = tl.minimum(end, tl.min(qpos, axis=0) + 1)  # keys < lim are seen by every query row
    full_end = start + tl.maximum(lim - start, 0) // BLOCK_N * BLOCK_N
    page_next = tl.load(PT + b * stride_ptb + start // PAGE)
    for n0 in range(start, full_end, BLOCK_N):
        # the page id is read one block ahead, so the code loads do not wait on a dependent load
        page = page_next.to(tl.int64)
        page_next = tl.load(PT + b * stride_ptb + tl.minimum(n0 + BLOCK_N, end - 1) // PAGE)
        acc_e, acc_o, m_i, l_i = _qm_step(acc_e, acc_o, m_i, l_i, KC, KS, KZ, VC, VS, VZ, page, n0, end, h, j,
                                          qe16, qo16, qe_lo, qo_lo, row_scale, qsum, qpos,
                                          stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
                                          PAGE, BLOCK_N, ZERO_POINT, ASM, LAZY, False, QK8)
    for n0 in range(full_end, end, BLOCK_N):
        page = tl.load(PT + b * stride_ptb + n0 // PAGE).to(tl.int64)
        acc_e, acc_o, m_i, l_i = _qm_step(acc_e, acc_o, m_i, l_i, KC, KS, KZ, VC, VS, VZ, page, n0, end, h, j,
                                          qe16, qo16, qe_lo, qo_lo, row_scale, qsum, qpos,
                                          stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
                                          PAGE, BLOCK_N, ZERO_POINT, ASM, LAZY, True, QK8)
    return acc_e, acc_o, m_i, l_i


@triton.jit
def _loop_tokens_major(KC, KS, KZ, VC, VS, VZ, PT, b, h, start, end, j, qe16, qo16, qe_lo, qo_lo, row_scale, qsum, qpos,
                       stride_cp, stride_ch, stride_cn, stride_sp, stride_sh, stride_ptb,
                       BLOCK_M: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       ZERO_POINT: tl.constexpr, ASM: tl.constexpr, LAZY: tl.constexpr, QK8: tl.constexpr):
    """TRANS=True: the same math with tokens as the M dimension of both dots (M = BLOCK_N and
    M = D/2, N = BLOCK_M query rows): ``S^T = K Q^T`` and ``O^T = V^T (P^T * v_scale)``, so the
    code tiles are the register (A) operand of the MMA and no code tile is transposed. Returns
    the accumulators transposed back to ``[BLOCK_M, HALF]``."""
    XOR: tl.constexpr = 0 if ZERO_POINT else 0x88
    OFFSET: tl.constexpr = 1024.0 if ZERO_POINT else 1032.0
    qe_t = tl.trans(qe16)  # [HALF, M]
    qo_t = tl.trans(qo16)
    qe_lt = tl.trans(qe_lo)
    qo_lt = tl.trans(qo_lo)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_e = tl.zeros([HALF, BLOCK_M], tl.float32)
    acc_o = tl.zeros([HALF, BLOCK_M], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    page_next = tl.load(PT + b * stride_ptb + start // PAGE)
    for n0 in range(start, end, BLOCK_N):
        page = page_next.to(tl.int64)
        page_next = tl.load(PT + b * stride_ptb + tl.minimum(n0 + BLOCK_N, end - 1) // PAGE)
        tok = (n0 % PAGE) + n_off
        kpos = n0 + n_off
        key_ok = kpos < end
        base = page * stride_cp + h * stride_ch
        kc = tl.load(KC + base + tok[:, None] * stride_cn + j[None, :])  # [BLOCK_N, HALF]
        vc = tl.load(VC + base + tok[None, :] * stride_cn + j[:, None])  # [HALF, BLOCK_N]
        s_off = page * stride_sp + h * stride_sh + tok
        ks = tl.load(KS + s_off, mask=key_ok, other=0.0).to(tl.float32)
        vs = tl.load(VS + s_off, mask=key_ok, other=0.0).to(tl.float32)
        if QK8:
            k_lo, k_hi = _convert_i8(kc, ZERO_POINT, ASM)
            si = tl.dot(k_hi, qo_t, tl.dot(k_lo, qe_t, out_dtype=tl.int32), out_dtype=tl.int32)
            if QK8 == 2:
                si = tl.dot(k_hi, qo_lt, tl.dot(k_lo, qe_lt, si * 254, out_dtype=tl.int32), out_dtype=tl.int32)
            s = si.to(tl.float32)
        else:
            k_lo, k_hi = _convert(kc, XOR, OFFSET, ZERO_POINT, ASM)
            s = tl.dot(k_hi, qo_t, tl.dot(k_lo, qe_t))  # [BLOCK_N, M]
        if ZERO_POINT:
            kz = tl.load(KZ + s_off, mask=key_ok, other=0).to(tl.float32)
            if QK8:
                kz = kz - 8.0
            s = s - kz[:, None] * qsum[None, :]
        s = s * (ks[:, None] * row_scale[None, :])
        ok = key_ok[:, None] & (kpos[:, None] <= qpos[None, :])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[None, :])
        acc_e, acc_o, l_i = _rescale(acc_e, acc_o, l_i, m_i, m_new, m_safe, 1, LAZY)
        l_i += tl.sum(p, axis=0)
        pv16 = (p * vs[:, None]).to(tl.float16)
        v_lo, v_hi = _convert_both(vc, XOR, OFFSET, ZERO_POINT, ASM)
        acc_e = tl.dot(v_lo, pv16, acc_e)
        acc_o = tl.dot(v_hi, pv16, acc_o)
        if ZERO_POINT:
            vz = tl.load(VZ + s_off, mask=key_ok, other=0).to(tl.float32)
            zs = tl.sum(pv16.to(tl.float32) * vz[:, None], axis=0)
            acc_e -= zs[None, :]
            acc_o -= zs[None, :]
        m_i = m_new
    return tl.trans(acc_e), tl.trans(acc_o), m_i, l_i


@triton.jit
def _decode_kv4_kernel(
    # pointers
    Q, KC, KS, KZ, VC, VS, VZ, PT, LENS, CRSQ, O, OP, MP, LP,
    # sizes / scalars
    qk_scale, SPLIT_LEN, Hkv,
    # strides
    stride_qb, stride_qh, stride_qt,
    stride_cp, stride_ch, stride_cn,  # codes [pages, Hkv, PAGE, D/2] (last dim contiguous)
    stride_sp, stride_sh,  # scales / zeros [pages, Hkv, PAGE] (last dim contiguous)
    stride_ptb,
    stride_ob, stride_oh, stride_ot,
    # constexpr
    G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    ZERO_POINT: tl.constexpr, HAS_CRS: tl.constexpr, SPLIT: tl.constexpr,
    TRANS: tl.constexpr, ASM: tl.constexpr, LAZY: tl.constexpr, QK8: tl.constexpr,
):
    pid_bh, sid, b, h, start, end, m_idx, g, t, row_ok, j, qe16, qo16, qe_lo, qo_lo, row_scale, qsum, qpos = _prologue(
        Q, LENS, CRSQ, qk_scale, SPLIT_LEN, Hkv, stride_qb, stride_qh, stride_qt,
        G, TQ, BLOCK_M, HALF, ZERO_POINT, HAS_CRS, QK8)
    if TRANS:
        acc_e, acc_o, m_i, l_i = _loop_tokens_major(
            KC, KS, KZ, VC, VS, VZ, PT, b, h, start, end, j, qe16, qo16, qe_lo, qo_lo, row_scale, qsum, qpos,
            stride_cp, stride_ch, stride_cn, stride_sp, stride_sh, stride_ptb,
            BLOCK_M, HALF, PAGE, BLOCK_N, ZERO_POINT, ASM, LAZY, QK8)
    else:
        acc_e, acc_o, m_i, l_i = _loop_queries_major(
            KC, KS, KZ, VC, VS, VZ, PT, b, h, start, end, j, qe16, qo16, qe_lo, qo_lo, row_scale, qsum, qpos,
            stride_cp, stride_ch, stride_cn, stride_sp, stride_sh, stride_ptb,
            BLOCK_M, HALF, PAGE, BLOCK_N, ZERO_POINT, ASM, LAZY, QK8)
    _epilogue(acc_e, acc_o, m_i, l_i, O, OP, MP, LP, pid_bh, sid, b, h, m_idx, g, t, row_ok, j,
              stride_ob, stride_oh, stride_ot, G, HALF, SPLIT)

@triton.jit
def _combine_kernel(
    OP, MP, LP, O, Hkv, NUM_SPLITS,
    stride_ob, stride_oh, stride_ot,
    G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    SPLITS_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr = False,
):
    """One program per (sequence, KV head, query row, BLOCK_D channels): the splits' partials are
    read as ``[CHUNK, BLOCK_D]`` tiles (all splits at once up to CHUNK), not one split after the
    other: a serial loop over 64+ splits would be bound by memory latency. Up to CHUNK splits,
    maxima, denominators and partials are loaded together (one memory round trip). ``GDC``:
    launched as a programmatic dependent launch, it waits for the decode grid here."""
    if GDC:
        tl.extra.cuda.gdc_wait()
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    sp = tl.arange(0, SPLITS_P2)
    d = d0 + tl.arange(0, BLOCK_D)
    row = (pid_bh * NUM_SPLITS + sp) * BLOCK_M + r
    ok_s = sp < NUM_SPLITS
    m_all = tl.load(MP + row, mask=ok_s, other=float("-inf"))
    l_all = tl.load(LP + row, mask=ok_s, other=0.0)
    if SPLITS_P2 <= CHUNK:
        part = tl.load(OP + row[:, None] * D + d[None, :], mask=ok_s[:, None], other=0.0)
    m_tot = tl.max(m_all, axis=0)
    m_safe = tl.where(m_tot == float("-inf"), 0.0, m_tot)
    w_all = tl.where(ok_s, tl.exp2(m_all - m_safe), 0.0)
    l_tot = tl.sum(w_all * l_all, axis=0)
    if SPLITS_P2 <= CHUNK:
        acc = tl.sum(w_all[:, None] * part, axis=0)
    else:
        c = tl.arange(0, CHUNK)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, NUM_SPLITS, CHUNK):
            ok = (s0 + c) < NUM_SPLITS
            rr = (pid_bh * NUM_SPLITS + s0 + c) * BLOCK_M + r
            w = tl.exp2(tl.load(MP + rr, mask=ok, other=float("-inf")) - m_safe)
            part = tl.load(OP + rr[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            acc += tl.sum(w[:, None] * part, axis=0)
    inv = tl.where(l_tot == 0, 0.0, 1.0 / l_tot)
    g = r // TQ
    t = r % TQ
    tl.store(O + b * stride_ob + (h * G + g) * stride_oh + t * stride_ot + d, (acc * inv).to(O.dtype.element_ty))


def _num_sms(device) -> int:
    return sm_count(device, 8)


def _splits_used(max_len: int, splits: int, block_n: int) -> int:
    split_len = -(-(-(-max(max_len, 1) // splits)) // block_n) * block_n
    return max(1, -(-max(max_len, 1) // split_len))


def choose_splits(batch: int, hkv: int, max_len: int, block_n: int, sms: int, num_warps: int = 4,
                  ctas_per_sm: int | None = None, min_waves: float | None = None, good: float = 0.97) -> int:
    """Split count of the split-KV grid (B*Hkv programs per split). Every split keeps at least
    ``MIN_SPLIT_BLOCKS`` key blocks, or one block where that would leave fewer than ``SHORT_MIN_PROGRAMS``
    programs per SM (short contexts at small batch). Without occupancy: enough programs for ~16 resident warps per SM. With
    ``ctas_per_sm`` (from the compiled kernel's registers / shared memory): at least one full wave
    of ``sms * ctas_per_sm`` programs, and the split count whose programs fill the last wave best
    (all splits cost the same, so a wave that is 6% full costs as much as a full one): the first
    split count from there whose waves are at least ``good`` full."""
    bh = max(1, batch * hkv)
    most = max(1, math.ceil(max_len / (MIN_SPLIT_BLOCKS * block_n)),
               min(math.ceil(max_len / block_n), math.ceil(SHORT_MIN_PROGRAMS * sms / bh)))
    if not ctas_per_sm:
        want = math.ceil(16 // max(1, min(num_warps, 16)) * sms / bh)
        return max(1, min(want, most, 256))
    cap = sms * ctas_per_sm
    waves = DEFAULT_MIN_WAVES if min_waves is None else min_waves
    lo = max(1, min(math.floor(waves * cap / bh) if waves < 1 else math.ceil(waves * cap / bh), most, 512))
    best, best_eff = lo, -1.0
    for s in range(lo, min(most, 4 * lo, 512) + 1):
        n = bh * _splits_used(max_len, s, block_n)
        eff = n / (math.ceil(n / cap) * cap)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
        if eff >= good:
            break
    return best


LAST_LAUNCH: dict = {}  # the split count of the latest launch (benchmarks report it)
_OCCUPANCY: dict = {}  # launch configuration -> resident programs per SM (filled after the first launch)


def _occupancy_key(base: tuple, split: bool, q, k_codes, k_scale, page_table, Hkv, out) -> tuple:
    """``_OCCUPANCY`` key of the variant with constexpr ``SPLIT = split`` and this launch's argument specialization
    (``_utils.arg_specialization``; session 27: a first launch without a split, or with other strides, had set the
    residency of later split launches, the call-order dependence of session 25's ``lut_wgmma._resident``).
    ``choose_splits`` reads the split variant's residency (that is where the split count matters), each launch
    stores its own variant's."""
    return base + (split, arg_specialization((q, k_codes, k_scale, page_table, Hkv, *q.stride()[:3],
                                              *k_codes.stride()[:3], *k_scale.stride()[:2], page_table.stride(0),
                                              *out.stride()[:3])))


def decode_kv4_triton(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, *, k_zero=None,
                      v_zero=None, crs_q=None, sm_scale=None, max_len=None, num_splits=None,
                      block_n=None, num_warps=None, num_stages=None, trans=None, asm=None, lazy=None,
                      maxnreg=None, qk_int8=None, gluon=None, pdl=None, vsub=None, cstore=None, sraw=None,
                      return_kernel=False, _skip_combine=False, _probe=False):
    """Launcher. q ``[B, Hq, TQ, D]`` (post-RoPE; any float dtype); cache tensors as in the module
    docstring; returns O ``[B, Hq, TQ, D]`` in q's dtype. Arguments are checked by
    ``lowbit.ops.kv4.decode_kv4``; ``max_len`` (host int) avoids a device sync when given.
    ``gluon`` (None = ``DEFAULT_GLUON``): the Gluon kernel where it applies (CUDA, INT8 Q,
    G*TQ <= 8, D in {64, 128}); otherwise the Triton kernel."""
    B, Hq, TQ, D = q.shape
    P, Hkv, PAGE, HALF = k_codes.shape
    G = Hq // Hkv
    qk8 = int(DEFAULT_QK8 if qk_int8 is None else qk_int8)
    use_gluon = DEFAULT_GLUON if gluon is None else bool(gluon)
    if use_gluon and HAS_GLUON and q.is_cuda and qk8 >= 1 and G * TQ <= GLUON_MAX_ROWS and HALF in (32, 64) and not trans:
        return _launch_gluon(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, k_zero, v_zero, crs_q,
                             sm_scale, max_len, num_splits, block_n, num_stages, maxnreg, qk8, return_kernel,
                             _skip_combine, pdl, _probe, vsub, cstore, sraw)
    BLOCK_M = max(16, triton.next_power_of_2(G * TQ))
    block_n = min(PAGE, block_n or DEFAULT_BLOCK_N)  # a key block never spans two pages (PAGE is a power of 2)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of 2 >= 16 (and the page size caps it), got {block_n}")
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    if max_len is None:
        max_len = int(lengths.max().item()) if B else 0
    nw = num_warps or DEFAULT_WARPS
    occ_base = (q.device, q.dtype, G, TQ, HALF, PAGE, block_n, k_zero is not None, crs_q is not None, trans, asm, lazy,
                qk_int8, nw, num_stages, maxnreg, DEFAULT_TRANS, DEFAULT_LAZY, DEFAULT_QK8, DEFAULT_STAGES,
                DEFAULT_MAXNREG)
    out = torch.empty_like(q)
    if num_splits is None:
        num_splits = choose_splits(B, Hkv, max_len, block_n, _num_sms(q.device), nw, _OCCUPANCY.get(
            _occupancy_key(occ_base, True, q, k_codes, k_scale, page_table, Hkv, out)))
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(max_len, 1), split_len))
    LAST_LAUNCH["num_splits"] = num_splits
    zero_point = k_zero is not None
    kz = k_zero if zero_point else k_scale
    vz = v_zero if zero_point else v_scale
    crs = crs_q if crs_q is not None else q
    split = num_splits > 1
    op, mp, lp = split_workspace(out, B * Hkv, num_splits, BLOCK_M, D)
    grid = (B * Hkv, num_splits)
    kernel = _decode_kv4_kernel[grid](
        q, k_codes, k_scale, kz, v_codes, v_scale, vz, page_table, lengths, crs, out, op, mp, lp,
        sm_scale * LOG2E, split_len, Hkv,
        q.stride(0), q.stride(1), q.stride(2),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scale.stride(0), k_scale.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        G=G, TQ=TQ, BLOCK_M=BLOCK_M, HALF=HALF, PAGE=PAGE, BLOCK_N=block_n,
        ZERO_POINT=zero_point, HAS_CRS=crs_q is not None, SPLIT=split,
        TRANS=DEFAULT_TRANS if trans is None else trans,
        ASM=(DEFAULT_ASM and q.is_cuda) if asm is None else asm,
        LAZY=DEFAULT_LAZY if lazy is None else lazy,
        QK8=qk8,
        num_warps=num_warps or DEFAULT_WARPS, num_stages=num_stages or DEFAULT_STAGES,
        **({"maxnreg": mr} if (mr := DEFAULT_MAXNREG if maxnreg is None else maxnreg) and q.is_cuda else {}),
    )
    occ_key = _occupancy_key(occ_base, split, q, k_codes, k_scale, page_table, Hkv, out)
    if q.is_cuda and occ_key not in _OCCUPANCY:
        _OCCUPANCY[occ_key] = resident_ctas(kernel, nw)
    if split:
        _combine(op, mp, lp, out, B, Hkv, num_splits, G, TQ, BLOCK_M, D)
    return (out, kernel) if return_kernel else out


def split_workspace(out, programs: int, num_splits: int, BLOCK_M: int, D: int):
    """fp32 partials of the split-KV kernels (accumulator ``[programs, splits, BLOCK_M, D]``, running
    max and denominator ``[programs, splits, BLOCK_M]``, flat), read by ``_combine``; with one split
    nothing is allocated (``out`` stands in for all three)."""
    if num_splits <= 1:
        return out, out, out
    op = torch.empty(programs * num_splits * BLOCK_M * D, device=out.device, dtype=torch.float32)
    mp = torch.empty(programs * num_splits * BLOCK_M, device=out.device, dtype=torch.float32)
    return op, mp, torch.empty_like(mp)


def _combine(op, mp, lp, out, B, Hkv, num_splits, G, TQ, BLOCK_M, D, pdl=False):
    """Launch ``_combine_kernel`` over the split partials (``BLOCK_M`` rows per split); ``pdl``:
    as a programmatic dependent launch of the decode kernel (which triggers it)."""
    sp2 = triton.next_power_of_2(num_splits)
    bd = min(D, 128 if sp2 <= 32 else 32)  # few splits: one program per query row (fewer, fuller programs)
    _combine_kernel[(B * Hkv, G * TQ, D // bd)](
        op, mp, lp, out, Hkv, num_splits,
        out.stride(0), out.stride(1), out.stride(2),
        G=G, TQ=TQ, BLOCK_M=BLOCK_M, D=D, SPLITS_P2=sp2, CHUNK=min(sp2, 8192 // bd), BLOCK_D=bd, num_warps=4,
        **({"GDC": True, "launch_pdl": True} if pdl else {}),
    )


# ------------------------------------------------------------------------------------------------
# Gluon kernel (GPU only): the same math, tokens-major, with explicit register layouts, so every
# code byte is converted in the register where the tensor core reads it (no shared memory).
#
# mma.sync m16n8 with the KV tokens as the M dimension and the G*TQ query rows (padded to 8 or 16)
# as N: ``S^T = K Q^T`` on the INT8 tensor cores (m16n8k32; the K codes are the register A operand:
# 4 consecutive code bytes of one token are one 32-bit load and, shifted / masked by
# ``_convert_i8``, the int8 fragment of the low (even channels) and high (odd channels) nibbles),
# and ``O^T = V^T (P^T v_scale)`` in fp16 (m16n8k16; V^T is the A operand, whose registers pair two
# tokens of one channel). The V codes are loaded as HALF/8 consecutive bytes per token and lane
# group (tile ``[8, HALF/8, BLOCK_N]``; output channel row ``m = 8 r + g`` <-> code byte
# ``(HALF/8) g + r``), the byte transpose to token pairs is a register permutation, and
# ``_ASM_BOTH`` turns each word into the fp16 fragments of both nibbles; the channel permutation is
# undone when O is stored. Half the MMA work of the queries-major loop and half its accumulator
# registers (the padding of 4 query rows is 8 instead of 16). Q is INT8 (one plane, QK8 == 1) or
# two INT8 planes (QK8 == 2, ~15 bits); the fp16-Q numerics (QK8 == 0) use the Triton kernel.
# Options (constexpr, same result bit for bit; a default only once measured faster on the device):
# ``PDL`` (the combine kernel as a programmatic dependent launch; default since round 11's A/B: B=16 L=8k
# 0.0538 vs 0.0564 ms), ``CSTORE`` (the epilogue's vector stores, below), ``VSUB`` (V codes as fp16 subnormals,
# below), ``SRAW`` (the next block's token scales loaded into 32-bit registers, below). Options measured slower or
# no faster and removed in session 31 (their numbers stay in the kv4 section):
# ``LEAN`` (prologue: Q, page table and first scales read before the length arrives), ``ILP`` (the two Q planes
# as two independent MMA chains), ``SRING`` / ``PTA`` (the scales, and the page-table reads, two blocks ahead
# like the codes), ``AHEAD`` (S^T of block i+1 before the softmax of block i), ``LAZY`` (skip the rescale when
# no running max grew), the swizzled shared layouts of the ring, VSUB ``"mma"`` (below). A split combine in
# the last program of each (b, h) (atomic counter) was measured and removed (R10: 0.0568 vs 0.0554 ms
# at B=16 L=8k, 0.093 vs 0.029 ms at B=1 L=32k: one warp reading all partials is a serial tail).
# ``STAMP`` (probe only): every program writes %globaltimer / %clock64 at entry, loop start, loop end and exit and
# its SM id (``benchmarks/device/s16_kv4.py``). Session 16, H200, B=16 L=8k: all 2048 programs start within
# 0.2 us, 15-16 per SM; prologue ~7.1k cycles (Q quantization behind 2-3 dependent memory round trips), loop
# 54-75k cycles, ends spread 34.6-47.2 us. Work stealing against that spread (chunks of 2 / 4 / 8 key blocks
# claimed one chunk ahead through a per-(b, h) atomic counter, reset by the combine) was measured and removed:
# 0.0645 / 0.0609 / 0.0597 ms vs 0.0548 static, slower at every B and L timed; the loop grew 10-19% per block and
# the ends stayed as spread. Nsight Compute (same shape): 0.51 issued instructions per scheduler cycle with 3.65
# warps per scheduler, DRAM 59% of peak: the loop (581 SASS instructions per 32-key block) is latency / issue
# bound, not HBM bound. Session 30 (``s30_kv4_stamp.json``): the spread of the ends is inside each SM (6.6-11.1 us
# between an SM's first and last program; the SMs' mean ends lie within 3.3 us of each other) and follows the launch
# order: the mean end of split s rose from 36.9 us (s = 0) to 43.0 us (s = 15), the warp schedulers favouring the
# older programs. Longer splits first (lengths falling linearly by +-4..16 %, ``s30_kv4_skew.json``) did not help:
# B=16 8k 51.9-53.6 vs 52.0 us, 32k 160.5-161.6 vs 160.6-161.1, the spread as before (removed). The one-block probe
# grid (``s30_kv4_probe_stamp.json``) spans 15.7 us: prologue ~4k cycles, the one block 2.4-21.8k, the partials'
# epilogue 0.6-14k, so most of the ~16 us that does not scale with L is the first block and the epilogue of 16
# programs per SM queued behind each other, not the launch (empty grid 4.5 us).
# ------------------------------------------------------------------------------------------------
try:  # Gluon ships with Triton >= 3.4; the interpreter cannot run it (the Triton kernel above is the CPU path)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2 as _mma_v2

    HAS_GLUON = True
except Exception:  # pragma: no cover - older Triton
    HAS_GLUON = False

# R7 (H200, B=16, 32/8 heads, D=128, Q as two INT8 planes): Gluon 0.0598 ms at L=8k (2.28 TB/s) vs the Triton
# kernel's 0.0781 ms (same numerics) and 0.0941 ms (fp16 Q); 0.197 vs 0.261 ms at 32k.
DEFAULT_GLUON = True  # use the Gluon kernel on the GPU where it applies (QK8 >= 1, G*TQ <= 8, D in {64, 128})
GLUON_BLOCK_N = 32  # keys per loop step (R8, B=16 L=8k: 0.0593 ms at 32 vs 0.0626 at 16; 32k: 0.188 vs 0.196)
GLUON_MAX_ROWS = 8  # G*TQ <= 8 query rows (one m16n8 N tile); R8: 16 rows (168 registers) ran slower than the
# Triton kernel (B=16 L=8k TQ=4: 0.186 vs 0.116 ms), so more rows use the Triton kernel; session 16 with 2 stages:
# 16 rows won only at B=16 L=32k (0.282 vs 0.311 ms), lost at B=16 L=8k (0.112 vs 0.102), B=1 L=32k, B=4 L=8k
GLUON_STAGES = 2  # cp.async ring depth: the next key block in flight while one computes
# (session 16, H200, same runs, ms, 3 stages -> 2: B=16 L=4k / 8k / 16k / 32k 0.0379 / 0.0545 / 0.0906 / 0.1656 ->
# 0.0359 / 0.0522 / 0.0875 / 0.1611; B=1 L=8k / 32k 0.0145 / 0.0289 -> 0.0142 / 0.0268; B=4 L=8k 0.0287 -> 0.0265;
# B=64 L=1k 0.0416 -> 0.0392; 4 stages: 0.0582 at B=16 L=8k; 64-key blocks 0.086-0.090; s16_kv4.json)
GLUON_MAXNREG = 128  # 16 one-warp programs per SM
# first split count whose waves are this full (R10, B=16 L=32k: 16 splits = 0.970 of one wave 0.168 ms; the
# 0.97 rule took 49 = 0.990 of three waves, 0.179 ms: every split also costs its prologue and partials)
GLUON_GOOD_WAVE = 0.95
# the combine kernel as a programmatic dependent launch (its launch overlaps the decode grid); same-process A/B at
# B=16 (round 11): 8k 0.0538 vs 0.0564 / 0.0561 ms, 32k 0.1654 vs 0.1659 ms, B=1 32k (with options since removed)
# 0.0282 vs 0.0296
GLUON_PDL = True
# the V codes as fp16 subnormals (``_ASM_SUB``): True, False or "zp" = for zero-point (QServe kv4-zp) caches only.
# Session 27 (H200, B=16, 32/8 heads, D=128, same process, default / VSUB / default again, ms; s27_kv4_vsub*.json):
# zero points 8k 0.0566 / 0.0552 / 0.0566, 32k 0.1785 / 0.1730 / 0.1784 (the loop 676 -> 618 SASS, offline); signed
# codes slower at every shape (8k 0.0517 / 0.0535 / 0.0518, 32k 0.1603 / 0.1664 / 0.1605: the offset's per-block
# token sum costs shuffles and a 16-byte spill at the 128-register cap, 576 -> 542 SASS). Output error vs float64
# (5 cases each): 4.1-6.7e-4 vs 3.9-6.0e-4. ``"mma"`` (session 30; removed in session 31): for signed codes the
# offset's sum from one more MMA, a tile of ones times P' (main loop 576 -> 523 SASS per 32-key block, offline), ran
# slower on the H200 (B=16 8k 0.0526 vs 0.0518 ms, 32k 0.1628 vs 0.1615; s31_kv4_opts.json), and 136 registers
# without spills (15 programs per SM) 0.0677: the loop is not bound by its instruction count.
GLUON_VSUB = "zp"
# the epilogue's partial O (or O) as whole 16-byte vectors of channels in order, through one shared-memory layout
# change, instead of the MMA fragments' 4-byte scatter (one 32-byte sector per lane and store; session 30's stamps
# put the one-block grid's epilogue at up to 14k cycles). Bit-equal. Session 31 (H200, 32/8 heads, D=128, same
# process, three runs, ms, scatter -> CSTORE; s31_kv4_opts.json, s31_kv4_cstore_r2.json, s31_kv4_op16.json):
# B=16 8k 0.0518 / 0.0523 / 0.0518 -> 0.0499 / 0.0497 / 0.0497, 1k 0.0193 -> 0.0163, B=4 8k 0.0265 / 0.0269 / 0.0262
# -> 0.0201 / 0.0203 / 0.0200, B=1 32k 0.0267 / 0.0268 / 0.0265 -> 0.0201 / 0.0202 / 0.0201, B=4 32k 0.0509 / 0.0507
# -> 0.0490 / 0.0488; zero points alike (B=16 8k 0.0552 -> 0.0523, B=4 8k 0.0271 -> 0.0211). Long splits gain
# nothing: B=16 16k (1024 keys per split) 0.0873 -> 0.0874, and 32k (2048) lose 1.5 %, 0.1615 / 0.1612 / 0.1611 ->
# 0.1638 / 0.1637 / 0.1634 (one more 4-byte spill reloaded in the main loop: 1 -> 2 LDL per block, offline SASS).
# Default "short": on below GLUON_CSTORE_MAX_SPLIT keys per split. Lost in the same runs: VSUB "mma" 0.0526 /
# 0.1628 (8k / 32k), maxnreg 136 or 144 (15 / 14 programs per SM) 0.068-0.073 at 8k, 8 / 12 / 14 splits instead of
# 16 at B=16 (8k 0.0605 / 0.0537 / 0.0541 vs 0.0501, s31_kv4_splits.json), and the split partials as fp16 divided by
# l (half the partial bytes; 8k 0.0506 vs 0.0497, 32k 0.1615 vs 0.1611, s31_kv4_op16.json).
GLUON_CSTORE = "short"  # True, False or "short"
GLUON_CSTORE_MAX_SPLIT = 2048
# SRAW (session 32): the next block's token scales (and zero points) are loaded one loop step ahead, as before, but
# into 32-bit registers by inline PTX and typed only where they are used. Nsight Compute's stall sampling of the
# default build (B=16 L=8k, s32_kv4_ncu_src_8k.csv) put 22 % of all samples on one PRMT that waits on the scale
# byte loaded ~95 instructions earlier in the same step: under the 128-register cap ptxas had parked the HFMA2
# constant 0x2c00 in the upper half of the 16-bit scale load's destination register, so the packing PRMT waits
# for the load. Raw 32-bit destinations leave no half register to share. The outputs are bit-equal; the time
# (s32_kv4_sraw.json, same process, default / SRAW / default again, us): B=16 8k 50.2 / 49.6 / 50.2, 16k 87.7 /
# 85.8 / 87.7, 32k 161.1 / 156.5 / 161.0, but B=4 8k and B=1 32k (128-key splits) 20.3 -> 21.2, and zero-point
# caches slower everywhere (s32_kv4_sraw_zp.json: B=16 8k 52.3 -> 53.6, 32k 172.8 -> 178.7). Stall samples move to
# other waits rather than vanish. Default "long": signed codes with splits of >= GLUON_SRAW_MIN_SPLIT keys.
GLUON_SRAW = "long"  # True, False or "long"
GLUON_SRAW_MIN_SPLIT = 512


def _copy_layout(half: int):
    """Blocked layout of the cp.async source tile ``[BLOCK_N, half]``: 16 bytes per thread."""
    return gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[32 // (half // 16), half // 16],
                            warps_per_cta=[1, 1], order=[1, 0])


def _v_load_bases(block_n: int, half: int):
    """(register bases, lane bases) of ``_v_load_layout`` (one warp), for layouts that add dimensions to it."""
    nb = half // 8
    reg = [[0, 1 << i, 0] for i in range(nb.bit_length() - 1)] + [[0, 0, 1], [0, 0, 8]]
    reg += [[0, 0, 16 << i] for i in range((block_n // 16).bit_length() - 1)]
    lane = [[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    return reg, lane


def _v_load_layout(block_n: int, half: int):
    """Linear layout of the V-code tile ``[8, half // 8, block_n]`` (one warp): lane (g, t) holds
    code bytes ``(half/8) g .. (half/8) g + half/8 - 1`` (registers, fastest: one 64-bit load per
    token) of tokens 2t, 2t+1, 2t+8, 2t+9 (+16): the thread <-> element map of the fp16 A operand
    of ``O^T = V^T P^T`` after the channel permutation."""
    reg, lane = _v_load_bases(block_n, half)
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[], block_bases=[],
                                      shape=[8, half // 8, block_n])


if HAS_GLUON:
    @gluon.jit
    def _g_rows_in_order(acc_e, acc_o, HALF: gl.constexpr, BLOCK_Q: gl.constexpr, st_l: gl.constexpr):
        """``CSTORE``: the even / odd channel accumulators ``[HALF, BLOCK_Q]`` (MMA layout; row m holds channel pair
        j = (HALF/8) (m % 8) + m // 8) as ``[BLOCK_Q, 2 HALF]`` query rows of channels in order, in ``st_l``: with
        m = 8 b + a, j = (HALF/8) a + b, so the m axis split into (b, a) and swapped is j, and channel = 2 j + (0 | 1).
        The layout change goes through shared memory once; the stores are then whole vectors instead of the MMA
        fragments' 4-byte scatter (one 32-byte sector per lane and store)."""
        both = gl.permute(gl.join(acc_e, acc_o), [1, 0, 2])  # [BLOCK_Q, HALF (m), 2]
        both = gl.permute(gl.reshape(both, [BLOCK_Q, HALF // 8, 8, 2]), [0, 2, 1, 3])  # [BLOCK_Q, a, b, 2]
        return gl.convert_layout(gl.reshape(both, [BLOCK_Q, 2 * HALF]), st_l)

    @gluon.jit
    def _g_row_offsets(rows, base, b, h, stride_ob, stride_oh, stride_ot, G: gl.constexpr, TQ: gl.constexpr,
                       HALF: gl.constexpr, SPLIT: gl.constexpr):
        """Element offsets of the epilogue's query rows ``rows`` (r = g * TQ + t): in the split partials ``OP``
        (``base`` + r rows of 2 HALF channels) or in O ``[B, Hq, TQ, D]``."""
        if SPLIT:
            return (base + rows) * (2 * HALF)
        else:
            return b * stride_ob + (h * G + rows // TQ) * stride_oh + (rows % TQ) * stride_ot

    @gluon.jit
    def _g_stamp(ASM: gl.constexpr):
        """One 64-bit special register (``%globaltimer`` ns or ``%clock64`` cycles): the ``STAMP`` probe."""
        return gl.inline_asm_elementwise(ASM, "=l", [], dtype=gl.int64, is_pure=False, pack=1)

    @gluon.jit
    def _g_convert_i8(c, ZERO_POINT: gl.constexpr):
        """``_convert_i8`` (ASM) for Gluon: (16 * low code, 16 * high code) as int8."""
        if ZERO_POINT:
            lo = gl.inline_asm_elementwise(ASM_I8_LO_U, "=r,r", [c], dtype=gl.int8, is_pure=True, pack=4)
            hi = gl.inline_asm_elementwise(ASM_I8_HI_U, "=r,r", [c], dtype=gl.int8, is_pure=True, pack=4)
        else:
            lo = gl.inline_asm_elementwise(ASM_I8_LO_S, "=r,r", [c], dtype=gl.int8, is_pure=True, pack=4)
            hi = gl.inline_asm_elementwise(ASM_I8_HI_S, "=r,r", [c], dtype=gl.int8, is_pure=True, pack=4)
        return lo, hi

    @gluon.jit
    def _g_load(KC, KS, KZ, VC, VS, VZ, page, n0, end, h, pred, stride_cp, stride_ch: gl.constexpr,
                stride_cn: gl.constexpr, stride_sp, stride_sh: gl.constexpr,
                HALF: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, ZERO_POINT: gl.constexpr,
                MASK: gl.constexpr, LV: gl.constexpr):
        """Raw bytes of one key block: K codes ``[BLOCK_N, HALF]`` in the int8 A-operand layout,
        V codes ``[8, HALF/8, BLOCK_N]`` (``LV``), scales / zero points per token. Full blocks
        (MASK False) are predicated on ``pred`` only (a prefetch past the last block reads
        nothing; its registers are never used); in masked blocks scales of keys >= end are 0."""
        _MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=4)
        tok_l: gl.constexpr = gl.SliceLayout(1, _MMA)
        base = page * stride_cp + h * stride_ch + (n0 % PAGE) * stride_cn
        nk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a8))
        jk = gl.arange(0, HALF, layout=gl.SliceLayout(0, a8))
        gv = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, LV)))
        rv = gl.arange(0, HALF // 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LV)))
        tv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, LV)))
        k_ptr = KC + base + nk[:, None] * stride_cn + jk[None, :]
        v_ptr = VC + base + tv[None, None, :] * stride_cn + gv[:, None, None] * (HALF // 8) + rv[None, :, None]
        n_off = gl.arange(0, BLOCK_N, layout=tok_l)
        s_off = page * stride_sp + h * stride_sh + (n0 % PAGE) + n_off
        if MASK:
            kc = gl.load(k_ptr)
            vc = gl.load(v_ptr)
            key_ok = (n0 + n_off) < end
            ks = gl.load(KS + s_off, mask=key_ok, other=0.0)
            vs = gl.load(VS + s_off, mask=key_ok, other=0.0)
            if ZERO_POINT:
                kz = gl.load(KZ + s_off, mask=key_ok, other=0)
                vz = gl.load(VZ + s_off, mask=key_ok, other=0)
            else:
                kz = ks
                vz = vs
        else:
            kc = gl.load(k_ptr, mask=pred)
            vc = gl.load(v_ptr, mask=pred)
            ks = gl.load(KS + s_off, mask=pred)
            vs = gl.load(VS + s_off, mask=pred)
            if ZERO_POINT:
                kz = gl.load(KZ + s_off, mask=pred)
                vz = gl.load(VZ + s_off, mask=pred)
            else:
                kz = ks
                vz = vs
        return kc, vc, ks, vs, kz, vz

    @gluon.jit
    def _g_issue(smem_k, smem_v, stage, KC, VC, page, n0, h, pred, stride_cp, stride_ch: gl.constexpr,
                 stride_cn: gl.constexpr,
                 HALF: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, CL: gl.constexpr):
        """cp.async of one key block's K and V codes (16 bytes per thread and copy) into ``stage``
        of the shared-memory ring, zero-filled when ``pred`` is false."""
        base = page * stride_cp + h * stride_ch + (n0 % PAGE) * stride_cn
        t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CL))
        j = gl.arange(0, HALF, layout=gl.SliceLayout(0, CL))
        off = base + t[:, None] * stride_cn + j[None, :]
        ok = gl.full([BLOCK_N, HALF], 1, gl.int1, layout=CL) & pred
        _async_copy.async_copy_global_to_shared(smem_k.index(stage), KC + off, mask=ok)
        _async_copy.async_copy_global_to_shared(smem_v.index(stage), VC + off, mask=ok)
        _async_copy.commit_group()

    @gluon.jit
    def _g_ld(ptrs, SRAW: gl.constexpr):
        """One element per pointer: as stored, or (``SRAW``) zero-extended into a 32-bit register by
        ``ld.global.nc.u8`` / ``.u16``, to be typed by ``_g_typed`` where it is used."""
        if not SRAW:
            v = gl.load(ptrs)
        elif ptrs.dtype.element_ty.primitive_bitwidth == 8:
            v = gl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                          is_pure=False, pack=1)
        else:
            v = gl.inline_asm_elementwise("ld.global.nc.u16 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                          is_pure=False, pack=1)
        return v

    @gluon.jit
    def _g_typed(v, ty: gl.constexpr, SRAW: gl.constexpr):
        """A value of ``_g_ld`` as the cache stores it (``ty``: FP8 / BF16 scales, uint8 zero points)."""
        if SRAW:
            if ty.primitive_bitwidth == 8:
                v = v.to(gl.uint8).to(ty, bitcast=True)
            else:
                v = v.to(gl.uint16).to(ty, bitcast=True)
        return v

    @gluon.jit
    def _g_scales(KS, KZ, VS, VZ, page, n0, h, stride_sp, stride_sh: gl.constexpr, PAGE: gl.constexpr,
                  BLOCK_N: gl.constexpr, ZERO_POINT: gl.constexpr, SRAW: gl.constexpr = False):
        """Scales (and zero points) of one full key block, per token (rows of ``S^T``); unmasked
        (the caller clamps the block to one inside the split's pages). ``SRAW``: the raw bits as int32
        (``_g_ld``; ``_g_unraw`` types them where they are used, a loop step later)."""
        _MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        n_off = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _MMA))
        s_off = page * stride_sp + h * stride_sh + (n0 % PAGE) + n_off
        ks = _g_ld(KS + s_off, SRAW)
        vs = _g_ld(VS + s_off, SRAW)
        if ZERO_POINT:
            kz = _g_ld(KZ + s_off, SRAW)
            vz = _g_ld(VZ + s_off, SRAW)
        else:
            kz = ks
            vz = vs
        return ks, vs, kz, vz

    @gluon.jit
    def _g_unraw(ks, vs, kz, vz, KS, KZ, ZERO_POINT: gl.constexpr, SRAW: gl.constexpr):
        """``_g_scales``' values typed as the cache stores them (``_g_typed``)."""
        ks = _g_typed(ks, KS.dtype.element_ty, SRAW)
        vs = _g_typed(vs, KS.dtype.element_ty, SRAW)
        if ZERO_POINT:
            kz = _g_typed(kz, KZ.dtype.element_ty, SRAW)
            vz = _g_typed(vz, KZ.dtype.element_ty, SRAW)
        else:
            kz = ks
            vz = vs
        return ks, vs, kz, vz

    @gluon.jit
    def _g_rescale(acc_e, acc_o, l_acc, z_acc, alpha, ZERO_POINT: gl.constexpr, VSUB: gl.constexpr = False):
        """Online-softmax rescale of the per-query columns by alpha."""
        acc_e = acc_e * alpha[None, :]
        acc_o = acc_o * alpha[None, :]
        l_acc = l_acc * alpha[None, :]
        if VSUB and not ZERO_POINT:  # the offset's sum, already one value per query column
            z_acc = z_acc * alpha
        elif ZERO_POINT:  # per token and column
            z_acc = z_acc * alpha[None, :]
        return acc_e, acc_o, l_acc, z_acc

    @gluon.jit
    def _g_qk(kc, qe, qo, qe_lo, qo_lo, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr, ZERO_POINT: gl.constexpr,
              QK8: gl.constexpr):
        """``S^T [BLOCK_N, BLOCK_Q]`` (int32) of one key block on the INT8 tensor cores."""
        _MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        k_lo, k_hi = _g_convert_i8(kc, ZERO_POINT)
        x = gl.zeros([BLOCK_N, BLOCK_Q], gl.int32, layout=_MMA)
        x = _mma_v2(k_lo, qe, x)
        x = _mma_v2(k_hi, qo, x)
        if QK8 == 2:
            x = _mma_v2(k_lo, qe_lo, x * 254)
            x = _mma_v2(k_hi, qo_lo, x)
        return x

    @gluon.jit
    def _g_step(acc_e, acc_o, m_i, l_acc, z_acc, kc, vc, ks, vs, kz, vz, n0, end, qe, qo, qe_lo, qo_lo,
                row_scale, qsum, qpos, HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr,
                ZERO_POINT: gl.constexpr, QK8: gl.constexpr, MASK: gl.constexpr, VSUB: gl.constexpr = False):
        """One key block: ``S^T`` on the INT8 tensor cores, then ``_g_pv``."""
        x = _g_qk(kc, qe, qo, qe_lo, qo_lo, BLOCK_N, BLOCK_Q, ZERO_POINT, QK8)
        return _g_pv(acc_e, acc_o, m_i, l_acc, z_acc, x, vc, ks, vs, kz, vz, n0, end, row_scale, qsum, qpos,
                     HALF, BLOCK_N, BLOCK_Q, ZERO_POINT, MASK, VSUB)

    @gluon.jit
    def _g_pv(acc_e, acc_o, m_i, l_acc, z_acc, x, vc, ks, vs, kz, vz, n0, end, row_scale, qsum, qpos,
              HALF: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr, ZERO_POINT: gl.constexpr,
              MASK: gl.constexpr, VSUB: gl.constexpr = False):
        """Online softmax over tokens of ``S^T`` (axis 0, branch-free rescale; the denominators and the
        zero-point sums accumulate per thread in ``l_acc`` / ``z_acc [BLOCK_N, BLOCK_Q]`` and are
        reduced once at the end), then ``O^T += V^T (P^T v_scale)`` in fp16. ``VSUB``: the codes as fp16
        subnormals (``_ASM_SUB``) and ``z_acc`` the offset's sum (signed codes: sum P', times 8 at the end)."""
        _MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2)
        b16: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2)
        tok_l: gl.constexpr = gl.SliceLayout(1, _MMA)
        xf = x.to(gl.float32)
        if ZERO_POINT:
            xf = xf - (kz.to(gl.float32) - 8.0)[:, None] * qsum[None, :]
        xf = xf * ks.to(gl.float32)[:, None]
        if MASK:
            kpos = n0 + gl.arange(0, BLOCK_N, layout=tok_l)
            ok = (kpos[:, None] < end) & (kpos[:, None] <= qpos[None, :])
            xf = gl.where(ok, xf, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(xf, axis=0) * row_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(xf * row_scale[None, :] - m_safe[None, :])
        # branch-free rescale (R8: faster than skipping it when no running max grew): the V conversion may be
        # scheduled across it
        acc_e, acc_o, l_acc, z_acc = _g_rescale(acc_e, acc_o, l_acc, z_acc, gl.exp2(m_i - m_safe), ZERO_POINT, VSUB)
        l_acc += p
        pv16 = (p * vs.to(gl.float32)[:, None]).to(gl.float16)
        if ZERO_POINT:
            z_acc += pv16.to(gl.float32) * vz.to(gl.float32)[:, None]
        elif VSUB:  # reduced over the block's tokens at once: a [BLOCK_N, BLOCK_Q] sum would cost 8 more
            # registers a thread and spill at the 128-register cap (offline build)
            z_acc += gl.sum(pv16.to(gl.float32), axis=0)
        pb = gl.convert_layout(pv16, b16)
        vca = gl.convert_layout(gl.reshape(gl.permute(vc, [1, 0, 2]), [HALF, BLOCK_N]), a16)
        if VSUB:  # the codes as fp16 subnormals, or the magic-number conversion with its offset
            asm: gl.constexpr = ASM_SUB_U if ZERO_POINT else ASM_SUB_S
        else:
            asm: gl.constexpr = ASM_BOTH_U if ZERO_POINT else ASM_BOTH_S
        v_lo, v_hi = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [vca], dtype=(gl.float16, gl.float16),
                                               is_pure=True, pack=4)
        acc_e = _mma_v2(v_lo, pb, acc_e)
        acc_o = _mma_v2(v_hi, pb, acc_o)
        return acc_e, acc_o, m_new, l_acc, z_acc

    @gluon.jit
    def _decode_kv4_gluon_kernel(
        # pointers
        Q, KC, KS, KZ, VC, VS, VZ, PT, LENS, CRSQ, O, OP, MP, LP, TS,
        # sizes / scalars
        qk_scale, SPLIT_LEN, Hkv,
        # strides
        stride_qb, stride_qh, stride_qt,
        stride_cp, stride_sp,
        stride_ptb,
        stride_ob, stride_oh, stride_ot,
        # constexpr
        G: gl.constexpr, TQ: gl.constexpr, BLOCK_Q: gl.constexpr, HALF: gl.constexpr, PAGE: gl.constexpr,
        BLOCK_N: gl.constexpr, ZERO_POINT: gl.constexpr, HAS_CRS: gl.constexpr, SPLIT: gl.constexpr,
        QK8: gl.constexpr, LV: gl.constexpr, CL: gl.constexpr, STAGES: gl.constexpr,
        PDL: gl.constexpr = False, PROBE: gl.constexpr = False, STAMP: gl.constexpr = False,
        VSUB: gl.constexpr = False, CSTORE: gl.constexpr = False, SRAW: gl.constexpr = False,
    ):
        _MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        b8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=4)
        q_l: gl.constexpr = gl.SliceLayout(0, _MMA)
        # contiguous cache (checked by the op): per-page strides are runtime, the rest compile-time
        # constants, so per-thread offsets fold into the load / copy instructions' immediates
        stride_ch: gl.constexpr = PAGE * HALF
        stride_cn: gl.constexpr = HALF
        stride_sh: gl.constexpr = PAGE
        ql: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[1, 1],
                                            order=[1, 0])
        if STAMP:  # probe: TS[program] = globaltimer / clock64 at entry, loop start, loop end, exit; SM id
            g0 = _g_stamp("mov.u64 $0, %globaltimer;")
            c0 = _g_stamp("mov.u64 $0, %clock64;")
        pid_bh = gl.program_id(0)
        sid = gl.program_id(1)
        b = pid_bh // Hkv
        h = pid_bh % Hkv
        L = gl.load(LENS + b)
        start = sid * SPLIT_LEN
        ptb = PT + b * stride_ptb
        mq = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, ql))
        dq = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, ql))
        q_ptr = Q + b * stride_qb + (h * G + mq // TQ)[:, None] * stride_qh + (mq % TQ)[:, None] * stride_qt
        end = gl.minimum(start + SPLIT_LEN, L)
        # ---- the first key blocks' copies are issued before Q is prepared (their latency overlaps it)
        lim = gl.minimum(end, L - TQ + 1)  # keys < lim are seen by every query row
        full_end = start + gl.maximum(lim - start, 0) // BLOCK_N * BLOCK_N
        if PROBE:  # benchmark probe: one key block per program (launch + prologue + epilogue of the same grid)
            full_end = gl.minimum(full_end, start + BLOCK_N)
            end = full_end
        # cp.async ring of STAGES blocks (codes; STAGES - 1 in flight); scales one block ahead in registers
        a8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=4)
        sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        smem_k = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HALF], sl)
        smem_v = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HALF], sl)
        for i in gl.static_range(STAGES - 1):
            nb = start + i * BLOCK_N
            pg = gl.load(ptb + gl.minimum(nb, end - 1) // PAGE).to(gl.int64)
            _g_issue(smem_k, smem_v, i, KC, VC, pg, nb, h, nb < full_end, stride_cp, stride_ch, stride_cn,
                     HALF, PAGE, BLOCK_N, CL)
        last = gl.maximum(full_end - BLOCK_N, start)  # scale prefetches stay inside the split's full blocks
        pg1 = gl.load(ptb + gl.minimum(start + BLOCK_N, last) // PAGE).to(gl.int64)
        pgs = gl.load(ptb + gl.minimum(start + (STAGES - 1) * BLOCK_N, end - 1) // PAGE).to(gl.int64)
        pg0 = gl.load(ptb + start // PAGE).to(gl.int64)
        ks, vs, kz, vz = _g_scales(KS, KZ, VS, VZ, pg0, start, h, stride_sp, stride_sh, PAGE, BLOCK_N, ZERO_POINT,
                                   SRAW)
        q = gl.load(q_ptr + dq[None, :], mask=(mq < G * TQ)[:, None], other=0.0)
        # ---- Q [BLOCK_Q, D] fp32 (row r = g * TQ + t), CRS, INT8 plane(s), B operand [HALF, BLOCK_Q]
        q = q.to(gl.float32)
        if HAS_CRS:
            q = q * gl.load(CRSQ + h * 2 * HALF + dq)[None, :]
        qmax = gl.max(gl.where(q == q, gl.abs(q), float("inf")), axis=1)  # act_quant.abs_or_inf / amax_floor:
        qmax = gl.maximum(gl.where(qmax == float("inf"), float("nan"), qmax), 1e-30,
                          propagate_nan=tl.PropagateNan.ALL)  # NaN for a non-finite query row
        u = q / qmax[:, None] * 127.0
        hi = gl.floor(u + 0.5)
        lo = gl.floor((u - hi) * 254.0 + 0.5)
        if QK8 == 2:
            row_scale_q = qmax * (qk_scale / (127.0 * 16.0 * 254.0))
            qsum_q = 16.0 * gl.sum(254.0 * hi + lo, axis=1)  # zero-point term in units of the int32 dot
        else:
            row_scale_q = qmax * (qk_scale / (127.0 * 16.0))
            qsum_q = 16.0 * gl.sum(hi, axis=1)
        qe, qo = gl.split(gl.reshape(hi.to(gl.int8), [BLOCK_Q, HALF, 2]))
        qe_lo, qo_lo = gl.split(gl.reshape(lo.to(gl.int8), [BLOCK_Q, HALF, 2]))
        qe = gl.convert_layout(gl.permute(qe, [1, 0]), b8)
        qo = gl.convert_layout(gl.permute(qo, [1, 0]), b8)
        qe_lo = gl.convert_layout(gl.permute(qe_lo, [1, 0]), b8)
        qo_lo = gl.convert_layout(gl.permute(qo_lo, [1, 0]), b8)
        row_scale = gl.convert_layout(row_scale_q, q_l)
        qsum = gl.convert_layout(qsum_q, q_l)
        r_idx = gl.arange(0, BLOCK_Q, layout=q_l)
        qpos = L - TQ + r_idx % TQ
        # ---- key blocks: full blocks unmasked with the next block's bytes loaded one block ahead,
        # then the split's partial block and the causal diagonal (at most two) masked
        m_i = gl.full([BLOCK_Q], float("-inf"), gl.float32, layout=q_l)
        l_acc = gl.zeros([BLOCK_N, BLOCK_Q], gl.float32, layout=_MMA)
        if VSUB and not ZERO_POINT:
            z_acc = gl.zeros([BLOCK_Q], gl.float32, layout=q_l)
        else:
            z_acc = gl.zeros([BLOCK_N, BLOCK_Q], gl.float32, layout=_MMA)
        acc_e = gl.zeros([HALF, BLOCK_Q], gl.float32, layout=_MMA)
        acc_o = gl.zeros([HALF, BLOCK_Q], gl.float32, layout=_MMA)
        if STAMP:
            g1 = _g_stamp("mov.u64 $0, %globaltimer;")
            c1 = _g_stamp("mov.u64 $0, %clock64;")
        it = 0
        for n0 in range(start, full_end, BLOCK_N):
            stage = it % STAGES
            _async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            kc = smem_k.index(stage).load(a8)
            vc = smem_v.index(stage).reshape([BLOCK_N, 8, HALF // 8]).permute([1, 2, 0]).load(LV)
            nf = n0 + (STAGES - 1) * BLOCK_N
            _g_issue(smem_k, smem_v, (it + STAGES - 1) % STAGES, KC, VC, pgs, nf, h, nf < full_end,
                     stride_cp, stride_ch, stride_cn, HALF, PAGE, BLOCK_N, CL)
            pgs = gl.load(ptb + gl.minimum(nf + BLOCK_N, end - 1) // PAGE).to(gl.int64)
            ks2, vs2, kz2, vz2 = _g_scales(KS, KZ, VS, VZ, pg1, gl.minimum(n0 + BLOCK_N, last), h,
                                           stride_sp, stride_sh, PAGE, BLOCK_N, ZERO_POINT, SRAW)
            ksu, vsu, kzu, vzu = _g_unraw(ks, vs, kz, vz, KS, KZ, ZERO_POINT, SRAW)
            pg1 = gl.load(ptb + gl.minimum(n0 + 2 * BLOCK_N, last) // PAGE).to(gl.int64)
            acc_e, acc_o, m_i, l_acc, z_acc = _g_step(acc_e, acc_o, m_i, l_acc, z_acc, kc, vc, ksu, vsu, kzu, vzu,
                                                      n0, end, qe, qo, qe_lo, qo_lo, row_scale, qsum, qpos,
                                                      HALF, BLOCK_N, BLOCK_Q, ZERO_POINT, QK8, False, VSUB)
            ks, vs, kz, vz = ks2, vs2, kz2, vz2
            it += 1
        _async_copy.wait_group(0)
        for n0 in range(full_end, end, BLOCK_N):
            page = gl.load(PT + b * stride_ptb + n0 // PAGE).to(gl.int64)
            # the tail's bytes as loaded (their own names: with SRAW the main loop's carry int32)
            kct, vct, kst, vst, kzt, vzt = _g_load(KC, KS, KZ, VC, VS, VZ, page, n0, end, h, n0 < end,
                                                   stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
                                                   HALF, PAGE, BLOCK_N, ZERO_POINT, True, LV)
            acc_e, acc_o, m_i, l_acc, z_acc = _g_step(acc_e, acc_o, m_i, l_acc, z_acc, kct, vct, kst, vst, kzt, vzt,
                                                      n0, end, qe, qo, qe_lo, qo_lo, row_scale, qsum, qpos,
                                                      HALF, BLOCK_N, BLOCK_Q, ZERO_POINT, QK8, True, VSUB)
        l_i = gl.sum(l_acc, axis=0)
        if STAMP:
            g2 = _g_stamp("mov.u64 $0, %globaltimer;")
            c2 = _g_stamp("mov.u64 $0, %clock64;")
        if VSUB:  # back from the subnormal scale, minus the offset's sum (``_ASM_SUB``)
            if ZERO_POINT:
                zs = gl.sum(z_acc, axis=0)
            else:
                zs = z_acc * 8.0
            acc_e = acc_e * 16777216.0 - zs[None, :]
            acc_o = acc_o * 1048576.0 - zs[None, :]
        elif ZERO_POINT:
            zs = gl.sum(z_acc, axis=0)
            acc_e -= zs[None, :]
            acc_o -= zs[None, :]
        # ---- epilogue: channel row m <-> code byte (HALF/8) * (m % 8) + m // 8
        row_ok = r_idx < G * TQ
        mm = gl.arange(0, HALF, layout=gl.SliceLayout(1, _MMA))
        ch = 2 * ((HALF // 8) * (mm % 8) + mm // 8)
        if SPLIT:  # partials (fp32, unnormalized) for the combine
            if PDL:  # the combine kernel (programmatic dependent launch) may be scheduled now; it waits for this grid
                gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                          is_pure=False, pack=1)
            base = (pid_bh * gl.num_programs(1) + sid) * BLOCK_Q
            gl.store(MP + base + r_idx, m_i, mask=row_ok)
            gl.store(LP + base + r_idx, l_i, mask=row_ok)
            dst = OP
        else:  # O itself
            base = 0
            inv = gl.where(l_i == 0, 0.0, 1.0 / l_i)
            acc_e = acc_e * inv[None, :]
            acc_o = acc_o * inv[None, :]
            dst = O
        if CSTORE:  # rows of channels in order, one 16-byte vector per lane and store (see ``_g_rows_in_order``)
            if SPLIT:
                st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, HALF // 16], threads_per_warp=[1, 32],
                                                      warps_per_cta=[1, 1], order=[1, 0])
            else:
                st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, HALF // 8], threads_per_warp=[2, 16],
                                                      warps_per_cta=[1, 1], order=[1, 0])
            vals = _g_rows_in_order(acc_e, acc_o, HALF, BLOCK_Q, st_l)
            rows = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, st_l))
            cols = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, st_l))
            o_ptr = dst + _g_row_offsets(rows, base, b, h, stride_ob, stride_oh, stride_ot, G, TQ, HALF, SPLIT)
            gl.store(o_ptr[:, None] + cols[None, :], vals.to(dst.dtype.element_ty), mask=(rows < G * TQ)[:, None])
        else:  # the MMA fragments as they lie: 4-byte (fp32) / 2-byte stores
            o_ptr = dst + _g_row_offsets(r_idx, base, b, h, stride_ob, stride_oh, stride_ot, G, TQ, HALF, SPLIT)
            o_ptr = o_ptr[None, :] + ch[:, None]
            gl.store(o_ptr, acc_e.to(dst.dtype.element_ty), mask=row_ok[None, :])
            gl.store(o_ptr + 1, acc_o.to(dst.dtype.element_ty), mask=row_ok[None, :])
        if STAMP:
            g3 = _g_stamp("mov.u64 $0, %globaltimer;")
            c3 = _g_stamp("mov.u64 $0, %clock64;")
            smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            tsb = TS + (pid_bh * gl.num_programs(1) + sid) * 9
            gl.store(tsb, g0)
            gl.store(tsb + 1, g1)
            gl.store(tsb + 2, g2)
            gl.store(tsb + 3, g3)
            gl.store(tsb + 4, c0)
            gl.store(tsb + 5, c1)
            gl.store(tsb + 6, c2)
            gl.store(tsb + 7, c3)
            gl.store(tsb + 8, smid.to(gl.int64))


def _launch_gluon(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, k_zero, v_zero, crs_q, sm_scale, max_len,
                  num_splits, block_n, num_stages, maxnreg, qk8, return_kernel, skip_combine=False, pdl=None,
                  probe=False, vsub=None, cstore=None, sraw=None):
    """Launcher of ``_decode_kv4_gluon_kernel`` (same split-KV plan and combine as the Triton kernel;
    ``num_stages`` = depth of the cp.async ring; ``cstore``: ``GLUON_CSTORE``, by split length)."""
    B, Hq, TQ, D = q.shape
    P, Hkv, PAGE, HALF = k_codes.shape
    G = Hq // Hkv
    BQ = max(8, triton.next_power_of_2(G * TQ))
    bn = min(PAGE, block_n or (GLUON_BLOCK_N if BQ == 8 else 16))
    stages = num_stages or GLUON_STAGES
    mr = (GLUON_MAXNREG if BQ == 8 else 168) if maxnreg is None else maxnreg  # 16 query rows: 2x the accumulator
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    if max_len is None:
        max_len = int(lengths.max().item()) if B else 0
    if vsub is None:
        vsub = GLUON_VSUB is True or (GLUON_VSUB == "zp" and k_zero is not None)
    vsub = bool(vsub)
    occ_base = ("gluon", q.device, q.dtype, G, TQ, HALF, PAGE, bn, stages, mr, qk8, k_zero is not None,
                crs_q is not None, vsub, probe, GLUON_PDL if pdl is None else bool(pdl))
    out = torch.empty_like(q)
    if num_splits is None:  # the residency of either epilogue (CSTORE or not: same registers, same shared memory)
        num_splits = choose_splits(B, Hkv, max_len, bn, _num_sms(q.device), 1, _OCCUPANCY.get(
            _occupancy_key(occ_base, True, q, k_codes, k_scale, page_table, Hkv, out)), good=GLUON_GOOD_WAVE)
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), bn) * bn
    num_splits = max(1, triton.cdiv(max(max_len, 1), split_len))
    if cstore is None:
        cstore = GLUON_CSTORE is True or (GLUON_CSTORE == "short" and split_len < GLUON_CSTORE_MAX_SPLIT)
    cstore = bool(cstore)
    if sraw is None:  # both at the 128-register cap, same shared memory: the residency key above does not need it
        sraw = GLUON_SRAW is True or (GLUON_SRAW == "long" and k_zero is None
                                      and split_len >= GLUON_SRAW_MIN_SPLIT)
    sraw = bool(sraw)
    LAST_LAUNCH["num_splits"] = num_splits
    zero_point = k_zero is not None
    split = num_splits > 1
    op, mp, lp = split_workspace(out, B * Hkv, num_splits, BQ, D)
    pdl = split and (GLUON_PDL if pdl is None else bool(pdl))
    stamp = probe in ("stamp", "stamp1")  # TS int64 [B*Hkv*splits, 9], beside O (LAST_LAUNCH["stamps"]); "stamp1": + PROBE
    ts = torch.zeros(B * Hkv * num_splits, 9, device=q.device, dtype=torch.int64) if stamp else out
    if stamp:
        LAST_LAUNCH["stamps"] = ts
    kernel = _decode_kv4_gluon_kernel[(B * Hkv, num_splits)](
        q, k_codes, k_scale, k_zero if zero_point else k_scale, v_codes, v_scale, v_zero if zero_point else v_scale,
        page_table, lengths, crs_q if crs_q is not None else q, out, op, mp, lp, ts,
        sm_scale * LOG2E, split_len, Hkv,
        q.stride(0), q.stride(1), q.stride(2),
        k_codes.stride(0), k_scale.stride(0),
        page_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        G=G, TQ=TQ, BLOCK_Q=BQ, HALF=HALF, PAGE=PAGE, BLOCK_N=bn, ZERO_POINT=zero_point, HAS_CRS=crs_q is not None,
        SPLIT=split, QK8=qk8, LV=_v_load_layout(bn, HALF), CL=_copy_layout(HALF), STAGES=stages, PDL=pdl,
        PROBE=probe is True or probe == "stamp1", STAMP=stamp, VSUB=vsub, CSTORE=cstore, SRAW=sraw,
        num_warps=1, **({"maxnreg": mr} if mr else {}),
    )
    occ_key = _occupancy_key(occ_base, split, q, k_codes, k_scale, page_table, Hkv, out)
    if occ_key not in _OCCUPANCY:
        _OCCUPANCY[occ_key] = resident_ctas(kernel, 1)
    if split and not skip_combine:  # skip_combine: benchmarks time the main kernel alone
        _combine(op, mp, lp, out, B, Hkv, num_splits, G, TQ, BQ, D, pdl=pdl)
    return (out, kernel) if return_kernel else out
