"""Session-20 probe (issue 8): a warp-specialized form of the Gluon FP8 prefill attention, beside the committed
kernels in the same run. Not part of the library: the kernel lives here until a device run shows it faster.

    PYTHONPATH=$PWD python3 benchmarks/device/s20_attn_ws.py --out DIR

Per CTA: 128 query rows of one (batch, query head) = two 64-row blocks, one per consumer warpgroup, sharing a 3-stage
TMA ring of (K block, V^T block) pairs filled by a 1-warp loader partition (``gl.warp_specialize``); each consumer runs
the FlashAttention-3 order of ``lowbit.kernels.attention_prefill_gluon`` (S_{j+1} issued before P_j V_j, the softmax
of S_{j+1} overlapping P_j V_j) with the same numerics (``_g_softmax`` / ``_g_pa``: P = 256 exp2(S - m) in FP8, V^T
in the VPERM key order), and releases each stage after its P·V. Compared, attention launch alone on the same
pre-quantized codes (B=4, H=32, D=128, S = 4k / 16k, causal and not): the committed Gluon kernel (one warpgroup per
CTA), the tl kernel (the library default) and SDPA cuDNN bf16 (TFLOP/s), plus the output's rel-L2 against the
committed Gluon kernel (same math: expected ~0) and against the tl kernel.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, time_cuda, write_probe  # noqa: E402
from lowbit.kernels import attention_prefill_gluon as AG  # noqa: E402
from lowbit.kernels.attention_prefill import LOG2E, attention_prefill_triton  # noqa: E402
from lowbit.kernels.attention_quant import quantize_kv_triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait  # noqa: E402

NS = 3


@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, qbar, kv_ready, kv_free, m0, qrow, krow, vrow, n_blk,
               NS: gl.constexpr):
    BN: gl.constexpr = 128
    for c in gl.static_range(2):
        mbarrier.expect(qbar.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [qrow + m0 + 64 * c, 0], qbar.index(c), q_smem.index(c))
    for j in range(0, n_blk):
        st = j % NS
        mbarrier.wait(kv_free.index(st), ((j // NS) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [krow + j * BN, 0], kv_ready.index(st), k_smem.index(st))
        tma.async_copy_global_to_shared(v_desc, [vrow, j * BN], kv_ready.index(st), v_smem.index(st))


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, qbar, kv_ready, kv_free, turn, QS, KSb, VSb, Out, qk_scale, Sq, Skv, causal_off,
                 m0, qrow, b, hq, n_blk, stride_ksn, stride_vsn, stride_ob, stride_oh, stride_om, C: gl.constexpr,
                 CAUSAL: gl.constexpr, NS: gl.constexpr, PP: gl.constexpr):
    BM: gl.constexpr = 64
    BN: gl.constexpr = 128
    D: gl.constexpr = 128
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=4)
    row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
    col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
    mc = m0 + BM * C
    if CAUSAL:
        n_full = gl.minimum(((mc + causal_off + 1) // BN) * BN, (Skv // BN) * BN)
    else:
        n_full = (Skv // BN) * BN
    nf_blk = gl.maximum(n_full, 0) // BN
    offs_m = mc + gl.arange(0, BM, layout=row_l)
    offs_d = gl.arange(0, D, layout=col_l)
    qs = gl.load(QS + qrow + offs_m, mask=offs_m < Sq, other=0.0) * qk_scale
    q = q_smem.index(C)
    mbarrier.wait(qbar.index(C), 0)
    m_i = gl.full([BM], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([BM], gl.float32, row_l)
    acc = gl.zeros([BM, D], gl.float32, mma_l)
    c_acc = gl.load(VSb)
    p = gl.zeros([BM, BN], gl.float32, mma_l)
    if n_blk > 0:
        mbarrier.wait(kv_ready.index(0), 0)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([BM, BN], gl.float32, mma_l), use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_i = AG._g_softmax(s, 0, m_i, l_i, qs, mc, Skv, causal_off, KSb, stride_ksn, BM, BN, CAUSAL,
                                           True, mma_l)
        for j in range(0, n_blk - 1):
            nxt = j + 1
            sn = nxt % NS
            mbarrier.wait(kv_ready.index(sn), (nxt // NS) & 1)
            if PP:  # ping-pong (session 30): P converted outside the turn; the turn covers the two GEMM issues only
                p8 = AG._g_pa(p, BM, BN, True, p_l)
                mbarrier.wait(turn.index(C), (j & 1) ^ (1 - C))
                s = warpgroup_mma(q, k_smem.index(sn).permute((1, 0)), s, use_acc=False, is_async=True)
                acc = warpgroup_mma(p8, v_smem.index(j % NS).permute((1, 0)), acc, is_async=True)
                mbarrier.arrive(turn.index(1 - C))
            else:
                s = warpgroup_mma(q, k_smem.index(sn).permute((1, 0)), s, use_acc=False, is_async=True)
                p8 = AG._g_pa(p, BM, BN, True, p_l)
                acc = warpgroup_mma(p8, v_smem.index(j % NS).permute((1, 0)), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            if nxt < nf_blk:
                p, alpha, m_i, l_i = AG._g_softmax(s, nxt, m_i, l_i, qs, mc, Skv, causal_off, KSb, stride_ksn, BM, BN,
                                                   CAUSAL, False, mma_l)
            else:
                p, alpha, m_i, l_i = AG._g_softmax(s, nxt, m_i, l_i, qs, mc, Skv, causal_off, KSb, stride_ksn, BM, BN,
                                                   CAUSAL, True, mma_l)
            vsb = gl.load(VSb + nxt * stride_vsn)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(kv_free.index(j % NS))
            acc = acc * (alpha * (c_acc / vsb))[:, None]
            c_acc = vsb
        jl = n_blk - 1
        p8 = AG._g_pa(p, BM, BN, True, p_l)
        acc = warpgroup_mma(p8, v_smem.index(jl % NS).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_free.index(jl % NS))
    out = acc * (c_acc / gl.maximum(l_i, 1e-30))[:, None]
    optr = (Out + b.to(gl.int64) * stride_ob + hq.to(gl.int64) * stride_oh
            + offs_m[:, None].to(gl.int64) * stride_om + offs_d[None, :])
    gl.store(optr, out.to(Out.dtype.element_ty), mask=(offs_m < Sq)[:, None])


@gluon.jit
def _ws_attn_kernel(q_desc, k_desc, v_desc, QS, KS, VS, Out, qk_scale, Sq, Skv, causal_off, Hq, n_rep, n_mblk, sq_al,
                    stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsn,
                    stride_ob, stride_oh, stride_om, CAUSAL: gl.constexpr, NS: gl.constexpr, C1_REGS: gl.constexpr,
                    PP: gl.constexpr = False):
    BN: gl.constexpr = 128
    D: gl.constexpr = 128
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    hk = hq // n_rep
    if CAUSAL:  # longest query blocks first
        pid_m = n_mblk - 1 - pid_m
    m0 = pid_m * 128
    bhk = b * (Hq // n_rep) + hk
    krow = bhk * Skv
    vrow = bhk * D
    qrow = bh * sq_al
    if CAUSAL:
        hi = gl.minimum(Skv, m0 + 128 + causal_off)
    else:
        hi = Skv
    n_blk = (gl.maximum(hi, 0) + BN - 1) // BN
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS, D, BN], v_desc.layout)
    qbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(qbar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NS):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)
    KSb = KS + b.to(gl.int64) * stride_ksb + hk.to(gl.int64) * stride_ksh
    VSb = VS + b.to(gl.int64) * stride_vsb + hk.to(gl.int64) * stride_vsh
    gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, v_smem, qbar, kv_ready, kv_free, turn, QS, KSb, VSb, Out, qk_scale, Sq, Skv,
                        causal_off, m0, qrow, b, hq, n_blk, stride_ksn, stride_vsn, stride_ob, stride_oh, stride_om, 0,
                        CAUSAL, NS, PP)),
        (_ws_consumer, (q_smem, k_smem, v_smem, qbar, kv_ready, kv_free, turn, QS, KSb, VSb, Out, qk_scale, Sq, Skv,
                        causal_off, m0, qrow, b, hq, n_blk, stride_ksn, stride_vsn, stride_ob, stride_oh, stride_om, 1,
                        CAUSAL, NS, PP)),
        (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, qbar, kv_ready, kv_free, m0, qrow, krow, vrow,
                      n_blk, NS)),
    ], [4, 1], [C1_REGS, 24])


def ws_attention(q_codes, kc, ks, vt, vs, *, causal, qk_scale, out, c1_regs=232, maxnreg=168, pp=False, ns=None):
    qc, qs = q_codes
    B, Hq, Sq, D = qc.shape
    Hkv, Skv = kc.shape[1], kc.shape[2]
    sq_al = qs.stride(1)
    f8 = gl.float8e4nv
    q_desc = AG.GluonTensorDescriptor(qc, [B * Hq * sq_al, D], [D, 1], [64, D],
                                      gl.NVMMASharedLayout.get_default_for([64, D], f8))
    k_desc = AG.GluonTensorDescriptor(kc, [B * Hkv * Skv, D], [D, 1], [128, D],
                                      gl.NVMMASharedLayout.get_default_for([128, D], f8))
    s_al = vt.shape[-1]
    v_desc = AG.GluonTensorDescriptor(vt, [B * Hkv * D, s_al], [s_al, 1], [D, 128],
                                      gl.NVMMASharedLayout.get_default_for([D, 128], f8))
    n_mblk = -(-Sq // 128)
    _ws_attn_kernel[(n_mblk, B * Hq)](
        q_desc, k_desc, v_desc, qs, ks, vs, out, qk_scale, Sq, Skv, Skv - Sq, Hq, Hq // Hkv, n_mblk, sq_al,
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        out.stride(0), out.stride(1), out.stride(2), CAUSAL=bool(causal), NS=ns or NS, C1_REGS=c1_regs, PP=bool(pp),
        num_warps=4, maxnreg=maxnreg)
    return out


def time_with_cudnn(row, fns, q, k, v, causal, flops, S):
    """Time each of ``fns`` and SDPA cuDNN bf16 on the same q / k / v (median ms and TFLOP/s into ``row``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for name, fn in {**fns, "sdpa_cudnn": cudnn}.items():
        t = time_cuda(fn, [()], warmup=3, reps=20 if S > 8192 else 50)
        row[f"{name}_ms"] = t["median_ms"]
        row[f"{name}_tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    args = probe_args("t")
    doc = {"env": env_info(" ".join(sys.argv))}
    B, H, D = 4, 32, 128
    for S in (4096, 16384, 1000):
        for causal in (False, True):
            key = f"t S={S} causal={causal}"
            try:
                torch.manual_seed(0)
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                kc, ks, vt, vs, qc, qs = quantize_kv_triton(k, v, dtype=torch.float8_e4m3fn, k_block=128,
                                                            v_granularity="block", q=q, vperm=True)
                sm = D ** -0.5
                codes = (qc, qs)
                out_ws = torch.empty_like(q)
                out_g = torch.empty_like(q)
                ws_attention(codes, kc, ks, vt, vs, causal=causal, qk_scale=sm * LOG2E, out=out_ws)
                AG.fp8_attention_gluon(codes, kc, ks, vt, vs, causal=causal, qk_scale=sm * LOG2E, out=out_g, vperm=True)
                tl_out = attention_prefill_triton(q, kc, ks, vt, vs, mode="fp8", causal=causal, sm_scale=sm, k_block=128,
                                                  q_codes=codes, config={"vperm": True})
                row = {"S": S, "causal": causal, "ws_vs_gluon": rel(out_ws, out_g), "ws_vs_tl": rel(out_ws, tl_out),
                       "finite": bool(torch.isfinite(out_ws).all())}
                fl = 4.0 * B * H * S * S * D / (2 if causal else 1)
                fns = {
                    "ws": lambda: ws_attention(codes, kc, ks, vt, vs, causal=causal, qk_scale=sm * LOG2E, out=out_ws),
                    "gluon": lambda: AG.fp8_attention_gluon(codes, kc, ks, vt, vs, causal=causal, qk_scale=sm * LOG2E,
                                                            out=out_g, vperm=True),
                    "tl": lambda: attention_prefill_triton(q, kc, ks, vt, vs, mode="fp8", causal=causal, sm_scale=sm,
                                                           k_block=128, q_codes=codes, config={"vperm": True}),
                }
                time_with_cudnn(row, fns, q, k, v, causal, fl, S)
                probe_row(doc, key, row)
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                probe_row(doc, key, {"error": repr(exc)[:800]})
    write_probe(doc, args.out, "s20_attn_ws.json")


if __name__ == "__main__":
    main()
