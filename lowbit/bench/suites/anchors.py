"""Peers only, the rows of ../shared/ANCHORS.md: proves the harness before it judges lowbit.

Linear layers (Llama-3-8B shapes), prefill attention (B=4, H=32, D=128), decode attention
(B=16, GQA 32/8, D=128) and the bf16 MLA bmm path (DeepSeek-V3 shapes).
"""
from __future__ import annotations

import torch

from lowbit.bench import peers
from lowbit.bench.harness import attention_flops, gemm_flops, rotating_inputs, time_cuda

BASELINE = "cublas-bf16"

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _reps(est_ms: float) -> int:
    return 50 if est_ms > 5 else 100


def linear_rows(rec, quick: bool):
    dev = "cuda"
    ms_list = [1, 16, 128, 1024, 8192] if not quick else [1, 16, 1024]
    for layer, (N, K) in LLAMA3_8B.items():
        ws = rotating_inputs(lambda: (torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5,))
        for M in ms_list:
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in ws]
            case = {"layer": layer, "M": M, "N": N, "K": K}
            fl = gemm_flops(M, N, K)
            byts = 2 * (M * K + N * K + M * N)
            fns = [peers.cublas_bf16(w) for (w,) in ws]
            t = time_cuda(lambda i, x: fns[i](x), [(i, x) for i, x in enumerate(xs)])
            rec.record(case, "cublas-bf16", t, flops=fl, bytes_moved=byts, peak="bf16")
            t = time_cuda(lambda i, x: fns[i](x), [(i, x) for i, x in enumerate(xs)], mode="sync")
            rec.record(case, "cublas-bf16 [sync]", t, flops=fl, bytes_moved=byts, peak="bf16")
            mm = [peers.scaled_mm_rowwise(w, quantize_x=False) for (w,) in ws]
            xq = [peers.fp8_rowwise_act(x) for x in xs]
            t = time_cuda(lambda i, xq, xs_: mm[i](xq, xs_), [(i, *q) for i, q in enumerate(xq)])
            rec.record(case, "scaled_mm-fp8-rowwise", t, flops=fl, bytes_moved=M * K + N * K + 2 * M * N, peak="fp8")
            try:
                tg = [peers.tinygemm_int4(w) for (w,) in ws]
                t = time_cuda(lambda i, x: tg[i](x), [(i, x) for i, x in enumerate(xs)], reps=_reps(M / 128))
                rec.record(case, "tinygemm-int4", t, flops=fl, bytes_moved=2 * M * K + N * K // 2 + 2 * M * N, peak="bf16")
            except peers.PeerUnavailable as exc:
                rec.record(case, "tinygemm-int4", None, note=str(exc))
            try:
                bn = [peers.bnb_nf4(w) for (w,) in ws]
                xh = [x.half() for x in xs]
                t = time_cuda(lambda i, x: bn[i](x), [(i, x) for i, x in enumerate(xh)])
                rec.record(case, "bnb-nf4", t, flops=fl, bytes_moved=2 * M * K + N * K // 2 + 2 * M * N, peak="bf16")
            except peers.PeerUnavailable as exc:
                rec.record(case, "bnb-nf4", None, note=str(exc))
            del fns, mm, xq
        del ws
        torch.cuda.empty_cache()


def prefill_rows(rec, quick: bool):
    B, H, D = 4, 32, 128
    for S in ([1024, 4096, 16384] if not quick else [1024, 4096]):
        sets = rotating_inputs(lambda: tuple(torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)))
        for causal in (False, True):
            case = {"S": S, "causal": causal}
            fl = attention_flops(B, H, S, S, D, causal)
            for name in ("flash", "cudnn", "efficient"):
                try:
                    fn = peers.sdpa(name)
                    fn(*sets[0], causal=causal)
                    t = time_cuda(lambda q, k, v: fn(q, k, v, causal=causal), sets)
                    rec.record(case, f"sdpa-{name}", t, flops=fl, peak="bf16")
                    if name in ("flash", "cudnn"):
                        t = time_cuda(lambda q, k, v: fn(q, k, v, causal=causal), sets, mode="sync")
                        rec.record(case, f"sdpa-{name} [sync]", t, flops=fl, peak="bf16")
                except Exception as exc:
                    rec.record(case, f"sdpa-{name}", None, note=f"{type(exc).__name__}: {exc}"[:200])
            try:
                sg = peers.sageattention()
                hs = [tuple(x.half() for x in s) for s in sets]
                t = time_cuda(lambda q, k, v: sg(q, k, v, causal=causal), hs)
                rec.record(case, "sageattention-1.0.6", t, flops=fl, peak="bf16")
                del hs
            except Exception as exc:
                rec.record(case, "sageattention-1.0.6", None, note=f"{type(exc).__name__}: {exc}"[:200])
        del sets
        torch.cuda.empty_cache()


def decode_rows(rec, quick: bool):
    B, Hq, Hkv, D = 16, 32, 8, 128
    for L in ([4096, 32768] if not quick else [4096]):
        def make():
            return (torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16),
                    torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16),
                    torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16))
        sets = rotating_inputs(make)
        byts = 2 * B * Hkv * L * D * 2 + 2 * 2 * B * Hq * D
        fn = peers.sdpa("flash")
        for name in ("sdpa-default", "sdpa-flash"):
            try:
                if name == "sdpa-default":
                    f = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                else:
                    f = fn
                f(*sets[0])
                for mode, suffix in (("gpu", ""), ("sync", " [sync]")):
                    t = time_cuda(f, sets, mode=mode)
                    rec.record({"B": B, "L": L, "decode": True}, name + suffix, t, bytes_moved=byts,
                               flops=attention_flops(B, Hq, 1, L, D, False), peak="bf16")
            except Exception as exc:
                rec.record({"B": B, "L": L, "decode": True}, name, None, note=str(exc)[:200])
        del sets
        torch.cuda.empty_cache()


def mla_bmm_rows(rec, quick: bool):
    """bf16 absorbed-MLA decode as plain bmm-softmax-bmm (DeepSeek-V3: 128 heads, 512 + 64)."""
    B, H, Dc, Dr = 32, 128, 512, 64
    for L in ([4096, 16384] if not quick else [4096]):
        def make():
            return (torch.randn(B, H, Dc + Dr, device="cuda", dtype=torch.bfloat16),
                    torch.randn(B, L, Dc + Dr, device="cuda", dtype=torch.bfloat16))

        def mla(q, kv):
            s = torch.bmm(q, kv.transpose(1, 2)) * (Dc + Dr) ** -0.5
            p = torch.softmax(s.float(), dim=-1).to(torch.bfloat16)
            return torch.bmm(p, kv[:, :, :Dc])
        sets = rotating_inputs(make)
        t = time_cuda(mla, sets)
        fl = 2.0 * B * H * L * (Dc + Dr) + 2.0 * B * H * L * Dc
        rec.record({"B": B, "L": L, "mla": True}, "bmm-bf16", t, flops=fl, bytes_moved=B * L * (Dc + Dr) * 2, peak="bf16")
        del sets


# ANCHORS.md (H200, 2026-11-22; median of 20 event-timed calls, no queue padding) for the check.
ANCHOR_MS = {
    ("qkv", 1): 0.0341, ("qkv", 16): 0.0297, ("qkv", 128): 0.0328, ("qkv", 1024): 0.0847, ("qkv", 8192): 0.5459,
    ("o", 1): 0.0281, ("o", 16): 0.0345, ("o", 128): 0.0340, ("o", 1024): 0.0595, ("o", 8192): 0.3682,
    ("gate_up", 1): 0.0718, ("gate_up", 16): 0.0729, ("gate_up", 128): 0.0951, ("gate_up", 1024): 0.3286,
    ("gate_up", 8192): 2.4932, ("down", 1): 0.0472, ("down", 16): 0.0471, ("down", 128): 0.0598,
    ("down", 1024): 0.1776, ("down", 8192): 1.3068,
}
ANCHOR_TFLOPS = {  # SDPA (S, causal): (flash, cudnn)
    (1024, False): (270, 455), (1024, True): (166, 243), (4096, False): (349, 650),
    (4096, True): (314, 550), (16384, False): (348, 610), (16384, True): (340, 570),
}


def anchor_check(rec) -> None:
    """Note how each re-measured bf16 GEMM / SDPA row compares with ANCHORS.md (gpu and sync timing modes)."""
    by = {(tuple(sorted(r["case"].items())), r["provider"]): r for r in rec.rows if "median_ms" in r}
    lines = []
    for (layer, M), ref in ANCHOR_MS.items():
        N, K = LLAMA3_8B[layer]
        key = tuple(sorted({"layer": layer, "M": M, "N": N, "K": K}.items()))
        g, w = by.get((key, "cublas-bf16")), by.get((key, "cublas-bf16 [sync]"))
        if g and w:
            lines.append(f"bf16 {layer} M={M}: anchor {ref:.4f} ms, gpu {g['median_ms']:.4f} ({g['median_ms'] / ref - 1:+.0%}), "
                         f"sync {w['median_ms']:.4f} ({w['median_ms'] / ref - 1:+.0%})")
    for (S, causal), (fa, cd) in ANCHOR_TFLOPS.items():
        key = tuple(sorted({"S": S, "causal": causal}.items()))
        for prov, ref in (("sdpa-flash", fa), ("sdpa-cudnn", cd)):
            g, w = by.get((key, prov)), by.get((key, prov + " [sync]"))
            if g and w:
                lines.append(f"{prov} S={S} causal={causal}: anchor {ref} TF/s, gpu {g['TFLOPs']:.0f} ({g['TFLOPs'] / ref - 1:+.0%}), "
                             f"sync {w['TFLOPs']:.0f} ({w['TFLOPs'] / ref - 1:+.0%})")
    for ln in lines:
        rec.note(ln)


def run(rec, quick: bool = False):
    for part in (linear_rows, prefill_rows, decode_rows, mla_bmm_rows):
        try:
            part(rec, quick)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            rec.note(f"{part.__name__} aborted: {type(exc).__name__}: {exc}"[:300])
    anchor_check(rec)
