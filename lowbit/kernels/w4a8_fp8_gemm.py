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
  loop over more programs, writing fp32 partials to a workspace that ``_splitk_reduce_kernel`` sums
  and finishes with the same epilogue.

Shapes: any M >= 1, any N >= 1 (masked), any K >= 1 (masked; codes are stored padded to 128).
Alignment: none required for correctness; 16-byte-aligned rows (K % 16 == 0, which all Llama
shapes satisfy) let Triton use 16-byte loads. Tile BLOCK_K is fixed at 128 (= the pack block).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, check_tensor, interpret_mode
from lowbit.formats.common import FP8_E4M3
from lowbit.formats.w4a8_fp8 import PACK_BLOCK, padded_k, scale_cols
from lowbit.kernels.act_quant import round_to_fp8_e4m3

BLOCK_K = PACK_BLOCK
HALF_K = tl.constexpr(PACK_BLOCK // 2)


# ------------------------------------------------------------------------------------ configs
def _split_k(tiles: int, k_tiles: int, target: int) -> int:
    """Smallest power-of-two split with tiles * split >= target, keeping >= 4 K tiles per split."""
    split = 1
    while tiles * split < target and split * 2 <= max(1, k_tiles // 4):
        split *= 2
    return split


def pick_config(M: int, N: int, K: int, n_sm: int = 132) -> dict:
    """Tile config by shape (the sweep behind it: benchmarks/device/w4a8_fp8.py, H200).

    - M <= 64 (decode): SWAP_AB (the weight tile is the 64-row wgmma A operand, x^T the N=16..64
      operand), BLOCK_N = 64 weight rows, split-K until >= 2 programs per SM: memory-bound, the
      goal is many 4 KB tiles in flight.
    - 64 < M <= 256: BLOCK_M = 64/128 x BLOCK_N = 128, split-K until one wave.
    - larger M: 128 x 128 tiles, 8 warps, ``ACC_TILE`` (fast FP8 accumulation inside each K = 128
      tile, promoted to FP32 once per tile: 4% faster than Triton's promotion every K = 64).
    Accumulation is precise everywhere (FP32 promotion every K = 64 or 128); ``FAST_ACC=True`` (no
    promotion) is an option for experiments: 1.6x faster at M = 1024 but it lost 22% (rel-L2) on an
    all-positive K = 14336 product on the H200.
    """
    k_tiles = cdiv(K, BLOCK_K)
    if M <= 64:
        bm = 16 if M <= 16 else (32 if M <= 32 else 64)
        bn = 64
        split = _split_k(cdiv(N, bn) * cdiv(M, bm), k_tiles, 2 * n_sm)
        return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, SWAP_AB=True, num_warps=4, num_stages=4, GROUP_M=1)
    if M <= 256:
        bm = 64 if M <= 128 else 128
        split = _split_k(cdiv(N, 128) * cdiv(M, bm), k_tiles, n_sm)
        return dict(BLOCK_M=bm, BLOCK_N=128, SPLIT_K=split, SWAP_AB=False, num_warps=4, num_stages=4, GROUP_M=8)
    return dict(BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, SWAP_AB=False, num_warps=8, num_stages=3, GROUP_M=8,
                ACC_TILE=True)


# ------------------------------------------------------------------------------------ kernel
@triton.jit
def _fp8_lut(sig):
    """sigma (fp16, any shape) -> the 8-byte LUT FP8(k * sigma), k = 0..7, as two int32 words
    (bytes 0..3 = k 0..3, bytes 4..7 = k 4..7). k*sigma is exact in fp16 (<= 7 significant bits,
    <= 3136); ``cvt.rn.satfinite`` rounds to nearest even and clamps to 448 like the reference."""
    return tl.inline_asm_elementwise(
        asm="""{
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
        }""",
        constraints="=r,=r,h",
        args=[sig],
        dtype=(tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


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
def _epilogue(acc, offs_m, offs_n, pid_n, M, N, N_OUT, inv_delta,
              A_scale, Bias, Res, C, stride_rm, stride_cm,
              BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 of weight rows offs_n -> scaled, activated, stored output."""
    mask_m = offs_m < M
    sx = tl.load(A_scale + offs_m, mask=mask_m, other=0.0)
    y = acc * (sx * inv_delta)[:, None]
    if HAS_BIAS:
        b = tl.load(Bias + offs_n, mask=offs_n < N, other=0.0)
        y += b.to(tl.float32)[None, :]
    if SILU_MUL:
        gate, up = tl.split(tl.reshape(y, [y.shape[0], BLOCK_N // 2, 2]))
        gate = gate.to(C.dtype.element_ty).to(tl.float32)
        up = up.to(C.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(C.dtype.element_ty).to(tl.float32)
        y = act * up
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        cols = offs_n
    mask = mask_m[:, None] & (cols < N_OUT)[None, :]
    if HAS_RES:
        r = tl.load(Res + offs_m[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=mask, other=0.0)
        y = y.to(C.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + cols[None, :], y.to(C.dtype.element_ty), mask=mask)


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
def _w4a8_fp8_gemm_kernel(
    # pointers
    A, A_scale, Bq, B_scale, Bias, Res, C, Ws,
    # sizes / scalars
    M, N, K, N_OUT, inv_delta,
    # strides (last dims contiguous)
    stride_am, stride_bn, stride_sn, stride_rm, stride_cm,
    # constexpr flags
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SILU_MUL: tl.constexpr, LUT: tl.constexpr, IMPRECISE: tl.constexpr, ACC_TILE: tl.constexpr,
):
    # ---- tile indices (grouped ordering along M for L2 reuse of the weight tiles)
    pid = tl.program_id(0)
    pid_k = tl.program_id(2)
    num_m = tl.cdiv(M, BLOCK_M)
    if GROUP_M > 1:
        pid_n_all = tl.program_id(1)
        lin = pid_n_all * num_m + pid
        num_n = tl.num_programs(1)
        width = GROUP_M * num_n
        gid = lin // width
        first_m = gid * GROUP_M
        gsz = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (lin % width) % gsz
        pid_n = (lin % width) // gsz
    else:
        pid_m = pid
        pid_n = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = A + offs_m[:, None].to(tl.int64) * stride_am
    b_rows = Bq + offs_n[:, None].to(tl.int64) * stride_bn
    w_rows = Bq.to(tl.pointer_type(tl.int32)) + offs_n[:, None].to(tl.int64) * (stride_bn // 4)
    s_rows = B_scale + offs_n.to(tl.int64) * stride_sn

    k_tiles = tl.cdiv(K, 2 * HALF_K)
    per = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per
    kt1 = tl.minimum(kt0 + per, k_tiles)

    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(kt0, kt1):
        s_lo0, s_hi0 = _load_scales(s_rows, kt, mask_n, offs_h, GROUP)
        k0 = kt * 2 * HALF_K
        # activations: two 64-wide halves of the K tile (masked beyond K and M)
        k_lo = k0 + offs_h
        k_hi = k0 + HALF_K + offs_h
        a_lo = tl.load(a_rows + k_lo[None, :], mask=mask_m[:, None] & (k_lo < K)[None, :], other=0.0)
        a_hi = tl.load(a_rows + k_hi[None, :], mask=mask_m[:, None] & (k_hi < K)[None, :], other=0.0)
        # packed weights: 64 bytes per row (codes are padded to the 128-block: no K mask)
        if not LUT:
            wrd = tl.load(w_rows + (kt * 16 + tl.arange(0, 16))[None, :], mask=mask_n[:, None], other=0)
            w_lo = _dequant_emulated(wrd, s_lo0, False, BLOCK_N)
            w_hi = _dequant_emulated(wrd, s_hi0, True, BLOCK_N)
        else:
            p = tl.load(b_rows + (kt * HALF_K + offs_h)[None, :], mask=mask_n[:, None], other=0)
            l0, l1 = _fp8_lut(s_lo0)
            w_lo = _fp8_lookup(p, tl.broadcast_to(l0, p.shape), tl.broadcast_to(l1, p.shape), False)
            if GROUP > HALF_K:  # same group for both halves: reuse the LUT
                w_hi = _fp8_lookup(p, tl.broadcast_to(l0, p.shape), tl.broadcast_to(l1, p.shape), True)
            else:
                h0, h1 = _fp8_lut(s_hi0)
                w_hi = _fp8_lookup(p, tl.broadcast_to(h0, p.shape), tl.broadcast_to(h1, p.shape), True)
        if ACC_TILE:  # fast FP8 accumulation within the K tile, promoted to FP32 once per tile
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
    if SWAP_AB:
        acc = tl.trans(acc)

    if SPLIT_K > 1:
        ws = Ws + pid_k.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask_m[:, None] & mask_n[None, :])
    else:
        _epilogue(acc, offs_m, offs_n, pid_n, M, N, N_OUT, inv_delta, A_scale, Bias, Res, C, stride_rm, stride_cm,
                  BLOCK_N, HAS_BIAS, HAS_RES, SILU_MUL)


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
    _epilogue(acc, offs_m, offs_n, tl.program_id(1), M, N, N_OUT, inv_delta, A_scale, Bias, Res, C,
              stride_rm, stride_cm, BLOCK_N, HAS_BIAS, HAS_RES, SILU_MUL)


# ------------------------------------------------------------------------------------ launcher
def w4a8_fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  inv_delta: float, k: int, group_size: int, *, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, silu_mul: bool = False,
                  out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None,
                  return_compiled: bool = False):
    """``xq [M, K]`` fp8, ``sx [M]`` fp32, ``codes [N, Kp/2]`` uint8, ``scales [N, G]`` fp8 ->
    ``[M, N]`` (``[M, N/2]`` with ``silu_mul``) in ``out_dtype``. See the module docstring.
    ``config`` overrides ``pick_config``; ``return_compiled`` also returns the compiled GEMM kernel
    (for PTX inspection)."""
    check_tensor(xq, "xq", dtype=FP8_E4M3, ndim=2)
    M, K = xq.shape
    if K != k:
        raise ValueError(f"xq has K={K} columns but the weight has in_features={k}")
    check_tensor(sx, "sx", dtype=torch.float32, shape=(M,))
    check_tensor(codes, "codes", dtype=torch.uint8, ndim=2)
    N = codes.shape[0]
    if codes.shape[1] != padded_k(k) // 2:
        raise ValueError(f"codes must have shape [N, {padded_k(k) // 2}] for in_features={k}, got {list(codes.shape)}")
    check_tensor(scales, "scales", dtype=FP8_E4M3, shape=(N, scale_cols(k, group_size)))
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    if silu_mul and N % 2:
        raise ValueError(f"silu_mul needs an even number of (interleaved gate/up) rows, got N={N}")
    n_out = N // 2 if silu_mul else N
    if bias is not None:
        check_tensor(bias, "bias", shape=(N,))
    if residual is not None:
        check_tensor(residual, "residual", dtype=out_dtype, shape=(M, n_out))
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    codes, scales = codes.contiguous(), scales.contiguous()
    out = torch.empty((M, n_out), dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return (out, None) if return_compiled else out
    cfg = dict(pick_config(M, N, K) if config is None else config)
    bm, bn, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT_K"]
    split = max(1, min(split, cdiv(K, BLOCK_K)))
    ws = torch.empty((split, M, N), dtype=torch.float32, device=xq.device) if split > 1 else out
    dummy = sx
    grid = (cdiv(M, bm), cdiv(N, bn), split)
    compiled = _w4a8_fp8_gemm_kernel[grid](
        xq, sx, codes, scales, bias if bias is not None else dummy, residual if residual is not None else dummy,
        out, ws,
        M, N, K, n_out, float(inv_delta),
        xq.stride(0), codes.stride(0), scales.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, SWAP_AB=cfg["SWAP_AB"],
        GROUP_M=cfg.get("GROUP_M", 1), HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        SILU_MUL=silu_mul, LUT=cfg.get("LUT", os.environ.get("LOWBIT_W4A8_LUT", "1") != "0") and not interpret_mode(),
        IMPRECISE=None if cfg.get("FAST_ACC", False) else HALF_K.value, ACC_TILE=cfg.get("ACC_TILE", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split > 1:
        rbm, rbn = 16, 128
        _splitk_reduce_kernel[(cdiv(M, rbm), cdiv(N, rbn))](
            ws, sx, bias if bias is not None else dummy, residual if residual is not None else dummy, out,
            M, N, n_out, float(inv_delta),
            residual.stride(0) if residual is not None else 0, out.stride(0),
            SPLIT_K=split, BLOCK_M=rbm, BLOCK_N=rbn,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, SILU_MUL=silu_mul, num_warps=4,
        )
    return (out, compiled) if return_compiled else out
