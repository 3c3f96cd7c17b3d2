"""W4A8 INT8 linear (QServe QoQ): ``lowbit::w4a8_int8_gemm`` and ``w4a8_int8_linear``.

``w4a8_int8_linear(x, ...)`` = per-token INT8 quantization of ``x`` (``lowbit.ops.quant``, its
Triton kernel when present) followed by the W4A8 GEMM (``lowbit.kernels.w4a8_int8_gemm``; the
plain-PyTorch reference ``lowbit.formats.w4a8_int8.gemm_ref`` on CPU without the interpreter).
Weight fields and their layouts: ``lowbit.formats.w4a8_int8`` (the group size is implied by
the shapes: ``Kp / G`` columns per group, ``Kp = 2 * qweight.shape[1]``).
"""
from __future__ import annotations

import math

import torch

from lowbit._utils import check_same_device, check_tensor, use_triton
from lowbit.formats.w4a8_int8 import gemm_ref

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_weight(K, qweight, wscale, gscale, gzs, bias, out_dtype, xname="xq"):
    check_tensor(qweight, "qweight", dtype=torch.uint8, ndim=2)
    N, kp2 = qweight.shape
    Kp = 2 * kp2
    check_tensor(wscale, "wscale", dtype=torch.float32, shape=[N])
    check_tensor(gscale, "gscale", dtype=torch.uint8, ndim=2)
    G = gscale.shape[1]
    check_tensor(gscale, "gscale", dtype=torch.uint8, shape=[N, G])
    check_tensor(gzs, "gzs", dtype=torch.uint8, shape=[N, G])
    if G < 1 or Kp % G:
        raise ValueError(f"gscale has {G} groups, which must divide the padded in_features {Kp}")
    g = Kp // G
    if Kp % 128 or not (K <= Kp < K + math.lcm(g, 128)):
        raise ValueError(f"{xname} has K={K} columns but qweight holds {Kp} (padded to lcm(group {g}, 128)); "
                         f"they must match up to that padding")
    if bias is not None:
        check_tensor(bias, "bias", dtype=_OUT_DTYPES, shape=[N])
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    return g


def _check(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype):
    check_tensor(xq, "xq", dtype=torch.int8, ndim=2)
    M, K = xq.shape
    check_tensor(xscale, "xscale", dtype=torch.float32, shape=[M])
    g = _check_weight(K, qweight, wscale, gscale, gzs, bias, out_dtype)
    check_same_device(xq=xq, xscale=xscale, qweight=qweight, wscale=wscale, gscale=gscale, gzs=gzs, bias=bias)
    return g


@torch.library.custom_op("lowbit::w4a8_int8_gemm", mutates_args=())
def _w4a8_int8_gemm(xq: torch.Tensor, xscale: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                    gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    Kp = 2 * qweight.shape[1]
    g = Kp // gscale.shape[1]
    if use_triton(xq, qweight):
        from lowbit.kernels.w4a8_int8_gemm import w4a8_int8_gemm_triton

        return w4a8_int8_gemm_triton(xq, xscale, qweight, wscale, gscale, gzs, bias, xq.shape[1], g, out_dtype)
    return gemm_ref(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype)


@_w4a8_int8_gemm.register_fake
def _(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype):
    return xq.new_empty((xq.shape[0], qweight.shape[0]), dtype=out_dtype)


def w4a8_int8_gemm(xq: torch.Tensor, xscale: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                   gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None = None, *,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``y = (xq @ w8^T) * xscale[:, None] * wscale[None, :] + bias`` -> ``out_dtype`` [M, N].

    xq int8 [M, K] (per-token codes), xscale fp32 [M]; qweight uint8 [N, Kp/2], wscale fp32 [N],
    gscale/gzs uint8 [N, G] (see ``lowbit.formats.w4a8_int8``); bias [N] or None.
    INT8 x INT8 products accumulate in INT32; scales apply in fp32 in the epilogue.
    """
    _check(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype)
    return _w4a8_int8_gemm(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype)


def w4a8_int8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, gscale: torch.Tensor,
                     gzs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] (fp16/bf16/fp32) -> [..., N] in x's dtype: per-token INT8 quantization of x
    (``lowbit.ops.quant.per_token_quant``, its cost included) then ``w4a8_int8_gemm``.
    (Quantizing inside the GEMM for small M was measured 2-4x slower on the H200: every program
    re-reads the rows for their absmax; see docs/sections/w4a8_int8.md.)"""
    from lowbit.ops.quant import per_token_quant

    check_tensor(x, "x", dtype=_OUT_DTYPES)
    if x.ndim < 1:
        raise ValueError("x must have at least 1 dim")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = per_token_quant(x2, "int8")
    y = w4a8_int8_gemm(xq, xs, qweight, wscale, gscale, gzs, bias, out_dtype=x.dtype)
    return y.reshape(*lead, qweight.shape[0])
