"""W8 linear (INT8 weight-only, per-channel scale): ``lowbit::w8_linear`` and ``w8_linear``.

``w8_linear(x, codes, scale, bias)`` = ``x @ (scale * codes)^T + bias`` with the numerics of
``lowbit.formats.w8.gemm_ref`` (fp32 sums, the scale once per output, one cast): the Triton kernel
(``lowbit.kernels.w8_gemm``) on CUDA and under the interpreter, the reference on the CPU otherwise.
"""
from __future__ import annotations

import torch

from lowbit._utils import check_rows, check_same_device, check_tensor, run_op, use_triton
from lowbit.formats.w8 import gemm_ref

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("lowbit::w8_linear", mutates_args=())
def _w8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if use_triton(x, codes):
        from lowbit.kernels.w8_gemm import w8_gemm_triton

        return w8_gemm_triton(x, codes, scale, bias, x.dtype)
    return gemm_ref(x, codes, scale, bias, x.dtype)


@_w8_linear.register_fake
def _(x, codes, scale, bias):
    return x.new_empty((x.shape[0], codes.shape[0]))


def w8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] (fp16 / bf16 / fp32) -> [..., N] in x's dtype. ``codes`` [N, K] int8 (unit stride along K),
    ``scale`` [N] fp32, ``bias`` [N] or None (layouts: ``lowbit.formats.w8``)."""
    check_rows(x, empty_features=True)  # K = 0: the output is the bias (or 0)
    check_tensor(codes, "codes", dtype=torch.int8, ndim=2)
    N, K = codes.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features in its last dim but codes has K={K} columns")
    if codes.numel() and codes.stride(1) != 1:
        raise ValueError(f"codes must have unit stride along its last dim, got strides {list(codes.stride())}")
    check_tensor(scale, "scale", dtype=torch.float32, shape=[N])
    if bias is not None:
        check_tensor(bias, "bias", dtype=_DTYPES, shape=[N])
    check_same_device(x=x, codes=codes, scale=scale, bias=bias)
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return run_op(_w8_linear, x2, codes, scale, bias).reshape(*lead, N)
