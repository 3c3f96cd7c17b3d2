"""Fused rotary position embedding (RoPE) of query/key heads with transformers' half-precision rounding.

The runner (``lowbit.models.generate``) rotates the query heads of every layer (and, without a
KV4 cache, the key heads) once per step. Eagerly that is transformers' ``x * cos +
rotate_half(x) * sin`` = four launches (a cat and three elementwise ops) per tensor; at decode they
are latency-bound (~7 us per layer for q alone on the H200, R11 profile). This kernel does it in one
launch for any number of heads, with the same bits:

    out[d] = round(round(x[d] * cos[d]) + round(rot[d] * sin[d]))
    rot[d] = -x[d + D/2]  (d < D/2),   x[d - D/2]  (d >= D/2)          (half-split pairs, HF Llama)

``round`` = to the input dtype (bf16 / fp16), ties to even. A product of two bf16 or fp16 values
is exact in fp32, and so is the rounding of the fp32 sum to the input dtype, which is exactly what
each eager half-precision op computes (fp32 math, one rounding per op); negation is exact, so the
sign can sit on ``rot``. fp32 inputs are not handled here (an fp32 mul + add may be contracted to
an FMA on the GPU, which rounds once): the caller keeps the eager ops for them.

Layouts: x ``[B, S, H, D]`` with unit stride on D (any other strides, e.g. a slice of the fused
q/k/v projection output); cos, sin ``[B or 1, S, D]`` (transformers' layout, ``cos[..., i] ==
cos[..., i + D/2]``), unit stride on D; out ``[B, S, H, D]`` dense, in x's dtype. One program per
(token, block of ``_BLOCK_H`` heads); each row is read twice (as x and, rotated, as rot; the
second read hits L1), cos/sin once per program. Memory-bound at prefill, launch-bound at decode.

``PDL`` (Hopper, ``lowbit.kernels.act_quant.PDL_DEFAULT``): launched as a programmatic dependent
launch, the kernel waits for the previous grid before its first load and lets the next PDL kernel
launch at once (``act_quant.pdl_prologue``); same numerics.

Rounding (``_round``): bf16 in integer arithmetic (round-half-even, as ``lowbit.kernels.kv4_append``;
the interpreter's fp32 -> bf16 cast truncates), fp16 by an inline PTX round trip on the GPU.

``NORM`` (session 37, Qwen3's per-head ``q_norm`` / ``k_norm`` before RoPE, ``qk_norm=``): each head row
is first RMS-normalised with transformers' ``Qwen3RMSNorm`` arithmetic,

    x[d] <- round(w[d] * round(x[d] * rsqrt(mean_d(x^2) + eps)))       (fp32 mean and rsqrt)

with ``w`` = the q weight for heads ``< HQ`` and the k weight from there (q and k rotated in one launch;
``norm_args`` builds the arguments for every kernel that takes ``qk_norm``), and only heads ``< H_ROT`` are then rotated (the rest, keys whose RoPE a KV4 append does, are stored
normalised). The sum of squares runs in a different order from torch's reduction and ``rsqrt`` is the
GPU's approximation in both (torch's and Triton's need not be the same one), so the inner rounding of an
element can flip, and the weight scales that flip: at most two ulps of the input dtype from the eager modules
(tested; almost all equal). Eagerly these norms are eight launches per tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import interpret_mode
from lowbit.kernels.act_quant import pdl_enabled, pdl_prologue

# heads per program: 8 x 128 values = 8 per thread of 4 warps (short per-thread chains for the
# latency-bound decode step, B * S * H / 8 programs at prefill)
_BLOCK_H = 8


@triton.jit
def _round(x, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> the input dtype (bf16 if ``BF16`` else fp16), ties to even, returned as fp32.

    Done opaquely: bf16 by integer arithmetic (round-half-even on the bit pattern; also what the
    interpreter needs, its cast truncates), fp16 by an inline ``cvt.rn.f16.f32`` round trip on the
    GPU. R12: with plain ``.to(dtype).to(float32)`` casts the GPU results differed from the eager ops
    by one ulp in some elements (bf16 and fp16), while the interpreter matched: the compiler must not
    see a float round trip it may fold or contract into the neighbouring multiply-add."""
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    if INTERPRET:
        return x.to(tl.float16).to(tl.float32)
    return tl.inline_asm_elementwise("{ .reg .b16 h; cvt.rn.f16.f32 h, $1; cvt.f32.f16 $0, h; }", "=f,f", [x],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def rope_values(x, r, c, sn, low, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """``x * cos + rotate(x) * sin`` with the rounding of the module docstring, on fp32 values: x, its pair partner
    ``r`` (element ``(d + D/2) % D``), cos, sin; ``low`` = d < D/2 (where the partner enters negated). The one
    definition of this numerics: the rope kernel, ``rope_row`` and ``rope_tile`` call it."""
    rot = tl.where(low, -r, r)
    return _round(_round(x * c, BF16, INTERPRET) + _round(rot * sn, BF16, INTERPRET), BF16, INTERPRET)


@triton.jit
def rms_pair(x, r, ss, w, wr, eps, D: tl.constexpr, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """``NORM`` (module docstring): values ``x`` and their pair partners ``r`` of rows whose sum of squares is ``ss``
    (one per row, broadcast against x), weights ``w`` / ``wr`` at x's / r's channels -> (x, r) RMS-normalised with
    transformers' two roundings. The one definition of this numerics (the rope kernel, ``rope_row``, ``rope_tile``,
    ``lowbit.kernels.kv4_append``)."""
    rstd = tl.math.rsqrt(ss / D + eps)
    return (_round(w * _round(x * rstd, BF16, INTERPRET), BF16, INTERPRET),
            _round(wr * _round(r * rstd, BF16, INTERPRET), BF16, INTERPRET))


@triton.jit
def rope_row(X, O, COS, SIN, D: tl.constexpr, BF16: tl.constexpr, INTERPRET: tl.constexpr,
             W=None, eps=0.0, NORM: tl.constexpr = False):
    """One head row: ``O[d] = rope(X)[d]`` with the rounding of the module docstring (X, O, COS, SIN
    point at the row's first element, unit stride); ``NORM``: RMS-normalised first with weight ``W [D]``. Used by
    ``lowbit.kernels.kv4_append``'s ``ROPE_Q`` (the query heads rotated in the KV append launch) and float pages."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    x = tl.load(X + d).to(tl.float32)
    r = tl.load(X + (d + HALF) % D).to(tl.float32)
    c = tl.load(COS + d).to(tl.float32)
    sn = tl.load(SIN + d).to(tl.float32)
    if NORM:
        x, r = rms_pair(x, r, tl.sum(x * x, axis=0), tl.load(W + d).to(tl.float32),
                        tl.load(W + (d + HALF) % D).to(tl.float32), eps, D, BF16, INTERPRET)
    tl.store(O + d, rope_values(x, r, c, sn, d < HALF, BF16, INTERPRET).to(O.dtype.element_ty))


@triton.jit
def rope_tile(X, r_off, d, rmask, COS, SIN, c_off, D: tl.constexpr, BF16: tl.constexpr, INTERPRET: tl.constexpr,
              W=None, eps=0.0, NORM: tl.constexpr = False):
    """Rows ``X + r_off[:, None] + d`` rotated (cos / sin rows at ``c_off``), returned as fp32 holding values of the
    input dtype; masked rows 0; ``NORM``: each row RMS-normalised first with weight ``W [D]``. Used by
    ``lowbit.kernels.decode_float``'s ``APPEND`` (q and the new keys)."""
    HALF: tl.constexpr = D // 2
    x = tl.load(X + r_off[:, None] + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    r = tl.load(X + r_off[:, None] + ((d + HALF) % D)[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    c = tl.load(COS + c_off[:, None] + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    sn = tl.load(SIN + c_off[:, None] + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if NORM:
        x, r = rms_pair(x, r, tl.sum(x * x, axis=1)[:, None], tl.load(W + d).to(tl.float32)[None, :],
                        tl.load(W + (d + HALF) % D).to(tl.float32)[None, :], eps, D, BF16, INTERPRET)
    return rope_values(x, r, c, sn, d[None, :] < HALF, BF16, INTERPRET)


@triton.jit
def _rope_kernel(
    # pointers
    X, COS, SIN, OUT,
    # sizes
    S, H,
    # strides
    stride_xb, stride_xs, stride_xh, stride_cb, stride_cs, stride_ob, stride_os, stride_oh,
    # constexpr
    D: tl.constexpr, BLOCK_H: tl.constexpr, BF16: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
    # NORM (``norm_args``): q weight QW on heads < HQ, k weight KW from there; heads >= H_ROT not rotated
    QW=None, KW=None, eps=0.0, HQ=0, H_ROT=0, NORM: tl.constexpr = False,
):
    pdl_prologue(PDL)  # PDL launch: wait for the producer of x (the q/k/v GEMM) before any load
    pid = tl.program_id(0)
    b = pid // S
    s = pid % S
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    HALF: tl.constexpr = D // 2
    hmask = (h < H)[:, None]
    x_row = X + b.to(tl.int64) * stride_xb + s.to(tl.int64) * stride_xs + h[:, None] * stride_xh
    x = tl.load(x_row + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    r = tl.load(x_row + ((d + HALF) % D)[None, :], mask=hmask, other=0.0).to(tl.float32)
    c_off = b.to(tl.int64) * stride_cb + s.to(tl.int64) * stride_cs + d
    c = tl.load(COS + c_off).to(tl.float32)
    sn = tl.load(SIN + c_off).to(tl.float32)
    if NORM:  # the q weight on heads < HQ, the k weight from there
        is_q = (h < HQ)[:, None]
        w = tl.where(is_q, tl.load(QW + d).to(tl.float32)[None, :], tl.load(KW + d).to(tl.float32)[None, :])
        wr = tl.where(is_q, tl.load(QW + (d + HALF) % D).to(tl.float32)[None, :],
                      tl.load(KW + (d + HALF) % D).to(tl.float32)[None, :])
        x, r = rms_pair(x, r, tl.sum(x * x, axis=1)[:, None], w, wr, eps, D, BF16, INTERPRET)
    y = rope_values(x, r, c[None, :], sn[None, :], (d < HALF)[None, :], BF16, INTERPRET)
    if NORM:
        y = tl.where((h < H_ROT)[:, None], y, x)  # heads past H_ROT: normalised, not rotated
    o_row = OUT + b.to(tl.int64) * stride_ob + s.to(tl.int64) * stride_os + h[:, None] * stride_oh
    tl.store(o_row + d[None, :], y.to(OUT.dtype.element_ty), mask=hmask)


def rope_supported(x: torch.Tensor) -> bool:
    """Inputs this kernel takes: bf16 / fp16, power-of-two head_dim >= 16, unit stride on D."""
    D = x.shape[-1]
    return (x.dtype in (torch.bfloat16, torch.float16) and x.ndim == 4 and D >= 16 and not D & (D - 1)
            and x.stride(-1) == 1)


def norm_args(qk_norm, x: torch.Tensor, where: str) -> dict:
    """The ``NORM`` kernel arguments of ``qk_norm = (w_q, w_k, eps)`` (weights ``[D]`` in x's dtype and device,
    D = x's last dim; ValueError naming ``where`` otherwise), or {} for None. Shared by this module's launcher,
    ``lowbit.kernels.kv4_append`` and ``lowbit.kernels.decode_float``."""
    if qk_norm is None:
        return {}
    w_q, w_k, eps = qk_norm
    D = x.shape[-1]
    for name, w in (("w_q", w_q), ("w_k", w_k)):
        if w.shape != (D,) or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{where}: qk_norm {name} must be [{D}] {x.dtype} on {x.device}, got {tuple(w.shape)} "
                             f"{w.dtype} on {w.device}")
    return dict(QW=w_q.contiguous(), KW=w_k.contiguous(), eps=float(eps), NORM=True)


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None, *,
                pdl: bool | None = None, qk_norm: tuple | None = None, q_heads: int | None = None,
                rotate_heads: int | None = None) -> torch.Tensor:
    """Half-split RoPE of ``x [B, S, H, D]`` (module docstring) -> dense ``out [B, S, H, D]``.
    ``pdl``: programmatic dependent launch as ``lowbit.kernels.act_quant`` (None = its ``PDL_DEFAULT``).
    ``qk_norm = (w_q, w_k, eps)`` (``norm_args``): ``NORM`` first, ``w_q`` on heads ``< q_heads`` (default all),
    ``w_k`` on the rest; ``rotate_heads``: rotate only heads ``< rotate_heads`` (with ``qk_norm``; default all)."""
    if not rope_supported(x):
        raise ValueError(f"rope_triton takes bf16/fp16 x [B, S, H, D] with a power-of-two D and unit stride on D, "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    B, S, H, D = x.shape
    if cos.shape != sin.shape or cos.ndim != 3 or cos.shape[1:] != (S, D) or cos.shape[0] not in (1, B):
        raise ValueError(f"cos/sin must be [1 or {B}, {S}, {D}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    norm = norm_args(qk_norm, x, "rope_triton")
    if norm:
        norm.update(HQ=H if q_heads is None else int(q_heads), H_ROT=H if rotate_heads is None else int(rotate_heads))
    elif rotate_heads is not None or q_heads is not None:
        raise ValueError("rope_triton: rotate_heads needs qk_norm, as does q_heads (without it every head is rotated)")
    if out is None:
        out = torch.empty(B, S, H, D, device=x.device, dtype=x.dtype)
    if B * S * H == 0:
        return out
    block_h = min(triton.next_power_of_2(H), _BLOCK_H)
    grid = (B * S, triton.cdiv(H, block_h))
    _rope_kernel[grid](
        x, cos, sin, out,
        S, H,
        x.stride(0), x.stride(1), x.stride(2), 0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        D=D, BLOCK_H=block_h, BF16=x.dtype == torch.bfloat16, INTERPRET=interpret_mode(), **norm,
        **({"PDL": True, "launch_pdl": True} if pdl_enabled(x, pdl) else {}),
        num_warps=4 if block_h * D >= 512 else 1,
    )
    return out
