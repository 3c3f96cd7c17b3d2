"""INT4 x FP8 GEMM with FP8 group scales (FireQ §3.1, Fig. 2): ``y = x W^T`` for format ``w4a8-fp8``.

Math (numerics of ``lowbit.formats.w4a8_fp8.reference_linear``)::

    y[m, n] = sx[m] * inv_delta * sum_k xq[m, k] * FP8(q[n, k] * sigma[n, k // g])  (+ bias[n])

- A operand: ``xq`` FP8 E4M3 ``[M, K]`` (row stride given, K contiguous), per-token scale ``sx``
  fp32 ``[M]`` from ``lowbit.kernels.act_quant``.
- B operand: packed codes uint8 ``[N, Kp/2]`` and FP8 scales ``[N, G]``, layout in
  ``lowbit.formats.w4a8_fp8``: the 64 bytes of one row of a K=128 tile are 16 words of 8 weights
  (sign-magnitude, bit-scattered), giving the tile's two 64-column halves (lo / hi).
- Dequantization in registers through FireQ's scaled lookup table: per (row, group) the 8 bytes
  FP8(k * sigma), k = 0..7, built with 4 ``mul.f16x2`` + 4 ``cvt.rn.satfinite.e4m3x2.f16x2``
  (``_fp8_lut``); then per 4 weights one AND, one ``prmt.b32`` byte-permute over the LUT and one
  XOR of the sign bits (``_fp8_lookup``, ``tl.inline_asm_elementwise``). ``LUT=False`` (and the
  interpreter, which cannot run PTX) decodes arithmetically with identical numerics.
- MMA: FP8 x FP8 ``tl.dot`` (wgmma on Hopper) with FP32 accumulation. ``max_num_imprecise_acc=64``
  (= each dot's K) makes Triton add every K=64 partial product into a separate full-FP32
  accumulator (Hopper's fast FP8 accumulation keeps ~14 mantissa bits). Note: in Triton 3.6 a value
  below 32 (the wgmma K of FP8), e.g. 0, silently falls back to ``mma.sync`` -- no wgmma at all.
  Config ``FAST_ACC=True`` skips the promotion (see ``pick_config``).
- Epilogue (FP32): ``* sx[m] * inv_delta``, ``+ bias``, then either the output, or with ``SILU_MUL``
  (fused gate_up weight whose rows are interleaved gate_0, up_0, gate_1, ...) ``silu(gate) * up``
  with each intermediate rounded to the output dtype like the eager model; ``+ residual`` last.
- Small M (decode): ``SWAP_AB`` computes the transposed tile ``W_tile @ x_tile^T`` so N fills the
  64-row wgmma M dimension and M (>= 16 after padding) is the wgmma N; ``SPLIT_K > 1`` splits the K
  loop over more programs, writing fp32 partials to a workspace. ``SK_SEM`` (default): single
  launch -- each program bumps a per-tile atomic counter after storing its partial, and the last
  one sums the partials in split order (deterministic) and runs the epilogue, then resets the
  counter (a cached zeroed int32 buffer; concurrent launches on different streams must not share
  it). ``SK_SEM=False``: ``_splitk_reduce_kernel`` (a second launch) does that.
- Loads (decode): ``TMA`` fetches each K tile's ``[BLOCK_N, 64 B]`` code box with the tensor-memory
  accelerator (a host ``TensorDescriptor``; rows >= N read as zero), else cp.async; ``SWORD`` reads a
  row's group scales as the one aligned 4-byte word holding them (else a 16-byte chunk reduced in
  registers); ``KSTEP`` K tiles per loop iteration (the last step masked), i.e. KSTEP x 64
  contiguous code bytes per row per pipeline stage. None of them changes the arithmetic or its
  order (outputs bit-equal on the GPU, R8).
- ``QUANT_A`` (``w4a8_fp8_linear_fused``, decode): x arrives in fp16/bf16/fp32 and its per-token
  FP8 quantization runs inside the GEMM, so the linear is one launch. Every program reads its
  QROWS rows of x over the whole K (a few KB, L2-resident; redundant across programs), takes the
  absmax and the scale rule of ``lowbit.formats.common`` (NaN/Inf row -> NaN scale), then
  quantizes each K tile in registers; x tiles are prefetched one iteration ahead by hand. The
  quotient v/s is the IEEE one without a per-element division (``_quant_rows``), so codes and
  scales are bit-identical to ``lowbit.kernels.act_quant`` (tested). ``QROWS < BLOCK_M`` packs M
  rows into the 16-row wgmma tile at stride BLOCK_M/QROWS so only real rows are quantized.
- ``W_FP8`` (large M): the weight was dequantized once to FP8 ``[N, Kp]`` (``dequantize_to_fp8``,
  the same FP8(q*sigma) bytes) and the loop is a plain FP8 GEMM. The launcher can instead hand
  that buffer to ``torch._scaled_mm`` row-wise (scale_a = sx, scale_b = delta^-1); the choice is
  ``DEQUANT_GEMM``, measured (benchmarks/device/w4a8_fp8.py). Transient memory: N x Kp bytes
  (twice the packed weight) per call, freed after it.

- ``PDL`` (config key, default ``lowbit.kernels.act_quant.PDL_DEFAULT``): programmatic dependent
  launch -- the GEMM waits (``griddepcontrol.wait``) for the previous kernel (the activation
  quantization) before its first load, so its launch overlaps that kernel; ``PDL_TRIGGER`` (default
  True) also lets the next PDL kernel launch at once (False: when this grid ends). ``TILED``: tile-major
  codes (``lowbit.formats.w4a8_fp8.tile_codes``). ``LUT2``: both halves of a code word in one asm
  instance (``_fp8_lookup2``). ``CAT``: the two 64-column halves joined along K
  (``tl.join``/``permute``/``reshape``, a register renaming in the wgmma operand layout) into one
  K=128 dot per tile against the whole x tile: the same k32 wgmma steps in the same order, half the
  commit/wait pairs. All of them leave the arithmetic unchanged (bit-equal on the GPU, R12). ``DEFER`` (with
  ``CAT``, ``SWAP_AB`` and ``ACC_TILE``): each K tile's FP8 product is added into the FP32 accumulator one iteration
  later (the next tile's dequantization comes first), same sums in the same order (bit-equal on the H200, S15).
  ``HYB_FULL`` (runtime int, with single-launch split-K): n-tiles below it run whole, the rest ``SPLIT_K`` ways, in
  one launch (grid axis 1 = ``HYB_FULL + (n_tiles - HYB_FULL) * SPLIT_K``; each tile bit-equal to the launch that
  runs it the same way): the remainder of the mid-M waves (``pick_config``). ``XTMA`` (with ``CAT``, one K tile per
  step, pre-quantized x with 16-byte rows, a TMA-capable GPU: ``lowbit._utils.tma_descriptor``; else pointer
  loads): each ``[BLOCK_M, 128]`` x tile is one TMA box (rows >= M and columns >= K
  read as 0, like the masked loads: bit-equal), instead of per-thread cp.async and their address arithmetic.

Shapes: any M >= 1, any N >= 1 (masked), any K >= 1 (masked; codes are stored padded to 128).
Alignment: none required for correctness; 16-byte-aligned rows (K % 16 == 0, which all Llama
shapes satisfy) let Triton use 16-byte loads. Tile BLOCK_K is fixed at 128 (= the pack block).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowbit._utils import arrival_counters, cdiv, check_tensor, interpret_mode, tma_descriptor
from lowbit.formats.common import AMAX_EPS, FP8_E4M3, FP8_E4M3_MAX
from lowbit.formats.w4a8_fp8 import PACK_BLOCK, padded_k, scale_cols, tiled_shape
from lowbit.formats.w4a8_fp8 import TILE_N as _TILE_N
from lowbit.kernels.act_quant import pdl_enabled, pdl_prologue, round_to_fp8_e4m3
from lowbit.kernels.silu_mul import silu_mul_f32, silu_mul_triton

BLOCK_K = PACK_BLOCK
HALF_K = tl.constexpr(PACK_BLOCK // 2)
TILE_N = tl.constexpr(_TILE_N)
FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


# ------------------------------------------------------------------------------------ configs
def _split_k_fit(tiles: int, k_tiles: int, slots: int) -> int:
    """Largest power-of-two split with tiles * split <= slots (at least 1), keeping >= 4 K tiles per split."""
    split = 1
    while tiles * split * 2 <= slots and split * 2 <= max(1, k_tiles // 4):
        split *= 2
    return split


def _split_k(tiles: int, k_tiles: int, target: int, min_k_tiles: int = 4) -> int:
    """Smallest power-of-two split with tiles * split >= target, keeping >= ``min_k_tiles`` K tiles per split."""
    split = 1
    while tiles * split < target and split * 2 <= max(1, k_tiles // min_k_tiles):
        split *= 2
    return split


# Dispatch by M (measured on the H200, benchmarks/device/w4a8_fp8.py, round R4):
# - activation quantization fused into the GEMM (QUANT_A) LOST at every M measured: gate_up
#   M=1 43.1 us vs 36.2 us for act_quant + GEMM (M=16: 63.2 vs 37.2; down M=1 35.9 vs 27.1) -- the
#   per-program absmax prologue over the whole K and the in-loop quantization cost more than the
#   separate launch. It stays available (w4a8_fp8_linear_fused, FUSED_QUANT_MAX_M > 0), off by default.
FUSED_QUANT_MAX_M = 0  # w4a8_fp8_linear: activation quantization inside the GEMM up to this M
# - programmatic dependent launch of act_quant -> GEMM: w4a8_fp8_linear runs both launches PDL (op
#   lowbit::w4a8_fp8_linear_pdl; the GEMM waits but does not trigger its own dependents early) up to this M.
#   R12 (H200, act_quant + GEMM, us, plain / PDL / PDL without the GEMM's trigger): M=1 gate_up 28.3 / 27.3 /
#   27.2, down 19.6 / 18.8 / 18.6, qkv 14.8 / 14.0 / 13.8, o 13.2 / 12.1 / 12.0; M=16 gate_up 28.5 / 27.7 /
#   27.7 but down 22.3 / 24.6 / 24.7, qkv 15.4 / 16.0 / 15.9, o 13.9 / 14.1 / 13.9 (R11 the same): M = 1 only.
PDL_LINEAR_MAX_M = 1
# ... and up to this M where the config has no split-K (gate_up, lm_head): R12 / R13 gate_up M=16 27.7 / 25.9
# us with PDL vs 28.5 / 27.0 without (the M=16 losses above are all split-K configs).
PDL_NOSPLIT_MAX_M = 16


def use_pdl_linear(M: int, N: int, K: int) -> bool:
    """Whether w4a8_fp8_linear launches act_quant -> GEMM with programmatic dependent launch."""
    if M <= PDL_LINEAR_MAX_M:
        return True
    return M <= PDL_NOSPLIT_MAX_M and pick_config(M, N, K).get("SPLIT_K", 1) == 1 and M < DEQUANT_MIN_M
# - flags added to the fused-dequant configs; each output bit-equal to the plain config on the GPU (R12).
#   LUT2: one asm for both code halves; CAT: [w_lo | w_hi] as one K=128 dot per tile (2 wgmma waits per
#   KSTEP=2 iteration instead of 4; offline SASS: gate_up loop 621 -> 552 instructions). R12, GEMM alone,
#   us, plain / LUT2 / LUT2+CAT: gate_up M=1 25.3 / 24.0 / 23.3, M=16 25.7 / - / 23.8; qkv M=1 12.1 / 12.0 /
#   11.7, M=16 12.6 / - / 11.7; o M=1 10.4 / 10.3 / 10.2, M=16 11.2 / - / 10.7; lm_head 75.7 / - / 71.6;
#   down (long K, split-K) M=1 16.1 / 15.9 / 16.6, M=16 18.4 / - / 17.9; M=128 gate_up 58.5 / 58.6 / 54.5,
#   down 39.2 / 40.5 / 34.5.
DECODE_FLAGS: dict = {"LUT2": True, "CAT": True}  # M <= 64, 128-row wide-N and 64-row paths
LONG_K_FLAGS: dict = {"LUT2": True}  # M <= 64, long-K (down) path: CAT lost at M = 1
MID_FLAGS: dict = {"LUT2": True, "CAT": True, "DEFER": True, "XTMA": True}  # 64 < M < DEQUANT_MIN_M
# - DEFER (session 15, H200, M = 128, GEMM alone, graph us, default / DEFER, bit-equal): qkv 20.75 / 19.73, o 16.97 /
#   16.35, gate_up 52.2 / 50.6, down 32.1 / 30.4 (benchmarks/results/h200/s15_w4a8.json). The same run's losers at
#   M = 128 (s15_w4a8_r1.json): KSTEP=2 (gate_up 92.5), the FP32 promotion once per 2 K tiles (78.6; and 3.3x the
#   error on an all-positive K = 14336 product), 128 weight rows x 8 warps (57.0), SPLIT_K x2 (70.9), 3 / 5 stages
#   (54.0 / 52.4), group scales as one word (SWORD, 59.5); 64-token tiles won on o only (15.1) and lost on gate_up
#   (61.3) and down (35.6). M <= 64 paths (s15_w4a8_decode.json): DEFER slower or equal there (gate_up M = 1 / 64
#   22.6 / 31.3 vs 20.9 / 28.7, o M = 64 16.4 vs 15.9, qkv and down within 0.3 us): off.
# - XTMA (session 29, H200, GEMM alone, graph us, pointer loads / XTMA, bit-equal; s29_w4a8_hybrid_x.json): the x tile
#   ([128, 128] FP8) as one TMA box instead of 8 cp.async per thread and their address chain (ncu: 30 % of the stall
#   samples were fixed-latency waits, mostly on that chain); 222 -> 189 registers. gate_up M = 128 / 256 50.6-50.9 /
#   93.5-93.7 -> 44.5-44.9 / 83.5-85.5, qkv 19.6-19.9 / 26.3-26.5 -> 18.7-18.8 / 22.8-23.2, o 16.9-17.1 / 20.5-21.0 ->
#   16.7-16.9 / 19.6-19.9, down 31.7-32.0 / 48.6-48.8 -> 29.9-30.0 / 44.3-44.4. The codes by TMA as well lost (gate_up
#   47.1-47.2), as they did alone (53.3-53.7). 3 stages with TMA codes or a 168-register cap give 3 programs per SM:
#   faster only on gate_up M = 256 (79.1 vs 85.9; s29_w4a8_hybrid_y.json), slower on the 7 other shapes: not taken.
#   The 64-row decode configs (s29_w4a8_hybrid_z.json, off / XTMA): o M = 16 / 32 / 64 8.56-8.62 / 10.18-10.23 /
#   16.22-16.38 -> 8.92-8.96 / 10.28-10.32 / 13.58-13.75, qkv 9.88-9.89 / 11.04-11.09 / 13.81-13.88 -> 10.18-10.25 /
#   11.03-11.05 / 13.72-13.78: XTMA with 64-token tiles (M = 33..64) only. M = 96 (mid): qkv 19.2-19.3 -> 18.1-18.2, o
#   15.3 -> 15.1, gate_up 50.6-51.1 -> 45.6-45.7.
# - from M = DEQUANT_MIN_M (512 until session 29): dequantize the weight once to FP8 and use torch._scaled_mm row-wise (R4, gate_up
#   M=1024: 233.9 us vs 431.5 us fused-dequant and 348.0 us for the Triton W_FP8 GEMM; R5, M=512:
#   gate_up 148.6 vs 187.9 us, down 72.5 vs 122.2, 4096^2 26.2 vs 41.9 for the swap-AB kernel; at
#   M=256 the swap-AB kernel still wins or ties: 101.8 vs 114.2, 66.0 vs 69.0, 24.8 vs 24.9 us;
#   M=384 was not measured). Session 29 (s29_w4a8_hybrid_od.json, GEMM alone, us, fused (with HYB_FULL where it
#   applies) / dequantize + _scaled_mm): gate_up M=256 92.6 / 113.0, 384 135.1-145.0 / 136.8, 448 175.5 / 170.3, 511
#   170.4-181.7 / 151.3; qkv M=384 41.4-47.7 / 37.9, 448 44.7 / 42.9, 511 44.3 / 36.9: from 384.
DEQUANT_MIN_M = 384  # from this M: dequantize the weight once to FP8, then a plain FP8 GEMM
# - mid-M hybrid split (``HYB_FULL``, session 29): the mid config's programs (222 registers, 81 KB shared memory) run 2
#   per SM, and each one's time is set by its own latency chain, not by its SM neighbours: M = 128, K = 4096, GEMM
#   alone, us: N = 16896 / 22528 / 28672 / 33792 (1 / 1.33 / 1.70 / 2 waves of 264 programs) 27.0 / 45.7 / 50.9 /
#   51.6. A partial last wave costs a whole one. Where the remainder fits half a wave, its tiles run split-K 2 in
#   the same launch behind the whole waves: gate_up M = 256 (896 tiles = 3 waves + 104) 92.9 vs 99.0; where it does
#   not (M = 128: 264 + 184) splitting the tail loses (59.2 vs 50.5; s29_w4a8_hybrid.json).
MID_CTAS_PER_SM = 2
# split-K of the mid-M tiles: "fill" = the smallest split reaching one program per SM (the rule until session 30),
# "fit" = the largest split staying within one program per SM, "auto" = "fit" below MID_FILL_MIN_K_TILES K tiles,
# "fill" from there. Session 30 (H200, GEMM alone, same run, all 27 shapes of M = 96..320 where the two differ,
# s30_w4a8_split.json): "fit" 4-41 % faster at K <= 4096 (Llama-3-8B qkv M = 128 18.95 -> 17.29 us, o 16.23 -> 14.38,
# o M = 256 19.47 -> 17.66; tensor-parallel shards: N = 1536 qkv M = 128 17.78 -> 12.13, o K = 1024 M = 256 11.78 ->
# 6.97, down K = 1792 13.61 -> 9.53), 4-18 % slower on the long-K down layers (K = 14336 / 11008, 86-112 K tiles:
# 29.63 -> 32.43 at M = 128); bit-identical outputs either way
MID_SPLIT = "auto"
MID_FILL_MIN_K_TILES = 64
# decode (M <= 64), 64-row tiles (qkv, o, gate / up shards): split-K until this many programs per SM, by the tile's
# rows (16 / 32 / 64 tokens). R4-R8 sweeps set 2; session 31 (H200, GEMM alone, same run, 3 alternations,
# s31_w4a8_decode_split15.json) against 1.5 where the two differ: at 32 / 64 tokens 1.5 is 2-17 % faster (us, M = 64:
# Llama-3-8B o 13.6 -> 11.95, gate 14336 x 4096 22.9 -> 20.2, tp4 gate_up 7168 16.8 -> 14.9, N = 8192 16.8 -> 15.1,
# tp8 gate_up 14.0 -> 11.6; M = 32: o 10.0 -> 9.1, gate 18.7 -> 18.0, the rest within 1 %); at 16 tokens 2 stays
# (1.5: o 8.6 -> 8.3 but gate 16.8 -> 17.2, tp4 gate_up 11.0 -> 11.6, N = 8192 11.1 -> 11.8). One program per SM
# lost at every M on qkv (N = 6144: 13.4 -> 14.6 at M = 64, s30_w4a8_split_decode.json): the fp32 partials
# (M x N x split) weigh more at 64 tokens, too few programs starve the 16-token tiles.
DECODE_SPLIT_PER_SM = {16: 2.0, 32: 1.5, 64: 1.5}
# ... and of the long-K decode tiles (128 rows, >= 64 K tiles: down), by the tile's rows (R8: ~1.5 at M = 1)
LONG_K_SPLIT_PER_SM = {16: 1.5, 32: 1.5, 64: 1.5}
# ... each split keeping at least this many K tiles (of 128), by the tile's rows; the long-K tiles: LONG_K_MIN_K_TILES.
# Session 31 (H200, GEMM alone, same run, 3 alternations; s31_w4a8_min_tiles8.json, every decode shape where 8
# differs from 4): at M = 64 8 won on all 6 (us: tp4 qkv 1536 x 4096 11.58 -> 9.52, tp4 o 4096 x 1024 7.32 -> 6.13,
# tp2 o 4096 x 2048 9.80 -> 9.04, N = 2048 K = 4096 11.42 -> 9.76, tp8 down 4096 x 1792 8.64 -> 8.53, 2048 x 10944
# 25.2 -> 16.9); at 16 / 32 tokens it lost on the small shards (tp2 o M = 16 6.41 -> 6.96, tp8 down 6.64 -> 7.10)
# and won on others (o 8.45 -> 8.24, tp4 o 5.50 -> 5.07), so 4 stays there. Long K: 8 at every M (2048 x 10944:
# 13.5 -> 11.2 at M = 16, 14.9 -> 12.9 at 32; Llama-3/2 down keep their split, 14 / 10.75 K tiles each).
DECODE_MIN_K_TILES = {16: 4, 32: 4, 64: 8}
LONG_K_MIN_K_TILES = 8
DEQUANT_GEMM = "scaled_mm"  # ... by torch._scaled_mm ("scaled_mm") or by this kernel ("dequant")


def pick_config(M: int, N: int, K: int, n_sm: int = 132) -> dict:
    """Tile config by shape (the sweep behind it: benchmarks/device/w4a8_fp8.py, H200, R4).

    - M <= 64 (decode): SWAP_AB (the weight tile is the 64-row wgmma A operand, x^T the N=16..64
      operand). BLOCK_N = 128 weight rows without split-K when that already gives one program per
      SM, with the codes loaded by TMA (``TMA``), the group scales by one 4-byte word per row
      (``SWORD``) and two K tiles per loop iteration (``KSTEP=2``, 3 stages). R8 (H200, M=1, GEMM
      alone): gate_up 25.4 us (R7 default 29.9: 128 rows, cp.async, 16-byte scale chunk; TMA+SWORD
      26.8, SWORD only 28.4), lm_head (N=128256) 77.2 us (111.7). Long K (>= 64 K tiles, i.e. down):
      128 rows, TMA, SWORD, split-K to ~1.5 programs per SM (down M=1: 16.1 vs 18.8 us for 64 rows x
      split 8; session 31: each split keeps >= 8 K tiles). Otherwise (qkv, o) 64 rows, split-K until
      ``DECODE_SPLIT_PER_SM`` programs per SM (2 at 16 tokens, 1.5 above; >= 8 K tiles per split at 64 tokens;
      session 31), cp.async + 16-byte scale chunk (TMA / SWORD measured 0.2-1.2 us slower there). ``ACC_TILE``
      (31.0 vs 32.1 us, R4).
      Measured and dropped (R7/R8): stream-K over (tile, K tile) units with 132-528 programs (gate_up
      27.6-38.6 us, M=128 gate_up 64.7 vs 58.1), a rotated K start per tile (no change), 6 stages.
    - 64 < M < DEQUANT_MIN_M: SWAP_AB with BLOCK_M = 128 x-rows x BLOCK_N = 64 weight rows: the
      dequantized weight stays the register A operand (gate_up M=128: 59.4 us vs 72.6 us for 64x128
      tiles without swap; R4), split-K (below); beyond one wave (2 programs per SM), a remainder
      that fits half a wave runs split-K 2 behind the whole waves (``HYB_FULL``, session 29); x tiles by TMA
      (``XTMA``, session 29; also on the 64-token decode tiles). Split-K (session 30, ``MID_SPLIT``): below 64 K
      tiles the largest split that keeps within one program per SM, from 64 K tiles (long-K down) the smallest
      one reaching it.
    - M >= DEQUANT_MIN_M: ``MODE=DEQUANT_GEMM`` (dequantize once + FP8 GEMM); the tile entries are
      used by the Triton W_FP8 GEMM (``MODE="dequant"``, and where _scaled_mm cannot run).
    - Every fused-dequant config adds ``DECODE_FLAGS`` / ``LONG_K_FLAGS`` / ``MID_FLAGS`` (``LUT2``,
      ``CAT``: fewer instructions and wgmma waits per K tile, same products in the same order; R12
      numbers beside the constants).
    Accumulation is precise everywhere (FP32 promotion every K = 64 or 128); ``FAST_ACC=True`` (no
    promotion) is an option for experiments: 1.6x faster at M = 1024 but it lost 22% (rel-L2) on an
    all-positive K = 14336 product on the H200.
    """
    k_tiles = cdiv(K, BLOCK_K)
    if M >= DEQUANT_MIN_M:
        return dict(MODE=DEQUANT_GEMM, BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, SWAP_AB=False, num_warps=8,
                    num_stages=4, GROUP_M=8, ACC_TILE=True)
    if M <= 64:
        bm = 16 if M <= 16 else (32 if M <= 32 else 64)
        if cdiv(N, 128) >= n_sm:
            return dict(BLOCK_M=bm, BLOCK_N=128, SPLIT_K=1, SWAP_AB=True, num_warps=4, num_stages=3, GROUP_M=1,
                        ACC_TILE=True, SWORD=True, TMA=True, KSTEP=2, **DECODE_FLAGS)
        if k_tiles >= 64:  # long K (down): 128 rows, split-K to ~1.5 programs per SM
            split = _split_k(cdiv(N, 128) * cdiv(M, bm), k_tiles, int(LONG_K_SPLIT_PER_SM[bm] * n_sm),
                             LONG_K_MIN_K_TILES)
            return dict(BLOCK_M=bm, BLOCK_N=128, SPLIT_K=split, SWAP_AB=True, num_warps=4, num_stages=4, GROUP_M=1,
                        ACC_TILE=True, SWORD=True, TMA=True, **LONG_K_FLAGS)
        bn = 64
        split = _split_k(cdiv(N, bn) * cdiv(M, bm), k_tiles, int(DECODE_SPLIT_PER_SM[bm] * n_sm),
                         DECODE_MIN_K_TILES[bm])
        return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, SWAP_AB=True, num_warps=4, num_stages=4, GROUP_M=1,
                    ACC_TILE=True, SWORD=False, **DECODE_FLAGS, XTMA=bm == 64)
    m_tiles, n_tiles = cdiv(M, 128), cdiv(N, 64)
    if MID_SPLIT == "fit" or (MID_SPLIT == "auto" and k_tiles < MID_FILL_MIN_K_TILES):
        split = _split_k_fit(n_tiles * m_tiles, k_tiles, n_sm)
    else:
        split = _split_k(n_tiles * m_tiles, k_tiles, n_sm)
    cfg = dict(BLOCK_M=128, BLOCK_N=64, SPLIT_K=split, SWAP_AB=True, num_warps=4, num_stages=4, GROUP_M=1,
               ACC_TILE=True, SWORD=False, **MID_FLAGS)
    if split == 1:
        cfg.update(hybrid_split(n_tiles, m_tiles, k_tiles, MID_CTAS_PER_SM * n_sm))
    return cfg


def hybrid_split(n_tiles: int, m_tiles: int, k_tiles: int, slots: int) -> dict:
    """``{SPLIT_K: 2, HYB_FULL: f}`` when the tiles overflow whole waves of ``slots`` resident programs by at most
    half a wave (the remainder's tiles then run split-K 2 behind the whole waves), else ``{}``."""
    if n_tiles * m_tiles <= slots or k_tiles < 8:
        return {}
    full = (n_tiles * m_tiles // slots) * slots // m_tiles  # whole n-tiles per m-tile row
    rest = (n_tiles - full) * m_tiles
    return {"SPLIT_K": 2, "HYB_FULL": full} if 0 < rest and 2 * rest <= slots else {}


# The PTX of the two LUT steps (one copy: session 28's Gluon probe kernel, benchmarks/device/w4a8_gluon_kernel.py,
# imports them too).
FP8_LUT_PTX = """{
        .reg .b32 s2, k, m;
        .reg .b16 c0, c1, c2, c3;
        mov.b32 s2, {$2, $2};
        mov.b32 k, 0x3C000000;
        mul.rn.f16x2 m, s2, k;
        cvt.rn.satfinite.e4m3x2.f16x2 c0, m;
        mov.b32 k, 0x42004000;
        mul.rn.f16x2 m, s2, k;
        cvt.rn.satfinite.e4m3x2.f16x2 c1, m;
        mov.b32 k, 0x45004400;
        mul.rn.f16x2 m, s2, k;
        cvt.rn.satfinite.e4m3x2.f16x2 c2, m;
        mov.b32 k, 0x47004600;
        mul.rn.f16x2 m, s2, k;
        cvt.rn.satfinite.e4m3x2.f16x2 c3, m;
        mov.b32 $0, {c0, c1};
        mov.b32 $1, {c2, c3};
        }"""
FP8_LOOKUP2_PTX = """{
        .reg .b32 m, d, sg;
        and.b32 m, $2, 0x77777777;
        prmt.b32 d, $3, $7, m;
        and.b32 sg, $2, 0x80808080;
        xor.b32 $0, d, sg;
        shr.b32 m, m, 16;
        prmt.b32 d, $11, $15, m;
        shl.b32 sg, $2, 4;
        and.b32 sg, sg, 0x80808080;
        xor.b32 $1, d, sg;
        }"""
FP8_LOOKUP2_CONS = "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r"
_LUT_C = tl.constexpr(FP8_LUT_PTX)
_LOOKUP2_C = tl.constexpr(FP8_LOOKUP2_PTX)
_LOOKUP2_CONS_C = tl.constexpr(FP8_LOOKUP2_CONS)


# ------------------------------------------------------------------------------------ kernel
@triton.jit
def _fp8_lut(sig):
    """sigma (fp16, any shape) -> the 8-byte LUT FP8(k * sigma), k = 0..7, as two int32 words
    (bytes 0..3 = k 0..3, bytes 4..7 = k 4..7). k*sigma is exact in fp16 (<= 7 significant bits,
    <= 3136); ``cvt.rn.satfinite`` rounds to nearest even and clamps to 448 like the reference."""
    return tl.inline_asm_elementwise(asm=_LUT_C, constraints="=r,=r,h", args=[sig], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=1)


@triton.jit
def _fp8_lookup(p, l0, l1, HI: tl.constexpr):
    """Packed code bytes ``p`` (uint8, 4 per asm instance = one 32-bit word of 8 weights) -> the 4
    FP8 weights of its lo (``HI=False``) or hi columns: PRMT over the LUT {l1:l0} with the 3-bit
    magnitudes as selectors, then XOR in the sign bits (layout in lowbit.formats.w4a8_fp8)."""
    if HI:
        out = tl.inline_asm_elementwise(
            """{
            .reg .b32 sel, d, sg;
            shr.b32 sel, $1, 16;
            and.b32 sel, sel, 0x7777;
            prmt.b32 d, $2, $6, sel;
            shl.b32 sg, $1, 4;
            and.b32 sg, sg, 0x80808080;
            xor.b32 $0, d, sg;
            }""", "=r,r,r,r,r,r,r,r,r,r", [p, l0, l1], dtype=tl.float8e4nv, is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(
            """{
            .reg .b32 sel, d, sg;
            and.b32 sel, $1, 0x7777;
            prmt.b32 d, $2, $6, sel;
            and.b32 sg, $1, 0x80808080;
            xor.b32 $0, d, sg;
            }""", "=r,r,r,r,r,r,r,r,r,r", [p, l0, l1], dtype=tl.float8e4nv, is_pure=True, pack=4)
    return out


@triton.jit
def _fp8_lookup2(p, l0, l1, h0, h1):
    """Both halves of packed code bytes ``p`` in one asm instance (4 bytes = 8 weights): one AND
    masks all 8 magnitudes (``w & 0x77777777``), the hi selectors are that >> 16, so per 8 weights
    AND, 2 PRMT, SHR, SHL and 2 AND-XOR (fused to LOP3 by ptxas): 7 instructions instead of 8
    (``_fp8_lookup`` twice). LUTs {l1:l0} (lo columns) and {h1:h0} (hi columns)."""
    return tl.inline_asm_elementwise(_LOOKUP2_C, _LOOKUP2_CONS_C, [p, l0, l1, h0, h1],
                                     dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)


@triton.jit
def _dequant_emulated(words, sig, HI: tl.constexpr, BLOCK_N: tl.constexpr):
    """Arithmetic path, same numerics as the LUT (used by the interpreter, which cannot run inline
    PTX, and as config ``LUT=False``): int32 words [BLOCK_N, 16] -> FP8 [BLOCK_N, 64]."""
    i = tl.arange(0, 4)[None, None, :]
    wd = words[:, :, None]
    if HI:
        mag = (wd >> (16 + 4 * i)) & 7
        neg = (wd >> (8 * i + 3)) & 1
    else:
        mag = (wd >> (4 * i)) & 7
        neg = (wd >> (8 * i + 7)) & 1
    mag = tl.reshape(mag, [BLOCK_N, 64]).to(tl.float32)
    neg = tl.reshape(neg, [BLOCK_N, 64])
    v = round_to_fp8_e4m3(tl.minimum(mag * sig.to(tl.float32), 448.0))
    v = tl.where(neg != 0, -v, v)
    return v.to(tl.float8e4nv)


@triton.jit
def _epilogue(acc, sx, offs_m, offs_n, pid_n, M, N, N_OUT, inv_delta,
              Bias, Res, C, stride_rm, stride_cm,
              BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 of weight rows offs_n, per-token scales sx [BLOCK_M] of output
    rows offs_m (>= M: masked) -> scaled, activated, stored output."""
    mask_m = offs_m < M
    y = acc * (sx * inv_delta)[:, None]
    if HAS_BIAS:
        b = tl.load(Bias + offs_n, mask=offs_n < N, other=0.0)
        y += b.to(tl.float32)[None, :]
    if SILU_MUL:
        gate, up = tl.split(tl.reshape(y, [y.shape[0], BLOCK_N // 2, 2]))
        y = silu_mul_f32(gate, up, C.dtype.element_ty, False)  # the eager model's roundings
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        cols = offs_n
    mask = mask_m[:, None] & (cols < N_OUT)[None, :]
    if HAS_RES:
        r = tl.load(Res + offs_m[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=mask, other=0.0)
        y = y.to(C.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + cols[None, :], y.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _byte_to_fp16(wd, shift):
    """Byte ``(wd >> shift) & 0xFF`` of int32 words, read as FP8 E4M3, as fp16 (exact)."""
    return ((wd >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _load_scales_word(s_words, kt, mask_n, offs_h, GROUP: tl.constexpr):
    """As ``_load_scales``, from one 4-byte load per row (the aligned word holding the tile's
    groups; 4 bytes is the smallest load cp.async pipelines) and shifts: a few integer ops per
    tile instead of a 16-byte chunk reduced over 16 lanes."""
    if GROUP == 128:
        wd = tl.load(s_words + kt // 4, mask=mask_n, other=0)
        s_lo = _byte_to_fp16(wd, (kt % 4) * 8)[:, None]
        s_hi = s_lo
    elif GROUP == 64:
        wd = tl.load(s_words + kt // 2, mask=mask_n, other=0)
        s_lo = _byte_to_fp16(wd, (kt % 2) * 16)[:, None]
        s_hi = _byte_to_fp16(wd, (kt % 2) * 16 + 8)[:, None]
    else:  # GROUP == 32: the tile's 4 groups = the word; columns 0-31 / 32-63 of each half
        wd = tl.load(s_words + kt, mask=mask_n, other=0)
        first = (offs_h < 32)[None, :]
        s_lo = tl.where(first, _byte_to_fp16(wd, 0)[:, None], _byte_to_fp16(wd, 8)[:, None])
        s_hi = tl.where(first, _byte_to_fp16(wd, 16)[:, None], _byte_to_fp16(wd, 24)[:, None])
    return s_lo, s_hi


@triton.jit
def _load_scales(s_rows, kt, mask_n, offs_h, GROUP: tl.constexpr):
    """FP8 group scales of K tile ``kt`` as fp16, for the lo and hi halves: ``[BLOCK_N, 1]`` when
    GROUP >= 64, per column ``[BLOCK_N, 64]`` for GROUP = 32.

    The scales are loaded as one 16-byte chunk per row (16 consecutive groups; rows are padded to a
    multiple of 16 groups) and the wanted group picked in registers: a 1- or 2-byte load cannot go
    through cp.async, so Triton would not pipeline it and every iteration would stall on it.
    """
    j = tl.arange(0, 16)[None, :]
    if GROUP == 128:
        g = kt
    elif GROUP == 64:
        g = 2 * kt
    else:
        g = 4 * kt
    c = (g // 16) * 16
    chunk = tl.load(s_rows[:, None] + c + j, mask=mask_n[:, None], other=0.0).to(tl.float32)
    r = g % 16
    if GROUP == 128:
        s_lo = tl.sum(tl.where(j == r, chunk, 0.0), axis=1).to(tl.float16)[:, None]
        s_hi = s_lo
    elif GROUP == 64:
        s_lo = tl.sum(tl.where(j == r, chunk, 0.0), axis=1).to(tl.float16)[:, None]
        s_hi = tl.sum(tl.where(j == r + 1, chunk, 0.0), axis=1).to(tl.float16)[:, None]
    else:  # GROUP == 32: the tile's 4 groups; columns 0-31 / 32-63 of each half
        s0 = tl.sum(tl.where(j == r, chunk, 0.0), axis=1)[:, None]
        s1 = tl.sum(tl.where(j == r + 1, chunk, 0.0), axis=1)[:, None]
        s2 = tl.sum(tl.where(j == r + 2, chunk, 0.0), axis=1)[:, None]
        s3 = tl.sum(tl.where(j == r + 3, chunk, 0.0), axis=1)[:, None]
        first = (offs_h < 32)[None, :]
        s_lo = tl.where(first, s0, s1).to(tl.float16)
        s_hi = tl.where(first, s2, s3).to(tl.float16)
    return s_lo, s_hi


@triton.jit
def _dequant_tile(b_rows, w_rows, s_rows, s_words, kt, mask_n, offs_h, b_desc, n0, Bq, k_tiles,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, LUT: tl.constexpr, SWORD: tl.constexpr,
                  TMA: tl.constexpr, TILED: tl.constexpr, LUT2: tl.constexpr = False):
    """K tile ``kt`` of ``BLOCK_N`` weight rows (from row ``n0``) -> FP8 (w_lo, w_hi), each
    ``[BLOCK_N, 64]``: the columns ``128 kt + j`` and ``128 kt + 64 + j``. ``TILED``: the codes are
    tile-major (``lowbit.formats.w4a8_fp8.tile_codes``): the tile is BLOCK_N contiguous 64-byte rows
    of the 128-row block of ``n0`` (BLOCK_N divides 128)."""
    if SWORD:
        s_lo, s_hi = _load_scales_word(s_words, kt, mask_n, offs_h, GROUP)
    else:
        s_lo, s_hi = _load_scales(s_rows, kt, mask_n, offs_h, GROUP)
    if TILED:
        t_row = ((n0 // TILE_N) * k_tiles + kt) * TILE_N + n0 % TILE_N  # first code row of the tile
        t_rows = (t_row + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
        b_rows = Bq + t_rows * HALF_K
        w_rows = Bq.to(tl.pointer_type(tl.int32)) + t_rows * (HALF_K // 4) - kt * 16
        if TMA:
            p = b_desc.load([t_row, 0])
    elif TMA:  # [BLOCK_N, 64] code bytes by the tensor-memory accelerator (rows >= N read as 0)
        p = b_desc.load([n0, kt * HALF_K])
    if not LUT:
        if TMA:
            b4 = tl.reshape(p, [BLOCK_N, 16, 4]).to(tl.int32)
            sh = (8 * tl.arange(0, 4))[None, None, :]
            wrd = tl.sum(b4 << sh, axis=2)
        else:
            wrd = tl.load(w_rows + (kt * 16 + tl.arange(0, 16))[None, :], mask=mask_n[:, None], other=0)
        w_lo = _dequant_emulated(wrd, s_lo, False, BLOCK_N)
        w_hi = _dequant_emulated(wrd, s_hi, True, BLOCK_N)
    else:
        if TILED and not TMA:
            p = tl.load(b_rows + offs_h[None, :], mask=mask_n[:, None], other=0)
        elif not TMA:
            p = tl.load(b_rows + (kt * HALF_K + offs_h)[None, :], mask=mask_n[:, None], other=0)
        l0, l1 = _fp8_lut(s_lo)
        if LUT2:  # both halves in one asm instance (7 instructions per 8 weights)
            if GROUP > HALF_K:
                h0, h1 = l0, l1
            else:
                h0, h1 = _fp8_lut(s_hi)
            w_lo, w_hi = _fp8_lookup2(p, tl.broadcast_to(l0, p.shape), tl.broadcast_to(l1, p.shape),
                                      tl.broadcast_to(h0, p.shape), tl.broadcast_to(h1, p.shape))
        else:
            w_lo = _fp8_lookup(p, tl.broadcast_to(l0, p.shape), tl.broadcast_to(l1, p.shape), False)
            if GROUP > HALF_K:  # same group for both halves: reuse the LUT
                w_hi = _fp8_lookup(p, tl.broadcast_to(l0, p.shape), tl.broadcast_to(l1, p.shape), True)
            else:
                h0, h1 = _fp8_lut(s_hi)
                w_hi = _fp8_lookup(p, tl.broadcast_to(h0, p.shape), tl.broadcast_to(h1, p.shape), True)
    return w_lo, w_hi


@triton.jit
def _quant_rows(v, s, r, QROWS: tl.constexpr, RSTEP: tl.constexpr, BLOCK_M: tl.constexpr, EMU: tl.constexpr):
    """fp32 ``v [QROWS, C]`` / per-row scale ``s [QROWS]`` -> FP8 ``[BLOCK_M, C]``: the numerics of
    ``lowbit.kernels.act_quant`` (IEEE division, clamp to +-448, RNE cast). With ``QROWS <
    BLOCK_M`` row r lands on tile row ``r * BLOCK_M / QROWS`` and the rows between are zero, so the
    division runs on the real rows only (decode: 1 row, not the 16 of the smallest wgmma tile).

    The correctly rounded quotient v / s without a division per element: ``r`` = 1/s correctly
    rounded (one division per row), ``y0 = v r`` (within ~2 ulp), then two Markstein corrections
    ``y <- fma(fma(-s, y, v), r, y)``: the first makes y faithful, so the second's remainder is
    exact and y the IEEE quotient (checked against exact rational arithmetic on 60k cases,
    tests/test_w4a8_fp8_paths.py). 5 FP32 ops instead of ~10 and a slow-path check. The
    interpreter's fma is not fused, so it divides (``EMU``)."""
    if EMU:
        y = tl.div_rn(v, s[:, None])
    else:
        sb = s[:, None]
        rb = r[:, None]
        y = v * rb
        y = tl.fma(tl.fma(-sb, y, v), rb, y)
        y = tl.fma(tl.fma(-sb, y, v), rb, y)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if EMU:  # the interpreter mis-rounds fp32->fp8 across a binade: round exactly first
        y = round_to_fp8_e4m3(y)
    q = y.to(tl.float8e4nv)
    if QROWS < BLOCK_M:
        qi = q.to(tl.int8, bitcast=True)
        qe = tl.reshape(tl.broadcast_to(qi[:, None, :], [QROWS, RSTEP, HALF_K]), [BLOCK_M, HALF_K])
        keep = (tl.arange(0, BLOCK_M) % RSTEP == 0)[:, None]
        q = tl.where(keep, qe, 0).to(tl.float8e4nv, bitcast=True)
    return q


@triton.jit
def _tile_offsets(pid_m, pid_n, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QROWS: tl.constexpr,
                  RSTEP: tl.constexpr):
    """x rows (M where the tile row holds none) and weight rows of output tile (pid_m, pid_n)."""
    i_m = tl.arange(0, BLOCK_M)
    row_of = pid_m * QROWS + i_m // RSTEP
    offs_m = tl.where((i_m % RSTEP == 0) & (row_of < M), row_of, M)  # tile row -> x row (M: none)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n


@triton.jit
def _gemm_tile(
    A, A_scale, Bq, B_scale, Bdesc, Adesc, M, N, K, amax_eps, stride_am, stride_bn, stride_sn,
    pid_m, pid_n, pid_k, kt0, kt1,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, LUT: tl.constexpr, IMPRECISE: tl.constexpr, ACC_TILE: tl.constexpr,
    QUANT_A: tl.constexpr, QROWS: tl.constexpr, RSTEP: tl.constexpr, QCH: tl.constexpr, QWIDE: tl.constexpr,
    W_FP8: tl.constexpr, SK_SEM: tl.constexpr, EMU: tl.constexpr, SWORD: tl.constexpr, KSTEP: tl.constexpr,
    TMA: tl.constexpr, TILED: tl.constexpr, LUT2: tl.constexpr, CAT: tl.constexpr = False,
    DEFER: tl.constexpr = False, XTMA: tl.constexpr = False,
):
    """K tiles [kt0, kt1) of output tile (pid_m, pid_n) -> (acc [BLOCK_M, BLOCK_N] fp32 before
    scaling, the tile rows' per-token scales sx [BLOCK_M])."""
    k_tiles = tl.cdiv(K, 2 * HALF_K)
    offs_m, offs_n = _tile_offsets(pid_m, pid_n, M, BLOCK_M, BLOCK_N, QROWS, RSTEP)
    offs_h = tl.arange(0, HALF_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = A + offs_m[:, None].to(tl.int64) * stride_am
    b_rows = Bq + offs_n[:, None].to(tl.int64) * stride_bn
    w_rows = Bq.to(tl.pointer_type(tl.int32)) + offs_n[:, None].to(tl.int64) * (stride_bn // 4)
    s_rows = B_scale + offs_n.to(tl.int64) * stride_sn
    s_words = B_scale.to(tl.pointer_type(tl.int32)) + offs_n.to(tl.int64) * (stride_sn // 4)

    if QUANT_A:
        # fused per-token FP8 quantization of x (float): absmax of the QROWS real rows over the
        # whole K (x is a few KB, L2-resident), the scale rule of lowbit.formats.common, then every
        # K tile is quantized in registers in the main loop
        offs_q = pid_m * QROWS + tl.arange(0, QROWS)
        mask_q = offs_q < M
        q_rows = A + offs_q[:, None].to(tl.int64) * stride_am
        # [QROWS, 64] pieces, QCH / 64 of them unrolled per iteration (independent loads in flight;
        # the same layout as the main loop's x tiles, so the scale needs no replicated layout there)
        if QWIDE:  # [QROWS, QCH] loads: few rows, wide coalesced loads (decode)
            amax_t = tl.zeros([QROWS, QCH], dtype=tl.float32)
            bad_t = tl.zeros([QROWS, QCH], dtype=tl.int32)
            for c0 in range(0, K, QCH):
                kk = c0 + tl.arange(0, QCH)
                v = tl.load(q_rows + kk[None, :], mask=mask_q[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
                av = tl.abs(v)
                amax_t = tl.maximum(amax_t, av)
                bad_t = bad_t | ((av == float("inf")) | (v != v)).to(tl.int32)
        else:
            amax_t = tl.zeros([QROWS, HALF_K], dtype=tl.float32)
            bad_t = tl.zeros([QROWS, HALF_K], dtype=tl.int32)
            for c0 in range(0, K, QCH):
                for u in tl.static_range(QCH // HALF_K):
                    kk = c0 + u * HALF_K + offs_h
                    v = tl.load(q_rows + kk[None, :], mask=mask_q[:, None] & (kk < K)[None, :],
                                other=0.0).to(tl.float32)
                    av = tl.abs(v)
                    amax_t = tl.maximum(amax_t, av)
                    bad_t = bad_t | ((av == float("inf")) | (v != v)).to(tl.int32)
        amax = tl.max(amax_t, axis=1)
        amax = tl.where(tl.max(bad_t, axis=1) > 0, float("nan"), amax)  # NaN/Inf row -> NaN scale -> NaN row
        sxq = tl.div_rn(tl.maximum(amax, amax_eps, propagate_nan=tl.PropagateNan.ALL), FP8_MAX)
        rxq = tl.div_rn(tl.full([QROWS], 1.0, tl.float32), sxq)
        # x of the first K tile, loaded one iteration ahead in the loop (register prefetch: these
        # loads feed ALU work, not the dot, so the pipeliner does not prefetch them)
        k_lo = kt0 * 2 * HALF_K + offs_h
        nv_lo = tl.load(q_rows + k_lo[None, :], mask=mask_q[:, None] & (k_lo < K)[None, :], other=0.0)
        nv_hi = tl.load(q_rows + HALF_K + k_lo[None, :], mask=mask_q[:, None] & (k_lo + HALF_K < K)[None, :],
                        other=0.0)
        if SPLIT_K > 1 and not SK_SEM:
            if (pid_n == 0) & (pid_k == 0):  # the reduce kernel's scales
                tl.store(A_scale + offs_q, sxq, mask=mask_q)

    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if DEFER:
        prev = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kt_s in range(kt0, kt1, KSTEP):
        for u in tl.static_range(KSTEP):  # KSTEP K tiles per iteration: KSTEP x 64 B per code row
            kt = kt_s + u
            k0 = kt * 2 * HALF_K
            # activations: two 64-wide halves of the K tile (masked beyond K and M)
            k_lo = k0 + offs_h
            k_hi = k0 + HALF_K + offs_h
            if KSTEP > 1:  # the last step may run past this split's K tiles
                kmask_lo = (k_lo < K) & (kt < kt1)
                kmask_hi = (k_hi < K) & (kt < kt1)
                wmask_n = mask_n & (kt < kt1)
            else:
                kmask_lo = k_lo < K
                kmask_hi = k_hi < K
                wmask_n = mask_n
            if QUANT_A:
                v_lo = nv_lo
                v_hi = nv_hi
                nk_lo = k_lo + 2 * HALF_K
                pmask = mask_q[:, None] & (kt + 1 < kt1)
                nv_lo = tl.load(q_rows + nk_lo[None, :], mask=pmask & (nk_lo < K)[None, :], other=0.0)
                nv_hi = tl.load(q_rows + HALF_K + nk_lo[None, :], mask=pmask & (nk_lo + HALF_K < K)[None, :], other=0.0)
                a_lo = _quant_rows(v_lo.to(tl.float32), sxq, rxq, QROWS, RSTEP, BLOCK_M, EMU)
                a_hi = _quant_rows(v_hi.to(tl.float32), sxq, rxq, QROWS, RSTEP, BLOCK_M, EMU)
            elif CAT:  # the whole K tile in one piece (k_lo, k_hi contiguous)
                k_all = k0 + tl.arange(0, 2 * HALF_K)
                kmask = k_all < K
                if KSTEP > 1:
                    kmask = kmask & (kt < kt1)
                if XTMA:  # [BLOCK_M, 128] box by the tensor-memory accelerator (rows >= M, columns >= K read as 0)
                    a_all = Adesc.load([pid_m * BLOCK_M, k0])
                else:
                    a_all = tl.load(a_rows + k_all[None, :], mask=mask_m[:, None] & kmask[None, :], other=0.0)
            else:
                a_lo = tl.load(a_rows + k_lo[None, :], mask=mask_m[:, None] & kmask_lo[None, :], other=0.0)
                a_hi = tl.load(a_rows + k_hi[None, :], mask=mask_m[:, None] & kmask_hi[None, :], other=0.0)
            if W_FP8:  # weights already dequantized to FP8 [N, Kp] (large-M path): plain FP8 GEMM
                w_lo = tl.load(b_rows + (k0 + offs_h)[None, :], mask=wmask_n[:, None], other=0.0)
                w_hi = tl.load(b_rows + (k0 + HALF_K + offs_h)[None, :], mask=wmask_n[:, None], other=0.0)
            else:  # packed INT4 codes (padded to the 128-block: no K mask) -> FP8 through the LUT
                w_lo, w_hi = _dequant_tile(b_rows, w_rows, s_rows, s_words, kt, wmask_n, offs_h, Bdesc,
                                            pid_n * BLOCK_N, Bq, k_tiles, GROUP, BLOCK_N, LUT, SWORD, TMA, TILED,
                                            LUT2)
            if CAT:  # one K=128 dot per tile: [w_lo | w_hi] (columns in order) against the whole x tile
                if QUANT_A:
                    a_all = tl.reshape(tl.permute(tl.join(a_lo, a_hi), (0, 2, 1)), [BLOCK_M, 2 * HALF_K])
                w_all = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 2, 1)), [BLOCK_N, 2 * HALF_K])
                if DEFER:  # (swap-AB, ACC_TILE) add the PREVIOUS tile's product: those FADDs do not
                    # depend on this tile's wgmma, so they fill its issue-to-wait shadow (the SASS still waits
                    # for all wgmma each tile, gsb0 0x0)
                    part = tl.dot(w_all, tl.trans(a_all), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
                    acc += prev
                    prev = part
                elif ACC_TILE:
                    if SWAP_AB:
                        acc += tl.dot(w_all, tl.trans(a_all), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
                    else:
                        acc += tl.dot(a_all, tl.trans(w_all), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
                elif SWAP_AB:
                    acc = tl.dot(w_all, tl.trans(a_all), acc, max_num_imprecise_acc=IMPRECISE)
                else:
                    acc = tl.dot(a_all, tl.trans(w_all), acc, max_num_imprecise_acc=IMPRECISE)
            elif ACC_TILE:  # fast FP8 accumulation within the K tile, promoted to FP32 once per tile
                if SWAP_AB:
                    part = tl.dot(w_lo, tl.trans(a_lo), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
                    part = tl.dot(w_hi, tl.trans(a_hi), part)
                else:
                    part = tl.dot(a_lo, tl.trans(w_lo), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
                    part = tl.dot(a_hi, tl.trans(w_hi), part)
                acc += part
            elif SWAP_AB:
                acc = tl.dot(w_lo, tl.trans(a_lo), acc, max_num_imprecise_acc=IMPRECISE)
                acc = tl.dot(w_hi, tl.trans(a_hi), acc, max_num_imprecise_acc=IMPRECISE)
            else:
                acc = tl.dot(a_lo, tl.trans(w_lo), acc, max_num_imprecise_acc=IMPRECISE)
                acc = tl.dot(a_hi, tl.trans(w_hi), acc, max_num_imprecise_acc=IMPRECISE)
    if DEFER:
        acc += prev
    if SWAP_AB:
        acc = tl.trans(acc)

    if QUANT_A:
        sx = tl.reshape(tl.broadcast_to(sxq[:, None], [QROWS, RSTEP]), [BLOCK_M])
    else:
        sx = tl.load(A_scale + offs_m, mask=mask_m, other=0.0)
    return acc, sx


@triton.jit
def _w4a8_fp8_gemm_kernel(
    # pointers
    A, A_scale, Bq, B_scale, Bias, Res, C, Ws, Lock, Bdesc, Adesc,
    # sizes / scalars
    M, N, K, N_OUT, inv_delta, amax_eps,
    # strides (last dims contiguous)
    stride_am, stride_bn, stride_sn, stride_rm, stride_cm,
    # constexpr flags
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SILU_MUL: tl.constexpr, LUT: tl.constexpr, IMPRECISE: tl.constexpr, ACC_TILE: tl.constexpr,
    QUANT_A: tl.constexpr, QROWS: tl.constexpr, RSTEP: tl.constexpr, QCH: tl.constexpr, QWIDE: tl.constexpr, W_FP8: tl.constexpr,
    SK_SEM: tl.constexpr, EMU: tl.constexpr, SWORD: tl.constexpr, KSTEP: tl.constexpr, TMA: tl.constexpr,
    TILED: tl.constexpr, LUT2: tl.constexpr, PDL: tl.constexpr, PDL_TRIGGER: tl.constexpr, CAT: tl.constexpr,
    DEFER: tl.constexpr = False, HYBRID: tl.constexpr = False, HYB_FULL=0, XTMA: tl.constexpr = False,
):
    pdl_prologue(PDL, PDL_TRIGGER)  # PDL launch: wait for the producer of x / sx before any load
    k_tiles = tl.cdiv(K, 2 * HALF_K)
    num_m = tl.cdiv(M, QROWS)
    # ---- tile indices (grouped ordering along M for L2 reuse of the weight tiles). A program
    # covers QROWS rows of x (= BLOCK_M unless QUANT_A packs fewer rows into the tile).
    pid = tl.program_id(0)
    pid_k = tl.program_id(2)
    num_n = tl.num_programs(1)
    if GROUP_M > 1:
        pid_n_all = tl.program_id(1)
        lin = pid_n_all * num_m + pid
        width = GROUP_M * num_n
        gid = lin // width
        first_m = gid * GROUP_M
        gsz = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (lin % width) % gsz
        pid_n = (lin % width) // gsz
    else:
        pid_m = pid
        pid_n = tl.program_id(1)
    per = tl.cdiv(k_tiles, SPLIT_K)
    is_full = False
    if HYBRID:  # (GROUP_M == 1) n-tiles < HYB_FULL whole (no split), then SPLIT_K programs per n-tile
        p = tl.program_id(1)
        is_full = p < HYB_FULL
        t = tl.maximum(p - HYB_FULL, 0)
        pid_n = tl.where(is_full, p, HYB_FULL + t // SPLIT_K)
        pid_k = tl.where(is_full, 0, t % SPLIT_K)
    kt0 = pid_k * per
    kt1 = tl.minimum(kt0 + per, k_tiles)
    if HYBRID:
        kt1 = tl.where(is_full, k_tiles, kt1)
    acc, sx = _gemm_tile(A, A_scale, Bq, B_scale, Bdesc, Adesc, M, N, K, amax_eps, stride_am, stride_bn, stride_sn,
                         pid_m, pid_n, pid_k, kt0, kt1, GROUP, BLOCK_M, BLOCK_N, SPLIT_K, SWAP_AB, LUT, IMPRECISE,
                         ACC_TILE, QUANT_A, QROWS, RSTEP, QCH, QWIDE, W_FP8, SK_SEM, EMU, SWORD, KSTEP, TMA, TILED,
                         LUT2, CAT, DEFER, XTMA)
    offs_m, offs_n = _tile_offsets(pid_m, pid_n, M, BLOCK_M, BLOCK_N, QROWS, RSTEP)
    if HYBRID:
        if is_full:
            _epilogue(acc, sx, offs_m, offs_n, pid_n, M, N, N_OUT, inv_delta, Bias, Res, C, stride_rm, stride_cm,
                      BLOCK_N, HAS_BIAS, HAS_RES, SILU_MUL)
        else:
            _split_finish(acc, sx, offs_m, offs_n, pid_m, pid_n, pid_k, num_n, M, N, N_OUT, inv_delta, Bias, Res, C,
                          Ws, Lock, stride_rm, stride_cm, BLOCK_M, BLOCK_N, SPLIT_K, SK_SEM, HAS_BIAS, HAS_RES,
                          SILU_MUL)
    elif SPLIT_K > 1:
        _split_finish(acc, sx, offs_m, offs_n, pid_m, pid_n, pid_k, num_n, M, N, N_OUT, inv_delta, Bias, Res, C,
                      Ws, Lock, stride_rm, stride_cm, BLOCK_M, BLOCK_N, SPLIT_K, SK_SEM, HAS_BIAS, HAS_RES, SILU_MUL)
    else:
        _epilogue(acc, sx, offs_m, offs_n, pid_n, M, N, N_OUT, inv_delta, Bias, Res, C, stride_rm, stride_cm,
                  BLOCK_N, HAS_BIAS, HAS_RES, SILU_MUL)


@triton.jit
def _split_finish(acc, sx, offs_m, offs_n, pid_m, pid_n, pid_k, num_n, M, N, N_OUT, inv_delta, Bias, Res, C, Ws, Lock,
                  stride_rm, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                  SK_SEM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr):
    """A split-K partial -> the fp32 workspace ``Ws [SPLIT_K, M, N]``; with ``SK_SEM`` (single-launch split-K) the
    last program of the tile to arrive (atomic counter) sums the partials in split order (deterministic), runs the
    epilogue and resets the counter; otherwise ``_splitk_reduce_kernel`` does that in a second launch."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    ws = Ws + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    wmask = mask_m[:, None] & mask_n[None, :]
    tl.store(ws + pid_k.to(tl.int64) * M * N, acc, mask=wmask)
    if SK_SEM:
        tl.debug_barrier()
        tile = pid_m * num_n + pid_n
        cnt = tl.atomic_add(Lock + tile, 1, sem="acq_rel")
        if cnt == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(ws + s * M * N, mask=wmask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(Lock + tile, 0)
            _epilogue(acc, sx, offs_m, offs_n, pid_n, M, N, N_OUT, inv_delta, Bias, Res, C, stride_rm,
                      stride_cm, BLOCK_N, HAS_BIAS, HAS_RES, SILU_MUL)


@triton.jit
def _splitk_reduce_kernel(
    Ws, A_scale, Bias, Res, C,
    M, N, N_OUT, inv_delta,
    stride_rm, stride_cm,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptr = Ws + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(ptr + s * M * N, mask=mask, other=0.0)
    sx = tl.load(A_scale + offs_m, mask=offs_m < M, other=0.0)
    _epilogue(acc, sx, offs_m, offs_n, tl.program_id(1), M, N, N_OUT, inv_delta, Bias, Res, C,
              stride_rm, stride_cm, BLOCK_N, HAS_BIAS, HAS_RES, SILU_MUL)


@triton.jit
def _dequant_fp8_kernel(
    Bq, B_scale, Out, Offsets,  # pointers: codes, FP8 group scales, FP8 [N, Kp] output (, routed rows' offsets)
    N, stride_bn, stride_sn, stride_on,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, LUT: tl.constexpr, SWORD: tl.constexpr, TILED: tl.constexpr,
    EXPERTS: tl.constexpr = False,
):
    """One 128-column block of BLOCK_N rows: INT4 codes -> FP8(q * sigma), the GEMM's own values. ``EXPERTS``
    (session 41, the MoE prefill form): grid axis 2 = expert ``e``, ``Bq`` / ``B_scale`` int64 tables of the experts'
    codes / scales addresses (``moe_grouped.address_table``), ``Out`` ``[E, N, Kp]``; an expert that owns no rows
    (``Offsets[e + 1] == Offsets[e]``) writes nothing."""
    kt = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_K)
    mask_n = offs_n < N
    if EXPERTS:
        e = tl.program_id(2)
        mask_n = mask_n & (tl.load(Offsets + e + 1) > tl.load(Offsets + e))
        Bq = tl.multiple_of(tl.load(Bq + e).to(tl.pointer_type(tl.uint8)), 16)
        B_scale = tl.multiple_of(tl.load(B_scale + e).to(tl.pointer_type(tl.float8e4nv)), 16)
        Out += e.to(tl.int64) * N * stride_on
    b_rows = Bq + offs_n[:, None].to(tl.int64) * stride_bn
    w_rows = Bq.to(tl.pointer_type(tl.int32)) + offs_n[:, None].to(tl.int64) * (stride_bn // 4)
    s_rows = B_scale + offs_n.to(tl.int64) * stride_sn
    s_words = B_scale.to(tl.pointer_type(tl.int32)) + offs_n.to(tl.int64) * (stride_sn // 4)
    w_lo, w_hi = _dequant_tile(b_rows, w_rows, s_rows, s_words, kt, mask_n, offs_h, Bq, tl.program_id(0) * BLOCK_N,
                               Bq, tl.num_programs(1), GROUP, BLOCK_N, LUT, SWORD, False, TILED)
    o_rows = Out + offs_n[:, None].to(tl.int64) * stride_on + kt * 2 * HALF_K
    tl.store(o_rows + offs_h[None, :], w_lo, mask=mask_n[:, None])
    tl.store(o_rows + HALF_K + offs_h[None, :], w_hi, mask=mask_n[:, None])


# ------------------------------------------------------------------------------------ launchers
_SCALE_B: dict = {}


def _use_lut(cfg: dict) -> bool:
    return cfg.get("LUT", os.environ.get("LOWBIT_W4A8_LUT", "1") != "0") and not interpret_mode()


def dequantize_to_fp8(codes: torch.Tensor, scales: torch.Tensor, k: int, group_size: int, *,
                      block_n: int = 64, tiled: bool = False, out: torch.Tensor | None = None,
                      num_warps: int = 4) -> torch.Tensor:
    """Packed weight -> FP8 E4M3 ``[N, Kp]`` holding FP8(q * sigma) (columns >= k are 0): the
    values the fused kernel builds in registers, written once for a plain FP8 GEMM (large M).
    ``tiled``: tile-major codes (N from ``scales``). ``out``: an FP8 ``[N, Kp]`` buffer to write
    (unit column stride; e.g. a reused buffer that stays in L2)."""
    N = scales.shape[0] if tiled else codes.shape[0]
    kp = padded_k(k)
    if out is None:
        out = torch.empty((N, kp), dtype=FP8_E4M3, device=codes.device)
    else:
        check_tensor(out, "out", dtype=FP8_E4M3, shape=(N, kp))
        if out.stride(1) != 1:
            raise ValueError(f"out needs unit column stride, got strides {tuple(out.stride())}")
    if N:
        _dequant_fp8_kernel[(cdiv(N, block_n), kp // BLOCK_K)](
            codes, scales, out, None, N, codes.stride(0), scales.stride(0), out.stride(0),
            GROUP=group_size, BLOCK_N=block_n, LUT=_use_lut({}), SWORD=True, TILED=tiled, num_warps=num_warps)
    return out


def dequantize_experts_to_fp8(codes: list[torch.Tensor], scales: list[torch.Tensor], offsets: torch.Tensor, k: int,
                              group_size: int, *, block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """``dequantize_to_fp8`` of ``E`` experts' row-major codes in one launch (session 41, the MoE prefill form):
    FP8 ``[E, N, Kp]``; experts that own no routed rows (``offsets`` int32 ``[E + 1]``) are left unwritten. The
    experts' codes / scales share one shape and stride (``lowbit.nn.moe._uniform``)."""
    from lowbit.kernels.moe_grouped import address_table

    E, N = len(codes), codes[0].shape[0]
    kp = padded_k(k)
    out = torch.empty((E, N, kp), dtype=FP8_E4M3, device=codes[0].device)
    if E and N:
        _dequant_fp8_kernel[(cdiv(N, block_n), kp // BLOCK_K, E)](
            address_table(codes), address_table(scales), out, offsets, N, codes[0].stride(0), scales[0].stride(0),
            kp, GROUP=group_size, BLOCK_N=block_n, LUT=_use_lut({}), SWORD=True, TILED=False, EXPERTS=True,
            num_warps=num_warps)
    return out


def _launch(a, sx, bq, scales, inv_delta, K, group_size, bias, residual, silu_mul, out_dtype, cfg, *,
            quant_a: bool, w_fp8: bool, tiled: bool = False):
    M = a.shape[0]
    N = scales.shape[0] if tiled else bq.shape[0]
    n_out = N // 2 if silu_mul else N
    out = torch.empty((M, n_out), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out, None
    bm, bn, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT_K"]
    if tiled and _TILE_N % bn:
        raise ValueError(f"tile-major codes need BLOCK_N dividing {_TILE_N}, got config BLOCK_N={bn}")
    split = max(1, min(split, cdiv(K, BLOCK_K)))
    qrows = bm
    if quant_a:
        qrows = min(bm, cfg.get("QROWS") or triton.next_power_of_2(M))
    sk_sem = split > 1 and cfg.get("SK_SEM", True)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    grid = (cdiv(M, qrows), cdiv(N, bn), split)
    hyb_full = int(cfg.get("HYB_FULL", 0))
    hybrid = 0 < hyb_full < grid[1] and split > 1
    if hybrid:  # whole tiles first, then the remaining n-tiles split-K (single launch, last arriver reduces)
        if not sk_sem or cfg.get("GROUP_M", 1) > 1 or quant_a:
            raise ValueError("config HYB_FULL needs single-launch split-K (SK_SEM), GROUP_M 1 and pre-quantized x")
        grid = (grid[0], hyb_full + (grid[1] - hyb_full) * split, 1)
    lock = arrival_counters("w4a8_fp8", a.device, grid[0] * grid[1]) if sk_sem else out  # single-launch split-K
    dummy = sx
    # TMA descriptors (None where TMA cannot read the tensor: the kernel keeps its pointer loads): the packed codes,
    # one [BLOCK_N, 64 B] box per K tile (config TMA); x, one [BLOCK_M, 128] box per K tile (config XTMA: the CAT path
    # with one K tile per step and pre-quantized x)
    bdesc = tma_descriptor(bq, [bn, HALF_K.value]) if cfg.get("TMA", False) and not w_fp8 else None
    use_x = cfg.get("XTMA", False) and not quant_a and cfg.get("CAT") and cfg.get("KSTEP", 1) == 1 and qrows == bm
    adesc = tma_descriptor(a, [bm, 2 * HALF_K.value]) if use_x else None
    tma, xtma = bdesc is not None, adesc is not None
    qwide = cfg.get("QWIDE", False)
    qch = max(HALF_K.value, min(2048 if qwide else 1024, 2048 // qrows))  # prologue columns per iteration
    compiled = _w4a8_fp8_gemm_kernel[grid](
        a, sx, bq, scales, bias if bias is not None else dummy, residual if residual is not None else dummy,
        out, ws, lock, bdesc if tma else bq, adesc if xtma else a,
        M, N, K, n_out, float(inv_delta), AMAX_EPS,
        a.stride(0), bq.stride(0), scales.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, SWAP_AB=cfg["SWAP_AB"],
        GROUP_M=cfg.get("GROUP_M", 1), HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        SILU_MUL=silu_mul, LUT=_use_lut(cfg),
        IMPRECISE=cfg.get("IMPRECISE", None if cfg.get("FAST_ACC", False) else HALF_K.value), ACC_TILE=cfg.get("ACC_TILE", False),
        QUANT_A=quant_a, QROWS=qrows, RSTEP=bm // qrows, QCH=qch, QWIDE=qwide, W_FP8=w_fp8, SK_SEM=sk_sem, EMU=interpret_mode(), SWORD=cfg.get("SWORD", True),
        KSTEP=1 if quant_a else cfg.get("KSTEP", 1), TMA=tma, TILED=tiled, LUT2=bool(cfg.get("LUT2", False)),
        **({"PDL": True, "launch_pdl": True} if pdl_enabled(a, cfg.get("PDL")) else {"PDL": False}),
        PDL_TRIGGER=bool(cfg.get("PDL_TRIGGER", True)), CAT=bool(cfg.get("CAT", False)),
        DEFER=bool(cfg.get("DEFER", False) and cfg.get("CAT") and cfg.get("ACC_TILE") and cfg["SWAP_AB"]) and not quant_a,
        **({"HYBRID": True, "HYB_FULL": hyb_full} if hybrid else {}),
        **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {}),  # register cap (ptxas spills above)
        **({"XTMA": True} if xtma else {}),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split > 1 and not sk_sem:
        rbm, rbn = 16, 128
        _splitk_reduce_kernel[(cdiv(M, rbm), cdiv(N, rbn))](
            ws, sx, bias if bias is not None else dummy, residual if residual is not None else dummy, out,
            M, N, n_out, float(inv_delta),
            residual.stride(0) if residual is not None else 0, out.stride(0),
            SPLIT_K=split, BLOCK_M=rbm, BLOCK_N=rbn,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, SILU_MUL=silu_mul, num_warps=4,
        )
    return out, compiled


def _check_weight(k, codes, scales, group_size, silu_mul, bias, tiled=False):
    check_tensor(codes, "codes", dtype=torch.uint8, ndim=2)
    if tiled:  # tile-major codes: N from the scales
        check_tensor(scales, "scales", dtype=FP8_E4M3, ndim=2)
        N = scales.shape[0]
        if tuple(codes.shape) != tiled_shape(N, k):
            raise ValueError(f"tile-major codes must have shape {list(tiled_shape(N, k))} for {N} rows and "
                             f"in_features={k}, got {list(codes.shape)}")
    else:
        N = codes.shape[0]
    if not tiled and codes.shape[1] != padded_k(k) // 2:
        raise ValueError(f"codes must have shape [N, {padded_k(k) // 2}] for in_features={k}, got {list(codes.shape)}")
    check_tensor(scales, "scales", dtype=FP8_E4M3, shape=(N, scale_cols(k, group_size)))
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    if silu_mul and N % 2:
        raise ValueError(f"silu_mul needs an even number of (interleaved gate/up) rows, got N={N}")
    if bias is not None:
        check_tensor(bias, "bias", shape=(N,))
    return N, N // 2 if silu_mul else N


def _scaled_mm_path(xq, sx, wf, inv_delta, bias, residual, silu_mul, out_dtype):
    """``torch._scaled_mm`` row-wise on the dequantized FP8 weight: scale_a = sx ``[M, 1]``,
    scale_b = delta^-1 ``[1, N]`` (cached), bias in its epilogue; SiLU*mul (+ residual) in one
    Triton pass (``kernels.silu_mul``), a lone residual as an eager add; the reference's roundings."""
    M, N = xq.shape[0], wf.shape[0]
    sa = sx.reshape(M, 1)
    key = (N, float(inv_delta), xq.device.type, xq.device.index)
    sb = _SCALE_B.get(key)
    if sb is None:  # cached: no fill launch per call
        if len(_SCALE_B) > 256:
            _SCALE_B.clear()
        sb = _SCALE_B[key] = torch.full((1, N), float(inv_delta), dtype=torch.float32, device=xq.device)
    y = torch._scaled_mm(xq, wf.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                         bias=None if bias is None else bias.to(torch.bfloat16))
    y = y.to(out_dtype)
    if silu_mul:  # one Triton pass (eager silu(y[:, 0::2]) * y[:, 1::2] moves ~1.7x the bytes)
        return silu_mul_triton(y, residual=residual, out_dtype=out_dtype)
    if residual is not None:
        y = y + residual
    return y


def w4a8_fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  inv_delta: float, k: int, group_size: int, *, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, silu_mul: bool = False,
                  out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None,
                  return_compiled: bool = False, tiled: bool = False, pdl: bool = False,
                  pdl_trigger: bool = True, _checked: bool = False):
    """``xq [M, K]`` fp8, ``sx [M]`` fp32, ``codes [N, Kp/2]`` uint8 (tile-major
    ``lowbit.formats.w4a8_fp8.tile_codes`` with ``tiled=True``), ``scales [N, G]`` fp8 ->
    ``[M, N]`` (``[M, N/2]`` with ``silu_mul``) in ``out_dtype``. See the module docstring.
    ``config`` overrides ``pick_config``; ``config["MODE"]``: ``"fused"`` (dequant in the GEMM
    loop), ``"dequant"`` (``dequantize_to_fp8`` once, then the same kernel with ``W_FP8``) or
    ``"scaled_mm"`` (``dequantize_to_fp8`` + ``torch._scaled_mm`` row-wise). ``return_compiled``
    also returns the compiled GEMM kernel (for PTX inspection). ``pdl``: launched as a programmatic
    dependent launch (config ``PDL``; ``pdl_trigger`` = ``PDL_TRIGGER``: True when the caller's next
    kernel is a PDL launch too, as in the generation runner's chain; the standalone op passes False).
    ``_checked``: the caller (``lowbit.ops.w4a8_fp8``'s op bodies) has validated every operand: no second check."""
    M, K = xq.shape
    if _checked:
        N = scales.shape[0]
        n_out = N // 2 if silu_mul else N
    else:
        check_tensor(xq, "xq", dtype=FP8_E4M3, ndim=2)
        if K != k:
            raise ValueError(f"xq has K={K} columns but the weight has in_features={k}")
        check_tensor(sx, "sx", dtype=torch.float32, shape=(M,))
        N, n_out = _check_weight(k, codes, scales, group_size, silu_mul, bias, tiled)
    if residual is not None:
        check_tensor(residual, "residual", dtype=out_dtype, shape=(M, n_out))
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    codes, scales = codes.contiguous(), scales.contiguous()
    cfg = dict(pick_config(M, N, K) if config is None else config)
    if pdl:
        cfg.update(PDL=True, PDL_TRIGGER=bool(pdl_trigger))
    mode = cfg.get("MODE", "fused")
    if mode == "scaled_mm" and (K % 16 or N % 16 or out_dtype != torch.bfloat16 or interpret_mode()
                                or not xq.is_cuda):  # _scaled_mm's row-wise limits: bf16 out, 16-aligned
        mode = "dequant"
    if mode == "scaled_mm":
        wf = dequantize_to_fp8(codes, scales, k, group_size, tiled=tiled)[:, :K]
        out = _scaled_mm_path(xq, sx, wf, inv_delta, bias, residual, silu_mul, out_dtype)
        return (out, None) if return_compiled else out
    if mode == "dequant":
        wf = dequantize_to_fp8(codes, scales, k, group_size, tiled=tiled)
        out, compiled = _launch(xq, sx, wf, scales, inv_delta, K, group_size, bias, residual, silu_mul, out_dtype,
                                cfg, quant_a=False, w_fp8=True)
    else:
        out, compiled = _launch(xq, sx, codes, scales, inv_delta, K, group_size, bias, residual, silu_mul,
                                out_dtype, cfg, quant_a=False, w_fp8=False, tiled=tiled)
    return (out, compiled) if return_compiled else out


def w4a8_fp8_linear_fused(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, inv_delta: float, k: int,
                          group_size: int, *, bias: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None, silu_mul: bool = False,
                          out_dtype: torch.dtype | None = None, config: dict | None = None,
                          return_compiled: bool = False):
    """``x [M, K]`` float (fp16/bf16/fp32) -> ``[M, N]``: per-token FP8 quantization of x fused
    into the GEMM (``QUANT_A``): one launch. Every program computes the absmax of its x rows over
    the whole K and quantizes its K tiles in registers, with the numerics of
    ``lowbit.kernels.act_quant`` (bit-identical codes and scales). For small M (decode), where x
    is a few KB served from L2; see ``FUSED_QUANT_MAX_M``."""
    check_tensor(x, "x", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=2)
    M, K = x.shape
    if K != k:
        raise ValueError(f"x has K={K} columns but the weight has in_features={k}")
    out_dtype = out_dtype or x.dtype
    N, n_out = _check_weight(k, codes, scales, group_size, silu_mul, bias)
    if residual is not None:
        check_tensor(residual, "residual", dtype=out_dtype, shape=(M, n_out))
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes, scales = codes.contiguous(), scales.contiguous()
    cfg = dict(pick_config(M, N, K) if config is None else config)
    sx = torch.empty((M,), dtype=torch.float32, device=x.device)
    out, compiled = _launch(x, sx, codes, scales, inv_delta, K, group_size, bias, residual, silu_mul, out_dtype,
                            cfg, quant_a=True, w_fp8=False)
    return (out, compiled) if return_compiled else out
