"""W4A8 INT8 linear (QServe QoQ): ``lowbit::w4a8_int8_gemm`` and ``w4a8_int8_linear``.

``w4a8_int8_linear(x, ...)`` (op ``lowbit::w4a8_int8_linear``) = per-token INT8 quantization of
``x`` followed by the W4A8 GEMM (``lowbit.kernels.w4a8_int8_gemm``): the act-quant kernel then the
GEMM, for M <= ``PDL_MAX_M`` as a programmatic dependent pair (or, where ``use_fused_quant`` says so
-- off by default since session 11 -- the quantization inside the GEMM kernel); the plain-PyTorch reference (``quantize_per_token`` + ``gemm_ref``, same
numerics) on CPU without the interpreter.
Weight fields and their layouts: ``lowbit.formats.w4a8_int8`` (the group size is implied by
the shapes: ``Kp / G`` columns per group, ``Kp = 2 * qweight.shape[1]``).
"""
from __future__ import annotations

import math

import torch

from lowbit._utils import check_rows, check_same_device, check_tensor, run_op, use_triton
from lowbit.formats.common import quantize_per_token
from lowbit.formats.w4a8_int8 import gemm_ref

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_weight(K, qweight, wscale, gscale, gzs, bias, out_dtype, xname="xq", tiled=False):
    check_tensor(qweight, "qweight", dtype=torch.uint8, ndim=2)
    N, kp2 = qweight.shape
    Kp = 2 * kp2
    if qweight.numel() and qweight.stride(1) != 1:
        raise ValueError(f"qweight must have unit stride along its last dim, got strides {list(qweight.stride())}")
    if tiled and not qweight.is_contiguous():
        raise ValueError("tiled qweight must be contiguous (its 64-row blocks are contiguous bytes)")
    check_tensor(wscale, "wscale", dtype=torch.float32, shape=[N])
    check_tensor(gscale, "gscale", dtype=torch.uint8, ndim=2)
    G = gscale.shape[1]
    check_tensor(gscale, "gscale", dtype=torch.uint8, shape=[N, G])
    check_tensor(gzs, "gzs", dtype=torch.uint8, shape=[N, G])
    if G < 1 or Kp % G:
        raise ValueError(f"gscale has {G} groups, which must divide the padded in_features {Kp}")
    g = Kp // G
    if Kp % 128 or not (K <= Kp < K + math.lcm(g, 128)):
        raise ValueError(f"{xname} has K={K} columns but qweight holds {Kp} (padded to lcm(group {g}, 128)); "
                         f"they must match up to that padding")
    if bias is not None:
        check_tensor(bias, "bias", dtype=_OUT_DTYPES, shape=[N])
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    return g


def _check(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype, tiled=False):
    check_tensor(xq, "xq", dtype=torch.int8, ndim=2)
    M, K = xq.shape
    check_tensor(xscale, "xscale", dtype=torch.float32, shape=[M])
    g = _check_weight(K, qweight, wscale, gscale, gzs, bias, out_dtype, tiled=tiled)
    check_same_device(xq=xq, xscale=xscale, qweight=qweight, wscale=wscale, gscale=gscale, gzs=gzs, bias=bias)
    return g


@torch.library.custom_op("lowbit::w4a8_int8_gemm", mutates_args=())
def _w4a8_int8_gemm(xq: torch.Tensor, xscale: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                    gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype, pdl: bool = False, tiled: bool = False) -> torch.Tensor:
    Kp = 2 * qweight.shape[1]
    g = Kp // gscale.shape[1]
    if use_triton(xq, qweight):
        from lowbit.kernels.w4a8_int8_gemm import w4a8_int8_gemm_triton

        return w4a8_int8_gemm_triton(xq, xscale, qweight, wscale, gscale, gzs, bias, xq.shape[1], g, out_dtype,
                                     pdl=pdl, tiled=tiled)
    return gemm_ref(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype, tiled)


@_w4a8_int8_gemm.register_fake
def _(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype, pdl=False, tiled=False):
    return xq.new_empty((xq.shape[0], qweight.shape[0]), dtype=out_dtype)


def w4a8_int8_gemm(xq: torch.Tensor, xscale: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                   gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None = None, *,
                   out_dtype: torch.dtype = torch.bfloat16, pdl: bool = False, tiled: bool = False) -> torch.Tensor:
    """``y = (xq @ w8^T) * xscale[:, None] * wscale[None, :] + bias`` -> ``out_dtype`` [M, N].

    xq int8 [M, K] (per-token codes), xscale fp32 [M]; qweight uint8 [N, Kp/2], wscale fp32 [N],
    gscale/gzs uint8 [N, G] (see ``lowbit.formats.w4a8_int8``); bias [N] or None.
    INT8 x INT8 products accumulate in INT32; scales apply in fp32 in the epilogue. ``pdl``: launch
    the kernel as a programmatic dependent launch (Hopper; same result; the runner's batch-1 chain
    after its PDL act-quant launch). ``tiled``: ``qweight`` in the row-tiled layout
    (``lowbit.formats.w4a8_int8.tile_codes``; what ``W4A8INT8Linear`` stores by default).
    """
    _check(xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype, tiled)
    return run_op(_w4a8_int8_gemm, xq, xscale, qweight, wscale, gscale, gzs, bias, out_dtype, bool(pdl), bool(tiled))


@torch.library.custom_op("lowbit::w4a8_int8_linear", mutates_args=())
def _w4a8_int8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, gscale: torch.Tensor,
                      gzs: torch.Tensor, bias: torch.Tensor | None, tiled: bool = False) -> torch.Tensor:
    Kp = 2 * qweight.shape[1]
    g = Kp // gscale.shape[1]
    if use_triton(x, qweight):
        from lowbit.kernels.w4a8_int8_gemm import use_fused_quant, use_pdl, w4a8_int8_gemm_triton

        if use_fused_quant(x.shape[0], qweight.shape[0], Kp, g):  # decode: quantization inside the GEMM
            return w4a8_int8_gemm_triton(x, None, qweight, wscale, gscale, gzs, bias, x.shape[1], g, x.dtype,
                                         tiled=tiled)
        if use_pdl(x.shape[0]):  # act-quant -> GEMM as a programmatic dependent pair (same codes, same sums)
            from lowbit.kernels.act_quant import per_token_quant_triton

            xq, xs = per_token_quant_triton(x, torch.int8, pdl=True)
            return w4a8_int8_gemm_triton(xq, xs, qweight, wscale, gscale, gzs, bias, x.shape[1], g, x.dtype, pdl=True,
                                         tiled=tiled)
        from lowbit.ops.quant import per_token_quant

        xq, xs = per_token_quant(x, "int8")
        return w4a8_int8_gemm_triton(xq, xs, qweight, wscale, gscale, gzs, bias, x.shape[1], g, x.dtype, tiled=tiled)
    xq, xs = quantize_per_token(x, torch.int8)
    return gemm_ref(xq, xs, qweight, wscale, gscale, gzs, bias, x.dtype, tiled)


@_w4a8_int8_linear.register_fake
def _(x, qweight, wscale, gscale, gzs, bias, tiled=False):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def w4a8_int8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, gscale: torch.Tensor,
                     gzs: torch.Tensor, bias: torch.Tensor | None = None, *, tiled: bool = False,
                     weight_checked: bool = False) -> torch.Tensor:
    """``x`` [..., K] (fp16/bf16/fp32) -> [..., N] in x's dtype: per-token INT8 quantization of x
    (numerics of ``lowbit.formats.common.quantize_per_token``, its cost included) then the W4A8 GEMM:
    the act-quant kernel first (for M <= 16 launched with the GEMM as a programmatic dependent pair),
    or, where ``lowbit.kernels.w4a8_int8_gemm.use_fused_quant`` allows it (off by default since
    session 11: measured slower), inside the GEMM kernel. All give the same codes (bit-identical outputs).
    ``tiled``: ``qweight`` in the row-tiled layout (``lowbit.formats.w4a8_int8.tile_codes``). ``weight_checked``:
    the caller vouches that the weight tensors fit each other (``W4A8INT8Linear``, which also checked x's width):
    only x's dtype and device are checked (host time, session 38)."""
    check_rows(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not (weight_checked and wscale.dtype == torch.float32 and qweight.dtype == gscale.dtype == gzs.dtype ==
            torch.uint8 and (bias is None or bias.dtype in _OUT_DTYPES)):  # a module cast by .to(dtype): full checks
        _check_weight(x2.shape[1], qweight, wscale, gscale, gzs, bias, x.dtype, xname="x", tiled=tiled)
        check_same_device(x=x, qweight=qweight, wscale=wscale, gscale=gscale, gzs=gzs, bias=bias)
    elif x.device != qweight.device:
        check_same_device(x=x, qweight=qweight)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = run_op(_w4a8_int8_linear, x2, qweight, wscale, gscale, gzs, bias, bool(tiled))
    return y.reshape(*lead, qweight.shape[0])


@torch.library.custom_op("lowbit::w4a8_int8_silu_mul_linear", mutates_args=())
def _w4a8_int8_silu_mul_linear(gate_up: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                               gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None,
                               tiled: bool = False) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    Kp = 2 * qweight.shape[1]
    gsz = Kp // gscale.shape[1]
    if use_triton(gate_up, qweight):
        from lowbit.kernels.w4a8_int8_gemm import FUSE_SILU_MAX_M, w4a8_int8_gemm_triton

        if 0 < gate_up.shape[0] <= FUSE_SILU_MAX_M:  # SiLU*mul + quantization inside the GEMM (off: slower)
            return w4a8_int8_gemm_triton(g, None, qweight, wscale, gscale, gzs, bias, inter, gsz, gate_up.dtype,
                                         up_offset=inter, tiled=tiled)
        from lowbit.kernels.act_quant import per_token_quant_triton

        xq, xs = per_token_quant_triton(g, torch.int8, fuse="silu_mul", up=u)
        return w4a8_int8_gemm_triton(xq, xs, qweight, wscale, gscale, gzs, bias, inter, gsz, gate_up.dtype,
                                     tiled=tiled)
    v = (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
    xq, xs = quantize_per_token(v, torch.int8)
    return gemm_ref(xq, xs, qweight, wscale, gscale, gzs, bias, gate_up.dtype, tiled)


@_w4a8_int8_silu_mul_linear.register_fake
def _(gate_up, qweight, wscale, gscale, gzs, bias, tiled=False):
    return gate_up.new_empty((gate_up.shape[0], qweight.shape[0]))


def w4a8_int8_silu_mul_linear(gate_up: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                              gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None = None, *,
                              tiled: bool = False) -> torch.Tensor:
    """Down projection of a gated MLP: ``gate_up`` [..., 2I] (gate = first I columns, up = last I)
    -> ``w4a8_int8_linear(silu(gate) * up, ...)`` [..., N] in gate_up's dtype, with HF LlamaMLP's
    rounding (SiLU rounded to the dtype, then the product): ``lowbit.kernels.act_quant``'s fused
    silu_mul quantization, then the GEMM. For M <= ``FUSE_SILU_MAX_M`` (0: off, measured slower)
    SiLU*mul and the quantization run inside the GEMM instead (one launch)."""
    check_tensor(gate_up, "gate_up", dtype=(torch.float16, torch.bfloat16))
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must have an even last dim (gate | up), got shape {list(gate_up.shape)}")
    lead = gate_up.shape[:-1]
    h = gate_up.reshape(-1, gate_up.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()
    _check_weight(h.shape[1] // 2, qweight, wscale, gscale, gzs, bias, gate_up.dtype, xname="gate_up's halves",
                  tiled=tiled)
    check_same_device(gate_up=gate_up, qweight=qweight, wscale=wscale, gscale=gscale, gzs=gzs, bias=bias)
    y = run_op(_w4a8_int8_silu_mul_linear, h, qweight, wscale, gscale, gzs, bias, bool(tiled))
    return y.reshape(*lead, qweight.shape[0])
