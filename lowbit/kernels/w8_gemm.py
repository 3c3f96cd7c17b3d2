"""W8 GEMM: INT8 weight codes x activations as two INT8 planes, integer-exact sums (scheme ``"w8"``).

Math and layouts: ``lowbit.formats.w8`` (``x_planes`` and ``gemm_ref`` are the reference)::

    Y[m, n] = (acc_hi + acc_lo / 254) * (sx[m] * s[n]) (+ bias[n]),   acc_p[m, n] = sum_k plane_p[m, k] * codes[n, k]

Three kernels, one numerics (the int32 sums are exact, so the paths agree to the epilogue's rounding):

- ``_x_planes_kernel``: one program per row of x: amax over K, then the planes ``hi``, ``lo`` int8 [M, Kp] and
  ``sx`` fp32 [M] (``lowbit.formats.common.int8_planes``'s rule) (Kp = K rounded up to 4, zero-padded, so the planes read as int32 words).
- ``_w8_gemv_kernel`` (M <= ``GEMV_MAX_M`` = 1, K % 4 == 0): a program = ``BLOCK_N`` channels x one token row;
  the codes and the planes read as int32 words (4 bytes each), multiplied by ``dp4a.s32.s32`` (4 multiply-adds
  in one instruction, no code conversion), int32 partial sums per (row, word column) in registers, reduced once
  at the end: 4.29 TB/s at the lm_head shape (H200). The grid has a token axis, (M, N / BLOCK_N), but at M = 4
  the re-reads of the codes made it slower than the GEMM (session 21), hence M = 1 only. The interpreter emulates
  ``dp4a`` with shifts (same integers).
- ``_w8_gemm_kernel`` (any other shape): "swap AB" ``tl.dot`` on the INT8 tensor cores, the codes [BLOCK_N,
  BLOCK_K] as A, each plane's [BLOCK_K, BLOCK_M] tile as B, two int32 accumulators; masks on N, K and M.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode
from lowbit.formats.common import AMAX_EPS
from lowbit.formats.w8 import PLANE_LO, QMAX
from lowbit.kernels.act_quant import abs_or_inf, amax_floor

GEMV_MAX_M = 1  # token rows served by the dp4a GEMV (M = 2..4 on it re-read the codes: slower than the GEMM)
_EPS = tl.constexpr(AMAX_EPS)
_QMAX = tl.constexpr(QMAX)
_INV_LO = tl.constexpr(1.0 / PLANE_LO)
_PLANE_LO = tl.constexpr(PLANE_LO)


@triton.jit
def _x_planes_kernel(X, HI, LO, SX, K, KP, stride_xm, stride_pm, BLOCK: tl.constexpr):
    """Row ``m`` of x -> its two INT8 planes (columns >= K written as 0 up to KP) and ``sx = amax / 127``."""
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    xrow = X + m.to(tl.int64) * stride_xm
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(xrow + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, abs_or_inf(v))  # NaN -> inf: max would skip it
    # an Inf or NaN in the row gives a NaN scale, so the row's output is NaN, as the reference's (session 33: the
    # row came out finite, its NaN element silently replaced)
    a = amax_floor(tl.max(amax, axis=0), _EPS)
    tl.store(SX + m, tl.div_rn(a, tl.full([], _QMAX, tl.float32)))  # div_rn: rounded as the reference (``/`` is not)
    prow = m.to(tl.int64) * stride_pm
    for k0 in range(0, KP, BLOCK):
        v = tl.load(xrow + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        u = tl.div_rn(v, a) * _QMAX
        hi = tl.floor(u + 0.5)
        lo = tl.floor((u - hi) * _PLANE_LO + 0.5)
        tl.store(HI + prow + k0 + offs, hi.to(tl.int8), mask=k0 + offs < KP)
        tl.store(LO + prow + k0 + offs, lo.to(tl.int8), mask=k0 + offs < KP)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + the dot product of the 4 signed bytes of ``a`` and of ``b`` (int32 words)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        for j in tl.static_range(4):
            c += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return c


@triton.jit
def _epilogue(acc_hi, acc_lo, sx, S, BIAS, Y, offs_n, n_ok, y_ptr, y_mask, HAS_BIAS: tl.constexpr, AXIS: tl.constexpr):
    """fp32 ``(acc_hi + acc_lo / 254) * (sx * s) (+ bias)`` -> Y; ``AXIS``: the channels' axis of the tiles."""
    s = tl.load(S + offs_n, mask=n_ok, other=0.0)
    t = acc_hi.to(tl.float32) + acc_lo.to(tl.float32) * _INV_LO
    if AXIS == 0:
        y = t * (sx * s[:, None])
        if HAS_BIAS:
            y += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    else:
        y = t * (sx * s)
        if HAS_BIAS:
            y += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr, y.to(Y.dtype.element_ty), mask=y_mask)


@triton.jit
def _w8_gemv_kernel(HI, LO, SX, C, S, BIAS, Y, N, KW, stride_pw, stride_cw, stride_ym,
                    HAS_BIAS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                    STAGES: tl.constexpr):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    n_ok = offs_n < N
    c_ptr = C + offs_n[:, None].to(tl.int64) * stride_cw + offs_w[None, :]
    hi_ptr = HI + m.to(tl.int64) * stride_pw + offs_w
    lo_ptr = LO + m.to(tl.int64) * stride_pw + offs_w
    acc_hi = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    acc_lo = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for w0 in tl.range(0, KW, BLOCK_W, num_stages=STAGES):
        w_ok = w0 + offs_w < KW
        c = tl.load(c_ptr + w0, mask=n_ok[:, None] & w_ok[None, :], other=0)
        xh = tl.load(hi_ptr + w0, mask=w_ok, other=0)
        xl = tl.load(lo_ptr + w0, mask=w_ok, other=0)
        acc_hi = _dp4a(c, xh[None, :], acc_hi, ASM)
        acc_lo = _dp4a(c, xl[None, :], acc_lo, ASM)
    _epilogue(tl.sum(acc_hi, axis=1), tl.sum(acc_lo, axis=1), tl.load(SX + m), S, BIAS, Y, offs_n, n_ok,
              Y + m.to(tl.int64) * stride_ym + offs_n, n_ok, HAS_BIAS, 1)


@triton.jit
def _w8_gemm_kernel(HI, LO, SX, C, S, BIAS, Y, M, N, K, stride_pm, stride_cn, stride_ym,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    STAGES: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    c_ptr = C + offs_n[:, None].to(tl.int64) * stride_cn + offs_k[None, :]
    p_off = offs_m[None, :].to(tl.int64) * stride_pm + offs_k[:, None]  # plane^T tile [BLOCK_K, BLOCK_M]
    acc_hi = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    acc_lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = k0 + offs_k < K
        c = tl.load(c_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0)
        pm = k_ok[:, None] & m_ok[None, :]
        acc_hi = tl.dot(c, tl.load(HI + p_off + k0, mask=pm, other=0), acc_hi, out_dtype=tl.int32)
        acc_lo = tl.dot(c, tl.load(LO + p_off + k0, mask=pm, other=0), acc_lo, out_dtype=tl.int32)
    sx = tl.load(SX + offs_m, mask=m_ok, other=0.0)
    _epilogue(acc_hi, acc_lo, sx[None, :], S, BIAS, Y, offs_n, n_ok,
              Y + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None], n_ok[:, None] & m_ok[None, :],
              HAS_BIAS, 0)


def w8_config(M: int, N: int, K: int, gemv_ok: bool = True) -> dict:
    """Launch shape (session-21 sweep at the lm_head shape 128256 x 4096, H200, ``s21_w8_sweep.json``). GEMV (M = 1,
    K % 4 == 0): 32 channels x 128 words (512 K) per step, 3 stages (0.1225 ms, 4.29 TB/s; 64 channels 0.1229).
    GEMM: 16 tokens per program up to M = 16 (64 channels, 128 K, 3 stages, 4 warps: 0.131 ms at M = 16; the GEMV at
    M = 4 re-read the codes, 0.206 ms), else 64 (128 channels, 8 warps: 0.149 ms at M = 64); half the channels
    when the full tile leaves fewer than 2 waves of programs on 132 SMs."""
    if M <= GEMV_MAX_M and K % 4 == 0 and gemv_ok:  # gemv_ok: the code rows read as aligned int32 words
        return {"GEMV": True, "BLOCK_N": 32, "BLOCK_W": 128, "STAGES": 3, "num_warps": 4}
    bm, bn, nw = (16, 64, 4) if M <= 16 else (64, 128, 8)
    if cdiv(N, bn) * cdiv(M, bm) < 264:
        bn //= 2
    return {"GEMV": False, "BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": 128, "STAGES": 3, "num_warps": nw}


def x_planes_triton(x: torch.Tensor, kp: int):
    """``x`` [M, K] -> (hi, lo) int8 [M, kp] (zero past K) and sx fp32 [M] (``lowbit.formats.w8.x_planes``)."""
    M, K = x.shape
    hi = torch.empty(M, kp, device=x.device, dtype=torch.int8)
    lo = torch.empty_like(hi)
    sx = torch.empty(M, device=x.device, dtype=torch.float32)
    if M:
        _x_planes_kernel[(M,)](x, hi, lo, sx, K, kp, x.stride(0), hi.stride(0),
                               BLOCK=min(2048, triton.next_power_of_2(max(kp, 16))), num_warps=4)
    return hi, lo, sx


def w8_gemm_triton(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype, config: dict | None = None, return_kernel: bool = False):
    """``x`` [M, K] fp16 / bf16 / fp32 (unit stride along K), ``codes`` [N, K] int8, ``scale`` [N] fp32 -> [M, N]
    (arguments checked by ``lowbit.ops.w8``); ``return_kernel``: also the compiled GEMM kernel (probes read its
    SASS)."""
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return (y, None) if return_kernel else y
    gemv_ok = K % 4 == 0 and codes.stride(0) % 4 == 0 and codes.data_ptr() % 4 == 0
    cfg = dict(config or w8_config(M, N, K, gemv_ok))
    gemv = cfg.pop("GEMV")
    if gemv and not gemv_ok:
        raise ValueError("config GEMV=True needs K % 4 == 0 and code rows aligned to 4 bytes")
    hi, lo, sx = x_planes_triton(x, cdiv(K, 4) * 4)
    b = bias if bias is not None else scale
    if gemv:
        c32 = codes.view(torch.int32)
        grid = (M, cdiv(N, cfg["BLOCK_N"]))
        kernel = _w8_gemv_kernel[grid](hi.view(torch.int32), lo.view(torch.int32), sx, c32, scale, b, y, N,
                                       K // 4, hi.stride(0) // 4, codes.stride(0) // 4, y.stride(0),
                                       HAS_BIAS=bias is not None, ASM=not interpret_mode(), **cfg)
    else:
        grid = (cdiv(N, cfg["BLOCK_N"]), cdiv(M, cfg["BLOCK_M"]))
        kernel = _w8_gemm_kernel[grid](hi, lo, sx, codes, scale, b, y, M, N, K, hi.stride(0), codes.stride(0),
                                       y.stride(0), HAS_BIAS=bias is not None, **cfg)
    return (y, kernel) if return_kernel else y
