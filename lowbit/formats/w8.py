"""W8: INT8 weight-only linear format, one fp32 scale per output channel (scheme ``"w8"``).

For wide layers where a 4-bit code costs too much accuracy, first of all the output projection
(``lm_head``: 128256 x 4096 in Llama-3, 1.05 GB in bf16, ~16% of a batch-1 decode step once the
decoder layers are 4-bit). Not from one of the seed papers: the usual per-channel INT8 weight
(LLM.int8 without outliers, W8A16), chosen over FP8 E4M3 weights because INT8's uniform grid has
the smaller error on the bell-shaped rows of a weight (absmax / 127 steps against 3 mantissa bits).

Layout and numerics::

    codes  int8 [N, K]      symmetric, in [-127, 127], row n = output channel n (nn.Linear layout)
    scale  fp32 [N]         s = max(amax(W[n, :]), AMAX_EPS) / 127  (all-zero rows: codes 0, never 0/0)
    W ~= s[:, None] * codes                                  codes = clamp(rint(W / s), -127, 127)

Activations: each row of x [M, K] (bf16 / fp16 / fp32) as two INT8 planes (``lowbit.formats.common.int8_planes``, the
same rule as the kv4 decode's two-plane Q)::

    a = max(amax(x[m, :]), AMAX_EPS),  u = x / a * 127,  hi = floor(u + 0.5),  lo = floor((u - hi) * 254 + 0.5)
    x ~= sx * (hi + lo / 254),  sx = a / 127                error <= a / 64516 per element (~15 bits of the row)

    Y[m, n] = (acc_hi + acc_lo * (1/254)) * (sx[m] * s[n])  (+ bias[n]),  acc_* = sum_k plane[m, k] * codes[n, k]

The sums are exact int32 (|acc| <= 127^2 K: K < 133,000), so every kernel path (the dp4a GEMV at M = 1, the
INT8 tensor-core GEMM above) and this reference give the same sums; only the fp32 epilogue may differ by an ulp
(fused multiply-add). Decision: the planes instead of multiplying bf16 x by codes converted to bf16 because the
conversion costs ~11 instructions per 4 codes (the M = 1 GEMV then ran at 2.8 TB/s, session 21), while dp4a
multiplies 4 codes in one, with no conversion; the plane error is below bf16's own rounding of x for every
element above amax / 256, and far below the weight's (~0.4% per weight).

This module is the one reference (``gemm_ref``): the Triton kernel (``lowbit.kernels.w8_gemm``),
the op and the tests import it.
"""
from __future__ import annotations

import torch

from lowbit.formats.common import div_ieee, int8_planes, safe_scale

__all__ = ["QMAX", "PLANE_LO", "quantize_w8", "dequantize_w8", "x_planes", "gemm_ref"]

QMAX = 127.0
PLANE_LO = 254.0  # the low plane's weight: x ~= sx * (hi + lo / PLANE_LO)


def quantize_w8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] float -> (codes int8 [N, K], scale fp32 [N]); rounding half to even."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float tensor [out_features, in_features], got {w.dtype} {list(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("w holds NaN or Inf; a W8 scale would be non-finite")
    w = w.float()
    s = safe_scale(w.abs().amax(dim=1), QMAX)
    codes = torch.round(w / s[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, s


def dequantize_w8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [N, K] int8, scale [N] fp32 -> W [N, K] (multiplied in fp32, cast to ``dtype``)."""
    return (codes.float() * scale.float()[:, None]).to(dtype)


def x_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (hi int8 [M, K], lo int8 [M, K], sx fp32 [M]) as in the module docstring."""
    hi, lo, a = int8_planes(x)
    return hi, lo, div_ieee(a, QMAX)


def gemm_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``x`` [M, K] -> [M, N] in ``out_dtype``: the exact integer sums of both planes, the fp32 epilogue."""
    hi, lo, sx = x_planes(x)
    c = codes.double().t()
    acc_hi = (hi.double() @ c).float()  # exact integers (< 2^53), then rounded to fp32 as the kernel's int32 -> fp32
    acc_lo = (lo.double() @ c).float()
    y = (acc_hi + acc_lo * (1.0 / PLANE_LO)) * (sx[:, None] * scale.float()[None, :])
    if bias is not None:
        y = y + bias.float()[None, :]
    return y.to(out_dtype)
