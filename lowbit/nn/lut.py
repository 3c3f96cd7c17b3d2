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

``activation='silu_mul'`` (``fuse_mlp``): the module is a fused gate_up of ``N = 2 * out_features`` rows, gate and
up alternating in blocks of ``interleave`` = 8 rows (``formats.common.interleave_rows(gate, up, 8)``: the rows g /
g + 8 of each 16-row fragment tile), and its output is ``silu(gate) * up`` (``ops.lut.lut_gemm(silu_mul=True)``:
the register-table kernel's epilogue at 9..128 tokens, one pass after the GEMM elsewhere). No bias.

``dtype`` is the activation dtype the kernel runs in. A float32 model (the embedded SmolLM2 on
the CPU) keeps float32 activations: on the CPU they go through the reference (float32 math); on
CUDA they are cast to ``dtype`` for the kernel and the output cast back.
"""
from __future__ import annotations

import torch
from torch import nn

from lowbit._utils import check_choice
from lowbit.formats.common import interleave_rows
from lowbit.formats.lut import (GROUP_SIZES, SCALE_DTYPES, SILU_BLOCK, make_table, mma_layout_ok, mma_packed_shapes, pack_codes,
                                pack_codes_mma, pack_lut, packed_shapes, pair_table, quantize_lut, table_is_uniform)

DEFAULT_LAYOUT = "mma"  # 'mma' where it exists (mma_layout_ok), else 'planar'; see docs/sections/lut.md
from lowbit.nn.base import FusedMLP, QuantLinear, gptq_record
from lowbit.ops.lut import dequantize_packed, lut_gemm


class LUTLinear(QuantLinear):
    scheme = "lut"
    interleave = SILU_BLOCK  # fused gate_up (``activation='silu_mul'``): gate / up rows alternate in blocks of 8

    def __init__(self, in_features: int, out_features: int, *, bits: int = 4, group_size: int = 128,
                 bias: bool = False, dtype: torch.dtype = torch.bfloat16, table_kind: str = "nf",
                 lookup: str | None = None, layout: str | None = None, activation: str | None = None, device=None):
        super().__init__(in_features, out_features, dtype)
        if activation not in (None, "silu_mul"):
            raise ValueError(f"activation must be None or 'silu_mul', got {activation!r}")
        if activation and bias:
            raise ValueError("activation='silu_mul' (a fused gate_up) takes no bias")
        self.activation = activation
        rows = 2 * self.out_features if activation else self.out_features
        group_size = check_choice(group_size, "group_size", GROUP_SIZES)
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
            qs, qd, hs = mma_packed_shapes(rows, self.in_features, self.bits, group_size)
        else:
            qs, qd, hs = packed_shapes(rows, self.in_features, bits)
        self.register_buffer("qweight", torch.zeros(qs, dtype=qd, device=device))
        self.register_buffer("qweight_hi", torch.zeros(hs, dtype=torch.int32, device=device) if hs else None)
        self.register_buffer("scales", torch.zeros(ng, rows, dtype=dtype, device=device))
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
        rec = gptq_record(linear, "lut", group_size)
        if rec is not None:  # GPTQ's scales (lowbit.ptq.gptq): the same table, bits and scale dtype required
            o = rec.options
            same_table = (isinstance(table, str) and o.get("table", "nf") == table) or (
                not isinstance(table, str) and not isinstance(o.get("table"), str)
                and torch.equal(make_table(table, bits), make_table(o["table"], bits)))
            if scales is not None or o.get("bits", 4) != bits or not same_table or o.get("scale_dtype") != dtype:
                raise ValueError(f"this linear was GPTQ-quantized with bits={o.get('bits', 4)}, table="
                                 f"{o.get('table', 'nf')!r}, dtype={o.get('scale_dtype')}; quantize it with the same "
                                 "and without scales=")
            scales = rec.scales["scales"]
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
        c = {"bits": self.bits, "group_size": self.group_size, "table_kind": self.table_kind,
             "lookup": self.lookup, "layout": self.layout}
        if self.activation:  # (only when set: plain modules keep their metadata)
            c["activation"] = self.activation
        return c

    def fuse_layout(self) -> dict[str, tuple[int, int] | None]:
        """``qweight``/``qweight_hi``: row tiles of 16 along dim 0 in the 'mma' layout (N padded to
        a multiple of 16: only modules with N % 16 == 0 stack), rows along dim 0 in 'planar';
        ``scales`` [groups, N]: N along dim 1; ``bias``: rows; ``table``/``pairs``: shared."""
        if self.activation:
            raise NotImplementedError("a fused gate_up (activation='silu_mul') does not stack further")
        r = 16 if self.layout == "mma" else 1
        return {"qweight": (0, r), "qweight_hi": (0, r), "scales": (1, 1), "bias": (0, 1),
                "table": None, "pairs": None}

    # --- compute ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
        """``x @ W_hat^T (+ bias)``; ``pdl``: as ``lowbit.ops.lut.lut_gemm`` (the runner's batch-1 chain)."""
        self.check_input(x)
        xin = x
        if x.is_cuda and x.dtype != self.dtype:
            x = x.to(self.dtype)
        y = lut_gemm(x, self.qweight, self.qweight_hi, self.scales, self.table, bits=self.bits,
                     group_size=self.group_size, lookup=self.lookup, pairs=self.pairs, layout=self.layout, pdl=pdl,
                     silu_mul=self.activation == "silu_mul", weight_checked=True)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(xin.dtype)

    def dequantize(self) -> torch.Tensor:
        """``W_hat`` [rows, in_features] float32 (a fused gate_up: its 2 * out_features interleaved rows)."""
        return dequantize_packed(self.qweight, self.qweight_hi, self.scales, self.table, self.bits,
                                 self.group_size, self.in_features, layout=self.layout)

    def codes(self) -> torch.Tensor:
        """uint8 codes [N, in_features] (reference layout), whatever the packed layout."""
        from lowbit.formats.lut import unpack_codes, unpack_codes_mma

        if self.layout == "mma":
            return unpack_codes_mma(self.qweight, self.qweight_hi, self.scales.shape[1], self.in_features, self.bits,
                                    self.group_size)
        return unpack_codes(self.qweight, self.qweight_hi, self.bits, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme='lut', {self.config()}"


def fuse_mlp(layer_view) -> FusedMLP:
    """Replace ``layer_view.layer.mlp`` (a Llama MLP with SiLU whose gate_proj / up_proj are ``LUTLinear`` of one
    config and one table, no bias, out_features a multiple of 8) by a ``FusedMLP``: one ``LUTLinear`` with
    ``activation='silu_mul'`` holding the same codes and scales, rows interleaved in blocks of 8, and the same
    ``down_proj``. Exact: the same weights, the same products; the output is rounded as the eager MLP's
    (``formats.common.silu_mul_ref``). Run after quantization (and after learned NF scales). Raises
    ``ValueError`` / ``TypeError`` naming what does not fit."""
    mlp = layer_view.layer.mlp
    act = getattr(mlp, "act_fn", None)
    if act is None or type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"fuse_mlp needs a SiLU MLP, got {type(act).__name__}")
    gate, up = layer_view.gate_proj, layer_view.up_proj
    if type(gate) is not LUTLinear or type(up) is not LUTLinear:
        raise TypeError(f"fuse_mlp needs LUTLinear gate_proj / up_proj, got {type(gate).__name__} / "
                        f"{type(up).__name__}")
    if gate.config() != up.config() or gate.in_features != up.in_features or gate.out_features != up.out_features:
        raise ValueError(f"fuse_mlp: gate_proj and up_proj differ ({gate.config()} vs {up.config()})")
    if gate.bias is not None or up.bias is not None:
        raise ValueError("fuse_mlp: gate_proj / up_proj with a bias are not fused")
    if gate.out_features % SILU_BLOCK:
        raise ValueError(f"fuse_mlp needs out_features a multiple of {SILU_BLOCK}, got {gate.out_features}")
    if not torch.equal(gate.table, up.table):
        raise ValueError("fuse_mlp: gate_proj and up_proj have different tables")
    k, b, g = gate.in_features, gate.bits, gate.group_size
    m = LUTLinear(k, gate.out_features, bits=b, group_size=g, dtype=gate.dtype, table_kind=gate.table_kind,
                  lookup=gate.lookup, layout=gate.layout, activation="silu_mul", device=gate.qweight.device)
    codes = interleave_rows(gate.codes(), up.codes(), SILU_BLOCK)
    qw, qh = pack_codes_mma(codes, b, g, k) if gate.layout == "mma" else pack_codes(codes, b, k)
    m.qweight.copy_(qw)
    if qh is not None:
        m.qweight_hi.copy_(qh)
    m.scales.copy_(interleave_rows(gate.scales.t(), up.scales.t(), SILU_BLOCK).t())
    m.table.copy_(gate.table)
    m.pairs.copy_(gate.pairs)
    new = FusedMLP(m, mlp.down_proj)
    layer_view.layer.mlp = new
    return new
