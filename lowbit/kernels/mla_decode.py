"""MLA decode attention over a paged latent cache, bf16 or SnapMLA FP8 (one kernel, constexpr FP8).

Absorbed MLA (DeepSeek-V2/V3; SnapMLA §2, digest 2.2): every head ``h`` of query token ``t``
carries ``q = [q_C W_UK | q_R]`` of width ``Dc + Dr`` (512 + 64); the cache holds one latent
``[c | k_R]`` per token, shared by all heads; key = the whole latent, value = its content part:

    o[t, h] = softmax_j( q[t, h] · kv[j] * sm_scale ) · c[j],      j < L - Sq + t + 1   (causal MTP)

Work decomposition (flash-decoding):
- a row is one (query token, head) pair, rows ``r = t * H + h`` of the ``Sq * H`` rows of one
  sequence; a program takes ``BLOCK_M`` (64) consecutive rows, so 64 heads share every KV tile
  loaded: the heads are the M dimension of both dots (``[64 x 576] x [576 x BLOCK_N]`` then
  ``[64 x BLOCK_N] x [BLOCK_N x 512]``, wgmma shapes on Hopper);
- the sequence is cut into ``num_splits`` chunks of ``chunk`` tokens (a multiple of BLOCK_N);
  grid = (row blocks, splits, batch), row blocks fastest so that the programs reading the same KV
  run side by side and share it through L2;
- each program walks its chunk in BLOCK_N-token blocks, in increasing order (monotone block
  order: SnapMLA App. C), gathering the rows of the block through the page table
  (``slot = page_table[b, n // PAGE] * PAGE + n % PAGE``), and keeps an online softmax;
- with one split the program writes the normalised output; otherwise fp32 partial outputs and
  their base-2 log-sum-exp go to a workspace and ``_mla_combine_kernel`` merges them.

FP8 path (``FP8=True``; SnapMLA §3.1-3.2, digest 2.3 and 2.5), for a row with query scale ``s_q``
and tokens with scales ``s_k``:
- QK: ``acc_s = q̂_C · ĉ^T`` (fp8 x fp8 -> fp32, promoted to full fp32 every 128 products, as
  DeepSeek-V3's N_C = 128) ``+ q̃_R · k̃_R^T`` (bf16, same fp32 accumulator: pre-scaled domain
  alignment), then ``S = acc_s * s_q * s_k * sm_scale``;
- PV: ``P̃ = exp(S - m) * s_k`` (the value scale fused into P, Key Step 2), re-quantized per block
  and row with ``σ = rowmax(P̃) / 448`` to ``P̂ = FP8(P̃ / σ)``; the fp32 accumulator and the
  softmax denominator both live in the "divided by σ" domain, so σ is folded into the online
  softmax rescale factor ``r = e^(m_old - m_new) * σ_old / σ_new`` and never applied explicitly
  (digest 2.5's reconstruction of Appendix B). ``P̂ · ĉ`` accumulates into the rescaled accumulator
  inside the fp8 wgmma (``acc = dot(P̂, ĉ, acc * r)``). Adding each block's product in a fresh fp32
  tile instead (``PV_PROMOTE=True``, DeepSeek-V3's promotion) keeps a second 64 x 512 fp32 tile
  live: 2 x 128 registers per thread, which spills; the device check compares both against the
  emulating reference at L = 32k in one split (``benchmarks/device/mla.py``).
- Decision (digest 2.5 / App. C hazard): σ is made monotone, ``σ_new = max(rowmax(P̃)/448,
  σ_old e^(m_old - m_new))``, so every rescale factor is <= 1: the accumulator's scale only moves
  one way (no division by a ratio that could overflow). Without it a late block whose scores lie
  far below the running max (σ ~ e^-100) would multiply the accumulator by ~e^100. The price: a
  block whose P̃ is tiny next to the history is quantized with the history's σ; the lost terms
  are below 2^-9 of what the accumulator already holds. Because the block that sets a new max
  always contains a P = 1 entry, σ >= s_k,min / 448 >= 5e-18 and l <= L / σ stays finite.

Variant ``PV_FP8=False`` (FP8 caches): FP8 QK as above, then ``P * s_k`` in bf16 times the FP8
latent upcast to bf16 (exact) in a bf16 wgmma: no P quantization and no V transpose (bf16 wgmma
takes the MN-major V tile as it is). Measured next to the SnapMLA path because Triton lowers the
register-to-smem transpose of the FP8 V tile to single-byte shared stores (64 STS.U8 per thread
per 32-token block in SASS), which dominates the FP8 PV path's time (docs/sections/mla.md).

Layouts (all row-major, last dim contiguous):
    q content  [B * Sq * H, Dc]   bf16/fp16 (or fp8 with FP8), row stride ``stride_qc``
    q rope     [B * Sq * H, Dr]   bf16/fp16 (pre-divided by s_q with FP8)
    q scale    [B * Sq * H]       fp32 (FP8 only)
    cache      content [slots, Dc], rope [slots, Dr], scale [slots] fp32 (FP8 only); slot = page * PAGE + offset
    page_table [B, max_pages] int32; seq_lens [B] int32 (tokens in the cache, including the Sq new ones)
    out        [B * Sq * H, Dc] in q's dtype (bf16 for FP8); workspace o fp32 [splits, rows, Dc], lse fp32 [splits, rows]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit._utils import cdiv, interpret_mode
from lowbit.kernels.mla_quant import _cast

LOG2E = 1.4426950408889634
FP8_MAX = 448.0
# GPU defaults per path (bf16, fp8): tokens per KV block and pipeline depth (smem: Q 72/40 KB +
# stages x the KV tile, under 227 KB; registers: 32-token blocks do not spill)
PV_BLOCK_N = {False: 64, True: 32}
PV_STAGES = {False: 2, True: 2}


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """tl.dot, except under Triton 3.6's interpreter, which multiplies bf16 bit patterns: fp32 there."""
    if INTERPRET:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _load_page(ptr, INTERPRET: tl.constexpr):
    """One page-table entry. On the GPU a plain ``ld.global.nc`` through inline PTX: Triton's
    pipeliner turns a ``tl.load`` here into an async copy in the same group as the KV tiles, whose
    address depends on it, and then waits for the whole group at the top of every iteration
    (``async_wait num=0``, no prefetch at all); hidden from it, the KV copies run a stage ahead.
    The entry is tiny and shared by consecutive blocks, so the load mostly hits L1."""
    if INTERPRET:
        return tl.load(ptr)
    return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _slots(PT, b, stride_pt, n0, end, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Cache slots of the BLOCK_N tokens from ``n0`` (-1 past ``end``)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ok = offs_n < end
    page = tl.load(PT + b * stride_pt + offs_n // PAGE, mask=ok, other=0)
    return tl.where(ok, page.to(tl.int64) * PAGE + offs_n % PAGE, -1)


@triton.jit
def _v_rows(KC, stride_kc, slot, offs_c):
    """The content rows at ``slot`` (zeros where slot < 0), loaded to registers."""
    return tl.load(KC + slot[:, None] * stride_kc + offs_c[None, :], mask=slot[:, None] >= 0, other=0.0,
                   eviction_policy="evict_first")


@triton.jit(do_not_specialize=["H", "SQ", "ROWS", "chunk"])  # one compile for every Sq, H, plan
def _mla_decode_kernel(
    # pointers
    QC, QR, QS, KC, KR, KS, PT, SEQ, O, LSE,
    # sizes
    sm_scale_log2e, H, SQ, ROWS, chunk,
    # strides
    stride_qc, stride_qr, stride_kc, stride_kr, stride_pt, stride_o, stride_os, stride_ls,
    # constexpr
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr, IMPRECISE: tl.constexpr,
    PV_PROMOTE: tl.constexpr, V_PREFETCH: tl.constexpr, PV_FP8: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(SEQ + b)
    start = pid_s * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < ROWS
    lim = seq_len - SQ + 1 + offs_m // H  # causal among the Sq query tokens: keys [0, lim)
    rows = b * ROWS + offs_m
    offs_c = tl.arange(0, DC)
    offs_r = tl.arange(0, DR)
    qc = tl.load(QC + rows[:, None] * stride_qc + offs_c[None, :], mask=row_ok[:, None], other=0.0)
    qr = tl.load(QR + rows[:, None] * stride_qr + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    if FP8:
        qscale = tl.load(QS + rows, mask=row_ok, other=0.0) * sm_scale_log2e

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    sig_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DC], tl.float32)
    if FP8:
        if V_PREFETCH:  # V rows one block ahead, their page ids two blocks ahead
            vc_next = _v_rows(KC, stride_kc, _slots(PT, b, stride_pt, start, end, BLOCK_N, PAGE), offs_c)
            vslot_next = _slots(PT, b, stride_pt, start + BLOCK_N, end, BLOCK_N, PAGE)
    for n0 in range(start, end, BLOCK_N):  # monotone block order (SnapMLA App. C)
        if FP8:
            if V_PREFETCH:  # this block's V rows (loaded one iteration ahead); issue the next block's
                vc = vc_next
                vc_next = _v_rows(KC, stride_kc, vslot_next, offs_c)
                vslot_next = _slots(PT, b, stride_pt, n0 + 2 * BLOCK_N, end, BLOCK_N, PAGE)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tok_ok = offs_n < end
        if PAGE % BLOCK_N == 0:  # the block lies in one page: one scalar page-table load
            page = _load_page(PT + b * stride_pt + n0 // PAGE, INTERPRET).to(tl.int64)
            slot = page * PAGE + (n0 % PAGE) + tl.arange(0, BLOCK_N)
        else:
            page = tl.load(PT + b * stride_pt + offs_n // PAGE, mask=tok_ok, other=0)
            slot = page.to(tl.int64) * PAGE + offs_n % PAGE
        kc = tl.load(KC + slot[:, None] * stride_kc + offs_c[None, :], mask=tok_ok[:, None], other=0.0,
                     eviction_policy="evict_last")
        kr = tl.load(KR + slot[:, None] * stride_kr + offs_r[None, :], mask=tok_ok[:, None], other=0.0)
        # QK^T: content groups then the RoPE group, one fp32 accumulator
        if FP8:
            ks = tl.load(KS + slot, mask=tok_ok, other=0.0)
            s = tl.dot(qc, tl.trans(kc), max_num_imprecise_acc=IMPRECISE)
            s = _dot(qr, tl.trans(kr), s, INTERPRET)
            s = s * qscale[:, None] * ks[None, :]
        else:
            s = _dot(qc, tl.trans(kc), None, INTERPRET)
            s = _dot(qr, tl.trans(kr), s, INTERPRET)
            s = s * sm_scale_log2e
        keep = (offs_n[None, :] < lim[:, None]) & tok_ok[None, :]
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        if FP8 and not PV_FP8:  # variant: FP8 QK, bf16 PV on the exactly upcast FP8 latent
            l_i = l_i * alpha + tl.sum(p, 1)
            if not V_PREFETCH:
                vc = _v_rows(KC, stride_kc, tl.where(tok_ok, slot, -1), offs_c)
            pvb = _cast(p * ks[None, :], tl.bfloat16, INTERPRET)
            acc = _dot(pvb, vc.to(tl.bfloat16), acc * alpha[:, None], INTERPRET)
        elif FP8:
            pv = p * ks[None, :]  # value scale fused into P (Key Step 2)
            sig_new = tl.maximum(tl.max(pv, 1) / 448.0, sig_i * alpha)  # monotone block scale
            inv_sig = tl.where(sig_new > 0, 1.0 / sig_new, 0.0)
            r = sig_i * alpha * inv_sig  # <= 1: sigma folded into the online-softmax rescale
            p8 = _cast(tl.minimum(pv * inv_sig[:, None], 448.0), KC.dtype.element_ty, INTERPRET)
            l_i = l_i * r + tl.sum(p, 1) * inv_sig
            # V = the same content rows, loaded a second time (an L2 hit) so that the K tile can stay
            # in its async-copied K-major smem buffer while this one is transposed through
            # registers into the k-major layout fp8 wgmma needs for V (SnapMLA §3.3, layer 3).
            # V_PREFETCH: this block's rows were loaded one iteration ahead (by hand: Triton does
            # not pipeline a load whose consumer is a register-to-smem transpose)
            if not V_PREFETCH:
                vc = _v_rows(KC, stride_kc, tl.where(tok_ok, slot, -1), offs_c)
            if PV_PROMOTE:  # each block's P̂·ĉ in a fresh fp32 tile: exact fp32 sum, 2x acc registers
                acc = acc * r[:, None] + tl.dot(p8, vc)
            else:  # accumulate in the wgmma accumulator (tensor-core fp8 accumulation, see docstring)
                acc = tl.dot(p8, vc, acc * r[:, None])
            sig_i = sig_new
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = _dot(_cast(p, KC.dtype.element_ty, INTERPRET), kc, acc, INTERPRET)
        m_i = m_new

    inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    out = acc * inv_l[:, None]
    if SPLIT:
        ell = l_i * sig_i if (FP8 and PV_FP8) else l_i
        lse = tl.where(l_i > 0, m_i + tl.log2(ell), float("-inf"))
        tl.store(LSE + pid_s * stride_ls + rows, lse, mask=row_ok)
        tl.store(O + pid_s * stride_os + rows[:, None] * stride_o + offs_c[None, :], out, mask=row_ok[:, None])
    else:
        tl.store(O + rows[:, None] * stride_o + offs_c[None, :], _cast(out, O.dtype.element_ty, INTERPRET),
                 mask=row_ok[:, None])


@triton.jit
def _mla_combine_kernel(
    OW, LSE, O,
    NSPLIT,
    stride_ows, stride_ow, stride_ls, stride_o,
    DC: tl.constexpr, SPLITS_P2: tl.constexpr, INTERPRET: tl.constexpr,
):
    """out[row] = sum_s 2^(lse_s - lse) o_s[row], lse = log2 sum_s 2^lse_s (empty splits: lse = -inf)."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_c = tl.arange(0, DC)
    s_ok = offs_s < NSPLIT
    lse = tl.load(LSE + offs_s * stride_ls + row, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    o = tl.load(OW + offs_s[:, None] * stride_ows + row * stride_ow + offs_c[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0)
    tl.store(O + row * stride_o + offs_c, _cast(out, O.dtype.element_ty, INTERPRET))


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def plan_splits(batch: int, row_blocks: int, max_len: int, block_n: int, device, num_splits: int | None = None):
    """(num_splits, chunk): enough programs to fill the SMs in whole waves, chunks of >= 4 blocks."""
    blocks = max(1, cdiv(max_len, block_n))
    if num_splits is None:
        sms = _num_sms(device)
        tiles = batch * row_blocks
        best, best_eff = 1, 0.0
        for s in range(1, min(64, max(1, blocks // 4)) + 1):
            n = tiles * s
            eff = n / (cdiv(n, sms) * sms) - 0.01 * (s - 1)  # small cost per extra split (combine pass)
            if eff > best_eff + 1e-9:
                best, best_eff = s, eff
        num_splits = best
    num_splits = max(1, min(num_splits, blocks))
    chunk = cdiv(blocks, num_splits) * block_n
    return cdiv(max_len, chunk) if max_len > 0 else 1, chunk


def mla_decode_triton(qc, qr, qs, kc, kr, ks, page_table, seq_lens, *, num_heads: int, sm_scale: float,
                      max_seq_len: int, page_size: int, fp8: bool, out_dtype=torch.bfloat16,
                      num_splits: int | None = None, block_n: int | None = None, block_m: int | None = None,
                      imprecise: int = 128, pv_promote: bool = False, v_prefetch: bool = True, pv_fp8: bool = True, num_warps: int | None = None,
                      num_stages: int | None = None,
                      return_plan: bool = False):
    """Launch the decode kernel. ``qc`` [B, Sq*H, Dc] (fp8 with ``fp8``), ``qr`` [B, Sq*H, Dr],
    ``qs`` [B, Sq*H] fp32 or None; cache tensors as in the module docstring. Returns the output
    [B, Sq*H, Dc] in ``out_dtype`` (and, with ``return_plan``, a dict: splits, chunk, block_n,
    block_m and the compiled decode kernel, for the reference's emulation and for PTX checks).
    Arguments are validated by ``lowbit.ops.mla.mla_decode``."""
    B, ROWS, DC = qc.shape
    DR = qr.shape[-1]
    SQ = ROWS // num_heads
    dev = qc.device
    interp = interpret_mode() or dev.type != "cuda"
    if block_m is None:
        block_m = 64 if not interp else max(16, min(64, triton.next_power_of_2(ROWS)))
    if block_n is None:
        block_n = PV_BLOCK_N[fp8] if not interp else 16
    if dev.type == "cuda" and block_m < 64:
        raise ValueError("block_m must be >= 64 on the GPU (wgmma tile)")
    row_blocks = cdiv(ROWS, block_m)
    splits, chunk = plan_splits(B, row_blocks, max_seq_len, block_n, dev, num_splits)
    out = torch.empty(B, ROWS, DC, device=dev, dtype=out_dtype)
    qc2, qr2 = qc.reshape(B * ROWS, DC), qr.reshape(B * ROWS, DR)
    if splits > 1:
        ow = torch.empty(splits, B * ROWS, DC, device=dev, dtype=torch.float32)
        lse = torch.empty(splits, B * ROWS, device=dev, dtype=torch.float32)
        o_arg, so, sos, sls = ow, ow.stride(1), ow.stride(0), lse.stride(0)
    else:
        ow = lse = None
        o_arg, so, sos, sls = out.view(B * ROWS, DC), DC, 0, 0
    if num_warps is None:
        num_warps = 8 if (not interp and DC >= 256) else 4
    if num_stages is None:
        num_stages = PV_STAGES[fp8] if not interp else 1
    dummy = kc.new_empty(1, dtype=torch.float32) if qs is None else None
    kernel = _mla_decode_kernel[(row_blocks, splits, B)](
        qc2, qr2, qs if qs is not None else dummy, kc, kr, ks if ks is not None else dummy,
        page_table, seq_lens, o_arg, lse if lse is not None else o_arg,
        sm_scale * LOG2E, num_heads, SQ, ROWS, chunk,
        qc2.stride(0), qr2.stride(0), kc.stride(0), kr.stride(0), page_table.stride(0), so, sos, sls,
        DC=DC, DR=DR, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page_size, FP8=fp8, SPLIT=splits > 1,
        IMPRECISE=min(imprecise, DC), PV_PROMOTE=pv_promote, V_PREFETCH=v_prefetch, PV_FP8=pv_fp8, INTERPRET=interpret_mode(), num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _mla_combine_kernel[(B * ROWS,)](
            ow, lse, out.view(B * ROWS, DC), splits,
            ow.stride(0), ow.stride(1), lse.stride(0), DC,
            DC=DC, SPLITS_P2=max(2, triton.next_power_of_2(splits)), INTERPRET=interpret_mode(), num_warps=4,
        )
    if return_plan:
        return out, {"splits": splits, "chunk": chunk, "block_n": block_n, "block_m": block_m, "kernel": kernel}
    return out
