"""``W4A8INT8Linear``: QServe's W4A8 linear layer (scheme ``"w4a8-int8"``, QServe §4 / QoQ).

Weights: progressive group quantization (``lowbit.formats.w4a8_int8``: per-channel INT8 in
[-119, 119], then per-group UINT4 with integer scales and zero points of that INT8 weight).
Activations: per-token symmetric INT8, quantized at run time (``lowbit.ops.quant``).
GEMM: INT8 x INT8 tensor cores, INT32 accumulation, fp32 epilogue (``lowbit.ops.w4a8_int8``).

    >>> import torch, lowbit
    >>> lin = torch.nn.Linear(256, 64)
    >>> q = lowbit.quantize_linear(lin, "w4a8-int8", group_size=128)
    >>> q(torch.randn(3, 256)).shape
    torch.Size([3, 64])
"""
from __future__ import annotations

import torch
from torch import nn

from lowbit.formats import w4a8_int8 as fmt
from lowbit.nn.base import QuantLinear
from lowbit.ops.w4a8_int8 import w4a8_int8_linear


class W4A8INT8Linear(QuantLinear):
    """Buffers (see ``lowbit.formats.w4a8_int8``): ``qweight`` uint8 [N, Kp/2], ``wscale`` fp32 [N],
    ``gscale`` uint8 [N, G], ``gzs`` uint8 [N, G], optional ``bias`` [N] in the activation dtype.
    ``group_size`` = 128 by default, ``-1`` = per-channel (QServe's two options)."""

    scheme = "w4a8-int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.bfloat16,
                 group_size: int = 128, device=None):
        super().__init__(in_features, out_features, dtype)
        self.group_size = fmt.check_group_size(group_size)
        kp = fmt.padded_k(in_features, group_size)
        G = 1 if group_size == -1 else kp // group_size
        self.register_buffer("qweight", torch.zeros(out_features, kp // 2, dtype=torch.uint8, device=device))
        self.register_buffer("wscale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("gscale", torch.ones(out_features, G, dtype=torch.uint8, device=device))
        self.register_buffer("gzs", torch.zeros(out_features, G, dtype=torch.uint8, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, dtype: torch.dtype | None = None) -> "W4A8INT8Linear":
        """Quantize ``linear`` (its weight on any device; the module lands on the same device).
        ``dtype``: activation/output dtype (default: the linear's weight dtype)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        dtype = dtype or w.dtype
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, group_size, device=w.device)
        qw = fmt.quantize(w, group_size)
        mod.qweight.copy_(qw.qweight)
        mod.wscale.copy_(qw.wscale)
        mod.gscale.copy_(qw.gscale)
        mod.gzs.copy_(qw.gzs)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(dtype))
        return mod

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, **config) -> "W4A8INT8Linear":
        return cls(in_features, out_features, bias, dtype, **config)

    def config(self) -> dict:
        return {"group_size": self.group_size}

    # --- inspection ---------------------------------------------------------------------
    def qoq_weight(self) -> fmt.QoQWeight:
        return fmt.QoQWeight(self.qweight, self.wscale, self.gscale, self.gzs, self.in_features, self.group_size)

    def dequantize(self) -> torch.Tensor:
        return fmt.dequantize(self.qoq_weight(), torch.float32)

    # --- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must have {self.in_features} features in its last dim, got shape {list(x.shape)}")
        return w4a8_int8_linear(x, self.qweight, self.wscale, self.gscale, self.gzs, self.bias)
