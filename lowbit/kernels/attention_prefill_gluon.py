"""FP8 prefill attention in Gluon (Hopper): the numerics of ``attention_prefill._attn_fwd`` with
MODE 0 (``fp8``: per-token Q scales, one K and one V scale per 128-key block, P = 256 exp2(S - m)
in FP8 E4M3), with the MMAs overlapped with the softmax inside one warpgroup.

Why (session 4): Triton 3.6 waits on every ``wgmma`` right after issuing it, so within a CTA the
tensor cores idle during the softmax and the CUDA cores idle during the MMAs (per 64x128 block the
two cost about the same SM time at D = 128; the tl kernel's main loop is 563 SASS instructions
per thread per block, ``MUFU.EX2`` alone needs 536 issue cycles of the MUFU pipe). Gluon exposes
``warpgroup_mma(is_async=True)`` and ``warpgroup_mma_wait(num_outstanding)``, which gives the
FlashAttention-3 intra-warpgroup schedule, per KV block j::

    issue  S_{j+1} = Q K_{j+1}^T              (async; K_{j+1} already in shared memory)
    softmax of S_j -> P_j (FP8), alpha_j     (CUDA cores, overlaps S_{j+1} and P_{j-1} V_{j-1})
    wait until P_{j-1} V_{j-1} is done        (num_outstanding = 1: S_{j+1} may still run)
    acc *= alpha_j * c_acc / v_scale_j        (the scaled accumulator of the tl kernel)
    issue  acc += P_j V_j                     (async, accumulated in the wgmma)
    wait until S_{j+1} is done                (num_outstanding = 1: P_j V_j may still run)

K and V go through 2-slot TMA rings (K_{j+3} is requested when S_{j+1} is done, V_{j+1} when
P_{j-1} V_{j-1} is done). Difference from the tl kernel: P_j V_j is accumulated into ``acc`` by
the tensor core (use_acc) instead of a fresh per-block accumulator added by CUDA cores (a fresh
one needs 64 more registers per thread than a warpgroup has). The product is rescaled by CUDA
cores every block, so the tensor core only adds one block's 128 products to the running sum;
measured error vs the float64 reference: see the device checks.

Scope: head_dim 128, BLOCK_M 64, BLOCK_N 128, K/V codes from ``quantize_kv_triton(k_block=128,
v_granularity='block', q=...)`` (Q codes from the same launch), causal (bottom-right) or not,
GQA, any Sq / Skv (masked tail and diagonal blocks). Everything else runs the tl kernel, which
is also the interpreter-tested path (Gluon does not run under TRITON_INTERPRET).
"""
from __future__ import annotations

import torch

try:  # Gluon is experimental: any import problem means "not available", never an error
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the Triton build
    HAS_GLUON = False

BLOCK_M, BLOCK_N, HEAD_DIM = 64, 128, 128


def gluon_fp8_ok(q_codes, kc, ks, vt, vs, k_block, v_block) -> bool:
    """The Gluon kernel applies: Hopper, D = 128, per-block K scales over 128 keys, per-block V
    scales over 128 keys, Q codes given, 16-byte aligned contiguous code buffers."""
    if not HAS_GLUON or q_codes is None or not kc.is_cuda:
        return False
    if torch.cuda.get_device_capability(kc.device)[0] != 9:
        return False
    if kc.shape[-1] != HEAD_DIM or k_block != BLOCK_N or v_block != BLOCK_N or vs is None or vs.ndim != 3:
        return False
    if kc.dtype != torch.float8_e4m3fn or not (kc.is_contiguous() and vt.is_contiguous()):
        return False
    return all(t.data_ptr() % 16 == 0 for t in (kc, vt, q_codes[0]))


if HAS_GLUON:

    @gluon.jit
    def _g_step(j, n_blk, s, acc, p_prev, m_i, l_i, c_acc, qs, m0, krow, vrow, Skv, causal_off,
                q_smem, k_smem, v_smem, kbar, vbar, k_desc, v_desc, KSb, VSb, stride_ksn, stride_vsn,
                BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr,
                mma_l: gl.constexpr, p_l: gl.constexpr):
        """One KV block j (see the module docstring); returns the new loop state."""
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
        nbytes: gl.constexpr = BN * D  # one FP8 tile
        # ---- issue S_{j+1} = Q K_{j+1}^T (its K tile was requested two blocks ago); past the last
        # block the MMA runs on a stale slot and its result is dropped
        nxt = j + 1
        ks_slot = nxt % 2
        mbarrier.wait(kbar.index(ks_slot), (nxt // 2) & 1, pred=nxt < n_blk)
        s_next = warpgroup_mma(q_smem, k_smem.index(ks_slot).permute((1, 0)),
                               gl.zeros([BM, BN], gl.float32, mma_l), use_acc=False, is_async=True)
        # ---- softmax of S_j (log2 units): P = 256 exp2(S qsb - m)
        qsb = qs * gl.load(KSb + j * stride_ksn)
        t = s
        if MASK:
            offs_n = j * BN + gl.arange(0, BN, layout=col_l)
            valid = (offs_n < Skv)[None, :]
            if CAUSAL:
                offs_m = m0 + gl.arange(0, BM, layout=row_l)
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
            t = gl.where(valid, t, float("-inf"))
        mb = gl.max(t, axis=1) * qsb
        m_new = gl.maximum(m_i, mb)
        if MASK:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(t * qsb[:, None] - (m_use - 8.0)[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        # ---- P_{j-1} V_{j-1} done: its V slot is free (request V_{j+1}), rescale acc. P_j goes
        # through the wait: its FP8 operand registers (those of P_{j-1} V_{j-1}, in flight until
        # here) are written only after it (else ptxas serializes every wgmma)
        acc, p = warpgroup_mma_wait(num_outstanding=1, deps=(acc, p))
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_l)
        vn = j + 1
        pv = (j >= 1) & (vn < n_blk)
        mbarrier.expect(vbar.index(vn % 2), nbytes, pred=pv)
        tma.async_copy_global_to_shared(v_desc, [vrow, vn * BN], vbar.index(vn % 2), v_smem.index(vn % 2), pred=pv)
        vsb = gl.load(VSb + j * stride_vsn)
        acc = acc * (alpha * (c_acc / vsb))[:, None]
        # ---- issue acc += P_j V_j
        mbarrier.wait(vbar.index(j % 2), (j // 2) & 1)
        acc = warpgroup_mma(p8, v_smem.index(j % 2).permute((1, 0)), acc, is_async=True)
        # ---- S_{j+1} and P_j V_j done (ptxas serializes every wgmma when a group stays in flight
        # across the loop's back edge), K_{j+1}'s slot is free: request K_{j+3}
        s_next, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
        kn = j + 3
        pk = kn < n_blk
        mbarrier.expect(kbar.index(kn % 2), nbytes, pred=pk)
        tma.async_copy_global_to_shared(k_desc, [krow + kn * BN, 0], kbar.index(kn % 2), k_smem.index(kn % 2), pred=pk)
        return s_next, acc, p8, m_new, l_i, vsb

    @gluon.jit
    def _fp8_attn_gluon_kernel(q_desc, k_desc, v_desc, QS, KS, VS, Out,  #
                               qk_scale, Sq, Skv, causal_off, Hq, n_rep, n_mblk, sq_al,  #
                               stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsn,  #
                               stride_ob, stride_oh, stride_om,  #
                               BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr):
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BM // 16, 1],
                                                        instr_shape=[16, 128, 32])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=4)
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
        nbytes: gl.constexpr = BN * D

        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // Hq
        hq = bh % Hq
        hk = hq // n_rep
        if CAUSAL:  # longest query blocks first
            pid_m = n_mblk - 1 - pid_m
        m0 = pid_m * BM
        bhk = b * (Hq // n_rep) + hk
        krow = bhk * Skv
        vrow = bhk * D
        qrow = bh * sq_al

        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, D, BN], v_desc.layout)
        qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        vbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qbar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(kbar.index(i), count=1)
            mbarrier.init(vbar.index(i), count=1)

        if CAUSAL:
            hi = gl.minimum(Skv, m0 + BM + causal_off)
            n_full = gl.minimum(((m0 + causal_off + 1) // BN) * BN, (Skv // BN) * BN)
        else:
            hi = Skv
            n_full = (Skv // BN) * BN
        hi = gl.maximum(hi, 0)
        n_full = gl.maximum(gl.minimum(n_full, hi), 0)
        n_blk = (hi + BN - 1) // BN

        mbarrier.expect(qbar, BM * D)
        tma.async_copy_global_to_shared(q_desc, [qrow + m0, 0], qbar, q_smem)
        for i in gl.static_range(2):
            mbarrier.expect(kbar.index(i), nbytes, pred=i < n_blk)
            tma.async_copy_global_to_shared(k_desc, [krow + i * BN, 0], kbar.index(i), k_smem.index(i), pred=i < n_blk)
            mbarrier.expect(vbar.index(i), nbytes, pred=i < n_blk)
            tma.async_copy_global_to_shared(v_desc, [vrow, i * BN], vbar.index(i), v_smem.index(i), pred=i < n_blk)

        offs_m = m0 + gl.arange(0, BM, layout=row_l)
        offs_d = gl.arange(0, D, layout=col_l)
        qs = gl.load(QS + qrow + offs_m, mask=offs_m < Sq, other=0.0) * qk_scale
        KSb = KS + b.to(gl.int64) * stride_ksb + hk.to(gl.int64) * stride_ksh
        VSb = VS + b.to(gl.int64) * stride_vsb + hk.to(gl.int64) * stride_vsh

        # ---- S_0, then K_2 into slot 0
        mbarrier.wait(qbar, 0)
        mbarrier.wait(kbar.index(0), 0, pred=n_blk > 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BM, BN], gl.float32, mma_l),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.expect(kbar.index(0), nbytes, pred=2 < n_blk)
        tma.async_copy_global_to_shared(k_desc, [krow + 2 * BN, 0], kbar.index(0), k_smem.index(0), pred=2 < n_blk)

        acc = gl.zeros([BM, D], gl.float32, mma_l)
        p8 = gl.zeros([BM, BN], gl.float8e4nv, p_l)
        m_i = gl.full([BM], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BM], gl.float32, row_l)
        c_acc = qk_scale * 0.0 + 1.0
        for start_n in range(0, n_full, BN):
            s, acc, p8, m_i, l_i, c_acc = _g_step(start_n // BN, n_blk, s, acc, p8, m_i, l_i, c_acc, qs, m0, krow, vrow,
                                                  Skv, causal_off, q_smem, k_smem, v_smem, kbar, vbar, k_desc, v_desc,
                                                  KSb, VSb, stride_ksn, stride_vsn, BM, BN, D, CAUSAL, False, mma_l, p_l)
        for start_n in range(n_full, hi, BN):
            s, acc, p8, m_i, l_i, c_acc = _g_step(start_n // BN, n_blk, s, acc, p8, m_i, l_i, c_acc, qs, m0, krow, vrow,
                                                  Skv, causal_off, q_smem, k_smem, v_smem, kbar, vbar, k_desc, v_desc,
                                                  KSb, VSb, stride_ksn, stride_vsn, BM, BN, D, CAUSAL, True, mma_l, p_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.invalidate(qbar)
        for i in gl.static_range(2):
            mbarrier.invalidate(kbar.index(i))
            mbarrier.invalidate(vbar.index(i))
        out = acc * (c_acc / gl.maximum(l_i, 1e-30))[:, None]
        optr = (Out + b.to(gl.int64) * stride_ob + hq.to(gl.int64) * stride_oh
                + offs_m[:, None].to(gl.int64) * stride_om + offs_d[None, :])
        gl.store(optr, out.to(Out.dtype.element_ty), mask=(offs_m < Sq)[:, None])


def fp8_attention_gluon(q_codes, kc, ks, vt, vs, *, causal: bool, qk_scale: float, out: torch.Tensor,
                        block_m: int = BLOCK_M) -> torch.Tensor:
    """Launch on the codes of ``quantize_kv_triton(k, v, k_block=128, v_granularity='block', q=q)``:
    ``q_codes = (qc [B, Hq, Sq, D], qs [B, Hq, Sq])`` (rows padded to a multiple of 4 per head),
    ``kc [B, Hkv, Skv, D]``, ``ks [B, Hkv, nblk]``, ``vt [B, Hkv, D, S_al]``, ``vs [B, Hkv, nblk]``;
    ``qk_scale`` = sm_scale * log2(e). Writes O into ``out`` ([B, Hq, Sq, D], 16-bit).
    ``block_m`` 64 (one warpgroup per program) or 128 (two warpgroups of 64 rows sharing the K/V
    tiles: half the shared-memory fills per score)."""
    if block_m not in (64, 128):
        raise ValueError(f"block_m must be 64 or 128, got {block_m}")
    qc, qs = q_codes
    B, Hq, Sq, D = qc.shape
    Hkv, Skv = kc.shape[1], kc.shape[2]
    sq_al = qs.stride(1)
    f8 = gl.float8e4nv
    lay_q = gl.NVMMASharedLayout.get_default_for([block_m, D], f8)
    lay_k = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], f8)
    lay_v = gl.NVMMASharedLayout.get_default_for([D, BLOCK_N], f8)
    q_desc = GluonTensorDescriptor(qc, [B * Hq * sq_al, D], [D, 1], [block_m, D], lay_q)
    k_desc = GluonTensorDescriptor(kc, [B * Hkv * Skv, D], [D, 1], [BLOCK_N, D], lay_k)
    s_al = vt.shape[-1]
    v_desc = GluonTensorDescriptor(vt, [B * Hkv * D, s_al], [s_al, 1], [D, BLOCK_N], lay_v)
    n_mblk = -(-Sq // block_m)
    _fp8_attn_gluon_kernel[(n_mblk, B * Hq)](
        q_desc, k_desc, v_desc, qs, ks, vs, out,
        qk_scale, Sq, Skv, Skv - Sq, Hq, Hq // Hkv, n_mblk, sq_al,
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BM=block_m, BN=BLOCK_N, D=D, CAUSAL=bool(causal), num_warps=block_m // 16)
    return out
