"""Per-token activation quantization op: ``lowbit::per_token_quant``.

x ``[..., K]`` (fp16/bf16/fp32) -> (q ``[..., K]`` in FP8 E4M3 or INT8, scale fp32 ``[...]``),
one absmax scale per row, numerics of ``lowbit.formats.common.quantize_per_token``.
The Triton kernel lives in ``lowbit.kernels.act_quant``.
"""
from __future__ import annotations

import torch

from lowbit._utils import check_rows, run_op, use_triton
from lowbit.formats.common import FP8_E4M3, quantize_per_token

_OUT = {"fp8": FP8_E4M3, "int8": torch.int8}


@torch.library.custom_op("lowbit::per_token_quant", mutates_args=())
def _per_token_quant(x: torch.Tensor, out_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = _OUT[out_format]
    if use_triton(x):
        try:
            from lowbit.kernels.act_quant import per_token_quant_triton
        except ImportError:  # kernel not built yet in this tree: same numerics in PyTorch
            per_token_quant_triton = None
        if per_token_quant_triton is not None:
            return per_token_quant_triton(x, dtype)
    return quantize_per_token(x, dtype)


@_per_token_quant.register_fake
def _(x, out_format):
    return x.new_empty(x.shape, dtype=_OUT[out_format]), x.new_empty(x.shape[:-1], dtype=torch.float32)


def per_token_quant(x: torch.Tensor, out_format: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to ``out_format`` ('fp8' or 'int8'); returns (q, scale)."""
    if out_format not in _OUT:
        raise ValueError(f"out_format must be one of {sorted(_OUT)}, got {out_format!r}")
    check_rows(x)
    return run_op(_per_token_quant, x.contiguous(), out_format)
