"""``W8Linear``: INT8 weight-only linear layer, one fp32 scale per output channel (scheme ``"w8"``).

Format: ``lowbit.formats.w8``; GEMM: ``lowbit.ops.w8`` (activations stay bf16 / fp16). Meant for
wide layers where 4 bits cost too much accuracy, first of all ``lm_head`` (the recipes'
``lm_head="w8"``): half the bytes of bf16 at ~1% weight error.

    >>> import torch, lowbit
    >>> q = lowbit.quantize_linear(torch.nn.Linear(256, 64), "w8")
    >>> q(torch.randn(3, 256)).shape
    torch.Size([3, 64])
"""
from __future__ import annotations

import torch
from torch import nn

from lowbit.formats import w8 as fmt
from lowbit.nn.base import QuantLinear
from lowbit.ops.w8 import w8_linear


class W8Linear(QuantLinear):
    """Buffers: ``codes`` int8 [N, K], ``scale`` fp32 [N], optional ``bias`` [N] in the activation dtype."""

    scheme = "w8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__(in_features, out_features, dtype)
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None) -> "W8Linear":
        """Quantize ``linear`` (its weight on any device; the module lands on the same device). ``dtype``:
        activation / output dtype (default: the linear's weight dtype)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        dtype = dtype or w.dtype
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, device=w.device)
        codes, scale = fmt.quantize_w8(w)
        mod.codes.copy_(codes)
        mod.scale.copy_(scale)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(dtype))
        return mod

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, **config) -> "W8Linear":
        return cls(in_features, out_features, bias, dtype, **config)

    def config(self) -> dict:
        return {}

    def dequantize(self) -> torch.Tensor:
        return fmt.dequantize_w8(self.codes, self.scale, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return w8_linear(x, self.codes, self.scale, self.bias)
