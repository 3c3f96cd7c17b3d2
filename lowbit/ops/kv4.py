"""Paged KV cache ops: ``lowbit::kv4_append`` (RoPE + CRS + quantize + paged write),
``lowbit::decode_kv4`` (decode attention over the paged INT4 cache) and ``lowbit::decode_float``
(the same over the unquantized bf16 / fp16 pages, ``k, v [num_pages, Hkv, PAGE, D]``), with their
plain-PyTorch references (same numerics, used on CPU and by the tests).

Cache tensors (one layer; see ``lowbit.nn.kv_cache.PagedKVCache``)::

    k_codes, v_codes  uint8 [num_pages, Hkv, PAGE, D/2]   (lowbit.formats.kv4 packing)
    k_scale, v_scale  [num_pages, Hkv, PAGE]              float8_e4m3fn | bfloat16 | float32
    k_zero,  v_zero   uint8 [num_pages, Hkv, PAGE] or None (None: symmetric 'kv4'; else 'kv4-zp')
    page_table        int32 [B, max_pages]                 physical page of each logical page
    start / lengths   int32 [B]                            tokens cached before the append / after

RoPE: ``x * cos + rotate(x) * sin`` in fp32 with transformers' cos/sin ``[B, T, D]``; ``rotate``
pairs (i, i + D/2) ("half", Llama) or (2i, 2i+1) ("interleaved"). CRS (FireQ §1.9): keys are
multiplied by ``crs_k [Hkv, D]`` after RoPE, queries by ``crs_q = 1 / crs_k`` after RoPE (inside
the decode kernel), so ``q . k`` is unchanged up to quantization.
"""
from __future__ import annotations

from typing import Optional

import torch

from lowbit._utils import (by_batch, check_indices, check_int, check_page_reads, check_page_writes, check_same_device,
                           check_sm_scale, check_tensor, run_op, use_triton)
from lowbit.formats.common import int8_planes
from lowbit.formats.kv4 import SCALE_DTYPES, dequantize_kv4, quantize_kv4
from lowbit.ops.attention import attention_ref

__all__ = ["rope_ref", "kv4_append", "kv4_quantize", "kv4_append_ref", "decode_kv4", "decode_kv4_ref",
           "gather_kv4", "gather_pages", "decode_float", "decode_float_ref"]


def rotate(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE's rotation partner: half: [-x2, x1]; interleaved: (-x[2i+1], x[2i])."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
             eager: bool = False) -> torch.Tensor:
    """x ``[B, H, T, D]``, cos/sin ``[B, T, D]`` -> fp32 ``x * cos + rotate(x) * sin``. ``eager``: in x's dtype,
    each op rounded as transformers' eager ops compute it (the bits ``lowbit.kernels.rope`` reproduces)."""
    xf = x if eager else x.float()
    c, s = cos.to(xf.dtype).unsqueeze(1), sin.to(xf.dtype).unsqueeze(1)
    return xf * c + rotate(xf, interleaved) * s


def _write_slots(dst: torch.Tensor, x: torch.Tensor, page: torch.Tensor, off: torch.Tensor) -> None:
    """The append references' paged write: ``x [B, H, T, ...]`` to ``dst[page[b, t], h, off[b, t]]`` (``_slots``)."""
    B, H, T = x.shape[:3]
    dst[page[:, None, :].expand(B, H, T), torch.arange(H, device=dst.device)[None, :, None].expand(B, H, T),
        off[:, None, :].expand(B, H, T)] = x.to(dst.dtype)


def _slots(page_table, start, T, page_size):
    """[B, T] (page, offset) of the new tokens."""
    pos = start.long().unsqueeze(1) + torch.arange(T, device=start.device)
    page = torch.gather(page_table.long(), 1, pos // page_size)
    return page, pos % page_size


def kv4_append_ref(k, v, k_codes, k_scale, v_codes, v_scale, page_table, start, *, cos=None, sin=None,
                   crs_k=None, k_zero=None, v_zero=None, interleaved=False) -> None:
    """Reference of ``kv4_append`` (writes the cache tensors in place)."""
    kf = rope_ref(k, cos, sin, interleaved=interleaved) if cos is not None else k.float()
    if crs_k is not None:
        kf = kf * crs_k.float()[None, :, None, :]
    zp = k_zero is not None
    page, off = _slots(page_table, start, k.shape[2], k_codes.shape[2])  # [B, T]
    for x, codes, scale, zero in ((kf, k_codes, k_scale, k_zero), (v.float(), v_codes, v_scale, v_zero)):
        c, s, z = quantize_kv4(x, zero_point=zp, scale_dtype=scale.dtype)  # [B, H, T, ...]
        _write_slots(codes, c, page, off)
        _write_slots(scale, s, page, off)
        if zp:
            _write_slots(zero, z, page, off)


def gather_pages(t, page_table_row, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a paged pool ``t [num_pages, Hkv, PAGE, ...]``,
    as ``[Hkv, length, ...]`` (reference path)."""
    P = t.shape[2]
    pos = torch.arange(length, device=t.device)
    return t[page_table_row.long()[pos // P], :, pos % P].transpose(0, 1)


def gather_kv4(codes, scale, zero, page_table_row, length: int, *, dtype=torch.float32) -> torch.Tensor:
    """Dequantized ``[Hkv, length, D]`` of one sequence (reference path)."""
    c, s = gather_pages(codes, page_table_row, length), gather_pages(scale, page_table_row, length)
    z = gather_pages(zero, page_table_row, length) if zero is not None else None
    return dequantize_kv4(c, s, z, dtype=dtype)


def decode_kv4_ref(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, *, k_zero=None, v_zero=None,
                   crs_q=None, sm_scale=None, q_int8=False) -> torch.Tensor:
    """Reference of ``decode_kv4``: dequantize each sequence's pages and run ``attention_ref``
    (float64, bottom-right causal). Returns q's dtype. ``q_int8``: Q (after CRS) rounded to INT8
    per row first, ``floor(q * 127 / absmax + 0.5) * absmax / 127`` (the kernel's QK8 numerics);
    ``q_int8=2``: two INT8 planes, ``u = q * 127 / absmax``, ``hi = floor(u + 0.5)``,
    ``lo = floor((u - hi) * 254 + 0.5)``, Q = ``(hi + lo / 254) * absmax / 127``."""
    B, Hq, TQ, D = q.shape
    Hkv = k_codes.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(lengths[b])
        kb = gather_kv4(k_codes, k_scale, k_zero, page_table[b], L, dtype=torch.float64)
        vb = gather_kv4(v_codes, v_scale, v_zero, page_table[b], L, dtype=torch.float64)
        qb = q[b].double()
        if crs_q is not None:
            qb = qb * crs_q.double().repeat_interleave(Hq // Hkv, dim=0)[:, None, :]
        if int(q_int8) == 2:
            hi, lo, qmax = int8_planes(qb, eps=1e-30)
            qb = (hi.double() + lo.double() / 254.0) * qmax.double()[..., None] / 127.0
        elif q_int8:
            qf = qb.float()
            qmax = qf.abs().amax(-1, keepdim=True).clamp_min(1e-30)
            qb = (torch.floor(qf / qmax * 127.0 + 0.5).double() * qmax.double() / 127.0)
        out[b] = attention_ref(qb[None], kb[None], vb[None], causal=True, sm_scale=sm_scale)[0].to(q.dtype)
    return out


def decode_float_ref(q, k, v, page_table, lengths, *, sm_scale=None) -> torch.Tensor:
    """Reference of ``decode_float``: each sequence's pages gathered and ``attention_ref`` (float64,
    bottom-right causal) on Q rounded to the cache dtype (the kernel's Q); returns q's dtype."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        L = int(lengths[b])
        kb, vb = gather_pages(k, page_table[b], L), gather_pages(v, page_table[b], L)  # [Hkv, L, D]
        qb = q[b].to(k.dtype)
        out[b] = attention_ref(qb[None], kb[None], vb[None], causal=True, sm_scale=sm_scale)[0].to(q.dtype)
    return out


# Decode numerics of Q: 2 = two INT8 planes per row (~15 bits; the INT8 tensor-core QK^T at fp16-Q accuracy),
# 1 = one INT8 plane (FireQ's 8-bit Q; 5e-2 extra error with outlier channels), 0 = fp16 (row-normalised).
# Equal to ``lowbit.kernels.decode_kv4.DEFAULT_QK8`` (tested); the CPU reference follows it too.
Q_INT8_DEFAULT = 2

# ---- torch.library ops --------------------------------------------------------------------------

@torch.library.custom_op("lowbit::kv4_append", mutates_args=("k_codes", "k_scale", "v_codes", "v_scale", "k_zero", "v_zero"))
def _kv4_append(k: torch.Tensor, v: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                v_codes: torch.Tensor, v_scale: torch.Tensor, page_table: torch.Tensor, start: torch.Tensor,
                cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], crs_k: Optional[torch.Tensor],
                k_zero: Optional[torch.Tensor], v_zero: Optional[torch.Tensor], interleaved: bool) -> None:
    kw = dict(cos=cos, sin=sin, crs_k=crs_k, k_zero=k_zero, v_zero=v_zero, interleaved=interleaved)
    if use_triton(k, k_codes):
        from lowbit.kernels.kv4_append import kv4_append_triton

        kv4_append_triton(k, v, k_codes, k_scale, v_codes, v_scale, page_table, start, **kw)
    else:
        kv4_append_ref(k, v, k_codes, k_scale, v_codes, v_scale, page_table, start, **kw)


@_kv4_append.register_fake
def _(k, v, k_codes, k_scale, v_codes, v_scale, page_table, start, cos, sin, crs_k, k_zero, v_zero, interleaved):
    return None


@torch.library.custom_op("lowbit::kv4_quantize", mutates_args=())
def _kv4_quantize(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kv4_quantize``'s op: the Triton launch for power-of-two D >= 16, else the reference."""
    D = k.shape[-1]
    if use_triton(k, v) and D >= 16 and not D & (D - 1):
        from lowbit.kernels.kv4_append import kv4_quantize_triton

        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        return by_batch(lambda k_, v_: kv4_quantize_triton(k_, v_)[:4], k.shape[1], k, v)
    kc, ks, _ = quantize_kv4(k)
    vc, vs, _ = quantize_kv4(v)
    return kc, ks, vc, vs


@_kv4_quantize.register_fake
def _(k, v):
    B, H, S, D = k.shape
    codes = k.new_empty(B, H, S, D // 2, dtype=torch.uint8)
    scale = k.new_empty(B, H, S, dtype=torch.float8_e4m3fn)
    return codes, scale, torch.empty_like(codes), torch.empty_like(scale)


def kv4_quantize(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric KV4 (FP8 E4M3 scales) of whole dense sequences ``k, v [B, Hkv, S, D]`` (D even):
    ``(k_codes, k_scale, v_codes, v_scale)``, codes uint8 ``[B, Hkv, S, D/2]`` and scales ``[B, Hkv, S]``;
    bit for bit ``lowbit.formats.kv4.quantize_kv4``. One Triton launch (``kv4_append.kv4_quantize_triton``: tiles of
    tokens, the append kernel's row numerics) where D is a power of two >= 16, else that reference."""
    check_tensor(k, "k", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=4)
    check_tensor(v, "v", dtype=k.dtype, shape=list(k.shape))
    if k.shape[-1] % 2 or k.shape[-1] < 2:
        raise ValueError(f"kv4 needs an even head_dim >= 2, got {k.shape[-1]}")
    if v.device != k.device:
        raise ValueError(f"v must be on {k.device}, got {v.device}")
    return run_op(_kv4_quantize, k, v)


@torch.library.custom_op("lowbit::decode_kv4", mutates_args=())
def _decode_kv4(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                v_scale: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                k_zero: Optional[torch.Tensor], v_zero: Optional[torch.Tensor], crs_q: Optional[torch.Tensor],
                sm_scale: float, max_len: int, num_splits: int, q_int8: int) -> torch.Tensor:
    kw = dict(k_zero=k_zero, v_zero=v_zero, crs_q=crs_q, sm_scale=sm_scale)
    if use_triton(q, k_codes):
        from lowbit.kernels.decode_kv4 import decode_kv4_triton

        return decode_kv4_triton(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths,
                                 max_len=min(max_len or cap, cap) if (cap := page_table.shape[1] * k_codes.shape[2]) else 0,
                                 num_splits=num_splits or None, qk_int8=q_int8, **kw)
    return decode_kv4_ref(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, q_int8=q_int8, **kw)


@_decode_kv4.register_fake
def _(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, k_zero, v_zero, crs_q, sm_scale, max_len, num_splits,
      q_int8):
    return torch.empty_like(q)


# ---- public functions ---------------------------------------------------------------------------

@torch.library.custom_op("lowbit::decode_float", mutates_args=())
def _decode_float(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                  sm_scale: float, max_len: int, num_splits: int) -> torch.Tensor:
    if use_triton(q, k) and k.dtype in (torch.float16, torch.bfloat16):  # fp32 pages: the reference
        from lowbit.kernels.decode_float import decode_float_triton

        cap = page_table.shape[1] * k.shape[2]
        return decode_float_triton(q, k, v, page_table, lengths, sm_scale=sm_scale,
                                   max_len=min(max_len or cap, cap), num_splits=num_splits or None)
    return decode_float_ref(q, k, v, page_table, lengths, sm_scale=sm_scale)


@_decode_float.register_fake
def _(q, k, v, page_table, lengths, sm_scale, max_len, num_splits):
    return torch.empty_like(q)


def _check_float_cache(k, v, D: int, dtypes: tuple) -> tuple[int, int]:
    """Checks of the float pages ``k, v [num_pages, Hkv, PAGE, D]`` shared by the float-cache decode ops (a dtype of
    ``dtypes``, one shape, head dim ``D`` a power of two >= 16, PAGE a multiple of 16, unit stride along D) ->
    (Hkv, PAGE)."""
    check_tensor(k, "k", dtype=dtypes, ndim=4)
    check_tensor(v, "v", dtype=k.dtype, shape=list(k.shape))
    _, Hkv, PAGE, Dk = k.shape
    if Dk != D or D < 16 or D & (D - 1):
        raise ValueError(f"k's head dim ({Dk}) must equal q's ({D}) and be a power of two >= 16")
    if PAGE % 16:
        raise ValueError(f"the page size (k.shape[2] = {PAGE}) must be a multiple of 16")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have unit stride along the head dim")
    check_same_device(k=k, v=v)
    return Hkv, PAGE


def decode_float_append_ref(q, k_new, v_new, k, v, page_table, lengths, *, cos, sin, sm_scale=None) -> torch.Tensor:
    """Reference of ``decode_float_append``: q and the new keys rotated (``rope_ref(eager=True)``), the new keys /
    values written to slots ``lengths - TQ + t`` of the float pages ``k``, ``v`` (in place), then
    ``decode_float_ref``."""
    TQ = q.shape[2]
    page, off = _slots(page_table, lengths - TQ, TQ, k.shape[2])
    _write_slots(k, rope_ref(k_new, cos, sin, eager=True), page, off)
    _write_slots(v, v_new, page, off)
    return decode_float_ref(rope_ref(q, cos, sin, eager=True), k, v, page_table, lengths, sm_scale=sm_scale)


@torch.library.custom_op("lowbit::decode_float_append", mutates_args=("k", "v"))
def _decode_float_append(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         page_table: torch.Tensor, lengths: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         sm_scale: float, max_len: int, num_splits: int) -> torch.Tensor:
    if use_triton(q, k):
        from lowbit.kernels.decode_float import decode_float_append_triton

        cap = page_table.shape[1] * k.shape[2]
        return decode_float_append_triton(q, k_new, v_new, k, v, page_table, lengths, cos=cos, sin=sin,
                                          sm_scale=sm_scale, max_len=min(max_len or cap, cap),
                                          num_splits=num_splits or None)
    return decode_float_append_ref(q, k_new, v_new, k, v, page_table, lengths, cos=cos, sin=sin, sm_scale=sm_scale)


@_decode_float_append.register_fake
def _(q, k_new, v_new, k, v, page_table, lengths, cos, sin, sm_scale, max_len, num_splits):
    return torch.empty_like(q)


def decode_float_append(q, k_new, v_new, k, v, page_table, lengths, *, cos, sin, sm_scale=None, max_len: int = 0,
                        num_splits: int = 0) -> torch.Tensor:
    """One decode step over a paged float cache whose TQ new tokens are not in it yet (session 27; the fast
    runner's step): ``q [B, Hq, TQ, D]`` and ``k_new`` / ``v_new [B, Hkv, TQ, D]`` pre-RoPE, half-split ``cos`` /
    ``sin [B, TQ, D]``; the new keys (rotated) and values are written to slots ``lengths[b] - TQ + t`` of ``k``,
    ``v [num_pages, Hkv, PAGE, D]`` (``lengths`` counts them) and O ``[B, Hq, TQ, D]`` is returned, attending
    causally among the new tokens. The same bits as ``float_append`` + ``decode_float`` with q rotated by the
    append (one launch instead of three: ``lowbit.kernels.decode_float``). bf16 / fp16 only."""
    check_tensor(q, "q", dtype=(torch.float16, torch.bfloat16), ndim=4)
    B, Hq, TQ, D = q.shape
    Hkv, PAGE = _check_float_cache(k, v, D, (q.dtype,))
    check_tensor(k_new, "k_new", dtype=q.dtype, shape=[B, Hkv, TQ, D])
    check_tensor(v_new, "v_new", dtype=q.dtype, shape=[B, Hkv, TQ, D])
    check_tensor(cos, "cos", shape=[B, TQ, D])
    check_tensor(sin, "sin", shape=[B, TQ, D])
    q, sm_scale, max_len, num_splits = _check_decode_args(q, k, page_table, lengths, sm_scale, max_len, num_splits,
                                                          "decode_float_append")
    check_same_device(q=q, k_new=k_new, v_new=v_new, v=v, cos=cos, sin=sin)
    k_new = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
    v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
    if check_indices(lengths, page_table):  # (on CUDA only under LOWBIT_CHECK_INDEX: no extra launch in a graph)
        check_page_writes(lengths - TQ, page_table, TQ, PAGE, k.shape[0])  # "start" = lengths - TQ
        check_page_reads(lengths, page_table, PAGE, k.shape[0])
    return run_op(_decode_float_append, q, k_new, v_new, k, v, page_table, lengths, cos.to(q.dtype), sin.to(q.dtype),
                  sm_scale, max_len, num_splits)


def _check_cache(k_codes, k_scale, v_codes, v_scale, k_zero, v_zero, head_dim):
    check_tensor(k_codes, "k_codes", dtype=torch.uint8, ndim=4, contiguous=True)
    P, H, PAGE, HALF = k_codes.shape
    if HALF * 2 != head_dim:
        raise ValueError(f"k_codes last dim must be head_dim/2 = {head_dim // 2}, got {HALF}")
    check_tensor(v_codes, "v_codes", dtype=torch.uint8, shape=[P, H, PAGE, HALF], contiguous=True)
    check_tensor(k_scale, "k_scale", dtype=SCALE_DTYPES, shape=[P, H, PAGE], contiguous=True)
    check_tensor(v_scale, "v_scale", dtype=k_scale.dtype, shape=[P, H, PAGE], contiguous=True)
    if (k_zero is None) != (v_zero is None):
        raise ValueError("k_zero and v_zero must both be given ('kv4-zp') or both be None ('kv4')")
    if k_zero is not None:
        check_tensor(k_zero, "k_zero", dtype=torch.uint8, shape=[P, H, PAGE], contiguous=True)
        check_tensor(v_zero, "v_zero", dtype=torch.uint8, shape=[P, H, PAGE], contiguous=True)
    if PAGE & (PAGE - 1) or PAGE < 16:
        raise ValueError(f"page size must be a power of two >= 16, got {PAGE}")
    check_same_device(k_codes=k_codes, k_scale=k_scale, v_codes=v_codes, v_scale=v_scale, k_zero=k_zero, v_zero=v_zero)
    return P, H, PAGE


def kv4_append(k, v, k_codes, k_scale, v_codes, v_scale, page_table, start, *, cos=None, sin=None,
               crs_k=None, k_zero=None, v_zero=None, interleaved=False) -> None:
    """Quantize new tokens ``k``/``v`` ``[B, Hkv, T, D]`` (k pre-RoPE when cos/sin are given) and
    write them at positions ``start[b] .. start[b]+T-1`` of each sequence's pages. The pages must
    already be allocated in ``page_table``."""
    check_tensor(k, "k", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=4)
    B, H, T, D = k.shape
    check_tensor(v, "v", dtype=(torch.float16, torch.bfloat16, torch.float32), shape=[B, H, T, D])
    if D % 2 or D < 16 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
    _, Hc, PAGE = _check_cache(k_codes, k_scale, v_codes, v_scale, k_zero, v_zero, D)
    if Hc != H:
        raise ValueError(f"k has {H} heads but the cache has {Hc}")
    check_tensor(page_table, "page_table", dtype=torch.int32, ndim=2)
    check_tensor(start, "start", dtype=torch.int32, shape=[B])
    if page_table.shape[0] != B:
        raise ValueError(f"page_table must have {B} rows (one per sequence), got {page_table.shape[0]}")
    check_same_device(k=k, v=v, k_codes=k_codes, page_table=page_table, start=start, cos=cos, sin=sin, crs_k=crs_k)
    check_page_writes(start, page_table, T, PAGE, k_codes.shape[0])
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must be given together")
    if cos is not None:
        check_tensor(cos, "cos", shape=[None, T, D])
        check_tensor(sin, "sin", shape=list(cos.shape))
        if cos.shape[0] not in (1, B):
            raise ValueError(f"cos/sin batch dim must be 1 or {B}, got {cos.shape[0]}")
        cos, sin = cos.contiguous().expand(B, T, D), sin.contiguous().expand(B, T, D)
    if crs_k is not None:
        check_tensor(crs_k, "crs_k", shape=[H, D])
        crs_k = crs_k.float().contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    run_op(_kv4_append, k, v, k_codes, k_scale, v_codes, v_scale, page_table, start, cos, sin, crs_k,
                k_zero, v_zero, bool(interleaved))


def _check_decode_args(q, cache, page_table, lengths, sm_scale, max_len, num_splits, name: str, cache_name: str = "k"):
    """Checks shared by the decode ops: 1..16 query tokens, GQA grouping against the cache's KV heads
    (``cache [pages, Hkv, PAGE, ...]``, on q's device), int32 page table with one row per sequence and int32
    lengths (on q's device too), a positive finite ``sm_scale`` (None = 1/sqrt(D)), ``max_len`` and ``num_splits``
    ints >= 0 (0: automatic), ``max_len`` bounding ``lengths`` where they are checked (a ``max_len`` below them cut
    the keys read: a silently wrong output). Returns (q with unit stride along D, sm_scale, max_len, num_splits)."""
    B, Hq, TQ, D = q.shape
    Hkv = cache.shape[1]
    if not 1 <= TQ <= 16:
        raise ValueError(f"{name} takes 1..16 query tokens per sequence, got {TQ}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the cache's KV heads ({Hkv})")
    check_tensor(page_table, "page_table", dtype=torch.int32, ndim=2)
    check_tensor(lengths, "lengths", dtype=torch.int32, shape=[B])
    if page_table.shape[0] != B:
        raise ValueError(f"page_table must have {B} rows (one per sequence), got {page_table.shape[0]}")
    check_same_device(q=q, **{cache_name: cache}, page_table=page_table, lengths=lengths)
    sm_scale = check_sm_scale(sm_scale, D)
    max_len, num_splits = check_int(max_len, "max_len"), check_int(num_splits, "num_splits")
    if max_len and B and check_indices(lengths) and int(lengths.max()) > max_len:
        raise ValueError(f"max_len ({max_len}) must bound lengths (up to {int(lengths.max())}); 0 = read from lengths")
    return (q if q.stride(-1) == 1 else q.contiguous()), sm_scale, max_len, num_splits


def decode_kv4(q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, *, k_zero=None, v_zero=None,
               crs_q=None, sm_scale=None, max_len: int = 0, num_splits: int = 0, q_int8=None) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, TQ, D]`` (post-RoPE, TQ in 1..4, causal among the TQ new
    tokens, which must already be in the cache) over the paged KV4 cache. ``lengths[b]`` counts
    every cached token of sequence b. ``max_len`` (host int, optional) bounds ``lengths`` and
    sizes the split-KV grid without a device sync; ``num_splits`` 0 = automatic. ``q_int8``
    (None = ``Q_INT8_DEFAULT``): QK^T on the INT8 tensor cores with Q rounded to INT8 per row
    (FireQ's 8-bit Q; see ``lowbit.kernels.decode_kv4``), else fp16 Q; P, V and O as before."""
    check_tensor(q, "q", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=4)
    B, Hq, TQ, D = q.shape
    P, Hkv, PAGE = _check_cache(k_codes, k_scale, v_codes, v_scale, k_zero, v_zero, D)
    q, sm_scale, max_len, num_splits = _check_decode_args(q, k_codes, page_table, lengths, sm_scale, max_len,
                                                          num_splits, "decode_kv4", "k_codes")
    check_page_reads(lengths, page_table, PAGE, P)
    if crs_q is not None:
        check_tensor(crs_q, "crs_q", shape=[Hkv, D])
        crs_q = crs_q.float().contiguous()
    if q_int8 is None:
        q_int8 = Q_INT8_DEFAULT
    if q_int8 not in (0, 1, 2):
        raise ValueError(f"q_int8 must be False/0 (fp16 Q), True/1 (INT8 Q) or 2 (two INT8 planes), got {q_int8!r}")
    return run_op(_decode_kv4, q, k_codes, k_scale, v_codes, v_scale, page_table, lengths, k_zero, v_zero, crs_q,
                  sm_scale, max_len, num_splits, int(q_int8))


def decode_float(q, k, v, page_table, lengths, *, sm_scale=None, max_len: int = 0, num_splits: int = 0) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, TQ, D]`` (post-RoPE, TQ in 1..16, causal among the TQ new
    tokens, already in the cache) over a paged float cache ``k, v [num_pages, Hkv, PAGE, D]`` (bf16 or
    fp16 for the kernel; fp32 runs the reference; unit stride along D; PAGE a multiple of 16). ``lengths[b]`` counts every cached token of
    sequence b (ragged batches are fine); ``max_len`` (host int, optional) bounds it and sizes the
    split-KV grid without a device sync; ``num_splits`` 0 = automatic. Kernel:
    ``lowbit.kernels.decode_float``."""
    check_tensor(q, "q", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=4)
    Hkv, PAGE = _check_float_cache(k, v, q.shape[3], (torch.float16, torch.bfloat16, torch.float32))
    q, sm_scale, max_len, num_splits = _check_decode_args(q, k, page_table, lengths, sm_scale, max_len, num_splits,
                                                          "decode_float")
    check_page_reads(lengths, page_table, PAGE, k.shape[0])
    return run_op(_decode_float, q, k, v, page_table, lengths, sm_scale, max_len, num_splits)
