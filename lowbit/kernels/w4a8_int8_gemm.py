"""W4A8 INT8 GEMM (QServe §4, QoQ): UINT4 weights dequantized to INT8 in registers, INT8 tensor cores.

Math (format: ``lowbit.formats.w4a8_int8``, which also holds the reference ``gemm_ref``)::

    w8[n, k]  = q4[n, k] * s2[n, g(k)] - zs[n, g(k)]        integer, in [-127, 127] (tested)
    acc[m, n] = sum_k x8[m, k] * w8[n, k]                    INT8 x INT8 -> INT32 (tensor cores)
    y[m, n]   = float32(acc) * sx[m] * s1[n] (+ bias[n])     epilogue, then cast to the output dtype

"Subtraction after multiplication": the zero point enters as the precomputed integer ``zs = z*s2``,
so dequantizing one weight is one multiply and one subtract on integers (no float on the main
loop, unlike per-group float scales that must rescale partial sums every group).
INT32 cannot overflow for K < 2^31 / 127^2 = 133,143.

Layouts:
- x8 ``[M, K]`` int8, any strides; sx ``[M]`` fp32 (per-token scale, ``lowbit.ops.quant``);
- qweight ``[N, Kp/2]`` uint8, row-major, two k per byte (k = 2i low nibble); Kp >= K is the
  padded K (a multiple of the group; the kernel masks x at k >= K, so padded columns add 0);
- s1 ``[N]`` fp32; s2, zs ``[N, G]`` uint8 (G = Kp / GROUP_SIZE groups along k);
- out ``[M, N]`` fp16/bf16 (or an fp32 workspace with SPLIT_K > 1, reduced by atomic adds).

Tiling: a program computes a BLOCK_M x BLOCK_N tile over a K range (SPLIT_K > 1 splits K over a
second grid axis so small M still fills the 132 SMs). A tile of packed weights is loaded as
``[BLOCK_N, BLOCK_K/2]`` bytes (k contiguous: 16-byte loads), split into nibbles, interleaved
back to ``[BLOCK_N, BLOCK_K]``, dequantized with one group scale per row and k-group, cast to int8
and fed to ``tl.dot`` transposed (k-major B, which Hopper's int8 wgmma needs). BLOCK_K may span
several groups (reshaped to ``[BLOCK_N, BLOCK_K/GROUP, GROUP]``) or lie inside one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K or 0 = auto, num_warps, num_stages), by M bucket.
# Chosen from the device sweeps (benchmarks/device/w4a8_int8.py, --sweep); see docs/sections/w4a8_int8.md.
CONFIGS = {
    16: (16, 64, 256, 0, 4, 4),
    64: (64, 64, 128, 0, 4, 4),
    128: (64, 128, 128, 0, 4, 4),
    1 << 62: (128, 128, 128, 1, 8, 3),
}


@triton.jit
def _w4a8_int8_gemm_kernel(
    # pointers
    X, XS, W, WS, GS, GZS, BIAS, OUT,
    # sizes
    M, N, K, KP, NUM_GROUPS, TILES_PER_SPLIT,
    # strides (elements; W in bytes)
    stride_xm, stride_xk, stride_wn, stride_gn, stride_om, stride_on,
    # constexpr flags / tiles
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # grouped ordering of output tiles: GROUP_M row-tiles share the weight tiles they read (L2 reuse)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    gsize = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # clamp out-of-range rows/columns to valid ones (their results are masked at the store), so the
    # main-loop loads need no M/N masks
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)

    t0 = pid_k * TILES_PER_SPLIT  # the last split may run past KP: its loads are masked off

    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for i in range(0, TILES_PER_SPLIT):
        k0 = (t0 + i) * BLOCK_K
        kk = k0 + offs_k
        a = tl.load(X + rm[:, None] * stride_xm + kk[None, :] * stride_xk, mask=kk[None, :] < K, other=0)
        kb = k0 // 2 + offs_kb
        b = tl.load(W + rn[:, None] * stride_wn + kb[None, :], mask=kb[None, :] < KP // 2, other=0)
        b = b.to(tl.int32)
        q = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K))  # k = 2i low, 2i + 1 high
        if BLOCK_K <= GROUP_SIZE:  # the whole tile lies in one k-group
            g = k0 // GROUP_SIZE
            s2 = tl.load(GS + rn * stride_gn + g).to(tl.int32)
            zs = tl.load(GZS + rn * stride_gn + g).to(tl.int32)
            w8 = q * s2[:, None] - zs[:, None]
        else:  # BLOCK_K // GROUP_SIZE groups per tile
            NG: tl.constexpr = BLOCK_K // GROUP_SIZE
            gg = k0 // GROUP_SIZE + tl.arange(0, NG)
            gm = gg[None, :] < NUM_GROUPS
            s2 = tl.load(GS + rn[:, None] * stride_gn + gg[None, :], mask=gm, other=0).to(tl.int32)
            zs = tl.load(GZS + rn[:, None] * stride_gn + gg[None, :], mask=gm, other=0).to(tl.int32)
            q3 = tl.reshape(q, (BLOCK_N, NG, GROUP_SIZE))
            w8 = tl.reshape(q3 * s2[:, :, None] - zs[:, :, None], (BLOCK_N, BLOCK_K))
        acc = tl.dot(a, tl.trans(w8.to(tl.int8)), acc, out_dtype=tl.int32)

    # epilogue: per-token activation scale x per-channel weight scale (+ bias once)
    sx = tl.load(XS + rm)
    s1 = tl.load(WS + rn)
    y = acc.to(tl.float32) * sx[:, None] * s1[None, :]
    if HAS_BIAS:
        bias = tl.load(BIAS + rn).to(tl.float32)
        if ATOMIC:  # split-K: only the first split adds the bias
            y += tl.where(pid_k == 0, 1.0, 0.0) * bias[None, :]
        else:
            y += bias[None, :]
    out_ptrs = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ATOMIC:
        tl.atomic_add(out_ptrs, y, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=mask)


PER_CHANNEL_GROUP = 1 << 30  # GROUP_SIZE passed for per-channel weights: every k is in group 0


def block_k_for(group_size: int, want: int) -> int | None:
    """BLOCK_K (a power of two >= 32) compatible with ``group_size``: any multiple of a
    power-of-two group, or a power of two dividing the group; None when no such size exists
    (then ``lowbit.ops.w4a8_int8`` falls back to the reference)."""
    if group_size & (group_size - 1) == 0:  # power of two (incl. PER_CHANNEL_GROUP)
        return want
    bk = want
    while bk >= 32:
        if group_size % bk == 0:
            return bk
        bk //= 2
    return None


def pick_config(M: int, N: int, K: int, group_size: int, *, num_sms: int = 132) -> dict:
    """Tile config by M bucket (``CONFIGS``), BLOCK_K fitted to the group, split-K for small M
    (about two programs per SM, each keeping >= 4 k-tiles)."""
    for bound in sorted(CONFIGS):
        if M <= bound:
            bm, bn, bk, split, warps, stages = CONFIGS[bound]
            break
    bk = block_k_for(group_size, bk)
    if bk is None:
        raise ValueError(f"no BLOCK_K fits group_size={group_size}")
    if split == 0:
        tiles = cdiv(M, bm) * cdiv(N, bn)
        split = max(1, min(2 * num_sms // max(tiles, 1), cdiv(K, bk) // 4, 16))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)


def w4a8_int8_gemm_triton(*args, **kwargs) -> torch.Tensor:
    """Launch the kernel (see ``launch``); returns ``out_dtype`` [M, N]."""
    return launch(*args, **kwargs)[0]


def launch(xq: torch.Tensor, xscale: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
           gscale: torch.Tensor, gzs: torch.Tensor, bias: torch.Tensor | None, k: int,
           group_size: int, out_dtype: torch.dtype, config: dict | None = None):
    """Launch the kernel. ``xq`` int8 [M, K], ``xscale`` fp32 [M]; weight fields as in
    ``lowbit.formats.w4a8_int8``; ``group_size`` = columns per group (per-channel: Kp).
    Arguments are validated by ``lowbit.ops.w4a8_int8``. Returns ``(out, compiled_kernel)``
    (the compiled kernel for PTX inspection; None when nothing was launched)."""
    M, K = xq.shape
    N, kp2 = qweight.shape
    KP = 2 * kp2
    G = gscale.shape[1]
    assert K == k and KP >= K, "inconsistent shapes (validate in lowbit.ops)"
    if G == 1 and group_size == KP:
        group_size = PER_CHANNEL_GROUP
    if torch.cuda.is_available() and xq.is_cuda:
        num_sms = torch.cuda.get_device_properties(xq.device).multi_processor_count
    else:
        num_sms = 4
    cfg = dict(config) if config else pick_config(M, N, KP, group_size, num_sms=num_sms)
    bm, bn, bk, split = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    if split > 1:
        out = torch.zeros((M, N), device=xq.device, dtype=torch.float32)
    else:
        out = torch.empty((M, N), device=xq.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out.to(out_dtype), None
    grid = (cdiv(M, bm) * cdiv(N, bn), split)
    kernel = _w4a8_int8_gemm_kernel[grid](
        xq, xscale, qweight, wscale, gscale, gzs, bias if bias is not None else wscale, out,
        M, N, K, KP, G, cdiv(cdiv(KP, bk), split),
        xq.stride(0), xq.stride(1), qweight.stride(0), gscale.stride(0), out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ATOMIC=split > 1,
        HAS_BIAS=bias is not None, GROUP_M=8, **cfg,
    )
    return (out if split == 1 else out.to(out_dtype)), kernel
