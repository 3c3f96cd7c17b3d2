"""SnapMLA data-path kernels (§3.3 layer 1, digest 2.6): Fused-K-Append, Fused-Q-Quant, Fused-Fetch-Dequant.

One kernel, ``_latent_quant_kernel``, quantizes rows ``x = [c | r]`` (content ``Dc`` + RoPE ``Dr``)
with the format of ``lowbit.formats.mla_fp8`` (``s = max(amax|c|, 1e-12) / 448`` fp32, ``ĉ = FP8(c/s)``,
``r̃ = BF16(r/s)``) and writes each row either in place order (``PAGED=False``: Fused-Q-Quant, one
row per (token, head) of the absorbed query) or to its cache slot (``PAGED=True``: Fused-K-Append,
quantize + scale-domain alignment + paged scatter in one launch, no intermediate buffer). With
``FP8=False`` the same kernel appends to a bf16/fp16 latent cache (a plain scattered copy).

``_latent_gather_kernel`` is Fused-Fetch-Dequant: it gathers the cached latents of each sequence
through the page table and dequantizes them in registers right after the load (``[ĉ s | r̃ s]``),
writing a dense bf16 ``[B, L, Dc + Dr]`` for the prefill / chunked-prefill path (whose attention
then runs in bf16, as in the paper: prefill compute is not FP8, digest 2.12 item 11).

Layouts: rows ``x [R, Dc + Dr]`` (last dim contiguous); cache content ``[slots, Dc]``, rope
``[slots, Dr]``, scale ``[slots]`` (fp32), slot = page * PAGE + offset; ``slots [R]`` int64.
Dc and Dr are powers of two (``lowbit.ops.mla`` pads or falls back otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode
from lowbit.kernels.act_quant import abs_or_inf, amax_floor, round_to_fp8_e4m3


@triton.jit
def _cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even. Triton 3.6's interpreter truncates fp32 -> bf16
    and mis-rounds fp32 -> fp8 across binades; under it the value is rounded first (bit tricks),
    so the cast is exact. On the GPU this is the plain cast (cvt.rn)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
        elif dtype == tl.float8e4nv:
            x = round_to_fp8_e4m3(x)
    return x.to(dtype)


@triton.jit
def _latent_quant_kernel(
    # pointers
    X, SLOT, C, R, S,
    # sizes
    NROWS, NSLOTS,
    # strides
    stride_x, stride_c, stride_r,
    # constexpr
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_T: tl.constexpr, FP8: tl.constexpr, PAGED: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < NROWS
    offs_c = tl.arange(0, DC)
    offs_r = tl.arange(0, DR)
    rows = offs_t.to(tl.int64)
    c = tl.load(X + rows[:, None] * stride_x + offs_c[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    r = tl.load(X + rows[:, None] * stride_x + DC + offs_r[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    if PAGED:  # slots outside the cache are not written (on the GPU the op does not read slots back to check)
        dst = tl.load(SLOT + offs_t, mask=t_ok, other=0)
        t_ok = t_ok & (dst >= 0) & (dst < NSLOTS)
    else:
        dst = rows
    if FP8:
        # lowbit.formats.common.safe_scale; IEEE divisions (div_rn) so the codes match the reference
        scale = amax_floor(tl.max(abs_or_inf(c), 1), 1e-12) * (1.0 / 448.0)  # NaN for a non-finite content
        inv = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        q = tl.minimum(tl.maximum(c * inv[:, None], -448.0), 448.0)
        tl.store(C + dst[:, None] * stride_c + offs_c[None, :], _cast(q, C.dtype.element_ty, INTERPRET),
                 mask=t_ok[:, None])
        tl.store(R + dst[:, None] * stride_r + offs_r[None, :], _cast(r * inv[:, None], R.dtype.element_ty, INTERPRET),
                 mask=t_ok[:, None])
        tl.store(S + dst, scale, mask=t_ok)
    else:
        tl.store(C + dst[:, None] * stride_c + offs_c[None, :], _cast(c, C.dtype.element_ty, INTERPRET), mask=t_ok[:, None])
        tl.store(R + dst[:, None] * stride_r + offs_r[None, :], _cast(r, R.dtype.element_ty, INTERPRET), mask=t_ok[:, None])


@triton.jit
def _latent_gather_kernel(
    # pointers
    C, R, S, PT, SEQ, OUT,
    # sizes
    L_OUT,
    # strides
    stride_c, stride_r, stride_pt, stride_ob, stride_ot,
    # constexpr
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_T: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(SEQ + b)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < seq_len
    o_ok = offs_t < L_OUT
    offs_c = tl.arange(0, DC)
    offs_r = tl.arange(0, DR)
    page = tl.load(PT + b * stride_pt + offs_t // PAGE, mask=t_ok, other=0)
    slot = page.to(tl.int64) * PAGE + offs_t % PAGE
    c = tl.load(C + slot[:, None] * stride_c + offs_c[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    r = tl.load(R + slot[:, None] * stride_r + offs_r[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    if FP8:  # dequantize in registers right after the load (Fused-Fetch-Dequant)
        s = tl.load(S + slot, mask=t_ok, other=0.0)
        c = c * s[:, None]
        r = r * s[:, None]
    base = OUT + b * stride_ob + offs_t[:, None].to(tl.int64) * stride_ot
    tl.store(base + offs_c[None, :], _cast(c, OUT.dtype.element_ty, INTERPRET), mask=o_ok[:, None])
    tl.store(base + DC + offs_r[None, :], _cast(r, OUT.dtype.element_ty, INTERPRET), mask=o_ok[:, None])


def _block_t(dc: int) -> int:
    if interpret_mode():
        return 4
    return max(1, min(16, 8192 // dc))


def latent_quant_triton(x: torch.Tensor, kv_lora_rank: int, *, out=None, slots=None, fp8: bool = True):
    """Quantize rows ``x [R, Dc+Dr]``. Without ``out``: returns new (content fp8 [R, Dc], scale fp32 [R],
    rope bf16 [R, Dr]) (Fused-Q-Quant). With ``out=(content, rope, scale)`` cache tensors and ``slots``
    [R] int64: scatters row i to slot ``slots[i]`` (Fused-K-Append; ``scale`` unused without fp8); a slot
    outside ``[0, content.shape[0])`` is skipped (the op raises for CPU slot tensors; on the GPU it does not
    read them back, so the kernel must not write out of bounds)."""
    Rn, D = x.shape
    dc, dr = kv_lora_rank, D - kv_lora_rank
    if out is None:
        c = torch.empty(Rn, dc, device=x.device, dtype=torch.float8_e4m3fn)
        r = torch.empty(Rn, dr, device=x.device, dtype=torch.bfloat16)
        s = torch.empty(Rn, device=x.device, dtype=torch.float32)
    else:
        c, r, s = out
    if Rn == 0:
        return c, s, r
    bt = _block_t(dc)
    dummy = s if s is not None else torch.empty(1, device=x.device, dtype=torch.float32)
    _latent_quant_kernel[(cdiv(Rn, bt),)](
        x, slots if slots is not None else dummy, c, r, dummy,
        Rn, c.shape[0], x.stride(0), c.stride(0), r.stride(0),
        DC=dc, DR=dr, BLOCK_T=bt, FP8=fp8, PAGED=slots is not None, INTERPRET=interpret_mode(), num_warps=4,
    )
    return c, s, r


def latent_gather_triton(content, rope, scale, page_table, seq_lens, max_len: int, *, page_size: int,
                         out_dtype=torch.bfloat16):
    """Gather + dequantize the cached latents: returns [B, max_len, Dc + Dr] in ``out_dtype``; rows
    at or beyond a sequence's length are zero."""
    B = page_table.shape[0]
    dc, dr = content.shape[-1], rope.shape[-1]
    out = torch.empty(B, max_len, dc + dr, device=content.device, dtype=out_dtype)
    if B == 0 or max_len == 0:
        return out
    bt = _block_t(dc)
    fp8 = scale is not None
    _latent_gather_kernel[(cdiv(max_len, bt), B)](
        content, rope, scale if fp8 else content, page_table, seq_lens, out,
        max_len, content.stride(0), rope.stride(0), page_table.stride(0), out.stride(0), out.stride(1),
        DC=dc, DR=dr, BLOCK_T=bt, PAGE=page_size, FP8=fp8, INTERPRET=interpret_mode(), num_warps=4,
    )
    return out
