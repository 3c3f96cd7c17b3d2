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
- qweight ``[N, Kp/2]`` uint8, row-major, chunk-reordered: in each 128-column chunk byte j holds
  column j (low nibble) and column 64 + j (high nibble); Kp >= K is the padded K (a multiple of
  lcm(group, 128); the kernel masks x at k >= K, so padded columns add 0);
- s1 ``[N]`` fp32; s2, zs ``[N, G]`` uint8 (G = Kp / GROUP_SIZE groups along k);
- out ``[M, N]`` fp16/bf16/fp32.

Tiling: a program computes a BLOCK_M x BLOCK_N tile over a K range (SPLIT_K > 1 splits K over a
second grid axis so small M still fills the 132 SMs; the last split of a tile to finish sums the
INT32 partial tiles exactly and runs the epilogue, in the same launch: no memset, no cast kernel). BLOCK_K = 128 = one reorder chunk: the packed tile is loaded as
``[BLOCK_N, 64]`` bytes (16-byte loads), its low nibbles are the tile's first 64 columns and its
high nibbles the last 64, so the x tile is loaded as two contiguous halves and the product is two
``tl.dot`` of K = 64 (B transposed: k-major, as Hopper's int8 wgmma wants). Dequantization on the
GPU is the 4-lanes-per-register PTX below (7 instructions per 8 weights); under the interpreter
the same integers one lane at a time. Groups that are a multiple of 128 (g128, per-channel) load
one (s2, zs) per row and tile; smaller or odd groups gather a group index per column.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode

# (BLOCK_M, BLOCK_N, SPLIT_K or 0 = auto, num_warps, num_stages) by M bucket; BLOCK_K = CHUNK = 128.
# Chosen from the device sweeps (benchmarks/device/w4a8_int8.py); see docs/sections/w4a8_int8.md.
CONFIGS = {
    16: (16, 64, 0, 4, 4),
    32: (32, 64, 0, 4, 4),
    64: (64, 64, 0, 4, 4),
    128: (64, 128, 0, 4, 4),
    1 << 62: (128, 128, 1, 8, 3),
}

# Four INT8 lanes per 32-bit register (QServe's register-level parallelism). $2 holds 4 bytes of
# one weight row (8 codes): low nibbles = columns j..j+3 of the tile's first half, high nibbles =
# the same j of the second half. Per lane, q * s2 + (128 - zs) lies in [1, 255] (tested bound
# |w8| <= 127), so one 32-bit multiply-add with c = (128 - zs) * 0x01010101 never carries between
# lanes; XOR 0x80 per byte then subtracts 128, giving the int8 two's complement w8 = q * s2 - zs.
_DEQUANT_ASM = tl.constexpr("""
{
.reg .b32 t;
and.b32 t, $2, 0x0F0F0F0F;
mad.lo.u32 t, t, $3, $7;
xor.b32 $0, t, 0x80808080;
shr.u32 t, $2, 4;
and.b32 t, t, 0x0F0F0F0F;
mad.lo.u32 t, t, $3, $7;
xor.b32 $1, t, 0x80808080;
}
""")


@triton.jit
def _dequant_halves(b, s2, zs, USE_ASM: tl.constexpr):
    """Packed codes b uint8 [BN, 64] + per-element s2, zs (int32, broadcast) -> (w8 of the first
    64 columns, w8 of the last 64), int8 [BN, 64] each: w8 = q4 * s2 - zs."""
    if USE_ASM:
        c = (128 - zs) * 0x01010101
        lo, hi = tl.inline_asm_elementwise(_DEQUANT_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [b, s2, c],
                                           dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:  # same integers, one lane per op (interpreter: no inline PTX)
        bi = b.to(tl.int32)
        lo = ((bi & 0xF) * s2 - zs).to(tl.int8)
        hi = ((bi >> 4) * s2 - zs).to(tl.int8)
    return lo, hi


@triton.jit
def _w4a8_int8_gemm_kernel(
    # pointers
    X, XS, W, WS, GS, GZS, BIAS, OUT, PART, CNT,
    # sizes
    M, N, K, KP, NUM_GROUPS, TILES_PER_SPLIT, NSPLIT,
    # strides (elements; W in bytes)
    stride_xm, stride_xk, stride_wn, stride_gn, stride_om, stride_on,
    # constexpr flags / tiles
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_M: tl.constexpr, USE_ASM: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    BLOCK_K: tl.constexpr = 128  # = lowbit.formats.w4a8_int8.CHUNK
    HALF: tl.constexpr = 64
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
    offs_h = tl.arange(0, HALF)
    x_ptrs = X + rm[:, None] * stride_xm + offs_h[None, :] * stride_xk
    w_ptrs = W + rn[:, None] * stride_wn + offs_h[None, :]

    t0 = pid_k * TILES_PER_SPLIT  # the last split may run past KP: its loads are masked off
    # SWAP_AB: compute the transposed tile W x^T ([BLOCK_N, BLOCK_M]) so the dequantized weights are
    # the MMA's A operand, which Hopper's wgmma reads from registers (no shared-memory round trip),
    # and the tokens are its N dimension (wgmma N can be 8..256: small M wastes nothing)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for i in range(0, TILES_PER_SPLIT):
        k0 = (t0 + i) * BLOCK_K
        a_lo = tl.load(x_ptrs + k0 * stride_xk, mask=(k0 + offs_h)[None, :] < K, other=0)
        a_hi = tl.load(x_ptrs + (k0 + HALF) * stride_xk, mask=(k0 + HALF + offs_h)[None, :] < K, other=0)
        b = tl.load(w_ptrs + k0 // 2, mask=k0 < KP, other=0)  # [BN, 64] bytes, 16-byte loads
        if GROUP_SIZE % BLOCK_K == 0:  # one k-group per tile: one (s2, zs) per row
            g = k0 // GROUP_SIZE
            gm = g < NUM_GROUPS
            s2 = tl.load(GS + rn * stride_gn + g, mask=gm, other=1).to(tl.int32)
            zs = tl.load(GZS + rn * stride_gn + g, mask=gm, other=0).to(tl.int32)
            s2b = tl.broadcast_to(s2[:, None], (BLOCK_N, HALF))
            zsb = tl.broadcast_to(zs[:, None], (BLOCK_N, HALF))
            w_lo, w_hi = _dequant_halves(b, s2b, zsb, USE_ASM)
        else:  # groups smaller than the tile (or not dividing it): gather each column's group
            g_lo = (k0 + offs_h) // GROUP_SIZE
            g_hi = (k0 + HALF + offs_h) // GROUP_SIZE
            base = rn[:, None] * stride_gn
            m_lo = g_lo[None, :] < NUM_GROUPS
            m_hi = g_hi[None, :] < NUM_GROUPS
            s_lo = tl.load(GS + base + g_lo[None, :], mask=m_lo, other=1).to(tl.int32)
            z_lo = tl.load(GZS + base + g_lo[None, :], mask=m_lo, other=0).to(tl.int32)
            s_hi = tl.load(GS + base + g_hi[None, :], mask=m_hi, other=1).to(tl.int32)
            z_hi = tl.load(GZS + base + g_hi[None, :], mask=m_hi, other=0).to(tl.int32)
            bi = b.to(tl.int32)
            w_lo = ((bi & 0xF) * s_lo - z_lo).to(tl.int8)
            w_hi = ((bi >> 4) * s_hi - z_hi).to(tl.int8)
        if SWAP_AB:
            acc = tl.dot(w_lo, tl.trans(a_lo), acc, out_dtype=tl.int32)
            acc = tl.dot(w_hi, tl.trans(a_hi), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a_lo, tl.trans(w_lo), acc, out_dtype=tl.int32)
            acc = tl.dot(a_hi, tl.trans(w_hi), acc, out_dtype=tl.int32)

    if SPLIT:
        # split-K fixup in the same launch: every split stores its INT32 partial tile, the last one to
        # arrive (per-tile counter) sums them exactly, applies the epilogue and re-arms the counter
        if SWAP_AB:
            offs_t = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        else:
            offs_t = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_base = pid.to(tl.int64) * NSPLIT * (BLOCK_M * BLOCK_N)
        tl.store(PART + tile_base + pid_k * (BLOCK_M * BLOCK_N) + offs_t, acc, cache_modifier=".cg")
        tl.debug_barrier()  # all of this program's stores precede its release below
        count = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
        if count == NSPLIT - 1:
            acc = tl.zeros_like(acc)
            for s in range(0, NSPLIT):
                acc += tl.load(PART + tile_base + s * (BLOCK_M * BLOCK_N) + offs_t, cache_modifier=".cg")
            tl.atomic_xchg(CNT + pid, 0, sem="relaxed", scope="gpu")
            _epilogue(acc, XS, WS, BIAS, OUT, rm, rn, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, SWAP_AB)
    else:
        _epilogue(acc, XS, WS, BIAS, OUT, rm, rn, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, SWAP_AB)


@triton.jit
def _epilogue(acc, XS, WS, BIAS, OUT, rm, rn, offs_m, offs_n, M, N, stride_om, stride_on,
              HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr):
    """y = float32(acc) * sx[m] * s1[n] (+ bias[n]) -> OUT's dtype, masked to [M, N]
    (acc is [BLOCK_N, BLOCK_M] with SWAP_AB, else [BLOCK_M, BLOCK_N])."""
    sx = tl.load(XS + rm)
    s1 = tl.load(WS + rn)
    if SWAP_AB:
        y = acc.to(tl.float32) * s1[:, None] * sx[None, :]
        if HAS_BIAS:
            y += tl.load(BIAS + rn).to(tl.float32)[:, None]
        out_ptrs = OUT + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None] * stride_on
        mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        y = acc.to(tl.float32) * sx[:, None] * s1[None, :]
        if HAS_BIAS:
            y += tl.load(BIAS + rn).to(tl.float32)[None, :]
        out_ptrs = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=mask)


PER_CHANNEL_GROUP = 1 << 30  # GROUP_SIZE passed for per-channel weights: every k is in group 0


CTAS_PER_SM = 4  # split-K target: programs per SM when the output tiles alone are too few
MIN_TILES_PER_SPLIT = 4


def auto_split(M: int, N: int, K: int, bm: int, bn: int, num_sms: int, ctas_per_sm: int = CTAS_PER_SM,
               min_tiles: int = MIN_TILES_PER_SPLIT) -> int:
    """Splits of K so that about ``ctas_per_sm`` programs run per SM, each keeping >= ``min_tiles``
    k-tiles of 128 (at most 32 splits)."""
    tiles = cdiv(M, bm) * cdiv(N, bn)
    return max(1, min(ctas_per_sm * num_sms // max(tiles, 1), cdiv(K, 128) // min_tiles, 32))


def pick_config(M: int, N: int, K: int, group_size: int, *, num_sms: int = 132) -> dict:
    """Tile config by M bucket (``CONFIGS``); split-K for small M (``auto_split``)."""
    for bound in sorted(CONFIGS):
        if M <= bound:
            bm, bn, split, warps, stages = CONFIGS[bound]
            break
    if split == 0:
        split = auto_split(M, N, K, bm, bn, num_sms)
    return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=stages)


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
    assert K == k and KP >= K and KP % 128 == 0, "inconsistent shapes (validate in lowbit.ops)"
    if G == 1 and group_size == KP:
        group_size = PER_CHANNEL_GROUP
    if torch.cuda.is_available() and xq.is_cuda:
        num_sms = torch.cuda.get_device_properties(xq.device).multi_processor_count
    else:
        num_sms = 4
    cfg = dict(config) if config else pick_config(M, N, KP, group_size, num_sms=num_sms)
    bm, bn, split = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    cfg.pop("BLOCK_K", None)
    bk = 128
    # the 4-lane PTX dequantization needs a real GPU; LOWBIT_W4A8_INT8_NO_ASM=1 forces the one-lane path
    use_asm = cfg.pop("USE_ASM", not interpret_mode() and os.environ.get("LOWBIT_W4A8_INT8_NO_ASM", "0") != "1")
    swap = cfg.pop("SWAP_AB", True)
    out = torch.empty((M, N), device=xq.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out, None
    tiles = cdiv(M, bm) * cdiv(N, bn)
    if split > 1:
        part, cnt = _split_workspace(xq.device, tiles * split * bm * bn, tiles)
    else:
        part = cnt = xscale  # unused
    grid = (tiles, split)
    kernel = _w4a8_int8_gemm_kernel[grid](
        xq, xscale, qweight, wscale, gscale, gzs, bias if bias is not None else wscale, out, part, cnt,
        M, N, K, KP, G, cdiv(cdiv(KP, bk), split), split,
        xq.stride(0), xq.stride(1), qweight.stride(0), gscale.stride(0), out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, BLOCK_M=bm, BLOCK_N=bn, SPLIT=split > 1,
        HAS_BIAS=bias is not None, GROUP_M=8, USE_ASM=use_asm, SWAP_AB=swap, **cfg,
    )
    return out, kernel


_WORKSPACES: dict = {}


def _split_workspace(device: torch.device, n_partial: int, n_tiles: int):
    """INT32 partial tiles and per-tile arrival counters for split-K, one pair per (device, stream),
    grown on demand. The counters start at 0 and the kernel leaves them at 0 (the last program of a
    tile re-arms its counter), so no memset launch is needed per call; launches on one stream are
    ordered, and each stream has its own pair."""
    key = (device.type, device.index, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    part, cnt = _WORKSPACES.get(key, (None, None))
    if part is None or part.numel() < n_partial:
        part = torch.empty(max(n_partial, 1 << 20), device=device, dtype=torch.int32)
    if cnt is None or cnt.numel() < n_tiles:
        cnt = torch.zeros(max(n_tiles, 4096), device=device, dtype=torch.int32)
    _WORKSPACES[key] = (part, cnt)
    return part, cnt
