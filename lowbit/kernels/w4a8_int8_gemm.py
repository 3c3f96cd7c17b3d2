"""W4A8 INT8 GEMM (QServe §4, QoQ): UINT4 weights dequantized to INT8 in registers, INT8 tensor cores.

Math (format: ``lowbit.formats.w4a8_int8``, which also holds the reference ``gemm_ref``)::

    w8[n, k]  = q4[n, k] * s2[n, g(k)] - zs[n, g(k)]        integer, in [-127, 127] (tested)
    acc[m, n] = sum_k x8[m, k] * w8[n, k]                    INT8 x INT8 -> INT32 (tensor cores)
    y[m, n]   = float32(acc) * sx[m] * s1[n] (+ bias[n])     epilogue, then cast to the output dtype

"Subtraction after multiplication": the zero point enters as the precomputed integer ``zs = z*s2``,
so dequantizing one weight is one multiply and one subtract on integers (no float on the main
loop, unlike per-group float scales that must rescale partial sums every group).
INT32 cannot overflow for K < 2^31 / 127^2 = 133,143.

Layouts:
- x8 ``[M, K]`` int8, any strides; sx ``[M]`` fp32 (per-token scale, ``lowbit.ops.quant``);
  or, with ``FUSE_QUANT``, x ``[M, K]`` fp16/bf16/fp32 and no sx (see below);
- qweight ``[N, Kp/2]`` uint8, chunk-reordered: in each 128-column chunk byte j holds column j (low
  nibble) and column 64 + j (high nibble); Kp >= K is the padded K (a multiple of lcm(group, 128);
  the kernel masks x at k >= K, so padded columns add 0). Row-major, or (``W_TILED``, launch's
  ``tiled``; the modules' default) row-tiled: each 64-row x 64-byte (row tile, chunk) block is 4
  contiguous KB (``lowbit.formats.w4a8_int8.tile_codes``; ``_code_rows`` computes the addresses);
- s1 ``[N]`` fp32; s2, zs ``[N, G]`` uint8 (G = Kp / GROUP_SIZE groups along k);
- out ``[M, N]`` fp16/bf16/fp32.

Tiling: a program computes a BLOCK_M x BLOCK_N tile over a K range (NSPLIT > 1 splits K over a
second grid axis so small M still fills the 132 SMs; the last split of a tile to finish sums the
INT32 partial tiles exactly -- small tiles issue all NSPLIT loads at once, NSPLIT is a constexpr -- and runs
the epilogue, in the same launch: no memset, no cast kernel). BLOCK_K = 128 = one reorder chunk:
the packed tile is loaded as ``[BLOCK_N, 64]`` bytes (16-byte loads), its low nibbles are the
tile's first 64 columns and its high nibbles the last 64, so the x tile is loaded as two
contiguous halves and the product is two ``tl.dot`` of K = 64 (B transposed: k-major, as
Hopper's int8 wgmma wants). ``XTMA`` (pre-quantized x with 16-byte rows on a TMA-capable GPU, ``lowbit._utils.tma_descriptor``; on from the 64-token bucket, off on
the W8 path): those halves are ``[BLOCK_M, 64]`` TMA boxes (``[BLOCK_M, 128]`` on the W8 path), rows >= M and
columns >= K read as 0 (the pointer loads clamp rows >= M to row 0; those rows are never stored: bit-equal). Dequantization on the GPU is the 4-lanes-per-register PTX below
(7 instructions per 8 weights); under the interpreter the same integers one lane at a time.

Group parameters (g128 and any group that is a multiple of 128: one (s2, zs) per row and tile):
by default one byte per row per tile, plain loads (not pipelined: cp.async moves >= 4 bytes, but
the bytes of a row share a sector, so after the first tile they hit L1). ``GS_WORDS`` (s2/zs
contiguous, N * G a multiple of 4) instead passes the flat [N * G] bytes viewed as int32 words;
the kernel loads the aligned 32-bit word holding byte ``n * G + g`` (pipelined like the codes)
and shifts the byte out, for any G. Measured on the H200 (r4): words are 5-25% slower (a third
barrier and 4-byte cp.async per row per stage), so they are off. ``PREFETCH`` loads the next
tile's parameters one step ahead by hand.
Per-channel weights load their one (s2, zs) per row before the loop; groups smaller than 128
(or not dividing it) gather a group index per column.

``FUSE_QUANT`` (small M, decode): x is the float activation and the per-token INT8 quantization
runs inside the GEMM, so a decode linear is one launch. Each program first reads its rows over the
whole K (from L2: the rows are tiny next to the weights) for the absmax, then quantizes each x tile
in registers before the MMA. Numerics identical to ``lowbit.formats.common.quantize_per_token``
(and the ``lowbit.kernels.act_quant`` kernel): ``sx = max(amax, AMAX_EPS) / 127`` and
``q = rne(clamp(x / sx, -127, 127))`` with the IEEE quotient (``_quantize_tile``: a correctly rounded
reciprocal per row and one Markstein FMA step on the GPU, ``tl.div_rn`` in the interpreter); a
NaN/Inf in a row gives that row a NaN scale (NaN output row), like the act-quant kernel.
``ACT = 1`` quantizes ``silu(gate) * up`` instead (the down projection of a gated MLP reading the
gate_up output directly; rounding as ``lowbit.kernels.act_quant``'s ``silu_mul``). When each is the
faster choice is measured, not assumed: see ``use_fused_quant`` below.
``JOIN_K`` joins the two halves into one K = 128 dot (one wgmma wait per tile; not measured yet, off).

``DP4A`` (M = 1, x pre-quantized): no MMA; the dequantized INT8 weights meet x in ``dp4a`` on CUDA
cores, int32 lanes summed per row after the loop (the M = 1 default: ``pick_config``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowbit._utils import arrival_counters, cdiv, interpret_mode, sm_count, stream_scratch, tma_descriptor
from lowbit.formats.common import AMAX_EPS as _AMAX_EPS
from lowbit.kernels.act_quant import pdl_enabled, silu_mul_rounded
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

AMAX_EPS = tl.constexpr(_AMAX_EPS)

# M bucket -> (BLOCK_M, BLOCK_N, SPLIT_K (0 = auto), num_warps, num_stages, programs per SM for
# the auto split, extra constexpr flags). BLOCK_K = CHUNK = 128. Chosen from the device sweeps
# (benchmarks/device/w4a8_int8.py, rounds r2-r4); see docs/sections/w4a8_int8.md.
# XTMA (session 29; x tiles as TMA boxes instead of pointer loads, bit-equal; GEMM alone, H200, us, pointer / XTMA,
# s29_int8_xtma.json): M = 64 qkv 14.2 / 13.1, gate_up 32.2 / 30.1, down 21.1 / 20.3; M = 128 qkv 19.1 / 15.7, gate_up
# 49.0 / 44.7, down 37.6 / 35.1; M = 1024 qkv 65.1 / 54.6, o 35.5 / 32.4, gate_up 241.8 / 230.5; M = 4096 qkv 202.5 /
# 190.6, gate_up 972.4 / 959.5. It lost on the W8 path (down M = 1024 126.0 / 132.0, 4096 439.6 / 452.9): off there.
CONFIGS = {
    16: (16, 64, 0, 4, 4, 4, {}),
    32: (32, 64, 0, 4, 4, 2, {}),
    64: (64, 64, 0, 4, 4, 2, {"XTMA": True}),
    # r8 (x pre-quantized, us): one 128-token tile, so each weight tile is dequantized once: down
    # 56.6 -> 43.0, gate_up 77.4 -> 56.7, o 23.6 -> 17.7 (the old 64x128 tile dequantized it twice)
    # session 30 (s30_int8_split_r{1,2}.json, x pre-quantized, us, 2 -> 1 program per SM): M = 128 o 14.43 -> 13.12,
    # down 35.12 -> 30.34, tensor-parallel shards 0.84-0.93x; Llama-3 qkv (96 tiles: 96 programs) lost 15.65 -> 17.27,
    # so a split leaving fewer than 0.8 programs per SM takes one more (FILL)
    128: (128, 64, 0, 4, 4, 1, {"XTMA": True, "FILL": 0.8}),
    1 << 62: (128, 128, 1, 8, 3, 1, {"XTMA": True}),
}
# Large M: dequantize the UINT4 weight once to its INT8 level-1 values (a transient int8 [N, Kp]
# buffer, ``dequantize_w8``: one read of N*Kp/2 bytes, one write of N*Kp) and run the same kernel as
# a plain W8A8 GEMM (``W8``: both wgmma operands from shared memory, one K = 128 dot per tile).
# (BLOCK_M, BLOCK_N, num_warps, num_stages, extra). W8_MIN_M: measured crossover (see docs).
# Measured on the H200 (r7, x pre-quantized, us; in-register default vs dequantize_w8 + W8A8 GEMM
# 128x256 8 warps 3 stages, the W8 GEMM alone in brackets): N=4096 K=14336 (down): M=4096 567 vs 430
# (399 = 1206 TOP/s), M=1024 148 vs 133 (104), M=512 134 vs 131; but K=4096 loses: gate_up
# N=28672 M=4096 877 vs 944, M=1024 221 vs 282; o M=4096 129 vs 139; qkv M=4096 190 vs 205 (the
# in-register kernel already runs ~1060-1100 TOP/s there, and the dequantization costs 9-61 us).
# Same-round A/B of this rule against the in-register default (R11, down N=4096 K=14336, x pre-quantized,
# us): M=1024 145.4 vs 133.3, M=4096 561.0 vs 428.1, outputs bit-equal; on since session 5.
# Cost (counted in every timing: the dequantization runs inside each call): one read of the packed
# codes + one write of a transient int8 [N, Kp] buffer (2x the packed weight, from the caching
# allocator, freed when the call returns; peak memory + N*Kp bytes during the call), ~32 us for down.
W8_CONFIG = (128, 256, 8, 3, {})
W8_MIN_M = 1024
# measured crossover (r7-r9). The r8/r9 'dequantize_w8 != dequantize_int8' FAIL was a benchmark bug:
# its inputs took qweight, gscale and gzs from three different weights (a generator re-ran quantize per field),
# so q4*s2 - zs left INT8 and the packed 4-lane PTX carried into the neighbour byte; real (s2, zs) pairs keep
# w8 in [-127, 127] (PROTECTIVE_RANGE), where the lanes never carry.
W8_MIN_K = 8192
DEQUANT_CONFIG = (64, 1, 4)  # dequantize_w8: (rows, 128-column chunks per program, warps)
# M = 1 (x pre-quantized): the dequantized weights meet x in ``dp4a`` on CUDA cores (DP4A; no MMA
# padding to 16 tokens, no shared memory, plain 16-byte loads, KSTEP chunks per iteration in flight), for
# layers of at most ``DP4A_M1_MAX_N[layout]`` output features (0: never), by the codes' layout.
# Row-major codes: N <= 8192. Session 10 probe (H200, x pre-quantized, PDL launches back to back in a CUDA
# graph, weights rotated over > 2x L2; `benchmarks/results/h200/s10_probe.json`), us dp4a vs wgmma: qkv 8.58
# vs 11.51, o 6.53 vs 8.32, down (N 4096, K 14336) 15.01 vs 18.53, gate_up (N 28672) 25.06 vs 23.98: the
# narrow layers have too few 64-row wgmma tiles to hide their latency.
DP4A_M1_MAX_N = {"rows": 8192, "tiled": 1 << 62}
DP4A_CONFIG = (16, 64, 0, 4, 1, 4, dict(DP4A=True, KSTEP=4))
# Row-tiled codes (``tiled``, the modules' default since session 11): dp4a for every N at M = 1, KSTEP 8 for
# K <= DP4A_TILED_K8_MAX_K, else KSTEP 4 with 8 warps. Session 11 probe (H100, x pre-quantized, PDL launches in
# a CUDA graph, weights rotated over > 2x L2, 5 alternations; `benchmarks/results/h100/s11_probe.json`), us:
#   layer     rows: previous default   tiled: wgmma  dp4a k4  dp4a k4 8 warps  dp4a k8
#   qkv       9.42 (dp4a)              11.96         8.74     8.66             7.75
#   o         7.49 (dp4a)              8.91          7.09     6.77             6.83
#   down      17.33 (dp4a)             18.78         15.72    15.24            17.29
#   gate_up   29.97 (wgmma)            25.17         25.63    26.26            23.48
DP4A_TILED_CONFIG = (16, 64, 0, 4, 1, 4, dict(DP4A=True, KSTEP=8))
DP4A_TILED_LONG_K_CONFIG = (16, 64, 0, 8, 1, 4, dict(DP4A=True, KSTEP=4))
DP4A_TILED_K8_MAX_K = 8192
# When lowbit.ops runs the per-token quantization inside the GEMM (``use_fused_quant``). Measured on
# the H200 (r5, us, fused vs act-quant kernel + GEMM): M=1 o_proj 12.6 vs 13.4, down 27.1 vs 26.1,
# gate_up 43.3 vs 30.6; M=4 o_proj 15.6 vs 13.8, down 37.8 vs 26.7. Quantizing in the GEMM costs
# every k-tile (float x loads, the quotient, a shared-memory store), the absmax pass one L2 round
# trip: it pays only while each program's K range is short (split-K decode of K = 4096 layers).
# Off since session 11: the act-quant kernel as a PDL launch + the GEMM ("nofuse pdl") beat the fused
# quantization at M = 1 in R14 (H200, row-major codes, us: qkv 13.63 vs 16.34, o 12.19 vs 13.06, gate_up
# 28.58 vs 29.76) and in session 11 (H100, row-tiled codes, dp4a: qkv 13.02 vs 16.56, o 11.84 vs 13.39,
# gate_up 28.27 vs 29.60; `benchmarks/results/h100/w4a8_int8_extra_s11.json`).
FUSE_QUANT_MAX_M = 0
FUSE_QUANT_MAX_TILES = 8  # k-tiles of 128 per program
# SiLU*mul + quantization inside the down GEMM (lowbit.ops.w4a8_int8_silu_mul_linear): measured
# slower at every M tried (r5, K = 11008: M=1 35.8 vs 24.4 us, M=4 54.3 vs 25.0), so off by default
FUSE_SILU_MAX_M = 0
# Programmatic dependent launch (Hopper) of the act-quant kernel -> this GEMM, for M <= PDL_MAX_M
# (the unfused linear, ``lowbit.ops.w4a8_int8``): the GEMM's programs launch while the act-quant kernel
# runs, optionally ask L2 for their first ``PDL_L2_TILES`` k-tiles of weight codes, then wait
# (``griddepcontrol.wait``: the act-quant grid has finished and its codes are visible) before any
# other load. Same numerics (bit-equal). On for M <= 16 since session 11: faster or equal on every
# decode layer in R14 (H200: M=16 gate_up 32.29 vs 33.68, down 24.94 vs 25.46, qkv 15.52 vs 16.08, o 13.22
# vs 13.73) and in session 11 (H100: 32.45 vs 33.70, 24.90 vs 25.87, 15.81 vs 16.59, 13.62 vs 14.30; M=1
# down 21.25 vs 22.30).
PDL_MAX_M = 16
PDL_L2_TILES = 0


def use_pdl(M: int) -> bool:
    """True when the unfused linear launches act-quant -> GEMM as a programmatic dependent pair."""
    return 0 < M <= PDL_MAX_M


def use_fused_quant(M: int, N: int, K: int, group_size: int, *, num_sms: int = 132) -> bool:
    """True when the in-GEMM quantization is the faster choice for this shape (see above)."""
    if not 0 < M <= FUSE_QUANT_MAX_M:
        return False
    cfg = pick_config(M, N, K, group_size, num_sms=num_sms, fused=True)
    return cdiv(cdiv(K, 128), cfg["SPLIT_K"]) <= FUSE_QUANT_MAX_TILES

# Four INT8 lanes per 32-bit register (QServe's register-level parallelism). $2 holds 4 bytes of
# one weight row (8 codes): low nibbles = columns j..j+3 of the tile's first half, high nibbles =
# the same j of the second half. Per lane, q * s2 + (128 - zs) lies in [1, 255] (tested bound
# |w8| <= 127), so one 32-bit multiply-add with c = (128 - zs) * 0x01010101 never carries between
# lanes; XOR 0x80 per byte then subtracts 128, giving the int8 two's complement w8 = q * s2 - zs.
_DEQUANT_ASM = tl.constexpr("""
{
.reg .b32 t;
and.b32 t, $2, 0x0F0F0F0F;
mad.lo.u32 t, t, $3, $7;
xor.b32 $0, t, 0x80808080;
shr.u32 t, $2, 4;
and.b32 t, t, 0x0F0F0F0F;
mad.lo.u32 t, t, $3, $7;
xor.b32 $1, t, 0x80808080;
}
""")


@triton.jit
def _dequant_halves(b, s2, zs, USE_ASM: tl.constexpr):
    """Packed codes b uint8 [BN, 64] + per-element s2, zs (int32, broadcast) -> (w8 of the first
    64 columns, w8 of the last 64), int8 [BN, 64] each: w8 = q4 * s2 - zs. The packed PTX is exact
    while every w8 + 128 fits a byte (the format guarantees w8 in [-127, 127]); (s2, zs) taken from a
    different weight than q4 can leave INT8, and then a lane carries into its neighbour."""
    if USE_ASM:
        c = (128 - zs) * 0x01010101
        lo, hi = tl.inline_asm_elementwise(_DEQUANT_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [b, s2, c],
                                           dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:  # same integers, one lane per op (interpreter: no inline PTX)
        bi = b.to(tl.int32)
        lo = ((bi & 0xF) * s2 - zs).to(tl.int8)
        hi = ((bi >> 4) * s2 - zs).to(tl.int8)
    return lo, hi


@triton.jit
def _code_rows(rn, N, stride_wn, TILED: tl.constexpr):
    """(byte offset of k-chunk 0, bytes from one 128-column chunk to the next), int64 [BLOCK_N], of
    code rows ``rn``: row-major (``rn * stride_wn``, 64) or, TILED, the row-tiled layout
    (``lowbit.formats.w4a8_int8.tile_codes``: rows below ``64 * (N // 64)`` sit in 64-row x 64-byte
    blocks, one 4 KB block per chunk; the rest row-major)."""
    if TILED:
        in_tile = rn < (N // 64) * 64
        base = tl.where(in_tile, (rn // 64) * (stride_wn * 64) + (rn % 64) * 64, rn * stride_wn)
        inc = tl.where(in_tile, 64 * 64, 64).to(tl.int64)
    else:
        base = rn * stride_wn
        inc = tl.full(rn.shape, 64, tl.int64)
    return base, inc


@triton.jit
def _dp4a(w, x, USE_ASM: tl.constexpr):
    """int32 partial products of int8 w [BN, n] and x (broadcast to w's shape): on the GPU one
    ``dp4a`` per 4 consecutive k (the sum lands in the first lane of each 4, the other three are 0);
    in the interpreter the plain products. Summing over k gives the exact dot product either way."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "{ dp4a.s32.s32 $0, $4, $5, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }",
            "=r,=r,=r,=r,r,r", [w, tl.broadcast_to(x, w.shape)], dtype=tl.int32, is_pure=True, pack=4)
    return w.to(tl.int32) * x.to(tl.int32)


@triton.jit
def _group_params(GS, GZS, rn, stride_gn, g, GS_WORDS: tl.constexpr):
    """(s2, zs) int32 [BLOCK_N] of group ``g`` for rows ``rn``. GS_WORDS: GS/GZS are the flat
    [N * G] bytes viewed as int32 words (little endian): byte i is bits 8*(i%4).. of word i//4."""
    if GS_WORDS:
        i = rn * stride_gn + g
        sh = (i % 4) * 8
        s2 = (tl.load(GS + i // 4) >> sh) & 0xFF
        zs = (tl.load(GZS + i // 4) >> sh) & 0xFF
    else:
        s2 = tl.load(GS + rn * stride_gn + g).to(tl.int32)
        zs = tl.load(GZS + rn * stride_gn + g).to(tl.int32)
    return s2, zs


@triton.jit
def _act_tile(ptrs, up_off, mask, ACT: tl.constexpr):
    """The value to quantize, fp32: x (ACT 0) or, ACT 1, silu(gate) * up rounded like the eager
    half-precision model (``lowbit.kernels.act_quant`` FUSE=2); ``up`` sits ``up_off`` elements
    after ``gate`` (the two halves of one gate_up output)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if ACT == 1:
        v = silu_mul_rounded(x, tl.load(ptrs + up_off, mask=mask, other=0.0).to(tl.float32))
    else:
        v = x.to(tl.float32)
    return v


@triton.jit
def _row_scales(X, up_off, row0, M, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, QROWS: tl.constexpr,
                QCHUNK: tl.constexpr, ACT: tl.constexpr):
    """Per-token INT8 scales [BLOCK_M] of rows row0 .. row0 + QROWS - 1 (rows >= M: unused value)
    over the whole K: ``max(amax, AMAX_EPS) / 127``, NaN when the row holds NaN/Inf."""
    offs_r = tl.arange(0, QROWS)
    offs_q = tl.arange(0, QCHUNK)
    rows = row0 + offs_r
    rmask = rows < M
    ptrs = X + rows.to(tl.int64)[:, None] * stride_xm + offs_q[None, :] * stride_xk
    amax = tl.zeros([QROWS], dtype=tl.float32)
    bad = tl.zeros([QROWS], dtype=tl.int32)
    for kq in range(0, K, QCHUNK):
        v = _act_tile(ptrs + kq * stride_xk, up_off, rmask[:, None] & ((kq + offs_q)[None, :] < K), ACT)
        av = tl.abs(v)
        amax = tl.maximum(amax, tl.max(av, axis=1))
        bad = bad | tl.max(((av == float("inf")) | (v != v)).to(tl.int32), axis=1)
    # max() skips NaN on the GPU: a NaN/Inf row gets a NaN scale, like lowbit.kernels.act_quant
    amax = tl.where(bad > 0, float("nan"), amax)
    sx = tl.div_rn(tl.maximum(amax, AMAX_EPS, propagate_nan=tl.PropagateNan.ALL),
                   tl.full([QROWS], 127.0, tl.float32))
    # [QROWS] -> [BLOCK_M] (a sum with one nonzero term per row: exact, keeps NaN)
    # (rows past QROWS get 1: their x is 0 and must quantize to 0, not 0/0)
    offs_b = tl.arange(0, BLOCK_M)
    s = tl.sum(tl.where(offs_b[:, None] == offs_r[None, :], sx[None, :], 0.0), axis=1)
    s = tl.where(offs_b < QROWS, s, 1.0)
    return s, tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), s)  # scale and its correctly rounded reciprocal


@triton.jit
def _quantize_tile(v, sx, inv, EXACT_DIV: tl.constexpr):
    """Float tile [BM, n] -> INT8 codes with the row scales sx [BM]: rne(clamp(v / sx, +-127)).

    v / sx is the correctly rounded quotient either way. On the GPU without a division per element
    (div.rn is a call with a slow path taken for zero dividends, i.e. every padded row): with
    inv = RN(1/sx), q = RN(v * inv) is within an ulp and one Markstein step q + fma(-q, sx, v) * inv
    (two FMAs) rounds correctly (Markstein 1990; Muller et al., Handbook of FP arithmetic, thm. on
    division with a correctly rounded reciprocal). Tested bit-equal to the act-quant kernel on the
    device. EXACT_DIV (the interpreter, whose fma is not fused): tl.div_rn."""
    s = tl.broadcast_to(sx[:, None], v.shape)
    if EXACT_DIV:
        y = tl.div_rn(v, s)
    else:
        r = tl.broadcast_to(inv[:, None], v.shape)
        q = v * r
        y = tl.fma(tl.fma(-q, s, v), r, q)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    # round half to even: adding and subtracting 1.5 * 2^23 (|y| <= 127); runs in the interpreter
    r = (y + 12582912.0) - 12582912.0
    return r.to(tl.int8)


@triton.jit
def _bulk_prefetch_l2(W, rn, stride_wn, tile, KP, NBYTES: tl.constexpr):
    """Ask L2 for up to NBYTES of packed codes of each row ``rn`` from k-tile ``tile`` on (one
    ``cp.async.bulk.prefetch.L2`` per row: the DRAM sees long contiguous runs instead of one 64-byte
    piece per row per k-tile), clipped to the row's end; 16-byte aligned (64-byte tiles)."""
    t = tl.minimum(tile, KP // 128 - 1)
    off = t * 64
    nb = tl.minimum(KP // 2 - off, NBYTES)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [W + rn * stride_wn + off, tl.broadcast_to(nb, rn.shape)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _w4a8_int8_gemm_kernel(
    # pointers
    X, XS, W, WS, GS, GZS, BIAS, OUT, PART, CNT, XD,
    # sizes (UP_OFF: elements from gate to up, ACT = 1)
    M, N, K, KP, NUM_GROUPS, TILES_PER_SPLIT, UP_OFF,
    # strides (elements; W in bytes; GS/GZS in their element: byte or, with GS_WORDS, int32 word)
    stride_xm, stride_xk, stride_wn, stride_gn, stride_om, stride_on,
    # constexpr flags / tiles
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NSPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr, USE_ASM: tl.constexpr,
    SWAP_AB: tl.constexpr, GS_WORDS: tl.constexpr, PREFETCH: tl.constexpr,
    FUSE_QUANT: tl.constexpr, QROWS: tl.constexpr, QCHUNK: tl.constexpr, UNROLL_REDUCE: tl.constexpr,
    ACT: tl.constexpr, L2_PREFETCH: tl.constexpr, JOIN_K: tl.constexpr, W8: tl.constexpr,
    KSTEP: tl.constexpr, PF_DIST: tl.constexpr, PF_BULK: tl.constexpr, W_TILED: tl.constexpr,
    DP4A: tl.constexpr, PDL: tl.constexpr = False, XTMA: tl.constexpr = False,
):
    BLOCK_K: tl.constexpr = 128  # = lowbit.formats.w4a8_int8.CHUNK
    HALF: tl.constexpr = 64
    PER_CHANNEL: tl.constexpr = GROUP_SIZE >= (1 << 30)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # grouped ordering of output tiles: GROUP_M row-tiles share the weight tiles they read (L2 reuse)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    gsize = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # clamp out-of-range rows/columns to valid ones (their results are masked at the store), so the
    # main-loop loads need no M/N masks
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_h = tl.arange(0, HALF)
    offs_k = tl.arange(0, BLOCK_K)
    if W8:  # W is the INT8 weight w8 [N, KP] itself (``dequantize_w8``): a plain W8A8 GEMM
        w_ptrs = W + rn[:, None] * stride_wn + offs_k[None, :]
    elif W_TILED:  # row-tiled codes (``lowbit.formats.w4a8_int8.tile_codes``): 64 rows x 64 bytes blocks
        w_base, w_inc = _code_rows(rn, N, stride_wn, True)
        w_inc = w_inc[:, None]  # bytes from one k-tile to the next
        w_ptrs = W + w_base[:, None] + offs_h[None, :]
    else:
        w_ptrs = W + rn[:, None] * stride_wn + offs_h[None, :]
    t0 = pid_k * TILES_PER_SPLIT  # the last split may run past KP: its loads are masked off
    if L2_PREFETCH > 0 and USE_ASM and not W_TILED and not W8:
        # start the first weight tiles on their way to L2 before the activation pass below (its L2
        # round trip would otherwise precede the pipeline's first loads)
        pf = tl.arange(0, L2_PREFETCH)
        pk = tl.minimum(t0 + pf, KP // BLOCK_K - 1) * HALF
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [W + rn[:, None] * stride_wn + pk[None, :]], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if PDL:  # launched as a dependent grid: only the (immutable) weight codes above were touched so far
        gdc_wait()
        gdc_launch_dependents()
    if FUSE_QUANT:
        # float rows, masked (not clamped): rows >= M move no bytes and quantize to 0
        x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_h[None, :] * stride_xk
        xrow = (offs_m < M)[:, None]
        sx, inv_sx = _row_scales(X, UP_OFF, pid_m * BLOCK_M, M, K, stride_xm, stride_xk, BLOCK_M, QROWS, QCHUNK, ACT)
    elif W8:
        x_ptrs = X + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk
    else:
        x_ptrs = X + rm[:, None] * stride_xm + offs_h[None, :] * stride_xk

    # SWAP_AB: compute the transposed tile W x^T ([BLOCK_N, BLOCK_M]) so the dequantized weights are
    # the MMA's A operand, which Hopper's wgmma reads from registers (no shared-memory round trip),
    # and the tokens are its N dimension (wgmma N can be 8..256: small M wastes nothing)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    if DP4A:  # M = 1 without tensor cores: int32 lanes [BLOCK_N, 64], summed over k after the loop
        accd = tl.zeros([BLOCK_N, HALF], dtype=tl.int32)
        x1_ptrs = X + offs_h * stride_xk  # row 0
    if W8:
        pass
    elif PER_CHANNEL:
        s2 = tl.load(GS + rn * stride_gn).to(tl.int32)
        zs = tl.load(GZS + rn * stride_gn).to(tl.int32)
    elif GROUP_SIZE % BLOCK_K == 0 and PREFETCH:
        s2n, zsn = _group_params(GS, GZS, rn, stride_gn,
                                 tl.minimum((t0 * BLOCK_K) // GROUP_SIZE, NUM_GROUPS - 1), GS_WORDS)
    if PF_DIST > 0 and PF_BULK > 0 and USE_ASM and not W8 and not W_TILED:  # the first PF_DIST tiles of each row, one request
        _bulk_prefetch_l2(W, rn, stride_wn, t0, KP, PF_DIST * (BLOCK_K // 2))
    for i in range(0, TILES_PER_SPLIT, KSTEP):
        if PF_DIST > 0 and USE_ASM and not W8 and not W_TILED:  # pull later k-tiles of every row into L2 (see PF_BULK)
            if PF_BULK > 0:
                if i % (PF_BULK // (BLOCK_K // 2)) == 0:
                    _bulk_prefetch_l2(W, rn, stride_wn, t0 + i + PF_DIST, KP, PF_BULK)
            else:
                pk = tl.minimum(t0 + i + PF_DIST, KP // BLOCK_K - 1) * (BLOCK_K // 2)
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [W + rn * stride_wn + pk],
                                          dtype=tl.int32, is_pure=False, pack=1)
        for j in tl.static_range(KSTEP):  # KSTEP chunks per iteration: 64 * KSTEP contiguous bytes per row
            k0 = (t0 + i + j) * BLOCK_K
            if W8:  # one K = 128 dot, both operands straight from memory (wgmma from shared memory)
                if XTMA:  # [BLOCK_M, 128] box (rows >= M, columns >= K read as 0; rows >= M are not stored)
                    a = XD.load([pid_m * BLOCK_M, k0])
                else:
                    a = tl.load(x_ptrs + k0 * stride_xk, mask=(k0 + offs_k)[None, :] < K, other=0)
                w = tl.load(w_ptrs + k0, mask=k0 < KP, other=0)
                if SWAP_AB:
                    acc = tl.dot(w, tl.trans(a), acc, out_dtype=tl.int32)
                else:
                    acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
            else:
                if FUSE_QUANT:
                    a_lo = _act_tile(x_ptrs + k0 * stride_xk, UP_OFF, xrow & ((k0 + offs_h)[None, :] < K), ACT)
                    a_hi = _act_tile(x_ptrs + (k0 + HALF) * stride_xk, UP_OFF, xrow & ((k0 + HALF + offs_h)[None, :] < K), ACT)
                    a_lo = _quantize_tile(a_lo, sx, inv_sx, not USE_ASM)
                    a_hi = _quantize_tile(a_hi, sx, inv_sx, not USE_ASM)
                elif XTMA:  # two [BLOCK_M, 64] boxes by the tensor-memory accelerator (as in the W8 path)
                    a_lo = XD.load([pid_m * BLOCK_M, k0])
                    a_hi = XD.load([pid_m * BLOCK_M, k0 + HALF])
                else:
                    a_lo = tl.load(x_ptrs + k0 * stride_xk, mask=(k0 + offs_h)[None, :] < K, other=0)
                    a_hi = tl.load(x_ptrs + (k0 + HALF) * stride_xk, mask=(k0 + HALF + offs_h)[None, :] < K, other=0)
                if W_TILED:
                    b = tl.load(w_ptrs + (k0 // BLOCK_K) * w_inc, mask=k0 < KP, other=0)
                else:
                    b = tl.load(w_ptrs + k0 // 2, mask=k0 < KP, other=0)  # [BN, 64] bytes, 16-byte loads
                if PER_CHANNEL or GROUP_SIZE % BLOCK_K == 0:  # one k-group per tile: one (s2, zs) per row
                    if not PER_CHANNEL:
                        if PREFETCH:
                            s2, zs = s2n, zsn
                            s2n, zsn = _group_params(GS, GZS, rn, stride_gn,
                                                     tl.minimum((k0 + BLOCK_K) // GROUP_SIZE, NUM_GROUPS - 1), GS_WORDS)
                        else:
                            # past the last group (a split running past KP) any group will do: x is 0 there
                            s2, zs = _group_params(GS, GZS, rn, stride_gn,
                                                   tl.minimum(k0 // GROUP_SIZE, NUM_GROUPS - 1), GS_WORDS)
                    s2b = tl.broadcast_to(s2[:, None], (BLOCK_N, HALF))
                    zsb = tl.broadcast_to(zs[:, None], (BLOCK_N, HALF))
                    w_lo, w_hi = _dequant_halves(b, s2b, zsb, USE_ASM)
                else:  # groups smaller than the tile (or not dividing it): gather each column's group
                    g_lo = tl.minimum((k0 + offs_h) // GROUP_SIZE, NUM_GROUPS - 1)
                    g_hi = tl.minimum((k0 + HALF + offs_h) // GROUP_SIZE, NUM_GROUPS - 1)
                    base = rn[:, None] * stride_gn
                    s_lo = tl.load(GS + base + g_lo[None, :]).to(tl.int32)
                    z_lo = tl.load(GZS + base + g_lo[None, :]).to(tl.int32)
                    s_hi = tl.load(GS + base + g_hi[None, :]).to(tl.int32)
                    z_hi = tl.load(GZS + base + g_hi[None, :]).to(tl.int32)
                    bi = b.to(tl.int32)
                    w_lo = ((bi & 0xF) * s_lo - z_lo).to(tl.int8)
                    w_hi = ((bi >> 4) * s_hi - z_hi).to(tl.int8)
                if DP4A:
                    x_lo = tl.load(x1_ptrs + k0 * stride_xk, mask=(k0 + offs_h) < K, other=0)[None, :]
                    x_hi = tl.load(x1_ptrs + (k0 + HALF) * stride_xk, mask=(k0 + HALF + offs_h) < K, other=0)[None, :]
                    accd += _dp4a(w_lo, x_lo, USE_ASM) + _dp4a(w_hi, x_hi, USE_ASM)
                elif JOIN_K:  # one K = 128 MMA (one wgmma wait per tile instead of two)
                    w = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 2, 1)), (BLOCK_N, BLOCK_K))
                    a = tl.reshape(tl.permute(tl.join(a_lo, a_hi), (0, 2, 1)), (BLOCK_M, BLOCK_K))
                    acc = tl.dot(w, tl.trans(a), acc, out_dtype=tl.int32)
                elif SWAP_AB:
                    acc = tl.dot(w_lo, tl.trans(a_lo), acc, out_dtype=tl.int32)
                    acc = tl.dot(w_hi, tl.trans(a_hi), acc, out_dtype=tl.int32)
                else:
                    acc = tl.dot(a_lo, tl.trans(w_lo), acc, out_dtype=tl.int32)
                    acc = tl.dot(a_hi, tl.trans(w_hi), acc, out_dtype=tl.int32)

    if DP4A:  # the row sums into column 0 of the [BLOCK_N, BLOCK_M] tile (M = 1)
        acc = tl.where(tl.arange(0, BLOCK_M)[None, :] == 0, tl.sum(accd, axis=1)[:, None], 0)
    if not FUSE_QUANT:
        sx = tl.load(XS + rm)
    if NSPLIT > 1:
        # split-K fixup in the same launch: every split stores its INT32 partial tile, the last one to
        # arrive (per-tile counter) sums them exactly, applies the epilogue and re-arms the counter
        if SWAP_AB:
            offs_t = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        else:
            offs_t = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_base = pid.to(tl.int64) * NSPLIT * (BLOCK_M * BLOCK_N)
        tl.store(PART + tile_base + pid_k * (BLOCK_M * BLOCK_N) + offs_t, acc, cache_modifier=".cg")
        tl.debug_barrier()  # all of this program's stores precede its release below
        count = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
        if count == NSPLIT - 1:
            acc = tl.zeros_like(acc)
            if UNROLL_REDUCE:  # small tiles: all partial loads in flight at once
                for s in tl.static_range(NSPLIT):
                    acc += tl.load(PART + tile_base + s * (BLOCK_M * BLOCK_N) + offs_t, cache_modifier=".cg")
            else:  # big tiles: one partial at a time (unrolled, they would spill)
                for s in range(0, NSPLIT):
                    acc += tl.load(PART + tile_base + s * (BLOCK_M * BLOCK_N) + offs_t, cache_modifier=".cg")
            tl.atomic_xchg(CNT + pid, 0, sem="relaxed", scope="gpu")
            _epilogue(acc, sx, WS, BIAS, OUT, rn, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, SWAP_AB)
    else:
        _epilogue(acc, sx, WS, BIAS, OUT, rn, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, SWAP_AB)


@triton.jit
def _epilogue(acc, sx, WS, BIAS, OUT, rn, offs_m, offs_n, M, N, stride_om, stride_on,
              HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr):
    """y = float32(acc) * sx[m] * s1[n] (+ bias[n]) -> OUT's dtype, masked to [M, N]
    (acc is [BLOCK_N, BLOCK_M] with SWAP_AB, else [BLOCK_M, BLOCK_N])."""
    s1 = tl.load(WS + rn)
    if SWAP_AB:
        y = acc.to(tl.float32) * sx[None, :] * s1[:, None]  # (acc * sx) * s1: the reference's order
        if HAS_BIAS:
            y += tl.load(BIAS + rn).to(tl.float32)[:, None]
        out_ptrs = OUT + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None] * stride_on
        mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        y = acc.to(tl.float32) * sx[:, None] * s1[None, :]
        if HAS_BIAS:
            y += tl.load(BIAS + rn).to(tl.float32)[None, :]
        out_ptrs = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_w8_kernel(
    W, GS, GZS, OUT,
    N, NUM_CHUNKS, NUM_GROUPS,
    stride_wn, stride_gn, stride_on,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, USE_ASM: tl.constexpr,
    TILED: tl.constexpr,
):
    """CHUNKS 128-column chunks of BLOCK_N rows: packed codes -> w8 = q4 * s2 - zs, int8, natural
    column order (the same integers as the GEMM's in-register dequantization); each row reads
    64 * CHUNKS contiguous bytes and writes 128 * CHUNKS. TILED: codes in the row-tiled layout."""
    HALF: tl.constexpr = 64
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    w_base, w_inc = _code_rows(rn, N, stride_wn, TILED)
    for j in tl.static_range(CHUNKS):
        c = tl.program_id(1) * CHUNKS + j
        mask = (offs_n < N)[:, None] & (c < NUM_CHUNKS)
        b = tl.load(W + w_base[:, None] + c * w_inc[:, None] + offs_h[None, :], mask=mask, other=0)
        k0 = c * 128
        if GROUP_SIZE % 128 == 0:  # one group per chunk (per-channel: GROUP_SIZE = PER_CHANNEL_GROUP)
            g = tl.minimum(k0 // GROUP_SIZE, NUM_GROUPS - 1)
            s2 = tl.load(GS + rn * stride_gn + g).to(tl.int32)
            zs = tl.load(GZS + rn * stride_gn + g).to(tl.int32)
            w_lo, w_hi = _dequant_halves(b, tl.broadcast_to(s2[:, None], (BLOCK_N, HALF)),
                                         tl.broadcast_to(zs[:, None], (BLOCK_N, HALF)), USE_ASM)
        else:
            base = rn[:, None] * stride_gn
            g_lo = tl.minimum((k0 + offs_h) // GROUP_SIZE, NUM_GROUPS - 1)[None, :]
            g_hi = tl.minimum((k0 + HALF + offs_h) // GROUP_SIZE, NUM_GROUPS - 1)[None, :]
            bi = b.to(tl.int32)
            w_lo = ((bi & 0xF) * tl.load(GS + base + g_lo).to(tl.int32) - tl.load(GZS + base + g_lo).to(tl.int32)).to(tl.int8)
            w_hi = ((bi >> 4) * tl.load(GS + base + g_hi).to(tl.int32) - tl.load(GZS + base + g_hi).to(tl.int32)).to(tl.int8)
        o = OUT + rn[:, None] * stride_on + k0 + offs_h[None, :]
        tl.store(o, w_lo, mask=mask)
        tl.store(o + HALF, w_hi, mask=mask)


PER_CHANNEL_GROUP = 1 << 30  # GROUP_SIZE passed for per-channel weights: every k is in group 0


CTAS_PER_SM = 2  # default split-K target: programs per SM when the output tiles alone are too few
MIN_TILES_PER_SPLIT = 4
MAX_SPLIT = 16


def auto_split(M: int, N: int, K: int, bm: int, bn: int, num_sms: int, ctas_per_sm: int = CTAS_PER_SM,
               min_tiles: int = MIN_TILES_PER_SPLIT, fill: float = 0.0) -> int:
    """Splits of K so that about ``ctas_per_sm`` programs run per SM, each keeping >= ``min_tiles``
    k-tiles of 128 (at most ``MAX_SPLIT`` splits); one split more where that leaves fewer than ``fill * ctas_per_sm``
    programs per SM (``CONFIGS``' ``FILL``, session 30)."""
    tiles = max(cdiv(M, bm) * cdiv(N, bn), 1)
    cap = min(cdiv(K, 128) // min_tiles, MAX_SPLIT)
    split = max(1, min(ctas_per_sm * num_sms // tiles, cap))
    if tiles * split < fill * ctas_per_sm * num_sms and split + 1 <= cap:
        split += 1
    return split


def use_w8(M: int, N: int, K: int) -> bool:
    """True when dequantizing the weight once to INT8 (``dequantize_w8``) and running the plain
    W8A8 GEMM beats the in-register dequantization (large M; see ``W8_MIN_M``)."""
    return M >= W8_MIN_M and K >= W8_MIN_K


def pick_config(M: int, N: int, K: int, group_size: int, *, num_sms: int = 132, w8: bool = False,
                fused: bool = False, tiled: bool = False) -> dict:
    """Tile config by M bucket (``CONFIGS``); split-K for small M (``auto_split``); ``w8``: the
    plain W8A8 GEMM's tiles (``W8_CONFIG``); M = 1 with x pre-quantized (not ``fused``) and
    ``N <= DP4A_M1_MAX_N[layout]``: the dp4a config of the codes' layout (row-tiled, ``tiled``:
    ``DP4A_TILED_CONFIG`` for K <= ``DP4A_TILED_K8_MAX_K``, else ``DP4A_TILED_LONG_K_CONFIG``;
    row-major: ``DP4A_CONFIG``)."""
    if w8:
        bm, bn, warps, stages, extra = W8_CONFIG
        return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1, num_warps=warps, num_stages=stages, **extra)
    if M == 1 and not fused and N <= DP4A_M1_MAX_N["tiled" if tiled else "rows"]:
        bm, bn, split, warps, stages, ctas, extra = (
            DP4A_CONFIG if not tiled else DP4A_TILED_CONFIG if K <= DP4A_TILED_K8_MAX_K else DP4A_TILED_LONG_K_CONFIG)
    else:
        for bound in sorted(CONFIGS):
            if M <= bound:
                bm, bn, split, warps, stages, ctas, extra = CONFIGS[bound]
                break
    extra = dict(extra)
    fill = extra.pop("FILL", 0.0)
    if split == 0:
        split = auto_split(M, N, K, bm, bn, num_sms, ctas, max(MIN_TILES_PER_SPLIT, extra.get("KSTEP", 1)), fill)
    return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=stages, **extra)


def w4a8_int8_gemm_triton(xq, xscale, qweight, wscale, gscale, gzs, bias, k, group_size, out_dtype,
                          config=None, **kwargs) -> torch.Tensor:
    """Launch the kernel (see ``launch``); returns ``out_dtype`` [M, N]. Without an explicit
    ``config``, large M (``use_w8``) dequantizes the weight once to a transient INT8 buffer and runs
    the W8A8 GEMM on it (freed when the call returns)."""
    if config is None and xscale is not None and "w8" not in kwargs and \
            use_w8(xq.shape[0], qweight.shape[0], 2 * qweight.shape[1]):
        kwargs["w8"] = dequantize_w8(qweight, gscale, gzs, tiled=kwargs.get("tiled", False))
    return launch(xq, xscale, qweight, wscale, gscale, gzs, bias, k, group_size, out_dtype, config, **kwargs)[0]


def _words(t: torch.Tensor):
    """uint8 [N, G] (contiguous) as its flat bytes viewed as int32 words, when legal (N * G a
    multiple of 4, 4-byte aligned storage); else None."""
    if not t.is_contiguous() or t.numel() % 4 or t.data_ptr() % 4:
        return None
    return t.reshape(-1).view(torch.int32)


def dequantize_w8(qweight: torch.Tensor, gscale: torch.Tensor, gzs: torch.Tensor, block_n: int | None = None,
                  chunks: int | None = None, num_warps: int | None = None, *, tiled: bool = False) -> torch.Tensor:
    """The INT8 level-1 weight ``w8 = q4 * s2 - zs`` as int8 [N, Kp] (natural column order), one
    read of the packed codes and one write: ``lowbit.formats.w4a8_int8.dequantize_int8`` (padded
    columns included) on the GPU. Feeds the large-M path of ``launch`` (``w8=``). Tiles default to
    ``DEQUANT_CONFIG``. ``tiled``: ``qweight`` in the row-tiled layout (the output is row-major)."""
    N, kp2 = qweight.shape
    KP = 2 * kp2
    G = gscale.shape[1]
    group_size = PER_CHANNEL_GROUP if G == 1 else KP // G
    out = torch.empty((N, KP), device=qweight.device, dtype=torch.int8)
    if N == 0:
        return out
    bn, ch, nw = DEQUANT_CONFIG
    bn, ch, nw = block_n or bn, chunks or ch, num_warps or nw
    use_asm = not interpret_mode() and os.environ.get("LOWBIT_W4A8_INT8_NO_ASM", "0") != "1"
    nchunks = KP // 128
    _dequant_w8_kernel[(cdiv(N, bn), cdiv(nchunks, ch))](
        qweight, gscale, gzs, out, N, nchunks, G, qweight.stride(0), gscale.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BLOCK_N=bn, CHUNKS=ch, USE_ASM=use_asm, TILED=bool(tiled), num_warps=nw)
    return out


def launch(xq: torch.Tensor, xscale: torch.Tensor | None, qweight: torch.Tensor, wscale: torch.Tensor,
           gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None, k: int,
           group_size: int, out_dtype: torch.dtype, config: dict | None = None, *, up_offset: int | None = None,
           w8: torch.Tensor | None = None, pdl: bool = False, tiled: bool = False):
    """Launch the kernel. ``xq`` int8 [M, K] with ``xscale`` fp32 [M], or ``xq`` float [M, K] with
    ``xscale=None``: the per-token INT8 quantization then runs inside the GEMM (``FUSE_QUANT``;
    M <= 16). Weight fields as in ``lowbit.formats.w4a8_int8``; ``group_size`` = columns per group
    (per-channel: Kp). ``up_offset`` (fused path only): x is the gate half of a gate_up output and
    the value quantized is ``silu(gate) * up`` with ``up`` ``up_offset`` elements after ``gate``
    (same strides). ``w8`` (int8 [N, Kp], ``dequantize_w8(qweight, ...)``): run the plain W8A8
    GEMM on it instead of dequantizing in registers (large M; needs ``xscale``). ``pdl``: launch as a
    programmatic dependent grid of the kernel before it in the stream (see ``PDL_MAX_M``; ignored
    under the interpreter, before Hopper and with ``w8``; the L2 prefetch depth is the config's
    ``L2_PREFETCH``, default ``PDL_L2_TILES``). ``tiled``: ``qweight`` is in the row-tiled layout
    (``lowbit.formats.w4a8_int8.tile_codes``; the kernel's ``W_TILED``; the L2 prefetch options
    ``L2_PREFETCH``, ``PF_DIST`` and ``PF_BULK`` address row-major codes and are skipped then). Arguments are
    validated by ``lowbit.ops.w4a8_int8``. Returns
    ``(out, compiled_kernel)`` (the compiled kernel for PTX inspection; None when nothing ran)."""
    M, K = xq.shape
    N, kp2 = qweight.shape
    KP = 2 * kp2
    G = gscale.shape[1]
    assert K == k and KP >= K and KP % 128 == 0, "inconsistent shapes (validate in lowbit.ops)"
    fuse_quant = xscale is None
    if w8 is not None and (fuse_quant or tuple(w8.shape) != (N, KP) or w8.dtype != torch.int8 or w8.stride(1) != 1):
        raise ValueError("w8 must be the int8 [N, Kp] weight of dequantize_w8, with pre-quantized x")
    if up_offset is not None and not fuse_quant:
        raise ValueError("up_offset (silu(gate) * up) needs the fused-quantization path (xscale=None)")
    if G == 1 and group_size == KP:
        group_size = PER_CHANNEL_GROUP
    num_sms = sm_count(xq.device, 4)
    cfg = dict(config) if config else pick_config(M, N, KP, group_size, num_sms=num_sms, w8=w8 is not None,
                                                  fused=fuse_quant, tiled=bool(tiled))
    bm, bn, split = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    cfg.pop("BLOCK_K", None)
    bk = 128
    # the 4-lane PTX dequantization needs a real GPU; LOWBIT_W4A8_INT8_NO_ASM=1 forces the one-lane path
    use_asm = cfg.pop("USE_ASM", not interpret_mode() and os.environ.get("LOWBIT_W4A8_INT8_NO_ASM", "0") != "1")
    swap = cfg.pop("SWAP_AB", w8 is None)
    prefetch = cfg.pop("PREFETCH", False)
    pdl = bool(pdl) and w8 is None and pdl_enabled(xq, True)
    l2pf = cfg.pop("L2_PREFETCH", PDL_L2_TILES if pdl else 0)  # k-tiles per row prefetched to L2 up front (power of 2; 0 = off)
    words = cfg.pop("GS_WORDS", False)  # r4: the byte loads (L1 hits) beat the pipelined words
    gs, gz, stride_g = gscale, gzs, gscale.stride(0)
    if words and group_size % bk == 0 and group_size != PER_CHANNEL_GROUP:
        gw, zw = _words(gscale), _words(gzs)
        words = gw is not None and zw is not None
        if words:
            gs, gz = gw, zw  # stride_g stays in bytes: the kernel indexes the flat bytes
    else:
        words = False
    if not words:
        assert gscale.stride(0) == gzs.stride(0) and gscale.stride(1) == gzs.stride(1) == 1
    qrows = qchunk = 1
    if fuse_quant:
        if M > bm:
            raise ValueError(f"the fused-quantization path takes M <= BLOCK_M = {bm} rows, got {M}")
        qrows = triton.next_power_of_2(max(M, 1))
        qchunk = max(16, min(triton.next_power_of_2(K), 16384 // qrows))
        xscale = wscale  # unused pointer
    # unroll the split-K reduction while a partial tile is <= 32 registers per thread
    unroll = cfg.pop("UNROLL_REDUCE", bm * bn <= 32 * 32 * cfg.get("num_warps", 4))
    out = torch.empty((M, N), device=xq.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out, None
    if "W_TILED" in cfg:
        raise ValueError("the code layout comes from tiled=, not from the config")
    dp4a = cfg.pop("DP4A", False)  # M = 1: dp4a on CUDA cores instead of the MMA (swap-AB epilogue)
    if dp4a and (M != 1 or fuse_quant or not swap or w8 is not None):
        raise ValueError("DP4A takes one pre-quantized row (M = 1, xscale given), swap-AB, no w8")
    kstep = cfg.pop("KSTEP", 1)  # chunks of 128 per loop iteration (TILES_PER_SPLIT a multiple of it)
    pf_dist = cfg.pop("PF_DIST", 0)  # per-iteration L2 prefetch distance in k-tiles (0 = off)
    pf_bulk = cfg.pop("PF_BULK", 0)  # bytes per row per bulk L2 prefetch (a multiple of 64 * KSTEP; 0: per-line prefetch)
    tps = cdiv(cdiv(cdiv(KP, bk), split), kstep) * kstep  # k-tiles per split, a multiple of KSTEP
    split = cdiv(cdiv(KP, bk), tps)  # (rounding tps up may leave trailing splits empty: drop them)
    tiles = cdiv(M, bm) * cdiv(N, bn)
    if split > 1:
        part, cnt = _split_workspace(xq.device, tiles * split * bm * bn, tiles)
    else:
        part = cnt = wscale  # unused
    grid = (tiles, split)
    # x by TMA (config XTMA; None where TMA cannot read it): boxes of [BLOCK_M, 64] (in-register dequantization) or
    # [BLOCK_M, 128] (W8)
    xd = None
    if cfg.pop("XTMA", False) and not fuse_quant and not dp4a:
        xd = tma_descriptor(xq, [bm, bk if w8 is not None else bk // 2])
    xtma = xd is not None
    kernel = _w4a8_int8_gemm_kernel[grid](
        xq, xscale, qweight if w8 is None else w8, wscale, gs, gz, bias if bias is not None else wscale, out, part, cnt,
        xd if xtma else xq,
        M, N, K, KP, G, tps, up_offset or 0,
        xq.stride(0), xq.stride(1), qweight.stride(0) if w8 is None else w8.stride(0), stride_g, out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, BLOCK_M=bm, BLOCK_N=bn, NSPLIT=split,
        HAS_BIAS=bias is not None, GROUP_M=8, USE_ASM=use_asm, SWAP_AB=swap, GS_WORDS=words,
        PREFETCH=prefetch, FUSE_QUANT=fuse_quant, QROWS=qrows, QCHUNK=qchunk, UNROLL_REDUCE=unroll,
        ACT=0 if up_offset is None else 1, L2_PREFETCH=l2pf,
        JOIN_K=cfg.pop("JOIN_K", False), W8=w8 is not None, KSTEP=kstep, PF_DIST=pf_dist, PF_BULK=pf_bulk,
        W_TILED=bool(tiled) and w8 is None, DP4A=dp4a, PDL=pdl, **({"XTMA": True} if xtma else {}), **cfg,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out, kernel


def _split_workspace(device: torch.device, n_partial: int, n_tiles: int):
    """INT32 partial tiles and per-tile arrival counters, one pair per device and stream, grown on demand
    (``lowbit._utils.stream_scratch`` / ``arrival_counters``). The counters start at 0 and the kernel leaves them at 0
    (the last program of a tile re-arms its counter), so no memset launch is needed per call; launches on one
    stream are ordered, and each stream has its own buffers."""
    return (stream_scratch("w4a8_int8", device, n_partial, torch.int32, minimum=1 << 20),
            arrival_counters("w4a8_int8", device, n_tiles))
