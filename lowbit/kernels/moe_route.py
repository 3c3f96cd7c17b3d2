"""Routing kernels of a mixture-of-experts layer's grouped schedule (``lowbit.ops.moe``): the sort of the
(token, slot) pairs by expert before the grouped GEMMs, and the weighted sum back per token after them. Each is one
launch; their plain-PyTorch references (several launches each) are ``lowbit.ops.moe.route`` / ``combine``, which
they equal bit for bit.

``route``: ids ``[R = T k]`` (row-major ``top_k_index``) -> with ``key = clamp(id, 0, E)`` (an id < 0 sorts with
expert 0, an id >= E after the last expert; both are computed or skipped, and never added), the stable sort by key:
``pos [R]`` int32 (the sorted row of flat slot i: the number of slots j with ``(key_j, j) < (key_i, i)``),
``row_tok [R]`` int32 (``row_tok[pos_i] = i // k``, the token a sorted row reads) and ``offsets [E + 1]`` int32
(``offsets[e]`` = slots with key < e: expert e owns sorted rows ``[offsets[e], offsets[e + 1])``). One program; the
pairwise counts run over ``CHUNK`` slots at a time (O(R^2) compares: meant for decode's R <= a few hundred).

``combine``: per token t and column block, its slots in increasing sorted row (= increasing expert) order: ``y`` of
the slot's row (``Y`` in the output dtype, or the ``SPLIT`` FP32 partials of a split-K GEMM summed in split order
and rounded to it), ``yw = round(y * weight)``, ``acc = round(acc + yw)`` from 0, skipping slots whose id lies
outside ``[0, E)``; every rounding to the output dtype (the sparse schedule's ``(y * w).to(dtype)`` and bf16
``index_add_``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode
from lowbit.kernels.act_quant import round16

CHUNK = 32  # slots per step of the pairwise counts in route
BLOCK_H = 1024  # output columns per combine program


@triton.jit
def _route_kernel(
    Ids, Pos, RowTok, Offsets,  # pointers: ids [R], pos [R], row_tok [R], offsets [E + 1]
    R, E, KS,  # sizes: slots, experts, slots per token
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
):
    i = tl.arange(0, BLOCK_R)
    mi = i < R
    key = tl.minimum(tl.maximum(tl.load(Ids + i, mask=mi, other=0), 0), E).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    pos = tl.zeros([BLOCK_R], dtype=tl.int32)
    off = tl.zeros([BLOCK_E], dtype=tl.int32)
    for j0 in range(0, R, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        mj = j < R
        kj = tl.minimum(tl.maximum(tl.load(Ids + j, mask=mj, other=0), 0), E).to(tl.int32)
        before = ((kj[None, :] < key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < i[:, None])))
        pos += tl.sum((before & mj[None, :]).to(tl.int32), axis=1)
        off += tl.sum(((kj[None, :] < e[:, None]) & mj[None, :]).to(tl.int32), axis=1)
    tl.store(Pos + i, pos, mask=mi)
    tl.store(RowTok + pos, (i // KS).to(tl.int32), mask=mi)
    tl.store(Offsets + e, off, mask=e <= E)


@triton.jit
def _combine_kernel(
    Y, Pos, Ids, Wt, Out,  # pointers: y [R, H] (or FP32 partials [SPLIT, R, H]), pos / ids / weights [T, KS], out [T, H]
    H, R, E, KS,  # sizes
    stride_ym, stride_om,  # strides
    SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, EMU: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = cols < H
    s = tl.arange(0, BLOCK_S)
    ms = s < KS
    pos = tl.load(Pos + t * KS + s, mask=ms, other=0x3FFFFFFF)
    ids = tl.load(Ids + t * KS + s, mask=ms, other=-1)
    w = tl.load(Wt + t * KS + s, mask=ms, other=0.0).to(tl.float32)
    valid = ms & (ids >= 0) & (ids < E)
    rank = tl.sum((pos[None, :] < pos[:, None]).to(tl.int32), axis=1)  # order of the slot's row (rows distinct)
    DT = Out.dtype.element_ty
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for jj in tl.static_range(BLOCK_S):
        sel = (rank == jj) & ms
        row = tl.sum(tl.where(sel, pos, 0)).to(tl.int64)
        wj = tl.sum(tl.where(sel, w, 0.0))
        if tl.sum((sel & valid).to(tl.int32)) > 0:
            if SPLIT == 1:
                y = tl.load(Y + row * stride_ym + cols, mask=mh, other=0.0).to(tl.float32)
            else:
                y = tl.zeros([BLOCK_H], dtype=tl.float32)
                for p in tl.static_range(SPLIT):
                    y += tl.load(Y + (p * R + row) * H + cols, mask=mh, other=0.0)
                y = round16(y, DT, EMU)
            acc = round16(acc + round16(y * wj, DT, EMU), DT, EMU)
    tl.store(Out + t.to(tl.int64) * stride_om + cols, acc.to(DT), mask=mh)


def route_triton(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``top_k_index [T, k]`` -> (pos int32 ``[T k]``, row_tok int32 ``[T k]``, offsets int32 ``[E + 1]``)."""
    ids = top_k_index.reshape(-1)
    R = ids.numel()
    dev = ids.device
    pos = torch.empty(R, dtype=torch.int32, device=dev)
    row_tok = torch.empty(R, dtype=torch.int32, device=dev)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    _route_kernel[(1,)](ids, pos, row_tok, offsets, R, num_experts, top_k_index.shape[1],
                        BLOCK_R=triton.next_power_of_2(max(R, 1)), BLOCK_E=triton.next_power_of_2(num_experts + 1),
                        CHUNK=CHUNK, num_warps=8)
    return pos, row_tok, offsets


def combine_triton(y: torch.Tensor, pos: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """``y``: the sorted rows' outputs ``[R, H]`` in ``dtype``, or a split-K GEMM's FP32 partials ``[S, R, H]``;
    ``pos`` from ``route_triton`` -> ``[T, H]`` in ``dtype`` (module docstring)."""
    T, k = top_k_index.shape
    split = y.shape[0] if y.dim() == 3 else 1
    R, H = y.shape[-2], y.shape[-1]
    out = torch.empty((T, H), dtype=dtype, device=y.device)
    if T and H:
        _combine_kernel[(T, cdiv(H, BLOCK_H))](
            y, pos, top_k_index, top_k_weights, out, H, R, num_experts, k, y.stride(-2), out.stride(0),
            SPLIT=split, BLOCK_S=triton.next_power_of_2(k), BLOCK_H=BLOCK_H, EMU=interpret_mode(), num_warps=4)
    return out
