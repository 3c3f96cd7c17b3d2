"""Quantized FlashAttention forward (prefill): FP8, full-INT8, half-INT8 and FP8 x INT4-KV in ONE
Triton kernel selected by constexpr flags.

Math (FlashAttention-2 forward, one program per ``BLOCK_M`` queries of one (batch, query head))::

    q_code, q_scale = quantize_qk(Q_tile)                 # in registers (Q is read once), or read
                                                          # from the quantization pass (Q_PRE)
    for each KV block of BLOCK_N keys:
        t     = (q_code . k_code^T) * k_scale             # INT32 -> fp32, or fp32 from FP8 MMA
        S2    = t * (q_scale * sm_scale * log2 e)         # scores in log2 units (exp2 softmax)
        m_new = max(m, rowmax(S2)); alpha = exp2(m - m_new)
        P     = exp2(S2 - m_new + c)                      # c = log2 127 (INT8) / 8 (FP8) / 0
        P     = quantize(P)                               # INT8 RNE / FP8 / 16-bit float
        l     = l * alpha + rowsum(P)                     # INT8: the quantized P (Alg. 1 line 13)
        acc   = acc * alpha + (P . V_block) * v_scale     # INT32 or fp32 block product
    O = acc / l

``MODE`` 0 = ``fp8`` (FP8 E4M3 Q/K/V/P, FP8 wgmma, fp32 accumulation), 1 = ``int8`` (INT8 Q/K/V/P,
s8 wgmma with INT32 accumulation, INT-FlashAttention Alg. 1), 2 = ``int8-qk`` (INT8 QK^T, 16-bit
float P and V). ``KV4`` (with MODE 0, FireQ §3.2) reads packed INT4 K/V codes with per-token FP8
scales and converts the codes to FP8 in registers (exact); the V scale is folded into P
(``lowbit.formats.attention_quant`` explains each rule; it is the reference of these numerics).

Layouts: Q ``[B, Hq, Sq, D]`` (16-bit or fp32, last dim contiguous), K codes ``[B, Hkv, Skv, D]``
(KV4: ``[B, Hkv, Skv, D/2]`` uint8), K scale ``[B, Hkv, Skv]``, V codes **transposed**
``[B, Hkv, D, S_al]`` with V scales ``[B, Hkv, cdiv(Skv, V_BLOCK), D]`` (KV4: V ``[B, Hkv, Skv, D/2]``,
scale ``[B, Hkv, Skv]``; int8-qk: V ``[B, Hkv, Skv, D]`` 16-bit), O like Q.

Precision notes: the FP8 P.V product of one KV block (K = BLOCK_N = 128 products) is taken in a
fresh accumulator and added to the fp32 ``acc`` by CUDA cores, never accumulated across blocks
inside the tensor core: Hopper's FP8 MMA accumulates with ~14 bits, and Triton's default for FP8
dots on sm_90 (``max_num_imprecise_acc`` = 2^30) would otherwise carry that over the whole
sequence. The per-block V scale multiply makes that split free.

Causal: bottom-right aligned (query i of Sq sees keys j <= i + Skv - Sq). KV blocks fully visible
to the whole query block run without masks; the diagonal and tail blocks run a masked copy of the
loop body; blocks above the diagonal are skipped. Query blocks are scheduled longest first.
GQA: query head h reads KV head h // (Hq / Hkv). Any Sq, Skv (masked tails, no padding needed).

``Q_PRE`` (fp8 default since session 3): the Q codes and per-token scales come from the K/V
quantization launch (``quantize_kv_triton(q=...)``, same codes): the prologue loses the per-row
``div_rn`` and the fp32 Q tile, and the kernel its register spills at 168 registers. ``Q_TMA``
reads them by TMA, ``WS`` warp-specializes the KV loops (Triton 3.6's Hopper automatic warp
specialization accepts only descriptor loads in the loop, scales included: they are read as
16-byte boxes of padded buffers). WS compiles but faulted on the H200 (session 3, R7/R8, also a
plain q/k/v probe with scales; compute-sanitizer: "Unknown Error" in thread 0, the producer
warp group): an option, not the default.

``POLY`` (config ``poly``, option, off; session 4): n of every 4 exponentials per thread on the FMA
pipe (``_exp2_poly``, FlashAttention-4's exp2 emulation) instead of MUFU.EX2 (R11: 818 vs 836
TFLOP/s fp8, 508 vs 537 int8: slower). Config ``gluon`` (option, off): fp8 with Q codes,
per-block K/V scales and D = 128 runs the Gluon kernel of ``lowbit.kernels.attention_prefill_gluon``
(FlashAttention-3 order: the softmax of block j+1 overlaps P_j V_j); everything else, and the
interpreter, runs this kernel.

``EXP16`` (config ``exp16``, fp8 modes, option, off): the FireQ-style fp16 numerator
P = h(2^h(x + 8)) by ``ex2.approx.f16x2``, l summed from it in fp32 (``attention_quant_ref(exp16=True)``
replays it). Session 15 (H200, ``benchmarks/device/s15_attn.py``, attention launch, B=4 H=32 D=128): slower,
S=4k 1.328 vs 1.239 ms, 16k 23.73 vs 21.34 ms: on sm_90 ptxas issues two MUFU.EX2 per ``f16x2`` op (MUFU count
per loop 136 either way), so it halves nothing and adds the f16 conversions. An INT8 form (P = RNE(127 h(2^h(x)))
through one fp16 FMA + PRMT per 4 codes) and folding INT8 P V's 1.5*2^23 offset into the V-scale FFMA were
measured in the same run and removed: 2.018 and 2.137 vs 1.981 ms at 4k (results/h200/s15_attn.json).

``VPERM`` (config ``vperm``; session 5): V^T is stored with the keys of each 32-key chunk at
``vperm_pos`` (the quantization kernels write it so, ``quantize_kv_triton(vperm=True)``), and P is
permuted the same way (``_vperm_p``): a permutation of the summed index, so P V is unchanged
(bit-equal on the GPU, R12), and the permuted P is exactly the register order of the wgmma
accumulator read as the 8-bit A operand, so the P -> A conversion needs no shuffles. SASS per
64x128 block: fp8 558 -> 509 instructions, int8 993 -> 912 (-24 SHFL / -32 PRMT / -16 SEL).

``FUSE_KV`` (option, off by default): the first programs of each KV head quantize its K/V blocks
(``lowbit.kernels.attention_quant._kv_quant_task``, the code of the separate pass) inside this
launch while the others wait on a per-head counter. Same codes; measured slower on the H200
(session 2, R4: S=1k 0.223 vs 0.158 ms, 4k 2.01 vs 1.60 ms): the producers' chunked loads are
latency-bound and every program of the head waits for them.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode, tma_capable
from lowbit.formats.common import AMAX_EPS, FP8_E4M3
from lowbit.kernels.act_quant import round_to_fp8_e4m3
from lowbit.kernels import attention_quant as _aq
from lowbit.kernels.attention_quant import _abs_operand, _eps_floor, _kv_quant_task

MODE_FP8, MODE_INT8, MODE_INT8_QK = 0, 1, 2
MODE_IDS = {"fp8": MODE_FP8, "int8": MODE_INT8, "int8-qk": MODE_INT8_QK, "fp8-kv4": MODE_FP8}
LOG2E = 1.4426950408889634
LOG2_127 = math.log2(127.0)


# ----------------------------------------------------------------------------------------- configs
# Session 5 defaults (each flipped only after a same-round device A/B against the previous one):
# ``vperm``: the quantization writes V^T in the VPERM key order and the kernel reads P's wgmma
# accumulator registers as the A operand without shuffles; ``gluon``: the fp8 attention runs the
# Gluon kernel (``attention_prefill_gluon``, "v2": FlashAttention-3 order) where it applies.
VPERM_FP8 = True
VPERM_INT8 = True
GLUON_FP8 = False

def default_config(mode: str, head_dim: int, causal: bool, sq: int) -> dict:
    """Block sizes / warps / stages / TMA per case, from the H200 sweep (benchmarks/device,
    S=4096, B=4, H=32, D=128, attention launch alone, TFLOP/s):

    fp8: 128x128 8 warps 3 stages 600 (TMA 557); 128x64 TMA 470; **64x128 4 warps TMA 2 stages
    651, 3 stages 733** (two CTAs per SM: one CTA's softmax overlaps the other's MMAs, which Triton
    does not do inside a CTA on Hopper: every wgmma is waited right after issue). int8: 128x128 430
    (TMA 420); 64x128 4 warps TMA 2 stages 492. ``tma``: K/V through tensor descriptors.

    Session 2 (R5, quantization included, ms): fp8 64x128 2 stages with ``maxnreg`` 168 (three
    CTAs per SM) vs 3 stages (two CTAs): S=1k 0.1561 vs 0.1580, 1k causal 0.1199 vs 0.1283,
    4k 1.511 vs 1.599, 4k causal 0.915 vs 0.969; int8 at 168 registers spills: 3.07 vs 2.34 ms.
    128x128 (8 warps) and 64x64 at S=1k: 0.193 / 0.190 ms.

    Session 3 (R8, quantization included, ms, same run): fp8 ``q_pre`` (Q quantized by the K/V
    quantization launch, codes read by pointer loads; bit-identical output) vs Q quantized in the
    prologue: 4k 1.479 vs 1.511, 1k 0.1547 vs 0.1556, 4k causal 0.911 vs 0.916. The prologue's
    per-row ``div_rn`` (a branchy slow path) and its fp32 Q tile go away, and with them the spills
    at 168 registers (SASS: STACK 480 -> 216 bytes, 0 spill instructions in the KV loops).
    int8 ``q_pre``: 2.206 vs 2.201 ms (3 stages, no gain), 2.424 at 168 registers / 2 stages: off.
    """
    if interpret_mode():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "q_pre": mode == "fp8",
                "q_tma": False}
    if head_dim > 128:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    if head_dim < 128:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    if mode == "int8-qk":  # 16-bit V tiles: two stages keep two CTAs per SM
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "tma": True}
    if mode == "fp8":  # three CTAs per SM: 2 stages (74 KB smem) and <= 168 registers; Q pre-pass
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "tma": True, "maxnreg": 168,
                "q_pre": True, "q_tma": False, "vperm": VPERM_FP8, "gluon": GLUON_FP8}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "tma": True,
            "vperm": VPERM_INT8 and mode == "int8"}


# ----------------------------------------------------------------------------------------- helpers
@triton.jit
def _to_fp8(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # Triton 3.6's interpreter mis-rounds fp32->fp8 across binades
        x = round_to_fp8_e4m3(x)
    return x.to(tl.float8e4nv)


# 2^f on [-0.5, 0.5], p(0) = 1, max relative error 1.2e-4 (Lawson-weighted least squares, fitted
# for this kernel): 1 + f (C1 + f (C2 + f C3))
EXP2_C1, EXP2_C2, EXP2_C3 = 0.6931994933193167, 0.24221115742352844, 0.05541792368569535


def _poly_ptx(dst: str, src: str) -> str:
    """PTX of ``_exp2_poly`` for one element (``dst`` = 2^``src``)."""
    def f32(v):
        import struct
        return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]
    return (f"max.f32 x, {src}, 0fC2FC0000; add.rn.f32 r, x, 0f4B400000; sub.rn.f32 j, r, 0f4B400000; "
            f"sub.rn.f32 f, x, j; fma.rn.f32 p, f, {f32(EXP2_C3)}, {f32(EXP2_C2)}; fma.rn.f32 p, p, f, {f32(EXP2_C1)}; "
            f"fma.rn.f32 p, p, f, 0f3F800000; mov.b32 rb, r; mov.b32 pb, p; shl.b32 rb, rb, 23; "
            f"add.s32 pb, pb, rb; mov.b32 {dst}, pb;")


def _exp2_asm(n_poly: int) -> str:
    body = ["{", ".reg .f32 x, r, j, f, p;", ".reg .b32 rb, pb;"]
    for i in range(4):  # the last n_poly of each 4 elements on the FMA pipe
        if i >= 4 - n_poly:
            body.append(_poly_ptx(f"${i}", f"${i + 4}"))
        else:
            body.append(f"ex2.approx.ftz.f32 ${i}, ${i + 4};")
    body.append("}")
    return "\n".join(body)


_EXP2_ASM1 = tl.constexpr(_exp2_asm(1))
_EXP2_ASM2 = tl.constexpr(_exp2_asm(2))
_EXP2_ASM3 = tl.constexpr(_exp2_asm(3))
_PC1 = tl.constexpr(EXP2_C1)
_PC2 = tl.constexpr(EXP2_C2)
_PC3 = tl.constexpr(EXP2_C3)


@triton.jit
def _exp2_poly(x):
    """2^x on the FMA pipe (FlashAttention-4's exp2 emulation; Cody-Waite split x = j + f with
    j = round(x) by the 1.5*2^23 magic add, |f| <= 1/2, degree-3 polynomial, j added into the
    exponent bits). x is clamped at -126 (2^-126 ~ 0 for every P code; -inf -> ~0)."""
    x = tl.maximum(x, -126.0)
    r = x + 12582912.0
    f = x - (r - 12582912.0)
    p = 1.0 + f * (_PC1 + f * (_PC2 + f * _PC3))
    return (p.to(tl.int32, bitcast=True) + (r.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _exp2(x, POLY: tl.constexpr, INTERPRET: tl.constexpr):
    """exp2 of the softmax numerator. ``POLY`` = n (1..3): n of every 4 elements of a thread use
    ``_exp2_poly`` on the FMA pipe, the others MUFU.EX2 (16 per clock per SM on sm_90, about the
    SM's FP8 MMA time per score at D = 128). The interpreter runs the polynomial on every element
    (same math; tests check it against exp2)."""
    if POLY == 0:
        return tl.math.exp2(x)
    elif INTERPRET:
        return _exp2_poly(x)
    elif POLY == 1:
        return tl.inline_asm_elementwise(_EXP2_ASM1, "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.float32, is_pure=True, pack=4)
    elif POLY == 2:
        return tl.inline_asm_elementwise(_EXP2_ASM2, "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.float32, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(_EXP2_ASM3, "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _vperm_p(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``VPERM``: P's keys in the order of a V^T stored with ``vperm_pos`` (within each 32-key chunk
    key bits h|j1|q|j0 at position h|q|j1|j0). On sm_90 this is the register order of the wgmma
    accumulator read as the 8-bit A operand, so the P -> A conversion needs no shuffles (SASS: 563 ->
    513 instructions per block for fp8, 1002 -> 921 for int8)."""
    return tl.reshape(tl.permute(tl.reshape(p, [BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2]), (0, 1, 2, 4, 3, 5)),
                      [BLOCK_M, BLOCK_N])


@triton.jit
def _first(x):
    """Element [0, 0] of a [1, 4] tile: a scale read by TMA (boxes are >= 16 bytes; the other
    three slots are padding, possibly uninitialized: selected away, never multiplied)."""
    return tl.sum(tl.sum(tl.where(tl.arange(0, x.shape[1])[None, :] == 0, x, 0.0), 1), 0)


@triton.jit
def _int4_to_fp8(packed, ROWS: tl.constexpr, COLS: tl.constexpr, INTERPRET: tl.constexpr):
    """uint8 [ROWS, COLS/2] (element 2i in the low nibble of byte i, two's complement) -> FP8 E4M3
    [ROWS, COLS] (INT4 values are exact in E4M3).

    On the GPU, 8 codes per 32-bit word go through the fp16 magic-number trick: a nibble n placed
    in the mantissa of 1024.0 (``0x6400 | (n ^ 8)``) minus 1032.0 is n as an fp16, and one
    ``cvt.rn.satfinite.e4m3x2.f16x2`` packs two of them; ~2 integer/half ops per code instead of
    a sign extension plus an I2F (quarter rate) per code.
    """
    if INTERPRET:
        lo = (packed & 0xF).to(tl.int8)
        hi = ((packed >> 4) & 0xF).to(tl.int8)
        lo = (lo - ((lo & 8) << 1)).to(tl.float16).to(tl.float8e4nv)
        hi = (hi - ((hi & 8) << 1)).to(tl.float16).to(tl.float8e4nv)
    else:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 a0, a1, a2, a3, c, q0, q1;
            .reg .b16 h0, h1, h2, h3;
            mov.b32 c, 0x64086408;
            and.b32 a0, $2, 0x000F000F;
            shr.u32 a1, $2, 8;
            and.b32 a1, a1, 0x000F000F;
            shr.u32 a2, $2, 4;
            and.b32 a2, a2, 0x000F000F;
            shr.u32 a3, $2, 12;
            and.b32 a3, a3, 0x000F000F;
            xor.b32 a0, a0, c;
            xor.b32 a1, a1, c;
            xor.b32 a2, a2, c;
            xor.b32 a3, a3, c;
            sub.f16x2 a0, a0, c;
            sub.f16x2 a1, a1, c;
            sub.f16x2 a2, a2, c;
            sub.f16x2 a3, a3, c;
            cvt.rn.satfinite.e4m3x2.f16x2 h0, a0;
            cvt.rn.satfinite.e4m3x2.f16x2 h1, a1;
            cvt.rn.satfinite.e4m3x2.f16x2 h2, a2;
            cvt.rn.satfinite.e4m3x2.f16x2 h3, a3;
            mov.b32 q0, {h0, h1};
            mov.b32 q1, {h2, h3};
            prmt.b32 $0, q0, q0, 0x3120;
            prmt.b32 $1, q1, q1, 0x3120;
            }""",
            constraints="=r,=r,r",
            args=[packed],
            dtype=(tl.float8e4nv, tl.float8e4nv),
            is_pure=True,
            pack=4,
        )
    x = tl.reshape(tl.join(lo, hi), [ROWS, COLS])
    if not INTERPRET:  # opaque copy: keeps Triton from folding the reshape into the MMA's shared layout
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float8e4nv, is_pure=True, pack=4)
    return x


@triton.jit
def _attn_blocks(acc, l_i, m_i, c_acc, q, qs, m0, lo, hi,  #
                 Kb, KSb, Vb, VSb,  #
                 Skv, causal_off, krow, vrow, ksrow, vsrow,  #
                 stride_kn, stride_ksn, stride_vr, stride_vsn,  #
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_BLOCK: tl.constexpr,  #
                 MODE: tl.constexpr, KV4: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,  #
                 K_PER_BLOCK: tl.constexpr, V_CHANNEL: tl.constexpr, EXP16: tl.constexpr,  #
                 P_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr, INTERPRET: tl.constexpr,
                 POLY: tl.constexpr = 0, VPERM: tl.constexpr = 0, NAN_SAFE: tl.constexpr = False):
    """KV blocks [lo, hi) of one query block; ``MASK`` adds the tail / causal masks. ``WS``:
    Triton's automatic warp specialization of the loop (every load is a TMA descriptor load then,
    the per-block K / V scales included: ``ksrow`` / ``vsrow`` index their 1-D descriptors).
    ``NAN_SAFE`` (INT8): a NaN K scale in the block (a non-finite key) is added to l as ``0 * scale``, because the
    integer P codes and row sums would drop the NaN its scores carry; every row that reads the block turns NaN."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_h = tl.arange(0, HEAD_DIM // 2)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nmask = offs_n < Skv
        # ---- S = Q K^T (block), in log2 units after the two scales
        if USE_TMA:  # 2-D descriptors over [B * H * S, D]: rows past Skv belong to the next head or
            # are zero-filled; their scores are masked to -inf below and their P is 0
            if KV4:
                k = _int4_to_fp8(Kb.load([krow + start_n, 0]), BLOCK_N, HEAD_DIM, INTERPRET)
            else:
                k = Kb.load([krow + start_n, 0])
        elif KV4:
            kp_ptr = Kb + offs_n[:, None] * stride_kn + offs_h[None, :]
            if MASK:
                kp = tl.load(kp_ptr, mask=nmask[:, None], other=0.0)
            else:
                kp = tl.load(kp_ptr)
            k = _int4_to_fp8(kp, BLOCK_N, HEAD_DIM, INTERPRET)
        else:
            k_ptr = Kb + offs_n[:, None] * stride_kn + offs_d[None, :]
            if MASK:
                k = tl.load(k_ptr, mask=nmask[:, None], other=0.0)
            else:
                k = tl.load(k_ptr)
        d = tl.dot(q, tl.trans(k))
        # score (log2 units) = (t - c) * qsb. INT8: the INT32 dot becomes the fp32 bit pattern of
        # 1.5*2^23 + d (exact for |d| < 2^22) with one integer add, no I2F (quarter rate); the
        # 1.5*2^23 offset c then folds into the exp2 argument (per-block K scale) or into one FFMA
        # per score with the per-key K scale.
        c = 0.0
        if MODE != 0:
            d = (d + 0x4B400000).to(tl.float32, bitcast=True)
        if K_PER_BLOCK:  # one K scale per block of BLOCK_N keys: folded into the per-row scale
            if WS:
                qsb = qs * _first(KSb.load([ksrow + start_n // BLOCK_N, 0]))
            else:
                qsb = qs * tl.load(KSb + (start_n // BLOCK_N) * stride_ksn)
            t = d
            if MODE != 0:
                c = 12582912.0
        else:
            if WS:  # [1, BLOCK_N] box of the [B * Hkv, S_al] scale rows (past Skv: masked below)
                ks = tl.reshape(KSb.load([ksrow, start_n]), [BLOCK_N])
            elif MASK:
                ks = tl.load(KSb + offs_n, mask=nmask, other=0.0).to(tl.float32)
            else:
                ks = tl.load(KSb + offs_n).to(tl.float32)
            qsb = qs
            if MODE != 0:
                t = d * ks[None, :] - (12582912.0 * ks)[None, :]
            else:
                t = d * ks[None, :]
        if MASK:
            valid = nmask[None, :]
            if CAUSAL:
                offs_m = m0 + tl.arange(0, BLOCK_M)
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
            t = tl.where(valid, t, float("-inf"))
        mb = (tl.max(t, 1) - c) * qsb  # this block's row max (log2 units)
        m_new = tl.maximum(m_i, mb)
        if MASK:  # a row with no visible key yet keeps m = -inf; subtract 0 instead (no inf - inf)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = tl.math.exp2(m_i - m_use)
        if MODE == 1:
            if P_BLOCK:  # P against this block's max: 127 * exp(S - m_block)
                mb_use = tl.where(mb == float("-inf"), m_use, mb)
                beta = tl.math.exp2(mb_use - m_use)  # <= 1, rescales the block's P V and row sum
                s0 = mb_use
            else:
                s0 = m_use
            # log2(127): P = 127 * exp(S - m) in [0, 127], less a rounding margin of (|m| + c q_s)
            # 2^-21 (the max's exp2 argument is one FFMA while m was rounded; the margin bounds
            # that error, so no score can round to 128 and wrap: no clamp per score). The margin is
            # < 2^-11 for |S| < 1024 and cancels in O = acc / l (l sums the same P)
            sub = (s0 - 6.988684686772166) + (tl.abs(s0) + c * qsb) * 4.76837158203125e-07
        elif MODE == 0:
            sub = m_use - 8.0  # P = 256 * exp(S - m) in [0, 256]
        else:
            sub = m_use
        if EXP16:  # FireQ-style half-precision softmax numerator: ex2.approx.f16x2, two per op
            x16 = (t * qsb[:, None] - (c * qsb + sub)[:, None]).to(tl.float16)
            if INTERPRET:  # the fp16 value carried in fp32 (the interpreter's FP8 rounding needs fp32)
                p16 = tl.math.exp2(x16.to(tl.float32)).to(tl.float16).to(tl.float32)
            else:
                p16 = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x16], dtype=tl.float16,
                                                is_pure=True, pack=2)
            p = p16
        else:
            p = _exp2(t * qsb[:, None] - (c * qsb + sub)[:, None], POLY, INTERPRET)
        if MODE == 1:
            # round to nearest even integer in [0, 127]: the low byte of (p + 1.5 * 2^23)'s bits is
            # the INT8 code (no F2I), and subtracting 1.5 * 2^23 again gives it as a float for l
            pm = p + 12582912.0
            p8 = pm.to(tl.int32, bitcast=True).to(tl.int8)
            if VPERM:
                p8 = _vperm_p(p8, BLOCK_M, BLOCK_N)
        # row sums l. int8: the tensor cores add the quantized P exactly (P . ones, a 16-wide INT8
        # MMA beside the P V one), which frees two ALU ops per score (the float copy of the
        # rounded P and its add); for fp8 the same trick measured slower (extra register moves)
        if MODE == 1:
            rs = tl.max(tl.dot(p8, tl.full([BLOCK_N, 16], 1, tl.int8)), 1).to(tl.float32)
            if P_BLOCK:
                rs = rs * beta
            l_i = l_i * alpha + rs
            if NAN_SAFE:  # 0, or NaN for a non-finite key in the block (docstring)
                if K_PER_BLOCK:
                    l_i = l_i + qsb * 0.0
                else:
                    l_i = l_i + tl.sum(ks * 0.0, 0)
        elif EXP16:
            l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        # ---- O += P V (block)
        if MODE == 2:
            if USE_TMA:
                v = Vb.load([vrow + start_n, 0])
            else:
                v_ptr = Vb + offs_n[:, None] * stride_vr + offs_d[None, :]
                if MASK:
                    v = tl.load(v_ptr, mask=nmask[:, None], other=0.0)
                else:
                    v = tl.load(v_ptr)
            acc = acc * alpha[:, None]
            if INTERPRET:  # Triton 3.6's interpreter multiplies bf16 bit patterns: go through fp32
                acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
        elif KV4:
            if USE_TMA:
                vp = Vb.load([vrow + start_n, 0])
            else:
                vp_ptr = Vb + offs_n[:, None] * stride_vr + offs_h[None, :]
                if MASK:
                    vp = tl.load(vp_ptr, mask=nmask[:, None], other=0.0)
                else:
                    vp = tl.load(vp_ptr)
            if MASK:
                sv = tl.load(VSb + offs_n, mask=nmask, other=0.0).to(tl.float32)
            else:
                sv = tl.load(VSb + offs_n).to(tl.float32)
            v = _int4_to_fp8(vp, BLOCK_N, HEAD_DIM, INTERPRET)
            svmax = tl.maximum(tl.max(sv, 0), 1e-30)
            r = sv * (1.0 / svmax)
            pv = tl.dot(_to_fp8(p * r[None, :], INTERPRET), v)
            # scaled accumulator: acc holds O / c_acc, c_acc = the last block's scale, so one FFMA
            # per element updates it (the per-row factor carries alpha and the scale change)
            acc = acc * (alpha * (c_acc / svmax))[:, None] + pv
            c_acc = svmax
        else:
            if USE_TMA:  # V^T rows are (head, channel); columns past S_al are zero-filled
                vt = Vb.load([vrow, start_n])
            else:
                vt_ptr = Vb + offs_d[:, None] * stride_vr + offs_n[None, :]
                if MASK and VPERM:  # position c holds key (c & ~15) | j1 << 3 | q << 1 | j0
                    vkey = ((offs_n & -16) | (((offs_n >> 1) & 1) << 3) | (((offs_n >> 2) & 3) << 1)
                            | (offs_n & 1))
                    vt = tl.load(vt_ptr, mask=(vkey < Skv)[None, :], other=0.0)
                elif MASK:
                    vt = tl.load(vt_ptr, mask=nmask[None, :], other=0.0)
                else:
                    vt = tl.load(vt_ptr)
            if MODE == 1:
                pv = tl.dot(p8, tl.trans(vt))
                pv = (pv + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
                if P_BLOCK:
                    pv = pv * beta[:, None]
            else:
                if VPERM:
                    pv = tl.dot(_vperm_p(_to_fp8(p, INTERPRET), BLOCK_M, BLOCK_N), tl.trans(vt))
                else:
                    pv = tl.dot(_to_fp8(p, INTERPRET), tl.trans(vt))
            if V_CHANNEL:  # per-channel scales of this block: acc * alpha + pv * s_v
                if WS:
                    vs = tl.reshape(VSb.load([vsrow + start_n // V_BLOCK, 0]), [HEAD_DIM])
                else:
                    vs = tl.load(VSb + (start_n // V_BLOCK) * stride_vsn + offs_d)
                acc = acc * alpha[:, None] + pv * vs[None, :]
            else:  # one scale per block: scaled accumulator as above
                if WS:
                    vsb = _first(VSb.load([vsrow + start_n // V_BLOCK, 0]))
                else:
                    vsb = tl.load(VSb + (start_n // V_BLOCK) * stride_vsn)
                acc = acc * (alpha * (c_acc / vsb))[:, None] + pv
                c_acc = vsb
        m_i = m_new
    return acc, l_i, m_i, c_acc


@triton.jit
def _fused_kv_prologue(r, b, hk, bhk, Kin, Vin, KC, KS, VT, VS, CNT, Skv, n_kq, n_vq, n_prod, amax_eps,
                       stride_kib, stride_kih, stride_kin, stride_vib, stride_vih, stride_vin, S_al,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, V_BLOCK: tl.constexpr, MODE: tl.constexpr,
                       V_CHANNEL: tl.constexpr, V_GIVEN: tl.constexpr, K_PER_BLOCK: tl.constexpr,
                       USE_TMA: tl.constexpr, INTERPRET: tl.constexpr, KV_CHUNK: tl.constexpr,
                       NAN_SAFE: tl.constexpr = False):
    """K/V quantization fused into the attention launch (no separate pass, no launch gap; the
    memory-bound quantization of one head overlaps the attention of the heads already running).

    The first ``n_prod`` programs of each KV head group (``r`` = their rank, in launch order)
    quantize the head's ``n_kq`` K blocks and ``n_vq`` V blocks (task t goes to rank t mod n_prod)
    with exactly the code of ``lowbit.kernels.attention_quant._kv_quant_kernel``, then add their
    task count to the head's counter (release). Every program of the group waits until the
    counter reaches ``n_kq + n_vq`` (acquire) before its first K/V load. Waiting programs only
    wait on programs launched before them or on the other producers, and ``n_prod`` <= 32 is
    far below the number of co-resident programs, so the in-order block dispatch of the GPU
    cannot deadlock. The interpreter runs programs one by one with axis 0 outermost: the
    launcher passes ``n_prod`` = 1 there, so program (0, first head of the group) quantizes all
    blocks before any program of the group waits."""
    if r < n_prod:
        n_tasks = n_kq + n_vq
        for task in range(r, n_tasks, n_prod):
            _kv_quant_task(task, b, hk, bhk, Kin, Vin, KC, KS, VT, VS, Skv, n_kq, amax_eps,
                           stride_kib, stride_kih, stride_kin, stride_vib, stride_vih, stride_vin,
                           S_al, S_al, n_vq,
                           HEAD_DIM, BLOCK_N, V_BLOCK, 448.0 if MODE == 0 else 127.0, MODE != 0, MODE != 2,
                           V_CHANNEL, V_GIVEN, K_PER_BLOCK, INTERPRET, KV_CHUNK, Skv, Skv, NAN_SAFE=NAN_SAFE)
        tl.debug_barrier()  # every thread's stores precede the release below
        tl.atomic_add(CNT + bhk, (n_tasks - r + n_prod - 1) // n_prod, sem="release", scope="gpu")
    done = tl.atomic_add(CNT + bhk, 0, sem="acquire", scope="gpu")
    spins = 0
    while (done < n_kq + n_vq) & (spins < 4194304):  # bounded: a scheduling bug shows as wrong output, not a hang
        done = tl.atomic_add(CNT + bhk, 0, sem="acquire", scope="gpu")
        spins += 1
    tl.debug_barrier()
    if USE_TMA and not INTERPRET:  # codes written through the generic proxy, read by TMA (async proxy)
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [done], dtype=tl.int32,
                                  is_pure=False, pack=1)


# ----------------------------------------------------------------------------------------- kernel
@triton.jit
def _attn_fwd(
    Q, QS, K, KS, V, VS, Out,  # pointers (Q_PRE: Q codes and QS their scales; TMA: descriptors)
    Kin, Vin, KC, VT, CNT,  # FUSE_KV: 16-bit K/V inputs, code buffers behind K/V, per-head counters
    qk_scale, amax_eps, Sq, Skv, causal_off, Hq, n_rep, n_mblk,  # sizes / scalars
    n_kq, n_vq, n_prod, S_al,  # FUSE_KV: K / V quantization tasks per head, producers per head
    stride_qb, stride_qh, stride_qm,  #
    stride_kb, stride_kh, stride_kn,  #
    stride_ksb, stride_ksh, stride_ksn,  #
    stride_vb, stride_vh, stride_vr,  #
    stride_vsb, stride_vsh, stride_vsn,  #
    stride_ob, stride_oh, stride_om,  #
    stride_kib, stride_kih, stride_kin, stride_vib, stride_vih, stride_vin,  # FUSE_KV inputs
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_BLOCK: tl.constexpr,  #
    MODE: tl.constexpr, KV4: tl.constexpr, CAUSAL: tl.constexpr, K_PER_BLOCK: tl.constexpr,  #
    V_CHANNEL: tl.constexpr, EXP16: tl.constexpr, P_BLOCK: tl.constexpr, USE_TMA: tl.constexpr,  #
    FUSE_KV: tl.constexpr, V_GIVEN: tl.constexpr, KV_CHUNK: tl.constexpr, Q_PRE: tl.constexpr,  #
    Q_TMA: tl.constexpr, WS: tl.constexpr, INTERPRET: tl.constexpr, POLY: tl.constexpr = 0,  #
    VPERM: tl.constexpr = 0, NAN_SAFE: tl.constexpr = False,  #
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hk = hq // n_rep
    if FUSE_KV:  # K/V quantization inside this launch (see _fused_kv_prologue)
        _fused_kv_prologue((hq % n_rep) * n_mblk + pid_m, b, hk, b * (Hq // n_rep) + hk,
                           Kin, Vin, KC, KS, VT, VS, CNT, Skv, n_kq, n_vq, n_prod, amax_eps,
                           stride_kib, stride_kih, stride_kin, stride_vib, stride_vih, stride_vin, S_al,
                           HEAD_DIM, BLOCK_N, V_BLOCK, MODE, V_CHANNEL, V_GIVEN, K_PER_BLOCK, USE_TMA, INTERPRET,
                           KV_CHUNK, NAN_SAFE)
    if CAUSAL:  # longest query blocks first
        pid_m = n_mblk - 1 - pid_m
    b64, hq64, hk64 = b.to(tl.int64), hq.to(tl.int64), hk.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mmask = offs_m < Sq

    if Q_PRE:  # ---- Q codes and per-token scales from the quantization pass (same codes)
        # codes [B, Hq, Sq_al, D] and scales [B, Hq, Sq_al] (Sq_al = stride_qh / D: rows padded to
        # 4 for 16-byte aligned scale boxes)
        qrow = (b64 * stride_qb + hq64 * stride_qh) // HEAD_DIM
        if Q_TMA:  # 2-D codes / 1-D scales; rows past Sq (the padding, the next head's or
            # zero-filled) only feed rows that are never stored
            q = Q.load([(qrow + m0).to(tl.int32), 0])
            q_scale = QS.load([(qrow + m0).to(tl.int32)])
        else:
            q = tl.load(Q + qrow * HEAD_DIM + offs_m[:, None].to(tl.int64) * stride_qm
                        + offs_d[None, :], mask=mmask[:, None], other=0.0)
            # rows past Sq (never stored): scale 1, so their masked scores stay -inf instead of -inf * 0 = NaN
            q_scale = tl.load(QS + qrow + offs_m, mask=mmask, other=1.0)
    else:  # ---- Q tile: read once, quantized per token in registers
        x = tl.load(Q + b64 * stride_qb + hq64 * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm
                    + offs_d[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
        QMAXV: tl.constexpr = 448.0 if MODE == 0 else 127.0
        q_amax = _eps_floor(tl.max(_abs_operand(x, NAN_SAFE), 1), amax_eps, NAN_SAFE)
        q_scale = tl.div_rn(q_amax, QMAXV)  # IEEE, as the reference (session 36)
        y = x * tl.div_rn(q_scale * 0.0 + 1.0, q_scale)[:, None]  # reciprocal once per row (as the reference)
        if MODE == 0:  # no clamp: the saturating convert keeps a NaN (attention_quant._quant_tile)
            q = _to_fp8(y, INTERPRET)
        else:
            y = tl.minimum(tl.maximum(y, -QMAXV), QMAXV)
            q = ((y + 12582912.0) - 12582912.0).to(tl.int8)
    qs = q_scale * qk_scale  # sm_scale * log2(e) folded in

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    if NAN_SAFE:  # zeros, or NaN for a non-finite query row (INT8 P's integer codes would drop its NaN)
        l_i = q_scale * 0.0
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # WS: rows of the 2-D scale descriptors: per-block scales [rows, 4] (scale_pad 4), per-token K
    # scales [B * Hkv, S_al], per-channel V scales [B * Hkv * NB, D]
    if K_PER_BLOCK:
        ksrow = (b * stride_ksb + hk * stride_ksh) // 4
    else:
        ksrow = b * (Hq // n_rep) + hk
    if V_CHANNEL:
        vsrow = (b * stride_vsb + hk * stride_vsh) // HEAD_DIM
    else:
        vsrow = (b * stride_vsb + hk * stride_vsh) // 4
    if WS:
        KSb = KS
        VSb = VS
    else:
        KSb = KS + b64 * stride_ksb + hk64 * stride_ksh
        VSb = VS + b64 * stride_vsb + hk64 * stride_vsh
    bhk = b * (Hq // n_rep) + hk
    krow = bhk * Skv  # first row of this head in the 2-D [B * Hkv * Skv, D] descriptors
    if USE_TMA:
        Kb = K
        Vb = V
        if MODE == 2 or KV4:
            vrow = krow
        else:
            vrow = bhk * HEAD_DIM  # V^T: [B * Hkv * D, S_al]
    else:
        Kb = K + b64 * stride_kb + hk64 * stride_kh
        Vb = V + b64 * stride_vb + hk64 * stride_vh
        vrow = krow
    if CAUSAL:
        hi = tl.minimum(Skv, m0 + BLOCK_M + causal_off)
        n_full = tl.minimum(((m0 + causal_off + 1) // BLOCK_N) * BLOCK_N, (Skv // BLOCK_N) * BLOCK_N)
    else:
        hi = Skv
        n_full = (Skv // BLOCK_N) * BLOCK_N
    c_acc = 1.0
    acc, l_i, m_i, c_acc = _attn_blocks(acc, l_i, m_i, c_acc, q, qs, m0, 0, n_full,  #
                                 Kb, KSb, Vb, VSb, Skv, causal_off, krow, vrow, ksrow, vsrow,  #
                                 stride_kn, stride_ksn, stride_vr, stride_vsn,  #
                                 HEAD_DIM, BLOCK_M, BLOCK_N, V_BLOCK, MODE, KV4, CAUSAL, False, K_PER_BLOCK, V_CHANNEL,
                                 EXP16, P_BLOCK, USE_TMA, WS, INTERPRET, POLY, VPERM, NAN_SAFE)
    acc, l_i, m_i, c_acc = _attn_blocks(acc, l_i, m_i, c_acc, q, qs, m0, n_full, hi,  #
                                 Kb, KSb, Vb, VSb, Skv, causal_off, krow, vrow, ksrow, vsrow,  #
                                 stride_kn, stride_ksn, stride_vr, stride_vsn,  #
                                 HEAD_DIM, BLOCK_M, BLOCK_N, V_BLOCK, MODE, KV4, CAUSAL, True, K_PER_BLOCK, V_CHANNEL,
                                 EXP16, P_BLOCK, USE_TMA, WS, INTERPRET, POLY, VPERM, NAN_SAFE)
    if NAN_SAFE:  # a NaN l (a non-finite input) stays NaN
        den = tl.maximum(l_i, 1e-30, propagate_nan=tl.PropagateNan.ALL)
    else:
        den = tl.maximum(l_i, 1e-30)
    out = acc * (c_acc / den)[:, None]  # l > 0 unless scores are absurd (> 2^17)
    tl.store(Out + b64 * stride_ob + hq64 * stride_oh + offs_m[:, None].to(tl.int64) * stride_om
             + offs_d[None, :], out.to(Out.dtype.element_ty), mask=mmask[:, None])


# ----------------------------------------------------------------------------------------- launcher
def _tma_ok(k, v, mode) -> bool:
    """TMA descriptors need a TMA-capable device (``lowbit._utils.tma_capable``) and contiguous operands with
    16-byte rows (our quantized K/V always are; a strided KV4 cache view falls back to pointer loads)."""
    if not tma_capable(k):
        return False
    return all(t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (k, v))



def attention_prefill_triton(q: torch.Tensor, k, ks, v, vs, *, mode: str, causal: bool, sm_scale: float,
                             v_block: int = 128, k_block: int | None = None,
                             p_block: bool = False,
                             config: dict | None = None,
                             out: torch.Tensor | None = None, fuse_from: dict | None = None,
                             q_codes: tuple | None = None) -> torch.Tensor:
    """Launch the kernel on pre-quantized K/V (layouts in the module docstring); Q is quantized
    inside, or given as ``q_codes = (qc [B, Hq, Sq, D], qs [B, Hq, Sq] fp32)`` (from
    ``quantize_kv_triton(q=...)``; ``q`` then only gives the output dtype and shape).
    ``config`` overrides ``default_config`` (BLOCK_M, BLOCK_N, num_warps, num_stages, ``tma``,
    ``ws``: warp-specialized loop, needs ``q_codes``, TMA and the fp8 per-block K / V scales).
    ``fuse_from`` (internal, see ``quant_attention_triton``): ``k, ks, v, vs`` are empty code
    buffers that this launch fills from ``fuse_from['k']`` / ``['v']`` (16-bit) before using them.
    Returns O ``[B, Hq, Sq, D]`` in q's dtype (or written into ``out``)."""
    if mode not in MODE_IDS:
        raise ValueError(f"mode must be one of {sorted(MODE_IDS)}, got {mode!r}")
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    if D not in (64, 128, 256) and not interpret_mode():
        raise ValueError(f"head_dim must be 64, 128 or 256 for the Triton kernel, got {D}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    cfg = dict(default_config(mode, D, causal, Sq))
    if config:
        cfg.update(config)
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    kv4 = mode == "fp8-kv4"
    exp16 = bool(cfg.get("exp16", False))
    if mode in ("fp8", "int8") and v_block % BN:
        raise ValueError(f"BLOCK_N ({BN}) must divide v_block ({v_block})")
    if p_block and mode != "int8":
        raise ValueError("p_block (INT8 P against the block max) applies to mode 'int8' only")
    if exp16 and not mode.startswith("fp8"):
        raise ValueError("exp16 (FP16 softmax numerator) applies to the fp8 modes only")
    if k_block is not None and k_block != BN:
        raise ValueError(f"per-block K scales need k_block == BLOCK_N, got {k_block} and {BN}")
    if out is None:
        out = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    if B * Hq * Sq == 0:
        return out
    # V^T written in the VPERM key order (fp8 / int8, see _vperm_p): a property of the caller's data,
    # so only an explicit ``config['vperm']`` (quant_attention_triton passes it), never the defaults
    vperm = bool((config or {}).get("vperm", False))
    if vperm and (mode not in ("fp8", "int8") or v.shape[-1] % 32):
        raise ValueError("config 'vperm' needs mode 'fp8' or 'int8' and V^T rows padded to a multiple of 32 keys")
    if cfg.get("gluon") and mode == "fp8" and not interpret_mode() and not p_block and not exp16:
        from lowbit.kernels.attention_prefill_gluon import fp8_attention_gluon, gluon_fp8_ok

        if gluon_fp8_ok(q_codes, k, ks, v, vs, k_block, v_block):  # else: the tl kernel below
            return fp8_attention_gluon(q_codes, k, ks, v, vs, causal=bool(causal), qk_scale=sm_scale * LOG2E, out=out,
                                       vperm=vperm)
    n_mblk = cdiv(Sq, BM)
    if mode == "int8-qk":
        vsp, svs = ks, (0, 0, 0)  # unused
        sv_r = v.stride(2)
    elif kv4:
        vsp, svs = vs, (vs.stride(0), vs.stride(1), 0)
        sv_r = v.stride(2)
    else:
        vsp, svs = vs, (vs.stride(0), vs.stride(1), vs.stride(2))
        sv_r = v.stride(2)  # V^T [B, H, D, S_al]: row (channel) stride
    use_tma = bool(cfg.get("tma", False)) and _tma_ok(k, v, mode)
    ws = bool(cfg.get("ws", False)) and not interpret_mode()  # the interpreter has no warp partitions
    if ws:
        k_ok = (ks.stride(2) == 4) if k_block is not None else (ks.stride(2) == 1 and ks.stride(1) % 4 == 0
                                                                 and ks.stride(0) == Hkv * ks.stride(1))
        v_ok = vs is not None and ((vs.ndim == 3 and vs.stride(2) == 4) or (vs.ndim == 4 and vs.is_contiguous()))
        if not (use_tma and q_codes is not None and mode in ("fp8", "int8") and k_ok and v_ok and not p_block):
            raise ValueError("config 'ws' needs TMA, q_codes, mode 'fp8' or 'int8' and scale rows padded to 16 bytes "
                             "(quantize_kv_triton(q=..., scale_pad=4))")
    kk, vv = k, v
    qq, qsp = q, q
    if q_codes is not None:
        qq, qsp = q_codes
        sq_al = qsp.stride(1)
        if (tuple(qq.shape) != (B, Hq, Sq, D) or tuple(qsp.shape) != (B, Hq, Sq) or sq_al % 4 or sq_al < Sq
                or qq.stride() != (Hq * sq_al * D, sq_al * D, D, 1) or qsp.stride() != (Hq * sq_al, sq_al, 1)):
            raise ValueError("q_codes must be (codes [B, Hq, Sq, D], scales [B, Hq, Sq]) as quantize_kv_triton(q=...) "
                             "returns them (rows padded to a multiple of 4)")
    q_tma = use_tma and q_codes is not None and bool(cfg.get("q_tma", True))
    if ws and not q_tma:
        raise ValueError("config 'ws' needs the Q codes through TMA (q_tma)")
    ksp = ks
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kw = k.shape[-1]
        kk = TensorDescriptor(k, [B * Hkv * Skv, kw], [kw, 1], [BN, kw])
        if mode == "int8-qk" or kv4:
            vw = v.shape[-1]
            vv = TensorDescriptor(v, [B * Hkv * Skv, vw], [vw, 1], [BN, vw])
        else:  # V^T [B, Hkv, D, S_al]
            s_al = v.shape[-1]
            vv = TensorDescriptor(v, [B * Hkv * D, s_al], [s_al, 1], [D, BN])
        if q_tma:
            qq = TensorDescriptor(qq, [B * Hq * sq_al, D], [D, 1], [BM, D])
            qsp = TensorDescriptor(qsp, [B * Hq * sq_al], [1], [BM])
        if ws:  # scales through TMA: per-block ones as [1, 4] (16-byte) boxes of the padded buffers
            # (slot 0 is used), per-token K as [1, BLOCK_N] boxes, per-channel V as [1, D] boxes
            if k_block is not None:
                ksp = TensorDescriptor(ks, [ks.numel(), 4], [4, 1], [1, 4])
            else:
                ksp = TensorDescriptor(ks, [B * Hkv, ks.stride(1)], [ks.stride(1), 1], [1, BN])
            if vs.ndim == 4:
                vsp = TensorDescriptor(vs, [vs.numel() // D, D], [D, 1], [1, D])
            else:
                vsp = TensorDescriptor(vs, [vs.numel(), 4], [4, 1], [1, 4])
    fuse = fuse_from is not None
    if fuse:
        kin, vin = fuse_from["k"], fuse_from["v"]
        n_kq = cdiv(Skv, BN)
        n_vq = cdiv(Skv, v_block) if mode != "int8-qk" else 0
        # producers per KV head group: at most 32 (they must be co-resident, see the prologue);
        # one under the interpreter, which runs the programs one at a time
        n_prod = 1 if interpret_mode() else max(1, min(n_kq + n_vq, n_mblk * (Hq // Hkv), 32))
        cnt = torch.zeros(B * Hkv, dtype=torch.int32, device=q.device)
        vin_ = vin if vin is not None else kin
        fz = (kin, vin_, k, v if mode != "int8-qk" else k, cnt, n_kq, n_vq, n_prod,
              v.shape[-1] if mode != "int8-qk" else Skv,
              kin.stride(0), kin.stride(1), kin.stride(2), vin_.stride(0), vin_.stride(1), vin_.stride(2))
    else:
        fz = (q, q, q, q, q, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    _attn_fwd[(n_mblk, B * Hq)](
        qq, qsp, kk, ksp, vv, vsp, out,
        *fz[:5],
        sm_scale * LOG2E, AMAX_EPS, Sq, Skv, Skv - Sq, Hq, Hq // Hkv, n_mblk,
        *fz[5:9],
        *((q_codes[0].stride(0), q_codes[0].stride(1), q_codes[0].stride(2)) if q_codes is not None else
          (q.stride(0), q.stride(1), q.stride(2))),
        k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        v.stride(0), v.stride(1), sv_r,
        *svs,
        out.stride(0), out.stride(1), out.stride(2),
        *fz[9:],
        HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN, V_BLOCK=v_block,
        MODE=MODE_IDS[mode], KV4=kv4, CAUSAL=bool(causal), K_PER_BLOCK=k_block is not None,
        V_CHANNEL=vs is not None and vs.ndim == 4, EXP16=bool(exp16), P_BLOCK=bool(p_block), USE_TMA=use_tma,
        FUSE_KV=fuse, V_GIVEN=bool(fuse and fuse_from.get("given", False)),
        KV_CHUNK=int(cfg.get("kv_chunk", min(32, BN, v_block))), Q_PRE=q_codes is not None, Q_TMA=q_tma, WS=ws,
        INTERPRET=interpret_mode(), POLY=int(cfg.get("poly", 0)), VPERM=vperm, NAN_SAFE=_aq.NAN_SAFE and mode in ("int8", "int8-qk"),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interpret_mode() and not ws else {}),
    )
    return out


def quant_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mode: str, causal: bool,
                           sm_scale: float, v_granularity: str = "channel", v_block: int = 128,
                           k_per_block: bool = False, p_block: bool = False, fuse_kv: bool = True,
                           config: dict | None = None) -> torch.Tensor:
    """16-bit Q/K/V -> O for ``mode`` in ('fp8', 'int8', 'int8-qk'), quantization included.

    ``fuse_kv`` (default): ONE launch; its first programs per KV head quantize K and V
    (``_fused_kv_prologue``). Otherwise two launches: ``quantize_kv_triton`` then the attention.
    Both write the same codes (one quantization routine, ``_kv_quant_task``). ``k_per_block``:
    one K scale per BLOCK_N keys. Q is quantized inside the attention kernel, or (config
    ``q_pre`` / ``ws``, two-launch path) by the K/V quantization launch: the same codes."""
    from lowbit.kernels.attention_quant import alloc_kv_codes, quantize_kv_triton

    D = q.shape[-1]
    cfg = dict(default_config(mode, D, causal, q.shape[2]))
    if config:
        cfg.update(config)
    bn = cfg["BLOCK_N"]
    kb = bn if k_per_block else None
    dt = FP8_E4M3 if mode == "fp8" else torch.int8
    vq = None if mode == "int8-qk" else v
    if mode == "int8-qk":
        vv = v if v.dtype != torch.float32 else v.to(torch.bfloat16)
        if vv.stride(-1) != 1:
            vv = vv.contiguous()
    if not fuse_kv or v_block % bn:
        q_pre = bool(cfg.get("q_pre", False) or cfg.get("ws", False))
        vperm = bool(cfg.get("vperm", False)) and mode in ("fp8", "int8") and bn % 32 == 0
        res = quantize_kv_triton(k, vq, dtype=dt, v_granularity=v_granularity, v_block=v_block, k_block=kb,
                                 q=q if q_pre else None, scale_pad=4 if cfg.get("ws", False) else 1, vperm=vperm)
        kc, ks, vt, vs = res[:4]
        qcodes = res[4:] if q_pre else None
        if mode == "int8-qk":
            return attention_prefill_triton(q, kc, ks, vv, None, mode=mode, causal=causal, sm_scale=sm_scale,
                                            k_block=kb, config=config, q_codes=qcodes)
        return attention_prefill_triton(q, kc, ks, vt, vs, mode=mode, causal=causal, sm_scale=sm_scale,
                                        v_block=v_block, k_block=kb, p_block=p_block,
                                        config=dict(config or {}, vperm=vperm), q_codes=qcodes)
    k = k if k.stride(-1) == 1 else k.contiguous()
    if vq is not None and vq.stride(-1) != 1:
        vq = vq.contiguous()
    buf = alloc_kv_codes(k, vq, dtype=dt, v_granularity=v_granularity, v_block=v_block, k_block=kb, block_t=bn)
    src = {"k": k, "v": vq, "given": buf["given"]}
    if mode == "int8-qk":
        return attention_prefill_triton(q, buf["kc"], buf["ks"], vv, None, mode=mode, causal=causal,
                                        sm_scale=sm_scale, k_block=kb, config=config, fuse_from=src)
    return attention_prefill_triton(q, buf["kc"], buf["ks"], buf["vt"], buf["vs"], mode=mode, causal=causal,
                                    sm_scale=sm_scale, v_block=v_block, k_block=kb, p_block=p_block,
                                    config=dict(config or {}, vperm=False), fuse_from=src)  # plain V^T here
