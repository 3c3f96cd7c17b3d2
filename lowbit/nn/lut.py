"""``LUTLinear``: FLUTE lookup-table weight-only linear layer (scheme ``"lut"``).

Buffers (layouts in ``lowbit.formats.lut``; all registered, so ``state_dict`` round-trips):

- ``qweight``: packed codes in one of two layouts (``layout``, part of ``config()``):
  ``'mma'`` (tensor-core fragment order, ``formats.lut.pack_codes_mma``; int32 ``[ceil(N/16), NC*128]``;
  4-bit with group >= 64 and 3-bit with group >= 128; read by the fragment kernel ``kernels.lut_gemm`` at few
  tokens and by the register-table kernel ``kernels.lut_wgmma`` at 9..128, ``ops.lut``) or ``'planar'``
  (``formats.lut.pack_codes``;
  int32 ``[N, Kp*bits/32]`` at 2/4-bit, int64 ``[N, Kp/32]`` 3-bit low-2-bit plane);
- ``qweight_hi``: 3-bit high-bit plane (int32, ``[ceil(N/16), NC*64]`` or ``[N, Kp/32]``), ``None`` otherwise;
- ``scales``: ``[Kp/group_size, N]`` in ``dtype`` (bf16 or fp16), group-major;
- ``table``: float32 ``[2**bits]``;
- ``pairs``: ``dtype`` ``[4**bits, 2]``, the pair table derived from ``table`` (FLUTE §3.2);
- ``bias``: ``[N]`` in ``dtype`` or ``None``.

``dtype`` is the activation dtype the kernel runs in. A float32 model (the embedded SmolLM2 on
the CPU) keeps float32 activations: on the CPU they go through the reference (float32 math); on
CUDA they are cast to ``dtype`` for the kernel and the output cast back.
"""
from __future__ import annotations

import torch
from torch import nn

from lowbit.formats.lut import (GROUP_SIZES, SCALE_DTYPES, make_table, mma_layout_ok, mma_packed_shapes,
                                pack_codes_mma, pack_lut, packed_shapes, pair_table, quantize_lut, table_is_uniform)

DEFAULT_LAYOUT = "mma"  # 'mma' where it exists (mma_layout_ok), else 'planar'; see docs/sections/lut.md
from lowbit.nn.base import QuantLinear
from lowbit.ops.lut import dequantize_packed, lut_gemm


class LUTLinear(QuantLinear):
    scheme = "lut"

    def __init__(self, in_features: int, out_features: int, *, bits: int = 4, group_size: int = 128,
                 bias: bool = False, dtype: torch.dtype = torch.bfloat16, table_kind: str = "nf",
                 lookup: str | None = None, layout: str | None = None, device=None):
        super().__init__(in_features, out_features, dtype)
        if group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        if dtype not in SCALE_DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        self.bits = int(bits)
        self.group_size = int(group_size)
        self.table_kind = table_kind  # 'nf' | 'int' | 'custom' (informational; the table buffer rules)
        ng = -(-self.in_features // group_size)
        if layout in (None, "auto"):
            layout = "mma" if DEFAULT_LAYOUT == "mma" and mma_layout_ok(self.bits, group_size) else "planar"
        if layout not in ("planar", "mma"):
            raise ValueError(f"layout must be 'planar', 'mma' or 'auto', got {layout!r}")
        if layout == "mma" and not mma_layout_ok(self.bits, group_size):
            raise ValueError(f"layout='mma' needs bits=4 with group_size >= 64 or bits=3 with group_size >= 128, "
                             f"got bits={bits}, group_size={group_size}")
        self.layout = layout
        if layout == "mma":
            qs, qd, hs = mma_packed_shapes(out_features, self.in_features, self.bits, group_size)
        else:
            qs, qd, hs = packed_shapes(out_features, self.in_features, bits)
        self.register_buffer("qweight", torch.zeros(qs, dtype=qd, device=device))
        self.register_buffer("qweight_hi", torch.zeros(hs, dtype=torch.int32, device=device) if hs else None)
        self.register_buffer("scales", torch.zeros(ng, out_features, dtype=dtype, device=device))
        self.register_buffer("table", make_table("int" if table_kind == "int" else "nf", bits).to(device))
        # FLUTE's vectorized pair table (derived from ``table``; used by lookup='pair')
        self.register_buffer("pairs", pair_table(self.table, bits, dtype).to(device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.lookup = lookup or ("affine" if table_kind == "int" else "load")

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, group_size: int = 128, table="nf",
                    dtype: torch.dtype | None = None, scales: torch.Tensor | None = None,
                    lookup: str | None = None, layout: str | None = None) -> "LUTLinear":
        """Quantize ``linear`` (RTN to the nearest table entry under absmax group scales, or
        under ``scales`` [N, ceil(K/group_size)] e.g. learned by ``lowbit.ptq.nfl``).
        ``table``: 'nf' (NormalFloat), 'int' (uniform RTN) or 2**bits floats.
        ``dtype``: activation/scale dtype; default the linear's if 16-bit, else bfloat16."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if dtype is None:
            dtype = w.dtype if w.dtype in SCALE_DTYPES else torch.bfloat16
        q = quantize_lut(w, bits=bits, group_size=group_size, table=table, scale_dtype=dtype, scales=scales)
        kind = table if isinstance(table, str) else ("int" if table_is_uniform(q.table) else "custom")
        m = cls(linear.in_features, linear.out_features, bits=bits, group_size=group_size,
                bias=linear.bias is not None, dtype=dtype, table_kind=kind, lookup=lookup, layout=layout,
                device=w.device)
        qw, qh, st = pack_lut(q)
        if m.layout == "mma":
            qw, qh = pack_codes_mma(q.codes, bits, group_size, linear.in_features)
        m.qweight.copy_(qw)
        if qh is not None:
            m.qweight_hi.copy_(qh)
        m.scales.copy_(st)
        m.table.copy_(q.table.to(w.device))
        m.pairs.copy_(pair_table(q.table, bits, dtype).to(w.device))
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach().to(dtype))
        return m

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, **config) -> "LUTLinear":
        config = dict(config)
        config.pop("dtype", None)
        config.setdefault("layout", "planar")  # checkpoints written before the 'mma' layout existed
        return cls(in_features, out_features, bias=bias, dtype=dtype, **config)

    def config(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "table_kind": self.table_kind,
                "lookup": self.lookup, "layout": self.layout}

    def fuse_layout(self) -> dict[str, tuple[int, int] | None]:
        """``qweight``/``qweight_hi``: row tiles of 16 along dim 0 in the 'mma' layout (N padded to
        a multiple of 16: only modules with N % 16 == 0 stack), rows along dim 0 in 'planar';
        ``scales`` [groups, N]: N along dim 1; ``bias``: rows; ``table``/``pairs``: shared."""
        r = 16 if self.layout == "mma" else 1
        return {"qweight": (0, r), "qweight_hi": (0, r), "scales": (1, 1), "bias": (0, 1),
                "table": None, "pairs": None}

    # --- compute ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
        """``x @ W_hat^T (+ bias)``; ``pdl``: as ``lowbit.ops.lut.lut_gemm`` (the runner's batch-1 chain)."""
        xin = x
        if x.is_cuda and x.dtype != self.dtype:
            x = x.to(self.dtype)
        y = lut_gemm(x, self.qweight, self.qweight_hi, self.scales, self.table, bits=self.bits,
                     group_size=self.group_size, lookup=self.lookup, pairs=self.pairs, layout=self.layout, pdl=pdl)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(xin.dtype)

    def dequantize(self) -> torch.Tensor:
        return dequantize_packed(self.qweight, self.qweight_hi, self.scales, self.table, self.bits,
                                 self.group_size, self.in_features, layout=self.layout)

    def codes(self) -> torch.Tensor:
        """uint8 codes [N, in_features] (reference layout), whatever the packed layout."""
        from lowbit.formats.lut import unpack_codes, unpack_codes_mma

        if self.layout == "mma":
            return unpack_codes_mma(self.qweight, self.qweight_hi, self.out_features, self.in_features, self.bits,
                                    self.group_size)
        return unpack_codes(self.qweight, self.qweight_hi, self.bits, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme='lut', {self.config()}"
