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
and writes its un-normalised fp32 accumulator, running max (log2 domain) and denominator; a
second small kernel combines the splits. With one split the first kernel writes O directly.
Accumulation fp32; exp2 with ``sm_scale * log2(e)`` folded into the Q row scale.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DEFAULT_TRANS = True  # tokens as the MMA M dimension (see _decode_tokens_major); fastest in R2
DEFAULT_ASM = True  # packed PTX nibble conversion (GPU only; the interpreter uses the int16 path)
DEFAULT_WARPS, DEFAULT_STAGES = 4, 3


@triton.jit
def _nibbles_to_f16(c, XOR: tl.constexpr, OFFSET: tl.constexpr):
    """uint8 codes -> (low nibble, high nibble) as fp16 integers (signed if XOR == 0x88)."""
    u = c.to(tl.int16) ^ XOR
    lo = ((u & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - OFFSET
    hi = (((u >> 4) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - OFFSET
    return lo, hi


# Packed conversion of 4 code bytes per 32-bit register, two fp16 lanes per instruction: prmt
# spreads bytes (b0, b1) and (b2, b3) into the low byte of each 16-bit half, xor 0x88 maps two's
# complement nibbles to offset binary (signed codes only), lop3 ORs the nibble into the mantissa of
# fp16 1024.0, and one sub.f16x2 (low nibbles: 1024 + u) or fma.f16x2 (high nibbles: 1024 + 16 u,
# times 1/16) leaves the exact integer code. One single-output asm per nibble half, so Triton may
# hoist the layout conversion to the MMA operand above it (codes cross shared memory as bytes).
_ASM_HEAD = """{{
.reg .b32 z, t0, t1, a0, a1, k1, k2, msk, mag;
mov.b32 z, 0;
mov.b32 mag, 0x64006400;
prmt.b32 t0, $2, z, 0x4140;
prmt.b32 t1, $2, z, 0x4342;
{xor}
"""
_ASM_LO = """mov.b32 msk, 0x000F000F;
lop3.b32 a0, t0, msk, mag, 0xEA;
lop3.b32 a1, t1, msk, mag, 0xEA;
mov.b32 k1, {off};
sub.f16x2 $0, a0, k1;
sub.f16x2 $1, a1, k1;
}}"""
_ASM_HI = """mov.b32 msk, 0x00F000F0;
lop3.b32 a0, t0, msk, mag, 0xEA;
lop3.b32 a1, t1, msk, mag, 0xEA;
mov.b32 k1, 0x2C002C00;
mov.b32 k2, {off};
fma.rn.f16x2 $0, a0, k1, k2;
fma.rn.f16x2 $1, a1, k1, k2;
}}"""
_XOR = "xor.b32 t0, t0, 0x00880088;\nxor.b32 t1, t1, 0x00880088;"
ASM_LO_S = tl.constexpr((_ASM_HEAD + _ASM_LO).format(xor=_XOR, off="0x64086408"))
ASM_HI_S = tl.constexpr((_ASM_HEAD + _ASM_HI).format(xor=_XOR, off="0xD480D480"))
ASM_LO_U = tl.constexpr((_ASM_HEAD + _ASM_LO).format(xor="", off="0x64006400"))
ASM_HI_U = tl.constexpr((_ASM_HEAD + _ASM_HI).format(xor="", off="0xD400D400"))


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


@triton.jit
def _convert(c, XOR: tl.constexpr, OFFSET: tl.constexpr, ZERO_POINT: tl.constexpr, ASM: tl.constexpr):
    if ASM:
        lo, hi = _nibbles_to_f16_asm(c, ZERO_POINT)
    else:
        lo, hi = _nibbles_to_f16(c, XOR, OFFSET)
    return lo, hi


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
    TRANS: tl.constexpr, ASM: tl.constexpr,
):
    if TRANS:
        _decode_tokens_major(Q, KC, KS, KZ, VC, VS, VZ, PT, LENS, CRSQ, O, OP, MP, LP, qk_scale, SPLIT_LEN, Hkv,
                             stride_qb, stride_qh, stride_qt, stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
                             stride_ptb, stride_ob, stride_oh, stride_ot,
                             G, TQ, BLOCK_M, HALF, PAGE, BLOCK_N, ZERO_POINT, HAS_CRS, SPLIT, ASM)
        return
    pid_bh = tl.program_id(0)
    sid = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    L = tl.load(LENS + b)
    start = sid * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, L)

    XOR: tl.constexpr = 0 if ZERO_POINT else 0x88
    OFFSET: tl.constexpr = 1024.0 if ZERO_POINT else 1032.0

    m_idx = tl.arange(0, BLOCK_M)
    g = m_idx // TQ
    t = m_idx % TQ
    row_ok = m_idx < G * TQ
    j = tl.arange(0, HALF)
    q_ptr = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt
    qe = tl.load(q_ptr + 2 * j[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    qo = tl.load(q_ptr + 2 * j[None, :] + 1, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if HAS_CRS:
        qe = qe * tl.load(CRSQ + h * 2 * HALF + 2 * j)[None, :]
        qo = qo * tl.load(CRSQ + h * 2 * HALF + 2 * j + 1)[None, :]
    qmax = tl.maximum(tl.max(tl.abs(qe), axis=1), tl.max(tl.abs(qo), axis=1))
    qmax = tl.maximum(qmax, 1e-30)
    qe16 = (qe / qmax[:, None]).to(tl.float16)
    qo16 = (qo / qmax[:, None]).to(tl.float16)
    row_scale = qmax * qk_scale  # includes sm_scale * log2(e)
    if ZERO_POINT:
        qsum = tl.sum(qe16.to(tl.float32), axis=1) + tl.sum(qo16.to(tl.float32), axis=1)
    qpos = L - TQ + t  # absolute position of query row m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_e = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_o = tl.zeros([BLOCK_M, HALF], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    page_next = tl.load(PT + b * stride_ptb + start // PAGE)
    for n0 in range(start, end, BLOCK_N):
        # the page id is read one block ahead, so the code loads do not wait on a dependent load
        page = page_next.to(tl.int64)
        page_next = tl.load(PT + b * stride_ptb + tl.minimum(n0 + BLOCK_N, end - 1) // PAGE)
        tok = (n0 % PAGE) + n_off
        kpos = n0 + n_off
        key_ok = kpos < end
        c_off = page * stride_cp + h * stride_ch + tok[:, None] * stride_cn + j[None, :]
        s_off = page * stride_sp + h * stride_sh + tok
        kc = tl.load(KC + c_off)
        vc = tl.load(VC + c_off)
        ks = tl.load(KS + s_off, mask=key_ok, other=0.0).to(tl.float32)
        vs = tl.load(VS + s_off, mask=key_ok, other=0.0).to(tl.float32)
        k_lo, k_hi = _convert(kc, XOR, OFFSET, ZERO_POINT, ASM)
        s = tl.dot(qe16, tl.trans(k_lo)) + tl.dot(qo16, tl.trans(k_hi))
        if ZERO_POINT:
            kz = tl.load(KZ + s_off, mask=key_ok, other=0).to(tl.float32)
            s = s - qsum[:, None] * kz[None, :]
        s = s * (row_scale[:, None] * ks[None, :])
        ok = key_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = p * vs[None, :]
        v_lo, v_hi = _convert(vc, XOR, OFFSET, ZERO_POINT, ASM)
        pv16 = pv.to(tl.float16)
        acc_e = acc_e * alpha[:, None] + tl.dot(pv16, v_lo)
        acc_o = acc_o * alpha[:, None] + tl.dot(pv16, v_hi)
        if ZERO_POINT:
            vz = tl.load(VZ + s_off, mask=key_ok, other=0).to(tl.float32)
            zs = tl.sum(pv16.to(tl.float32) * vz[None, :], axis=1)
            acc_e -= zs[:, None]
            acc_o -= zs[:, None]
        m_i = m_new

    if SPLIT:
        base = (pid_bh * tl.num_programs(1) + sid) * BLOCK_M
        tl.store(MP + base + m_idx, m_i)
        tl.store(LP + base + m_idx, l_i)
        o_ptr = OP + (base + m_idx)[:, None] * (2 * HALF) + 2 * j[None, :]
        tl.store(o_ptr, acc_e)
        tl.store(o_ptr + 1, acc_o)
    else:
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        o_ptr = O + b * stride_ob + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + 2 * j[None, :]
        tl.store(o_ptr, (acc_e * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(o_ptr + 1, (acc_o * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _decode_tokens_major(
    Q, KC, KS, KZ, VC, VS, VZ, PT, LENS, CRSQ, O, OP, MP, LP, qk_scale, SPLIT_LEN, Hkv,
    stride_qb, stride_qh, stride_qt, stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
    stride_ptb, stride_ob, stride_oh, stride_ot,
    G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    ZERO_POINT: tl.constexpr, HAS_CRS: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
):
    """TRANS=True: the same math with tokens as the M dimension of both dots (M = BLOCK_N and
    M = D/2, N = BLOCK_M query rows): ``S^T = K Q^T`` and ``O^T = V^T (P^T * v_scale)``, so the
    code tiles are the register (A) operand of the MMA and no code tile is transposed."""
    pid_bh = tl.program_id(0)
    sid = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    L = tl.load(LENS + b)
    start = sid * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, L)
    XOR: tl.constexpr = 0 if ZERO_POINT else 0x88
    OFFSET: tl.constexpr = 1024.0 if ZERO_POINT else 1032.0

    m_idx = tl.arange(0, BLOCK_M)
    g = m_idx // TQ
    t = m_idx % TQ
    row_ok = m_idx < G * TQ
    j = tl.arange(0, HALF)
    q_ptr = Q + b * stride_qb + (h * G + g)[None, :] * stride_qh + t[None, :] * stride_qt
    qe = tl.load(q_ptr + 2 * j[:, None], mask=row_ok[None, :], other=0.0).to(tl.float32)  # [HALF, M]
    qo = tl.load(q_ptr + 2 * j[:, None] + 1, mask=row_ok[None, :], other=0.0).to(tl.float32)
    if HAS_CRS:
        qe = qe * tl.load(CRSQ + h * 2 * HALF + 2 * j)[:, None]
        qo = qo * tl.load(CRSQ + h * 2 * HALF + 2 * j + 1)[:, None]
    qmax = tl.maximum(tl.max(tl.abs(qe), axis=0), tl.max(tl.abs(qo), axis=0))
    qmax = tl.maximum(qmax, 1e-30)
    qe16 = (qe / qmax[None, :]).to(tl.float16)
    qo16 = (qo / qmax[None, :]).to(tl.float16)
    col_scale = qmax * qk_scale
    if ZERO_POINT:
        qsum = tl.sum(qe16.to(tl.float32), axis=0) + tl.sum(qo16.to(tl.float32), axis=0)
    qpos = L - TQ + t

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_e = tl.zeros([HALF, BLOCK_M], tl.float32)
    acc_o = tl.zeros([HALF, BLOCK_M], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    page_next = tl.load(PT + b * stride_ptb + start // PAGE)
    for n0 in range(start, end, BLOCK_N):
        # the page id is read one block ahead, so the code loads do not wait on a dependent load
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
        k_lo, k_hi = _convert(kc, XOR, OFFSET, ZERO_POINT, ASM)
        s = tl.dot(k_lo, qe16) + tl.dot(k_hi, qo16)  # [BLOCK_N, M]
        if ZERO_POINT:
            kz = tl.load(KZ + s_off, mask=key_ok, other=0).to(tl.float32)
            s = s - kz[:, None] * qsum[None, :]
        s = s * (ks[:, None] * col_scale[None, :])
        ok = key_ok[:, None] & (kpos[:, None] <= qpos[None, :])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        pv16 = (p * vs[:, None]).to(tl.float16)
        v_lo, v_hi = _convert(vc, XOR, OFFSET, ZERO_POINT, ASM)
        acc_e = acc_e * alpha[None, :] + tl.dot(v_lo, pv16)
        acc_o = acc_o * alpha[None, :] + tl.dot(v_hi, pv16)
        if ZERO_POINT:
            vz = tl.load(VZ + s_off, mask=key_ok, other=0).to(tl.float32)
            zs = tl.sum(pv16.to(tl.float32) * vz[:, None], axis=0)
            acc_e -= zs[None, :]
            acc_o -= zs[None, :]
        m_i = m_new

    if SPLIT:
        base_m = (pid_bh * tl.num_programs(1) + sid) * BLOCK_M
        tl.store(MP + base_m + m_idx, m_i)
        tl.store(LP + base_m + m_idx, l_i)
        o_ptr = OP + (base_m + m_idx)[None, :] * (2 * HALF) + 2 * j[:, None]
        tl.store(o_ptr, acc_e)
        tl.store(o_ptr + 1, acc_o)
    else:
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        o_ptr = O + b * stride_ob + (h * G + g)[None, :] * stride_oh + t[None, :] * stride_ot + 2 * j[:, None]
        tl.store(o_ptr, (acc_e * inv[None, :]).to(O.dtype.element_ty), mask=row_ok[None, :])
        tl.store(o_ptr + 1, (acc_o * inv[None, :]).to(O.dtype.element_ty), mask=row_ok[None, :])


@triton.jit
def _combine_kernel(
    OP, MP, LP, O, Hkv, NUM_SPLITS,
    stride_ob, stride_oh, stride_ot,
    G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    m_idx = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    m_tot = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, NUM_SPLITS):
        m_tot = tl.maximum(m_tot, tl.load(MP + (pid_bh * NUM_SPLITS + s) * BLOCK_M + m_idx))
    m_safe = tl.where(m_tot == float("-inf"), 0.0, m_tot)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s in range(0, NUM_SPLITS):
        base = (pid_bh * NUM_SPLITS + s) * BLOCK_M
        w = tl.exp2(tl.load(MP + base + m_idx) - m_safe)
        l_tot += w * tl.load(LP + base + m_idx)
        acc += w[:, None] * tl.load(OP + (base + m_idx)[:, None] * D + d[None, :])
    inv = tl.where(l_tot > 0, 1.0 / l_tot, 0.0)
    g = m_idx // TQ
    t = m_idx % TQ
    row_ok = m_idx < G * TQ
    o_ptr = O + b * stride_ob + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :]
    tl.store(o_ptr, (acc * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(batch: int, hkv: int, max_len: int, block_n: int, sms: int, num_warps: int = 4) -> int:
    """Enough programs for ~16 resident warps per SM (B*Hkv*splits >= 16/num_warps * SMs, i.e.
    >= 4 * SMs programs of 4 warps), but every split keeps at least 4 key blocks."""
    want = math.ceil(16 // max(1, min(num_warps, 16)) * sms / max(1, batch * hkv))
    most = max(1, math.ceil(max_len / (4 * block_n)))
    return max(1, min(want, most, 64))


def decode_kv4_triton(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, *, k_zero=None,
                      v_zero=None, crs_q=None, sm_scale=None, max_len=None, num_splits=None,
                      block_n=None, num_warps=None, num_stages=None, trans=None, asm=None, return_kernel=False):
    """Launcher. q ``[B, Hq, TQ, D]`` (post-RoPE; any float dtype); cache tensors as in the module
    docstring; returns O ``[B, Hq, TQ, D]`` in q's dtype. Arguments are checked by
    ``lowbit.ops.kv4.decode_kv4``; ``max_len`` (host int) avoids a device sync when given."""
    B, Hq, TQ, D = q.shape
    P, Hkv, PAGE, HALF = k_codes.shape
    G = Hq // Hkv
    BLOCK_M = max(16, triton.next_power_of_2(G * TQ))
    if block_n is None:
        block_n = min(PAGE, 64)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    if max_len is None:
        max_len = int(lengths.max().item()) if B else 0
    if num_splits is None:
        num_splits = choose_splits(B, Hkv, max_len, block_n, _num_sms(q.device), num_warps or DEFAULT_WARPS)
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(max_len, 1), split_len))
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
        num_warps=num_warps or DEFAULT_WARPS, num_stages=num_stages or DEFAULT_STAGES,
    )
    if split:
        _combine_kernel[(B * Hkv,)](
            op, mp, lp, out, Hkv, num_splits,
            out.stride(0), out.stride(1), out.stride(2),
            G=G, TQ=TQ, BLOCK_M=BLOCK_M, D=D, num_warps=4,
        )
    return (out, kernel) if return_kernel else out
