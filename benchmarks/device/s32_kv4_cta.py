"""Session-32 probe (issue 8; written in session 31 without a device): the INT4-cache decode as CTAs of ``W`` warps,
one key split per warp, the warps' partials combined in shared memory at the end.

**Measured in session 32 (H200, ``benchmarks/results/h200/s32_kv4_cta.json``): correct, and slower at every shape.**
All 20 checks passed (rel-L2 3.6-7.8e-4 against ``decode_kv4_ref``). Time in us, same process, B / L:

| variant | 16 / 8k | 16 / 32k | 4 / 8k | 1 / 32k |
|---|---|---|---|---|
| committed one-warp kernel (+ combine) | 49.9 | 161.6 | 20.3 | 20.2 |
| W = 16 | 80.2 | 234.6 | 44.6 | 44.8 |
| W = 8 | 68.5 | 206.8 | 32.8 | 32.9 |
| W = 4 | 59.9 | 186.0 | 27.4 | 27.3 |
| W = 16, 3 stages | 83.8 | 236.8 | 46.1 | 46.3 |
| SDPA flash, bf16 | 133.5 | 489.2 | 48.9 | 50.3 |

The fewer warps a CTA holds, the less it loses, so the lockstep of the ring's CTA-wide barriers costs more than the
combine launch and the tail of program ends that it removes. The probe stays as the record; nothing of it moved into
the library.

Why: the committed Gluon kernel runs one-warp programs, 16 per SM, one per split. At B=16 L=8k the main kernel alone
takes 46.8 us and its split combine, a second launch, 2.9 us more (``s31_kv4_op16.json``). A CTA whose warps are the
16 splits of one (b, h) writes O itself: no combine launch, no partials in memory. 128 such CTAs fill 128 of the
132 SMs. It also tests a second hypothesis: the program ends spread 6.6-11 us inside each SM
(``s30_kv4_stamp.json``). Here the warps move in lockstep and end together. The offline build shows why: the
compiler's shared-memory hazard analysis puts two CTA-wide ``bar.sync`` in every loop step (the cp.async ring), even
though each warp reads only its own slice. ``CTA_SYNC`` adds one more barrier; without it, the code asks only for a
warp-level sync. If lockstep costs more than the tail it removes, the next step is a ring that the compiler does
not fence (per-warp mbarriers, or register prefetch).

Offline build (``--offline``, W = 16, one (b, h) per CTA): 128 registers, 20 spill bytes, 139 KB shared memory (1
CTA per SM), 593 SASS per 32-key block and warp. The committed one-warp kernel has 576, and the ring loads and the
operand conversions stay in registers as there. W = 8: 599 SASS, 16 spill bytes, 70 KB. W = 4 (four CTAs
per SM, each fencing only its own warps; 4 partials per (b, h) for the combine kernel): 16 spill bytes, 35 KB.
Three stages (W = 16): 205 KB, 60 spill bytes, 610 SASS with 11 local loads per block.

Scope of the prototype: signed codes (``kv4``, no zero points), no CRS, Q as two INT8 planes (the default
numerics), D = 128, G * TQ <= 8, pages a multiple of 32 keys. Every key block is masked (per warp: its split's end
and the causal diagonal), so warps whose split ends early, or holds no keys, run the same loop. ``CTAS`` > 1 (small
batches): each CTA writes a partial of its W splits for ``decode_kv4``'s combine kernel.

Layouts: every tensor has the warp (= split) as its leading dimension. A rank-3 ``mma_v2`` with ``warps_per_cta =
[W, 1, 1]`` is one m16n8 MMA chain per warp (``benchmarks/offline_gluon_batched_mma.py``). The token-axis
reductions of the softmax stay inside each warp; only the final combine (axis 0) crosses warps, through shared
memory.

    PYTHONPATH=$PWD python3 benchmarks/device/s32_kv4_cta.py --out DIR [--parts ct]    (GPU)
    PYTHONPATH=/tmp/t36 python3 benchmarks/device/s32_kv4_cta.py --offline             (sm_90a build, no GPU)

Parts: ``c`` against ``decode_kv4_ref`` (float64, same numerics) on ragged batches, GQA / MQA, 1-4 query tokens;
``t`` time at B = 16 / 4 / 1 beside the committed kernel and SDPA flash (rotating inputs, CUDA events). Writes
``s32_kv4_cta.json``.
"""
import argparse
import json
import os
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
from triton.experimental.gluon.language.nvidia.ampere import mma_v2 as _mma_v2

sys.path.insert(0, os.getcwd())
from lowbit.kernels import decode_kv4 as dk  # noqa: E402

W_DEFAULT = 16
BLOCK_N = 32
STAGES = 2


@gluon.jit
def _warp_sync():
    """``bar.warp.sync``: the warp's own cp.async data visible to all its lanes (each warp reads only its slice)."""
    gl.inline_asm_elementwise("bar.warp.sync -1; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue(smem_k, smem_v, stage, KC, VC, pg, n0, end, h, stride_cp, stride_ch: gl.constexpr, stride_cn: gl.constexpr,
           PAGE: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, W: gl.constexpr, CL: gl.constexpr):
    """cp.async of each warp's key block starting at ``n0 [W]`` (page ``pg [W]``) into ``stage``; zero-filled
    where the block starts at or after the warp's ``end``."""
    base = pg * stride_cp + h * stride_ch + (n0 % PAGE) * stride_cn
    t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
    j = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
    off = base[:, None, None] + t[None, :, None] * stride_cn + j[None, None, :]
    ok = gl.full([W, BLOCK_N, HALF], 1, gl.int1, layout=CL) & (n0 < end)[:, None, None]
    _async_copy.async_copy_global_to_shared(smem_k.index(stage), KC + off, mask=ok)
    _async_copy.async_copy_global_to_shared(smem_v.index(stage), VC + off, mask=ok)
    _async_copy.commit_group()


@gluon.jit
def _page(ptb, n0, end, PAGE: gl.constexpr):
    """Page of the block at ``n0`` (clamped inside the warp's split; 0 for a split without keys)."""
    return gl.load(ptb + gl.maximum(gl.minimum(n0, end - 1), 0) // PAGE).to(gl.int64)


@gluon.jit
def _scales(KS, VS, pg, n0, end, h, stride_sp, stride_sh: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
            tok_l: gl.constexpr):
    """K / V scales ``[W, BLOCK_N]`` of each warp's block at ``n0``, 0 past the warp's ``end``."""
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, tok_l))
    s_off = (pg * stride_sp + h * stride_sh + (n0 % PAGE))[:, None] + n[None, :]
    ok = (n0[:, None] + n[None, :]) < end[:, None]
    ks = gl.load(KS + s_off, mask=ok, other=0.0)
    vs = gl.load(VS + s_off, mask=ok, other=0.0)
    return ks, vs


@gluon.jit
def _cta_kernel(
    Q, KC, KS, VC, VS, PT, LENS, O, OP, MP, LP,
    qk_scale, SPLIT_LEN, Hkv,
    stride_qb, stride_qh, stride_qt, stride_cp, stride_sp, stride_ptb, stride_ob, stride_oh, stride_ot,
    W: gl.constexpr, G: gl.constexpr, TQ: gl.constexpr, BLOCK_Q: gl.constexpr, HALF: gl.constexpr,
    PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LV: gl.constexpr, CL: gl.constexpr,
    PARTIAL: gl.constexpr, CTA_SYNC: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    a8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    b8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    a16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    b16: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    tok_l: gl.constexpr = gl.SliceLayout(2, MMA)  # [W, BLOCK_N]: the token rows of S^T
    q_l: gl.constexpr = gl.SliceLayout(1, MMA)  # [W, BLOCK_Q]: per warp and query row
    stride_ch: gl.constexpr = PAGE * HALF
    stride_cn: gl.constexpr = HALF
    stride_sh: gl.constexpr = PAGE
    pid_bh = gl.program_id(0)
    cid = gl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    L = gl.load(LENS + b)
    ptb = PT + b * stride_ptb
    # each warp's split [start, end), in the copy layout (c) and in the token layout (t)
    w_c = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
    start_c = (cid * W + w_c) * SPLIT_LEN
    end_c = gl.minimum(start_c + SPLIT_LEN, L)
    w_t = gl.arange(0, W, layout=gl.SliceLayout(1, tok_l))
    start_t = (cid * W + w_t) * SPLIT_LEN
    end_t = gl.minimum(start_t + SPLIT_LEN, L)
    sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    smem_k = gl.allocate_shared_memory(gl.uint8, [STAGES, W, BLOCK_N, HALF], sl)
    smem_v = gl.allocate_shared_memory(gl.uint8, [STAGES, W, BLOCK_N, HALF], sl)
    for i in gl.static_range(STAGES - 1):
        n0 = start_c + i * BLOCK_N
        _issue(smem_k, smem_v, i, KC, VC, _page(ptb, n0, end_c, PAGE), n0, end_c, h, stride_cp, stride_ch, stride_cn,
               PAGE, BLOCK_N, HALF, W, CL)
    pgs = _page(ptb, start_c + (STAGES - 1) * BLOCK_N, end_c, PAGE)
    ks, vs = _scales(KS, VS, _page(ptb, start_t, end_t, PAGE), start_t, end_t, h, stride_sp, stride_sh, PAGE, BLOCK_N,
                     tok_l)
    # ---- Q: every warp prepares the same two INT8 planes (B operand [W, HALF, BLOCK_Q])
    ql: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 1, 32], warps_per_cta=[W, 1, 1],
                                        order=[2, 1, 0])
    mq = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, gl.SliceLayout(2, ql)))
    dq = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, gl.SliceLayout(1, ql)))
    wq = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, ql)))
    q_off = b * stride_qb + (h * G + mq // TQ)[None, :, None] * stride_qh + (mq % TQ)[None, :, None] * stride_qt
    q_ok = (mq < G * TQ)[None, :, None] & (wq >= 0)[:, None, None]
    q = gl.load(Q + q_off + dq[None, None, :] + 0 * wq[:, None, None], mask=q_ok, other=0.0).to(gl.float32)
    qmax = gl.maximum(gl.max(gl.abs(q), axis=2), 1e-30)
    u = q / qmax[:, :, None] * 127.0
    hi = gl.floor(u + 0.5)
    lo = gl.floor((u - hi) * 254.0 + 0.5)
    row_scale = gl.convert_layout(qmax * (qk_scale / (127.0 * 16.0 * 254.0)), q_l)
    qe, qo = gl.split(gl.reshape(hi.to(gl.int8), [W, BLOCK_Q, HALF, 2]))
    qe_lo, qo_lo = gl.split(gl.reshape(lo.to(gl.int8), [W, BLOCK_Q, HALF, 2]))
    qe = gl.convert_layout(gl.permute(qe, [0, 2, 1]), b8)
    qo = gl.convert_layout(gl.permute(qo, [0, 2, 1]), b8)
    qe_lo = gl.convert_layout(gl.permute(qe_lo, [0, 2, 1]), b8)
    qo_lo = gl.convert_layout(gl.permute(qo_lo, [0, 2, 1]), b8)
    r_q = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, q_l))
    qpos = L - TQ + r_q % TQ
    n_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, tok_l))
    m_i = gl.full([W, BLOCK_Q], float("-inf"), gl.float32, layout=q_l)
    l_acc = gl.zeros([W, BLOCK_N, BLOCK_Q], gl.float32, layout=MMA)
    acc_e = gl.zeros([W, HALF, BLOCK_Q], gl.float32, layout=MMA)
    acc_o = gl.zeros([W, HALF, BLOCK_Q], gl.float32, layout=MMA)
    it = 0
    for r in range(0, SPLIT_LEN, BLOCK_N):
        stage = it % STAGES
        _async_copy.wait_group(STAGES - 2)
        if CTA_SYNC:
            gl.thread_barrier()
        else:
            _warp_sync()
        kc = smem_k.index(stage).load(a8)
        vc = smem_v.index(stage).reshape([W, BLOCK_N, 8, HALF // 8]).permute([0, 2, 3, 1]).load(LV)
        nf = start_c + r + (STAGES - 1) * BLOCK_N
        _issue(smem_k, smem_v, (it + STAGES - 1) % STAGES, KC, VC, pgs, nf, end_c, h, stride_cp, stride_ch, stride_cn,
               PAGE, BLOCK_N, HALF, W, CL)
        pgs = _page(ptb, nf + BLOCK_N, end_c, PAGE)
        n1 = start_t + r + BLOCK_N
        ks2, vs2 = _scales(KS, VS, _page(ptb, n1, end_t, PAGE), n1, end_t, h, stride_sp, stride_sh, PAGE, BLOCK_N,
                           tok_l)
        # S^T [W, BLOCK_N, BLOCK_Q] on the INT8 tensor cores (the committed kernel's two-plane chain)
        k_lo, k_hi = dk._g_convert_i8(kc, False)
        x = gl.zeros([W, BLOCK_N, BLOCK_Q], gl.int32, layout=MMA)
        x = _mma_v2(k_lo, qe, x)
        x = _mma_v2(k_hi, qo, x)
        x = _mma_v2(k_lo, qe_lo, x * 254)
        x = _mma_v2(k_hi, qo_lo, x)
        kpos = start_t[:, None] + r + n_t[None, :]
        ok = ((kpos < end_t[:, None])[:, :, None]) & (kpos[:, :, None] <= qpos[None, None, :])
        xf = gl.where(ok, x.to(gl.float32) * ks.to(gl.float32)[:, :, None], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(xf, axis=1) * row_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(xf * row_scale[:, None, :] - m_safe[:, None, :])
        alpha = gl.exp2(m_i - m_safe)
        acc_e = acc_e * alpha[:, None, :]
        acc_o = acc_o * alpha[:, None, :]
        l_acc = l_acc * alpha[:, None, :] + p
        pb = gl.convert_layout((p * vs.to(gl.float32)[:, :, None]).to(gl.float16), b16)
        vca = gl.convert_layout(gl.reshape(gl.permute(vc, [0, 2, 1, 3]), [W, HALF, BLOCK_N]), a16)
        v_lo, v_hi = gl.inline_asm_elementwise(dk.ASM_BOTH_S, "=r,=r,=r,=r,r", [vca], dtype=(gl.float16, gl.float16),
                                               is_pure=True, pack=4)
        acc_e = _mma_v2(v_lo, pb, acc_e)
        acc_o = _mma_v2(v_hi, pb, acc_o)
        m_i = m_new
        ks, vs = ks2, vs2
        it += 1
    _async_copy.wait_group(0)
    # ---- the W splits combined (axis 0 crosses warps: shared memory, by the compiler)
    l_i = gl.sum(l_acc, axis=1)
    m_tot = gl.max(m_i, axis=0)
    m_s = gl.where(m_tot == float("-inf"), 0.0, m_tot)
    wgt = gl.exp2(m_i - m_s[None, :])
    l_tot = gl.sum(wgt * l_i, axis=0)
    o_e = gl.sum(acc_e * wgt[:, None, :], axis=0)
    o_o = gl.sum(acc_o * wgt[:, None, :], axis=0)
    o_l: gl.constexpr = gl.SliceLayout(0, MMA)  # [HALF, BLOCK_Q]
    mm = gl.arange(0, HALF, layout=gl.SliceLayout(1, o_l))
    ch = 2 * ((HALF // 8) * (mm % 8) + mm // 8)  # channel row m <-> code byte (HALF / 8) (m % 8) + m // 8
    rows = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, o_l))
    row_ok = rows < G * TQ
    if PARTIAL:  # m, l and the unnormalized O of this CTA's W splits, for the combine kernel
        base = (pid_bh * gl.num_programs(1) + cid) * BLOCK_Q
        r_m = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, q_l))
        gl.store(MP + base + r_m, gl.convert_layout(m_tot, gl.SliceLayout(0, q_l)), mask=r_m < G * TQ)
        gl.store(LP + base + r_m, gl.convert_layout(l_tot, gl.SliceLayout(0, q_l)), mask=r_m < G * TQ)
        ptr = OP + ((base + rows) * (2 * HALF))[None, :] + ch[:, None]
    else:
        inv = gl.convert_layout(gl.where(l_tot > 0, 1.0 / l_tot, 0.0), gl.SliceLayout(0, o_l))
        o_e = o_e * inv[None, :]
        o_o = o_o * inv[None, :]
        ptr = O + b * stride_ob + ((h * G + rows // TQ) * stride_oh + (rows % TQ) * stride_ot)[None, :] + ch[:, None]
    gl.store(ptr, o_e.to(ptr.dtype.element_ty), mask=row_ok[None, :])
    gl.store(ptr + 1, o_o.to(ptr.dtype.element_ty), mask=row_ok[None, :])


def _copy_layout_w(half: int, warps: int):
    """``decode_kv4._copy_layout`` with a leading dimension of ``warps`` warps: ``[warps, BLOCK_N, half]``."""
    return gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[1, 32 // (half // 16), half // 16],
                            warps_per_cta=[warps, 1, 1], order=[2, 1, 0])


def _v_layout_w(block_n: int, half: int, warps: int):
    """``decode_kv4._v_load_layout`` per warp, with a leading dimension of ``warps`` warps:
    ``[warps, 8, half // 8, block_n]``."""
    reg, lane = dk._v_load_bases(block_n, half)
    return gl.DistributedLinearLayout(reg_bases=[[0] + r for r in reg], lane_bases=[[0] + r for r in lane],
                                      warp_bases=[[1 << i, 0, 0, 0] for i in range(warps.bit_length() - 1)],
                                      block_bases=[], shape=[warps, 8, half // 8, block_n])


def decode_cta(q, c, *, max_len, W=W_DEFAULT, ctas=None, cta_sync=False, stages=STAGES, n_sm=132,
               return_kernel=False):
    """Launcher (the cache dict of ``lowbit.bench.suites.kv4.random_cache``, signed codes)."""
    import torch

    B, Hq, TQ, D = q.shape
    P, Hkv, PAGE, HALF = c["k_codes"].shape
    G = Hq // Hkv
    assert D == 128 and G * TQ <= 8 and PAGE % BLOCK_N == 0 and "k_zero" not in c
    if ctas is None:  # about 16 warps per SM
        ctas = max(1, min(round(n_sm * (16 // W) / (B * Hkv)), triton.cdiv(max_len, W * BLOCK_N)))
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), W * ctas), BLOCK_N) * BLOCK_N
    out = torch.empty_like(q)
    op, mp, lp = dk.split_workspace(out, B * Hkv, ctas, 8, D)
    k = _cta_kernel[(B * Hkv, ctas)](
        q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"], out, op, mp, lp,
        D ** -0.5 * dk.LOG2E, split_len, Hkv,
        q.stride(0), q.stride(1), q.stride(2), c["k_codes"].stride(0), c["k_scale"].stride(0),
        c["page_table"].stride(0), out.stride(0), out.stride(1), out.stride(2),
        W=W, G=G, TQ=TQ, BLOCK_Q=8, HALF=HALF, PAGE=PAGE, BLOCK_N=BLOCK_N, STAGES=stages,
        LV=_v_layout_w(BLOCK_N, HALF, W), CL=_copy_layout_w(HALF, W), PARTIAL=ctas > 1, CTA_SYNC=cta_sync,
        num_warps=W, maxnreg=128,
    )
    if ctas > 1:
        dk._combine(op, mp, lp, out, B, Hkv, ctas, G, TQ, 8, D)
    return (out, k) if return_kernel else out


def offline():
    """sm_90a build without a GPU: registers, spills, shared memory, loop SASS."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _offline import kv4_gluon_types, report, signature

    for W, partial, sync, st in ((16, False, False, 2), (16, True, False, 2), (8, False, False, 2),
                                 (4, True, False, 2), (16, False, False, 3)):
        consts = dict(W=W, G=4, TQ=1, BLOCK_Q=8, HALF=64, PAGE=64, BLOCK_N=BLOCK_N, STAGES=st,
                      LV=_v_layout_w(BLOCK_N, 64, W), CL=_copy_layout_w(64, W), PARTIAL=partial, CTA_SYNC=sync)
        sig, consts, attrs = signature(_cta_kernel, kv4_gluon_types(False), consts)
        k = triton.compile(GluonASTSource(fn=_cta_kernel, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": W, "maxnreg": 128})
        report(k, dict(mma_s8="s8.s8", mma_f16="f16.f16", cp_async="cp.async.", bar_sync="bar.sync",
                       st_shared="st.shared", ld_shared="ld.shared", st_global="st.global"),
               f"W {W}, partial {partial}, cta_sync {sync}, stages {st}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--parts", default="ct")
    ap.add_argument("--offline", action="store_true")
    a = ap.parse_args()
    if a.offline:
        offline()
        return
    import torch
    import torch.nn.functional as F

    from lowbit.bench.harness import env_info, rotating_inputs, time_cuda
    from lowbit.bench.suites.kv4 import kv4_bytes, random_cache
    from lowbit.ops.kv4 import decode_kv4_ref

    os.makedirs(a.out, exist_ok=True)
    doc = {"env": env_info("PYTHONPATH=$PWD python3 benchmarks/device/s32_kv4_cta.py " + " ".join(sys.argv[1:])),
           "rows": {}}

    def row(key, r):
        doc["rows"][key] = r
        print(key, json.dumps(r), flush=True)
        json.dump(doc, open(os.path.join(a.out, "s32_kv4_cta.json"), "w"), indent=1)

    def rel(x, y):
        x, y = x.double(), y.double()
        return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()

    # W = 4: four CTAs per SM, each fencing only its own 4 warps, and 4 partials per (b, h) for the combine kernel
    variants = {"cta16": dict(W=16), "cta8": dict(W=8), "cta4": dict(W=4), "cta16s3": dict(W=16, stages=3)}
    if "c" in a.parts:
        cases = [(3, 32, 8, 1, [1000, 3001, 77]), (2, 32, 8, 2, [4099, 257]), (4, 8, 1, 1, [300, 129, 2048, 33]),
                 (16, 32, 8, 1, [8192] * 16), (2, 32, 8, 1, [5, 0])]
        for name, kw in variants.items():
            for B, Hq, Hkv, TQ, lens in cases:
                key = f"c {name} B={B} Hq={Hq} Hkv={Hkv} TQ={TQ} L={max(lens)}"
                try:
                    c = random_cache(B, Hkv, 128, max(max(lens), 1))
                    c["lengths"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
                    q = torch.randn(B, Hq, TQ, 128, device="cuda", dtype=torch.bfloat16)
                    ref = decode_kv4_ref(q, q_int8=2, **c)
                    o = decode_cta(q, c, max_len=max(lens), **kw)
                    torch.cuda.synchronize()
                    e = rel(o[torch.tensor(lens) > 0], ref[torch.tensor(lens) > 0]) if max(lens) else 0.0
                    row(key, {"err": e, "pass": e < 5e-3})
                except Exception as exc:  # noqa: BLE001
                    row(key, {"error": repr(exc)[:600], "pass": False})
    if "t" in a.parts:
        Hq, Hkv = 32, 8
        for B, L in ((16, 8192), (16, 32768), (4, 8192), (1, 32768)):
            sets = rotating_inputs(lambda: (torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.bfloat16),
                                            random_cache(B, Hkv, 128, L)))
            nb = kv4_bytes(B, Hq, Hkv, 128, L, 1, False)
            fns = {"committed": lambda q, c: dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"],
                                                                  c["v_scale"], c["page_table"], c["lengths"],
                                                                  max_len=L, qk_int8=2, gluon=True)}
            for name, kw in variants.items():
                if all(r.get("pass") for k, r in doc["rows"].items() if k.startswith(f"c {name} ")):
                    fns[name] = lambda q, c, kw=kw: decode_cta(q, c, max_len=L, **kw)
            for name, fn in list(fns.items()) + list(fns.items())[:1]:  # the committed kernel again (drift)
                try:
                    fn(*sets[0])
                    t = time_cuda(fn, sets, reps=100)
                    row(f"t {name} B={B} L={L}" + (" again" if f"t {name} B={B} L={L}" in doc["rows"] else ""),
                        {"ms": t["median_ms"], "TBps": nb / (t["median_ms"] * 1e-3) / 1e12})
                except Exception as exc:  # noqa: BLE001
                    row(f"t {name} B={B} L={L}", {"error": repr(exc)[:400]})
            qs = [(torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.bfloat16),
                   torch.randn(B, Hkv, L, 128, device="cuda", dtype=torch.bfloat16),
                   torch.randn(B, Hkv, L, 128, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def sdpa(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            row(f"t sdpa-flash B={B} L={L}", {"ms": time_cuda(sdpa, qs, reps=100)["median_ms"]})


if __name__ == "__main__":
    main()
