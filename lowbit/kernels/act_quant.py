"""Per-token activation quantization (FP8 E4M3 or INT8) in one Triton kernel, optionally fused
with the op that produces the activation (FireQ §3.1 "re-quantization on CUDA cores").

Math (per row ``m`` of ``v``, the value to quantize; the numerics of
``lowbit.formats.common.quantize_per_token``)::

    amax_m  = max_k |v[m, k]|                    (fp32)
    scale_m = max(amax_m, AMAX_EPS) / QMAX       (fp32; QMAX = 448 for FP8 E4M3, 127 for INT8)
    q[m, k] = cast(clamp(v[m, k] / scale_m, -QMAX, QMAX))   FP8: RNE cast; INT8: round half-even

The quotient is the IEEE round-to-nearest ``v / scale_m``, so the kernel agrees with the PyTorch
reference bit for bit: on the GPU (``FAST``) by Markstein's correction from the row's correctly
rounded reciprocal (three FP ops per element, ``div_fast``) and the hardware RNE FP8 convert; under
the interpreter (whose FMA rounds twice and whose FP8 cast mis-rounds) by ``tl.div_rn`` and an
arithmetic FP8 rounding (which keeps the sign of a zero code, like the hardware convert and the
reference; session 10: before, tiny negatives gave +0 there and a random test failed for some seeds).

``v`` is, by the constexpr flag ``FUSE``:

- ``0`` plain: ``v = x``;
- ``1`` RMSNorm (HF Llama numerics): ``h = (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)``,
  ``v = (w * h).to(dtype)``, i.e. ``quantize(LlamaRMSNorm(x))``;
- ``2`` SiLU-mul: ``v = (silu(g).to(dtype) * u).to(dtype)``, i.e. ``quantize(act(gate) * up)``
  as HF's ``LlamaMLP`` computes it before ``down_proj``.

``ADD`` (with ``FUSE = 1``; ``add=``): the residual add before the norm, ``x <- (x + d).to(dtype)``
(torch's half-precision add, bit for bit), and the sum is also stored (the new residual stream):
one launch instead of an add launch followed by the norm (vLLM's fused_add_rms_norm pattern).

NaN or Inf anywhere in a row gives that row a NaN scale, so the row's GEMM output is NaN (the GPU's
``max`` would otherwise skip NaN silently); the reference propagates NaN/Inf the same way. One
reduction finds both: NaN counts as +inf in the row maximum, and an infinite maximum means NaN.

Layout: rows are the flattened leading dims (row stride given, last dim contiguous); any K (not
only powers of two) and any number of rows. One program per row. A row of up to ``_SINGLE_MAX``
elements is held in registers (one read of HBM); longer rows are walked in chunks (the second and
third walks hit L2). Output: q ``[M, K]`` (dtype), scale ``[M]`` float32.

``PDL`` (programmatic dependent launch, Hopper; ``pdl=True``): the kernel is launched with the
programmatic-stream-serialization attribute, waits for the previous kernel in the stream
(``griddepcontrol.wait``, which also makes its writes visible) before touching memory, then lets the
next PDL kernel (the w4a8-fp8 GEMM) launch while it runs, so that kernel's launch and set-up overlap
this one. Same numerics. Default ``PDL_DEFAULT`` (off until measured on the device).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from lowbit._utils import check_rows, check_same_device, check_tensor, cuda_major, interpret_mode
from lowbit.formats.common import AMAX_EPS, FP8_E4M3, QMAX

PDL_DEFAULT = os.environ.get("LOWBIT_PDL", "0") == "1"


def pdl_enabled(t: torch.Tensor, pdl: bool | None = None) -> bool:
    """PDL launch for tensors on ``t``'s device: Hopper or newer, not under the interpreter."""
    want = PDL_DEFAULT if pdl is None else bool(pdl)
    return want and t.is_cuda and not interpret_mode() and cuda_major(t.device) >= 9


@triton.jit
def pdl_prologue(PDL: tl.constexpr, TRIGGER: tl.constexpr = True):
    """With ``PDL``: wait for the previous grid (and its writes), then (``TRIGGER``) allow the next
    one to launch at once. Without the trigger the next PDL kernel launches when this grid ends (the
    implicit trigger), so its programs do not sit on SMs waiting while this one runs."""
    if PDL:
        gdc_wait()
        if TRIGGER:
            gdc_launch_dependents()

_SINGLE_MAX = 16384  # largest row held in registers in one piece


def default_warps(M: int, block: int) -> int:
    """Warps per program (one program per row) for a row block of ``block`` elements."""
    return 1 if block <= 512 else 4 if block <= 4096 else 8 if block <= 8192 else 16


@triton.jit
def round16(v, DT: tl.constexpr, EMU: tl.constexpr):
    """fp32 ``v`` rounded to the 16-bit ``DT`` (nearest, ties to even), as fp32. ``EMU`` and bf16: the rounding
    done on the bit pattern (Triton 3.6's interpreter truncates fp32 -> bf16 casts), else the cast."""
    if EMU and DT == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    else:
        return v.to(DT).to(tl.float32)


@triton.jit
def _load_x(X, D, offs, mask, ADD: tl.constexpr):
    """x at ``offs`` of one row, in x's dtype; with ``ADD`` the residual-stream sum ``x + d`` rounded
    to x's dtype (torch's half-precision add: the fp32 sum of two fp16/bf16 values, rounded once)."""
    x = tl.load(X + offs, mask=mask, other=0.0)
    if ADD:
        s = x.to(tl.float32) + tl.load(D + offs, mask=mask, other=0.0).to(tl.float32)
        x = round16(s, x.dtype, True).to(x.dtype)  # (bf16: on the bit pattern, GPU too)
    return x


@triton.jit
def _fused_value(x, G, W, offs, mask, rstd, FUSE: tl.constexpr):
    """The value to quantize at ``offs`` of one row, in fp32 (rounded like the eager model), from the
    row's values ``x`` there (``_load_x``)."""
    # Products of two fp16/bf16 values are exact in fp32, so "multiply in fp32, round to the input
    # dtype" equals the eager half-precision multiply (and the interpreter, which has no bf16
    # arithmetic, gets it right too).
    if FUSE == 1:
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
        v = (w * h).to(x.dtype).to(tl.float32)
    elif FUSE == 2:
        v = silu_mul_rounded(x, tl.load(G + offs, mask=mask, other=0.0).to(tl.float32))
    else:
        v = x.to(tl.float32)
    return v


@triton.jit
def silu_mul_rounded(x, u, EMU: tl.constexpr = False):
    """``silu(x) * u`` as fp32, each intermediate rounded to x's dtype like the eager half-precision
    model (``u`` fp32 holding values of x's dtype; ``EMU``: ``round16``'s interpreter rounding)."""
    xf = x.to(tl.float32)
    a = round16(xf / (1.0 + tl.exp(-xf)), x.dtype, EMU)
    return round16(a * u, x.dtype, EMU)


@triton.jit
def round_to_fp8_e4m3(y):
    """fp32 ``y`` (already within +-448) rounded to the nearest E4M3 value (ties to even), as fp32.

    The E4M3 spacing near ``y`` is ``u = 2^(max(e, -6) - 3)`` (e = binary exponent of y; -6 is the
    smallest normal exponent, below it the subnormal spacing 2^-9); adding and subtracting
    ``1.5 * 2^23 * u`` makes the fp32 adder round to a multiple of ``u`` with ties to even. The
    result is exactly representable, so the following cast to FP8 is exact. The hardware cast
    already rounds like this; the arithmetic exists because Triton 3.6's interpreter mis-rounds
    fp32->fp8 when the carry crosses a binade (126.8 -> 64), and it costs a few ALU ops per
    element in a memory-bound kernel. A result of zero keeps y's sign (``y * 0``), like the
    hardware cast (tiny negatives give -0; the adder alone gives +0).
    """
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6) - 3
    u = ((e + 127) << 23).to(tl.float32, bitcast=True)
    c = u * 12582912.0
    r = (y + c) - c
    return tl.where(r == 0.0, y * 0.0, r)


@triton.jit
def _quant_store(Q, offs, mask, v, scale, rcp, QMAX: tl.constexpr, IS_INT8: tl.constexpr, FAST: tl.constexpr):
    """Store ``round(clamp(v / scale))``. ``FAST`` (GPU): the quotient by Markstein's correction
    from the row's correctly rounded reciprocal ``rcp`` (3 FP ops per element instead of div.rn's
    ~10 with its slow-path branch; RN(v / scale) exactly, see ``div_fast``) and FP8 by the hardware
    RNE convert. Without ``FAST`` (interpreter): ``div_rn`` and the arithmetic FP8 rounding."""
    if FAST:
        y = div_fast(v, scale, rcp)
    else:
        y = tl.div_rn(v, scale)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT8:
        # round half to even: adding and subtracting 1.5 * 2^23 leaves the fp32 value rounded to an
        # integer by the FPU's RNE (|y| <= 127); same result as rint, and the interpreter runs it
        r = (y + 12582912.0) - 12582912.0
        tl.store(Q + offs, r.to(tl.int8), mask=mask)
    elif FAST:
        tl.store(Q + offs, y.to(Q.dtype.element_ty), mask=mask)
    else:
        tl.store(Q + offs, round_to_fp8_e4m3(y).to(Q.dtype.element_ty), mask=mask)


@triton.jit
def div_fast(v, scale, rcp):
    """RN(v / scale) from rcp = RN(1 / scale) in three FP ops: q0 = RN(v * rcp) is within about an
    ulp of the quotient (wrong in ~26% of cases on its own), one FMA gives the remainder
    r = RN(v - q0 * scale), and RN(q0 + r * rcp) is the correctly rounded quotient (Markstein's
    correction step; Markstein 1990, and the FMA-division chapter of Muller et al., Handbook of
    Floating-Point Arithmetic). Checked against IEEE fp32 division on 10M values spanning the
    activation range (exact emulation in float64: tests/test_act_quant.py, and on the GPU). Tiny
    |v| (< 2^-100, where r could underflow) has a quotient < 2^-51 since scale >= AMAX_EPS / QMAX:
    a zero code either way (the smallest nonzero FP8 code is 2^-9)."""
    q0 = v * rcp
    r = tl.fma(-q0, scale, v)
    return tl.fma(r, rcp, q0)


@triton.jit
def abs_or_inf(v):
    """``|v|`` with NaN as +inf, the operand of every quantizer's maximum in lowbit: the GPU's (and the
    interpreter's) ``max`` skips NaN, +inf survives it. ``amax_floor`` then turns an infinite maximum
    (an Inf or a NaN among the inputs) into a NaN scale, so the non-finite input reaches the output
    that uses the scale instead of becoming an arbitrary finite code."""
    return tl.where(v == v, tl.abs(v), float("inf"))


@triton.jit
def amax_floor(amax, amax_eps):
    """``max(amax, amax_eps)`` (the scale rule's floor, before the division by QMAX that each kernel
    does its own way) of a maximum of ``abs_or_inf`` values; an infinite ``amax`` gives NaN."""
    amax = tl.where(amax == float("inf"), float("nan"), amax)
    return tl.maximum(amax, amax_eps, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_scale(v, amax_eps, QMAX: tl.constexpr):
    """(scale, rcp) of a row from its values (or per-lane ``abs_or_inf`` maxima) ``v``: one
    reduction; an Inf or NaN in the row gives a NaN scale, so the row's GEMM output is NaN."""
    scale = tl.div_rn(amax_floor(tl.max(abs_or_inf(v), axis=0), amax_eps), QMAX)
    return scale, tl.div_rn(1.0, scale)


@triton.jit
def _rstd_chunked(Xr, K, eps, offs, BLOCK_K: tl.constexpr, FUSE: tl.constexpr, Dr=None, Rr=None,
                  ADD: tl.constexpr = False):
    """RMSNorm's 1 / sqrt(mean(x^2) + eps) of a row walked in BLOCK_K chunks (FUSE == 1), else 1.
    With ``ADD`` x is the sum ``x + d``, stored to ``Rr`` on this walk (the later walks add again rather
    than read ``Rr`` back: no barrier between this program's stores and loads is needed)."""
    rstd = 1.0
    if FUSE == 1:
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = (k0 + offs) < K
            xs = _load_x(Xr, Dr, k0 + offs, m, ADD)
            if ADD:
                tl.store(Rr + k0 + offs, xs, mask=m)
            x = xs.to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)
    return rstd


@triton.jit
def _per_token_quant_kernel(
    X, G, W, Q, S,  # pointers: input, up (FUSE=2), norm weight (FUSE=1), codes, scales
    K, eps, amax_eps,  # sizes / scalars
    stride_xm, stride_gm, stride_qm,  # row strides (last dim contiguous)
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, FUSE: tl.constexpr,
    BLOCK_K: tl.constexpr, SINGLE: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr = False,
    QUANT: tl.constexpr = True,  # False: store the fused value in Q's (float) dtype, no scale
    D=None, R=None, stride_dm=0, stride_rm=0,  # ADD: the update d added to x, the sum's output
    ADD: tl.constexpr = False,  # FUSE == 1 only: normalize x + d, and store x + d to R
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    Xr = X + row * stride_xm
    Gr = G + row * stride_gm
    Qr = Q + row * stride_qm
    Dr = D
    Rr = R
    if ADD:
        Dr = D + row * stride_dm
        Rr = R + row * stride_rm
    offs = tl.arange(0, BLOCK_K)
    if SINGLE:
        mask = offs < K
        rstd = 1.0
        xs = _load_x(Xr, Dr, offs, mask, ADD)  # the row, loaded (and summed) once
        if ADD:
            tl.store(Rr + offs, xs, mask=mask)
        if FUSE == 1:
            x = xs.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
        v = _fused_value(xs, Gr, W, offs, mask, rstd, FUSE)
        if QUANT:
            scale, rcp = _row_scale(v, amax_eps, QMAX)
            _quant_store(Qr, offs, mask, v, scale, rcp, QMAX, IS_INT8, FAST)
        else:
            tl.store(Qr + offs, v.to(Q.dtype.element_ty), mask=mask)
    elif not QUANT:
        rstd = _rstd_chunked(Xr, K, eps, offs, BLOCK_K, FUSE, Dr, Rr, ADD)
        for k0 in range(0, K, BLOCK_K):
            m = (k0 + offs) < K
            v = _fused_value(_load_x(Xr, Dr, k0 + offs, m, ADD), Gr, W, k0 + offs, m, rstd, FUSE)
            tl.store(Qr + k0 + offs, v.to(Q.dtype.element_ty), mask=m)
    else:
        rstd = _rstd_chunked(Xr, K, eps, offs, BLOCK_K, FUSE, Dr, Rr, ADD)
        amax_v = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = (k0 + offs) < K
            v = _fused_value(_load_x(Xr, Dr, k0 + offs, m, ADD), Gr, W, k0 + offs, m, rstd, FUSE)
            amax_v = tl.maximum(amax_v, abs_or_inf(v))
        scale, rcp = _row_scale(amax_v, amax_eps, QMAX)
        for k0 in range(0, K, BLOCK_K):
            m = (k0 + offs) < K
            v = _fused_value(_load_x(Xr, Dr, k0 + offs, m, ADD), Gr, W, k0 + offs, m, rstd, FUSE)
            _quant_store(Qr, k0 + offs, m, v, scale, rcp, QMAX, IS_INT8, FAST)
    if QUANT:
        tl.store(S + row, scale)


_FUSE = {None: 0, "rmsnorm": 1, "silu_mul": 2}


def _row_operands(x, fuse, weight, up):
    """Checked kernel operands: ``x`` as rows ``[M, K]`` (unit stride along K), the second input
    (``up`` rows for 'silu_mul', else x again) and the norm weight (for 'rmsnorm', else x again)."""
    check_rows(x)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    g2, w = x2, x2
    if fuse == "rmsnorm":
        check_tensor(weight, "weight", dtype=x.dtype, shape=(K,))
        w = weight.contiguous()
    elif fuse == "silu_mul":
        check_tensor(up, "up", dtype=x.dtype, shape=tuple(x.shape))
        g2 = up.reshape(-1, K)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
    check_same_device(x=x, weight=w, up=g2)
    return x2, g2, w


def _add_operands(x, x2, add, fuse):
    """Rows ``[M, K]`` of ``add`` (shaped like ``x``) and a fresh ``[M, K]`` buffer for ``x + add``."""
    if fuse != "rmsnorm":
        raise ValueError(f"add= (the residual update) needs fuse='rmsnorm', got fuse={fuse!r}")
    check_tensor(add, "add", dtype=x.dtype, shape=tuple(x.shape))
    d2 = add.reshape(-1, x2.shape[1])
    if d2.stride(-1) != 1:
        d2 = d2.contiguous()
    return d2, torch.empty(x2.shape, dtype=x.dtype, device=x.device)


def _launch_rows(x2, g2, w, out, s, fuse, eps, qdtype, *, num_warps=None, fast=False, pdl=None,
                 add=None) -> None:
    """One program per row of ``x2 [M, K]``: quantized codes to ``out`` and scales to ``s`` for
    ``qdtype`` FP8 / INT8, or (``qdtype`` None) the fused float value to ``out`` (``QUANT=False``).
    ``add``: ``(d2, r2)``: the row value is ``x2 + d2`` (rounded to x's dtype), also stored to ``r2``."""
    M, K = x2.shape
    single = K <= _SINGLE_MAX
    block = triton.next_power_of_2(K) if single else 4096
    quant = qdtype is not None
    _per_token_quant_kernel[(M,)](
        x2, g2, w, out, s if quant else out,
        K, float(eps), AMAX_EPS,
        x2.stride(0), g2.stride(0), out.stride(0),
        QMAX=QMAX[qdtype] if quant else 448.0, IS_INT8=qdtype == torch.int8, FUSE=_FUSE[fuse],
        BLOCK_K=block, SINGLE=single, FAST=fast and quant, num_warps=num_warps or default_warps(M, block),
        **({} if quant else {"QUANT": False}),  # the quantizing launch keeps its measured signature
        **({} if add is None else {"D": add[0], "R": add[1], "stride_dm": add[0].stride(0),
                                   "stride_rm": add[1].stride(0), "ADD": True}),
        **({"PDL": True, "launch_pdl": True} if pdl_enabled(x2, pdl) else {}),
    )


def per_token_quant_triton(x: torch.Tensor, dtype: torch.dtype = FP8_E4M3, *, fuse: str | None = None,
                           weight: torch.Tensor | None = None, eps: float = 1e-6,
                           up: torch.Tensor | None = None, num_warps: int | None = None,
                           fast: bool | None = None, pdl: bool | None = None,
                           add: torch.Tensor | None = None):
    """Quantize each row of ``x`` ``[..., K]`` to ``dtype`` (FP8 E4M3 or INT8).

    Returns (q ``[..., K]`` dtype, scale ``[...]`` float32). ``fuse='rmsnorm'`` quantizes
    ``RMSNorm(x) * weight`` (``weight [K]``, ``eps``); ``fuse='silu_mul'`` quantizes
    ``silu(x) * up`` (``up`` shaped like ``x``). See the module docstring for the rounding.
    ``add`` (with ``fuse='rmsnorm'``; shaped like ``x``): the residual add before the norm, fused:
    the row is ``r = x + add`` (torch's rounding), and the call returns ``(q, scale, r)``.
    ``num_warps`` / ``fast`` (benchmarks, tests): override ``default_warps`` / the GPU fast path
    (``FAST``: Markstein division and the hardware FP8 convert; off under the interpreter).
    ``pdl``: programmatic dependent launch (module docstring; default ``PDL_DEFAULT``).
    """
    if dtype not in QMAX:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.int8, got {dtype}")
    if fuse not in _FUSE:
        raise ValueError(f"fuse must be one of None, 'rmsnorm', 'silu_mul', got {fuse!r}")
    x2, g2, w = _row_operands(x, fuse, weight, up)
    ad = None if add is None else _add_operands(x, x2, add, fuse)
    M, K = x2.shape
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M and K:
        fast = (x.is_cuda and not interpret_mode()) if fast is None else bool(fast)
        _launch_rows(x2, g2, w, q, s, fuse, eps, dtype, num_warps=num_warps, fast=fast, pdl=pdl, add=ad)
    elif M:
        s.fill_(AMAX_EPS / QMAX[dtype])
    if ad is not None:
        return q.reshape(x.shape), s.reshape(x.shape[:-1]), ad[1].reshape(x.shape)
    return q.reshape(x.shape), s.reshape(x.shape[:-1])


def fused_rows_triton(x: torch.Tensor, *, fuse: str, weight: torch.Tensor | None = None, eps: float = 1e-6,
                      up: torch.Tensor | None = None, pdl: bool | None = None, add: torch.Tensor | None = None):
    """The fused value of ``per_token_quant_triton`` without the quantization, in ``x``'s dtype, one
    launch: ``fuse='rmsnorm'`` -> ``RMSNorm(x) * weight`` (HF Llama numerics), ``fuse='silu_mul'`` ->
    ``silu(x) * up`` (each intermediate rounded to x's dtype, as the eager model). ``add`` (rmsnorm
    only): normalize ``r = x + add`` and return ``(RMSNorm(r) * weight, r)``. For the runner's
    float (weight-only) projections, which take these activations unquantized. Not bit-equal to the
    eager modules on the GPU: SiLU's ``tl.exp`` is the fast exp, and session-8 device runs (H200, H100) showed
    SiLU*mul values 1-2 ulps of x's dtype apart (within the quantization step when the value is
    quantized next, as in ``per_token_quant_triton``; tested to two ulps here)."""
    if fuse not in ("rmsnorm", "silu_mul"):
        raise ValueError(f"fuse must be 'rmsnorm' or 'silu_mul', got {fuse!r}")
    x2, g2, w = _row_operands(x, fuse, weight, up)
    ad = None if add is None else _add_operands(x, x2, add, fuse)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        _launch_rows(x2, g2, w, y, None, fuse, eps, None, pdl=pdl, add=ad)
    if ad is not None:
        return y.reshape(x.shape), ad[1].reshape(x.shape)
    return y.reshape(x.shape)
