"""KV4: the INT4 KV-cache format, per token and per head (FireQ §1.6 / §2.1; QServe KV4).

One row = the ``head_dim`` (D, even) values of one token of one head, post-RoPE for keys.
Two numerics share the same byte layout so one paged cache serves both:

``kv4`` (FireQ, symmetric)::

    codes  uint8 [..., D/2]   signed INT4 in [-7, 7], two's complement nibbles, element 2i in the
                              low nibble of byte i (``lowbit.formats.int4`` packing)
    scale  [...]              float8_e4m3fn (default), bfloat16 or float32, one per row
    x  ~=  scale * code

``kv4-zp`` (QServe, asymmetric, ``zero_point=True``)::

    codes  uint8 [..., D/2]   unsigned INT4 in [0, 15], same packing
    scale  [...]              as above
    zero   uint8 [...]        integer zero point in [0, 15]
    x  ~=  scale * (code - zero)

The range quantized by ``kv4-zp`` is ``[min(x_min, 0), max(x_max, 0)]`` (it always contains 0, so
the integer zero point lies in [0, 15] and nothing is clipped; the usual GPTQ/QServe rule).

Scale rule (the FP8-scale decisions; the paper leaves them open, FireQ notes §7.3)
---------------------------------------------------------------------------------
``s = max(amax, AMAX_EPS) / qmax`` in float32 (qmax = 7 symmetric, 15 asymmetric), then stored in
``scale_dtype``:

* **FP8 E4M3 underflow.** E4M3's smallest subnormal is 2^-9; Lemma B.1: a row with
  ``amax < 7 * 2^-9`` would get scale 0 and the *whole token* would dequantize to 0 (and ``x/0``
  would give inf/NaN codes). We floor the scale at ``FP8_SCALE_MIN = 2^-9``: a tiny row keeps
  its (now coarse) codes, an all-zero row gives codes 0, never NaN.
* **Subnormal range rounds up.** Below 2^-6 (E4M3's smallest normal) the FP8 grid is the fixed
  step 2^-9, so round-to-nearest could shrink the scale by up to 33% (e.g. 1.49 * 2^-9 -> 2^-9)
  and clip ``amax / scale`` far past 7. There we round *up* to the next multiple of 2^-9 (exact
  in E4M3), so ``|x| / scale <= qmax`` and nothing clips. In the normal range we round to
  nearest even (relative error <= 1/16, so ``|x| / scale <= 7.44`` which still rounds to 7).
* **Asymmetric scales never clip** (``kv4-zp``, session 33). With ``qmax = 15`` a scale rounded to nearest can
  shrink by up to 1/16 (E4M3) or 2^-9 (bf16); with the zero point's own rounding the top code then clips. A random
  fuzz found it (an element 0.79 steps off); over random spans 13 % of the rows had an element more than half a
  step off (up to 1.4 steps). Rounding every scale up removes that but coarsens the grid of the other rows (rel-L2
  on N(0, 1) rows 0.105 instead of 0.101). So: round to nearest, and where that scale would clip
  (``rint(hi / s) + rint(-lo / s) > 15``; the bottom code is ``rint(lo / s) + rint(-lo / s) = 0`` by symmetry of
  half-even rounding) take the dtype's next value up instead (``round_scale(..., up=True)``: the exact ceiling on
  E4M3's 3-bit / bf16's 7-bit mantissa grid). Then ``(hi - lo) / scale <= 15`` there, and every element of every
  row is within half a step. float32 scales are kept as computed.
* **Codes use the stored scale**: ``code = rint(x / float(scale_stored))`` so dequantization
  with the stored scale is the best INT4 reconstruction for that scale (no double rounding).
* ``bfloat16`` / ``float32`` scales: floor ``AMAX_EPS / qmax`` (``lowbit.formats.common``), RNE.

**Non-finite rows.** A row with an Inf or a NaN gets a NaN scale (E4M3's 0x7F, bf16 / float32 NaN) and
arbitrary codes, so every attention output that reads the token is NaN, as in a float cache (the kernels' maxima
skip NaN, so they map NaN to +inf first and an infinite range to NaN: ``lowbit.kernels.act_quant.abs_or_inf``).

Integer rounding is round-half-to-even (``torch.round``; ``libdevice.rint`` in kernels); codes are
clamped to [-7, 7] (symmetric) or [0, 15] (asymmetric). Dequantization multiplies in float32
and casts to ``dtype``. This module is the ONE reference: the Triton append kernel
(``lowbit.kernels.kv4_append``), the decode kernel and the tests import it.

Bytes per token per head (K or V): D/2 codes + 1 (FP8 scale) [+ 1 zero point for ``kv4-zp``].
"""
from __future__ import annotations

import torch

from lowbit.formats.common import AMAX_EPS, FP8_E4M3, FP8_E4M3_MAX, div_ieee, inf_to_nan
from lowbit.formats.int4 import pack_int4, unpack_int4

__all__ = [
    "quantize_kv4", "dequantize_kv4", "round_scale", "ceil_to_grid", "FP8_SCALE_MIN", "FP8_NORMAL_MIN",
    "SCALE_DTYPES", "KV4_SYM_QMAX", "KV4_ASYM_QMAX", "kv4_bytes_per_row",
]

FP8_SCALE_MIN = 2.0 ** -9  # smallest E4M3 subnormal: scale floor (Lemma B.1)
FP8_NORMAL_MIN = 2.0 ** -6  # smallest E4M3 normal: below it the grid step is 2^-9
KV4_SYM_QMAX = 7.0
KV4_ASYM_QMAX = 15.0
SCALE_DTYPES = (FP8_E4M3, torch.bfloat16, torch.float32)


def ceil_to_grid(s: torch.Tensor, mant_bits: int) -> torch.Tensor:
    """Smallest value >= ``s`` (float32, > 0, normal) with ``mant_bits`` explicit mantissa bits: ``s = m * 2^e`` with m
    in [1, 2), m rounded up to a multiple of 2^-mant_bits (every step exact in float32)."""
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    step = float(2 ** (mant_bits + 1))
    return torch.ldexp(torch.ceil(mant * step) / step, exp)


def round_scale(s: torch.Tensor, scale_dtype: torch.dtype = FP8_E4M3, *, up: bool = False) -> torch.Tensor:
    """float32 scale ``s`` (> 0) -> stored scale in ``scale_dtype`` (rule in the module docstring); ``up``: to the
    next value of the dtype at or above ``s`` instead of the nearest (E4M3 / bf16; float32 unchanged)."""
    s = s.float()
    if scale_dtype == FP8_E4M3:
        s = s.clamp(FP8_SCALE_MIN, FP8_E4M3_MAX)
        sub = torch.ceil(s * 512.0) / 512.0  # multiples of 2^-9: exact E4M3 subnormals (and 2^-6)
        s = torch.where(s < FP8_NORMAL_MIN, sub, ceil_to_grid(s, 3) if up else s)
        return s.to(FP8_E4M3)
    if scale_dtype == torch.bfloat16 and up:
        return ceil_to_grid(s, 7).to(scale_dtype)
    if scale_dtype in (torch.bfloat16, torch.float32):
        return s.to(scale_dtype)
    raise ValueError(f"scale_dtype must be torch.float8_e4m3fn, torch.bfloat16 or torch.float32, got {scale_dtype}")


def quantize_kv4(x: torch.Tensor, *, zero_point: bool = False, scale_dtype: torch.dtype = FP8_E4M3):
    """Quantize rows of ``x`` [..., D] (D even; any float dtype) to KV4.

    Returns ``(codes uint8 [..., D/2], scale scale_dtype [...], zero uint8 [...] or None)``.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dim (head_dim), got shape {list(x.shape)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")
    xf = x.float()
    if not zero_point:
        amax = xf.abs().amax(dim=-1)
        amax = inf_to_nan(amax)  # a non-finite row: NaN scale
        scale = round_scale(div_ieee(amax.clamp_min(AMAX_EPS), KV4_SYM_QMAX), scale_dtype)
        q = torch.round(xf / scale.float().unsqueeze(-1)).clamp(-KV4_SYM_QMAX, KV4_SYM_QMAX)
        return pack_int4(q.to(torch.int8)), scale, None
    lo = xf.amin(dim=-1).clamp_max(0.0)
    hi = xf.amax(dim=-1).clamp_min(0.0)
    st = div_ieee((hi - lo).clamp_min(AMAX_EPS), KV4_ASYM_QMAX)
    st = inf_to_nan(st)  # a non-finite row: NaN scale
    sf = round_scale(st, scale_dtype).float()
    if scale_dtype != torch.float32:  # the nearest scale unless it clips the top code (module docstring)
        clip = torch.round(hi / sf) + torch.round(-lo / sf) > KV4_ASYM_QMAX
        sf = torch.where(clip, round_scale(st, scale_dtype, up=True).float(), sf)
    scale = sf.to(scale_dtype)
    zero = torch.round(-lo / sf).clamp(0.0, KV4_ASYM_QMAX)
    q = (torch.round(xf / sf.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0.0, KV4_ASYM_QMAX)
    return pack_int4(q.to(torch.uint8)), scale, zero.to(torch.uint8)


def dequantize_kv4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, *,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """KV4 codes [..., D/2] + scale [...] (+ zero [...]) -> [..., D] in ``dtype`` (float32 math)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if scale.shape != codes.shape[:-1]:
        raise ValueError(f"scale must have shape {list(codes.shape[:-1])}, got {list(scale.shape)}")
    s = scale.float().unsqueeze(-1)
    if zero is None:
        return (unpack_int4(codes, signed=True).float() * s).to(dtype)
    if zero.shape != scale.shape:
        raise ValueError(f"zero must have shape {list(scale.shape)}, got {list(zero.shape)}")
    q = unpack_int4(codes, signed=False).float() - zero.float().unsqueeze(-1)
    return (q * s).to(dtype)


def kv4_bytes_per_row(head_dim: int, *, zero_point: bool = False,
                      scale_dtype: torch.dtype = FP8_E4M3) -> int:
    """Stored bytes for one token of one head (K or V): codes + scale (+ zero point)."""
    return head_dim // 2 + torch.empty((), dtype=scale_dtype).element_size() + (1 if zero_point else 0)
