"""Fused KV4 append: RoPE + CRS + INT4 quantization + paged write of new K/V tokens (FireQ §1.6-1.9).

For each new token t of sequence b and KV head h (one program per (b, t), h)::

    k_rot = k * cos + rotate(k) * sin          (RoPE, fp32; half-split pairs (i, i + D/2), or
                                                interleaved pairs (2i, 2i+1); optional)
    k_crs = k_rot * crs_k[h]                   (CRS, post-RoPE per-channel scales; optional)
    (codes, scale, zero) = quantize_kv4(k_crs) (lowbit.formats.kv4: symmetric or zero-point)
    v: the same quantization, no RoPE and no CRS

and the row is written to slot ``pos = start[b] + t`` of sequence b:
``page = page_table[b, pos // PAGE]``, ``offset = pos % PAGE``. The numerics are those of
``lowbit.formats.kv4`` (FP8 scale floor 2^-9, subnormal scales rounded up, codes from the stored
scale with an IEEE division and round-half-even). The row is read as its even and odd channels,
which are exactly the low and high nibbles of the packed bytes, so packing is one OR.

Layouts: k, v ``[B, Hkv, T, D]`` (any strides, last dim contiguous); cos, sin ``[B, T, D]``
(transformers' layout: ``cos[..., i] == cos[..., i + D/2]`` for half-split RoPE); crs_k fp32
``[Hkv, D]``; cache tensors as in ``lowbit.kernels.decode_kv4``; start int32 ``[B]``.

``FLOAT`` (``float_append_triton``): the same launch for the float pages of numerics ``'bf16'``
(``lowbit.kernels.decode_float``'s layout ``[num_pages, Hkv, PAGE, D]``; the fast runner's dense cache
is one page per sequence). k is rotated with the half-precision rounding of ``lowbit.kernels.rope``
(what transformers' eager ops store in a bf16/fp16 cache: bit for bit the runner's unfused path),
v is copied; with ``ROPE_Q`` the query heads are rotated in the same launch. At decode this replaces
the rope launch and the two ``index_put`` writes of every layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import check_page_writes
from lowbit.kernels.act_quant import abs_or_inf, div_fast, round_to_fp8_e4m3
from lowbit.kernels.rope import norm_args, rms_pair, rope_row

# warps per program when the append also rotates q (``ROPE_Q``, models area); 1 otherwise. R13 model A/B
# (fireq, ROPE_Q + PDL, tokens/s): B=1 1k 375 (1 warp) vs 383 (4 warps), 8k 366 vs 366, B=16 1k 4970 vs 4948.
ROPE_Q_WARPS = 4
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + M) - M rounds |y| < 2^22 to an integer, ties to even


@triton.jit
def _rint(y):
    """``torch.round`` of fp32 ``|y| < 2^22``: to an integer, ties to even (``_RNE_MAGIC``)."""
    return (y + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def _ceil_to_grid(s, STEPS: tl.constexpr):
    """``lowbit.formats.kv4.ceil_to_grid``: s (fp32, > 0, normal) = m * 2^e, m in [1, 2) rounded up to a multiple of
    1 / STEPS (8: E4M3's mantissa, 128: bf16's); exact."""
    p = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2^e
    return tl.ceil((s / p) * STEPS) / STEPS * p


@triton.jit
def _no_clip(sn, su, lo, hi):
    """``kv4-zp``: the nearest scale ``sn`` unless ``rint(hi / sn) + rint(-lo / sn) > 15`` (the top code would clip),
    then ``su`` (``lowbit.formats.kv4``)."""
    return tl.where(_rint(tl.div_rn(hi, sn)) + _rint(tl.div_rn(-lo, sn)) > 15.0, su, sn)


@triton.jit
def _col(s, AXIS: tl.constexpr):
    """A per-row value broadcast against the row's elements: as is (one row, ``AXIS`` 0), or ``s[:, None]``."""
    if AXIS == 1:
        return s[:, None]
    else:
        return s


@triton.jit
def quantize_row(xe, xo, ZERO_POINT: tl.constexpr, SCALE_KIND: tl.constexpr, AXIS: tl.constexpr = 0,
                  FAST: tl.constexpr = False):
    """Even/odd halves of one row (fp32, ``[HALF]``; or of a tile of rows ``[R, HALF]`` with ``AXIS`` 1) ->
    (packed bytes uint8, scale fp32 (exactly the stored value), zero fp32), per row. Numerics of
    ``lowbit.formats.kv4.quantize_kv4``. ``FAST`` (GPU only): ``x / s`` as ``act_quant.div_fast`` from the row's
    correctly rounded reciprocal (3 FP ops, the same IEEE quotient) instead of ``div_rn`` per element."""
    # a row with an Inf or a NaN: amax = inf (``abs_or_inf``), and the scale becomes NaN below
    amax = tl.maximum(tl.max(abs_or_inf(xe), axis=AXIS), tl.max(abs_or_inf(xo), axis=AXIS))
    if ZERO_POINT:
        lo = tl.minimum(tl.minimum(tl.min(xe, axis=AXIS), tl.min(xo, axis=AXIS)), 0.0)
        hi = tl.maximum(tl.maximum(tl.max(xe, axis=AXIS), tl.max(xo, axis=AXIS)), 0.0)
        s = tl.div_rn(tl.maximum(hi - lo, 1e-12), 15.0)
        # a finite row whose range hi - lo overflows fp32: NaN scale, as the reference (the clamps below drop a NaN)
        amax = tl.where(s == float("inf"), float("inf"), amax)
    else:
        # IEEE division (``/`` is div.full.f32 on the GPU, up to 2 ulp off): a bf16 row's amax / 7 can be exactly an
        # E4M3 rounding tie, which the approximate quotient breaks the wrong way (found on the H200, session 35)
        s = tl.div_rn(tl.maximum(amax, 1e-12), 7.0)
    if SCALE_KIND == 1:  # float8_e4m3fn
        s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)  # floor 2^-9: no whole-token underflow
        sub = tl.ceil(s * 512.0) / 512.0  # subnormal range: round up to a multiple of 2^-9
        sn = tl.where(s < 0.015625, sub, round_to_fp8_e4m3(s))
        if ZERO_POINT:  # the nearest scale unless it clips the top code: then the next value up (no clipping)
            sn = _no_clip(sn, tl.where(s < 0.015625, sub, _ceil_to_grid(s, 8.0)), lo, hi)
        s = sn
    elif SCALE_KIND == 2:  # bfloat16: the codes must use the stored (rounded) scale
        # fp32 -> bf16 round-half-even in integer arithmetic (the interpreter's cast truncates)
        bits = s.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        sn = bits.to(tl.float32, bitcast=True)
        if ZERO_POINT:
            sn = _no_clip(sn, _ceil_to_grid(s, 128.0), lo, hi)
        s = sn
    s = tl.where(amax == float("inf"), float("nan"), s)
    if FAST:
        rcp = _col(tl.div_rn(s * 0.0 + 1.0, s), AXIS)
        ye = div_fast(xe, _col(s, AXIS), rcp)
        yo = div_fast(xo, _col(s, AXIS), rcp)
    else:
        ye = tl.div_rn(xe, _col(s, AXIS))
        yo = tl.div_rn(xo, _col(s, AXIS))
    if ZERO_POINT:
        z = _rint(tl.div_rn(-lo, s))
        z = tl.minimum(tl.maximum(z, 0.0), 15.0)
        qe = tl.minimum(tl.maximum(_rint(ye) + _col(z, AXIS), 0.0), 15.0)
        qo = tl.minimum(tl.maximum(_rint(yo) + _col(z, AXIS), 0.0), 15.0)
    else:
        z = 0.0
        qe = tl.minimum(tl.maximum(_rint(ye), -7.0), 7.0)
        qo = tl.minimum(tl.maximum(_rint(yo), -7.0), 7.0)
    ie = qe.to(tl.int32) & 0xF
    io = qo.to(tl.int32) & 0xF
    packed = (ie | (io << 4)).to(tl.uint8)
    return packed, s, z


@triton.jit
def _append_kv4(k_row, v_row, COS, SIN, CRSK, KC, KS, KZ, VC, VS, VZ, b, t, h, page, off,
                stride_cb, stride_ct, stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
                HALF: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_CRS: tl.constexpr,
                ZERO_POINT: tl.constexpr, SCALE_KIND: tl.constexpr, KW=None, eps=0.0, NORM: tl.constexpr = False,
                ROW_BF16: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    """(``NORM``: the k_norm of q/k-norm models, ``lowbit.kernels.rope.rms_pair`` with weight ``KW``, half-split
    only) + RoPE (fp32) + CRS + INT4 quantization of one K row and one V row, written to slot ``off`` of ``page``."""
    j = tl.arange(0, HALF)
    de = 2 * j
    do = 2 * j + 1
    xe = tl.load(k_row + de).to(tl.float32)
    xo = tl.load(k_row + do).to(tl.float32)
    if NORM:  # the normalised row's values (the k_norm output the transformers path would append), partners below
        D_: tl.constexpr = 2 * HALF
        ss = tl.sum(xe * xe, axis=0) + tl.sum(xo * xo, axis=0)
        pe_ = (de + HALF) % D_
        po_ = (do + HALF) % D_
        ne, no = rms_pair(xe, xo, ss, tl.load(KW + de).to(tl.float32), tl.load(KW + do).to(tl.float32), eps, D_,
                          ROW_BF16, INTERPRET)
        npe, npo = rms_pair(tl.load(k_row + pe_).to(tl.float32), tl.load(k_row + po_).to(tl.float32), ss,
                            tl.load(KW + pe_).to(tl.float32), tl.load(KW + po_).to(tl.float32), eps, D_, ROW_BF16,
                            INTERPRET)
        xe, xo = ne, no
    if ROPE:
        c_row = b * stride_cb + t * stride_ct
        ce = tl.load(COS + c_row + de).to(tl.float32)
        co = tl.load(COS + c_row + do).to(tl.float32)
        se = tl.load(SIN + c_row + de).to(tl.float32)
        so = tl.load(SIN + c_row + do).to(tl.float32)
        if INTERLEAVED:  # pairs (2i, 2i+1): rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]
            re = -xo
            ro = xe
        elif NORM:  # half-split pairs of the normalised row
            re = npe * tl.where(de < HALF, -1.0, 1.0)
            ro = npo * tl.where(do < HALF, -1.0, 1.0)
        else:  # pairs (i, i + D/2): rotate(x)[i] = -x[i + D/2], rotate(x)[i + D/2] = x[i]
            D: tl.constexpr = 2 * HALF
            pe = (de + HALF) % D
            po = (do + HALF) % D
            re = tl.load(k_row + pe).to(tl.float32) * tl.where(de < HALF, -1.0, 1.0)
            ro = tl.load(k_row + po).to(tl.float32) * tl.where(do < HALF, -1.0, 1.0)
        xe, xo = xe * ce + re * se, xo * co + ro * so
    if HAS_CRS:
        xe = xe * tl.load(CRSK + h * 2 * HALF + de)
        xo = xo * tl.load(CRSK + h * 2 * HALF + do)

    c_off = page * stride_cp + h * stride_ch + off * stride_cn + j
    s_off = page * stride_sp + h * stride_sh + off
    packed, s, z = quantize_row(xe, xo, ZERO_POINT, SCALE_KIND)
    tl.store(KC + c_off, packed)
    tl.store(KS + s_off, s.to(KS.dtype.element_ty))
    if ZERO_POINT:
        tl.store(KZ + s_off, z.to(tl.uint8))

    ve = tl.load(v_row + de).to(tl.float32)
    vo = tl.load(v_row + do).to(tl.float32)
    packed, s, z = quantize_row(ve, vo, ZERO_POINT, SCALE_KIND)
    tl.store(VC + c_off, packed)
    tl.store(VS + s_off, s.to(VS.dtype.element_ty))
    if ZERO_POINT:
        tl.store(VZ + s_off, z.to(tl.uint8))


@triton.jit
def _kv4_append_kernel(
    # pointers
    K, V, COS, SIN, CRSK, PT, START, KC, KS, KZ, VC, VS, VZ, Q, QO,
    # sizes
    T, NPT, NPAGES,
    # strides
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_cb, stride_ct,
    stride_ptb,
    stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
    stride_qb, stride_qh, stride_qt, stride_ob, stride_oh, stride_ot,
    # constexpr
    HALF: tl.constexpr, PAGE: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_CRS: tl.constexpr, ZERO_POINT: tl.constexpr, SCALE_KIND: tl.constexpr,
    ROPE_Q: tl.constexpr = False, G: tl.constexpr = 1, ROW_BF16: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    FLOAT: tl.constexpr = False,
    # NORM (models area, q/k-norm models such as Qwen3): q rows and k rows RMS-normalised with QW / KW before RoPE
    QW=None, KW=None, eps=0.0, NORM: tl.constexpr = False,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = pid // T
    t = pid % T
    pos = tl.load(START + b) + t
    # a position past the page table or a page outside the pool writes nothing (the op checks CPU start
    # tensors on the host; CUDA ones are not read back, so the kernel must not read or write out of bounds)
    in_table = (pos >= 0) & (pos < NPT * PAGE)
    page = tl.load(PT + b * stride_ptb + tl.where(in_table, pos, 0) // PAGE).to(tl.int64)
    ok = in_table & (page >= 0) & (page < NPAGES)
    off = pos % PAGE
    k_row = K + b * stride_kb + h * stride_kh + t * stride_kt
    v_row = V + b * stride_vb + h * stride_vh + t * stride_vt
    if ok:
        if FLOAT:  # float pages: half-precision RoPE of k (lowbit.kernels.rope's bits), v copied
            D_: tl.constexpr = 2 * HALF
            dst = page * stride_cp + h * stride_ch + off * stride_cn
            d = tl.arange(0, D_)
            if ROPE:
                rope_row(k_row, KC + dst, COS + b * stride_cb + t * stride_ct, SIN + b * stride_cb + t * stride_ct,
                         D_, ROW_BF16, INTERPRET, KW, eps, NORM)
            else:
                tl.store(KC + dst + d, tl.load(k_row + d))
            tl.store(VC + dst + d, tl.load(v_row + d))
        else:
            _append_kv4(k_row, v_row, COS, SIN, CRSK, KC, KS, KZ, VC, VS, VZ, b, t, h, page, off,
                        stride_cb, stride_ct, stride_cp, stride_ch, stride_cn, stride_sp, stride_sh,
                        HALF, ROPE, INTERLEAVED, HAS_CRS, ZERO_POINT, SCALE_KIND, KW, eps, NORM, ROW_BF16, INTERPRET)

    if ROPE_Q:  # (models area) the G query heads of KV head h, half-precision RoPE as lowbit.kernels.rope
        for g in tl.static_range(G):
            rope_row(Q + b * stride_qb + (h * G + g) * stride_qh + t * stride_qt,
                     QO + b * stride_ob + (h * G + g) * stride_oh + t * stride_ot,
                     COS + b * stride_cb + t * stride_ct, SIN + b * stride_cb + t * stride_ct,
                     2 * HALF, ROW_BF16, INTERPRET, QW, eps, NORM)


def kv4_append_triton(k, v, k_codes, k_scale, v_codes, v_scale, page_table, start, *, cos=None, sin=None,
                      crs_k=None, k_zero=None, v_zero=None, interleaved=False, q=None, q_out=None, qk_norm=None):
    """Launcher (arguments checked by ``lowbit.ops.kv4.kv4_append``); writes the cache in place.
    ``q`` / ``q_out`` (models area, optional; bf16/fp16 ``[B, Hq, T, D]``, unit stride on D, half-split
    RoPE given by cos/sin): also writes RoPE(q) to ``q_out`` in the same launch, with the rounding of
    ``lowbit.kernels.rope`` (the eager half-precision ops), saving the runner a launch per layer.
    ``qk_norm = (w_q, w_k, eps)`` (with ``q``; session 37, Qwen3): q and k rows RMS-normalised first, with
    ``lowbit.kernels.rope``'s ``NORM`` arithmetic (k as the transformers path appends ``k_norm``'s output)."""
    _launch(k, v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, page_table, start, cos, sin, crs_k,
            interleaved, q, q_out, float_pages=False, qk_norm=qk_norm)


@triton.jit
def quantize_rows(X, x_off, t, ok, stride_t, HALF: tl.constexpr, ROWS: tl.constexpr, ZERO_POINT: tl.constexpr,
                  SCALE_KIND: tl.constexpr, FAST: tl.constexpr):
    """Rows ``t`` (``[ROWS]``, ``ok`` masks them) of X at ``x_off + t * stride_t`` (unit stride on D = 2 HALF) ->
    ``quantize_row`` of the tile: (packed ``[ROWS, HALF]``, scale, zero). Each row is loaded whole (16-byte loads) and
    split into its even / odd channels, the low / high nibbles; masked rows read 0. Shared by the dense quantize and
    the KV4 -> FP8 conversion from float (``attention_quant``)."""
    d = tl.arange(0, 2 * HALF)
    x = tl.load(X + x_off + t[:, None].to(tl.int64) * stride_t + d[None, :], mask=ok[:, None], other=0.0)
    xe, xo = tl.split(tl.reshape(x.to(tl.float32), [ROWS, HALF, 2]))
    return quantize_row(xe, xo, ZERO_POINT, SCALE_KIND, 1, FAST)


@triton.jit
def _quantize_tile(X, C, SC, Z, x_off, row0, t, ok, stride_t, HALF: tl.constexpr, ROWS: tl.constexpr,
                   ZERO_POINT: tl.constexpr, SCALE_KIND: tl.constexpr, FAST: tl.constexpr):
    """``quantize_rows`` of rows ``t`` of one (sequence, head), stored at dense rows ``row0 + t``."""
    packed, s, z = quantize_rows(X, x_off, t, ok, stride_t, HALF, ROWS, ZERO_POINT, SCALE_KIND, FAST)
    rows = row0 + t
    j = tl.arange(0, HALF)
    tl.store(C + rows[:, None] * HALF + j[None, :], packed, mask=ok[:, None])
    tl.store(SC + rows, s.to(SC.dtype.element_ty), mask=ok)
    if ZERO_POINT:
        tl.store(Z + rows, z.to(tl.uint8), mask=ok)


@triton.jit
def _kv4_quantize_kernel(K, V, KC, KS, KZ, VC, VS, VZ, S, H,
                         stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                         HALF: tl.constexpr, ROWS: tl.constexpr, ZERO_POINT: tl.constexpr, SCALE_KIND: tl.constexpr,
                         FAST: tl.constexpr):
    """``ROWS`` tokens of one (sequence, KV head) per program, K and V: dense KV4 (``kv4_quantize_triton``)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = t < S
    row0 = bh.to(tl.int64) * S
    _quantize_tile(K, KC, KS, KZ, b * stride_kb + h * stride_kh, row0, t, ok, stride_kt, HALF, ROWS, ZERO_POINT,
                   SCALE_KIND, FAST)
    _quantize_tile(V, VC, VS, VZ, b * stride_vb + h * stride_vh, row0, t, ok, stride_vt, HALF, ROWS, ZERO_POINT,
                   SCALE_KIND, FAST)


# tokens per program and warps of ``kv4_quantize_triton`` (H200, session 35: ``benchmarks/device/s35_ab.py`` part k)
QUANT_ROWS = 32
QUANT_WARPS = 4


def kv4_quantize_triton(k, v, *, zero_point: bool = False, scale_dtype=torch.float8_e4m3fn, rows: int | None = None,
                        num_warps: int | None = None, fast: bool | None = None):
    """Dense KV4 quantization of whole sequences, no RoPE and no CRS: k, v ``[B, Hkv, S, D]`` (D a power of two,
    unit stride on D) -> ``(k_codes, k_scale, v_codes, v_scale, k_zero, v_zero)`` with codes uint8
    ``[B, Hkv, S, D/2]``, scales ``scale_dtype [B, Hkv, S]`` and zeros uint8 ``[B, Hkv, S]`` (None without
    ``zero_point``): bit for bit ``lowbit.formats.kv4.quantize_kv4`` of each (the append kernel's row numerics,
    ``quantize_row``, on tiles of ``rows`` tokens; ``fast``: Markstein quotients, default on the GPU)."""
    from lowbit._utils import interpret_mode

    B, H, S, D = k.shape
    dev = k.device
    kc = torch.empty(B, H, S, D // 2, dtype=torch.uint8, device=dev)
    vc = torch.empty_like(kc)
    ks = torch.empty(B, H, S, dtype=scale_dtype, device=dev)
    vs = torch.empty_like(ks)
    kz = torch.empty(B, H, S, dtype=torch.uint8, device=dev) if zero_point else None
    vz = torch.empty_like(kz) if zero_point else None
    if B * H * S == 0:
        return kc, ks, vc, vs, kz, vz
    rows = rows or QUANT_ROWS
    if rows < 1 or rows & (rows - 1) or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"kv4_quantize_triton: rows must be a power of two and k, v one shape [B, H, S, D] with unit "
                         f"stride on D; got rows={rows}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    _kv4_quantize_kernel[(triton.cdiv(S, rows), B * H)](  # B * H <= 65535: the op slices the batch (``by_batch``)
        k, v, kc, ks, kz if zero_point else ks, vc, vs, vz if zero_point else vs, S, H,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        HALF=D // 2, ROWS=rows, ZERO_POINT=zero_point,
        SCALE_KIND={torch.float32: 0, torch.float8_e4m3fn: 1, torch.bfloat16: 2}[scale_dtype],
        FAST=not interpret_mode() if fast is None else bool(fast), num_warps=num_warps or QUANT_WARPS,
    )
    return kc, ks, vc, vs, kz, vz


def float_append_triton(k, v, k_cache, v_cache, page_table, start, *, cos=None, sin=None, q=None, q_out=None,
                        qk_norm=None):
    """``FLOAT`` launcher (module docstring): write k (half-split RoPE by cos/sin when given, the
    rounding of ``lowbit.kernels.rope``) and v, bf16/fp16 ``[B, Hkv, T, D]`` with unit stride on D, to
    slots ``start[b] + t`` of the float pages ``k_cache``, ``v_cache [num_pages, Hkv, PAGE, D]`` (same
    strides, k's dtype); ``q`` / ``q_out`` / ``qk_norm`` as ``kv4_append_triton``. The runner's decode step calls it."""
    if (k.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != k.dtype or v.dtype != k.dtype
            or v_cache.dtype != k.dtype or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
            or k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.shape[1:2] != k.shape[1:2]
            or k_cache.shape[3] != k.shape[3] or v.shape != k.shape):
        raise ValueError(f"float_append_triton: k, v [B, Hkv, T, D] and k_cache, v_cache [pages, Hkv, PAGE, D] "
                         f"must share one bf16/fp16 dtype, unit stride on D, and the caches one shape and strides; "
                         f"got k {k.dtype} {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {k_cache.dtype} "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if page_table.shape[0] != k.shape[0] or start.shape != (k.shape[0],):
        raise ValueError(f"float_append_triton: page_table needs {k.shape[0]} rows and start shape ({k.shape[0]},), "
                         f"got {tuple(page_table.shape)} and {tuple(start.shape)}")
    check_page_writes(start, page_table, k.shape[2], k_cache.shape[2], k_cache.shape[0])
    if cos is not None and (cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    _launch(k, v, k_cache, None, None, v_cache, None, None, page_table, start, cos, sin, None, False, q, q_out,
            float_pages=True, qk_norm=qk_norm)


def _launch(k, v, kc, ks, kz, vc, vs, vz, page_table, start, cos, sin, crs_k, interleaved, q, q_out, *, float_pages,
            qk_norm=None):
    from lowbit._utils import interpret_mode

    B, Hkv, T, D = k.shape
    if B * T == 0:
        return
    PAGE = kc.shape[2]
    zero_point = kz is not None
    rope = cos is not None
    scale_kind = 0 if float_pages else {torch.float32: 0, torch.float8_e4m3fn: 1, torch.bfloat16: 2}[ks.dtype]
    cos_ = cos if rope else k
    sin_ = sin if rope else k
    rope_q = q is not None
    if rope_q and (not rope or interleaved or q_out is None or q.shape[1] % Hkv or q.stride(-1) != 1
                   or q_out.stride(-1) != 1 or q.dtype not in (torch.bfloat16, torch.float16)
                   or cos.stride(-1) != 1 or sin.stride() != cos.stride() or (float_pages and q.dtype != k.dtype)):
        raise ValueError("q rope in kv4_append needs half-split cos/sin, bf16/fp16 q and q_out with unit stride on D")
    q_, qo_ = (q, q_out) if rope_q else (k, k)
    if qk_norm is not None and (not rope_q or q.dtype != k.dtype):
        raise ValueError("qk_norm in the append needs q (the q rope) in k's dtype")
    norm = norm_args(qk_norm, k, "kv4_append")
    ks_ = kc if float_pages else ks  # placeholders for pointers a constexpr branch never reads
    vs_ = vc if float_pages else vs
    _kv4_append_kernel[(B * T, Hkv)](
        k, v, cos_, sin_, crs_k if crs_k is not None else k, page_table, start,
        kc, ks_, kz if zero_point else ks_, vc, vs_, vz if zero_point else vs_,
        q_, qo_,
        T, page_table.shape[1], kc.shape[0],
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cos_.stride(0) if rope else 0, cos_.stride(1) if rope else 0,
        page_table.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), ks_.stride(0), ks_.stride(1),
        q_.stride(0), q_.stride(1), q_.stride(2), qo_.stride(0), qo_.stride(1), qo_.stride(2),
        HALF=D // 2, PAGE=PAGE, ROPE=rope, INTERLEAVED=interleaved, HAS_CRS=crs_k is not None,
        ZERO_POINT=zero_point, SCALE_KIND=scale_kind,
        ROPE_Q=rope_q, G=q.shape[1] // Hkv if rope_q else 1,
        ROW_BF16=(q if rope_q else k).dtype == torch.bfloat16,  # the rows rope_row rotates (q; float-page k) are bf16
        INTERPRET=interpret_mode(), FLOAT=float_pages, num_warps=ROPE_Q_WARPS if rope_q else 1, **norm,
    )
