"""bf16 / fp16 MLA decode for many heads per sequence: Gluon, warp-specialized, wgmma + TMA (GPU only, Hopper).

The compute-bound case of absorbed MLA (DeepSeek-V2/V3, 128 heads: ~242 FLOP per cache byte, above the H200's ridge).
The Triton kernel of ``lowbit.kernels.mla_decode`` (the CPU / interpreter path and the fallback) reaches ~33% of the
bf16 peak there: with 64 rows and 8 warps Triton puts all warps along M for the chained dots, so both warpgroups
compute the same 64 x 64 score tile (1.53x the needed MMA work), and every wgmma is waited on at once. Here the roles
are written out (FlashMLA's split of the work):

Per program: ``BM = 64`` rows (query token, head) of one sequence and one split of its tokens; 64-token blocks
through a TMA ring of 2 stages (bf16; FP8: ``FP8_STAGES`` = 3) (a block = one 64-slot slice of a page: one copy per
cache tensor, ``mbarrier`` completion). Three partitions (``gl.warp_specialize``):

- loader (1 warp): Q once, then each block into the ring once both warpgroups have released the stage;
- first warpgroup (default partition): ``S = q_C · c^T + q_R · k_R^T`` [64, 64] on wgmma (all 64 tokens, fp32), the
  online softmax in base 2 (``sm_scale * log2(e)`` folded into one multiply), P (rounded to the cache dtype) and the
  rescale factor to shared memory for the second warpgroup, then ``O[:, :256] = O * alpha + P · c[:, :256]`` with P
  from registers; at the end the row sums (shared memory), its half of O and the LSE;
- second warpgroup: per block, waits for P, ``O[:, 256:] = O * alpha + P · c[:, 256:]`` (P from shared memory), then
  releases P and the stage; at the end normalises by the first warpgroup's row sums.

So the second warpgroup's P·V of block j runs on the tensor cores beside the first one's QK^T of block j+1, and no
MMA work is duplicated. The value tile is the content part of the stage ([64 tokens, 512], MN-major B operand:
16-bit wgmma reads it transposed, no copy). Accumulators: 128 fp32 registers per thread per warpgroup
(64 x 256); registers: first warpgroup 256, second ``WS_PV_REGS``, loader 24 (``maxnreg`` = ``WS_MAXNREG`` per
thread of the 12 warps). Shared memory: Q 72 KB + 2 stages x 72 KB + P 8 KB = 225 KB, one program per SM.

Numerics: as the Triton bf16 path (P rounded to the cache dtype before P·V, fp32 accumulation, fp32 softmax
statistics; ``mla_decode_ref`` is the reference: GPU tests, rel-L2 equal to the Triton kernel's to 4 digits).
Masks: keys past the split or the sequence and, with MTP, past the causal limit ``lim = L - Sq + 1 + t`` get score
-inf (blocks every row sees whole skip the mask). The tail block's copy reads the whole 64-slot slice of its page
(pages are a multiple of 64 tokens): its rows past the length are zeroed in shared memory before use, so stale or
non-finite slot contents never reach O (0 * NaN). Split-KV partials and the combine are the Triton kernel's
(``split_workspace``, ``combine_splits``).

Measured (H200, session 20, ``benchmarks/results/h200/s20_mla_wgmma*.json``; ms at B=32 H=128 L=16k, Triton 0.554):
one 8-warp program, both warpgroups splitting the scores' columns and the values' columns, every wgmma waited (no
warp specialization): 0.357 (P to the second dot through a register layout conversion), 0.345-0.350 (P through a
shared tile); with QK^T of block j+1 issued before P·V of block j (2 stages: its K copy is then waited on almost at
once) 0.421-0.438; this form 0.251 (583 TFLOP/s). The FP8 form (session 21): 0.249 (586 TFLOP/s) with the value
transpose as packed ``prmt`` (0.363 with Triton's byte-wise transpose), 0.234 (625 TFLOP/s, 1.09x bf16) with a 3-stage
ring (``FP8_STAGES``).
"""
from __future__ import annotations

import torch

from lowbit.kernels.mla_decode import BYTES_T4_PTX, LOG2E, combine_splits, plan_splits, split_workspace

try:  # Gluon ships with Triton >= 3.4; the interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    HAS_GLUON = True
except Exception:  # pragma: no cover - older Triton
    HAS_GLUON = False

BM = 64  # rows per program (one wgmma M tile)
BN = 64  # tokens per block
WS_PV_REGS = 192  # registers per thread of the second warpgroup (S20: 224 and 160 within 1% or slower)
WS_MAXNREG = 168  # the kernel's cap per thread; the default partition gets what the workers leave (256)
# FP8 form: TMA ring depth. 3 (one value-tile buffer instead of two, same 197 KB): 4.5-7.3% faster than 2 at every
# shape of the session-21 probe (s21_mla_wgmma_stages.json; 0.2338 vs 0.2448 ms at B=32 H=128 L=16k)
FP8_STAGES = 3


def supported(rows: int, dc: int, dr: int, page_size: int, qc, qr, kc, kr, qs=None, ks=None) -> bool:
    """Whether a launch can run here: a Hopper GPU, rows per sequence a multiple of 64, the DeepSeek latent (512 + 64),
    pages a multiple of the 64-token block, every tensor TMA-addressable (16-byte aligned base and row stride, unit
    stride along the row), and the dtypes of one form: bf16/fp16 throughout (``qs`` / ``ks`` None), or FP8 E4M3
    content with bf16 RoPE parts and fp32 scales (``ks`` contiguous: read as 64-float rows)."""
    if not HAS_GLUON or rows % BM or dc != 512 or dr != 64 or page_size % BN:
        return False
    if ks is None:
        if qc.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != qc.dtype for t in (qr, kc, kr)):
            return False
        tensors = (qc, qr, kc, kr)
    else:
        f8 = torch.float8_e4m3fn
        if qc.dtype != f8 or kc.dtype != f8 or qr.dtype != torch.bfloat16 or kr.dtype != torch.bfloat16:
            return False
        if qs is None or qs.dtype != torch.float32 or ks.dtype != torch.float32 or not ks.is_contiguous():
            return False
        tensors = (qc, qr, kc, kr, ks)
    for t in tensors:
        if t.device.type != "cuda" or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if t.dim() > 1 and (t.stride(-2) * t.element_size()) % 16:
            return False
    return torch.cuda.get_device_capability(kc.device)[0] == 9

if HAS_GLUON:
    _T4X4 = gl.constexpr(BYTES_T4_PTX)  # 4 x 4 byte transpose by 8 prmt (words a, b, c, d -> (a_k, b_k, c_k, d_k))

    @gluon.jit
    def _bounds(SEQ, chunk):
        """This program's (row block, split, sequence) and its key range ``[start, end)`` in 64-token blocks."""
        pid_m = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = gl.program_id(2)
        seq_len = gl.load(SEQ + b)
        start = pid_s * chunk
        end = gl.minimum(start + chunk, seq_len)
        n_blk = (gl.maximum(end - start, 0) + 63) // 64
        return pid_m, pid_s, b, seq_len, start, end, n_blk

    @gluon.jit
    def _store_cols(acc, l_o, O, rows, stride_o, stride_os, pid_s, C0: gl.constexpr, W: gl.constexpr,
                    o_l: gl.constexpr, SPLIT: gl.constexpr):
        """Columns ``[C0, C0 + W)`` of O (or of the split's fp32 partial) = acc / l."""
        cols = C0 + gl.arange(0, W, layout=gl.SliceLayout(0, o_l))
        out = acc * gl.where(l_o == 0, 0.0, 1.0 / l_o)[:, None]
        optr = O + pid_s * stride_os + rows[:, None].to(gl.int64) * stride_o + cols[None, :]
        if SPLIT:
            gl.store(optr, out)
        else:
            gl.store(optr, out.to(O.dtype.element_ty))

    @gluon.jit
    def _zero_tail(kc_smem, kr_smem, stage, valid, DC: gl.constexpr, DR: gl.constexpr, BN: gl.constexpr):
        """bf16 form: rows ``>= valid`` of a stage set to 0 (the tail block: slots past the sequence), 64 columns at
        a time."""
        zl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
        keep = (gl.arange(0, BN, layout=gl.SliceLayout(1, zl)) < valid)[:, None]
        for c in gl.static_range(DC // 64):
            part = kc_smem.index(stage).slice(c * 64, 64, dim=1)
            x = part.load(zl)
            part.store(gl.where(keep, x, gl.zeros_like(x)))
        r = kr_smem.index(stage).load(zl)
        kr_smem.index(stage).store(gl.where(keep, r, gl.zeros_like(r)))
        fence_async_shared()  # the generic-proxy stores before the wgmma (async proxy) reads

    @gluon.jit
    def _vt_tile(x, tl_: gl.constexpr):
        """``x`` [64 tokens, 128 columns] FP8 codes in ``tl_`` (4 tokens x 16 columns per thread) -> its transpose
        [128, 64] as uint8, each 4 x 4 byte block transposed in registers by 8 ``prmt`` (``_T4X4``)."""
        x = x.to(gl.uint8, bitcast=True).reshape([16, 4, 128]).permute(0, 2, 1).reshape([16, 128, 2, 2])
        ev, od = gl.split(x)  # tokens 4i + {0, 2} and 4i + {1, 3}
        a, c = gl.split(ev)
        b, d = gl.split(od)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_T4X4, "=r,=r,=r,=r,r,r,r,r", [a, b, c, d],
                                                   dtype=(gl.uint8, gl.uint8, gl.uint8, gl.uint8), is_pure=True,
                                                   pack=4)
        # o_k[i, 4w + m] = x[4i + m, 4w + k]  ->  vt[4w + k, 4i + m]
        z = gl.join(gl.join(o0, o2), gl.join(o1, o3)).reshape([16, 32, 4, 4])  # (i, w, m, k)
        return z.permute(1, 3, 0, 2).reshape([128, 64])

    @gluon.jit
    def _vt_block(kc_smem, vt_smem, st, vi, valid):
        """FP8 form: the K-major copy of one stage's FP8 content tile that FP8 wgmma needs for P·V (``vt [512, 64]``):
        4 tokens x 16 columns per thread (16-byte loads), transposed in registers (``_vt_tile``; 4-byte stores);
        in the tail block rows past the sequence are written as 0 (no 0 * NaN from stale slots); then a fence and
        the warpgroup's barrier."""
        BN: gl.constexpr = 64
        # 16 token groups x 2 column groups per warp: each 4-byte store instruction writes 2 rows of vt, 16 columns
        # apart, which the 64-byte swizzle puts on the same banks (2-way; 8 x 4 lanes: 4 rows, 4-way, 5-8% slower)
        tl_: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 16], threads_per_warp=[16, 2], warps_per_cta=[1, 4],
                                             order=[1, 0])
        if valid < BN:
            tok = gl.arange(0, BN, layout=gl.SliceLayout(1, tl_))
            for c in gl.static_range(4):
                x = kc_smem.index(st).slice(c * 128, 128, dim=1).load(tl_)
                x = gl.where((tok < valid)[:, None], x, gl.zeros_like(x))
                vt_smem.index(vi).slice(c * 128, 128, dim=0).store(_vt_tile(x, tl_).to(gl.float8e4nv, bitcast=True))
        else:
            for c in gl.static_range(4):
                x = kc_smem.index(st).slice(c * 128, 128, dim=1).load(tl_)
                vt_smem.index(vi).slice(c * 128, 128, dim=0).store(_vt_tile(x, tl_).to(gl.float8e4nv, bitcast=True))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _publish_p(p, scale, p_smem, a_smem, p_free, p_ready, j):
        """First warpgroup: block ``j``'s P (in the P·V dtype) and its per-row rescale factor to shared memory for
        the second warpgroup, once that one is done with block ``j - 1``'s."""
        mbarrier.wait(p_free, (j & 1) ^ 1)
        p_smem.store(p)
        a_smem.store(scale)
        fence_async_shared()
        mbarrier.arrive(p_ready)

    @gluon.jit
    def _left_epilogue(acc, l_i, m_i, lse_l, l_smem, done, O, LSE, row0, pid_s, stride_o, stride_os, stride_ls,
                       o_l: gl.constexpr, SPLIT: gl.constexpr):
        """First warpgroup, after the last block: the row sums ``l_i`` to the second warpgroup (``done``), the split's
        LSE ``m + log2(lse_l)`` (``lse_l``: the real denominator; FP8: ``l_i * sigma``) and value columns [0, 256)."""
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)
        l_smem.store(l_i)
        mbarrier.arrive(done)
        l_o = gl.convert_layout(l_i, row_o)
        rows = row0 + gl.arange(0, acc.shape[0], layout=row_o)
        if SPLIT:
            ell = gl.convert_layout(lse_l, row_o)
            m_o = gl.convert_layout(m_i, row_o)
            gl.store(LSE + pid_s * stride_ls + rows, gl.where(l_o == 0, float("-inf"), m_o + gl.log2(ell)))
        _store_cols(acc, l_o, O, rows, stride_o, stride_os, pid_s, 0, acc.shape[1], o_l, SPLIT)

    @gluon.jit
    def _softmax(s, n0, end, lim, m_i, l_i, sm_scale_log2e, BN: gl.constexpr, s_l: gl.constexpr,
                 MASK: gl.constexpr = True):
        """bf16 form: online softmax of one block's scores (base 2): returns (P fp32, alpha, m, l). ``MASK`` False: a
        block every row sees whole (no key past the split, the sequence or the causal limit)."""
        if MASK:
            offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
            ok = (offs_n[None, :] < end) & (offs_n[None, :] < lim[:, None])
            t = gl.where(ok, s * sm_scale_log2e, float("-inf"))
        else:
            t = s * sm_scale_log2e
        m_new = gl.maximum(m_i, gl.max(t, axis=1))
        if MASK:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(t - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _ws_loader(qc_desc, qr_desc, kc_desc, kr_desc, ks_desc, qc_smem, qr_smem, kc_smem, kr_smem, ks_smem, qbar,
                   kv_ready, kv_free, PT, SEQ, ROWS, chunk, stride_pt, PAGE: gl.constexpr, FP8: gl.constexpr):
        """1-warp partition: Q once, then per 64-token block the content and RoPE rows of its page slice (and, FP8,
        the fp32 token scales) into the 2-stage ring; a stage is refilled once both warpgroups released it."""
        BN: gl.constexpr = 64
        STAGES: gl.constexpr = kc_smem.shape[0]
        if FP8:
            NBYTES: gl.constexpr = kc_desc.block_type.nbytes + kr_desc.block_type.nbytes + ks_desc.block_type.nbytes
        else:
            NBYTES: gl.constexpr = kc_desc.block_type.nbytes + kr_desc.block_type.nbytes
        pid_m, pid_s, b, seq_len, start, end, n_blk = _bounds(SEQ, chunk)
        ptb = PT + b.to(gl.int64) * stride_pt
        row0 = b * ROWS + pid_m * 64
        mbarrier.expect(qbar, qc_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(qc_desc, [row0, 0], qbar, qc_smem)
        tma.async_copy_global_to_shared(qr_desc, [row0, 0], qbar, qr_smem)
        for j in range(0, n_blk):
            st = j % STAGES
            mbarrier.wait(kv_free.index(st), ((j // STAGES) & 1) ^ 1)
            n0 = start + j * BN
            slot = gl.load(ptb + n0 // PAGE) * PAGE + n0 % PAGE
            mbarrier.expect(kv_ready.index(st), NBYTES)
            tma.async_copy_global_to_shared(kc_desc, [slot, 0], kv_ready.index(st), kc_smem.index(st))
            tma.async_copy_global_to_shared(kr_desc, [slot, 0], kv_ready.index(st), kr_smem.index(st))
            if FP8:
                tma.async_copy_global_to_shared(ks_desc, [slot // BN, 0], kv_ready.index(st), ks_smem.index(st))

    @gluon.jit
    def _ws_pv_right(kc_smem, vt_smem, kv_ready, kv_free, vt_ready, vt_free, p_smem, a_smem, l_smem, p_ready, p_free,
                     done, O, SEQ, ROWS, chunk, stride_o, stride_os, SPLIT: gl.constexpr, FP8: gl.constexpr):
        """4-warp partition (second warpgroup), value columns [256, 512): per block (FP8: first the K-major value
        tile, ``_vt_block``, released to the first warpgroup with ``vt_ready``) wait for P and its rescale factor
        (shared memory), ``O = O * alpha + P · V[:, 256:]``, release P and the stage; then normalise by the first
        warpgroup's row sums and store."""
        HALF: gl.constexpr = 256
        STAGES: gl.constexpr = kc_smem.shape[0]
        VT: gl.constexpr = vt_smem.shape[0]  # FP8 value-tile buffers (one beside a 3-stage ring)
        if FP8:
            o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HALF, 32])
        else:
            o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HALF, 16])
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)
        pid_m, pid_s, b, seq_len, start, end, n_blk = _bounds(SEQ, chunk)
        acc = gl.zeros([64, HALF], gl.float32, o_l)
        for j in range(0, n_blk):
            st = j % STAGES
            vi = j % VT
            mbarrier.wait(kv_ready.index(st), (j // STAGES) & 1)
            if FP8:
                mbarrier.wait(vt_free.index(vi), ((j // VT) & 1) ^ 1)  # the first warpgroup's P·V of block j - VT
                _vt_block(kc_smem, vt_smem, st, vi, end - (start + j * 64))
                mbarrier.arrive(vt_ready.index(vi))
            mbarrier.wait(p_ready, j & 1)
            alpha = a_smem.load(row_o)
            acc = acc * alpha[:, None]
            if FP8:
                v = vt_smem.index(vi).slice(HALF, HALF, dim=0).permute((1, 0))
            else:
                v = kc_smem.index(st).slice(HALF, HALF, dim=1)
            acc = warpgroup_mma(p_smem, v, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(p_free)
            mbarrier.arrive(kv_free.index(st))
        mbarrier.wait(done, 0)
        rows = b * ROWS + pid_m * 64 + gl.arange(0, 64, layout=row_o)
        _store_cols(acc, l_smem.load(row_o), O, rows, stride_o, stride_os, pid_s, HALF, HALF, o_l, SPLIT)

    @gluon.jit
    def _ws_softmax_pv_left(qc_smem, qr_smem, kc_smem, kr_smem, qbar, kv_ready, kv_free, p_smem, a_smem, l_smem,
                            p_ready, p_free, done, SEQ, O, LSE, sm_scale_log2e, H, SQ, ROWS, chunk, stride_o,
                            stride_os, stride_ls, DC: gl.constexpr, DR: gl.constexpr, SPLIT: gl.constexpr):
        """bf16 form, default partition (first warpgroup): per block ``S = q_C c^T + q_R k_R^T`` (all 64 tokens), the
        online softmax, P and its rescale factor to shared memory for the second warpgroup, then ``O = O * alpha +
        P · c[:, :256]`` with P from registers; at the end the row sums for the second warpgroup, its own half of O
        and the LSE."""
        BM: gl.constexpr = 64
        BN: gl.constexpr = 64
        HALF: gl.constexpr = DC // 2
        STAGES: gl.constexpr = kc_smem.shape[0]
        dt: gl.constexpr = qc_smem.dtype
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)
        pid_m, pid_s, b, seq_len, start, end, n_blk = _bounds(SEQ, chunk)
        offs_m = pid_m * BM + gl.arange(0, BM, layout=row_s)
        lim = seq_len - SQ + 1 + offs_m // H  # causal among the Sq query tokens: keys [0, lim)
        vis = gl.minimum(end, seq_len - SQ + 1)  # keys below this are seen by every row
        m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BM], gl.float32, row_s)
        acc = gl.zeros([BM, HALF], gl.float32, o_l)
        mbarrier.wait(qbar, 0)
        for j in range(0, n_blk):
            st = j % STAGES
            n0 = start + j * BN
            mbarrier.wait(kv_ready.index(st), (j // STAGES) & 1)
            if n0 + BN > end:  # the tail block: rows past the sequence zeroed (no 0 * NaN from stale slots)
                _zero_tail(kc_smem, kr_smem, st, end - n0, DC, DR, BN)
                gl.thread_barrier()
            s = warpgroup_mma(qc_smem, kc_smem.index(st).permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_l),
                              use_acc=False, is_async=True)
            s = warpgroup_mma(qr_smem, kr_smem.index(st).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if n0 + BN <= vis:
                p, alpha, m_i, l_i = _softmax(s, n0, end, lim, m_i, l_i, sm_scale_log2e, BN, s_l, False)
            else:
                p, alpha, m_i, l_i = _softmax(s, n0, end, lim, m_i, l_i, sm_scale_log2e, BN, s_l, True)
            pb = p.to(dt)
            _publish_p(pb, alpha, p_smem, a_smem, p_free, p_ready, j)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(gl.convert_layout(pb, a_l), kc_smem.index(st).slice(0, HALF, dim=1), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(kv_free.index(st))
        _left_epilogue(acc, l_i, m_i, l_i, l_smem, done, O, LSE, b * ROWS + pid_m * BM, pid_s, stride_o, stride_os,
                       stride_ls, o_l, SPLIT)

    @gluon.jit
    def _ws8_softmax_pv_left(qc_smem, qr_smem, kc_smem, kr_smem, ks_smem, vt_smem, qbar, kv_ready, kv_free, vt_ready,
                             vt_free, p_smem, a_smem, l_smem, p_ready, p_free, done, QS, SEQ, O, LSE, sm_scale_log2e,
                             H, SQ, ROWS, chunk, stride_o, stride_os, stride_ls, DC: gl.constexpr,
                             SPLIT: gl.constexpr):
        """FP8 form, first warpgroup: ``t = (q̂_C ĉ^T + q̃_R k̃_R^T) s_k`` (FP8 and bf16 wgmma, two fp32
        accumulators summed), then the SnapMLA online softmax of the Triton FP8 path (``_softmax_step_t``, row P
        scale: ``P̃ = exp2(t s_q sm_scale log2e - m) s_k``, monotone ``σ``, ``P̂ = FP8(P̃ / σ)``, σ folded into the
        rescale factor r), P̂ and r to shared memory, then ``O[:, :256] = O * r + P̂ · vt[:256]^T``."""
        BM: gl.constexpr = 64
        BN: gl.constexpr = 64
        HALF: gl.constexpr = DC // 2
        STAGES: gl.constexpr = kc_smem.shape[0]
        VT: gl.constexpr = vt_smem.shape[0]
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        sr_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 32])
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        col_s: gl.constexpr = gl.SliceLayout(0, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)
        ks_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 4],
                                              order=[1, 0])
        pid_m, pid_s, b, seq_len, start, end, n_blk = _bounds(SEQ, chunk)
        offs_m = pid_m * BM + gl.arange(0, BM, layout=row_s)
        lim = seq_len - SQ + 1 + offs_m // H
        qscale = gl.load(QS + b * ROWS + offs_m) * sm_scale_log2e  # > 0
        m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BM], gl.float32, row_s)
        sig_i = gl.zeros([BM], gl.float32, row_s)
        acc = gl.zeros([BM, HALF], gl.float32, o_l)
        mbarrier.wait(qbar, 0)
        for j in range(0, n_blk):
            st = j % STAGES
            vi = j % VT
            n0 = start + j * BN
            mbarrier.wait(kv_ready.index(st), (j // STAGES) & 1)
            s = warpgroup_mma(qc_smem, kc_smem.index(st).permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_l),
                              use_acc=False, is_async=True)
            sr = warpgroup_mma(qr_smem, kr_smem.index(st).permute((1, 0)), gl.zeros([BM, BN], gl.float32, sr_l),
                               use_acc=False, is_async=True)
            s, sr = warpgroup_mma_wait(num_outstanding=0, deps=(s, sr))
            s = s + gl.convert_layout(sr, s_l)  # the same registers (only the instruction's K differs)
            ks = gl.convert_layout(gl.reshape(ks_smem.index(st).load(ks_l), [BN]), col_s)
            offs_n = n0 + gl.arange(0, BN, layout=col_s)
            ok = (offs_n[None, :] < end) & (offs_n[None, :] < lim[:, None])
            t = gl.where(ok, s * ks[None, :], float("-inf"))
            m_new = gl.maximum(m_i, gl.max(t, axis=1) * qscale)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_safe))
            sig_keep = sig_i * alpha
            p = gl.exp2(t * qscale[:, None] - m_safe[:, None])
            pt = p * gl.where(ok, ks[None, :], 0.0)
            sig_new = gl.maximum(gl.max(pt, axis=1) * (1.0 / 448.0), sig_keep)  # monotone block scale
            inv_sig = gl.where(sig_new > 0, 1.0 / sig_new, 0.0)
            r = gl.where(sig_new == sig_keep, 1.0, sig_keep * inv_sig)
            l_i = l_i * r + gl.sum(p, axis=1) * inv_sig
            m_i = m_new
            sig_i = sig_new
            _publish_p((pt * inv_sig[:, None]).to(gl.float8e4nv), r, p_smem, a_smem, p_free, p_ready, j)
            acc = acc * gl.convert_layout(r, row_o)[:, None]
            mbarrier.wait(vt_ready.index(vi), (j // VT) & 1)
            acc = warpgroup_mma(p_smem, vt_smem.index(vi).slice(0, HALF, dim=0).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(vt_free.index(vi))
            mbarrier.arrive(kv_free.index(st))
        _left_epilogue(acc, l_i, m_i, l_i * sig_i, l_smem, done, O, LSE, b * ROWS + pid_m * BM, pid_s, stride_o,
                       stride_os, stride_ls, o_l, SPLIT)

    @gluon.jit
    def _handoff_smem(p_dt: gl.constexpr):
        """What the first warpgroup hands the second besides the barriers: P [64, 64] in ``p_dt`` (the P·V operand),
        the per-row rescale factors and, at the end, the row sums (fp32 [64])."""
        p_smem = gl.allocate_shared_memory(p_dt, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], p_dt))
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        a_smem = gl.allocate_shared_memory(gl.float32, [64], vec_l)
        l_smem = gl.allocate_shared_memory(gl.float32, [64], vec_l)
        return p_smem, a_smem, l_smem

    @gluon.jit
    def _barriers():
        """The kernels' mbarriers, initialised: Q, the ring's ready / free (both warpgroups release a stage), the FP8
        value tile's ready, P ready / free, done (the row sums are in shared memory)."""
        qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        vt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        vt_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(qbar, count=1)
        for i in gl.static_range(3):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_free.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(vt_ready.index(i), count=1)
            mbarrier.init(vt_free.index(i), count=1)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        mbarrier.init(done, count=1)
        return qbar, kv_ready, kv_free, vt_ready, vt_free, p_ready, p_free, done

    @gluon.jit
    def _mla_ws_kernel(qc_desc, qr_desc, kc_desc, kr_desc, PT, SEQ, O, LSE,
                       sm_scale_log2e, H, SQ, ROWS, chunk, stride_pt, stride_o, stride_os, stride_ls,
                       DC: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
                       PV_REGS: gl.constexpr):
        """bf16 / fp16 form (module docstring): a 1-warp TMA loader, the first warpgroup (scores, softmax, value
        columns [0, 256)) and the second (value columns [256, 512))."""
        BM: gl.constexpr = 64
        BN: gl.constexpr = 64
        dt: gl.constexpr = qc_desc.dtype
        qc_smem = gl.allocate_shared_memory(dt, [BM, DC], qc_desc.layout)
        qr_smem = gl.allocate_shared_memory(dt, [BM, DR], qr_desc.layout)
        kc_smem = gl.allocate_shared_memory(dt, [2, BN, DC], kc_desc.layout)
        kr_smem = gl.allocate_shared_memory(dt, [2, BN, DR], kr_desc.layout)
        p_smem, a_smem, l_smem = _handoff_smem(dt)
        qbar, kv_ready, kv_free, vt_ready, vt_free, p_ready, p_free, done = _barriers()
        gl.warp_specialize([
            (_ws_softmax_pv_left, (qc_smem, qr_smem, kc_smem, kr_smem, qbar, kv_ready, kv_free, p_smem, a_smem, l_smem,
                                   p_ready, p_free, done, SEQ, O, LSE, sm_scale_log2e, H, SQ, ROWS, chunk, stride_o,
                                   stride_os, stride_ls, DC, DR, SPLIT)),
            (_ws_pv_right, (kc_smem, kc_smem, kv_ready, kv_free, vt_ready, vt_free, p_smem, a_smem, l_smem, p_ready,
                            p_free, done, O, SEQ, ROWS, chunk, stride_o, stride_os, SPLIT, False)),
            (_ws_loader, (qc_desc, qr_desc, kc_desc, kr_desc, kr_desc, qc_smem, qr_smem, kc_smem, kr_smem, kr_smem,
                          qbar, kv_ready, kv_free, PT, SEQ, ROWS, chunk, stride_pt, PAGE, False)),
        ], [4, 1], [PV_REGS, 24])

    @gluon.jit
    def _mla_ws_fp8_kernel(qc_desc, qr_desc, kc_desc, kr_desc, ks_desc, QS, PT, SEQ, O, LSE,
                           sm_scale_log2e, H, SQ, ROWS, chunk, stride_pt, stride_o, stride_os, stride_ls,
                           DC: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
                           PV_REGS: gl.constexpr, STAGES: gl.constexpr):
        """SnapMLA FP8 form of ``_mla_ws_kernel``: the loader also brings the token scales, the second warpgroup
        also writes the K-major FP8 value tile that P·V needs. ``STAGES`` 2 (two value tiles, 190 KB of shared
        memory) or 3 (one value tile, released by the first warpgroup's ``vt_free``; 198 KB)."""
        BM: gl.constexpr = 64
        BN: gl.constexpr = 64
        f8: gl.constexpr = gl.float8e4nv
        qc_smem = gl.allocate_shared_memory(f8, [BM, DC], qc_desc.layout)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, DR], qr_desc.layout)
        VT: gl.constexpr = 2 if STAGES == 2 else 1
        kc_smem = gl.allocate_shared_memory(f8, [STAGES, BN, DC], kc_desc.layout)
        kr_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, DR], kr_desc.layout)
        ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BN], ks_desc.layout)
        vt_smem = gl.allocate_shared_memory(f8, [VT, DC, BN], gl.NVMMASharedLayout.get_default_for([DC, BN], f8))
        p_smem, a_smem, l_smem = _handoff_smem(f8)
        qbar, kv_ready, kv_free, vt_ready, vt_free, p_ready, p_free, done = _barriers()
        gl.warp_specialize([
            (_ws8_softmax_pv_left, (qc_smem, qr_smem, kc_smem, kr_smem, ks_smem, vt_smem, qbar, kv_ready, kv_free,
                                    vt_ready, vt_free, p_smem, a_smem, l_smem, p_ready, p_free, done, QS, SEQ, O, LSE,
                                    sm_scale_log2e, H, SQ, ROWS, chunk, stride_o, stride_os, stride_ls, DC, SPLIT)),
            (_ws_pv_right, (kc_smem, vt_smem, kv_ready, kv_free, vt_ready, vt_free, p_smem, a_smem, l_smem, p_ready,
                            p_free, done, O, SEQ, ROWS, chunk, stride_o, stride_os, SPLIT, True)),
            (_ws_loader, (qc_desc, qr_desc, kc_desc, kr_desc, ks_desc, qc_smem, qr_smem, kc_smem, kr_smem, ks_smem,
                          qbar, kv_ready, kv_free, PT, SEQ, ROWS, chunk, stride_pt, PAGE, True)),
        ], [4, 1], [PV_REGS, 24])


def _desc(t, rows: int, cols: int, block: list, dtype):
    """TMA descriptor of a ``[rows, cols]`` row view (row stride ``t.stride(0)``) with a ``block`` box in the
    default NVMMA shared layout of ``dtype``."""
    return GluonTensorDescriptor(t, [rows, cols], [t.stride(0), 1], block,
                                 gl.NVMMASharedLayout.get_default_for(block, dtype))


def mla_decode_wgmma(qc, qr, qs, kc, kr, ks, page_table, seq_lens, *, num_heads: int, sm_scale: float,
                     max_seq_len: int, page_size: int, out_dtype=None, num_splits: int | None = None,
                     ws_regs: tuple | None = None, stages: int | None = None, return_plan: bool = False):
    """Launch either form (``supported`` must hold; arguments as ``mla_decode_triton``'s): ``qc`` [B, Sq*H, 512],
    ``qr`` [B, Sq*H, 64], ``kc`` [slots, 512] / ``kr`` [slots, 64] (row views of the cache), page table and lengths
    as in ``lowbit.kernels.mla_decode``; FP8 when ``ks`` is given (``qs`` [B, Sq*H] and ``ks`` [slots] fp32:
    Fused-Q-Quant and the cache's token scales; the reference emulates its P with ``p_block=(64, chunk, 0.0,
    float8_e4m3fn, "row")``). Returns [B, Sq*H, 512] in ``out_dtype`` (default: bf16 for FP8, else the cache dtype),
    and the plan with ``return_plan``. ``ws_regs``: (second warpgroup's registers, kernel maxnreg) and ``stages``
    (FP8 ring depth, ``FP8_STAGES``), for sweeps."""
    if stages not in (None, 2, 3):
        raise ValueError(f"stages must be 2 or 3 (the FP8 ring depth), got {stages!r}")
    B, ROWS, DC = qc.shape
    DR = qr.shape[-1]
    dev = qc.device
    fp8 = ks is not None
    dt_c = gl.float8e4nv if fp8 else (gl.bfloat16 if qc.dtype == torch.bfloat16 else gl.float16)
    dt_r = gl.bfloat16 if fp8 else dt_c
    if out_dtype is None:
        out_dtype = torch.bfloat16 if fp8 else qc.dtype
    splits, chunk = plan_splits(B, ROWS // BM, max_seq_len, BN, dev, num_splits, 1)
    out = torch.empty(B, ROWS, DC, device=dev, dtype=out_dtype)
    ow, lse, o_arg, so, sos, sls = split_workspace(out, splits)
    slots = kc.shape[0]
    descs = [_desc(qc.reshape(B * ROWS, DC), B * ROWS, DC, [BM, DC], dt_c),
             _desc(qr.reshape(B * ROWS, DR), B * ROWS, DR, [BM, DR], dt_r),
             _desc(kc, slots, DC, [BN, DC], dt_c), _desc(kr, slots, DR, [BN, DR], dt_r)]
    if fp8:
        descs += [_desc(ks.view(slots // BN, BN), slots // BN, BN, [1, BN], gl.float32), qs.reshape(B * ROWS)]
    pv_regs, maxnreg = ws_regs or (WS_PV_REGS, WS_MAXNREG)
    kernel = (_mla_ws_fp8_kernel if fp8 else _mla_ws_kernel)[(ROWS // BM, splits, B)](
        *descs, page_table, seq_lens, o_arg, lse if lse is not None else o_arg,
        sm_scale * LOG2E, num_heads, ROWS // num_heads, ROWS, chunk, page_table.stride(0), so, sos, sls,
        DC=DC, DR=DR, PAGE=page_size, SPLIT=splits > 1, PV_REGS=pv_regs, num_warps=4, maxnreg=maxnreg,
        **({"STAGES": stages or FP8_STAGES} if fp8 else {}),
    )
    combine_splits(ow, lse, out, splits)
    if return_plan:
        return out, {"splits": splits, "chunk": chunk, "block_n": BN, "block_m": BM, "kernel": kernel,
                     **({"p_rule": "row"} if fp8 else {})}
    return out
