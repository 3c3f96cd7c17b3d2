"""W4A8-FP (FireQ §3.1): INT4 weights with FP8 E4M3 group scales, FP8 E4M3 per-token activations.

This file is THE reference of the format: quantize, pack, dequantize and the float64 matmul that
the Triton kernel (``lowbit.kernels.w4a8_fp8_gemm``) must reproduce.

Weights ``W [N, K]`` (N = out_features, K = in_features), after CAS and PTS (``lowbit.ptq``)::

    W'    = W * delta                             delta = 2^n (PTS, FireQ Def. 3.2; n = 0 without)
    amax  = max |W'| over a group of ``group_size`` consecutive input channels of one output row
    sigma = FP8_E4M3( max(amax, AMAX_EPS) / 7 )   RNE, clamped to 448; a sigma that underflows to
                                                  0 (amax < 7 * 2^-10) zeroes its group (FireQ
                                                  Lemma B.1) -- codes 0, never 0/0
    q     = clamp(round_half_even(W' / sigma), -7, 7)   divided by the *FP8-rounded* sigma, so the
                                                  rounding of sigma is compensated in q; symmetric
                                                  [-7, 7] (|W'|/sigma <= 7/(1 - 2^-4) < 7.5 for a
                                                  normal sigma, so -8 could only appear for a
                                                  subnormal sigma rounded down; we clip it to -7)
    Weff  = FP8_E4M3(q * sigma)                   the dequantized weight is the FP8 rounding of
                                                  q*sigma: FireQ's lookup table holds FP8(q*sigma),
                                                  so the kernel multiplies FP8 x FP8 on the tensor
                                                  cores. q*sigma has up to 7 significant bits, E4M3
                                                  keeps 4: the rounding is part of the format, not a
                                                  kernel error. FP8(-x) = -FP8(x) (RNE is
                                                  symmetric), so 8 magnitudes FP8(k*sigma), k = 0..7,
                                                  and a sign bit give every entry.

Activations: ``xq, sx = quantize_per_token(x, FP8_E4M3)`` (``lowbit.formats.common``).

Output::

    y[m, n] = sx[m] * delta^-1 * sum_k xq[m, k] * Weff[n, k]  (+ bias[n])     (FP32 accumulation)

Storage (every field a tensor; ``Kp = ceil(K / 128) * 128``):

- ``codes`` uint8 ``[N, Kp / 2]``: 4 bits per weight, sign-magnitude, laid out for a byte-permute
  (``prmt``) lookup. Per row, each 128-column block is 64 bytes = 16 little-endian 32-bit words;
  word ``w`` holds the 8 weights ``lo_i`` = column ``4w + i`` and ``hi_i`` = column ``64 + 4w + i``
  (i = 0..3) of the block as::

      bits 4i .. 4i+2      |q(lo_i)|        bit 8i+7   sign(lo_i)
      bits 16+4i .. 16+4i+2 |q(hi_i)|       bit 8i+3   sign(hi_i)

  so ``prmt(LUT, word & 0x7777) ^ (word & 0x80808080)`` yields the four FP8 values of the lo
  columns and ``prmt(LUT, (word >> 16) & 0x7777) ^ ((word << 4) & 0x80808080)`` those of the hi
  columns, LUT = the 8 bytes FP8(k*sigma), k = 0..7 (one AND, one PRMT, one XOR per 4 weights).
  This is not nibble-per-weight packing (``lowbit.formats.int4``): sign bits are scattered so the
  sign lands on each FP8 byte's bit 7 with one mask. Columns K..Kp-1 are padding (q = 0).
- ``scales`` float8_e4m3fn ``[N, Gp]``: sigma per (row, group), ``G = ceil(K / group_size)``
  groups padded with zeros to ``Gp`` = a multiple of 16 (``scale_cols``) so the kernel fetches them
  in 16-byte chunks that Triton can pipeline with cp.async.
- ``inv_delta`` float32 scalar ``[]``: 2^-n, applied in the epilogue.

Tile-major code layout (optional, ``tile_codes`` / ``untile_codes``; ``tiled=True`` in the kernel
and the references): the same 64-byte row pieces regrouped so that each (``TILE_N`` = 128 rows x
128 columns) tile -- the K tile of one kernel program -- is one contiguous 8 KB block: uint8
``[ceil(N / 128) * Kp / 128 * 128, 64]``, block ``(nb, kt)`` at rows ``(nb * Kp/128 + kt) * 128``,
its row ``r`` = codes row ``nb * 128 + r``, bytes ``64 kt .. 64 kt + 63``; rows N.. of the last
block are zero. Same bytes, same numerics; the kernel then streams contiguous memory per program
(the row-major layout reads 64 B pieces at the row stride). ``scales`` keep their layout.

K that is not a multiple of ``group_size``: the last group of each row is shorter (its sigma comes
from its real columns only) and the code storage is zero-padded to the 128-column block. This is
exact (padding codes dequantize to 0 and the kernel masks activations beyond K) and costs at most
127 columns of storage per row (K=576: 640 stored, 10%); picking a smaller group per layer instead
would change the numerics of that layer, so we pad. ``group_size`` in {32, 64, 128}.
"""
from __future__ import annotations

import torch

from lowbit._utils import cached_dense, check_choice
from lowbit.formats.common import (AMAX_EPS, FP8_E4M3, FP8_E4M3_MAX, INT4_MAX, div_ieee, quantize_per_token,
                                   silu_mul_ref, tile_rows, untile_rows)

GROUP_SIZES = (32, 64, 128)
PACK_BLOCK = 128  # columns per reorder block (= the kernel's BLOCK_K)


def padded_k(k: int) -> int:
    return -(-k // PACK_BLOCK) * PACK_BLOCK


def num_groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


SCALE_ALIGN = 16  # scale rows are padded to a multiple of 16 groups (16-byte loads in the kernel)


def scale_cols(k: int, group_size: int) -> int:
    """Stored columns of ``scales``: ceil(K / g) rounded up to a multiple of 16 (zero padding)."""
    return -(-num_groups(k, group_size) // SCALE_ALIGN) * SCALE_ALIGN


def _check_group(group_size: int) -> None:
    check_choice(group_size, "group_size", GROUP_SIZES)


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP8 E4M3 value (ties to even, clamped to +-448), returned as float32."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3).float()


_I = torch.arange(4)


def encode_codes(q: torch.Tensor) -> torch.Tensor:
    """int q ``[N, Kp]`` in [-7, 7] (Kp a multiple of 128) -> uint8 ``[N, Kp/2]`` (layout above)."""
    n, kp = q.shape
    q = q.to(torch.int64).reshape(n, kp // PACK_BLOCK, 2, 16, 4)  # [row, block, half, word, i]
    mag, sgn = q.abs(), (q < 0).to(torch.int64)
    i = _I.to(q.device)
    word = ((mag[:, :, 0] << (4 * i)) | (sgn[:, :, 0] << (8 * i + 7))
            | (mag[:, :, 1] << (16 + 4 * i)) | (sgn[:, :, 1] << (8 * i + 3))).sum(-1)  # [row, block, 16]
    byts = (word[..., None] >> (8 * i)) & 0xFF  # little-endian bytes
    return byts.reshape(n, kp // 2).to(torch.uint8)


def decode_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, Kp/2]`` -> int8 q ``[N, Kp]`` (inverse of ``encode_codes``)."""
    n, kp2 = codes.shape
    i = _I.to(codes.device)
    b = codes.to(torch.int64).reshape(n, kp2 // 64, 16, 4)
    word = (b << (8 * i)).sum(-1)[..., None]  # [row, block, 16, 1]
    lo = ((word >> (4 * i)) & 7) * (1 - 2 * ((word >> (8 * i + 7)) & 1))
    hi = ((word >> (16 + 4 * i)) & 7) * (1 - 2 * ((word >> (8 * i + 3)) & 1))
    return torch.stack((lo, hi), dim=2).reshape(n, 2 * kp2).to(torch.int8)


def group_sigma(amax: torch.Tensor) -> torch.Tensor:
    """sigma = FP8_E4M3(max(amax, AMAX_EPS) / 7) as float32 (0 where it underflows); ``amax`` of ``|W'|``."""
    return fp8_round(div_ieee(amax.float().clamp_min(AMAX_EPS), INT4_MAX))  # IEEE quotient on any device


def grid_codes(w_scaled: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """q = clamp(round_half_even(W' / sigma), -7, 7) as float32, 0 where sigma == 0 (a group whose sigma
    underflowed); ``sigma`` broadcasts against ``w_scaled`` (= W * 2^n)."""
    safe = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
    q = torch.round(w_scaled.float() / safe).clamp(-7, 7)
    return torch.where(sigma > 0, q, torch.zeros_like(q))


def _nearest_on_grid(w_scaled: torch.Tensor, q: torch.Tensor, sigma: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """Codes whose dequantized value FP8(q * sigma) is nearest to ``w_scaled``, among ``q - 1, q, q + 1`` (ties: the
    smaller |q|). For given scales (GPTQ's): a weight on the grid comes back exactly, also where FP8(q * sigma)
    saturates at 448 (sigma > 64, e.g. a forced PTS exponent), which ``grid_codes`` alone would not give back."""
    out = torch.empty_like(q)
    for r in range(0, q.shape[0], rows):  # (row chunks: [rows, G, group, 3] candidates)
        qq, ww, ss = q[r:r + rows], w_scaled[r:r + rows].float(), sigma[r:r + rows]
        cand = (qq.unsqueeze(-1) + torch.tensor([0.0, -1.0, 1.0], device=q.device)).clamp(-7, 7)
        dist = (fp8_round(cand * ss.unsqueeze(-1)) - ww.unsqueeze(-1)).abs()
        # ties: the smaller |code| (stable argmin over candidates sorted by |code|)
        order = torch.argsort(cand.abs(), dim=-1, stable=True)
        best = torch.gather(order, -1, torch.argmin(torch.gather(dist, -1, order), dim=-1, keepdim=True))
        out[r:r + rows] = torch.where(ss > 0, torch.gather(cand, -1, best).squeeze(-1), torch.zeros_like(qq))
    return out


def quantize_weight(w: torch.Tensor, group_size: int = 128, pts_exp: int = 0, sigma: torch.Tensor | None = None):
    """``w [N, K]`` float -> (codes uint8 [N, Kp/2], scales fp8 [N, Gp], inv_delta fp32 []).

    ``pts_exp`` is PTS's n (delta = 2^n), see ``lowbit.ptq.pts``. CAS, if any, is already folded
    into ``w``. ``sigma`` [N, ceil(K / group_size)] (FP8 E4M3 values, >= 0) replaces the absmax scales,
    e.g. chosen by GPTQ (``lowbit.ptq.gptq``); the codes are then the nearest dequantized values under it
    (``_nearest_on_grid``), so a weight on the grid comes back exactly. Returns tensors on w's device.
    """
    _check_group(group_size)
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("w has NaN or Inf entries")
    n, k = w.shape
    g = num_groups(k, group_size)
    kg = g * group_size
    wf = w.float() * (2.0 ** pts_exp)
    wg = torch.nn.functional.pad(wf, (0, kg - k)).reshape(n, g, group_size)
    given = sigma is not None
    if sigma is None:
        sigma = group_sigma(wg.abs().amax(-1))  # [N, G], may be 0 (underflow)
    else:
        if tuple(sigma.shape) != (n, g):
            raise ValueError(f"sigma must have shape [{n}, {g}], got {list(sigma.shape)}")
        sigma = sigma.detach().to(w.device, torch.float32)
        if not (sigma >= 0).all() or not torch.equal(fp8_round(sigma), sigma):
            raise ValueError("sigma must hold non-negative FP8 E4M3 values")
    q = grid_codes(wg, sigma.unsqueeze(-1))
    if given:
        q = _nearest_on_grid(wg, q, sigma.unsqueeze(-1))
    q = q.reshape(n, kg)[:, :k]
    qp = torch.zeros((n, padded_k(k)), dtype=torch.int16, device=w.device)
    qp[:, :k] = q.to(torch.int16)
    codes = encode_codes(qp)
    sig = torch.zeros((n, scale_cols(k, group_size)), dtype=torch.float32, device=w.device)
    sig[:, :g] = sigma
    return codes, sig.to(FP8_E4M3), torch.tensor(2.0 ** -pts_exp, dtype=torch.float32, device=w.device)


TILE_N = 128  # rows per block of the tile-major code layout


def tiled_shape(n: int, k: int) -> tuple[int, int]:
    """Shape of the tile-major codes of an ``[N, K]`` weight."""
    return (-(-n // TILE_N) * (padded_k(k) // PACK_BLOCK) * TILE_N, PACK_BLOCK // 2)


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """Row-major codes uint8 ``[N, Kp/2]`` -> tile-major ``[ceil(N/128) * Kp/128 * 128, 64]`` (layout
    in the module docstring; rows beyond N zero)."""
    n = codes.shape[0]
    c = torch.nn.functional.pad(codes, (0, 0, 0, -(-n // TILE_N) * TILE_N - n))
    return tile_rows(c, TILE_N, PACK_BLOCK // 2).reshape(-1, PACK_BLOCK // 2)


def untile_codes(tiled: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of ``tile_codes``: tile-major codes of an ``[N, K]`` weight -> ``[N, Kp/2]``."""
    if tuple(tiled.shape) != tiled_shape(n, k):
        raise ValueError(f"tiled codes must have shape {list(tiled_shape(n, k))} for [N={n}, K={k}], "
                         f"got {list(tiled.shape)}")
    nb = -(-n // TILE_N)
    return untile_rows(tiled, nb * TILE_N, padded_k(k) // 2, TILE_N, PACK_BLOCK // 2)[:n].contiguous()


def unpack_codes(codes: torch.Tensor, k: int, *, tiled: bool = False, n: int | None = None) -> torch.Tensor:
    """codes uint8 [N, Kp/2] (or tile-major with ``tiled=True``, then ``n`` = N) -> signed int8 q [N, K]."""
    if tiled:
        if n is None:
            raise ValueError("unpack_codes(tiled=True) needs n (the weight's number of rows)")
        codes = untile_codes(codes, n, k)
    return decode_codes(codes)[:, :k]


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, k: int, group_size: int = 128, *,
                      tiled: bool = False) -> torch.Tensor:
    """Weff = FP8(q * sigma) as float32 [N, K] (without delta^-1). ``tiled``: ``codes`` are
    tile-major (``tile_codes``); N is taken from ``scales``."""
    _check_group(group_size)
    q = unpack_codes(codes, k, tiled=tiled, n=scales.shape[0]).float()
    sig = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    return fp8_round(q * sig)


def reference_gemm(xq: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, inv_delta: float,
                   k: int, group_size: int = 128, bias: torch.Tensor | None = None, *,
                   residual: torch.Tensor | None = None, silu_mul: bool = False,
                   out_dtype: torch.dtype = torch.bfloat16, tiled: bool = False) -> torch.Tensor:
    """The float64 reference of the kernel for pre-quantized activations ``xq [M, K]`` fp8,
    ``sx [M]`` fp32. Returns ``[M, N]`` (``[M, N/2]`` with ``silu_mul``) in ``out_dtype``.

    ``silu_mul``: the weight rows are interleaved (gate_0, up_0, gate_1, up_1, ...) and the output
    is ``silu(gate) * up``, each of gate, up, silu(gate) and the product rounded to ``out_dtype``
    like the eager model. ``residual`` (shaped like the output) is added last, in ``out_dtype``.
    ``tiled``: tile-major codes (``tile_codes``).
    """
    # the float64 copy is what is kept (casting a cached float32 copy every call was most of a CPU decode step)
    w = cached_dense(lambda: dequantize_weight(codes, scales, k, group_size, tiled=tiled).double(), codes, scales,
                     tag=("fp8", k, group_size, tiled))
    y = (xq.double() @ w.t()) * sx.double().unsqueeze(-1) * float(inv_delta)
    if bias is not None:
        y = y + bias.double()
    dt = out_dtype
    y = silu_mul_ref(y.to(dt)) if silu_mul else y.to(dt)
    if residual is not None:
        y = (y.float() + residual.float()).to(dt)
    return y


def reference_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, inv_delta, k: int,
                     group_size: int = 128, bias: torch.Tensor | None = None, *,
                     residual: torch.Tensor | None = None, silu_mul: bool = False,
                     tiled: bool = False) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., N]`` in x.dtype: FP8 per-token quantization of x, then
    ``reference_gemm`` (``tiled``: tile-major codes)."""
    lead = x.shape[:-1]
    xq, sx = quantize_per_token(x.reshape(-1, x.shape[-1]), FP8_E4M3)
    res = None if residual is None else residual.reshape(xq.shape[0], -1)
    y = reference_gemm(xq, sx, codes, scales, float(inv_delta), k, group_size, bias, residual=res,
                       silu_mul=silu_mul, out_dtype=x.dtype, tiled=tiled)
    return y.reshape(*lead, y.shape[-1])


