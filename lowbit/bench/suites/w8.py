"""W8 (INT8 weight-only, per-channel scale; ``lowbit.ops.w8``) against cuBLAS bf16 and torch's int8 weight-only
matmul (``torch._weight_int8pack_mm``, gpt-fast's int8 path) where this torch build runs it on CUDA.

Rows: the Llama-3-8B lm_head (128256 x 4096, the scheme's purpose: ``lm_head="w8"``) and the decoder projections
(qkv, o, gate_up, down), M in {1, 4, 16, 64} (decode) and 1024 (prefill; the lm_head runs on one token per request
in the runner, so its large-M row is for completeness). ``lowbit-w8`` takes bf16 x: its two-plane pre-pass is
counted. Bytes: the int8 codes + fp32 scales + x and y in bf16 (the roofline of a weight-only GEMV is the code read).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.bench.harness import gemm_flops, rotating_inputs, time_cuda
from lowbit.formats.w8 import quantize_w8

BASELINE = "cublas-bf16"
SHAPES = {"lm_head": (128256, 4096), "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
MS = [1, 4, 16, 64, 1024]


def run(rec, quick: bool = False) -> None:
    from lowbit.ops.w8 import w8_linear

    dev = "cuda"
    ms = [1, 16] if quick else MS
    for layer, (N, K) in SHAPES.items():
        wb = rotating_inputs(lambda: (torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5,))
        wq = [quantize_w8(w) for (w,) in wb]
        peer_ok = True
        for M in ms:
            case = {"layer": layer, "M": M, "N": N, "K": K}
            fl = gemm_flops(M, N, K)
            reps = 30 if M >= 1024 else 100
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(len(wb))]
            t = time_cuda(lambda w, x: F.linear(x, w), [(w, xs[i]) for i, (w,) in enumerate(wb)], reps=reps)
            rec.record(case, "cublas-bf16", t, flops=fl, bytes_moved=2 * (M * K + N * K + M * N), peak="bf16")
            wbytes = N * K + 4 * N + 2 * (M * K + M * N)
            try:
                t = time_cuda(lambda x, c, s: w8_linear(x, c, s), [(xs[i], *q) for i, q in enumerate(wq)], reps=reps)
                rec.record(case, "lowbit-w8", t, flops=fl, bytes_moved=wbytes, peak="int8")
            except Exception as exc:
                rec.record(case, "lowbit-w8", None, note=f"{type(exc).__name__}: {exc}"[:200])
            if peer_ok:
                try:
                    args = [(xs[i], c, s.to(torch.bfloat16)) for i, (c, s) in enumerate(wq)]
                    t = time_cuda(torch._weight_int8pack_mm, args, reps=reps)
                    rec.record(case, "torch-int8pack-mm", t, flops=fl, bytes_moved=N * K + 2 * N + 2 * (M * K + M * N),
                               peak="bf16")
                except Exception as exc:  # not every torch build has a CUDA kernel for it
                    peer_ok = False
                    rec.record(case, "torch-int8pack-mm", None, note=f"{type(exc).__name__}: {exc}"[:200])
            del xs
        del wb, wq
        torch.cuda.empty_cache()
