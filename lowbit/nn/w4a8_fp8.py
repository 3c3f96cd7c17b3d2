"""``W4A8FP8Linear``: FireQ's W4A8-FP linear layer (scheme ``w4a8-fp8``), and ``fuse_mlp``.

Buffers (see ``lowbit.formats.w4a8_fp8`` for the layouts): ``codes`` uint8 ``[N, Kp/2]``,
``scales`` float8_e4m3fn ``[N, Gp]`` (groups padded to 16), optional ``bias`` ``[N]``. Config: ``group_size``,
``pts_exp`` (PTS's n; delta^-1 = 2^-n is applied in the epilogue) and ``activation``
(``None``, or ``"silu_mul"`` for a fused gate_up weight with interleaved rows whose output is
``silu(gate) * up``, ``out_features = N / 2``).

Forward: per-token FP8 quantization of x, INT4 x FP8 GEMM with FP32 accumulation, epilogue
(``lowbit.ops.w4a8_fp8.w4a8_fp8_linear``). On CUDA the Triton kernels run; on CPU the float64
reference with the same numerics (or the kernels under TRITON_INTERPRET=1). NaN/Inf in the
weight raise at quantization; NaN/Inf in an activation row propagate to NaN in that output row.
"""
from __future__ import annotations

import torch
from torch import nn

from lowbit._utils import check_choice
from lowbit.formats.common import FP8_E4M3, interleave_rows
from lowbit.formats.w4a8_fp8 import GROUP_SIZES, dequantize_weight, padded_k, quantize_weight, scale_cols
from lowbit.nn.base import FusedMLP, QuantLinear, gptq_record

_ACTIVATIONS = (None, "silu_mul")


class W4A8FP8Linear(QuantLinear):
    scheme = "w4a8-fp8"
    interleave = 1  # fused gate_up (``activation='silu_mul'``): gate / up rows alternate one by one

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.bfloat16,
                 *, group_size: int = 128, pts_exp: int = 0, activation: str | None = None, device=None):
        super().__init__(in_features, out_features, dtype)
        group_size = check_choice(group_size, "group_size", GROUP_SIZES)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be None or 'silu_mul', got {activation!r}")
        self.group_size = int(group_size)
        self.pts_exp = int(pts_exp)
        self.activation = activation
        rows = 2 * out_features if activation == "silu_mul" else out_features
        self.register_buffer("codes", torch.full((rows, padded_k(in_features) // 2), 0x88, dtype=torch.uint8,
                                                 device=device))
        self.register_buffer("scales", torch.zeros((rows, scale_cols(in_features, group_size)), dtype=FP8_E4M3,
                                                   device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(rows, dtype=dtype, device=device))
        else:
            self.bias = None

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group_size: int = 128, pts: bool = True, pts_exp: int | None = None,
                    dtype: torch.dtype | None = None, **options) -> "W4A8FP8Linear":
        """Quantize ``linear`` (CAS, if any, already folded into its weight). ``pts=True`` picks
        delta = 2^n by ``lowbit.ptq.pts.pts_exponent``; ``pts_exp`` forces n."""
        if options:
            raise TypeError(f"unexpected options for w4a8-fp8: {sorted(options)}")
        sigma = None
        rec = gptq_record(linear, "w4a8-fp8", group_size)
        if rec is not None:  # GPTQ's scales and PTS exponent (lowbit.ptq.gptq)
            pts_exp = _gptq_pts(rec, pts, pts_exp)
            sigma = rec.scales["sigma"]
        return cls.from_weight(linear.weight.detach(), linear.bias, group_size=group_size, pts=pts, pts_exp=pts_exp,
                               dtype=dtype or linear.weight.dtype, sigma=sigma)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 128,
                    pts: bool = True, pts_exp: int | None = None, dtype: torch.dtype = torch.bfloat16,
                    activation: str | None = None, sigma: torch.Tensor | None = None) -> "W4A8FP8Linear":
        """From a float weight ``[rows, K]`` (rows already interleaved for ``activation='silu_mul'``);
        ``sigma`` [rows, ceil(K / group_size)] replaces the absmax group scales (GPTQ's)."""
        from lowbit.ptq.pts import exponent_for

        rows, k = weight.shape
        pts_exp = exponent_for(weight, group_size, pts=pts, pts_exp=pts_exp)
        out = rows // 2 if activation == "silu_mul" else rows
        m = cls(k, out, bias is not None, dtype, group_size=group_size, pts_exp=pts_exp, activation=activation,
                device=weight.device)
        codes, scales, _ = quantize_weight(weight, group_size, pts_exp, sigma)
        m.codes.copy_(codes)
        m.scales.copy_(scales)
        if bias is not None:
            m.bias.copy_(bias.detach().to(dtype))
        return m

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, **config) -> "W4A8FP8Linear":
        return cls(in_features, out_features, bias, dtype, **config)

    def config(self) -> dict:
        return {"group_size": self.group_size, "pts_exp": self.pts_exp, "activation": self.activation}

    # --- compute --------------------------------------------------------------------------
    @property
    def inv_delta(self) -> float:
        return 2.0 ** -self.pts_exp

    def dequantize(self) -> torch.Tensor:
        """Effective weight ``FP8(q*sigma) * delta^-1`` [rows, K] float32 (rows interleaved for
        ``silu_mul``)."""
        return dequantize_weight(self.codes, self.scales, self.in_features, self.group_size) * self.inv_delta

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        from lowbit.ops.w4a8_fp8 import w4a8_fp8_linear

        return w4a8_fp8_linear(x, self.codes, self.scales, self.inv_delta, self.in_features, self.group_size,
                               self.bias, residual=residual, silu_mul=self.activation == "silu_mul",
                               weight_checked=True)


class W4A8FP8MLP(FusedMLP):
    """Llama MLP with a fused gate_up ``W4A8FP8Linear`` (SiLU*mul in its epilogue) and ``down``."""


def _gptq_pts(rec, pts: bool, pts_exp: int | None) -> int:
    """The PTS exponent GPTQ quantized under; ValueError when the caller asks for another one."""
    n = int(rec.options.get("pts_exp", 0))
    if (pts_exp is not None and pts_exp != n) or (pts_exp is None and not pts and n != 0):
        raise ValueError(f"this linear was GPTQ-quantized with PTS exponent {n}; got pts={pts}, pts_exp={pts_exp}")
    return n


def fuse_mlp(layer_view, *, group_size: int = 128, pts: bool = True, quantize_down: bool = True) -> W4A8FP8MLP:
    """Replace ``layer_view.layer.mlp`` (a float Llama MLP with SiLU) by ``W4A8FP8MLP``: gate and
    up rows interleaved into one w4a8-fp8 weight with one shared PTS exponent (the rule applied to
    the concatenated weight). ``down_proj`` is quantized too unless it already is a QuantLinear."""
    mlp = layer_view.layer.mlp
    act = getattr(mlp, "act_fn", None)
    if act is not None and not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"fuse_mlp needs a SiLU MLP, got {type(act).__name__}")
    gate, up = layer_view.gate_proj, layer_view.up_proj
    if not isinstance(gate, nn.Linear) or not isinstance(up, nn.Linear):
        raise TypeError("fuse_mlp needs float nn.Linear gate_proj/up_proj")
    w = interleave_rows(gate.weight.detach(), up.weight.detach())
    rg, ru = gptq_record(gate, "w4a8-fp8", group_size), gptq_record(up, "w4a8-fp8", group_size)
    sigma = pts_exp = None
    if (rg is None) != (ru is None):
        raise ValueError("fuse_mlp: only one of gate_proj / up_proj carries GPTQ scales")
    if rg is not None:
        pts_exp = _gptq_pts(rg, pts, None)
        if _gptq_pts(ru, pts, None) != pts_exp:
            raise ValueError("fuse_mlp: gate_proj and up_proj were GPTQ-quantized with different PTS exponents")
        sigma = interleave_rows(rg.scales["sigma"], ru.scales["sigma"])
    b = None
    if gate.bias is not None or up.bias is not None:
        zg = gate.bias if gate.bias is not None else torch.zeros_like(up.bias)
        zu = up.bias if up.bias is not None else torch.zeros_like(gate.bias)
        b = interleave_rows(zg.detach(), zu.detach())
    gu = W4A8FP8Linear.from_weight(w, b, group_size=group_size, pts=pts, pts_exp=pts_exp, dtype=gate.weight.dtype,
                                   activation="silu_mul", sigma=sigma)
    down = layer_view.down_proj
    if quantize_down and isinstance(down, nn.Linear):
        down = W4A8FP8Linear.from_linear(down, group_size=group_size, pts=pts)
    new = W4A8FP8MLP(gu, down)
    layer_view.layer.mlp = new
    return new
