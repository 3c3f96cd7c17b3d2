"""W4A8-FP linear (FireQ §3.1): ops ``lowbit::w4a8_fp8_gemm`` (pre-quantized x) and
``lowbit::w4a8_fp8_linear_fused`` (float x, quantized inside the GEMM), and ``w4a8_fp8_linear``.

``w4a8_fp8_linear(x, ...)`` dispatches by M = rows of x:

- ``M <= FUSED_QUANT_MAX_M`` (``lowbit.kernels.w4a8_fp8_gemm``; decode): one launch, the per-token
  FP8 quantization of x runs inside the GEMM kernel (same codes and scales as the separate kernel);
- else where ``use_pdl_linear`` (M = 1; M <= 16 without split-K): op ``lowbit::w4a8_fp8_linear_pdl``, the quantization kernel and the
  GEMM launched with programmatic dependent launch (same numerics, the GEMM's launch overlapped);
- larger M: per-token FP8 quantization of ``x`` (``lowbit.ops.quant``; its Triton kernel on GPU)
  followed by ``lowbit::w4a8_fp8_gemm`` (whose launcher picks the fused-dequant kernel or, from
  ``DEQUANT_MIN_M``, dequantize-once + FP8 GEMM).

Without the GPU or the interpreter both ops run the float64 reference
(``lowbit.formats.w4a8_fp8.reference_gemm`` / ``reference_linear``) with the same numerics.
Weight fields and layouts: ``lowbit.formats.w4a8_fp8``. ``inv_delta`` is PTS's 2^-n.
"""
from __future__ import annotations

import torch

from lowbit._utils import check_choice, check_rows, check_same_device, check_tensor, run_op, use_triton
from lowbit.formats.common import FP8_E4M3
from lowbit.formats.w4a8_fp8 import GROUP_SIZES, padded_k, reference_gemm, reference_linear, scale_cols

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fused_quant_max_m() -> int:
    from lowbit.kernels import w4a8_fp8_gemm as kmod

    return kmod.FUSED_QUANT_MAX_M


def _use_pdl(M: int, N: int, K: int) -> bool:
    from lowbit.kernels import w4a8_fp8_gemm as kmod

    return kmod.use_pdl_linear(M, N, K)


def _check(xq, sx, codes, scales, k, group_size, bias, residual, silu_mul, out_dtype):
    check_tensor(xq, "xq", dtype=FP8_E4M3, ndim=2)
    M, K = xq.shape
    if K != k:
        raise ValueError(f"xq has {K} columns but the weight has in_features={k}")
    check_tensor(sx, "sx", dtype=torch.float32, shape=[M])
    _check_weight(M, codes, scales, k, group_size, bias, residual, silu_mul, out_dtype)
    check_same_device(xq=xq, sx=sx, codes=codes, scales=scales, bias=bias, residual=residual)


def _check_weight(M, codes, scales, k, group_size, bias, residual, silu_mul, out_dtype):
    check_choice(group_size, "group_size", GROUP_SIZES)
    check_tensor(codes, "codes", dtype=torch.uint8, ndim=2)
    N = codes.shape[0]
    check_tensor(codes, "codes", shape=[N, padded_k(k) // 2])
    check_tensor(scales, "scales", dtype=FP8_E4M3, shape=[N, scale_cols(k, group_size)])
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if silu_mul and N % 2:
        raise ValueError(f"silu_mul needs an even number of interleaved gate/up rows, got N={N}")
    if bias is not None:
        check_tensor(bias, "bias", dtype=_OUT_DTYPES, shape=[N])
    if residual is not None:
        check_tensor(residual, "residual", dtype=out_dtype, shape=[M, N // 2 if silu_mul else N])


@torch.library.custom_op("lowbit::w4a8_fp8_gemm", mutates_args=())
def _w4a8_fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   inv_delta: float, k: int, group_size: int, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, silu_mul: bool, out_dtype: torch.dtype,
                   pdl: bool = False) -> torch.Tensor:
    if use_triton(xq, codes):
        from lowbit.kernels.act_quant import pdl_enabled
        from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm as kernel

        return kernel(xq, sx, codes, scales, inv_delta, k, group_size, bias=bias, residual=residual,
                      silu_mul=silu_mul, out_dtype=out_dtype, pdl=pdl_enabled(xq, pdl), _checked=True)
    return reference_gemm(xq, sx, codes, scales, inv_delta, k, group_size, bias, residual=residual,
                          silu_mul=silu_mul, out_dtype=out_dtype)


@_w4a8_fp8_gemm.register_fake
def _(xq, sx, codes, scales, inv_delta, k, group_size, bias, residual, silu_mul, out_dtype, pdl=False):
    n = codes.shape[0] // 2 if silu_mul else codes.shape[0]
    return xq.new_empty((xq.shape[0], n), dtype=out_dtype)


def w4a8_fp8_gemm(xq: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  inv_delta: float, k: int, group_size: int = 128, bias: torch.Tensor | None = None, *,
                  residual: torch.Tensor | None = None, silu_mul: bool = False,
                  out_dtype: torch.dtype = torch.bfloat16, pdl: bool = False) -> torch.Tensor:
    """``y = sx[:, None] * inv_delta * (xq @ Weff^T) + bias`` -> ``out_dtype`` ``[M, N]``.

    xq fp8 ``[M, K]``, sx fp32 ``[M]``; codes uint8 ``[N, Kp/2]``, scales fp8 ``[N, Gp]`` (``formats.w4a8_fp8.scale_cols``);
    ``silu_mul``: rows interleaved gate/up, output ``silu(gate) * up`` ``[M, N/2]``; ``residual``
    added last. FP8 x FP8 products accumulate in FP32. ``pdl`` (Hopper, not the interpreter): a
    programmatic dependent launch that also lets the next PDL launch start early (the runner's batch-1
    chain after its PDL act-quant launch; same result).
    """
    _check(xq, sx, codes, scales, k, group_size, bias, residual, silu_mul, out_dtype)
    return run_op(_w4a8_fp8_gemm, xq, sx, codes, scales, float(inv_delta), int(k), int(group_size), bias, residual,
                  bool(silu_mul), out_dtype, bool(pdl))


@torch.library.custom_op("lowbit::w4a8_fp8_linear_fused", mutates_args=())
def _w4a8_fp8_linear_fused(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, inv_delta: float, k: int,
                           group_size: int, bias: torch.Tensor | None, residual: torch.Tensor | None,
                           silu_mul: bool) -> torch.Tensor:
    if use_triton(x, codes):
        from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_linear_fused as kernel

        return kernel(x, codes, scales, inv_delta, k, group_size, bias=bias, residual=residual, silu_mul=silu_mul)
    return reference_linear(x, codes, scales, inv_delta, k, group_size, bias, residual=residual, silu_mul=silu_mul)


def _linear_fake(x, codes, scales, inv_delta, k, group_size, bias, residual, silu_mul):
    """Fake of the x-in ops (fused and PDL): ``[M, N]`` (``N / 2`` with the SiLU*mul epilogue), x's dtype."""
    n = codes.shape[0] // 2 if silu_mul else codes.shape[0]
    return x.new_empty((x.shape[0], n))


_w4a8_fp8_linear_fused.register_fake(_linear_fake)


@torch.library.custom_op("lowbit::w4a8_fp8_linear_pdl", mutates_args=())
def _w4a8_fp8_linear_pdl(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, inv_delta: float, k: int,
                         group_size: int, bias: torch.Tensor | None, residual: torch.Tensor | None,
                         silu_mul: bool) -> torch.Tensor:
    """Per-token FP8 quantization of x then the GEMM, both launched with programmatic dependent
    launch (the GEMM's launch overlaps the quantization; each waits for its producer before any
    load): the same codes, scales and output as the two separate ops."""
    if use_triton(x, codes):
        from lowbit.kernels.act_quant import per_token_quant_triton
        from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm as kernel

        xq, sx = per_token_quant_triton(x, FP8_E4M3, pdl=True)
        return kernel(xq, sx, codes, scales, inv_delta, k, group_size, bias=bias, residual=residual,
                      silu_mul=silu_mul, out_dtype=x.dtype, pdl=True, pdl_trigger=False, _checked=True)
    return reference_linear(x, codes, scales, inv_delta, k, group_size, bias, residual=residual, silu_mul=silu_mul)


_w4a8_fp8_linear_pdl.register_fake(_linear_fake)


def w4a8_fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, inv_delta: float, k: int,
                    group_size: int = 128, bias: torch.Tensor | None = None, *,
                    residual: torch.Tensor | None = None, silu_mul: bool = False,
                    weight_checked: bool = False) -> torch.Tensor:
    """``x [..., K]`` (fp16/bf16/fp32) -> ``[..., N]`` in x's dtype: per-token FP8 quantization of x
    (its cost included) then ``w4a8_fp8_gemm``. ``weight_checked``: the caller vouches that codes, scales and bias
    fit each other and ``k`` (``W4A8FP8Linear``, whose buffers are built consistent): their checks are skipped on
    the decode path (host time, session 38), x's still run."""
    from lowbit.ops.quant import per_token_quant

    check_rows(x)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight has in_features={k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    res = None
    if residual is not None:  # [*lead, N]: reshaped with its own width (-1 is ambiguous at M = 0)
        check_tensor(residual, "residual", shape=[*lead, None])
        res = residual.reshape(x2.shape[0], residual.shape[-1])
    if x2.shape[0] > 0 and (x2.shape[0] <= _fused_quant_max_m() or _use_pdl(x2.shape[0], codes.shape[0], k)):
        # decode: the quantization of x runs inside the GEMM (one launch), or both launches PDL
        if weight_checked and res is None and codes.dtype == torch.uint8 and scales.dtype == FP8_E4M3 and (
                bias is None or bias.dtype in _OUT_DTYPES):  # (a module cast by .to(dtype) fails here: full checks)
            if x2.device != codes.device:
                check_same_device(x=x2, codes=codes)
        else:
            _check_weight(x2.shape[0], codes, scales, k, group_size, bias, res, silu_mul, x.dtype)
            check_same_device(x=x2, codes=codes, scales=scales, bias=bias, residual=res)
        op = _w4a8_fp8_linear_fused if x2.shape[0] <= _fused_quant_max_m() else _w4a8_fp8_linear_pdl
        y = run_op(op, x2.contiguous(), codes, scales, float(inv_delta), int(k), int(group_size), bias, res,
                   bool(silu_mul))
        return y.reshape(*lead, y.shape[-1])
    xq, sx = per_token_quant(x2, "fp8")
    y = w4a8_fp8_gemm(xq, sx, codes, scales, inv_delta, k, group_size, bias, residual=res, silu_mul=silu_mul,
                      out_dtype=x.dtype)
    return y.reshape(*lead, y.shape[-1])
