"""FP8 MLA decode for few rows per sequence, in Gluon (GPU only): 16 heads x 1 query token (DeepSeek-V3
under tensor parallelism 8), or up to 48 (query token, head) rows (16 per program) with MTP or 32 heads; the
DeepSeek latent (512 + 64).

Why a separate kernel (the Triton kernel ``lowbit.kernels.mla_decode`` stays the CPU / interpreter path and
the fallback, ``gluon=False``): with 16 rows the decode is memory-bound (644 bytes and ~35k FLOPs per token),
and the Triton FP8 ``FEW`` tile read 1.2 TB/s where the bf16 one reads 3.6 (R14: 1.12 vs 0.66 ms at B=128
L=16k): the P·V operand needs the latent with the *tokens* as the reduction dimension, ``ldmatrix`` cannot
transpose 8-bit data, and Triton gave either byte-wise shared loads or an upcast it could not pipeline.

Per program (one sequence, one split of its tokens; 4 warps; rows padded to the MMA's M = 16), per 32-token block:

1. cp.async ring (``STAGES`` = 2): the block's FP8 content ``[32, 512]``, bf16 RoPE part ``[32, 64]`` and fp32 token
   scales, laid out warp-major (warp w owns content columns ``[128 w, 128 w + 128)`` and RoPE columns
   ``[16 w, 16 w + 16)``); page-table entries read two blocks ahead. ~55 KB of shared memory and ``maxnreg`` 168:
   three programs per SM.
2. ``S = q̂_C · ĉ^T + q̃_R · k̃_R^T`` (SnapMLA's pre-scaled domain): each warp computes the partial over its
   columns on mma.sync m16n8k16 (fp32 accumulation) -- its content slice upcast FP8 -> fp16 in registers
   (exact), its query slice held as fp16 in registers (upcast once) -- and writes it to shared memory (rows
   padded: no bank conflicts). The products are exact and summed in fp32 (the FP8 wgmma of the wide tile
   accumulates with fewer bits).
3. Warp w sums the four partials of rows ``[4 w, 4 w + 4)`` only and runs their online softmax, the Triton FP8
   path's ``T_STEP`` numerics: ``P̃ = exp2(S - m) s_k``, ``σ = max(rowmax(P̃) / 448, σ_old e^(m_old - m_new))``
   (monotone), ``P̂ = FP8(P̃ / σ)`` (fp16 with ``pv16``), σ folded into the rescale factor; ``P̂`` (a copy per
   warp) and the rescale factors go to every warp through shared memory. So
   ``mla_decode_ref(..., p_block=(32, chunk, 0, float8_e4m3fn, "row"))`` emulates this kernel exactly up to
   fp32 summation order.
4. ``O += P̂ · V`` with the tokens as the reduction dimension, from the same FP8 stage: ``ldmatrix`` cannot
   transpose bytes, but it transposes 16-bit pairs, so the stage is read as int16 (columns 2p, 2p + 1 of one
   token) with ``ldmatrix.trans``: each register then holds the pairs of two consecutive tokens, one ``prmt``
   regroups them into (t0, t1) of column 2p and of column 2p + 1, and two exact ``cvt.rn.f16x2.e4m3x2`` give
   the fp16 B operands of the even and of the odd columns (``_split_pairs``). Each warp accumulates its 128 value
   columns as four 16 x 32 fp32 tiles (even / odd columns of its first and last 64); the epilogue writes them
   back interleaved.

Four barriers per block (three written, one the compiler adds). H200, session 18, B=128 H=16 L=16k: 0.396 ms
(3.41 TB/s on 644 B per token) vs 0.664 for the bf16 path (1.68x); session 17's form (every warp softmaxed all rows;
the content written to shared memory as fp16 and read back for P·V: 64 KB of extra shared traffic per block) 0.547.

Split-KV partials use the Triton kernel's workspace (fp32 ``[splits, rows, Dc]`` + base-2 LSE) and its combine
kernel. Layouts as in ``lowbit.kernels.mla_decode`` (row ``r = t * H + h``; cache rows contiguous, 16-byte aligned).
Measured history and the target gap: ``docs/sections/mla.md`` (sessions 17-18).
"""
from __future__ import annotations

import functools

import torch

try:  # Gluon ships with Triton >= 3.4; the interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2 as _mma_v2

    # Triton 3.6 (the device): async_copy_global_to_shared; later releases renamed it async_load
    _cp_async = getattr(_async_copy, "async_load", None) or _async_copy.async_copy_global_to_shared
    HAS_GLUON = True
except Exception:  # pragma: no cover - older Triton
    HAS_GLUON = False

LOG2E = 1.4426950408889634
# (query tokens x heads) per sequence the dispatch sends here: 16 rows per program (one m16 tile), more rows as several
# programs (row blocks fastest; each reads the whole KV, so the time grows with the row blocks). H200, session 18, ms,
# FP8 Gluon / FP8 Triton / bf16: 32 rows (B=64 L=16k) 0.390 / 0.663 / 0.472 (session 17: 0.555 / 0.667 / 0.476); 48 rows
# (B=32 L=16k) 0.299 / 0.346 / 0.302, (B=128 L=4k) 0.291 / 0.340 / 0.307: up to 48 rows this is the faster FP8 path;
# 64 rows (B=32 L=16k) 0.391 / 0.348 / 0.303, (B=128 L=4k) 0.427 / 0.341 / 0.308: the Triton tile
MAX_ROWS = 48
BLOCK_N = 32  # tokens per loop step
STAGES = 2  # cp.async ring depth (>= 2: P·V reads the stage after the QK^T barrier, so it cannot be refilled earlier)
NUM_WARPS = 4
CTAS_PER_SM = 3  # ~55 KB of shared memory and <= 168 registers per thread: three resident per SM (split plan)
MAXNREG = 168  # 65536 registers / (3 x 128 threads); ptxas spills 8 bytes (no maxnreg: 235 registers, two per SM, the
# same time: 0.397 vs 0.396 ms)


def supported(rows: int, dc: int, dr: int, page_size: int, *cache: torch.Tensor, block_n: int = BLOCK_N) -> bool:
    """Whether the dispatch sends a launch here (else the Triton kernel runs): <= 48 rows per sequence, the
    DeepSeek-V2/V3 latent (Dc = 512: 128 columns per warp; Dr = 64: one 16-column RoPE k-step per warp), pages a
    multiple of the 32-token block, and the ``cache`` row tensors (content, rope, scale) 16-byte aligned for the
    16-byte cp.async copies (row starts and bases)."""
    if not (HAS_GLUON and 1 <= rows <= MAX_ROWS and dc == 512 and dr == 64 and page_size % block_n == 0):
        return False
    return all(t.data_ptr() % 16 == 0 and (t.dim() == 1 or (t.stride(0) * t.element_size()) % 16 == 0)
               for t in cache)

if HAS_GLUON:
    _bar = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _copy_rows(dst, src, stride, slot0, n0, end, W: gl.constexpr, NW: gl.constexpr, BLOCK_N: gl.constexpr,
                   CL: gl.constexpr):
        """cp.async of rows ``slot0 ..`` of ``src`` into the warp-major tile ``dst [NW, BLOCK_N, W]`` (warp w:
        columns ``[w W, (w + 1) W)``); rows at or past ``end`` are zero-filled."""
        w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
        t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
        k = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
        ok = ((n0 + t) < end)[None, :, None] & (k < W)[None, None, :] & (w < NW)[:, None, None]
        _cp_async(dst, src + (slot0 + t)[None, :, None] * stride + (w * W)[:, None, None] + k[None, None, :], mask=ok)

    @gluon.jit
    def _issue(ring_c, ring_r, ring_s, stage, KC, KR, KS, page, n0, end, stride_kc, stride_kr,
               KW: gl.constexpr, RW: gl.constexpr, NW: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
               CLC: gl.constexpr, CLR: gl.constexpr, CLS: gl.constexpr):
        """cp.async of the block at ``n0`` (content, RoPE and scale rows of one page) into ``stage`` of the rings."""
        slot0 = page * PAGE + n0 % PAGE
        _copy_rows(ring_c.index(stage), KC, stride_kc, slot0, n0, end, KW, NW, BLOCK_N, CLC)
        _copy_rows(ring_r.index(stage), KR, stride_kr, slot0, n0, end, RW, NW, BLOCK_N, CLR)
        ts = gl.arange(0, BLOCK_N, layout=CLS)
        _cp_async(ring_s.index(stage), KS + slot0 + ts, mask=(n0 + ts) < end)  # (threads beyond 8 duplicate)
        _async_copy.commit_group()

    @gluon.jit
    def _split_pairs(x):
        """``x``: int16 byte pairs (FP8 columns 2p, 2p + 1) of two consecutive tokens per 32-bit register (a
        ``k_width=2`` B operand, tokens as K) -> the fp16 B operands of the even and of the odd columns: one ``prmt``
        (bytes t0.2p, t1.2p, t0.2p+1, t1.2p+1) and two exact ``cvt.rn.f16x2.e4m3x2`` per register. ``pack=2`` hands
        the asm a thread's consecutive elements, which in the ``k_width=2`` layout are the two tokens of one register
        (Triton leaves the grouping unspecified: the GPU tests against the emulating reference check it)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 a, b; prmt.b32 t, $2, 0, 0x3120; mov.b32 {a, b}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; }",
            "=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _block(it, start, end, last, ptb, ring_c, ring_c16, ring_r, ring_s, red, ps, rs, KC, KR, KS, pg_next, pg_next2,
               q0, q1, q2, q3, qr, qscale, lim, m_i, l_i, sig_i, acc0, acc1, acc2, acc3, stride_kc, stride_kr,
               KW: gl.constexpr, RW: gl.constexpr, KQ: gl.constexpr, NW: gl.constexpr, BM: gl.constexpr,
               PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PV16: gl.constexpr, MASK: gl.constexpr,
               SL: gl.constexpr, SL3: gl.constexpr, CLC: gl.constexpr, CLR: gl.constexpr, CLS: gl.constexpr):
        """One block of tokens (the loop body): wait for its copies, QK^T partials, their sum, the online softmax
        (this warp's rows), P·V; issues the copies STAGES - 1 blocks ahead. ``MASK=False``: the block is whole and seen
        by every row (no token / causal mask on the scores)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
        b8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
        a16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b16: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        zero = gl.zeros([NW, BM, BLOCK_N], gl.float32, layout=mma)
        n0 = start + it * BLOCK_N
        stage = it % STAGES
        _async_copy.wait_group(STAGES - 2)
        _bar()
        # QK^T partial of warp w over its content and RoPE columns (fp8 -> fp16 exact), then the sum
        kst = ring_c.index(stage)
        ks = ring_s.index(stage).load(gl.SliceLayout(0, SL))  # token scales (0 past the end)
        k16 = kst.slice(0, KQ, dim=2).permute([0, 2, 1]).load(b8).to(gl.float16)  # [NW, KQ, BLOCK_N]
        s3 = _mma_v2(q0, k16, zero)
        k16 = kst.slice(KQ, KQ, dim=2).permute([0, 2, 1]).load(b8).to(gl.float16)
        s3 = _mma_v2(q1, k16, s3)
        k16 = kst.slice(2 * KQ, KQ, dim=2).permute([0, 2, 1]).load(b8).to(gl.float16)
        s3 = _mma_v2(q2, k16, s3)
        k16 = kst.slice(3 * KQ, KQ, dim=2).permute([0, 2, 1]).load(b8).to(gl.float16)
        s3 = _mma_v2(q3, k16, s3)
        s3 = _mma_v2(qr, ring_r.index(stage).permute([0, 2, 1]).load(b16), s3)
        # next block's copies into the stage read last iteration (the barrier above retired its reads)
        nf = n0 + (STAGES - 1) * BLOCK_N
        _issue(ring_c, ring_r, ring_s, (it + STAGES - 1) % STAGES, KC, KR, KS, pg_next, nf, end, stride_kc, stride_kr,
               KW, RW, NW, PAGE, BLOCK_N, CLC, CLR, CLS)
        red.store(gl.reshape(s3, [NW * BM, BLOCK_N]))
        _bar()
        pg_next = pg_next2
        pg_next2 = gl.load(ptb + gl.minimum(nf + 2 * BLOCK_N, last) // PAGE).to(gl.int64)
        # warp w sums the partials of its rows [w BM / NW, (w + 1) BM / NW) and runs their online softmax, the
        # Triton FP8 path's T_STEP numerics (per-row P scale, monotone)
        s = red.slice(0, BM, dim=0).load(SL)
        for w in gl.static_range(1, NW):
            s += red.slice(w * BM, BM, dim=0).load(SL)
        t = s * ks[None, :]
        if MASK:
            kpos = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, SL))
            t = gl.where((kpos[None, :] < lim[:, None]) & (kpos < end)[None, :], t, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(t, axis=1) * qscale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_safe))
        sig_keep = sig_i * alpha
        p = gl.exp2(t * qscale[:, None] - m_safe[:, None])
        pt = p * ks[None, :]
        sig_new = gl.maximum(gl.max(pt, axis=1) * (1.0 / 448.0), sig_keep)
        inv_sig = gl.where(sig_new > 0, 1.0 / sig_new, 0.0)
        r = gl.where(sig_new == sig_keep, 1.0, sig_keep * inv_sig)
        pv = pt * inv_sig[:, None]
        l_i = l_i * r + gl.sum(p, axis=1) * inv_sig
        m_i = m_new
        sig_i = sig_new
        if PV16:
            p16 = gl.minimum(pv, 448.0).to(gl.float16)
        else:
            p16 = pv.to(gl.float8e4nv).to(gl.float16)  # cvt.rn.satfinite: P̂ <= 448, exact upcast
        # P̂ (a copy per warp: its A operand) and the rows' rescale factors to every warp through shared memory
        ps.store(gl.expand_dims(p16, 0) + gl.zeros([NW, BM, BLOCK_N], gl.float16, layout=SL3))
        rs.store(r)
        _bar()
        pa = ps.load(a16)
        r3 = gl.expand_dims(gl.expand_dims(rs.load(gl.SliceLayout(1, gl.SliceLayout(0, mma))), 1), 0)
        # (a lazy rescale, skipped in a CTA-uniform branch when no row moved, measured slower: 0.599 vs 0.571 ms)
        acc0 = acc0 * r3
        acc1 = acc1 * r3
        acc2 = acc2 * r3
        acc3 = acc3 * r3
        # V fragments straight from the FP8 stage: byte pairs (columns 2p, 2p + 1) of two tokens through ldmatrix.trans,
        # split into the even and the odd columns' operands (acc0 / acc1: the warp's first 64 columns, acc2 / acc3:
        # its last 64)
        vst = ring_c16.index(stage)  # [NW, BLOCK_N, KW / 2] int16 view of the content
        v_even, v_odd = _split_pairs(vst.slice(0, KW // 4, dim=2).load(b16))
        acc0 = _mma_v2(pa, v_even, acc0)
        acc1 = _mma_v2(pa, v_odd, acc1)
        v_even, v_odd = _split_pairs(vst.slice(KW // 4, KW // 4, dim=2).load(b16))
        acc2 = _mma_v2(pa, v_even, acc2)
        acc3 = _mma_v2(pa, v_odd, acc3)
        return m_i, l_i, sig_i, acc0, acc1, acc2, acc3, pg_next, pg_next2

    @gluon.jit
    def _mla_decode_few_kernel(
        QC, QR, QS, KC, KR, KS, PT, SEQ, O, LSE,
        sm_scale_log2e, H, SQ, ROWS, chunk,
        stride_qc, stride_qr, stride_pt, stride_o, stride_os, stride_ls,
        stride_kc: gl.constexpr, stride_kr: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        SPLIT: gl.constexpr, PV16: gl.constexpr, NW: gl.constexpr, CLC: gl.constexpr, CLR: gl.constexpr,
        CLS: gl.constexpr,
    ):
        BM: gl.constexpr = 16
        KW: gl.constexpr = DC // NW  # content columns per warp (QK reduction slice = P·V output slice)
        RW: gl.constexpr = DR // NW  # RoPE columns per warp
        KQ: gl.constexpr = KW // 4  # the warp's slice in four chunks (registers: operands of one chunk live at a time)
        # warp w is batch index w of 3-d (batched) mma.sync tiles: [NW, 16 rows, ...]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
        a8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        a16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, mma))  # rows of the accumulators (epilogue)
        # the summed scores [16, BLOCK_N] of the softmax: warp w holds rows [w 16 / NW, (w + 1) 16 / NW); SL3 adds the
        # warp-copy axis of the P̂ store (every thread writes its P̂ values into each warp's copy)
        SL3: gl.constexpr = gl.BlockedLayout(size_per_thread=[NW, 1, BLOCK_N * BM // 32 // NW],
                                             threads_per_warp=[1, BM // NW, 32 * NW // BM], warps_per_cta=[1, NW, 1],
                                             order=[2, 1, 0])
        SL: gl.constexpr = gl.SliceLayout(0, SL3)
        srow_l: gl.constexpr = gl.SliceLayout(1, SL)  # softmax state per row: in the row's warp
        sw8: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[2, 1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])

        r0 = gl.program_id(0) * BM  # this program's 16 rows (row blocks fastest: they share the KV through L2)
        pid_s = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        seq_len = gl.load(SEQ + b)
        start = pid_s * chunk
        end = gl.minimum(start + chunk, seq_len)
        last = gl.maximum(end - 1, 0)
        ptb = PT + b * stride_pt

        ring_c = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, NW, BLOCK_N, KW], sw8)
        ring_r = gl.allocate_shared_memory(gl.bfloat16, [STAGES, NW, BLOCK_N, RW], flat)
        ring_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N],
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        # the content stages viewed as int16 byte pairs (same bytes, same 16-byte swizzle): the P·V operand
        ring_c16 = ring_c._reinterpret(gl.int16, [STAGES, NW, BLOCK_N, KW // 2],
                                       gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]))
        # the QK^T partials of the warps, summed through shared memory; rows padded by 8 floats so the
        # accumulator fragments (8 rows x 4 lanes of 8 bytes per instruction) do not collide in banks
        # (gl.sum over the warp axis measured 8-way conflicts on both the stores and the loads)
        red = gl.allocate_shared_memory(gl.float32, [NW * BM, BLOCK_N],
                                        gl.PaddedSharedLayout.with_identity_for([[BLOCK_N, 8]], [NW * BM, BLOCK_N],
                                                                                [1, 0]))
        # P̂ (one copy per warp, read as its A operand) and the rows' rescale factors
        ps = gl.allocate_shared_memory(gl.float16, [NW, BM, BLOCK_N],
                                       gl.SwizzledSharedLayout(vec=8, per_phase=2, max_phase=4, order=[2, 1, 0]))
        rs = gl.allocate_shared_memory(gl.float32, [BM],
                                       gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        nblk = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        for i in gl.static_range(STAGES - 1):  # the first blocks' copies before the query is read
            nb = start + i * BLOCK_N
            pg = gl.load(ptb + gl.minimum(nb, last) // PAGE).to(gl.int64)
            _issue(ring_c, ring_r, ring_s, i, KC, KR, KS, pg, nb, end, stride_kc, stride_kr, KW, RW, NW, PAGE, BLOCK_N,
                   CLC, CLR, CLS)

        # ---- query: warp w holds its content slice (fp16, exact upcast of the FP8 codes) and RoPE slice
        w8 = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, a8)))
        r8 = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, a8)))
        k8 = gl.arange(0, KQ, layout=gl.SliceLayout(0, gl.SliceLayout(1, a8)))
        q_ptr = QC + (b * ROWS + r8)[None, :, None] * stride_qc + (w8 * KW)[:, None, None] + k8[None, None, :]
        q_ok = (r8 < ROWS)[None, :, None]
        q0 = gl.load(q_ptr, mask=q_ok, other=0.0).to(gl.float16)  # four column chunks of the warp's slice
        q1 = gl.load(q_ptr + KQ, mask=q_ok, other=0.0).to(gl.float16)
        q2 = gl.load(q_ptr + 2 * KQ, mask=q_ok, other=0.0).to(gl.float16)
        q3 = gl.load(q_ptr + 3 * KQ, mask=q_ok, other=0.0).to(gl.float16)
        wr = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, a16)))
        rr = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, a16)))
        kr = gl.arange(0, RW, layout=gl.SliceLayout(0, gl.SliceLayout(1, a16)))
        qr = gl.load(QR + (b * ROWS + rr)[None, :, None] * stride_qr + (wr * RW)[:, None, None] + kr[None, None, :],
                     mask=(rr < ROWS)[None, :, None], other=0.0)
        r_idx = r0 + gl.arange(0, BM, layout=srow_l)
        qscale = gl.load(QS + b * ROWS + r_idx, mask=r_idx < ROWS, other=1.0) * sm_scale_log2e  # > 0
        lim = seq_len - SQ + 1 + r_idx // H  # causal among the Sq query tokens: keys [0, lim)

        m_i = gl.full([BM], float("-inf"), gl.float32, layout=srow_l)
        l_i = gl.zeros([BM], gl.float32, layout=srow_l)
        sig_i = gl.zeros([BM], gl.float32, layout=srow_l)
        acc0 = gl.zeros([NW, BM, KQ], gl.float32, layout=mma)  # warp w: output columns w KW + [0, KW) (see P·V)
        acc1 = gl.zeros([NW, BM, KQ], gl.float32, layout=mma)
        acc2 = gl.zeros([NW, BM, KQ], gl.float32, layout=mma)
        acc3 = gl.zeros([NW, BM, KQ], gl.float32, layout=mma)
        # page-table entries of the next two copies (the one issued this iteration and the one after)
        pg_next = gl.load(ptb + gl.minimum(start + (STAGES - 1) * BLOCK_N, last) // PAGE).to(gl.int64)
        pg_next2 = gl.load(ptb + gl.minimum(start + STAGES * BLOCK_N, last) // PAGE).to(gl.int64)
        # whole blocks seen by every row first (no score masks), then the split's ragged / causal tail
        vis = gl.minimum(end, seq_len - SQ + 1)
        nfull = gl.maximum(vis - start, 0) // BLOCK_N
        for it in range(0, nfull):
            m_i, l_i, sig_i, acc0, acc1, acc2, acc3, pg_next, pg_next2 = _block(
                it, start, end, last, ptb, ring_c, ring_c16, ring_r, ring_s, red, ps, rs, KC, KR, KS, pg_next, pg_next2,
                q0, q1, q2, q3, qr, qscale, lim, m_i, l_i, sig_i, acc0, acc1, acc2, acc3, stride_kc, stride_kr,
                KW, RW, KQ, NW, BM, PAGE, BLOCK_N, STAGES, PV16, False, SL, SL3, CLC, CLR, CLS)
        for it in range(nfull, nblk):
            m_i, l_i, sig_i, acc0, acc1, acc2, acc3, pg_next, pg_next2 = _block(
                it, start, end, last, ptb, ring_c, ring_c16, ring_r, ring_s, red, ps, rs, KC, KR, KS, pg_next, pg_next2,
                q0, q1, q2, q3, qr, qscale, lim, m_i, l_i, sig_i, acc0, acc1, acc2, acc3, stride_kc, stride_kr,
                KW, RW, KQ, NW, BM, PAGE, BLOCK_N, STAGES, PV16, True, SL, SL3, CLC, CLR, CLS)
        _async_copy.wait_group(0)

        # ---- epilogue: O / l (and the base-2 LSE of the split)
        wo = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
        ro = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
        ko = gl.arange(0, KQ, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))
        m_i = gl.convert_layout(m_i, row_l)
        l_i = gl.convert_layout(l_i, row_l)
        sig_i = gl.convert_layout(sig_i, row_l)
        r_idx = r0 + gl.arange(0, BM, layout=row_l)
        row_ok = r_idx < ROWS
        inv = gl.expand_dims(gl.expand_dims(gl.where(l_i == 0, 0.0, 1.0 / l_i), 1), 0)
        # acc0 / acc1: the even / odd columns of the warp's first 64, acc2 / acc3: of its last 64
        col = (wo * KW)[:, None, None] + 2 * ko[None, None, :]
        C1: gl.constexpr = 1
        C2: gl.constexpr = KW // 2
        C3: gl.constexpr = KW // 2 + 1
        ok = (ro < ROWS)[None, :, None] & (col < DC)
        if SPLIT:  # the split's base-2 LSE beside its fp32 partial (one split: O is the output, stride_os is 0)
            lse = gl.where(l_i == 0, float("-inf"), m_i + gl.log2(l_i * sig_i))
            gl.store(LSE + pid_s * stride_ls + b * ROWS + r_idx, lse, mask=row_ok)
        o_ptr = O + pid_s * stride_os + (b * ROWS + ro)[None, :, None] * stride_o + col
        gl.store(o_ptr, (acc0 * inv).to(O.dtype.element_ty), mask=ok)
        gl.store(o_ptr + C1, (acc1 * inv).to(O.dtype.element_ty), mask=ok)
        gl.store(o_ptr + C2, (acc2 * inv).to(O.dtype.element_ty), mask=ok)
        gl.store(o_ptr + C3, (acc3 * inv).to(O.dtype.element_ty), mask=ok)

@functools.lru_cache(maxsize=None)
def _scale_layout():
    """The token scales' cp.async source layout (4 per thread; threads past the 32 scales copy duplicates)."""
    return gl.BlockedLayout(size_per_thread=[4], threads_per_warp=[32], warps_per_cta=[NUM_WARPS], order=[0])


@functools.lru_cache(maxsize=None)
def _copy_layout(width: int, vec: int):
    """Blocked layout of a warp-major ``[NUM_WARPS, BLOCK_N, width]`` tile with ``vec`` elements (16 bytes) per thread."""
    tc = min(32, width // vec)
    return gl.BlockedLayout(size_per_thread=[1, 1, vec], threads_per_warp=[1, 32 // tc, tc],
                            warps_per_cta=[NUM_WARPS, 1, 1], order=[2, 1, 0])


def mla_decode_few_gluon(qc, qr, qs, kc, kr, ks, page_table, seq_lens, *, num_heads: int, sm_scale: float,
                         max_seq_len: int, page_size: int, out_dtype=torch.bfloat16, num_splits: int | None = None,
                         block_n: int = BLOCK_N, stages: int = STAGES, pv16: bool = False, ctas_per_sm: int = CTAS_PER_SM,
                         maxnreg: int | None = MAXNREG, return_plan: bool = False):
    """Launch (GPU, FP8 cache, ``supported(...)``). Arguments as ``mla_decode_triton``'s: ``qc`` [B, ROWS, Dc] fp8,
    ``qr`` [B, ROWS, Dr] bf16, ``qs`` [B, ROWS] fp32; cache rows ``kc`` [slots, Dc] fp8, ``kr`` [slots, Dr] bf16,
    ``ks`` [slots] fp32. ``ctas_per_sm`` (the split plan) and ``maxnreg`` go together (3 programs per SM need <= 168
    registers); ``stages`` >= 2."""
    if stages < 2:
        raise ValueError(f"stages must be >= 2 (P·V reads the stage after the QK^T barrier), got {stages}")
    from lowbit.kernels.mla_decode import combine_splits, plan_splits, split_workspace

    B, ROWS, DC = qc.shape
    DR = qr.shape[-1]
    dev = qc.device
    row_blocks = -(-ROWS // 16)
    splits, chunk = plan_splits(B, row_blocks, max_seq_len, block_n, dev, num_splits, ctas_per_sm)
    out = torch.empty(B, ROWS, DC, device=dev, dtype=out_dtype)
    qc2, qr2 = qc.reshape(B * ROWS, DC), qr.reshape(B * ROWS, DR)
    ow, lse, o_arg, so, sos, sls = split_workspace(out, splits)
    kernel = _mla_decode_few_kernel[(row_blocks, splits, B)](
        qc2, qr2, qs.reshape(B * ROWS), kc, kr, ks, page_table, seq_lens, o_arg, lse if lse is not None else o_arg,
        sm_scale * LOG2E, num_heads, ROWS // num_heads, ROWS, chunk,
        qc2.stride(0), qr2.stride(0), page_table.stride(0), so, sos, sls, kc.stride(0), kr.stride(0),
        DC=DC, DR=DR, PAGE=page_size, BLOCK_N=block_n, STAGES=stages, SPLIT=splits > 1, PV16=bool(pv16),
        NW=NUM_WARPS, CLC=_copy_layout(DC // NUM_WARPS, 16), CLR=_copy_layout(DR // NUM_WARPS, 8), CLS=_scale_layout(),
        num_warps=NUM_WARPS, **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    combine_splits(ow, lse, out, splits)
    if return_plan:
        return out, {"splits": splits, "chunk": chunk, "block_n": block_n, "block_m": 16, "num_stages": stages,
                     "num_warps": NUM_WARPS, "ctas_per_sm": ctas_per_sm, "dv_splits": 1, "v_prmt": 0, "s_ahead": False,
                     "tokens_m": False, "deq16": 0, "p_rule": "row", "kernel": kernel, "gluon": True}
    return out
