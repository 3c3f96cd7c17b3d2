"""Grouped low-bit GEMMs over the experts of a mixture-of-experts layer, one launch for all experts:
``y[r] = sx[a(r)] * xq[a(r)] @ W_e^T`` (times the format's scales) for each row ``r`` routed to expert ``e``.
Formats ``w4a8-fp8`` (``_moe_w4a8_fp8_kernel``), ``w4a8-int8`` (``_moe_w4a8_int8_kernel``) and ``lut``
(``_moe_lut_kernel``; weight-only: ``y[r] = x[a(r)] @ W_hat_e^T``, no activation scale).

The per-expert arithmetic is each format's dense decode kernel's, through the same helpers:
- ``w4a8-fp8`` (FireQ §3.1; ``lowbit.kernels.w4a8_fp8_gemm``): packed INT4 codes and FP8 group scales dequantized in
  registers by ``_dequant_tile`` (FP8 lookup table on the GPU, its arithmetic twin under the interpreter), FP8 x FP8
  ``tl.dot`` per K tile of 128 with the tile's product added into an FP32 accumulator (``ACC_TILE``: Hopper's FP8
  accumulator holds 4 k32 steps before each FP32 add); epilogue ``* sx * inv_delta[e]``.
- ``w4a8-int8`` (QServe §4; ``lowbit.kernels.w4a8_int8_gemm``): UINT4 codes -> INT8 ``q * s2 - zs``
  (``_dequant_halves``), INT8 x INT8 ``tl.dot`` into INT32 (exact), epilogue ``float32(acc) * sx * s1[e][n]``. Group
  sizes that are multiples of 128 and per-channel weights (one ``(s2, zs)`` per row and K tile); codes row-major or
  row-tiled (``_code_rows``).
- ``lut`` (FLUTE §3; ``lowbit.kernels.lut_wgmma``, the register-table kernel of 9..128 tokens): 3/4-bit codes in the
  fragment layout (``formats.lut.pack_codes_mma``, the ``LUTLinear`` default), looked up in registers by ``prmt``
  (``_decode``, the table in the activation dtype), relabelled into the wgmma A fragment (``_reg_a``), one dot per
  half tile (rows g / g + 8 of each 16-row tile) against the bf16 / fp16 rows; per scale group the products are
  summed in FP32 and scaled once (``acc += part * s``), as the dense LUT kernels do.
All put the weight tile in the 64-row wgmma operand (``SWAP_AB``: the few routed rows are the wgmma N).

The routing (``lowbit.kernels.moe_route`` builds it):
- Rows are sorted by expert: expert ``e`` owns rows ``[offsets[e], offsets[e + 1])`` (int32 ``[E + 1]``, on the
  device: computing them needs no host read, so a decode step stays CUDA-graph capturable). ``row_map`` (int32
  ``[R]``, optional) names the row of ``xq`` / ``sx`` each sorted row reads (gate_up: the token); without it row
  ``r`` reads row ``r`` (down, whose input is already in sorted order).
- Weights stay one module per expert (checkpoints unchanged): the kernels read expert ``e``'s tensors through tables
  of their addresses (int64 ``[E]`` per field, ``address_table``), all experts with the same shapes and strides.
  Addresses read from memory carry no alignment facts, so the kernels assert 16 bytes (``tl.multiple_of``; the
  launcher checks it): without it the codes load byte by byte and the 4-byte inline-asm lookups mix bytes of
  different words (session 39's first GPU run: wrong results, right under the interpreter).
- Grid ``(E, N / BLOCK_N, SPLIT_K)``: a program whose expert got no rows does nothing, so only the routed experts'
  weights are read. Rows beyond ``BLOCK_M`` per expert loop inside the program (the weight tile is re-read, from L2).
- ``SPLIT_K > 1`` (few experts hit, long K: down): each program writes its scaled FP32 partial to
  ``ws [SPLIT_K, R, N]``; the launcher sums the splits in order or returns them (``partials``) for the combine.

Rows ``>= offsets[E]`` (ids of no expert) are not written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, device_table, interpret_mode, sm_count
from lowbit.kernels.w4a8_fp8_gemm import HALF_K, _dequant_tile, _split_k, _use_lut
from lowbit.kernels.lut_prmt import _byte_tables
from lowbit.kernels.lut_gemm import _store_pair_table
from lowbit.kernels.lut_wgmma import _group_dots, _next_group_words, _reg_a_k, _reg_a_row, table_offset
from lowbit.kernels.w4a8_int8_gemm import _code_rows, _dequant_halves, _group_params

BLOCK_N = 128  # weight rows per program (two 64-row wgmma M tiles)
BLOCK_M_MAX = 64  # routed rows per inner step: a power of two from 16 up to this
SPLIT_TARGET = 2.0  # split K until the programs of the experts that can be hit reach this many per SM
MIN_K_TILES = 8  # ... keeping at least this many K tiles of 128 per split
NUM_WARPS, NUM_STAGES = 4, 4
# pipeline stages of the lut kernel; None: 2 at 16-row steps, else 3. Session 40 (H200, Mixtral-8x7B block, CUDA
# graph, with the shared table, us; s40_moe_lut_smem.json): 1 / 16 tokens 95.4 / 305 at 2 vs 128 / 340 at 3; 4 tokens
# 241 vs 231; 64 tokens (32-row steps) 576 vs 521
LUT_STAGES = None
# the next group's code words in registers (``_moe_lut_kernel``): 143 vs 156 us at 1 token, 784 vs 880 at 64
LUT_PREFETCH = True
# the shared-memory pair-table decode (``lut_wgmma``'s ``SMEM_TAB``): session 40 (same file), us, 1 / 4 / 16 / 64 tokens:
# 128 / 231 / 340 / 521 vs the byte-table ``prmt`` decode's 145 / 331 / 450 / 612 (3 stages both)
LUT_SMEM_TAB = True
LUT_SPLIT_TARGET = SPLIT_TARGET  # programs per SM the lut kernel's split-K aims at (4 / 8: within 3 % either way)
# routed rows per inner step of the lut kernel; None: the power of two >= twice the mean rows per hit expert (16..64).
# Session 40 (H200, Mixtral-8x7B block, CUDA graph, us; s40_moe_lut_sweep.json): 64 tokens 607 at 32 vs 784 at 64
# and 758 at 16; 4 / 16 tokens 402 / 541 at 32 vs 328 / 446 at 16
LUT_BLOCK_M = None
SPLIT_M_MIN_STEPS = 2  # mean row steps per hit expert from which the row steps, not K, are split (``pick_split_m``)


@triton.jit
def _program(Offsets, k_tiles, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's expert ``e``, its sorted rows ``[start, end)``, its weight rows ``offs_n`` and its K tiles
    ``[kt0, kt1)`` (grid ``(E, N / BLOCK_N, SPLIT_K)``)."""
    e = tl.program_id(0)
    pid_k = tl.program_id(2)
    per = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, pid_k, tl.load(Offsets + e), tl.load(Offsets + e + 1), offs_n, kt0, tl.minimum(kt0 + per, k_tiles)


@triton.jit
def _program_rows(Offsets, k_tiles, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  SPLIT_M: tl.constexpr):
    """``_program`` with split rows (``SPLIT_M > 1``, session 41): grid ``(E, N / BLOCK_N, SPLIT_K * SPLIT_M)``, split
    ``pid_k`` of K and every ``SPLIT_M``-th row step from ``pid_m``: ``start`` is the first of this program's steps
    (its steps: ``range(start, end, BLOCK_M * SPLIT_M)``). A separate helper, not a branch inside ``_program``: with
    the split folded into ``_program`` the decode launches (``SPLIT_M == 1``) compiled to other code and ran 15-30 %
    slower on the H200 (``s41_ab_block_*.json``)."""
    e = tl.program_id(0)
    pid_k = tl.program_id(2) % SPLIT_K
    pid_m = tl.program_id(2) // SPLIT_K
    per = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(Offsets + e) + pid_m * BLOCK_M
    return e, pid_k, start, tl.load(Offsets + e + 1), offs_n, kt0, tl.minimum(kt0 + per, k_tiles)


@triton.jit
def _expert_address(Table, e, DT: tl.constexpr):
    """Expert ``e``'s tensor from an address table, as a pointer to ``DT``. Addresses read from memory carry no
    alignment facts: without the 16-byte hint Triton would load the codes byte by byte, and the 4-byte inline-asm
    lookups (``pack=4``) need each thread to hold whole words (module docstring)."""
    return tl.multiple_of(tl.load(Table + e).to(tl.pointer_type(DT)), 16)


@triton.jit
def _row_step(A, RowMap, m0, end, stride_am, BLOCK_M: tl.constexpr, GATHER: tl.constexpr):
    """Sorted rows ``[m0, m0 + BLOCK_M)`` of one expert (those >= ``end`` masked): (rows, mask, the activation row
    each reads, pointers to those rows of ``A``)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    mask_m = rows < end
    if GATHER:
        arow = tl.load(RowMap + rows, mask=mask_m, other=0)
    else:
        arow = rows
    return rows, mask_m, arow, A + arow[:, None].to(tl.int64) * stride_am


@triton.jit
def _store_rows(y, rows, mask_m, offs_n, N, R, C, Ws, pid_k, stride_cm, SPLIT_K: tl.constexpr):
    """Scaled fp32 ``y [BLOCK_M, BLOCK_N]`` -> ``C`` (its dtype) or, split-K, this split's FP32 partial in ``Ws``."""
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    out = rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(C + out, y.to(C.dtype.element_ty), mask=mask)
    else:
        tl.store(Ws + pid_k.to(tl.int64) * R * N + out, y, mask=mask)


@triton.jit
def _moe_w4a8_fp8_kernel(
    # pointers
    A, Sx, RowMap, Offsets, CodePtrs, ScalePtrs, InvDelta, C, Ws,
    # sizes
    N, K, R,
    # strides
    stride_am, stride_bn, stride_sn, stride_cm,
    # flags
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    GATHER: tl.constexpr, LUT: tl.constexpr, SWORD: tl.constexpr, SPLIT_M: tl.constexpr = 1,
):
    k_tiles = tl.cdiv(K, 2 * HALF_K)
    if SPLIT_M == 1:
        e, pid_k, start, end, offs_n, kt0, kt1 = _program(Offsets, k_tiles, BLOCK_N, SPLIT_K)
    else:
        e, pid_k, start, end, offs_n, kt0, kt1 = _program_rows(Offsets, k_tiles, BLOCK_N, SPLIT_K, BLOCK_M, SPLIT_M)
    Bq = _expert_address(CodePtrs, e, tl.uint8)
    Bs = _expert_address(ScalePtrs, e, tl.float8e4nv)
    inv_delta = tl.load(InvDelta + e)
    offs_h = tl.arange(0, HALF_K)
    offs_k = tl.arange(0, 2 * HALF_K)
    mask_n = offs_n < N
    b_rows = Bq + offs_n[:, None].to(tl.int64) * stride_bn
    w_rows = Bq.to(tl.pointer_type(tl.int32)) + offs_n[:, None].to(tl.int64) * (stride_bn // 4)
    s_rows = Bs + offs_n.to(tl.int64) * stride_sn
    s_words = Bs.to(tl.pointer_type(tl.int32)) + offs_n.to(tl.int64) * (stride_sn // 4)
    for m0 in range(start, end, BLOCK_M * SPLIT_M):  # no iteration for an expert without rows
        rows, mask_m, arow, a_rows = _row_step(A, RowMap, m0, end, stride_am, BLOCK_M, GATHER)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for kt in range(kt0, kt1):
            k_all = kt * 2 * HALF_K + offs_k
            a_all = tl.load(a_rows + k_all[None, :], mask=mask_m[:, None] & (k_all < K)[None, :], other=0.0)
            w_lo, w_hi = _dequant_tile(b_rows, w_rows, s_rows, s_words, kt, mask_n, offs_h, Bq, tl.program_id(1) * BLOCK_N,
                                       Bq, k_tiles, GROUP, BLOCK_N, LUT, SWORD, False, False, LUT)
            w_all = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 2, 1)), [BLOCK_N, 2 * HALF_K])
            acc += tl.dot(w_all, tl.trans(a_all), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
        sx = tl.load(Sx + arow, mask=mask_m, other=0.0)
        y = tl.trans(acc) * (sx * inv_delta)[:, None]
        _store_rows(y, rows, mask_m, offs_n, N, R, C, Ws, pid_k, stride_cm, SPLIT_K)


@triton.jit
def _moe_w4a8_int8_kernel(
    # pointers
    A, Sx, RowMap, Offsets, CodePtrs, S1Ptrs, S2Ptrs, ZsPtrs, C, Ws,
    # sizes
    N, K, R, KP,
    # strides
    stride_am, stride_wn, stride_gn, stride_cm,
    # flags
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    GATHER: tl.constexpr, TILED: tl.constexpr, USE_ASM: tl.constexpr, SPLIT_M: tl.constexpr = 1,
):
    PER_CHANNEL: tl.constexpr = GROUP_SIZE < 0
    if SPLIT_M == 1:
        e, pid_k, start, end, offs_n, kt0, kt1 = _program(Offsets, KP // (2 * HALF_K), BLOCK_N, SPLIT_K)
    else:
        e, pid_k, start, end, offs_n, kt0, kt1 = _program_rows(Offsets, KP // (2 * HALF_K), BLOCK_N, SPLIT_K, BLOCK_M,
                                                               SPLIT_M)
    W = _expert_address(CodePtrs, e, tl.uint8)
    S1 = _expert_address(S1Ptrs, e, tl.float32)
    GS = _expert_address(S2Ptrs, e, tl.uint8)
    GZS = _expert_address(ZsPtrs, e, tl.uint8)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)  # clamped: columns >= N are computed and not stored
    offs_h = tl.arange(0, HALF_K)
    w_base, w_inc = _code_rows(rn, N, stride_wn, TILED)
    w_ptrs = W + w_base[:, None] + offs_h[None, :]
    if PER_CHANNEL:
        s2 = tl.load(GS + rn * stride_gn).to(tl.int32)
        zs = tl.load(GZS + rn * stride_gn).to(tl.int32)
    s1 = tl.load(S1 + rn)
    for m0 in range(start, end, BLOCK_M * SPLIT_M):  # no iteration for an expert without rows
        rows, mask_m, arow, a_rows = _row_step(A, RowMap, m0, end, stride_am, BLOCK_M, GATHER)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        for kt in range(kt0, kt1):
            k0 = kt * 2 * HALF_K
            a_lo = tl.load(a_rows + (k0 + offs_h)[None, :], mask=mask_m[:, None] & (k0 + offs_h < K)[None, :], other=0)
            a_hi = tl.load(a_rows + (k0 + HALF_K + offs_h)[None, :],
                           mask=mask_m[:, None] & (k0 + HALF_K + offs_h < K)[None, :], other=0)
            b = tl.load(w_ptrs + kt * w_inc[:, None])
            if not PER_CHANNEL:
                s2, zs = _group_params(GS, GZS, rn, stride_gn, k0 // GROUP_SIZE, False)
            w_lo, w_hi = _dequant_halves(b, tl.broadcast_to(s2[:, None], (BLOCK_N, HALF_K)),
                                         tl.broadcast_to(zs[:, None], (BLOCK_N, HALF_K)), USE_ASM)
            acc = tl.dot(w_lo, tl.trans(a_lo), acc, out_dtype=tl.int32)
            acc = tl.dot(w_hi, tl.trans(a_hi), acc, out_dtype=tl.int32)
        sx = tl.load(Sx + arow, mask=mask_m, other=0.0)
        y = tl.trans(acc.to(tl.float32)) * sx[:, None] * s1[None, :]  # (acc * sx) * s1: the reference's order
        _store_rows(y, rows, mask_m, offs_n, N, R, C, Ws, pid_k, stride_cm, SPLIT_K)


@triton.jit(do_not_specialize=["TAB_OFF"])
def _moe_lut_kernel(
    # pointers
    A, RowMap, Offsets, QPtrs, QHPtrs, SPtrs, PPtrs, C, Ws,
    # sizes
    N, K, R, NRT, NC, NG,
    # strides
    stride_am, stride_sg, stride_cm,
    # shared offset of the pair table (SMEM_TAB only: Triton's own shared size, set by the launcher)
    TAB_OFF,
    # flags
    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
    GATHER: tl.constexpr, EMU: tl.constexpr, PREFETCH: tl.constexpr, SMEM_TAB: tl.constexpr = 0,
    SPLIT_M: tl.constexpr = 1,
):
    """Program = 8 row tiles of 16 weight rows (two 64-row halves: rows g and g + 8 of each tile) x one expert x one
    split-K range of scale groups (``lut_wgmma._lut_wgmma_kernel``'s two-dot ``REG_A`` tile). ``PREFETCH``: the
    next group's code words are loaded into registers while this group is decoded (its register double buffer).
    ``SMEM_TAB``: the codes are looked up in the expert's lane-duplicated pair table, written to shared memory at
    ``TAB_OFF`` (``lut_wgmma``'s ``SMEM_TAB``), instead of the byte-table ``prmt`` decode."""
    RT: tl.constexpr = 8
    BR: tl.constexpr = 8 * RT
    CK: tl.constexpr = 64 if BITS == 4 else 128  # K per chunk of the fragment layout
    CPG: tl.constexpr = GROUP // CK
    ODT: tl.constexpr = C.dtype.element_ty
    if SPLIT_M == 1:
        e, pid_k, start, end, _, g0, g1 = _program(Offsets, NG, BR, SPLIT_K)
    else:
        e, pid_k, start, end, _, g0, g1 = _program_rows(Offsets, NG, BR, SPLIT_K, BLOCK_M, SPLIT_M)
    Q = _expert_address(QPtrs, e, tl.int32)
    QH = _expert_address(QHPtrs, e, tl.int32)  # (4-bit: the codes again, unused)
    S = _expert_address(SPtrs, e, ODT)
    P = _expert_address(PPtrs, e, ODT)
    i = tl.arange(0, BR)
    rt = tl.program_id(1) * RT + i // 8
    rt_ok = rt < NRT
    it = _reg_a_row(i)  # the relabelled tile's row -> its words' row
    n0 = (tl.program_id(1) * RT + it // 8) * 16 + it % 8  # weight rows of half 0; half 1: + 8
    n1 = n0 + 8
    q_rows = Q + (rt.to(tl.int64) * (NC * 128) + (i % 8) * 16)[:, None] + tl.arange(0, 16)[None, :]
    h_rows = QH + (rt.to(tl.int64) * (NC * 64) + (i % 8) * 8)[:, None] + tl.arange(0, 8)[None, :]
    kx = _reg_a_k(tl.arange(0, CK), CK)  # the activation columns in the relabelled tile's K order
    if SMEM_TAB > 0:
        tabs = (0, 0, 0, 0, 0, 0, 0, 0)
        if not EMU and end > start:  # (uniform per program: the table's barrier is reached by all or none)
            _store_pair_table(P.to(tl.pointer_type(tl.int32)), BITS, TAB_OFF, BITS == 3)
    else:
        tabs = _byte_tables(P, BITS)
    for m0 in range(start, end, BLOCK_M * SPLIT_M):  # no iteration for an expert without rows
        rows, mask_m, arow, a_rows = _row_step(A, RowMap, m0, end, stride_am, BLOCK_M, GATHER)
        acc0 = tl.zeros([BR, BLOCK_M], dtype=tl.float32)
        acc1 = tl.zeros([BR, BLOCK_M], dtype=tl.float32)
        nw0, nw1, nw2, nw3 = 0, 0, 0, 0  # (pass-through values without PREFETCH)
        if PREFETCH:
            nw0, nw1, nw2, nw3 = _next_group_words(q_rows, h_rows, g0 - 1, g1, rt_ok, CPG, BITS)
        for gi in range(g0, g1):
            p0, p1, nw0, nw1, nw2, nw3 = _group_dots(
                q_rows, h_rows, a_rows, mask_m[:, None], kx, K, gi, g1, rt_ok, nw0, nw1, nw2, nw3, P, tabs, TAB_OFF,
                BR, BR, BLOCK_M, CPG, CK, BITS, EMU, ODT, False, True, PREFETCH, SMEM_TAB, True)
            s0 = tl.load(S + gi * stride_sg + n0, mask=n0 < N, other=0.0).to(tl.float32)
            s1 = tl.load(S + gi * stride_sg + n1, mask=n1 < N, other=0.0).to(tl.float32)
            acc0 += p0 * s0[:, None]
            acc1 += p1 * s1[:, None]
        _store_rows(tl.trans(acc0), rows, mask_m, n0, N, R, C, Ws, pid_k, stride_cm, SPLIT_K)
        _store_rows(tl.trans(acc1), rows, mask_m, n1, N, R, C, Ws, pid_k, stride_cm, SPLIT_K)


def address_table(ts: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``[E]`` table of the tensors' addresses on their device (``lowbit._utils.device_table``)."""
    ptrs = tuple(t.data_ptr() for t in ts)
    if any(p % 16 for p in ptrs):
        raise ValueError("grouped MoE GEMM: every expert's weight tensors must start 16-byte aligned (the "
                         "kernels load them in 16-byte pieces); got a view at an odd offset: pass contiguous "
                         "copies")
    return device_table(ptrs, torch.int64, ts[0].device)


def pick_split(E: int, rows: int, N: int, K: int, n_sm: int) -> int:
    """Split-K for ``rows`` routed rows over ``E`` experts: the dense decode rule (``w4a8_fp8_gemm._split_k``) over
    the programs of the experts that can be hit (at most ``min(E, rows)``), to ``SPLIT_TARGET`` per SM, keeping
    ``MIN_K_TILES`` K tiles per split."""
    live = min(E, max(rows, 1)) * cdiv(N, BLOCK_N)
    return _split_k(live, cdiv(K, 2 * HALF_K.value), SPLIT_TARGET * n_sm, MIN_K_TILES)


def pick_split_m(E: int, rows: int, bm: int, per_expert: int, n_sm: int) -> int:
    """Programs per (expert, weight tile) that share its row steps (prefill sizes, session 41): where each hit expert
    has at least ``SPLIT_M_MIN_STEPS`` row steps on average and the ``min(E, rows) * per_expert`` programs fall short
    of ``SPLIT_TARGET`` per SM, the power of two that reaches it (at most the mean steps). Rows are split instead of
    K there: no FP32 partials (split-K's workspace is ``split x rows x N`` floats, 1 GB on Mixtral-8x7B's down at 16k
    tokens) and the same arithmetic as one program (each row's sum is one program's)."""
    hit = min(E, max(rows, 1))
    steps = cdiv(cdiv(rows, hit), bm)
    if steps < SPLIT_M_MIN_STEPS:
        return 1
    want = cdiv(int(SPLIT_TARGET * n_sm), hit * per_expert)
    s = 1
    while s < want and 2 * s <= steps:
        s *= 2
    return s


def lut_pick_split(E: int, rows: int, nrt: int, ng: int, group_size: int, n_sm: int) -> int:
    """``pick_split`` for the ``lut`` kernel: programs of 8 row tiles, K split by whole scale groups (at least
    ``MIN_K_TILES`` x 128 K per split)."""
    live = min(E, max(rows, 1)) * cdiv(nrt, 8)
    return _split_k(live, ng, LUT_SPLIT_TARGET * n_sm, max(1, MIN_K_TILES * 2 * HALF_K.value // group_size))


def moe_gemm_triton(scheme: str, a: torch.Tensor, sx: torch.Tensor | None, row_map: torch.Tensor | None,
                    offsets: torch.Tensor, weights: list[list[torch.Tensor]], params: torch.Tensor | None, k: int,
                    group_size: int, out_dtype: torch.dtype, rows: int, max_rows_per_expert: int, *,
                    tiled: bool = False, split_k: int | None = None, partials: bool = False,
                    bits: int = 4, split_m: int | None = None) -> torch.Tensor:
    """Launcher (inputs checked by ``lowbit.ops.moe``). ``a`` ``[Ta, K]`` (FP8 for ``w4a8-fp8``, INT8 for
    ``w4a8-int8``, bf16 / fp16 for ``lut``), ``sx`` fp32 ``[Ta]`` (None for ``lut``), ``row_map`` int32 ``[rows]`` or
    None, ``offsets`` int32 ``[E + 1]``;
    ``weights``: per field a list over the experts -- ``w4a8-fp8``: ``[codes [N, Kp/2] uint8, scales [N, Gp] FP8]``
    with ``params`` = inv_delta fp32 ``[E]``; ``w4a8-int8``: ``[qweight [N, Kp/2] uint8 (``tiled``: row-tiled),
    s1 [N] fp32, s2 [N, G] uint8, zs [N, G] uint8]``, ``params`` None, ``group_size`` -1 for per-channel;
    ``lut`` (``bits`` 3 or 4): ``[qweight, qweight_hi (4-bit: qweight again), scales [G, N], pairs, ...]`` of
    ``LUTLinear``'s fragment layout (contiguous), scales and pairs in ``a``'s dtype, which ``out_dtype`` must be ->
    ``[rows, N]`` ``out_dtype`` (rows no expert owns left unwritten). ``max_rows_per_expert`` sizes the inner row
    step (a bound, not a promise: more rows loop). ``partials``: with split-K, return the FP32 partials
    ``[SPLIT_K, rows, N]`` unsummed (the combine kernel sums them in split order). ``split_m``: programs per (expert,
    weight tile) sharing its row steps (None: ``pick_split_m``, then split-K only where rows are not split; given
    ``split_k`` alone: 1)."""
    E = len(weights[0])
    if scheme == "lut" and out_dtype != a.dtype:
        raise ValueError(f"lut: the output dtype is the activations' ({a.dtype}), got {out_dtype}")
    if scheme == "lut":
        weights = weights[:4]  # (the kernel's fields; a caller's float32 tables after them are for the reference)
        N, ng = weights[2][0].shape[1], weights[2][0].shape[0]
        nrt, nc = weights[0][0].shape[0], weights[0][0].shape[1] // 128
        units = ng
    else:
        N = weights[0][0].shape[0]
        units = weights[0][0].shape[1] // HALF_K.value  # K tiles of 128 (kp / 128)
    out = torch.empty((rows, N), dtype=out_dtype, device=a.device)
    if rows == 0 or N == 0:
        return out
    if scheme == "lut":  # each row step decodes the weight tile again: one step for most experts (twice the mean
        # rows per hit expert; max_rows_per_expert is not used)
        bm = int(LUT_BLOCK_M or min(BLOCK_M_MAX, max(16, triton.next_power_of_2(cdiv(2 * rows, max(1, min(E, rows)))))))
    else:
        bm = min(BLOCK_M_MAX, max(16, triton.next_power_of_2(max(1, max_rows_per_expert))))
    n_sm = sm_count(a.device, 132)
    per_expert = cdiv(nrt, 8) if scheme == "lut" else cdiv(N, BLOCK_N)
    if split_m is None:
        split_m = pick_split_m(E, rows, bm, per_expert, n_sm) if split_k is None else 1
    split_m = max(1, int(split_m))
    if split_k is None:
        split_k = 1 if split_m > 1 else (lut_pick_split(E, rows, nrt, ng, group_size, n_sm) if scheme == "lut"
                                         else pick_split(E, rows, N, k, n_sm))
    split_k = max(1, min(int(split_k), units))
    ws = torch.empty((split_k, rows, N), dtype=torch.float32, device=a.device) if split_k > 1 else out
    tables = [address_table(f) for f in weights]
    rmap = row_map if row_map is not None else offsets
    common = dict(BLOCK_M=bm, SPLIT_K=split_k, GATHER=row_map is not None, num_warps=NUM_WARPS,
                  num_stages=NUM_STAGES)
    if split_m > 1:  # (passed only when set: the kernels' default is 1)
        common["SPLIT_M"] = split_m
    if scheme == "lut":
        args = (a, rmap, offsets, *tables, out, ws, N, k, rows, nrt, nc, ng, a.stride(0), weights[2][0].stride(0),
                out.stride(0))
        kw = dict(common, GROUP=group_size, BITS=bits, EMU=interpret_mode(), PREFETCH=LUT_PREFETCH,
                  num_stages=int(LUT_STAGES or (2 if bm == 16 else 3)))
        grid = (E, cdiv(nrt, 8), split_k * split_m)
        tab_off = 0
        if LUT_SMEM_TAB:  # passed only when set; the table's place: past Triton's own shared memory
            kw["SMEM_TAB"] = 1
            if not interpret_mode():
                tab_off = table_offset(_moe_lut_kernel, args, grid, kw)
        _moe_lut_kernel[grid](*args, tab_off, **kw)
    elif scheme == "w4a8-fp8":
        _moe_w4a8_fp8_kernel[(E, cdiv(N, BLOCK_N), split_k * split_m)](
            a, sx, rmap, offsets, *tables, params, out, ws, N, k, rows,
            a.stride(0), weights[0][0].stride(0), weights[1][0].stride(0), out.stride(0),
            GROUP=group_size, LUT=_use_lut({}), SWORD=True, BLOCK_N=BLOCK_N, **common)
    elif scheme == "w4a8-int8":
        _moe_w4a8_int8_kernel[(E, cdiv(N, BLOCK_N), split_k * split_m)](
            a, sx, rmap, offsets, *tables, out, ws, N, k, rows, 2 * weights[0][0].shape[1],
            a.stride(0), weights[0][0].stride(0), weights[2][0].stride(0), out.stride(0),
            GROUP_SIZE=group_size, TILED=tiled, USE_ASM=a.is_cuda and not interpret_mode(), BLOCK_N=BLOCK_N,
            **common)
    else:
        raise ValueError(f"scheme must be 'w4a8-fp8', 'w4a8-int8' or 'lut', got {scheme!r}")
    if split_k > 1 and partials:
        return ws
    if split_k > 1:
        out.copy_(ws.sum(0))  # a fixed order (deterministic); rows no expert owns stay unspecified
    return out
