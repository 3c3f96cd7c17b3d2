"""Fused K/V quantization for quantized prefill attention (one launch quantizes K and V).

Numerics: ``lowbit.formats.attention_quant`` (the reference this kernel must match bit for bit):

- K: symmetric per token per head (``K_PER_BLOCK``: per block of BLOCK_T keys),
  ``scale = max(amax, AMAX_EPS) / QMAX`` (fp32, ``tl.div_rn``: the IEEE quotient of the reference's ``safe_scale``
  on every device; Triton's ``/`` is ``div.full.f32``, up to 2 ulp off, session 36),
  ``code = cast(clamp(k * (1 / scale)))`` (reciprocal IEEE-rounded once per scale), INT8 codes rounded to nearest
  even, FP8 codes by the RNE cast.
- V: symmetric, per channel per block of ``V_BLOCK`` tokens (``V_CHANNEL``, scales
  ``[B, H, NB, D]``) or one scale per block (``[B, H, NB]``; ``V_GIVEN``: precomputed, e.g. the
  per-tensor option, and only read).

Layouts written (all contiguous):

- ``kc [B, H, S, D]`` codes, ``ks [B, H, S]`` fp32;
- ``vt [B, H, D, S_al]`` codes **transposed** (``S_al`` = S rounded up to 16 for 16-byte rows):
  8-bit tensor-core MMAs on Hopper (wgmma with e4m3 / s8 operands) need the B operand K-major,
  and in ``P V`` the reduction runs over tokens, so V must be token-contiguous. Doing the
  transpose here costs nothing extra (this pass reads and writes V anyway);
- ``vs [B, H, cdiv(S, V_BLOCK), D]`` (``channel``) or ``[B, H, cdiv(S, V_BLOCK)]`` fp32.

The Q quantization is not here: the attention kernel quantizes its Q tile in registers
(Q is read exactly once there, so that saves a full pass over Q).

Grid: ``(cdiv(S, BLOCK_T) [K programs] + cdiv(S, V_BLOCK) [V programs], B * H)``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode
from lowbit.formats.common import AMAX_EPS, QMAX, safe_scale
from lowbit.kernels.act_quant import abs_or_inf, amax_floor, round_to_fp8_e4m3
from lowbit.kernels.kv4_append import quantize_rows

_MAGIC = 12582912.0  # 1.5 * 2^23: x + M - M rounds fp32 x to an integer, ties to even
# Non-finite inputs. The FP8 codes carry a NaN by themselves (``_quant_tile``). For the INT8 schemes, set
# ``LOWBIT_NAN_SAFE=1`` (or this attribute): the INT8 scale maxima of the prefill quantization (this module's K / V /
# Q launch, the attention kernel's Q prologue; the launchers pass it to INT8 launches only) then take NaN as +inf and an infinite maximum as
# NaN (``act_quant.abs_or_inf``). Off by default: it makes the quantization launch 29-35 % slower (H200, session 34,
# ``s34_nan_ab_r4_split.json``: the launch is issue-bound, not memory-bound) and the INT8 prefill call 2-16 %.
NAN_SAFE = os.environ.get("LOWBIT_NAN_SAFE", "0") == "1"


@triton.jit
def _abs_operand(x, NAN_SAFE: tl.constexpr):
    """The operand of a scale maximum: ``|x|``, or with ``NAN_SAFE`` ``act_quant.abs_or_inf(x)``."""
    if NAN_SAFE:
        return abs_or_inf(x)
    return tl.abs(x)


@triton.jit
def _eps_floor(amax, eps, NAN_SAFE: tl.constexpr):
    """``max(amax, eps)``, or with ``NAN_SAFE`` ``act_quant.amax_floor`` (an infinite maximum gives NaN)."""
    if NAN_SAFE:
        return amax_floor(amax, eps)
    return tl.maximum(amax, eps)


@triton.jit
def _quant_tile(x, scale, QMAX: tl.constexpr, IS_INT8: tl.constexpr, EXACT_FP8: tl.constexpr):
    """fp32 tile * (1 / scale) (broadcast; the reciprocal IEEE-rounded once per scale) -> INT8 (clamped) or
    FP8 E4M3 codes, RNE. FP8 has no clamp (session 34): ``|x| <= amax`` keeps ``|y| <= 448 (1 + 2^-22)``,
    which the GPU's ``cvt.rn.satfinite`` (the interpreter: ``round_to_fp8_e4m3``) rounds to 448, the clamped
    reference's code; and ``satfinite`` keeps a NaN, so a non-finite Q, K or V element (NaN, or an Inf, which
    makes its scale infinite and its code NaN) reaches the attention output without ``NAN_SAFE``, with two ALU
    ops per element fewer (the launch 5 % faster, ``s34_nan_ab_r7_noclamp.json``). INT8 codes cannot hold a
    NaN; without the clamp they also came out different (``max |diff|`` 1) and the launch slower there."""
    y = x * tl.div_rn(scale * 0.0 + 1.0, scale)
    if IS_INT8:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        c = ((y + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        if EXACT_FP8:  # the interpreter's fp32->fp8 cast mis-rounds across binades
            y = round_to_fp8_e4m3(y)
        c = y.to(tl.float8e4nv)
    return c


@triton.jit
def _load_rows(base, offs_t, S, stride_n, HEAD_DIM: tl.constexpr):
    """16-bit rows ``offs_t`` of one head (masked past S, zeros) as fp32 ``[len(offs_t), HEAD_DIM]``."""
    offs_d = tl.arange(0, HEAD_DIM)
    return tl.load(base + offs_t[:, None].to(tl.int64) * stride_n + offs_d[None, :],
                   mask=(offs_t < S)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _vperm_rows(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Rows (keys) of a 32-aligned tile to their ``VPERM`` order: row ``vperm_pos(t)``
    (``lowbit.kernels.attention_prefill_gluon``) of the result is row t of ``x`` (key bits
    h|j1|q|j0 -> h|q|j1|j0 within each 32-row chunk)."""
    return tl.reshape(tl.permute(tl.reshape(x, [ROWS // 32, 2, 2, 4, 2, COLS]), (0, 1, 3, 2, 4, 5)), [ROWS, COLS])


@triton.jit
def _kv_quant_task(
    task, b, h, bh,  # task < n_kprog: K block ``task``; else V block ``task - n_kprog``
    K, V, KC, KS, VT, VS,  # pointers: inputs, K codes / scales, V^T codes / scales
    S, n_kprog, amax_eps,  # sizes
    stride_kb, stride_kh, stride_kn,  # K input (last dim contiguous)
    stride_vb, stride_vh, stride_vn,  # V input (last dim contiguous)
    stride_vtd, S_al, n_vblk,  # V^T row stride, padded length, V scale blocks
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, V_BLOCK: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, QUANT_V: tl.constexpr, V_CHANNEL: tl.constexpr,
    V_GIVEN: tl.constexpr, K_PER_BLOCK: tl.constexpr, EXACT_FP8: tl.constexpr, CHUNK: tl.constexpr,
    S_OUT, KS_ROWS, SC_STRIDE: tl.constexpr = 1, VPERM: tl.constexpr = False, NAN_SAFE: tl.constexpr = False,
):
    """Quantize one block of K rows or V rows of head (b, h) (``bh`` = its row in the outputs).
    ``VPERM``: key t of V^T is stored at ``vperm_pos(t)`` (S_al a multiple of 32; ``_vperm_rows``).

    ``S_OUT``: rows per head in the code outputs (``S`` for K; the Q outputs are padded to a
    multiple of 4 rows); ``KS_ROWS``: the same for the per-token scales (padded to a multiple
    of 4 with ``scale_pad`` = 4: 16-byte aligned TMA boxes). ``SC_STRIDE``: float32 slots per per-block K / V scale
    (4: a 16-byte row per scale, the smallest TMA box, for the warp-specialized attention).

    Shared by ``_kv_quant_kernel`` (one task per program, the whole block in registers) and the
    attention kernel's fused prologue (``lowbit.kernels.attention_prefill``, ``FUSE_KV``), which
    walks the block in ``CHUNK``-row pieces (an amax pass first where the scale spans the block)
    to stay within the attention kernel's registers. Same codes and scales either way."""
    offs_d = tl.arange(0, HEAD_DIM)
    if task < n_kprog:
        Kh = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        t0 = task * BLOCK_T
        if K_PER_BLOCK:  # one scale for the BLOCK_T keys of this task
            if CHUNK == BLOCK_T:
                kx = _load_rows(Kh, t0 + tl.arange(0, BLOCK_T), S, stride_kn, HEAD_DIM)
                kam = _eps_floor(tl.max(tl.max(_abs_operand(kx, NAN_SAFE), 1), 0), amax_eps, NAN_SAFE)
                kscale = tl.div_rn(kam, QMAX)
            else:
                am = tl.zeros([CHUNK], dtype=tl.float32)
                for c in tl.range(0, BLOCK_T, CHUNK, loop_unroll_factor=1):
                    am = tl.maximum(am, tl.max(_abs_operand(_load_rows(Kh, t0 + c + tl.arange(0, CHUNK), S, stride_kn,
                                                                         HEAD_DIM), NAN_SAFE), 1))
                kscale = tl.div_rn(_eps_floor(tl.max(am, 0), amax_eps, NAN_SAFE), QMAX)
            tl.store(KS + (bh.to(tl.int64) * n_kprog + task) * SC_STRIDE, kscale)
        for c in tl.range(0, BLOCK_T, CHUNK, loop_unroll_factor=1):
            koffs_t = t0 + c + tl.arange(0, CHUNK)
            ktmask = koffs_t < S
            row = bh.to(tl.int64) * S_OUT + koffs_t
            if not (K_PER_BLOCK and CHUNK == BLOCK_T):
                kx = _load_rows(Kh, koffs_t, S, stride_kn, HEAD_DIM)
            if K_PER_BLOCK:
                kcodes = _quant_tile(kx, kscale, QMAX, IS_INT8, EXACT_FP8)
            else:
                kscale_r = tl.div_rn(_eps_floor(tl.max(_abs_operand(kx, NAN_SAFE), 1), amax_eps, NAN_SAFE),
                                     QMAX)
                kcodes = _quant_tile(kx, kscale_r[:, None], QMAX, IS_INT8, EXACT_FP8)
                tl.store(KS + bh.to(tl.int64) * KS_ROWS + koffs_t, kscale_r, mask=ktmask)
            tl.store(KC + row[:, None] * HEAD_DIM + offs_d[None, :], kcodes, mask=ktmask[:, None])
    elif QUANT_V:
        vblk = task - n_kprog
        Vh = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
        t0 = vblk * V_BLOCK
        if CHUNK == V_BLOCK:  # the whole block in registers
            vx = _load_rows(Vh, t0 + tl.arange(0, V_BLOCK), S, stride_vn, HEAD_DIM)
            vam = tl.max(_abs_operand(vx, NAN_SAFE), 0)  # per channel
        elif not V_GIVEN:
            vam = tl.zeros([HEAD_DIM], dtype=tl.float32)
            for c in tl.range(0, V_BLOCK, CHUNK, loop_unroll_factor=1):
                vam = tl.maximum(vam, tl.max(_abs_operand(_load_rows(Vh, t0 + c + tl.arange(0, CHUNK), S, stride_vn,
                                                                       HEAD_DIM), NAN_SAFE), 0))
        if V_CHANNEL:  # one scale per channel of this block
            vscale = tl.div_rn(_eps_floor(vam, amax_eps, NAN_SAFE), QMAX)
            tl.store(VS + (bh.to(tl.int64) * n_vblk + vblk) * HEAD_DIM + offs_d, vscale)
        else:  # one scale for the block (V_GIVEN: precomputed, e.g. per tensor)
            vvs_ptr = VS + (bh.to(tl.int64) * n_vblk + vblk) * SC_STRIDE
            if V_GIVEN:
                vscale = tl.load(vvs_ptr)
            else:
                vscale = tl.div_rn(_eps_floor(tl.max(vam, 0), amax_eps, NAN_SAFE), QMAX)
                tl.store(vvs_ptr, vscale)
        for c in tl.range(0, V_BLOCK, CHUNK, loop_unroll_factor=1):
            voffs_t = t0 + c + tl.arange(0, CHUNK)
            if CHUNK != V_BLOCK:
                vx = _load_rows(Vh, voffs_t, S, stride_vn, HEAD_DIM)
            if V_CHANNEL:
                vcodes = _quant_tile(vx, vscale[None, :], QMAX, IS_INT8, EXACT_FP8)
            else:
                vcodes = _quant_tile(vx, vscale, QMAX, IS_INT8, EXACT_FP8)
            # transposed store: element (t, d) -> VT[b, h, d, t]; the padding columns S..S_al get
            # code 0 (the masked load gave 0), so no separate zero fill is needed
            if VPERM:  # keys to their VPERM positions in registers (the store stays contiguous)
                vcodes = _vperm_rows(vcodes, CHUNK, HEAD_DIM)
            vvt_ptr = VT + bh.to(tl.int64) * HEAD_DIM * stride_vtd + offs_d[None, :] * stride_vtd + voffs_t[:, None]
            tl.store(vvt_ptr, vcodes, mask=(voffs_t < S_al)[:, None])


@triton.jit
def _kv_quant_kernel(
    K, V, KC, KS, VT, VS,  # pointers: inputs, K codes / scales, V^T codes / scales
    Q, QC, QS,  # QUANT_Q: 16-bit Q in, Q codes / per-token scales out
    S, H, n_kprog, amax_eps,  # sizes
    KS_ROWS, Sq, Sq_al, n_qprog, n_rep,  # per-token K scale rows per head; QUANT_Q: query length (padded rows per head), Q tasks per head, heads per KV head
    stride_kb, stride_kh, stride_kn,  # K input (last dim contiguous)
    stride_vb, stride_vh, stride_vn,  # V input (last dim contiguous)
    stride_qb, stride_qh, stride_qn,  # Q input (last dim contiguous)
    stride_vtd, S_al, n_vblk,  # V^T row stride, padded length, V scale blocks
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, V_BLOCK: tl.constexpr,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, QUANT_V: tl.constexpr, V_CHANNEL: tl.constexpr,
    V_GIVEN: tl.constexpr,
    K_PER_BLOCK: tl.constexpr, EXACT_FP8: tl.constexpr, QUANT_Q: tl.constexpr, SC_STRIDE: tl.constexpr,
    VPERM: tl.constexpr = False, NAN_SAFE: tl.constexpr = False,
):
    bh = tl.program_id(1)
    task = tl.program_id(0)
    n_kv = n_kprog + (n_vblk if QUANT_V else 0)
    if QUANT_Q and task >= n_kv:  # Q block: per-token scales, the numerics of the K rows (and of
        # the attention kernel's in-register Q quantization: same codes)
        j = task - n_kv
        b = bh // H
        hq = (bh % H) * n_rep + j // n_qprog
        _kv_quant_task(j % n_qprog, b, hq, b * (H * n_rep) + hq, Q, Q, QC, QS, QC, QS, Sq, n_qprog, amax_eps,
                       stride_qb, stride_qh, stride_qn, stride_qb, stride_qh, stride_qn, stride_vtd, S_al, n_vblk,
                       HEAD_DIM, BLOCK_T, V_BLOCK, QMAX, IS_INT8, False, V_CHANNEL, V_GIVEN, False, EXACT_FP8,
                       BLOCK_T, Sq_al, Sq_al, NAN_SAFE=NAN_SAFE)
    else:
        _kv_quant_task(task, bh // H, bh % H, bh, K, V, KC, KS, VT, VS, S, n_kprog, amax_eps,
                       stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_vtd, S_al, n_vblk,
                       HEAD_DIM, BLOCK_T, V_BLOCK, QMAX, IS_INT8, QUANT_V, V_CHANNEL, V_GIVEN, K_PER_BLOCK, EXACT_FP8,
                       min(BLOCK_T, V_BLOCK), S, KS_ROWS, SC_STRIDE, VPERM, NAN_SAFE)


def alloc_kv_codes(k: torch.Tensor, v: torch.Tensor | None, *, dtype: torch.dtype, v_granularity: str = "channel",
                   v_block: int = 128, k_block: int | None = None, block_t: int = 128, scale_pad: int = 1,
                   vperm: bool = False) -> dict:
    """The output buffers of the K/V quantization (layouts in the module docstring) plus the
    launch sizes: ``kc, ks, vt, vs`` (vt/vs None without ``v``), ``n_kprog`` (K tasks of
    ``k_block or block_t`` keys), ``n_vblk``, ``s_al`` and ``given`` (V scales precomputed here:
    ``v_granularity='tensor'``). ``scale_pad`` = 4: the per-block K / V scales are the element 0
    of 16-byte rows (``ks[..., 0]`` views of ``[B, H, NB, 4]`` buffers; TMA boxes for the
    warp-specialized attention). ``vperm``: V^T rows padded to a multiple of 32 keys (``VPERM``)."""
    B, H, S, D = k.shape
    dev = k.device
    block_t = k_block or block_t
    n_kprog = cdiv(S, block_t)
    if k_block:
        ks = torch.empty((B, H, n_kprog, scale_pad), dtype=torch.float32, device=dev)[..., 0]
    else:
        ks = torch.empty((B, H, -(-S // scale_pad) * scale_pad), dtype=torch.float32, device=dev)[:, :, :S]
    out = {"kc": torch.empty((B, H, S, D), dtype=dtype, device=dev), "ks": ks,
           "vt": None, "vs": None, "n_kprog": n_kprog, "block_t": block_t, "n_vblk": cdiv(S, v_block),
           "s_al": -(-S // (32 if vperm else 16)) * (32 if vperm else 16), "given": False}
    if v is not None:
        n_vblk = out["n_vblk"]
        out["vt"] = torch.empty((B, H, D, out["s_al"]), dtype=dtype, device=dev)  # padding columns written as 0
        if v_granularity == "tensor":
            amax = v.abs().amax(dim=(2, 3)).float()
            vs = safe_scale(amax, QMAX[dtype])[:, :, None, None].expand(B, H, n_vblk, scale_pad)  # the reference's
            out["vs"] = vs.contiguous()[..., 0]
            out["given"] = True
        elif v_granularity == "channel":
            out["vs"] = torch.empty((B, H, n_vblk, D), dtype=torch.float32, device=dev)
        else:
            out["vs"] = torch.empty((B, H, n_vblk, scale_pad), dtype=torch.float32, device=dev)[..., 0]
    return out


def quantize_kv_triton(k: torch.Tensor, v: torch.Tensor | None, *, dtype: torch.dtype,
                       v_granularity: str = "channel", v_block: int = 128, k_block: int | None = None,
                       num_warps: int | None = None, q: torch.Tensor | None = None, scale_pad: int = 1,
                       vperm: bool = False):
    """K [B, H, S, D] (and V, or None to quantize K only) -> (kc, ks, vt, vs) in the layouts of
    the module docstring (vt, vs None when ``v`` is None). ``k_block``: one K scale per block of
    that many keys (``ks [B, H, cdiv(S, k_block)]``) instead of one per key.

    ``q`` (``[B, Hq, Sq, D]``, Hq a multiple of H): also quantize Q per token in the same launch
    (extra programs) and return ``(kc, ks, vt, vs, qc, qs)`` with ``qc [B, Hq, Sq, D]`` codes and
    ``qs [B, Hq, Sq]`` fp32 scales: the codes the attention kernel computes in registers otherwise
    (views of buffers padded to a multiple of 4 rows per head: 16-byte aligned TMA boxes of the
    scales). ``scale_pad``: see ``alloc_kv_codes``. ``vperm``: V^T in the ``VPERM`` key order
    (rows padded to 32 keys; the attention kernels' ``vperm`` config reads it)."""
    B, H, S, D = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v is not None and v.stride(-1) != 1:
        v = v.contiguous()
    buf = alloc_kv_codes(k, v, dtype=dtype, v_granularity=v_granularity, v_block=v_block, k_block=k_block,
                         block_t=128 if D <= 128 else 64, scale_pad=scale_pad, vperm=vperm)
    kc, ks, vt, vs = buf["kc"], buf["ks"], buf["vt"], buf["vs"]
    qc = qs = None
    n_qprog, n_rep, sq, sq_al = 0, 1, 0, 0
    if q is not None:
        if q.stride(-1) != 1:
            q = q.contiguous()
        Hq, sq = q.shape[1], q.shape[2]
        n_rep = Hq // H
        n_qprog = cdiv(sq, buf["block_t"])
        sq_al = -(-sq // 4) * 4
        qc = torch.empty((B, Hq, sq_al, D), dtype=dtype, device=k.device)[:, :, :sq]
        qs = torch.empty((B, Hq, sq_al), dtype=torch.float32, device=k.device)[:, :, :sq]
    res = (kc, ks, vt, vs) if q is None else (kc, ks, vt, vs, qc, qs)
    if B * H == 0 or (S == 0 and sq == 0):
        return res
    n_kprog, n_vblk, s_al = buf["n_kprog"], buf["n_vblk"], buf["s_al"]
    grid = (n_kprog + (n_vblk if v is not None else 0) + n_rep * n_qprog, B * H)
    vv = v if v is not None else k
    qq = q if q is not None else k
    _kv_quant_kernel[grid](
        k, vv, kc, ks, vt if vt is not None else kc, vs if vs is not None else ks,
        qq, qc if qc is not None else kc, qs if qs is not None else ks,
        S, H, n_kprog, AMAX_EPS,
        ks.stride(1) if k_block is None else S, sq, sq_al, max(n_qprog, 1), n_rep,
        k.stride(0), k.stride(1), k.stride(2),
        vv.stride(0), vv.stride(1), vv.stride(2),
        qq.stride(0), qq.stride(1), qq.stride(2),
        s_al, s_al, n_vblk,
        HEAD_DIM=D, BLOCK_T=buf["block_t"], V_BLOCK=v_block, QMAX=QMAX[dtype], IS_INT8=dtype == torch.int8,
        QUANT_V=v is not None, V_CHANNEL=v_granularity == "channel", V_GIVEN=buf["given"],
        K_PER_BLOCK=k_block is not None, EXACT_FP8=interpret_mode(), QUANT_Q=q is not None, SC_STRIDE=scale_pad,
        VPERM=bool(vperm), NAN_SAFE=NAN_SAFE and dtype == torch.int8,  # FP8 codes carry a NaN themselves
        num_warps=num_warps or 4,  # H200: 4 warps 0.112 ms vs 8 warps 0.127 ms (fp8, S=4096)
    )
    return res


# ------------------------------------------------------------------------------- KV4 -> FP8 blocks
@triton.jit
def _kv4_to_fp8_kernel(
    KC, KS, VC, VS, OK, OKS, OVT, OVS,  # pointers: KV4 codes/scales in, FP8 codes/scales out
    S, n_blk, S_al,  # sizes
    stride_kb, stride_kh, stride_kn, stride_ksb, stride_ksh,  # KV4 K (codes last dim contiguous)
    stride_vb, stride_vh, stride_vn, stride_vsb, stride_vsh,  # KV4 V
    H, amax_eps,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, EXACT_FP8: tl.constexpr, VPERM: tl.constexpr = False,
    FROM_FLOAT: tl.constexpr = False,
):
    """One program = BLOCK_T tokens of K (program_id(0) < n_blk) or of V: dequantize the KV4 codes
    (code * scale, fp32) and requantize them to FP8 E4M3 with one scale per block. ``FROM_FLOAT``: KC / VC are
    float K / V ``[B, H, S, D]`` (the code strides are theirs; KS / VS unused), quantized to KV4 here first
    (``kv4_append.quantize_rows``, ``quantize_kv4``'s numerics), so the KV4 codes never reach memory."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    is_v = pid >= n_blk
    blk = tl.where(is_v, pid - n_blk, pid)
    offs_t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, HEAD_DIM // 2)
    tmask = offs_t < S
    if FROM_FLOAT:  # float rows -> KV4 codes and scales in registers
        if is_v:
            packed, sc, _ = quantize_rows(VC, b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh, offs_t, tmask,
                                          stride_vn, HEAD_DIM // 2, BLOCK_T, False, 1, not EXACT_FP8)
        else:
            packed, sc, _ = quantize_rows(KC, b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh, offs_t, tmask,
                                          stride_kn, HEAD_DIM // 2, BLOCK_T, False, 1, not EXACT_FP8)
        sc = tl.where(tmask, sc, 0.0)
    elif is_v:
        packed = tl.load(VC + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
                         + offs_t[:, None].to(tl.int64) * stride_vn + offs_h[None, :], mask=tmask[:, None], other=0)
        sc = tl.load(VS + b.to(tl.int64) * stride_vsb + h.to(tl.int64) * stride_vsh + offs_t,
                     mask=tmask, other=0.0).to(tl.float32)
    else:
        packed = tl.load(KC + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
                         + offs_t[:, None].to(tl.int64) * stride_kn + offs_h[None, :], mask=tmask[:, None], other=0)
        sc = tl.load(KS + b.to(tl.int64) * stride_ksb + h.to(tl.int64) * stride_ksh + offs_t,
                     mask=tmask, other=0.0).to(tl.float32)
    lo = (packed & 0xF).to(tl.int8)
    hi = ((packed >> 4) & 0xF).to(tl.int8)
    lo = (lo - ((lo & 8) << 1)).to(tl.float32)
    hi = (hi - ((hi & 8) << 1)).to(tl.float32)
    x = tl.reshape(tl.join(lo, hi), [BLOCK_T, HEAD_DIM]) * sc[:, None]
    # a NaN KV4 scale: NaN codes
    scale = tl.div_rn(tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), amax_eps), 448.0)
    codes = _quant_tile(x, scale, 448.0, False, EXACT_FP8)
    offs_d = tl.arange(0, HEAD_DIM)
    if is_v:
        tl.store(OVS + bh.to(tl.int64) * n_blk + blk, scale)
        vt_ptr = OVT + bh.to(tl.int64) * HEAD_DIM * S_al + offs_d[None, :] * S_al + offs_t[:, None]
        if VPERM:  # keys to their VPERM positions in registers; keys past S carry code 0
            tl.store(vt_ptr, _vperm_rows(codes, BLOCK_T, HEAD_DIM), mask=(offs_t < S_al)[:, None])
        else:
            tl.store(vt_ptr, codes, mask=tmask[:, None])
    else:
        tl.store(OKS + bh.to(tl.int64) * n_blk + blk, scale)
        row = bh.to(tl.int64) * S + offs_t
        tl.store(OK + row[:, None] * HEAD_DIM + offs_d[None, :], codes, mask=tmask[:, None])


def kv4_to_fp8_triton(k_codes, k_scale, v_codes, v_scale, *, block: int = 128, vperm: bool = False,
                      from_float: bool = False, num_warps: int | None = None):
    """KV4 K/V (codes ``[B, H, S, D/2]`` uint8, scales ``[B, H, S]``) -> the ``fp8`` scheme's
    operands with one scale per ``block`` keys: (kc ``[B, H, S, D]``, ks ``[B, H, NB]``,
    vt ``[B, H, D, S_al]`` transposed, vs ``[B, H, NB]``); numerics of
    ``quantize_k_block(dequantize_kv4(...), fp8, block)``. ``vperm``: V^T in the ``VPERM`` key order.
    ``from_float``: ``k_codes`` / ``v_codes`` are float K / V ``[B, H, S, D]`` (D a power of two, unit stride on D;
    the scales are None), quantized to KV4 (``quantize_kv4``) inside the same launch."""
    if from_float:
        B, H, S, D = k_codes.shape
        D2 = D // 2
        k_scale, v_scale = k_codes, v_codes  # placeholders: FROM_FLOAT never reads them
    else:
        B, H, S, D2 = k_codes.shape
        D = 2 * D2
    dev = k_codes.device
    al = 32 if vperm else 16
    nb, s_al = cdiv(S, block), -(-S // al) * al
    kc = torch.empty((B, H, S, D), dtype=torch.float8_e4m3fn, device=dev)
    vt = torch.empty((B, H, D, s_al), dtype=torch.float8_e4m3fn, device=dev)
    if s_al != S and vperm:  # padding keys sit at permuted positions of the last 32-key chunk
        vt[..., (S // 32) * 32:].zero_()
    elif s_al != S:
        vt[..., S:].zero_()
    ks = torch.empty((B, H, nb), dtype=torch.float32, device=dev)
    vs = torch.empty((B, H, nb), dtype=torch.float32, device=dev)
    if B * H and S:  # B * H <= 65535: the ops slice the batch (``lowbit._utils.by_batch``)
        _kv4_to_fp8_kernel[(2 * nb, B * H)](
            k_codes, k_scale, v_codes, v_scale, kc, ks, vt, vs,
            S, nb, s_al,
            k_codes.stride(0), k_codes.stride(1), k_codes.stride(2), k_scale.stride(0), k_scale.stride(1),
            v_codes.stride(0), v_codes.stride(1), v_codes.stride(2), v_scale.stride(0), v_scale.stride(1),
            H, AMAX_EPS,
            HEAD_DIM=D, BLOCK_T=block, EXACT_FP8=interpret_mode(), VPERM=bool(vperm), FROM_FLOAT=bool(from_float),
            # 16 warps at D >= 128: H200 s35 (s35_ab_r4 part k, D = 128; D = 256 not measured), 6-11 % less time than 8
            num_warps=num_warps or (16 if D >= 128 else 4),
        )
    return kc, ks, vt, vs
