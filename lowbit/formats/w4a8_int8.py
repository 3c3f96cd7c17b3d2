"""QoQ progressive group quantization (QServe §4, W4A8): the one reference of the ``w4a8-int8`` format.

Two levels, both integer below the per-channel scale (seed 003, digest part 1.3):

Level 1, per output channel ``n``, symmetric INT8 with the *protective range* [-119, 119]::

    s1[n] = max(max_k |W[n, k]|, AMAX_EPS) / 119          (float32, ``lowbit.formats.common`` rule)
    q8[n, k] = clamp(round(W[n, k] / s1[n]), -119, 119)

Level 2, per group ``g`` of ``group_size`` consecutive k (or one group per row: per-channel),
asymmetric UINT4 of that INT8 weight with an *integer* scale and an integer zero point::

    lo = min(min_g q8, 0),  hi = max(max_g q8, 0)          (the range always contains 0)
    s2[n, g] = max(ceil((hi - lo) / 15), 1)                 integer in [1, 16]
    z[n, g]  = round(-lo / s2)                              integer in [0, 15]
    q4[n, k] = clamp(round(q8 / s2) + z, 0, 15)

Runtime dequantization UINT4 -> INT8 ("subtraction after multiplication", precomputed z*s2)::

    w8[n, k] = q4 * s2 - zs,     zs[n, g] = z * s2  (integer in [0, 240])

and the GEMM is a plain W8A8 one: ``y[m, n] = (sum_k x8[m, k] * w8[n, k]) * sx[m] * s1[n]``
(INT8 x INT8 products, INT32 accumulation, scales in the epilogue only).

Why 119 (the digest's reasoning, made exact here and tested in ``tests/test_w4a8_int8_format.py``):
a group's range is at most 119 - (-119) = 238, so s2 <= ceil(238 / 15) = 16 and the level-2
rounding error is at most s2 / 2 = 8. An unclamped code reconstructs ``round(q8 / s2) * s2``, within
8 of ``q8`` in [-119, 119], so inside [-127, 127]; a code clamped to 15 (or 0) reconstructs a value
*closer to zero* than that. Hence ``w8`` never leaves [-127, 127] (INT8, and the symmetric INT8
range the activations use), and ``q4 * s2 <= 15 * 16 = 240 < 256`` fits one unsigned byte, which is
what lets QServe's kernel dequantize four lanes of a 32-bit register at once without carries.
With the full range 127 the same bound would reach 135 and overflow INT8.

Decisions where the sources leave room (each has a test):
- ``s2`` rounds *up* (ceil): the group's [lo, hi] always fits in 15 steps, so no code is clipped
  by the scale (round-to-nearest would clip up to 7 INT8 units of a group of range 22).
- the group range is widened to contain 0, so ``z`` fits UINT4 and all-zero groups give
  s2 = 1, z = 0, codes 0 and dequantize to exactly 0.
- K not a multiple of the group or of the 128-column chunk: the weight is padded with zero columns
  up to a multiple of lcm(group_size, 128) (of 128 for per-channel); the padded columns are zero
  weights, the activation is never padded (kernels mask k >= K), ``in_features`` keeps the true K.

Compute-aware weight reorder (QServe §5's idea, our layout): the codes are stored in chunks of
``CHUNK = 128`` columns; byte ``j`` (0..63) of a chunk holds column ``j`` in its low nibble and
column ``64 + j`` in its high nibble (``lowbit.formats.int4`` packing applied to the codes permuted
by ``chunk_permutation``). A kernel tile of 128 columns then splits into two *contiguous* halves by
one AND and one shift, with no register shuffle, and four codes of one row sit in each 32-bit
register, so the dequantization runs on four INT8 lanes per instruction (QServe's register-level
parallelism; ``q4 * s2 + 128 - zs`` stays in [1, 255] per byte, so lanes never carry).

Stored fields (all plain tensors, row = output channel ``n``, layout ``[N, ...]``):

========== ======================== ======== =====================================================
name       shape                    dtype    meaning
========== ======================== ======== =====================================================
qweight    [N, Kp / 2]              uint8    q4, two codes per byte, chunk-reordered (see above): in
                                             chunk c, byte 64c + j = k 128c + j (low nibble) and
                                             k 128c + 64 + j (high nibble)
wscale     [N]                      float32  s1, per-channel level-1 scale
gscale     [N, Kp / group_size]     uint8    s2 in [1, 16]
gzs        [N, Kp / group_size]     uint8    zs = z * s2 in [0, 240] (z = gzs / gscale)
========== ======================== ======== =====================================================

``Kp`` = K padded as above; per-channel (``group_size=-1``) has one group of Kp columns.
All-zero chunks/groups cost nothing special: s2 = 1, zs = 0, codes 0.

Row-tiled code layout (``tiled``; ``tile_codes`` / ``untile_codes``): the same ``qweight`` bytes
and shape, regrouped so that each block of ``TILE_ROWS`` = 64 rows x one 128-column chunk (64 bytes
per row) is 4 contiguous KB, block (t, c) at byte ``(t * Kp/128 + c) * 4096``; rows past the last
full 64-row block stay row-major. Rows ``64t .. 64t + 63`` of the ``[N, Kp/2]`` view hold exactly
row tile ``t``, so modules whose row counts are multiples of 64 stack by concatenation
(``W4A8INT8Linear.fuse_layout``). Decision (session 11): ``W4A8INT8Linear.from_linear`` stores the
codes tiled by default, because the kernels read each (row tile, chunk) in one contiguous piece;
measured on an H100 (M = 1, each layout with its default config, weights streamed from HBM, us):
qkv 7.50 vs 9.18, o 6.62 vs 7.45, down 14.89 vs 16.90, gate_up 23.59 vs 30.07 (a flat read of the
gate_up codes: 20.87); M = 16 / 128 2-13% faster; ``benchmarks/results/h100/s11_probe.json``. The
layout is a runtime property of the module (its ``config()`` records it; its ``state_dict`` and so
every checkpoint hold the row-major codes); every reference here takes ``tiled`` and untiles first
(same integers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit._utils import cached_dense, check_int
from lowbit.formats.common import safe_scale, tile_rows, untile_rows
from lowbit.formats.int4 import pack_int4, unpack_int4

PROTECTIVE_RANGE = 119  # level-1 INT8 range [-119, 119]; see module docstring for why
UINT4_MAX = 15
GSCALE_MAX = 16  # ceil(2 * 119 / 15)
CHUNK = 128  # columns per reorder chunk (= the kernel's BLOCK_K)


@dataclass
class QoQWeight:
    """The quantized weight of one linear layer (fields: see module docstring)."""

    qweight: torch.Tensor
    wscale: torch.Tensor
    gscale: torch.Tensor
    gzs: torch.Tensor
    in_features: int
    group_size: int  # -1 = per-channel
    tiled: bool = False  # qweight in the row-tiled layout (``tile_codes``)

    @property
    def padded_in_features(self) -> int:
        return self.qweight.shape[1] * 2

    @property
    def effective_group_size(self) -> int:
        return self.padded_in_features if self.group_size == -1 else self.group_size


def padded_k(k: int, group_size: int) -> int:
    """K rounded up to a multiple of lcm(group_size, CHUNK) (per-channel ``-1``: of CHUNK)."""
    mult = CHUNK if group_size == -1 else math.lcm(group_size, CHUNK)
    return -(-k // mult) * mult


def chunk_permutation(kp: int, device=None) -> torch.Tensor:
    """Index ``perm`` [Kp] with ``stored[..., i] = codes[..., perm[i]]`` before nibble packing:
    positions (2j, 2j + 1) of chunk c hold columns (128c + j, 128c + 64 + j)."""
    half = CHUNK // 2
    j = torch.arange(half, device=device)
    one = torch.stack((j, j + half), dim=-1).reshape(CHUNK)
    return (torch.arange(kp // CHUNK, device=device)[:, None] * CHUNK + one[None, :]).reshape(kp)


def pack_codes(q4: torch.Tensor) -> torch.Tensor:
    """q4 [N, Kp] in natural column order -> qweight uint8 [N, Kp / 2] (chunk-reordered)."""
    return pack_int4(q4[:, chunk_permutation(q4.shape[1], q4.device)])


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 [N, Kp / 2] -> codes uint8-valued int8 [N, Kp], natural order."""
    stored = unpack_int4(qweight, signed=False)
    out = torch.empty_like(stored)
    out[:, chunk_permutation(stored.shape[1], stored.device)] = stored
    return out


TILE_ROWS = 64  # rows per contiguous block of the row-tiled code layout (``tile_codes``)


def tile_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Row-tiled copy of ``qweight`` [N, Kp/2] (same bytes, same shape, another order): the first
    ``N64 = TILE_ROWS * (N // TILE_ROWS)`` rows are stored as blocks of TILE_ROWS rows x one
    128-column chunk (64 bytes per row), block (t, c) at byte ``(t * Kp/128 + c) * TILE_ROWS * 64``,
    so a kernel reading one row-tile and one chunk reads 4 contiguous KB; the remaining rows follow
    row-major. Inverse: ``untile_codes``. (The modules' default layout; see the module docstring.)"""
    return tile_rows(qweight, TILE_ROWS).reshape(qweight.shape)


def untile_codes(tiled: torch.Tensor) -> torch.Tensor:
    """Inverse of ``tile_codes``."""
    return untile_rows(tiled, *tiled.shape, TILE_ROWS)


def check_group_size(group_size: int) -> int:
    check_int(group_size, "group_size", -1)
    if group_size != -1 and (group_size < 2 or group_size % 2):
        raise ValueError(f"group_size must be -1 (per-channel) or an even int >= 2, got {group_size}")
    return group_size


def quantize_int8_per_channel(w: torch.Tensor, s1: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Level 1: w [N, K] float -> (q8 int16 [N, K] in [-119, 119], s1 float32 [N]); ``s1`` given: kept."""
    wf = w.float()
    if s1 is None:
        s1 = safe_scale(wf.abs().amax(dim=1), PROTECTIVE_RANGE)
    q8 = torch.round(wf / s1[:, None]).clamp(-PROTECTIVE_RANGE, PROTECTIVE_RANGE).to(torch.int16)
    return q8, s1


def uint4_params(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Level-2 parameters of integer groups ``x`` [..., g]: (s2, z) int32 [...] (module docstring's rule)."""
    x = x.to(torch.int32)
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1).clamp(min=0)
    s2 = ((hi - lo + UINT4_MAX - 1) // UINT4_MAX).clamp(min=1)  # ceil((hi - lo) / 15), >= 1
    # z = round(-lo / s2) with round-half-even, in integers: -lo / s2 is exact as a float64 ratio
    z = torch.round(-lo.double() / s2.double()).to(torch.int32)
    return s2, z


def uint4_codes(x: torch.Tensor, s2: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """q4 = clamp(round(x / s2) + z, 0, 15) (int32) for integers ``x``; ``s2`` / ``z`` broadcast against it."""
    q = torch.round(x.double() / s2.double()).to(torch.int32) + z.to(torch.int32)
    return q.clamp(0, UINT4_MAX)


def quantize_uint4_groups(q8: torch.Tensor, group_size: int, s2: torch.Tensor | None = None,
                          z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Level 2: q8 [N, Kp] integers (Kp a multiple of the group) -> (q4 uint8 [N, Kp],
    s2 uint8 [N, G], zs uint8 [N, G]); integer arithmetic only. ``s2`` / ``z`` [N, G] given: kept."""
    N, Kp = q8.shape
    g = Kp if group_size == -1 else group_size
    x = q8.to(torch.int32).reshape(N, Kp // g, g)
    if s2 is None or z is None:
        s2, z = uint4_params(x)
    else:
        s2, z = s2.to(q8.device, torch.int32), z.to(q8.device, torch.int32)
        if s2.ndim == 2 and s2.shape == z.shape and s2.shape[0] == N and s2.shape[1] < Kp // g:
            # groups wholly in the zero padding (K up to the lcm with 128): s2 = 1, z = 0 as the rule gives them
            pad = Kp // g - s2.shape[1]
            s2 = torch.nn.functional.pad(s2, (0, pad), value=1)
            z = torch.nn.functional.pad(z, (0, pad), value=0)
        if tuple(s2.shape) != (N, Kp // g) or tuple(z.shape) != (N, Kp // g):
            raise ValueError(f"s2 and z must have shape [{N}, {Kp // g}], got {list(s2.shape)} / {list(z.shape)}")
        if not ((s2 >= 1) & (s2 <= 16) & (z >= 0) & (z <= UINT4_MAX) & (z * s2 <= 255)).all():
            raise ValueError("s2 must lie in [1, 16] and z in [0, 15] (z * s2 <= 255)")
    q4 = uint4_codes(x, s2[..., None], z[..., None]).to(torch.uint8).reshape(N, Kp)
    return q4, s2.to(torch.uint8), (z * s2).to(torch.uint8)


def quantize(w: torch.Tensor, group_size: int = 128, *, s1: torch.Tensor | None = None,
             s2: torch.Tensor | None = None, z: torch.Tensor | None = None) -> QoQWeight:
    """Progressive group quantization of a linear weight ``w`` [N, K] (float). ``s1`` [N] and ``s2`` / ``z``
    [N, Kp / group_size] replace the rule's scales (e.g. chosen by GPTQ, ``lowbit.ptq.gptq``)."""
    check_group_size(group_size)
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [out_features, in_features], got shape {list(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"w must be a float tensor, got {w.dtype}")
    if not torch.isfinite(w).all():  # (as the other formats; was quantized silently into a NaN output feature)
        raise ValueError("w has NaN or Inf entries")
    N, K = w.shape
    if s1 is not None:
        s1 = s1.detach().to(w.device, torch.float32)
        if tuple(s1.shape) != (N,) or not (s1 > 0).all():
            raise ValueError(f"s1 must be a positive [{N}] tensor, got shape {list(s1.shape)}")
    q8, s1 = quantize_int8_per_channel(w, s1)
    Kp = padded_k(K, group_size)
    if Kp != K:
        q8 = torch.nn.functional.pad(q8, (0, Kp - K))
    q4, s2, zs = quantize_uint4_groups(q8, group_size, s2, z)
    return QoQWeight(pack_codes(q4), s1, s2, zs, K, group_size)


def dequantize_int8(qweight: torch.Tensor, gscale: torch.Tensor, gzs: torch.Tensor,
                    in_features: int | None = None, *, tiled: bool = False) -> torch.Tensor:
    """The runtime INT8 weight ``w8 = q4 * s2 - zs`` as int8 [N, in_features] (all of Kp if None).
    ``tiled``: ``qweight`` is in the row-tiled layout (``tile_codes``)."""
    q4 = unpack_codes(untile_codes(qweight) if tiled else qweight).to(torch.int32)
    N, Kp = q4.shape
    G = gscale.shape[1]
    g = Kp // G
    w8 = q4.reshape(N, G, g) * gscale.to(torch.int32)[..., None] - gzs.to(torch.int32)[..., None]
    w8 = w8.reshape(N, Kp)
    if in_features is not None:
        w8 = w8[:, :in_features]
    return w8.to(torch.int8)


def dequantize(qw: QoQWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The effective float weight ``w8 * s1`` [N, K]."""
    w8 = dequantize_int8(qw.qweight, qw.gscale, qw.gzs, qw.in_features, tiled=qw.tiled)
    return (w8.float() * qw.wscale[:, None]).to(dtype)


INT_DOT_CHUNK = 1024  # |int8 x int8| <= 2^14, so any partial sum of 1024 products is an integer below 2^24


def exact_int_dot(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``xq [M, K] @ w [N, K]^T`` of integer-valued int8-range operands, exact: float32 GEMMs over K chunks of
    ``INT_DOT_CHUNK`` (every partial sum an integer below 2^24, exact in float32 in any order), chunks added in
    float64, the total rounded once to float32 -- the same number as a float64 dot, at float32 GEMM speed."""
    xf, w = xq.float(), w.float()
    acc = torch.zeros(xf.shape[0], w.shape[0], dtype=torch.float64, device=xf.device)
    for k0 in range(0, xf.shape[-1], INT_DOT_CHUNK):
        acc += xf[:, k0:k0 + INT_DOT_CHUNK] @ w[:, k0:k0 + INT_DOT_CHUNK].t()
    return acc.float()


def gemm_ref(xq: torch.Tensor, xscale: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
             gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
             tiled: bool = False) -> torch.Tensor:
    """Reference of the W4A8 INT8 GEMM, same numerics as the kernel.

    xq int8 [M, K], xscale fp32 [M] -> out_dtype [M, N]: the INT8 dot is exact (computed in
    float64, |acc| <= 127 * 127 * K < 2^53; ``exact_int_dot``), then ``float32(acc) * xscale[m] * wscale[n] (+ bias)``.
    ``tiled``: ``qweight`` in the row-tiled layout.
    """
    K = xq.shape[-1]
    w8 = cached_dense(lambda: dequantize_int8(qweight, gscale, gzs, K, tiled=tiled).float(), qweight, gscale, gzs,
                      tag=("int8", K, tiled))
    acc = exact_int_dot(xq, w8)
    y = acc * xscale.float()[:, None] * wscale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
