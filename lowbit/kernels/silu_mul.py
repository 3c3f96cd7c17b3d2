"""SiLU*mul of a fused gate_up output, one pass: ``out = silu(gate) * up`` (+ ``residual``).

``y [M, 2n]`` holds gate and up with their columns alternating in blocks of ``BLOCK_I`` (the rows of the fused
weight, ``formats.common.interleave_rows``: 1 for w4a8-fp8, 8 for the LUT fragment layout): output column c reads
gate at ``(c // BLOCK_I) * 2 BLOCK_I + c % BLOCK_I`` and up ``BLOCK_I`` further. Roundings of
``formats.common.silu_mul_ref`` (gate, up, silu(gate) and the product in the output dtype; the residual added to
the rounded product in FP32, rounded once). For the paths whose GEMM has no SiLU*mul epilogue (w4a8-fp8's
``torch._scaled_mm`` path, the LUT kernels but the register-table one). One program per row and ``BLOCK`` output
columns; any n (masked tail).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, check_tensor, interpret_mode
from lowbit.kernels.act_quant import pdl_enabled, pdl_prologue, round16, silu_mul_rounded


@triton.jit
def silu_mul_f32(gate, up, DT: tl.constexpr, EMU: tl.constexpr):
    """``silu(gate) * up`` from fp32 ``gate`` / ``up`` (GEMM outputs), as fp32 holding a ``DT`` value: gate and up
    rounded to ``DT`` first, then ``act_quant.silu_mul_rounded`` (silu(gate) and the product rounded too:
    ``formats.common.silu_mul_ref``)."""
    return silu_mul_rounded(round16(gate, DT, EMU).to(DT), round16(up, DT, EMU), EMU)


@triton.jit
def _silu_mul_kernel(
    Y, Res, Out,  # pointers: y [M, 2n] (gate/up interleaved in blocks of BLOCK_I), residual [M, n], out [M, n]
    n, stride_ym, stride_rm, stride_om,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_I: tl.constexpr = 1, EMU: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    if BLOCK_I == 1:  # adjacent (gate, up) pairs: one 2-wide load
        gu = tl.load(Y + row * stride_ym + 2 * cols[:, None] + tl.arange(0, 2)[None, :], mask=mask[:, None],
                     other=0.0)
        gate, up = tl.split(gu.to(tl.float32))
    else:
        gc = (cols // BLOCK_I) * (2 * BLOCK_I) + cols % BLOCK_I
        gate = tl.load(Y + row * stride_ym + gc, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(Y + row * stride_ym + gc + BLOCK_I, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul_f32(gate, up, Out.dtype.element_ty, EMU)
    if HAS_RES:
        r = tl.load(Res + row * stride_rm + cols, mask=mask, other=0.0)
        y = y + r.to(tl.float32)
    tl.store(Out + row * stride_om + cols, y.to(Out.dtype.element_ty), mask=mask)


def silu_mul_triton(y: torch.Tensor, *, block: int = 1, residual: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, pdl: bool = False) -> torch.Tensor:
    """``y [M, 2n]`` (16-bit; gate/up interleaved in blocks of ``block``) -> ``[M, n]`` in ``out_dtype`` (default
    y's), ``+ residual [M, n]``. ``pdl``: a programmatic dependent launch (``act_quant.pdl_prologue``; Hopper)."""
    check_tensor(y, "y", dtype=(torch.float16, torch.bfloat16), ndim=2)
    M, n2 = y.shape
    if block < 1 or n2 % (2 * block):
        raise ValueError(f"y has {n2} columns: not a multiple of 2 * block = {2 * block}")
    if y.stride(-1) != 1:
        y = y.contiguous()
    n = n2 // 2
    out = torch.empty((M, n), dtype=out_dtype or y.dtype, device=y.device)
    if residual is not None:
        check_tensor(residual, "residual", shape=(M, n))
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    if M and n:
        BLOCK = 1024
        _silu_mul_kernel[(M, cdiv(n, BLOCK))](
            y, residual if residual is not None else y, out, n, y.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0),
            HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=4, **({"BLOCK_I": block} if block != 1 else {}),
            **({"EMU": True} if interpret_mode() else {}),
            **({"PDL": True, "launch_pdl": True} if pdl and pdl_enabled(y, True) else {}))
    return out
