"""GPTQ's column loop (``lowbit.ptq.gptq.gptq_weight``) for one segment of a lazy block in one launch.

For the block of columns ``[b0, b0 + nb)`` of ``W`` and its segment ``c0 <= j < c1`` (offsets in the block)::

    for j in c0 .. c1 - 1:                     sequential, in every program
        q_j  = grid(w_j)                       the format's quantize-dequantize, per-row group parameters
        e_j  = (w_j - q_j) / U[b0 + j, b0 + j]
        w_k -= e_j * U[b0 + j, b0 + k]         block columns k >= j
        Q[:, b0 + j] = q_j,  E[:, j] = e_j

Rows are independent: programs over tiles of ``BLOCK_R`` rows, each keeping its ``[BLOCK_R, BLOCK_B]`` tile of
the block in registers for the whole segment (``BLOCK_B`` = the block's width rounded up to a power of two,
``nb <= MAX_BLOCK``); column j is read from the tile by a masked sum (a ``-0.0`` fill: exact, signed zeros too).

Layouts (float32, row-major): ``W`` and ``Q`` ``[N, K]`` (row stride K; W is updated in place, the block's
columns ``>= c1`` written back: the next segment and the host's group parameters read them); ``U`` ``[K, K]``
(the upper Cholesky factor of H^-1, row stride K); ``E`` ``[N, nb]``; group parameters ``P0`` / ``P1``
``[N, G]`` (row stride given), read at group ``GIDX[b0 + j]`` (int32 ``[K]``, ``PER_COL``: act-order's static
groups in the permuted column order) or at group 0 (one group for the whole segment).

``FORMAT`` (constexpr; ``FORMATS``), the grids of ``lowbit.ptq.gptq``:

- 0 ``w4a8-fp8`` (P0 = sigma): ``q = clamp(rne(w 2^n / sigma), -7, 7)`` (0 where sigma = 0),
  ``FP8(clamp(q sigma, +-448)) 2^-n`` (``lowbit.formats.w4a8_fp8``: ``grid_codes``, ``fp8_round``);
- 1 ``w4a8-int8`` (P0 = s2, P1 = z, ``S1`` [N]): ``q8 = clamp(rne(w / s1), -119, 119)``,
  ``q4 = clamp(rne(q8 / s2) + z, 0, 15)``, ``((q4 - z) s2) s1`` (``lowbit.formats.w4a8_int8``);
- 2 ``lut`` (P0 = the scale s as float32): ``TS[#{i: MIDS[i] < w / s}] s``, TS the table sorted ascending, MIDS
  the midpoints of neighbours (``lut_tables``; +inf padding): the nearest entry, ties to the smaller
  (``lowbit.formats.lut.nearest_codes``).

Numerics: the PyTorch loop's float32 operations, in its order, each rounded once, so Q, E and W equal the loop's
bit for bit (signed zeros included; ``tests/test_gptq_kernel.py``, and on the GPU its gpu test): IEEE
quotients (``div_rn``), round half to even by the 1.5 * 2^23 adder (after the clamp: |x| <= 119) with the sign
of a zero kept (``torch.round(-0.3)`` is -0), FP8 E4M3 rounding by ``act_quant.round_to_fp8_e4m3`` on both
devices (Triton 3.6's interpreter mis-rounds the fp8 cast at binade carries), and no FMA contraction: the
launch passes ``enable_fp_fusion=False`` (torch's ``W -= e * u`` rounds the product, then the difference; the
interpreter's numpy never fuses). The lazy-block GEMM ``W[:, b0+nb:] -= E @ U[b0:b0+nb, b0+nb:]`` stays on the
host (torch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, check_same_device, check_tensor
from lowbit.formats.lut import sorted_midpoints
from lowbit.kernels.act_quant import round_to_fp8_e4m3
from lowbit.kernels.kv4_append import _rint

FORMATS = {"w4a8-fp8": 0, "w4a8-int8": 1, "lut": 2}
MAX_BLOCK = 128  # widest lazy block held in registers
# rows per program, warps: s43 on the H200, gate_up act-order, the kernel's GPU time: 14.5 ms of 48.8 (16 x 4);
# 4 x 1 13.0, 8 x 1 13.6, 16 x 1 20.2, 32 x 4 20.0, 64 x 4 21.5
BLOCK_R = 16
NUM_WARPS = 4


@triton.jit
def _rne(v):
    """``torch.round`` of fp32 ``|v| < 2^22``: ties to even, a zero result with v's sign."""
    r = _rint(v)
    return tl.where(r == 0.0, v * 0.0, r)


@triton.jit
def _qdq(w, p0, p1, s1, TS, MIDS, d, inv_d, FORMAT: tl.constexpr, NM: tl.constexpr):
    """The grid's quantize-dequantize of the column ``w`` [BLOCK_R] under per-row parameters (module docstring)."""
    if FORMAT == 0:
        pos = p0 > 0.0
        q = tl.where(pos, _rne(tl.clamp(tl.div_rn(w * d, tl.where(pos, p0, 1.0)), -7.0, 7.0)), 0.0)
        out = round_to_fp8_e4m3(tl.clamp(q * p0, -448.0, 448.0)) * inv_d
    elif FORMAT == 1:
        q8 = _rne(tl.clamp(tl.div_rn(w, s1), -119.0, 119.0))
        q4 = tl.clamp(_rne(tl.div_rn(q8, p0)) + p1, 0.0, 15.0)
        out = ((q4 - p1) * p0) * s1
    else:
        mids = tl.load(MIDS + tl.arange(0, NM))
        idx = tl.sum((tl.div_rn(w, p0)[:, None] > mids[None, :]).to(tl.int32), axis=1)
        out = tl.load(TS + idx) * p0
    return out


@triton.jit
def _gptq_block_kernel(
    W, Q, E, U, P0, P1, S1, TS, MIDS, GIDX,  # pointers (module docstring)
    N, K, b0, nb, c0, c1, stride_e, stride_p, d, inv_d,
    FORMAT: tl.constexpr, PER_COL: tl.constexpr, NM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_B)
    inb = cols < nb
    woff = r64[:, None] * K + b0 + cols[None, :]
    tile = tl.load(W + woff, mask=rmask[:, None] & inb[None, :], other=0.0)
    prow, p1row = P0 + r64 * stride_p, P1 + r64 * stride_p
    p0 = tl.load(prow, mask=rmask, other=1.0)
    p1 = p0
    s1 = p0
    if FORMAT == 1:
        p1 = tl.load(p1row, mask=rmask, other=0.0)
        s1 = tl.load(S1 + rows, mask=rmask, other=1.0)
    qrow = Q + r64 * K + b0
    erow = E + r64 * stride_e
    ucol = U + b0 + cols  # + (b0 + j) K: row b0 + j of U at the block's columns
    last = tl.where(inb, cols, -1)  # (columns beyond the block: never >= j)
    for j in range(c0, c1):
        col = (b0 + j).to(tl.int64)
        urow = ucol + col * K
        if PER_COL:
            g = tl.load(GIDX + col)
            p0 = tl.load(prow + g, mask=rmask, other=1.0)
            if FORMAT == 1:
                p1 = tl.load(p1row + g, mask=rmask, other=0.0)
        wj = tl.sum(tl.where((cols == j)[None, :], tile, -0.0), axis=1)
        qj = _qdq(wj, p0, p1, s1, TS, MIDS, d, inv_d, FORMAT, NM)
        e = tl.div_rn(wj - qj, tl.load(U + col * (K + 1)))
        tile = tile - e[:, None] * tl.load(urow, mask=last >= j, other=0.0)[None, :]
        tl.store(qrow + j, qj, mask=rmask)
        tl.store(erow + j, e, mask=rmask)
    if c1 < nb:
        tl.store(W + woff, tile, mask=rmask[:, None] & (last >= c1)[None, :])


def lut_tables(table: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A LUT grid's table -> (the entries sorted ascending, float32 ``[T]``; the midpoints of neighbours, float32,
    padded with +inf to a power of two), as ``lowbit.formats.lut.nearest_codes`` computes them, on ``device``."""
    ts, _, mids = sorted_midpoints(table, device)
    nm = triton.next_power_of_2(max(mids.numel(), 1))
    return ts, torch.nn.functional.pad(mids, (0, nm - mids.numel()), value=float("inf"))


def gptq_block_triton(w: torch.Tensor, u: torch.Tensor, q: torch.Tensor, e: torch.Tensor, b0: int, c0: int,
                      c1: int, fmt: str, p0: torch.Tensor, p1: torch.Tensor | None = None, *,
                      s1: torch.Tensor | None = None, tables: tuple | None = None, pts_exp: int = 0,
                      gidx: torch.Tensor | None = None, block_r: int | None = None,
                      num_warps: int | None = None) -> None:
    """Columns ``b0 + c0 .. b0 + c1 - 1`` of GPTQ's loop over the block ``[b0, b0 + nb)``, ``nb = e.shape[1]``
    (module docstring): updates ``w`` [N, K] in place, writes those columns of ``q`` [N, K] and of ``e`` [N, nb].
    ``u`` [K, K]; all float32, contiguous. ``fmt`` in ``FORMATS``; ``p0`` / ``p1`` [N, G] float32 group parameters
    (sigma; s2, z; the LUT scale), at group ``gidx[col]`` (int32 [K]) if given, else at group 0; ``s1`` [N]
    (``w4a8-int8``), ``tables`` (``lut_tables``, ``lut``), ``pts_exp`` (``w4a8-fp8``); ``block_r`` rows per
    program and ``num_warps`` (default ``BLOCK_R`` / ``NUM_WARPS``, read at the call)."""
    n, k = w.shape
    nb = e.shape[1]
    for t, name in ((w, "w"), (q, "q"), (u, "u"), (e, "e")):
        check_tensor(t, name, dtype=torch.float32, ndim=2, contiguous=True)
    if q.shape != w.shape or u.shape != (k, k) or e.shape[0] != n or not 0 < nb <= MAX_BLOCK or b0 + nb > k:
        raise ValueError(f"gptq_block: w {list(w.shape)}, q {list(q.shape)}, u {list(u.shape)}, e {list(e.shape)} "
                         f"(block width <= {MAX_BLOCK}) do not fit at column {b0}")
    if not 0 <= c0 < c1 <= nb:
        raise ValueError(f"gptq_block: segment [{c0}, {c1}) is not inside the block of {nb} columns")
    if p0.dtype != torch.float32 or p0.ndim != 2 or p0.shape[0] != n or p0.stride(1) != 1:
        raise ValueError(f"gptq_block: p0 must be float32 [N, G] with unit column stride, got {p0.dtype} "
                         f"{list(p0.shape)}")
    p1 = p0 if p1 is None else p1
    if p1.dtype != torch.float32 or p1.shape != p0.shape or p1.stride() != p0.stride():
        raise ValueError("gptq_block: p1 must be float32 with p0's shape and strides")
    if fmt not in FORMATS or (fmt == "w4a8-int8") != (s1 is not None) or (fmt == "lut") != (tables is not None):
        raise ValueError(f"gptq_block: fmt must be one of {tuple(FORMATS)}, with s1 for w4a8-int8 and tables for lut; "
                         f"got {fmt!r}")
    if gidx is not None:
        check_tensor(gidx, "gidx", dtype=torch.int32, shape=(k,))
    check_same_device(w=w, u=u, q=q, e=e, p0=p0, p1=p1, s1=s1, gidx=gidx)
    ts, mids = tables if tables is not None else (p0, p0)
    if n == 0:
        return
    d = 2.0 ** pts_exp
    block_r, num_warps = block_r or BLOCK_R, num_warps or NUM_WARPS
    _gptq_block_kernel[(cdiv(n, block_r),)](
        w, q, e, u, p0, p1, s1 if s1 is not None else p0, ts, mids, gidx if gidx is not None else p0,
        n, k, b0, nb, c0, c1, e.stride(0), p0.stride(0), d, 1.0 / d,
        FORMAT=FORMATS[fmt], PER_COL=gidx is not None, NM=mids.numel() if tables is not None else 1,
        BLOCK_R=block_r, BLOCK_B=triton.next_power_of_2(nb), num_warps=num_warps, enable_fp_fusion=False)
