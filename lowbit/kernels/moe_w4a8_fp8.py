"""Grouped INT4 x FP8 GEMM over the experts of a mixture-of-experts layer (format ``w4a8-fp8``), one launch for all
experts: ``y[r] = sx[a(r)] * inv_delta[e] * xq[a(r)] @ Weff_e^T`` for each row ``r`` routed to expert ``e``.

The per-expert arithmetic is ``lowbit.kernels.w4a8_fp8_gemm``'s (FireQ §3.1): the same packed codes and FP8 group
scales (``lowbit.formats.w4a8_fp8``), dequantized in registers by the same ``_dequant_tile`` (FP8 lookup table on the
GPU, its arithmetic twin under the interpreter), FP8 x FP8 ``tl.dot`` per K tile of 128 with the tile's product added
into an FP32 accumulator (``ACC_TILE``), the weight tile as the 64-row wgmma operand (``SWAP_AB``: the few routed rows
are the wgmma N). What is new is the routing:

- Rows are sorted by expert: expert ``e`` owns rows ``[offsets[e], offsets[e + 1])`` (int32 ``[E + 1]``, on the
  device: computing them needs no host read, so a decode step stays CUDA-graph capturable). ``row_map`` (int32
  ``[R]``, optional) names the row of ``xq`` / ``sx`` each sorted row reads (gate_up: the token); without it row
  ``r`` reads row ``r`` (down, whose input is already in sorted order).
- Weights stay one ``W4A8FP8Linear`` per expert (checkpoints unchanged): the kernel reads expert ``e``'s codes and
  scales through tables of their addresses (int64 ``[E]``, ``code_ptrs`` / ``scale_ptrs``, built once per set of
  weights by the launcher), all experts with the same shape and strides.
- Grid ``(E, N / BLOCK_N, SPLIT_K)``: a program whose expert got no rows ends at once, so only the routed
  experts' weights are read (the dense schedule of ``lowbit.nn.moe`` read all of them). Rows beyond ``BLOCK_M``
  per expert loop inside the program (the weight tile is re-read, from L2).
- ``SPLIT_K > 1`` (few experts hit, long K: down): each program writes its scaled FP32 partial to
  ``ws [SPLIT_K, R, N]``; the launcher sums the splits in order (deterministic) and casts.

Rows ``>= offsets[E]`` (ids of no expert) are not written. Accumulation FP32; per K tile of 128 the wgmma chain adds
4 k32 steps in Hopper's FP8 accumulator before the FP32 add (``max_num_imprecise_acc`` is moot: each tile's dot
starts from zero), as the dense kernel's decode configs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, device_table
from lowbit.formats.w4a8_fp8 import padded_k
from lowbit.kernels.w4a8_fp8_gemm import HALF_K, _dequant_tile, _use_lut

BLOCK_N = 128  # weight rows per program (two 64-row wgmma M tiles)
BLOCK_M_MAX = 64  # routed rows per inner step: a power of two from 16 up to this
SPLIT_TARGET = 2.0  # split K until the programs of the experts that can be hit reach this many per SM
MIN_K_TILES = 8  # ... keeping at least this many K tiles of 128 per split
NUM_WARPS, NUM_STAGES = 4, 4


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
    GATHER: tl.constexpr, LUT: tl.constexpr, SWORD: tl.constexpr,
):
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(Offsets + e)
    end = tl.load(Offsets + e + 1)
    # addresses read from memory carry no alignment facts: without these hints Triton would load the codes byte by
    # byte, and the 4-byte lookup (``pack=4`` inline asm) needs each thread to hold whole words (16-byte loads)
    Bq = tl.multiple_of(tl.load(CodePtrs + e).to(tl.pointer_type(tl.uint8)), 16)
    Bs = tl.multiple_of(tl.load(ScalePtrs + e).to(tl.pointer_type(tl.float8e4nv)), 16)
    inv_delta = tl.load(InvDelta + e)
    k_tiles = tl.cdiv(K, 2 * HALF_K)
    per = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per
    kt1 = tl.minimum(kt0 + per, k_tiles)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_K)
    offs_k = tl.arange(0, 2 * HALF_K)
    mask_n = offs_n < N
    b_rows = Bq + offs_n[:, None].to(tl.int64) * stride_bn
    w_rows = Bq.to(tl.pointer_type(tl.int32)) + offs_n[:, None].to(tl.int64) * (stride_bn // 4)
    s_rows = Bs + offs_n.to(tl.int64) * stride_sn
    s_words = Bs.to(tl.pointer_type(tl.int32)) + offs_n.to(tl.int64) * (stride_sn // 4)
    for m0 in range(start, end, BLOCK_M):  # no iteration for an expert without rows
        rows = m0 + tl.arange(0, BLOCK_M)
        mask_m = rows < end
        if GATHER:
            arow = tl.load(RowMap + rows, mask=mask_m, other=0)
        else:
            arow = rows
        a_rows = A + arow[:, None].to(tl.int64) * stride_am
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for kt in range(kt0, kt1):
            k_all = kt * 2 * HALF_K + offs_k
            a_all = tl.load(a_rows + k_all[None, :], mask=mask_m[:, None] & (k_all < K)[None, :], other=0.0)
            w_lo, w_hi = _dequant_tile(b_rows, w_rows, s_rows, s_words, kt, mask_n, offs_h, Bq, pid_n * BLOCK_N,
                                       Bq, k_tiles, GROUP, BLOCK_N, LUT, SWORD, False, False, LUT)
            w_all = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 2, 1)), [BLOCK_N, 2 * HALF_K])
            acc += tl.dot(w_all, tl.trans(a_all), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32))
        sx = tl.load(Sx + arow, mask=mask_m, other=0.0)
        y = tl.trans(acc) * (sx * inv_delta)[:, None]
        mask = mask_m[:, None] & mask_n[None, :]
        out = rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        if SPLIT_K == 1:
            tl.store(C + out, y.to(C.dtype.element_ty), mask=mask)
        else:
            tl.store(Ws + pid_k.to(tl.int64) * R * N + out, y, mask=mask)


def address_table(ts: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``[E]`` table of the tensors' addresses on their device (``lowbit._utils.device_table``)."""
    def addresses():
        ptrs = [t.data_ptr() for t in ts]
        if any(p % 16 for p in ptrs):
            raise ValueError("moe_w4a8_fp8: every expert's codes and scales must start 16-byte aligned (the kernel "
                             "loads them in 16-byte pieces); got a view at an odd offset: pass contiguous copies")
        return ptrs

    return device_table(addresses, torch.int64, ts, ("addresses", len(ts)))


def pick_split(E: int, rows: int, N: int, K: int, n_sm: int) -> int:
    """Split-K for ``rows`` routed rows over ``E`` experts: until the programs of the experts that can be hit
    (at most ``min(E, rows)``) reach ``SPLIT_TARGET`` per SM, keeping ``MIN_K_TILES`` K tiles per split."""
    k_tiles = cdiv(K, 2 * HALF_K.value)
    live = min(E, max(rows, 1)) * cdiv(N, BLOCK_N)
    split = 1
    while live * split < SPLIT_TARGET * n_sm and k_tiles // (split * 2) >= MIN_K_TILES:
        split *= 2
    return split


def moe_w4a8_fp8_gemm_triton(a: torch.Tensor, sx: torch.Tensor, row_map: torch.Tensor | None,
                             offsets: torch.Tensor, codes: list[torch.Tensor], scales: list[torch.Tensor],
                             inv_delta: torch.Tensor, k: int, group_size: int, out_dtype: torch.dtype,
                             rows: int, max_rows_per_expert: int, split_k: int | None = None,
                             partials: bool = False) -> torch.Tensor:
    """Launcher (inputs checked by ``lowbit.ops.moe``): ``a`` FP8 ``[Ta, K]``, ``sx`` fp32 ``[Ta]``, ``row_map``
    int32 ``[rows]`` or None, ``offsets`` int32 ``[E + 1]``, per expert ``codes[e]`` uint8 ``[N, Kp/2]`` and
    ``scales[e]`` FP8 ``[N, Gp]``, ``inv_delta`` fp32 ``[E]`` -> ``[rows, N]`` ``out_dtype`` (rows no expert owns
    are left unwritten). ``max_rows_per_expert`` sizes the inner row step (a bound, not a promise: more rows loop).
    ``partials``: with split-K, return the FP32 partials ``[SPLIT_K, rows, N]`` unsummed (the MoE combine kernel
    sums them in split order)."""
    E, N = len(codes), codes[0].shape[0]
    out = torch.empty((rows, N), dtype=out_dtype, device=a.device)
    if rows == 0 or N == 0:
        return out
    bm = min(BLOCK_M_MAX, max(16, triton.next_power_of_2(max(1, max_rows_per_expert))))
    if split_k is None:
        n_sm = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 132
        split_k = pick_split(E, rows, N, k, n_sm)
    split_k = max(1, min(int(split_k), cdiv(padded_k(k), 2 * HALF_K.value)))
    ws = torch.empty((split_k, rows, N), dtype=torch.float32, device=a.device) if split_k > 1 else out
    cp, sp = address_table(codes), address_table(scales)
    _moe_w4a8_fp8_kernel[(E, cdiv(N, BLOCK_N), split_k)](
        a, sx, row_map if row_map is not None else offsets, offsets, cp, sp, inv_delta, out, ws,
        N, k, rows,
        a.stride(0), codes[0].stride(0), scales[0].stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=bm, BLOCK_N=BLOCK_N, SPLIT_K=split_k, GATHER=row_map is not None,
        LUT=_use_lut({}), SWORD=True, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if split_k > 1 and partials:
        return ws
    if split_k > 1:
        out.copy_(ws.sum(0))  # a fixed order (deterministic); rows no expert owns stay unspecified
    return out
