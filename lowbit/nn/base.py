"""``QuantLinear``: the contract every quantized linear module follows.

A scheme's module stores only tensors as registered buffers (so ``state_dict`` round-trips
through safetensors) plus a JSON-serialisable ``config()``. ``lowbit.models.checkpoint`` rebuilds
it with ``cls.empty(in_features, out_features, bias, dtype, **config)`` and loads the buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from lowbit._utils import check_tensor


GPTQ_ATTR = "lowbit_gptq"  # attribute of a float nn.Linear holding its GPTQResult until it is quantized


@dataclass
class GPTQResult:
    """Scales chosen by GPTQ (``lowbit.ptq.gptq.apply_gptq``) for a float ``nn.Linear`` whose weight GPTQ already
    moved onto the format's grid; the modules' ``from_linear`` quantize under them (``gptq_record``)."""

    scheme: str
    group_size: int
    scales: dict  # w4a8-fp8: sigma [N, G] float32; w4a8-int8: s1 [N], s2 / z [N, G] int32; lut: scales [N, G]
    options: dict = field(default_factory=dict)  # pts_exp (w4a8-fp8); bits, table, scale_dtype (lut)
    stats: dict = field(default_factory=dict)  # proxy losses ``rtn`` / ``gptq`` (mean over tokens of |x (W - Q)^T|^2)


def gptq_record(linear, scheme: str, group_size: int) -> GPTQResult | None:
    """The ``GPTQResult`` attached to ``linear`` (None without one); ValueError when it was made for another
    scheme or group size than the module about to be built."""
    rec = getattr(linear, GPTQ_ATTR, None)
    if rec is None:
        return None
    if rec.scheme != scheme or rec.group_size != group_size:
        raise ValueError(f"this linear was GPTQ-quantized for {rec.scheme!r} with group_size={rec.group_size}; "
                         f"quantize it with the same (got {scheme!r}, group_size={group_size})")
    return rec


class QuantLinear(nn.Module):
    scheme: ClassVar[str] = ""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.dtype = dtype  # activation / output dtype

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "QuantLinear":
        raise NotImplementedError

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, **config) -> "QuantLinear":
        """Allocate a module with correctly shaped (uninitialised) buffers, for loading."""
        raise NotImplementedError

    def config(self) -> dict:
        """Options that ``empty`` needs to rebuild this module (JSON-serialisable)."""
        raise NotImplementedError

    def fuse_layout(self) -> dict[str, tuple[int, ...] | None]:
        """How each registered buffer follows the output features, for stacking modules into one
        (``lowbit.models.generate._fuse_rows``): ``{name: (dim, rows_per_index)}`` says that index
        ``i`` along ``dim`` covers output rows ``[i * rows_per_index, (i + 1) * rows_per_index)``, so
        modules whose ``out_features`` are multiples of ``rows_per_index`` concatenate along ``dim``
        exactly; a third entry ``(dim, rows_per_index, align)``: only while every module but the last
        has a multiple of ``align`` output rows (a layout tiled in blocks of ``align`` rows). ``None``:
        the buffer does not follow the rows (it must be identical across the modules and is shared).
        Default: ``(0, 1)`` for every buffer (row-major; a buffer that is not row-major is still shared
        when identical across the modules)."""
        return {n: (0, 1) for n, _ in self.named_buffers(recurse=False)}

    @classmethod
    def prepare_fusion(cls, mods: list) -> None:
        """Called by the runner's fusion (``lowbit.models.generate._fuse_rows``) on modules of this
        class before it stacks them: a class whose buffer layout can change in place (e.g. tiled
        codes back to row-major) makes the modules stackable here. Default: nothing."""

    def _apply(self, fn, recurse=True):
        """Device moves (``.to(device)``, ``.cuda()``) apply to the stored buffers; dtype casts (``.half()``,
        ``.to(torch.bfloat16)``, ``.float()``, of the module or of a model holding it) do not. Codes, scales, tables
        and bias are the format's storage, and the forward takes fp16 / bf16 / fp32 activations and answers in their
        dtype, so ``quantized_model.half()`` runs in fp16 with the weights as quantized. (Until session 43 a cast
        converted the FP8 / fp32 scales too and the forward raised, naming the buffer.)"""

        def move(t):
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(device=out.device)

        return super()._apply(move, recurse)

    def check_input(self, x) -> None:
        """The forward's check of ``x [..., in_features]`` before its op (a tensor, at least 1-D, this module's width:
        an op that sees only the padded groups would let an x up to a group wider pass); ValueError / TypeError
        naming x."""
        check_tensor(x, "x")
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have {self.in_features} features in its last dim, got shape {list(x.shape)}")

    # --- inspection ---------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """The effective weight [out_features, in_features] in float32 (for tests and export)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of every stored buffer (codes, scales, bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme!r}, {self.config()}"


class FusedMLP(nn.Module):
    """A gated (Llama) MLP as two quantized linears: ``gate_up``, gate and up stacked with their rows interleaved
    (``formats.common.interleave_rows``, in blocks of the module's ``interleave``) and ``activation='silu_mul'``,
    so its output is ``silu(gate) * up`` from the GEMM (the epilogue, or one pass after it), then ``down_proj``.
    Built by the schemes' ``fuse_mlp`` (``lowbit.nn.w4a8_fp8``, ``lowbit.nn.lut``)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate_up = gate_up
        self.down_proj = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up(x))
