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
from lowbit.nn.base import QuantLinear, gptq_record
from lowbit.ops.w4a8_int8 import w4a8_int8_linear


class W4A8INT8Linear(QuantLinear):
    """Buffers (see ``lowbit.formats.w4a8_int8``): ``qweight`` uint8 [N, Kp/2], ``wscale`` fp32 [N],
    ``gscale`` uint8 [N, G], ``gzs`` uint8 [N, G], optional ``bias`` [N] in the activation dtype.
    ``group_size`` = 128 by default, ``-1`` = per-channel (QServe's two options).

    ``tiled`` (runtime layout of ``qweight``): the codes sit row-tiled in memory
    (``lowbit.formats.w4a8_int8.tile_codes``: the same bytes in 64-row blocks; faster decode GEMMs,
    see the format's docstring). Default (None): tiled when ``out_features`` is a multiple of 64, true
    of every projection of a real model. The ``state_dict`` always holds the row-major codes
    (untiled on save, tiled again on load), so a state_dict or checkpoint loads into a module of
    either layout, and checkpoints from before the tiled layout load unchanged; ``config()`` records
    the layout so a loaded module gets the same one."""

    scheme = "w4a8-int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.bfloat16,
                 group_size: int = 128, tiled: bool | None = None, device=None):
        super().__init__(in_features, out_features, dtype)
        self.group_size = fmt.check_group_size(group_size)
        if tiled is None:
            tiled = out_features % fmt.TILE_ROWS == 0
        if not isinstance(tiled, bool):
            raise TypeError(f"tiled must be a bool or None, got {type(tiled).__name__}")
        self.tiled = tiled
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
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, dtype: torch.dtype | None = None,
                    tiled: bool | None = None) -> "W4A8INT8Linear":
        """Quantize ``linear`` (its weight on any device; the module lands on the same device).
        ``dtype``: activation/output dtype (default: the linear's weight dtype). ``tiled``: the codes'
        layout in memory (default None: tiled when ``out_features`` is a multiple of 64)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        dtype = dtype or w.dtype
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, group_size, tiled,
                  device=w.device)
        rec = gptq_record(linear, "w4a8-int8", group_size)  # GPTQ's scales (lowbit.ptq.gptq), if any
        qw = fmt.quantize(w, group_size, **(rec.scales if rec is not None else {}))
        mod.qweight.copy_(fmt.tile_codes(qw.qweight) if mod.tiled else qw.qweight)
        mod.wscale.copy_(qw.wscale)
        mod.gscale.copy_(qw.gscale)
        mod.gzs.copy_(qw.gzs)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(dtype))
        return mod

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, **config) -> "W4A8INT8Linear":
        """A module to load into (a config without ``tiled``, from before the tiled layout: the default)."""
        return cls(in_features, out_features, bias, dtype, **config)

    def config(self) -> dict:
        return {"group_size": self.group_size, "tiled": self.tiled}

    # the state_dict holds row-major codes whatever the runtime layout (see the class docstring)
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled and prefix + "qweight" in destination:
            destination[prefix + "qweight"] = fmt.untile_codes(self.qweight.detach())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "qweight"
        codes = state_dict.get(key)
        if self.tiled and isinstance(codes, torch.Tensor) and codes.shape == self.qweight.shape:
            state_dict[key] = fmt.tile_codes(codes)  # a new tensor: the caller's (a copied dict's entry) is untouched
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def fuse_layout(self) -> dict:
        """Row-major buffers stack by rows; tiled codes too, while every module but the last has a
        multiple of ``fmt.TILE_ROWS`` rows (then the concatenation is the tiled stack)."""
        lay = super().fuse_layout()
        if self.tiled:
            lay["qweight"] = (0, 1, fmt.TILE_ROWS)
        return lay

    @classmethod
    def prepare_fusion(cls, mods: list) -> None:
        """Modules that differ only in layout, or tiled modules that cannot stack (a row count that is
        not a multiple of 64 before the last module): the tiled ones go back to row-major, in place,
        so the group stacks row-major."""
        if len({m.group_size for m in mods}) != 1 or not any(m.tiled for m in mods):
            return
        if not all(m.tiled for m in mods) or any(m.out_features % fmt.TILE_ROWS for m in mods[:-1]):
            for m in mods:
                m._set_tiled(False)

    def _set_tiled(self, tiled: bool) -> None:
        """Re-lay the codes in place (same storage): row-tiled (True) or row-major (False). Only while the
        module owns its codes: after the runner's fusion they are views of (or viewed by) a fused buffer."""
        if bool(tiled) == self.tiled:
            return
        if self.qweight._base is not None:
            raise RuntimeError("this module's codes are a view of a fused buffer; re-laying them would corrupt it")
        with torch.no_grad():
            codes = fmt.tile_codes(self.qweight) if tiled else fmt.untile_codes(self.qweight)
            self.qweight.copy_(codes)
        self.tiled = bool(tiled)

    # --- inspection ---------------------------------------------------------------------
    def qoq_weight(self) -> fmt.QoQWeight:
        return fmt.QoQWeight(self.qweight, self.wscale, self.gscale, self.gzs, self.in_features, self.group_size,
                             self.tiled)

    def dequantize(self) -> torch.Tensor:
        return fmt.dequantize(self.qoq_weight(), torch.float32)

    # --- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return w4a8_int8_linear(x, self.qweight, self.wscale, self.gscale, self.gzs, self.bias, tiled=self.tiled,
                                weight_checked=True)
