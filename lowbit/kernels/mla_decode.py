"""MLA decode attention over a paged latent cache, bf16 or SnapMLA FP8 (one kernel, constexpr FP8).

Absorbed MLA (DeepSeek-V2/V3; SnapMLA §2, digest 2.2): every head ``h`` of query token ``t``
carries ``q = [q_C W_UK | q_R]`` of width ``Dc + Dr`` (512 + 64); the cache holds one latent
``[c | k_R]`` per token, shared by all heads; key = the whole latent, value = its content part:

    o[t, h] = softmax_j( q[t, h] · kv[j] * sm_scale ) · c[j],      j < L - Sq + t + 1   (causal MTP)

Work decomposition (flash-decoding):
- a row is one (query token, head) pair, rows ``r = t * H + h`` of the ``Sq * H`` rows of one
  sequence; a program takes ``BLOCK_M`` consecutive rows, so BLOCK_M heads share every KV tile
  loaded: the heads are the M dimension of both dots (``[BLOCK_M x 576] x [576 x BLOCK_N]`` then
  ``[BLOCK_M x BLOCK_N] x [BLOCK_N x BLOCK_DV]``, wgmma shapes on Hopper), and the 512 output
  columns may be split over ``DC / BLOCK_DV`` programs (each recomputes the scores: ``dv_splits``);
- the "wide" tile (FP8 default on the GPU when a sequence has more than 64 rows, ``WIDE``):
  BLOCK_M = 128 (8 warps = one warpgroup per 64 rows, so both dots are chained with
  ``warpsPerCTA [8, 1]`` and no warpgroup duplicates the other's QK or needs the other's row
  max), BLOCK_DV = 256 (accumulator 128 x 256 fp32 = 128 registers per thread), BLOCK_N = 64, and
  the loop split into an unmasked part over whole blocks (``EVEN_LOOP``) and a masked tail.
  Device R7 (B=32, H=128, L=16k): 260 vs 213 TFLOP/s for the 64-row tile with S_AHEAD;
- few rows per sequence (``FEW``, GPU, e.g. 16 heads x 1 query token, memory-bound): a 64-row
  wgmma tile is 3/4 padding, and its per-block cost is that of 64 heads. bf16 takes a 16/32-row
  tile (Triton emits mma.sync), 32-token blocks, 4 warps, 2 programs per SM: 3.62-3.64 TB/s vs
  2.05-2.07 for the 64-row tile (R12/R13). FP8 takes ``TOKENS_M``: both dots transposed,
  ``S^T = K · Q^T`` and ``O^T = V^T · P^T`` (the block's 64 tokens and the value columns are the wgmma M
  dimension, the 16 rows N; accumulator [512, 16]): 1.107 vs 1.299 ms (R13). The fp8 mma.sync
  tile does not pay here: Hopper has no FP8 mma.sync, Triton upcasts every fragment to fp16 (F2FP)
  and the one FP8 K tile cannot serve both dots' shared layouts, so it is not pipelined either
  (``DEQ16``, options: 0.86-1.02 TB/s). Since session 17 FP8 caches with at most 32 (48 since session 18) rows per sequence take
  the Gluon kernel of ``lowbit.kernels.mla_decode_gluon`` on the GPU instead (explicit cp.async copies, the
  P·V operand read from the FP8 stage as 16-bit column pairs with ``ldmatrix.trans`` and split by ``prmt``,
  warps splitting the QK^T reduction and then the softmax rows: 3.4 TB/s (session 18) vs 1.22 for the
  tokens-as-M tile at B=128 L=16k); the tile above stays the fallback (``gluon=False``);
- a multiple of 64 rows per sequence (128 heads) takes the warp-specialized Gluon kernels of
  ``lowbit.kernels.mla_decode_wgmma`` on Hopper since session 20 (a TMA loader warp; one warpgroup for QK^T, the
  softmax and half the value columns, the other for the other half, so no MMA work is duplicated and P·V of block j
  overlaps QK^T of block j+1): bf16 583 vs 262 TFLOP/s at B=32 H=128 L=16k; FP8 (the same SnapMLA numerics as the
  wide tile; the second warpgroup also writes the K-major FP8 value tile) 378 vs 300; the tiles here stay the
  fallback;
- the sequence is cut into ``num_splits`` chunks of ``chunk`` tokens (a multiple of BLOCK_N);
  grid = (row blocks x column slices, splits, batch), row blocks fastest so that the programs
  reading the same KV run side by side and share it through L2;
- each program walks its chunk in BLOCK_N-token blocks, in increasing order (monotone block
  order: SnapMLA App. C), gathering the rows of the block through the page table
  (``slot = page_table[b, n // PAGE] * PAGE + n % PAGE``), and keeps an online softmax;
- with one split the program writes the normalised output; otherwise fp32 partial outputs and
  their base-2 log-sum-exp go to a workspace and ``_mla_combine_kernel`` merges them.

FP8 path (``FP8=True``; SnapMLA §3.1-3.2, digest 2.3 and 2.5), for a row with query scale ``s_q``
and tokens with scales ``s_k``:
- QK: ``acc_s = q̂_C · ĉ^T`` (fp8 x fp8 in the wgmma accumulator over all 512 dims) ``+ q̃_R · k̃_R^T``
  (bf16), both in the same pre-scaled domain and summed in fp32 (pre-scaled domain alignment),
  then ``S = acc_s * s_q * s_k * sm_scale``. Decision: no fp32 promotion inside the 512-long FP8
  reduction by default (``imprecise=None`` = Dc). Promoting every 128 products (DeepSeek-V3's
  N_C = 128) makes Triton wait on the wgmma 4x per block: R5 measured 164 vs 179 TFLOP/s for the
  same error (GPU checks vs float64 5.65e-3 / 7.56e-3 / 7.67e-3 either way); ``imprecise=128``
  restores it;
- PV: ``P̃ = exp(S - m) * s_k`` (the value scale fused into P, Key Step 2), re-quantized per block
  and row with ``σ = rowmax(P̃) / 448`` to ``P̂ = FP8(P̃ / σ)``; the fp32 accumulator and the
  softmax denominator both live in the "divided by σ" domain, so σ is folded into the online
  softmax rescale factor ``r = e^(m_old - m_new) * σ_old / σ_new`` and never applied explicitly
  (digest 2.5's reconstruction of Appendix B). ``P̂ · ĉ`` accumulates into the rescaled accumulator
  inside the fp8 wgmma (``acc = dot(P̂, ĉ, acc * r)``). Adding each block's product in a fresh fp32
  tile instead (``PV_PROMOTE=True``, DeepSeek-V3's promotion) keeps a second 64 x 512 fp32 tile
  live: 2 x 128 registers per thread, which spills; the device check compares both against the
  emulating reference at L = 32k in one split (``benchmarks/device/mla.py``).
- Decision (digest 2.5 / App. C hazard): σ is made monotone, ``σ_new = max(rowmax(P̃)/448,
  σ_old e^(m_old - m_new))``, so every rescale factor is <= 1: the accumulator's scale only moves
  one way (no division by a ratio that could overflow). Without it a late block whose scores lie
  far below the running max (σ ~ e^-100) would multiply the accumulator by ~e^100. The price: a
  block whose P̃ is tiny next to the history is quantized with the history's σ; the lost terms
  are below 2^-9 of what the accumulator already holds. Because the block that sets a new max
  always contains a P = 1 entry, σ >= s_k,min / 448 >= 5e-18 and l <= L / σ stays finite.

The V operand of the FP8 P·V (decision, measured in device rounds R4-R5, B=32 H=128 L=16k):
FP8 wgmma takes both operands K-major only (the transpose bits exist for 16-bit types alone), and
K = tokens here while the latent is stored token-major (the 512 dims contiguous): V must be
transposed on chip. SnapMLA does it in CUDA (SMEM -> registers -> SMEM, §3.3); Triton, given the
token-major tile, stores it into the K-major smem tile one byte at a time (64 st.shared.b8 per
thread per 32-token block: 46 TFLOP/s in R4, 0.19x of bf16). Variants, all in this kernel:
- ``V_PRMT`` (b, the default and the fastest FP8 path): the rows are loaded as int32 words,
  byte-transposed 4x4 in registers with ``prmt`` (``_bytes_t4``) and reshaped (no data movement),
  so each 32-bit register holds 4 consecutive tokens of one dim and the smem store is 32 bits wide
  instead of 64 st.shared.b8. ``V_PRMT=1`` loads the words with the lanes along the dims: every
  lane of a store then hits the same bank, a 32-way conflict (R4: 103 TFLOP/s plain loop, 115 with
  S_AHEAD, 119 in R5); ``V_PRMT=2`` (default) puts the lanes on the token groups (9 st.shared.b32
  plus stmatrix): 179 TFLOP/s at 32-token blocks, 214 at 64 (R5).
- ``PV_FP8=False`` (a): FP8 QK, then ``P * s_k`` in bf16 against the latent upcast to bf16
  (exact) in a bf16 wgmma: no P quantization, no transpose (bf16 wgmma takes MN-major V). Costs
  the fp8 -> bf16 conversion, which Triton 3.6 lowers through f32 (F2F, quarter rate: 64 per
  thread per block). 171 TFLOP/s in R4 (with S_AHEAD); 191 in R5 reusing the QK tile.
- ``PV16`` (a'): SnapMLA's P scaling (P̃ / σ, same σ rule as the FP8 path) rounded to fp16 instead
  of FP8, the latent upcast to fp16 (exact; one cvt.rn.f16x2.e4m3x2 per 2 values), fp16 wgmma; more
  accurate than FP8 P, no transpose; without S_AHEAD it reuses the QK tile already in smem:
  197-200 TFLOP/s in R5 (64-token blocks spill: 384 B).
- (c) ``O^T = V^T P^T`` was not built: it moves V to the A operand, which for FP8 must be K-major
  too (from smem) or, from registers, packs 4 consecutive K (= token) values per 32-bit register:
  the same 4x4 byte transpose as (b), plus a transposed output.
Paper mismatch: SnapMLA runs P·V in FP8 (twice the bf16 MMA rate, P re-quantized per block) and
reports FP8 decode well above bf16. Here the FP8 kernel is 1.16-1.26x lowbit's bf16 kernel at
H = 128 (R8: 300 vs 247 TFLOP/s at B=32 L=16k), short of the 1.6-1.7x target: with one 8-warp CTA
per SM and every wgmma waited on at once by Triton 3.6, the loop is latency- and issue-bound
(814-875 SASS per thread per 64-token block of the wide tile, 128 of them the accumulator
rescale), so halving the MMA time buys little. What moved it (R6 -> R8, same numerics): the wide
tile (213 -> 261: no duplicated QK, no cross-warpgroup softmax reductions, V^T of 256 columns),
then the unmasked main loop and the single QK accumulator (261 -> 304; 18 bytes of spills gone).
Measured and not kept: 2 CTAs per SM of 4 warps (64 rows x 256 columns: 242), 32-token blocks in
the wide tile (210), a block-wide P scale (292, and 1.8-6x the P error on peaked rows). The
``T_STEP`` softmax (row scale inside the exp2 argument) measured 300 vs 304 without it: equal within
noise, fewer instructions; it is on (R8's suite table measured it).

Pipelining (what Triton 3.6 generates, read in the TTGIR/SASS of R11-R13): with ``num_stages=2`` the
copies of block j+1 are issued at the END of iteration j (after its dots) and waited for at the top
of iteration j+1 (``async_wait num=0``, SASS ``DEPBAR.LE SB0, 0x0``), so the HBM latency of every block
is exposed once per iteration, overlapped at most with the last asynchronous wgmma. Three stages of
the wide FP8 tile do not fit shared memory at 64-token blocks (254976 B > 232448 B: an sm_90 compile);
at 32-token blocks, 3 and 4 stages (loads 2-3 blocks ahead) measured 262 and 259 TFLOP/s vs 300 for
the 64-token 2-stage default (R13): the per-token instruction cost of the smaller block outweighs the
hidden latency.

``S_AHEAD`` (loop order): with the plain loop Triton sees QK's result feed the PV dot and assigns
all 8 warps along M (``warpsPerCTA [8, 1]`` for a "chained" dot), so with BLOCK_M = 64 both
warpgroups compute the same whole S tile. Computing S of block j beside P·V of block j-1 (P carried
across iterations) breaks that chain: QK's N is split over the two warpgroups. It needs V loaded
separately from K (the FP8-PV path does anyway), adds cross-warpgroup reductions, and is the
default only where it measured faster (R4: FP8-PV 103 -> 115 TFLOP/s; bf16 bn32 196 vs 248 for
the plain bn64 loop, whose smem has no room for a separate V tile, so bf16 keeps the plain loop;
fp16-PV 198 vs 200 plain, where the plain loop reuses the QK tile). ``TAU`` > 0 (lazy running max, rescale skipped while no row
moved by more than TAU) measured no gain (R4: 110 vs 115, 187 vs 196) and stays off.

Layouts (all row-major, last dim contiguous):
    q content  [B * Sq * H, Dc]   bf16/fp16 (or fp8 with FP8), row stride ``stride_qc``
    q rope     [B * Sq * H, Dr]   bf16/fp16 (pre-divided by s_q with FP8)
    q scale    [B * Sq * H]       fp32 (FP8 only)
    cache      content [slots, Dc], rope [slots, Dr], scale [slots] fp32 (FP8 only); slot = page * PAGE + offset
    page_table [B, max_pages] int32; seq_lens [B] int32 (tokens in the cache, including the Sq new ones)
    out        [B * Sq * H, Dc] in q's dtype (bf16 for FP8); workspace o fp32 [splits, rows, Dc], lse fp32 [splits, rows]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode, sm_count
from lowbit.formats.mla_fp8 import P_SCALE_HEADROOM
from lowbit.kernels.mla_quant import _cast

LOG2E = 1.4426950408889634
FP8_MAX = 448.0
SIG_HEADROOM = tl.constexpr(P_SCALE_HEADROOM)  # lazy mode (TAU > 0): a growing P scale overshoots 4x
# GPU defaults per path (bf16, fp8): tokens per KV block and pipeline depth (smem: Q 72/40 KB +
# stages x the KV tile, under 227 KB; registers: 32-token blocks do not spill)
# GPU defaults per path (measured in device rounds R3-R5, benchmarks/device/mla.py's sweep):
# tokens per KV block, pipeline stages, and S_AHEAD (QK of block j beside PV of block j-1)
PATHS = ("bf16", "fp8", "fp8-bf16pv", "fp8-f16pv")
PV_BLOCK_N = {"bf16": 64, "fp8": 64, "fp8-bf16pv": 32, "fp8-f16pv": 32}
PV_STAGES = {"bf16": 2, "fp8": 2, "fp8-bf16pv": 2, "fp8-f16pv": 3}
S_AHEAD = {"bf16": False, "fp8": True, "fp8-bf16pv": False, "fp8-f16pv": False}
# programs per row block, each owning DC / DV_SPLITS output columns (and recomputing the scores)
DV_SPLITS = {"bf16": 1, "fp8": 1, "fp8-bf16pv": 1, "fp8-f16pv": 1}
# unmasked loop over the whole blocks + a masked tail (plain loop order only); the RoPE dot
# accumulating into the content dot's accumulator
# (B=32 H=128 L=16k sweeps: bf16 263 vs 246 TFLOP/s in R8, 262 vs 245 in R10 and 262 vs 247 in R11
# with both on (26 B of spills), output within 1.5e-4 of the R6 loop: on for bf16 since session 5;
# the FP8 wide tile turns both on)
EVEN_LOOP = {"bf16": True, "fp8": False, "fp8-bf16pv": False, "fp8-f16pv": False}
ONE_ACC = {"bf16": True, "fp8": False, "fp8-bf16pv": False, "fp8-f16pv": False}
# FP8 P scale per block from max s_k (``_softmax_step_t``, BLOCK_RULE) instead of the per-row max of P̃ (option)
P_BLOCK = {"bf16": False, "fp8": False, "fp8-bf16pv": False, "fp8-f16pv": False}
# FP8-PV softmax on t = acc * s_k with the row scale inside the exp2 argument (``_softmax_step_t``)
# (R8: 300 vs 304 TFLOP/s with / without it in the wide tile, 814 vs 875 SASS per block: equal within
# noise; on, as in R8's suite table)
T_STEP = {"bf16": False, "fp8": True, "fp8-bf16pv": False, "fp8-f16pv": False}
# GPU, more than 64 rows (query tokens x heads) per sequence: the wide tile (R7: 260 vs 213 TFLOP/s
# at B=32 H=128 L=16k): 128 rows per program (one warpgroup per 64 rows, both dots chained, no
# duplicated QK, no cross-warpgroup softmax reductions), the 512 output columns over 2 programs
# (accumulator 128 x 256 = 128 registers per thread); unset launcher arguments take these
WIDE = {"fp8": dict(block_m=128, dv_splits=2, s_ahead=False, even_loop=True, one_acc=True)}
# GPU, at most FEW_ROWS rows per sequence (e.g. 16 heads, one query token: memory-bound): a
# 64-row wgmma tile would be 3/4 padding, so such shapes may take a small-M tile instead
# (BLOCK_M < 64: Triton emits mma.sync), several programs resident per SM and more splits.
# bf16 (R12/R13 sweeps, B=128 H=16 L=16k, same-round A/B): 16-row tile (mma.sync), 32-token blocks,
# 4 warps, 2 programs per SM (185 registers, 57 KB smem), 2 splits: 0.663 / 0.667 ms = 3.64 / 3.62 TB/s
# vs 1.170 / 1.179 ms for the 64-row wgmma tile (R13 suite: 0.668 ms, 2.05x the bmm path).
# FP8 (R13 sweep, same shape): tokens as the M dimension (``tokens_m``: K·Q^T then V^T·P^T, 64-token
# wgmma tiles, 16 rows as N), 4 warps: 1.107 ms vs 1.299 ms for the 64-row tile (output within 1.6e-4);
# 16 rows at most (32 rows spill 240 B); the fp16-MMA variants (``deq16``) measured 1.32-1.57 ms.
# block_m: the rows rounded up to a power of two; max_rows: the largest row count a path takes
FEW_ROWS = 32
# FP8 caches with <= 48 rows per sequence (16 heads x 1-3 tokens, 32 heads) take the Gluon kernel on the GPU
# (lowbit.kernels.mla_decode_gluon; H200, B=128 H=16 L=16k: session 18 0.395 ms = 3.42 TB/s (session 17: 0.542) vs
# 1.102 ms for the tokens-as-M tile below and 0.660 ms for the bf16 FEW tile, benchmarks/results/h200/s18_mla_few.json)
GLUON_FEW = True
# A multiple of 64 rows per sequence (e.g. 128 heads) takes the warp-specialized Gluon wgmma kernels on Hopper
# (lowbit.kernels.mla_decode_wgmma; H200, session 20, B=32 H=128 L=16k, benchmarks/results/h200/s20_mla_wgmma*.json):
# bf16 0.251 ms = 583 TFLOP/s vs 0.554 ms for this kernel's bf16 tile (3.49x the bmm path); FP8 (SnapMLA numerics,
# same P rounding as the wide tile) 0.386 ms vs 0.486 ms for the wide FP8 tile. The Triton tiles stay the fallback
# (``gluon=False``, or any tuning argument)
GLUON_WIDE = True
FEW = {"bf16": dict(block_n=32, num_warps=4, num_stages=2, s_ahead=False, even_loop=True, one_acc=True,
                    ctas_per_sm=2),
       "fp8": dict(tokens_m=True, block_m=16, block_n=64, num_warps=4, num_stages=2, even_loop=True, one_acc=True,
                   ctas_per_sm=1, max_rows=16)}


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """tl.dot, except under Triton 3.6's interpreter, which multiplies bf16 bit patterns: fp32 there."""
    if INTERPRET:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _cdot(a, b, acc, IMPRECISE: tl.constexpr, DEQ16: tl.constexpr):
    """The content dot of QK. FP8 operands: one fp8 wgmma chain, ``IMPRECISE`` products between fp32
    promotions. ``DEQ16``: the operands are the FP8 values upcast to fp16 (exact), fp32 accumulation."""
    if DEQ16:
        r = tl.dot(a, b, acc)  # (DEQ16 = 2: FP8 operands on the mma.sync path; Triton upcasts the fragments)
    else:
        r = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
    return r


@triton.jit
def _e4m3_to_f16(x, INTERPRET: tl.constexpr):
    """FP8 E4M3 -> fp16 (exact). On the GPU one ``cvt.rn.f16x2.e4m3x2`` per 2 values in inline PTX,
    which Triton cannot move past the layout conversions after it (a plain ``.to`` is sunk into
    each dot operand's fragments and converted once per dot)."""
    if INTERPRET:
        return x.to(tl.float16)
    return tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x], dtype=tl.float16, is_pure=False,
                                     pack=2)


@triton.jit
def _load_page(ptr, INTERPRET: tl.constexpr):
    """One page-table entry. On the GPU a plain ``ld.global.nc`` through inline PTX: Triton's
    pipeliner turns a ``tl.load`` here into an async copy in the same group as the KV tiles, whose
    address depends on it, and then waits for the whole group at the top of every iteration
    (``async_wait num=0``, no prefetch at all); hidden from it, the KV copies run a stage ahead.
    The entry is tiny and shared by consecutive blocks, so the load mostly hits L1."""
    if INTERPRET:
        return tl.load(ptr)
    return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _ld(ptr, mask, other, MASK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """tl.load, with ``mask`` only where MASK (the unmasked loop over whole blocks drops it)."""
    if MASK:
        if EVICT_LAST:
            return tl.load(ptr, mask=mask, other=other, eviction_policy="evict_last")
        return tl.load(ptr, mask=mask, other=other)
    if EVICT_LAST:
        return tl.load(ptr, eviction_policy="evict_last")
    return tl.load(ptr)


@triton.jit
def _v_rows(KC, stride_kc, slot, offs_c):
    """The content rows at ``slot`` (zeros where slot < 0), loaded to registers."""
    return tl.load(KC + slot[:, None] * stride_kc + offs_c[None, :], mask=slot[:, None] >= 0, other=0.0,
                   eviction_policy="evict_first")


# 4 x 4 byte transpose of words a, b, c, d ($4..$7) into word k = (a_k, b_k, c_k, d_k) ($0..$3): 8 prmt. Also the
# Gluon MLA kernel's FP8 value transpose (``lowbit.kernels.mla_decode_wgmma``).
BYTES_T4_PTX = """{
.reg .b32 lo0, hi0, lo1, hi1;
prmt.b32 lo0, $4, $5, 0x5140;
prmt.b32 hi0, $6, $7, 0x5140;
prmt.b32 lo1, $4, $5, 0x7362;
prmt.b32 hi1, $6, $7, 0x7362;
prmt.b32 $0, lo0, hi0, 0x5410;
prmt.b32 $1, lo0, hi0, 0x7632;
prmt.b32 $2, lo1, hi1, 0x5410;
prmt.b32 $3, lo1, hi1, 0x7632;
}"""
_BYTES_T4 = tl.constexpr(BYTES_T4_PTX)


@triton.jit
def _bytes_t4(a0, a1, a2, a3, INTERPRET: tl.constexpr):
    """4x4 byte transpose of four int32 words: output k packs byte k of a0, a1, a2, a3 (low to high).
    On the GPU 8 ``prmt`` (byte permute) in inline PTX; under the interpreter shifts and masks."""
    if INTERPRET:
        o0 = (a0 & 0xFF) | ((a1 & 0xFF) << 8) | ((a2 & 0xFF) << 16) | ((a3 & 0xFF) << 24)
        o1 = ((a0 >> 8) & 0xFF) | (((a1 >> 8) & 0xFF) << 8) | (((a2 >> 8) & 0xFF) << 16) | (((a3 >> 8) & 0xFF) << 24)
        o2 = ((a0 >> 16) & 0xFF) | (((a1 >> 16) & 0xFF) << 8) | (((a2 >> 16) & 0xFF) << 16) | (((a3 >> 16) & 0xFF) << 24)
        o3 = ((a0 >> 24) & 0xFF) | (((a1 >> 24) & 0xFF) << 8) | (((a2 >> 24) & 0xFF) << 16) | (((a3 >> 24) & 0xFF) << 24)
        return o0, o1, o2, o3
    return tl.inline_asm_elementwise(_BYTES_T4, "=r,=r,=r,=r,r,r,r,r", [a0, a1, a2, a3],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _unpack4(w):
    """int32 [..] -> uint8 [.., 4], byte t of each word at index t (little-endian order)."""
    b0 = (w & 0xFF).to(tl.uint8)
    b1 = ((w >> 8) & 0xFF).to(tl.uint8)
    b2 = ((w >> 16) & 0xFF).to(tl.uint8)
    b3 = ((w >> 24) & 0xFF).to(tl.uint8)
    x = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [.., 2, 2]: [j][i] = b_(2j + i) (join adds the LAST dim)
    return tl.reshape(x, x.shape[:-2] + [4])


@triton.jit
def _v_kmajor(KC, stride_kc, slot4, n4, end, BLOCK_N: tl.constexpr, DC: tl.constexpr, LANES_ON_TOKENS: tl.constexpr,
              INTERPRET: tl.constexpr, MASK: tl.constexpr = True):
    """The FP8 content rows of the block's tokens as a [BLOCK_N, DC] fp8 tensor whose register
    layout holds 4 consecutive tokens of one dim in each 32-bit register, so that Triton's store
    into the K-major (token-contiguous) shared tile of the FP8 wgmma is 32 bits wide instead of
    one byte: the rows are loaded as int32 words (4 dims of one token; tokens ``n4 + t`` at slots
    ``slot4 + t``, t < 4, which lie in one page as PAGE % 4 == 0), 4x4 byte-transposed in
    registers (``_bytes_t4``) and only then reshaped (join / reshape / permute of registers: no
    data movement).

    ``LANES_ON_TOKENS``: the words are loaded as ``[BLOCK_N/4, DC/16, 4]`` (4 contiguous words per
    thread, then the token groups across lanes), so that the lanes of a warp write adjacent
    token groups of the same dims: one 32-byte row of the transposed tile per 8 lanes. Loaded as
    ``[BLOCK_N/4, DC/4]`` instead, the lanes cover 16-row steps of the dims, every lane of a store
    hits the same bank (R4: 32 lanes 512 B apart, a 32-way conflict on each of the 16 stores)."""
    G: tl.constexpr = BLOCK_N // 4
    W: tl.constexpr = DC // 4
    KW = KC.to(tl.pointer_type(tl.int32), bitcast=True)
    sw = stride_kc // 4
    if LANES_ON_TOKENS:
        JL: tl.constexpr = 4
        word = tl.arange(0, W // JL)[None, :, None] * JL + tl.arange(0, JL)[None, None, :]
        base = KW + slot4[:, None, None] * sw + word  # [g, jh, jl]: Triton orders the lanes g first
        ok = n4[:, None, None]
    else:
        base = KW + slot4[:, None] * sw + tl.arange(0, W)[None, :]
        ok = n4[:, None]
    a0 = _ld(base, ok < end, 0, MASK, False)
    a1 = _ld(base + sw, ok + 1 < end, 0, MASK, False)
    a2 = _ld(base + 2 * sw, ok + 2 < end, 0, MASK, False)
    a3 = _ld(base + 3 * sw, ok + 3 < end, 0, MASK, False)
    o0, o1, o2, o3 = _bytes_t4(a0, a1, a2, a3, INTERPRET)  # o_k = tokens 4g..4g+3 of dim 4 * word + k
    x = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # [.., 2, 2] -> k = 2 * j + i
    if LANES_ON_TOKENS:
        x = tl.reshape(x, [G, W // JL, JL, 4])  # [g, jh, jl, k]
        y = tl.permute(_unpack4(x), (0, 4, 1, 2, 3))  # [g, jh, jl, k, t] -> [g, t, jh, jl, k]
    else:
        x = tl.reshape(x, [G, W, 4])  # [g, j, k]
        y = tl.permute(_unpack4(x), (0, 3, 1, 2))  # [g, j, k, t] -> [g, t, j, k]
    return tl.reshape(y, [BLOCK_N, DC]).to(KC.dtype.element_ty, bitcast=True)


@triton.jit
def _block_slots(PT, b, stride_pt, n0, end, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr):
    """(slot [BLOCK_N] int64, tok_ok, base slot of each 4-token group [BLOCK_N // 4]) of the block at n0."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tok_ok = offs_n < end
    n4 = n0 + 4 * tl.arange(0, BLOCK_N // 4)
    if PAGE % BLOCK_N == 0:  # the block lies in one page: one scalar page-table load
        page = _load_page(PT + b * stride_pt + n0 // PAGE, INTERPRET).to(tl.int64)
        slot = page * PAGE + (n0 % PAGE) + tl.arange(0, BLOCK_N)
        slot4 = page * PAGE + (n0 % PAGE) + 4 * tl.arange(0, BLOCK_N // 4)
    else:
        page = tl.load(PT + b * stride_pt + offs_n // PAGE, mask=tok_ok, other=0)
        slot = page.to(tl.int64) * PAGE + offs_n % PAGE
        pg4 = tl.load(PT + b * stride_pt + n4 // PAGE, mask=n4 < end, other=0)
        slot4 = pg4.to(tl.int64) * PAGE + n4 % PAGE
    return slot, tok_ok, slot4


@triton.jit
def _scores(qc, qr, qscale, KC, KR, KS, PT, b, stride_pt, stride_kc, stride_kr, n0, end, lim, sm_scale_log2e,
            DC: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
            IMPRECISE: tl.constexpr, INTERPRET: tl.constexpr, MASK: tl.constexpr = True,
            ONE_ACC: tl.constexpr = False, T_STEP: tl.constexpr = False, TOKENS_M: tl.constexpr = False,
            DEQ16: tl.constexpr = False):
    """Base-2 scores of the block at n0 ([BLOCK_M, BLOCK_N], -inf where masked), the tokens' FP8
    scales (FP8) and the block's K tile (the bf16 path reuses it as V). ``MASK=False``: the block
    is whole and visible to every row (no token or causal mask at all). ``ONE_ACC``: the RoPE dot
    accumulates straight into the content dot's fp32 accumulator (one wgmma chain, one wait, one
    scaling: SnapMLA's single accumulator literally), instead of two accumulators scaled and added.
    ``T_STEP`` (FP8): returns ``t = acc * s_k`` without the row scale ``s_q * sm_scale * log2(e)``,
    which ``_softmax_step_t`` applies inside its exp2 argument (one FFMA). ``TOKENS_M``: both dots
    computed transposed (``K · Q^T``: the block's tokens are the M dimension, the rows N; one
    accumulator), the [BLOCK_N, BLOCK_M] result transposed back (a register layout change). ``DEQ16``
    (FP8, few rows): the K tile is upcast to fp16 once (exact; ``qc`` is fp16 too) and returned so for
    P·V, both dots on fp16 MMAs (mma.sync for a 16-row tile) with the FP8 kernel's numerics."""
    slot, tok_ok, _ = _block_slots(PT, b, stride_pt, n0, end, BLOCK_N, PAGE, INTERPRET)
    offs_c = tl.arange(0, DC)
    offs_r = tl.arange(0, DR)
    kc = _ld(KC + slot[:, None] * stride_kc + offs_c[None, :], tok_ok[:, None], 0.0, MASK, True)
    kr = _ld(KR + slot[:, None] * stride_kr + offs_r[None, :], tok_ok[:, None], 0.0, MASK, False)
    if DEQ16 == 1:
        kc = kc.to(tl.float16)
    elif DEQ16 == 3:  # converted right at the load (inline PTX), one fp16 tile for both dots
        kc = _e4m3_to_f16(kc, INTERPRET)
    # QK^T: the content groups and the RoPE group in the same pre-scaled domain, one fp32 sum,
    # then the two scales (pre-scaled domain alignment). The RoPE dot has its own accumulator and
    # both products are scaled before the add: a dot feeding another dot's accumulator (which
    # Triton's combiner makes of ``dot + x``) counts as "chained" for its warp assignment (S_AHEAD)
    if FP8:
        ks = _ld(KS + slot, tok_ok, 0.0, MASK, False)
        if T_STEP:
            f = ks[None, :]
        else:
            f = qscale[:, None] * ks[None, :]
        if TOKENS_M:
            st = _dot(kr, tl.trans(qr), _cdot(kc, tl.trans(qc), None, IMPRECISE, DEQ16), INTERPRET)
            s = tl.trans(st) * f
        elif ONE_ACC:
            s = _dot(qr, tl.trans(kr), _cdot(qc, tl.trans(kc), None, IMPRECISE, DEQ16), INTERPRET) * f
        else:
            s = _cdot(qc, tl.trans(kc), None, IMPRECISE, DEQ16) * f
            s = s + _dot(qr, tl.trans(kr), None, INTERPRET) * f
    else:
        ks = tok_ok.to(tl.float32)
        if TOKENS_M:
            s = tl.trans(_dot(kr, tl.trans(qr), _dot(kc, tl.trans(qc), None, INTERPRET), INTERPRET)) * sm_scale_log2e
        elif ONE_ACC:
            s = _dot(qr, tl.trans(kr), _dot(qc, tl.trans(kc), None, INTERPRET), INTERPRET) * sm_scale_log2e
        else:
            s = _dot(qc, tl.trans(kc), None, INTERPRET) * sm_scale_log2e
            s = s + _dot(qr, tl.trans(kr), None, INTERPRET) * sm_scale_log2e
    if MASK:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        keep = (offs_n[None, :] < lim[:, None]) & tok_ok[None, :]
        s = tl.where(keep, s, float("-inf"))
    return s, ks, kc


@triton.jit
def _softmax_step(s, ks, m_i, l_i, sig_i, V_DTYPE: tl.constexpr, FP8: tl.constexpr, PV_FP8: tl.constexpr,
                  TAU: tl.constexpr, PV16: tl.constexpr, INTERPRET: tl.constexpr):
    """Online-softmax update for one block of scores: returns (P operand of the PV dot, the factor
    that rescales the accumulator first, m, l, sigma). TAU > 0: lazy running max, moved only when a
    block's max exceeds it by more than TAU (base 2), so P <= 2^TAU and the rescale factor is
    exactly 1 in almost every block (``_pv_step`` then skips the rescale)."""
    m_blk = tl.max(s, 1)
    if TAU > 0:
        m_new = tl.where(m_blk > m_i + TAU, m_blk, m_i)
    else:
        m_new = tl.maximum(m_i, m_blk)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))  # exactly 1 where the max did not move
    if FP8 and PV_FP8:
        pv = p * ks[None, :]  # value scale fused into P (Key Step 2)
        sig_keep = sig_i * alpha
        sig_need = tl.max(pv, 1) / 448.0
        if TAU > 0:  # lazy too: when sigma must grow, grow it 4x past the need (P̂ <= 112 then)
            sig_new = tl.where(sig_need <= sig_keep, sig_keep, sig_need * SIG_HEADROOM)
        else:
            sig_new = tl.maximum(sig_need, sig_keep)  # monotone block scale
        inv_sig = tl.where(sig_new > 0, 1.0 / sig_new, 0.0)
        # <= 1: sigma folded into the online-softmax rescale (exactly 1 where neither m nor sigma moved)
        r = tl.where(sig_new == sig_keep, 1.0, sig_keep * inv_sig)
        if PV16:  # P / sigma in fp16 (11-bit mantissa) against V upcast to fp16 (exact)
            p_op = _cast(tl.minimum(pv * inv_sig[:, None], 448.0), tl.float16, INTERPRET)
        else:
            p_op = _cast(tl.minimum(pv * inv_sig[:, None], 448.0), V_DTYPE, INTERPRET)
        l_new = l_i * r + tl.sum(p, 1) * inv_sig
        return p_op, r, m_new, l_new, sig_new
    elif FP8:  # variant: bf16 P * s_k against the exactly upcast FP8 latent
        return _cast(p * ks[None, :], tl.bfloat16, INTERPRET), alpha, m_new, l_i * alpha + tl.sum(p, 1), sig_i
    else:
        return _cast(p, V_DTYPE, INTERPRET), alpha, m_new, l_i * alpha + tl.sum(p, 1), sig_i


@triton.jit
def _softmax_step_t(t, qscale, ks, m_i, l_i, sig_i, V_DTYPE: tl.constexpr, BLOCK_RULE: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """The FP8-PV online-softmax step (``T_STEP``, the default) on ``t = acc * s_k``: the scores are
    ``S = t * qscale`` with the row scale ``qscale = s_q * sm_scale * log2(e) > 0``, so
    ``rowmax(S) = qscale * rowmax(t)`` and ``S - m`` is one FFMA inside the exp2 (the product
    ``s_q * s_k`` is never formed per element). Same numerics as ``_softmax_step`` up to fp32
    rounding; the GPU's ``cvt.rn.satfinite`` replaces the clamp at 448 (kept under the interpreter).

    ``BLOCK_RULE=False`` (default): the P scale of the block is ``rowmax(P̃) / 448`` per row,
    made monotone, so the row's largest term is 448 exactly (no rounding on the dominant term).
    ``BLOCK_RULE=True``: ``σ_need = max_j(s_k) / 448`` for the whole block (every ``p <= 1``, so it
    bounds every row's P̃), ``1/σ`` folded into the exp2 argument: 2 fewer instructions per
    element, but the dominant term is rounded to FP8 too: 1.8-6x the output error on peaked
    attention (CPU emulation, ``tests/test_mla.py``), so it is an option only."""
    m_blk = tl.max(t, 1) * qscale
    m_new = tl.maximum(m_i, m_blk)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
    sig_keep = sig_i * alpha
    if BLOCK_RULE:
        sig_new = tl.maximum(sig_keep, tl.max(ks, 0) * (1.0 / 448.0))
        r = tl.where(sig_new == sig_keep, 1.0, sig_keep / sig_new)
        # p / sigma; log2 floored: a block that sees no key has sig_new = 0 (exp2(-inf + inf) would be NaN)
        e = tl.exp2(t * qscale[:, None] - (m_safe + tl.log2(tl.maximum(sig_new, 1e-30)))[:, None])
        pv = e * ks[None, :]
        l_new = l_i * r + tl.sum(e, 1)
    else:
        p = tl.exp2(t * qscale[:, None] - m_safe[:, None])
        pt = p * ks[None, :]  # value scale fused into P (Key Step 2)
        sig_new = tl.maximum(tl.max(pt, 1) * (1.0 / 448.0), sig_keep)  # monotone block scale
        inv_sig = tl.where(sig_new > 0, 1.0 / sig_new, 0.0)
        r = tl.where(sig_new == sig_keep, 1.0, sig_keep * inv_sig)
        pv = pt * inv_sig[:, None]
        l_new = l_i * r + tl.sum(p, 1) * inv_sig
    if INTERPRET:  # the GPU's cvt.rn.satfinite clamps the rounding overshoot past 448 by itself
        pv = tl.minimum(pv, 448.0)
    return _cast(pv, V_DTYPE, INTERPRET), r, m_new, l_new, sig_new


@triton.jit
def _softmax_any(s, ks, qscale, m_i, l_i, sig_i, V_DTYPE: tl.constexpr, FP8: tl.constexpr, PV_FP8: tl.constexpr,
                 TAU: tl.constexpr, PV16: tl.constexpr, T_STEP: tl.constexpr, BLOCK_RULE: tl.constexpr,
                 INTERPRET: tl.constexpr):
    if T_STEP:
        return _softmax_step_t(s, qscale, ks, m_i, l_i, sig_i, V_DTYPE, BLOCK_RULE, INTERPRET)
    return _softmax_step(s, ks, m_i, l_i, sig_i, V_DTYPE, FP8, PV_FP8, TAU, PV16, INTERPRET)


@triton.jit
def _pv_step(acc, p_op, rescale, KC, PT, b, stride_pt, stride_kc, n0, end, kc, dv0,
             DC: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
             PV_FP8: tl.constexpr, V_PRMT: tl.constexpr, PV_PROMOTE: tl.constexpr, S_AHEAD: tl.constexpr,
             TAU: tl.constexpr, PV16: tl.constexpr, INTERPRET: tl.constexpr, MASK: tl.constexpr = True,
             TOKENS_M: tl.constexpr = False, DEQ16: tl.constexpr = False):
    """acc = acc * rescale + P · V for the block at n0. V = the block's content rows: the K tile
    itself (bf16, unless S_AHEAD, where K and V belong to different blocks), or (FP8) the rows
    loaded again (an L2 hit), in the layout its wgmma needs (see the module docstring). With
    ``BLOCK_DV`` < DC only the value columns ``[dv0, dv0 + BLOCK_DV)`` (always loaded on their own).
    ``TOKENS_M``: ``acc`` is the transposed accumulator [BLOCK_DV, BLOCK_M] and the product is
    ``V^T · P^T`` (the value columns are the M dimension; bf16: V^T is the K tile read MN-major)."""
    offs_c = dv0 + tl.arange(0, BLOCK_DV)
    REUSE_K: tl.constexpr = (BLOCK_DV == DC) and not S_AHEAD
    if DEQ16:  # the K tile of _scores (REUSE_K: the launcher's rule); 1: fp16 K tile, P̂ upcast (exact)
        vc = kc
        if DEQ16 == 1 or DEQ16 == 3:
            p_op = p_op.to(tl.float16)
    elif FP8 and (PV16 or not PV_FP8) and REUSE_K:  # the K tile itself, upcast (exact): no second load
        vc = kc.to(tl.float16 if (PV_FP8 and PV16) else tl.bfloat16)
    elif FP8 or not REUSE_K:
        slot, tok_ok, slot4 = _block_slots(PT, b, stride_pt, n0, end, BLOCK_N, PAGE, INTERPRET)
        if FP8 and PV_FP8 and PV16:
            vc = _v_rows(KC, stride_kc, tl.where(tok_ok, slot, -1), offs_c).to(tl.float16)
        elif FP8 and PV_FP8 and V_PRMT:  # byte-transposed in registers: 32-bit stores into the K-major smem tile
            vc = _v_kmajor(KC + dv0, stride_kc, slot4, n0 + 4 * tl.arange(0, BLOCK_N // 4), end, BLOCK_N, BLOCK_DV,
                           V_PRMT == 2, INTERPRET, MASK)
        else:
            vc = _v_rows(KC, stride_kc, tl.where(tok_ok, slot, -1), offs_c)
        if FP8 and not PV_FP8:
            vc = vc.to(tl.bfloat16)
    else:
        vc = kc
    # (no early return inside a constexpr branch: the GPU frontend still type-checks the code after it)
    if TOKENS_M:  # (TAU = 0, no PV_PROMOTE: the launcher's rule)
        acc = acc * rescale[None, :]
        if FP8 and PV_FP8 and not PV16:
            acc = tl.dot(tl.trans(vc), tl.trans(p_op), acc)
        else:
            acc = _dot(tl.trans(vc), tl.trans(p_op), acc, INTERPRET)
    else:
        if TAU > 0:  # skip the 128-registers-per-thread rescale when no row needs it (CTA-uniform branch)
            if tl.min(rescale, 0) < 1.0:
                acc = acc * rescale[:, None]
        else:
            acc = acc * rescale[:, None]
        if FP8 and PV_FP8 and not PV16 and not DEQ16:
            if PV_PROMOTE:  # each block's P̂·ĉ in a fresh fp32 tile: exact fp32 sum, 2x acc registers
                acc = acc + tl.dot(p_op, vc)
            else:
                acc = tl.dot(p_op, vc, acc)  # tensor-core fp8 accumulation (docstring)
        else:
            acc = _dot(p_op, vc, acc, INTERPRET)
    return acc


@triton.jit(do_not_specialize=["H", "SQ", "ROWS", "chunk"])  # one compile for every Sq, H, plan
def _mla_decode_kernel(
    # pointers
    QC, QR, QS, KC, KR, KS, PT, SEQ, O, LSE,
    # sizes
    sm_scale_log2e, H, SQ, ROWS, chunk,
    # strides
    stride_qc, stride_qr, stride_kc, stride_kr, stride_pt, stride_o, stride_os, stride_ls,
    # constexpr
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr, IMPRECISE: tl.constexpr,
    PV_PROMOTE: tl.constexpr, PV_FP8: tl.constexpr, V_PRMT: tl.constexpr, S_AHEAD: tl.constexpr,
    TAU: tl.constexpr, PV16: tl.constexpr, EVEN_LOOP: tl.constexpr, ONE_ACC: tl.constexpr, T_STEP: tl.constexpr,
    BLOCK_RULE: tl.constexpr, TOKENS_M: tl.constexpr, DEQ16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    NDV: tl.constexpr = DC // BLOCK_DV  # programs sharing a row block, one per slice of the output columns
    pid_m = tl.program_id(0) // NDV
    dv0 = (tl.program_id(0) % NDV) * BLOCK_DV
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(SEQ + b)
    start = pid_s * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < ROWS
    lim = seq_len - SQ + 1 + offs_m // H  # causal among the Sq query tokens: keys [0, lim)
    rows = b * ROWS + offs_m
    offs_c = tl.arange(0, DC)
    offs_r = tl.arange(0, DR)
    qc = tl.load(QC + rows[:, None] * stride_qc + offs_c[None, :], mask=row_ok[:, None], other=0.0)
    if DEQ16 == 1 or DEQ16 == 3:
        qc = qc.to(tl.float16)  # exact
    qr = tl.load(QR + rows[:, None] * stride_qr + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    if FP8:
        qscale = tl.load(QS + rows, mask=row_ok, other=1.0) * sm_scale_log2e  # > 0 (T_STEP relies on it)
    else:
        qscale = tl.zeros([BLOCK_M], tl.float32)  # unused

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    sig_i = tl.zeros([BLOCK_M], tl.float32)
    if TOKENS_M:  # transposed accumulator: the value columns are the M dimension of the PV dot
        acc = tl.zeros([BLOCK_DV, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if S_AHEAD:
        # software-pipelined by hand: iteration j computes P·V of block j-1 and the scores of block j.
        # The QK dot's result then reaches the PV dot only through the loop-carried P, so Triton
        # does not treat the two dots as a chain and splits QK's N over the two warpgroups instead
        # of computing the whole [BLOCK_M, BLOCK_N] tile in both (warpsPerCTA [8, 1] for a chained
        # dot: with BLOCK_M = 64 the second warpgroup duplicates the first). V is loaded on its own.
        # (only P and the rescale factor are carried: the K tile must not be, or it would live in registers)
        s0, ks0, _k0 = _scores(qc, qr, qscale, KC, KR, KS, PT, b, stride_pt, stride_kc, stride_kr, start, end, lim,
                               sm_scale_log2e, DC, DR, BLOCK_N, PAGE, FP8, IMPRECISE, INTERPRET, True, ONE_ACC, T_STEP)
        p_op, rescale, m_i, l_i, sig_i = _softmax_any(s0, ks0, qscale, m_i, l_i, sig_i, KC.dtype.element_ty, FP8, PV_FP8,
                                                       TAU, PV16, T_STEP, BLOCK_RULE, INTERPRET)
        for n0 in range(start + BLOCK_N, end, BLOCK_N):  # monotone block order (SnapMLA App. C)
            acc = _pv_step(acc, p_op, rescale, KC, PT, b, stride_pt, stride_kc, n0 - BLOCK_N, end, 0, dv0, DC, BLOCK_DV,
                           BLOCK_N, PAGE, FP8, PV_FP8, V_PRMT, PV_PROMOTE, S_AHEAD, TAU, PV16, INTERPRET)
            s, ks, _k = _scores(qc, qr, qscale, KC, KR, KS, PT, b, stride_pt, stride_kc, stride_kr, n0, end, lim,
                                sm_scale_log2e, DC, DR, BLOCK_N, PAGE, FP8, IMPRECISE, INTERPRET, True, ONE_ACC, T_STEP)
            p_op, rescale, m_i, l_i, sig_i = _softmax_any(s, ks, qscale, m_i, l_i, sig_i, KC.dtype.element_ty, FP8,
                                                           PV_FP8, TAU, PV16, T_STEP, BLOCK_RULE, INTERPRET)
        last = start + tl.maximum(tl.cdiv(end - start, BLOCK_N) - 1, 0) * BLOCK_N
        acc = _pv_step(acc, p_op, rescale, KC, PT, b, stride_pt, stride_kc, last, end, 0, dv0, DC, BLOCK_DV, BLOCK_N, PAGE, FP8,
                       PV_FP8, V_PRMT, PV_PROMOTE, S_AHEAD, TAU, PV16, INTERPRET)
    else:
        if EVEN_LOOP:  # whole blocks that every row sees entirely: no token or causal masks at all
            vis = tl.minimum(end, seq_len - SQ + 1)
            full_end = start + tl.maximum(vis - start, 0) // BLOCK_N * BLOCK_N
            for n0 in range(start, full_end, BLOCK_N):  # monotone block order (SnapMLA App. C)
                s, ks, kc = _scores(qc, qr, qscale, KC, KR, KS, PT, b, stride_pt, stride_kc, stride_kr, n0, end, lim,
                                    sm_scale_log2e, DC, DR, BLOCK_N, PAGE, FP8, IMPRECISE, INTERPRET, False, ONE_ACC, T_STEP,
                                    TOKENS_M, DEQ16)
                p_op, rescale, m_i, l_i, sig_i = _softmax_any(s, ks, qscale, m_i, l_i, sig_i, KC.dtype.element_ty, FP8,
                                                               PV_FP8, TAU, PV16, T_STEP, BLOCK_RULE, INTERPRET)
                acc = _pv_step(acc, p_op, rescale, KC, PT, b, stride_pt, stride_kc, n0, end, kc, dv0, DC, BLOCK_DV,
                               BLOCK_N, PAGE, FP8, PV_FP8, V_PRMT, PV_PROMOTE, S_AHEAD, TAU, PV16, INTERPRET, False, TOKENS_M,
                               DEQ16)
        else:
            full_end = start
        for n0 in range(full_end, end, BLOCK_N):  # the ragged / causal tail (or every block), masked
            s, ks, kc = _scores(qc, qr, qscale, KC, KR, KS, PT, b, stride_pt, stride_kc, stride_kr, n0, end, lim,
                                sm_scale_log2e, DC, DR, BLOCK_N, PAGE, FP8, IMPRECISE, INTERPRET, True, ONE_ACC, T_STEP,
                                TOKENS_M, DEQ16)
            p_op, rescale, m_i, l_i, sig_i = _softmax_any(s, ks, qscale, m_i, l_i, sig_i, KC.dtype.element_ty, FP8,
                                                           PV_FP8, TAU, PV16, T_STEP, BLOCK_RULE, INTERPRET)
            acc = _pv_step(acc, p_op, rescale, KC, PT, b, stride_pt, stride_kc, n0, end, kc, dv0, DC, BLOCK_DV, BLOCK_N, PAGE, FP8,
                           PV_FP8, V_PRMT, PV_PROMOTE, S_AHEAD, TAU, PV16, INTERPRET, True, TOKENS_M, DEQ16)

    if TOKENS_M:
        acc = tl.trans(acc)
    inv_l = tl.where(l_i == 0, 0.0, 1.0 / l_i)  # a NaN l (a NaN latent scale) stays NaN
    offs_v = dv0 + tl.arange(0, BLOCK_DV)
    out = acc * inv_l[:, None]
    if SPLIT:
        ell = l_i * sig_i if (FP8 and PV_FP8) else l_i
        lse = tl.where(l_i == 0, float("-inf"), m_i + tl.log2(ell))
        tl.store(LSE + pid_s * stride_ls + rows, lse, mask=row_ok & (dv0 == 0))  # equal in every column slice
        tl.store(O + pid_s * stride_os + rows[:, None] * stride_o + offs_v[None, :], out, mask=row_ok[:, None])
    else:
        tl.store(O + rows[:, None] * stride_o + offs_v[None, :], _cast(out, O.dtype.element_ty, INTERPRET),
                 mask=row_ok[:, None])


@triton.jit
def _mla_combine_kernel(
    OW, LSE, O,
    NSPLIT,
    stride_ows, stride_ow, stride_ls, stride_o,
    DC: tl.constexpr, SPLITS_P2: tl.constexpr, INTERPRET: tl.constexpr,
):
    """out[row] = sum_s 2^(lse_s - lse) o_s[row], lse = log2 sum_s 2^lse_s (empty splits: lse = -inf)."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_c = tl.arange(0, DC)
    s_ok = offs_s < NSPLIT
    lse = tl.load(LSE + offs_s * stride_ls + row, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    o = tl.load(OW + offs_s[:, None] * stride_ows + row * stride_ow + offs_c[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0)
    tl.store(O + row * stride_o + offs_c, _cast(out, O.dtype.element_ty, INTERPRET))


def split_workspace(out, splits: int):
    """(partial outputs, LSE, output pointer / its row stride / split stride, LSE split stride) of a launch
    with ``splits`` chunks: fp32 workspaces when > 1, else the output itself."""
    B, ROWS, DC = out.shape
    if splits > 1:
        ow = torch.empty(splits, B * ROWS, DC, device=out.device, dtype=torch.float32)
        lse = torch.empty(splits, B * ROWS, device=out.device, dtype=torch.float32)
        return ow, lse, ow, ow.stride(1), ow.stride(0), lse.stride(0)
    return None, None, out.view(B * ROWS, DC), DC, 0, 0


def combine_splits(ow, lse, out, splits: int) -> None:
    """Merge the split partials into ``out`` (no-op for one split)."""
    if splits > 1:
        B, ROWS, DC = out.shape
        _mla_combine_kernel[(B * ROWS,)](
            ow, lse, out.view(B * ROWS, DC), splits, ow.stride(0), ow.stride(1), lse.stride(0), DC,
            DC=DC, SPLITS_P2=max(2, triton.next_power_of_2(splits)), INTERPRET=interpret_mode(), num_warps=4,
        )


def _num_sms(device) -> int:
    return sm_count(device, 4)


def plan_splits(batch: int, row_blocks: int, max_len: int, block_n: int, device, num_splits: int | None = None,
                ctas_per_sm: int = 1):
    """(num_splits, chunk): enough programs to fill the SMs (``ctas_per_sm`` resident programs each)
    in whole waves, chunks of >= 4 blocks."""
    blocks = max(1, cdiv(max_len, block_n))
    if num_splits is None:
        sms = _num_sms(device) * ctas_per_sm
        tiles = batch * row_blocks
        best, best_eff = 1, 0.0
        for s in range(1, min(64, max(1, blocks // 4)) + 1):
            n = tiles * s
            eff = n / (cdiv(n, sms) * sms) - 0.01 * (s - 1)  # small cost per extra split (combine pass)
            if eff > best_eff + 1e-9:
                best, best_eff = s, eff
        num_splits = best
    num_splits = max(1, min(num_splits, blocks))
    chunk = cdiv(blocks, num_splits) * block_n
    return cdiv(max_len, chunk) if max_len > 0 else 1, chunk


def mla_decode_triton(qc, qr, qs, kc, kr, ks, page_table, seq_lens, *, num_heads: int, sm_scale: float,
                      max_seq_len: int, page_size: int, fp8: bool, out_dtype=torch.bfloat16,
                      num_splits: int | None = None, block_n: int | None = None, block_m: int | None = None,
                      imprecise: int | None = None, pv_promote: bool = False, pv_fp8: bool = True,
                      v_prmt: int = 2, s_ahead: bool | None = None, tau: float = 0.0, pv16: bool = False,
                      num_warps: int | None = None,
                      num_stages: int | None = None, dv_splits: int | None = None,
                      even_loop: bool | None = None, one_acc: bool | None = None, p_block: bool | None = None,
                      t_step: bool | None = None, ctas_per_sm: int | None = None, tokens_m: bool | None = None,
                      deq16: bool | None = None, gluon: bool | None = None,
                      return_plan: bool = False):
    """Launch the decode kernel. ``qc`` [B, Sq*H, Dc] (fp8 with ``fp8``), ``qr`` [B, Sq*H, Dr],
    ``qs`` [B, Sq*H] fp32 or None; cache tensors as in the module docstring. Returns the output
    [B, Sq*H, Dc] in ``out_dtype`` (and, with ``return_plan``, a dict: splits, chunk, block_n,
    block_m and the compiled decode kernel, for the reference's emulation and for PTX checks).
    Arguments are validated by ``lowbit.ops.mla.mla_decode``. ``gluon``: on a Hopper GPU, FP8 caches with at most 48
    rows per sequence run the Gluon few-rows kernel (``lowbit.kernels.mla_decode_gluon``) and bf16/fp16 caches with a
    multiple of 64 rows the warp-specialized wgmma kernels (``lowbit.kernels.mla_decode_wgmma``: bf16/fp16, and FP8
    with the default SnapMLA P; not with tuning arguments); None = where it applies, False = this Triton kernel."""
    B, ROWS, DC = qc.shape
    DR = qr.shape[-1]
    SQ = ROWS // num_heads
    dev = qc.device
    interp = interpret_mode() or dev.type != "cuda"
    if fp8 and pv_fp8 and not tau and not interp and gluon is not False and GLUON_FEW:
        from lowbit.kernels import mla_decode_gluon as G

        if G.supported(ROWS, DC, DR, page_size, kc, kr, ks):
            return G.mla_decode_few_gluon(qc, qr, qs, kc, kr, ks, page_table, seq_lens, num_heads=num_heads,
                                          sm_scale=sm_scale, max_seq_len=max_seq_len, page_size=page_size,
                                          out_dtype=out_dtype, num_splits=num_splits, pv16=pv16,
                                          return_plan=return_plan)
    tuned = any(x is not None for x in (block_n, block_m, num_warps, num_stages, dv_splits, even_loop, one_acc,
                                        s_ahead, ctas_per_sm, tokens_m, imprecise, deq16)) or v_prmt != 2
    if not tau and not interp and gluon is not False and GLUON_WIDE and not tuned:
        from lowbit.kernels import mla_decode_wgmma as MW

        kw = dict(num_heads=num_heads, sm_scale=sm_scale, max_seq_len=max_seq_len, page_size=page_size,
                  num_splits=num_splits, return_plan=return_plan)
        snap = pv_fp8 and not pv16 and not pv_promote and not p_block and t_step is not False  # the FP8 form's P
        if (not fp8 or snap) and MW.supported(ROWS, DC, DR, page_size, qc, qr, kc, kr, qs, ks if fp8 else None):
            return MW.mla_decode_wgmma(qc, qr, qs, kc, kr, ks if fp8 else None, page_table, seq_lens,
                                       out_dtype=out_dtype, **kw)
    if gluon:
        raise ValueError("gluon=True needs an FP8 cache with SnapMLA P (pv_fp8) and at most 48 rows per sequence, "
                         "or a multiple of 64 rows per sequence (bf16/fp16 cache, or FP8 with the default row P "
                         "scale; no tuning arguments); the DeepSeek latent (512 + 64), pages a multiple of the "
                         "kernel's block, a Hopper GPU and no TRITON_INTERPRET")
    path = "bf16" if not fp8 else ("fp8-f16pv" if pv16 and pv_fp8 else "fp8" if pv_fp8 else "fp8-bf16pv")
    wide = WIDE.get(path) if (not interp and ROWS > 64 and not tau) else None
    if wide:
        block_m = wide["block_m"] if block_m is None else block_m
        dv_splits = wide["dv_splits"] if dv_splits is None else dv_splits
        s_ahead = wide["s_ahead"] if s_ahead is None else s_ahead
        even_loop = wide["even_loop"] if even_loop is None else even_loop
        one_acc = wide["one_acc"] if one_acc is None else one_acc
    few = FEW.get(path) if (not interp and ROWS <= FEW.get(path, {}).get("max_rows", FEW_ROWS) and not tau) else None
    if few:
        block_m = few.get("block_m", max(16, triton.next_power_of_2(ROWS))) if block_m is None else block_m
        block_n = few.get("block_n") if block_n is None else block_n
        num_warps = few.get("num_warps") if num_warps is None else num_warps
        num_stages = few.get("num_stages") if num_stages is None else num_stages
        s_ahead = few.get("s_ahead") if s_ahead is None else s_ahead
        even_loop = few.get("even_loop") if even_loop is None else even_loop
        one_acc = few.get("one_acc") if one_acc is None else one_acc
        ctas_per_sm = few.get("ctas_per_sm") if ctas_per_sm is None else ctas_per_sm
    tokens_m = bool((few or {}).get("tokens_m", False) if tokens_m is None else tokens_m)
    deq16 = int((few or {}).get("deq16", 0) if deq16 is None else deq16) if (fp8 and pv_fp8 and not pv16) else 0
    if deq16:  # K tile upcast once, reused as V: plain loop, all columns per program, no lazy max
        s_ahead, tau, pv_promote, dv_splits = False, 0.0, False, 1
    if tokens_m:  # the transposed dots: plain loop, no lazy max, no promoted PV, all columns per program
        s_ahead, tau, pv_promote, dv_splits = False, 0.0, False, 1
        if block_m is None:
            block_m = max(16, min(64, triton.next_power_of_2(ROWS)))
    if block_m is None:
        block_m = 64 if not interp else max(16, min(64, triton.next_power_of_2(ROWS)))
    if block_n is None:
        block_n = PV_BLOCK_N[path] if not interp else 16
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m ({block_m}) must be a power of two >= 16 (< 64: mma.sync on the GPU)")
    ok4 = fp8 and pv_fp8 and page_size % 4 == 0 and block_n % 4 == 0 and DC % 16 == 0 and kc.stride(0) % 4 == 0
    v_prmt = int(v_prmt) if (ok4 and not pv16 and not deq16) else 0
    if s_ahead is None:
        s_ahead = S_AHEAD[path]
    if dv_splits is None:
        dv_splits = DV_SPLITS[path] if not interp else 1
    if DC % dv_splits or (DC // dv_splits) < 16 or dv_splits & (dv_splits - 1):
        raise ValueError(f"dv_splits ({dv_splits}) must be a power of two dividing the latent width {DC} into >= 16")
    fp8pv = fp8 and pv_fp8 and not pv16 and not tau
    t_step_on = fp8pv and bool(T_STEP[path] if t_step is None else t_step)
    p_rule = "row" if not t_step_on else (
        ("block" if P_BLOCK[path] else "row") if p_block is None else ("block" if p_block else "row"))
    row_blocks = cdiv(ROWS, block_m)
    if num_warps is None:
        num_warps = (4 * max(1, block_n // 64) if tokens_m else 8) if (not interp and DC >= 256) else 4
    # 4 warps, 64 rows, half the columns: 255 registers x 128 threads and ~100 KB smem fit 2 per SM
    resident = 2 if (num_warps == 4 and block_m == 64 and dv_splits >= 2 and not interp) else 1
    if ctas_per_sm is not None:  # programs resident per SM, for the split plan (sweeps, small tiles)
        resident = max(1, int(ctas_per_sm))
    splits, chunk = plan_splits(B, row_blocks * dv_splits, max_seq_len, block_n, dev, num_splits, resident)
    out = torch.empty(B, ROWS, DC, device=dev, dtype=out_dtype)
    qc2, qr2 = qc.reshape(B * ROWS, DC), qr.reshape(B * ROWS, DR)
    ow, lse, o_arg, so, sos, sls = split_workspace(out, splits)
    if num_stages is None:
        num_stages = PV_STAGES[path] if not interp else 1
    dummy = kc.new_empty(1, dtype=torch.float32) if qs is None else None
    kernel = _mla_decode_kernel[(row_blocks * dv_splits, splits, B)](
        qc2, qr2, qs if qs is not None else dummy, kc, kr, ks if ks is not None else dummy,
        page_table, seq_lens, o_arg, lse if lse is not None else o_arg,
        sm_scale * LOG2E, num_heads, SQ, ROWS, chunk,
        qc2.stride(0), qr2.stride(0), kc.stride(0), kr.stride(0), page_table.stride(0), so, sos, sls,
        DC=DC, DR=DR, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DV=DC // dv_splits, PAGE=page_size, FP8=fp8, SPLIT=splits > 1,
        IMPRECISE=min(DC if imprecise is None else imprecise, DC), PV_PROMOTE=pv_promote, PV_FP8=pv_fp8,
        V_PRMT=v_prmt, S_AHEAD=s_ahead, TAU=float(tau), PV16=bool(pv16 and fp8 and pv_fp8),
        EVEN_LOOP=bool(EVEN_LOOP[path] if even_loop is None else even_loop),
        ONE_ACC=bool(ONE_ACC[path] if one_acc is None else one_acc), BLOCK_RULE=p_rule == "block",
        T_STEP=t_step_on, TOKENS_M=tokens_m, DEQ16=int(deq16),
        INTERPRET=interpret_mode(), num_warps=num_warps, num_stages=num_stages,
    )
    combine_splits(ow, lse, out, splits)
    if return_plan:
        return out, {"splits": splits, "chunk": chunk, "block_n": block_n, "block_m": block_m, "v_prmt": v_prmt,
                     "dv_splits": dv_splits, "p_rule": p_rule, "num_warps": num_warps, "num_stages": num_stages,
                     "s_ahead": s_ahead, "ctas_per_sm": resident, "tokens_m": tokens_m, "deq16": deq16,
                     "kernel": kernel}
    return out
