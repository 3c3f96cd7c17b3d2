"""Session-21 probe (issue 7): the W8 lm_head (``lowbit.kernels.w8_gemm``, INT8 per-channel weight-only).

    PYTHONPATH=$PWD python3 benchmarks/device/s21_w8.py --out DIR [--parts gm]

Part ``g``: the GEMM at the Llama-3-8B lm_head shape (N = 128256, K = 4096), M in {1, 4, 16, 64}: W8 vs cuBLAS bf16
(``F.linear``) in the same run, inputs rotated (weights > 2x L2), median of CUDA-event timings; TB/s on the weight
bytes; rel-L2 vs the reference; the kernel's SASS conversion / MMA opcodes. Part ``m``: ``lowbit.bench.model`` decode
(B = 1 / 64, ctx 1k / 8k) and prefill 16 x 1024 with the default heads and ``lm_head="w8"`` (``+head8``). Part ``s``:
the launch-shape sweep behind ``w8_config`` (GEMV at M = 1 / 4, GEMM at M = 16 / 64), ``s21_w8_sweep.json``.
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, time_cuda, write_probe  # noqa: E402
from lowbit.formats.w8 import gemm_ref, quantize_w8  # noqa: E402
from lowbit.ops.w8 import w8_linear  # noqa: E402

args = probe_args("gm")  # part s (the launch-shape sweep behind w8_config) runs only when named
doc = {"env": env_info(" ".join(sys.argv))}
N, K = 128256, 4096

if "g" in args.parts:
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    qs = [quantize_w8(w) for w in ws]
    for M in (1, 4, 16, 64):
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        c, s = qs[0]
        rel = ((w8_linear(xs[0], c, s).double() - gemm_ref(xs[0], c, s, None, torch.float32).double()).norm()
               / gemm_ref(xs[0], c, s, None, torch.float32).double().norm()).item()
        tw = time_cuda(lambda x, c, s: w8_linear(x, c, s), [(xs[i], *qs[i]) for i in range(3)], reps=100)
        tb = time_cuda(lambda x, w: F.linear(x, w), [(xs[i], ws[i]) for i in range(3)], reps=100)
        row = {"M": M, "N": N, "K": K, "w8_ms": tw["median_ms"], "bf16_ms": tb["median_ms"],
               "speedup": tb["median_ms"] / tw["median_ms"], "w8_TBps": N * K / tw["median_ms"] / 1e9,
               "bf16_TBps": 2 * N * K / tb["median_ms"] / 1e9, "rel_vs_ref": rel}
        probe_row(doc, f"g_M{M}", row)
    from triton.tools.disasm import get_sass

    from lowbit.kernels.w8_gemm import w8_gemm_triton

    for M in (1, 64):
        kern = w8_gemm_triton(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), *qs[0], None, torch.bfloat16,
                              return_kernel=True)[1]
        sass = get_sass(kern.asm["cubin"])
        probe_row(doc, f"g_sass_M{M}", {o: sass.count(o) for o in ("I2F", "F2FP", "PRMT", "HMMA", "HGMMA", "LDG.E.128",
                                                                  "LDGSTS", "STL", "LDSM")} | {"regs": kern.n_regs})

if "s" in args.parts:
    import itertools

    from lowbit.kernels.w8_gemm import w8_gemm_triton

    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    qs = [quantize_w8(w) for w in ws]
    sweep = []

    def med(fn, sets):
        return time_cuda(fn, sets, reps=40, warmup=3)["median_ms"]

    for M, kind in ((1, "gemv"), (4, "gemv"), (16, "gemm"), (64, "gemm")):
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        sweep.append(("bf16", M, med(lambda x, w: F.linear(x, w), [(xs[i], ws[i]) for i in range(3)])))
        shapes = (itertools.product((32, 64, 128), (32, 64, 128), (2, 3, 4), (4, 8)) if kind == "gemv" else
                  itertools.product((64, 128), (128, 256), (3, 4), (4, 8)))
        for a, b, st, nw in shapes:
            if kind == "gemv":
                if M == 4 and (a, b) not in ((64, 64), (32, 64), (64, 32), (128, 32), (32, 128)):
                    continue
                cfg = dict(GEMV=True, BLOCK_N=a, BLOCK_W=b, STAGES=st, num_warps=nw)
            else:
                cfg = dict(GEMV=False, BLOCK_N=a, BLOCK_M=16 if M == 16 else 64, BLOCK_K=b, STAGES=st, num_warps=nw)
            try:
                t = med(lambda x, c, s, cfg=cfg: w8_gemm_triton(x, c, s, None, torch.bfloat16, config=cfg),
                        [(xs[i], *qs[i]) for i in range(3)])
            except Exception as exc:  # e.g. out of shared memory
                t = None
                print(exc)
            sweep.append((kind, M, a, b, st, nw, t))
            print(kind, M, a, b, st, nw, t, flush=True)
    doc["sweep_columns"] = ["kind", "M", "BLOCK_N", "BLOCK_W (gemv) / BLOCK_K (gemm)", "STAGES", "num_warps", "ms"]
    doc["sweep"] = sweep

if "m" in args.parts:
    from lowbit.bench import model as BM

    t0 = time.time()
    BM.run(os.path.join(args.out, "model"), recipes=tuple(os.environ.get(
        "S21_RECIPES", "fireq,fireq+head8,flute-nf4,flute-nf4+head8,flute-nf4+kv4+head8,qserve+head8").split(",")),
        prefill_seqs=[1024], decode_batches=[1, 64], decode_ctx=[1024, 8192],
        time_budget_s=float(os.environ.get("S21_BUDGET", 330)), command=" ".join(sys.argv) + " (part m)")
    doc["model_s"] = time.time() - t0
write_probe(doc, args.out, "s21_w8.json")
