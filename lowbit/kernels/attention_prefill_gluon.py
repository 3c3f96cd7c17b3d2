"""FP8 prefill attention in Gluon (Hopper; option ``config={"gluon": True}``, off by default): the
numerics of ``attention_prefill._attn_fwd`` with MODE 0 (``fp8``: per-token Q scales, one K and one
V scale per 128-key block, P = 256 exp2(S - m) in FP8 E4M3), with the MMAs overlapped with the
softmax inside one warpgroup.

Why: Triton 3.6 waits on every ``wgmma`` right after issuing it, so within a CTA the tensor cores
idle during the softmax and the CUDA cores idle during the MMAs. Gluon exposes
``warpgroup_mma(is_async=True)`` and ``warpgroup_mma_wait(num_outstanding)``, which gives the
FlashAttention-3 intra-warpgroup order, per KV block j (P_j ready in fp32)::

    issue  S_{j+1} = Q K_{j+1}^T              (async; K_{j+1} already in shared memory)
    P_j -> FP8 A operand                     (CUDA cores, overlaps S_{j+1})
    issue  acc += P_j V_j                     (async, accumulated in the wgmma)
    wait until S_{j+1} is done                (num_outstanding = 1: P_j V_j may still run)
    softmax of S_{j+1} -> P_{j+1}, alpha      (CUDA cores, overlaps P_j V_j)
    wait until P_j V_j is done; request K_{j+3} and V_{j+2} (2-slot TMA rings)
    acc *= alpha * c_acc / v_scale_{j+1}      (the scaled accumulator of the tl kernel)

S stays one register tile (no S / S_next copies) and P crosses the loop's back edge in fp32 (an
FP8 operand tile carried there is unpacked to one byte per register and repacked: +200 SASS
instructions per block, session 5). ``VPERM``: V^T in the ``vperm_pos`` key order, so P's
accumulator registers are the A operand as they are (no shuffles; ``assert_trivial``).

History (H200, attention launch alone, B=4, H=32, S=4096, D=128): session 4's kernel (softmax of
block j overlapped with S_{j+1}, P_j V_j waited at once) 737 TFLOP/s vs 842 for the tl kernel
(R11); this order with VPERM 835 vs 889 for the tl kernel with VPERM (R12): two CTAs per SM at
~250 registers lose to three tl CTAs at 168. Kept as an option (GPU test
``test_gluon_fp8_matches_tl_kernel``); tensor-core row sums (P times a ones tile) were tried
(868 TFLOP/s in R12) and removed: their output was wrong (the ones tile needed a CTA barrier).

Difference from the tl kernel: P_j V_j is accumulated into ``acc`` by the tensor core (use_acc)
instead of a fresh per-block accumulator added by CUDA cores (a fresh one needs 64 more registers
per thread than a warpgroup has). acc is rescaled by CUDA cores every block, so the tensor core only
adds one block's 128 products to the running sum; measured vs the tl kernel: rel-L2 1.6e-3 (1k),
2.7e-3 (4k), 5.4e-3 (16k) (R11/R12 A/B), against ~5e-2 for both vs float64.

Scope: head_dim 128, BLOCK_M 64, BLOCK_N 128, K/V codes from ``quantize_kv_triton(k_block=128,
v_granularity='block', q=...)`` (Q codes from the same launch), causal (bottom-right) or not,
GQA, any Sq / Skv (masked tail and diagonal blocks; query blocks that see no key write 0).
Everything else runs the tl kernel, which is also the interpreter-tested path (Gluon does not run
under TRITON_INTERPRET).
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
    if kc.shape[2] == 0 or kc.dtype != torch.float8_e4m3fn or not (kc.is_contiguous() and vt.is_contiguous()):
        return False
    return all(t.data_ptr() % 16 == 0 for t in (kc, vt, q_codes[0]))


def vperm_pos(t: torch.Tensor) -> torch.Tensor:
    """Storage position of key ``t`` in a ``VPERM`` V^T row: within each 32-key chunk the key bits
    h|j1|q|j0 (t = 16h + 8j1 + 2q + j0; q = the lane in a quad of the wgmma accumulator, j0 the
    column pair, j1 / h the 8-column group) go to h|q|j1|j0: the key order of the FP8 A operand."""
    return (t & ~31) | (t & 16) | (((t >> 1) & 3) << 2) | (((t >> 3) & 1) << 1) | (t & 1)


def permute_vt(vt: torch.Tensor) -> torch.Tensor:
    """V^T codes ``[..., S_al]`` -> the ``VPERM`` layout ``[..., S_al32]`` (S rounded up to 32, zero
    padding; a torch gather for tests and device A/Bs; the quantization kernels write it directly)."""
    s = vt.shape[-1]
    s32 = -(-s // 32) * 32
    src = vt if s32 == s else torch.nn.functional.pad(vt.view(torch.uint8), (0, s32 - s)).view(vt.dtype)
    t = torch.arange(s32, device=vt.device)
    out = torch.empty_like(src)
    out.view(torch.uint8)[..., vperm_pos(t)] = src.view(torch.uint8)
    return out


if HAS_GLUON:

    @gluon.jit
    def _g_pa(p, BM: gl.constexpr, BN: gl.constexpr, VPERM: gl.constexpr, p_l: gl.constexpr):
        """P (fp32, wgmma accumulator layout) -> FP8 A operand of P V. ``VPERM``: V^T stores the keys
        of each 32-key chunk at ``vperm_pos``, so a thread's accumulator registers already hold the
        A operand's keys and the conversion moves no data between threads."""
        x = p.to(gl.float8e4nv)
        if VPERM:
            x = gl.reshape(x, [BM, BN // 32, 2, 2, 4, 2])
            x = gl.permute(x, (0, 1, 2, 4, 3, 5))
            x = gl.reshape(x, [BM, BN])
            return gl.convert_layout(x, p_l, assert_trivial=True)
        return gl.convert_layout(x, p_l)

    @gluon.jit
    def _g_softmax(s, j, m_i, l_i, qs, m0, Skv, causal_off, KSb, stride_ksn,
                   BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr,
                   mma_l: gl.constexpr):
        """Softmax of block j's scores (log2 units): P = 256 exp2(S qsb - m); returns (P fp32,
        alpha, m, l)."""
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
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
        return p, alpha, m_new, l_i

    @gluon.jit
    def _g_step(j, n_blk, s, acc, p, m_i, l_i, c_acc, qs, m0, krow, vrow, Skv, causal_off,
                q_smem, k_smem, v_smem, kbar, vbar, k_desc, v_desc, KSb, VSb, stride_ksn, stride_vsn,
                BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr,
                VPERM: gl.constexpr, mma_l: gl.constexpr, p_l: gl.constexpr):
        """KV block j in the order of the module docstring (``p`` = P_j in fp32, acc in block j's
        V units); returns the loop state for block j + 1."""
        nbytes: gl.constexpr = BN * D
        nxt = j + 1
        mbarrier.wait(kbar.index(nxt % 2), (nxt // 2) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(nxt % 2).permute((1, 0)), s, use_acc=False, is_async=True)
        p8 = _g_pa(p, BM, BN, VPERM, p_l)
        mbarrier.wait(vbar.index(j % 2), (j // 2) & 1)
        acc = warpgroup_mma(p8, v_smem.index(j % 2).permute((1, 0)), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_{j+1} (the older group) done
        p, alpha, m_i, l_i = _g_softmax(s, nxt, m_i, l_i, qs, m0, Skv, causal_off, KSb, stride_ksn,
                                        BM, BN, CAUSAL, MASK, mma_l)
        vsb = gl.load(VSb + nxt * stride_vsn)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # P_j V_j done
        # K_{j+1}'s slot (free since S_{j+1}) gets K_{j+3}, V_j's gets V_{j+2}: both requests here, where
        # the CTA barriers Gluon puts around each mbarrier.expect fall together
        kn = j + 3
        mbarrier.expect(kbar.index(kn % 2), nbytes, pred=kn < n_blk)
        tma.async_copy_global_to_shared(k_desc, [krow + kn * BN, 0], kbar.index(kn % 2), k_smem.index(kn % 2),
                                        pred=kn < n_blk)
        vn = j + 2
        mbarrier.expect(vbar.index(vn % 2), nbytes, pred=vn < n_blk)
        tma.async_copy_global_to_shared(v_desc, [vrow, vn * BN], vbar.index(vn % 2), v_smem.index(vn % 2),
                                        pred=vn < n_blk)
        acc = acc * (alpha * (c_acc / vsb))[:, None]
        return s, acc, p, m_i, l_i, vsb

    @gluon.jit
    def _fp8_attn_gluon_kernel(q_desc, k_desc, v_desc, QS, KS, VS, Out,  #
                               qk_scale, Sq, Skv, causal_off, Hq, n_rep, n_mblk, sq_al,  #
                               stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsn,  #
                               stride_ob, stride_oh, stride_om,  #
                               BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                               VPERM: gl.constexpr):
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
        nf_blk = n_full // BN

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

        # ---- prologue: S_0, K_2 into slot 0, softmax_0 (masked form: correct for any block)
        mbarrier.wait(qbar, 0)
        mbarrier.wait(kbar.index(0), 0, pred=n_blk > 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BM, BN], gl.float32, mma_l),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.expect(kbar.index(0), nbytes, pred=2 < n_blk)
        tma.async_copy_global_to_shared(k_desc, [krow + 2 * BN, 0], kbar.index(0), k_smem.index(0), pred=2 < n_blk)
        m_i = gl.full([BM], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BM], gl.float32, row_l)
        p, alpha, m_i, l_i = _g_softmax(s, 0, m_i, l_i, qs, m0, Skv, causal_off, KSb, stride_ksn,
                                        BM, BN, CAUSAL, True, mma_l)
        acc = gl.zeros([BM, D], gl.float32, mma_l)
        c_acc = gl.load(VSb)
        # ---- steady state: the softmax of block j+1 unmasked while j + 1 < nf_blk, then masked
        for j in range(0, nf_blk - 1):
            s, acc, p, m_i, l_i, c_acc = _g_step(
                j, n_blk, s, acc, p, m_i, l_i, c_acc, qs, m0, krow, vrow, Skv, causal_off,
                q_smem, k_smem, v_smem, kbar, vbar, k_desc, v_desc, KSb, VSb, stride_ksn, stride_vsn,
                BM, BN, D, CAUSAL, False, VPERM, mma_l, p_l)
        for j in range(gl.maximum(nf_blk - 1, 0), n_blk - 1):
            s, acc, p, m_i, l_i, c_acc = _g_step(
                j, n_blk, s, acc, p, m_i, l_i, c_acc, qs, m0, krow, vrow, Skv, causal_off,
                q_smem, k_smem, v_smem, kbar, vbar, k_desc, v_desc, KSb, VSb, stride_ksn, stride_vsn,
                BM, BN, D, CAUSAL, True, VPERM, mma_l, p_l)
        # ---- epilogue: acc += P_last V_last (a query block that sees no key keeps acc = 0: its V
        # slots were never filled)
        if n_blk > 0:
            jl = n_blk - 1
            p8 = _g_pa(p, BM, BN, VPERM, p_l)
            mbarrier.wait(vbar.index(jl % 2), (jl // 2) & 1)
            acc = warpgroup_mma(p8, v_smem.index(jl % 2).permute((1, 0)), acc, is_async=True)
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
                        vperm: bool = False) -> torch.Tensor:
    """Launch on the codes of ``quantize_kv_triton(k, v, k_block=128, v_granularity='block', q=q)``:
    ``q_codes = (qc [B, Hq, Sq, D], qs [B, Hq, Sq])`` (rows padded to a multiple of 4 per head),
    ``kc [B, Hkv, Skv, D]``, ``ks [B, Hkv, nblk]``, ``vt [B, Hkv, D, S_al]``, ``vs [B, Hkv, nblk]``;
    ``qk_scale`` = sm_scale * log2(e). Writes O into ``out`` ([B, Hq, Sq, D], 16-bit). ``vperm``:
    ``vt`` is stored in the ``vperm_pos`` key order (``quantize_kv_triton(vperm=True)`` or
    ``permute_vt``; S_al a multiple of 32)."""
    if vperm and vt.shape[-1] % 32:
        raise ValueError("vperm needs V^T rows padded to a multiple of 32 keys (quantize_kv_triton(vperm=True))")
    qc, qs = q_codes
    B, Hq, Sq, D = qc.shape
    Hkv, Skv = kc.shape[1], kc.shape[2]
    sq_al = qs.stride(1)
    f8 = gl.float8e4nv
    lay_q = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], f8)
    lay_k = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], f8)
    lay_v = gl.NVMMASharedLayout.get_default_for([D, BLOCK_N], f8)
    q_desc = GluonTensorDescriptor(qc, [B * Hq * sq_al, D], [D, 1], [BLOCK_M, D], lay_q)
    k_desc = GluonTensorDescriptor(kc, [B * Hkv * Skv, D], [D, 1], [BLOCK_N, D], lay_k)
    s_al = vt.shape[-1]
    v_desc = GluonTensorDescriptor(vt, [B * Hkv * D, s_al], [s_al, 1], [D, BLOCK_N], lay_v)
    n_mblk = -(-Sq // BLOCK_M)
    _fp8_attn_gluon_kernel[(n_mblk, B * Hq)](
        q_desc, k_desc, v_desc, qs, ks, vs, out,
        qk_scale, Sq, Skv, Skv - Sq, Hq, Hq // Hkv, n_mblk, sq_al,
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BM=BLOCK_M, BN=BLOCK_N, D=D, CAUSAL=bool(causal), VPERM=bool(vperm), num_warps=BLOCK_M // 16)
    return out
