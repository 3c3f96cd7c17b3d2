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
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Defaults = the fastest correct fp16-Q configuration of the device sweep (B=16, L=8k).
DEFAULT_TRANS = False  # query rows as the MMA M dimension (mma.sync, one warp: no cross-warp softmax)
DEFAULT_ASM = True  # packed PTX nibble conversion (GPU only; the interpreter uses the int16 path)
DEFAULT_WARPS, DEFAULT_STAGES, DEFAULT_BLOCK_N = 1, 3, 16
DEFAULT_MAXNREG = 128  # register cap per thread: 16 one-warp programs per SM (the compiler alone takes 168)
DEFAULT_MIN_WAVES = 0.95  # split count: ~one full wave of resident programs (R6 sweep: 0.95 beat 1.9 and 2.9)
DEFAULT_LAZY = True  # skip the accumulator rescale when no row max grew (exact)
DEFAULT_QK8 = False  # INT8 Q (per row) x INT8 16*code K on the INT8 tensor cores (opt-in: Q outlier channels)


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
def _prologue(Q, LENS, CRSQ, qk_scale, SPLIT_LEN, Hkv, stride_qb, stride_qh, stride_qt,
              G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
              ZERO_POINT: tl.constexpr, HAS_CRS: tl.constexpr, QK8: tl.constexpr):
    """Shared by both loop orientations: program ids, split bounds, and Q as two fp16 tiles
    ``[BLOCK_M, HALF]`` (even / odd channels) normalised per row by their absmax, whose scale
    (times ``sm_scale * log2 e``) is returned as ``row_scale``; ``qsum`` is the row sum of the
    fp16 Q (zero-point correction), ``qpos`` the absolute position of each query row."""
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
    j = tl.arange(0, HALF)
    d = tl.arange(0, 2 * HALF)
    q_ptr = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt
    q = tl.load(q_ptr + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)  # contiguous rows
    if HAS_CRS:
        q = q * tl.load(CRSQ + h * 2 * HALF + d)[None, :]
    qe, qo = tl.split(tl.reshape(q, [BLOCK_M, HALF, 2]))  # even / odd channels
    qmax = tl.maximum(tl.max(tl.abs(qe), axis=1), tl.max(tl.abs(qo), axis=1))
    qmax = tl.maximum(qmax, 1e-30)
    if QK8:  # Q in INT8 per row (127 / absmax, round half up); K codes as int8 16 * code
        qe16 = tl.floor(qe / qmax[:, None] * 127.0 + 0.5).to(tl.int8)
        qo16 = tl.floor(qo / qmax[:, None] * 127.0 + 0.5).to(tl.int8)
        row_scale = qmax * (qk_scale / (127.0 * 16.0))
        if ZERO_POINT:  # in units of the int32 dot: 16 * sum(q8)
            qsum = 16.0 * (tl.sum(qe16.to(tl.float32), axis=1) + tl.sum(qo16.to(tl.float32), axis=1))
        else:
            qsum = tl.zeros([BLOCK_M], tl.float32)
    else:
        qe16 = (qe / qmax[:, None]).to(tl.float16)
        qo16 = (qo / qmax[:, None]).to(tl.float16)
        row_scale = qmax * qk_scale  # includes sm_scale * log2(e)
        if ZERO_POINT:
            qsum = tl.sum(qe16.to(tl.float32), axis=1) + tl.sum(qo16.to(tl.float32), axis=1)
        else:
            qsum = tl.zeros([BLOCK_M], tl.float32)
    qpos = L - TQ + t  # absolute position of query row m
    return pid_bh, sid, b, h, start, end, m_idx, g, t, row_ok, j, qe16, qo16, row_scale, qsum, qpos


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
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        o_ptr = O + b * stride_ob + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + 2 * j[None, :]
        tl.store(o_ptr, (acc_e * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(o_ptr + 1, (acc_o * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _scale_rows(acc_e, acc_o, l_i, alpha, AXIS: tl.constexpr):
    """Multiply the accumulators (rows along AXIS) and the denominators by alpha."""
    if AXIS == 0:
        return acc_e * alpha[:, None], acc_o * alpha[:, None], l_i * alpha
    return acc_e * alpha[None, :], acc_o * alpha[None, :], l_i * alpha


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
def _qm_step(acc_e, acc_o, m_i, l_i, KC, KS, KZ, VC, VS, VZ, page, n0, end, h, j, qe16, qo16, row_scale, qsum, qpos,
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
def _loop_queries_major(KC, KS, KZ, VC, VS, VZ, PT, b, h, start, end, j, qe16, qo16, row_scale, qsum, qpos,
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
                                          qe16, qo16, row_scale, qsum, qpos,
                                          stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
                                          PAGE, BLOCK_N, ZERO_POINT, ASM, LAZY, False, QK8)
    for n0 in range(full_end, end, BLOCK_N):
        page = tl.load(PT + b * stride_ptb + n0 // PAGE).to(tl.int64)
        acc_e, acc_o, m_i, l_i = _qm_step(acc_e, acc_o, m_i, l_i, KC, KS, KZ, VC, VS, VZ, page, n0, end, h, j,
                                          qe16, qo16, row_scale, qsum, qpos,
                                          stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
                                          PAGE, BLOCK_N, ZERO_POINT, ASM, LAZY, True, QK8)
    return acc_e, acc_o, m_i, l_i


@triton.jit
def _loop_tokens_major(KC, KS, KZ, VC, VS, VZ, PT, b, h, start, end, j, qe16, qo16, row_scale, qsum, qpos,
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
            s = tl.dot(k_hi, qo_t, tl.dot(k_lo, qe_t, out_dtype=tl.int32), out_dtype=tl.int32).to(tl.float32)
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
    pid_bh, sid, b, h, start, end, m_idx, g, t, row_ok, j, qe16, qo16, row_scale, qsum, qpos = _prologue(
        Q, LENS, CRSQ, qk_scale, SPLIT_LEN, Hkv, stride_qb, stride_qh, stride_qt,
        G, TQ, BLOCK_M, HALF, ZERO_POINT, HAS_CRS, QK8)
    if TRANS:
        acc_e, acc_o, m_i, l_i = _loop_tokens_major(
            KC, KS, KZ, VC, VS, VZ, PT, b, h, start, end, j, qe16, qo16, row_scale, qsum, qpos,
            stride_cp, stride_ch, stride_cn, stride_sp, stride_sh, stride_ptb,
            BLOCK_M, HALF, PAGE, BLOCK_N, ZERO_POINT, ASM, LAZY, QK8)
    else:
        acc_e, acc_o, m_i, l_i = _loop_queries_major(
            KC, KS, KZ, VC, VS, VZ, PT, b, h, start, end, j, qe16, qo16, row_scale, qsum, qpos,
            stride_cp, stride_ch, stride_cn, stride_sp, stride_sh, stride_ptb,
            BLOCK_M, HALF, PAGE, BLOCK_N, ZERO_POINT, ASM, LAZY, QK8)
    _epilogue(acc_e, acc_o, m_i, l_i, O, OP, MP, LP, pid_bh, sid, b, h, m_idx, g, t, row_ok, j,
              stride_ob, stride_oh, stride_ot, G, HALF, SPLIT)

@triton.jit
def _combine_kernel(
    OP, MP, LP, O, Hkv, NUM_SPLITS,
    stride_ob, stride_oh, stride_ot,
    G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    SPLITS_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence, KV head, query row, BLOCK_D channels): the splits' partials are
    read as ``[CHUNK, BLOCK_D]`` tiles (all splits at once up to CHUNK), not one split after the
    other: a serial loop over 64+ splits would be bound by memory latency."""
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    sp = tl.arange(0, SPLITS_P2)
    row = (pid_bh * NUM_SPLITS + sp) * BLOCK_M + r
    m_all = tl.load(MP + row, mask=sp < NUM_SPLITS, other=float("-inf"))
    m_tot = tl.max(m_all, axis=0)
    m_safe = tl.where(m_tot == float("-inf"), 0.0, m_tot)
    l_all = tl.load(LP + row, mask=sp < NUM_SPLITS, other=0.0)
    l_tot = tl.sum(tl.where(sp < NUM_SPLITS, tl.exp2(m_all - m_safe) * l_all, 0.0), axis=0)
    d = d0 + tl.arange(0, BLOCK_D)
    c = tl.arange(0, CHUNK)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, NUM_SPLITS, CHUNK):
        ok = (s0 + c) < NUM_SPLITS
        rr = (pid_bh * NUM_SPLITS + s0 + c) * BLOCK_M + r
        w = tl.exp2(tl.load(MP + rr, mask=ok, other=float("-inf")) - m_safe)
        part = tl.load(OP + rr[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
    inv = tl.where(l_tot > 0, 1.0 / l_tot, 0.0)
    g = r // TQ
    t = r % TQ
    tl.store(O + b * stride_ob + (h * G + g) * stride_oh + t * stride_ot + d, (acc * inv).to(O.dtype.element_ty))


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits_used(max_len: int, splits: int, block_n: int) -> int:
    split_len = -(-(-(-max(max_len, 1) // splits)) // block_n) * block_n
    return max(1, -(-max(max_len, 1) // split_len))


def choose_splits(batch: int, hkv: int, max_len: int, block_n: int, sms: int, num_warps: int = 4,
                  ctas_per_sm: int | None = None, min_waves: float | None = None) -> int:
    """Split count of the split-KV grid (B*Hkv programs per split). Every split keeps at least 4
    key blocks. Without occupancy: enough programs for ~16 resident warps per SM. With
    ``ctas_per_sm`` (from the compiled kernel's registers / shared memory): at least one full wave
    of ``sms * ctas_per_sm`` programs, and the split count whose programs fill the last wave best
    (all splits cost the same, so a wave that is 6% full costs as much as a full one)."""
    most = max(1, math.ceil(max_len / (4 * block_n)))
    bh = max(1, batch * hkv)
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
        if eff >= 0.97:
            break
    return best


LAST_LAUNCH: dict = {}  # the split count of the latest launch (benchmarks report it)
_OCCUPANCY: dict = {}  # launch configuration -> resident programs per SM (filled after the first launch)


def _ctas_per_sm(kernel, num_warps: int) -> int | None:
    """Resident programs per SM of a compiled kernel on Hopper (64K registers, 227 KB shared
    memory, 64 warps, 32 blocks per SM); None when the kernel carries no metadata (interpreter)."""
    try:
        regs = int(kernel.n_regs)
        smem = int(kernel.metadata.shared)
    except Exception:
        return None
    if regs <= 0:
        return None
    regs = -(-regs // 8) * 8
    by_regs = 65536 // (regs * 32 * num_warps)
    by_smem = (227 * 1024) // (smem + 1024)
    return max(1, min(by_regs, by_smem, 64 // num_warps, 32))


def decode_kv4_triton(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, *, k_zero=None,
                      v_zero=None, crs_q=None, sm_scale=None, max_len=None, num_splits=None,
                      block_n=None, num_warps=None, num_stages=None, trans=None, asm=None, lazy=None,
                      maxnreg=None, qk_int8=None, return_kernel=False):
    """Launcher. q ``[B, Hq, TQ, D]`` (post-RoPE; any float dtype); cache tensors as in the module
    docstring; returns O ``[B, Hq, TQ, D]`` in q's dtype. Arguments are checked by
    ``lowbit.ops.kv4.decode_kv4``; ``max_len`` (host int) avoids a device sync when given."""
    B, Hq, TQ, D = q.shape
    P, Hkv, PAGE, HALF = k_codes.shape
    G = Hq // Hkv
    BLOCK_M = max(16, triton.next_power_of_2(G * TQ))
    if block_n is None:
        block_n = min(PAGE, DEFAULT_BLOCK_N)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    if max_len is None:
        max_len = int(lengths.max().item()) if B else 0
    nw = num_warps or DEFAULT_WARPS
    occ_key = (q.device, q.dtype, G, TQ, HALF, PAGE, block_n, k_zero is not None, crs_q is not None, trans, asm, lazy,
               qk_int8, nw, num_stages, maxnreg, DEFAULT_TRANS, DEFAULT_LAZY, DEFAULT_QK8, DEFAULT_STAGES, DEFAULT_MAXNREG)
    if num_splits is None:
        num_splits = choose_splits(B, Hkv, max_len, block_n, _num_sms(q.device), nw, _OCCUPANCY.get(occ_key))
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(max_len, 1), split_len))
    LAST_LAUNCH["num_splits"] = num_splits
    out = torch.empty_like(q)
    zero_point = k_zero is not None
    kz = k_zero if zero_point else k_scale
    vz = v_zero if zero_point else v_scale
    crs = crs_q if crs_q is not None else q
    split = num_splits > 1
    if split:
        op = torch.empty(B * Hkv * num_splits * BLOCK_M * D, device=q.device, dtype=torch.float32)
        mp = torch.empty(B * Hkv * num_splits * BLOCK_M, device=q.device, dtype=torch.float32)
        lp = torch.empty_like(mp)
    else:
        op = mp = lp = out
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
        QK8=DEFAULT_QK8 if qk_int8 is None else bool(qk_int8),
        num_warps=num_warps or DEFAULT_WARPS, num_stages=num_stages or DEFAULT_STAGES,
        **({"maxnreg": mr} if (mr := DEFAULT_MAXNREG if maxnreg is None else maxnreg) and q.is_cuda else {}),
    )
    if q.is_cuda and occ_key not in _OCCUPANCY:
        _OCCUPANCY[occ_key] = _ctas_per_sm(kernel, nw)
    if split:
        sp2 = triton.next_power_of_2(num_splits)
        bd = min(D, 32)
        _combine_kernel[(B * Hkv, G * TQ, D // bd)](
            op, mp, lp, out, Hkv, num_splits,
            out.stride(0), out.stride(1), out.stride(2),
            G=G, TQ=TQ, BLOCK_M=BLOCK_M, D=D, SPLITS_P2=sp2, CHUNK=min(sp2, 8192 // bd), BLOCK_D=bd, num_warps=4,
        )
    return (out, kernel) if return_kernel else out
