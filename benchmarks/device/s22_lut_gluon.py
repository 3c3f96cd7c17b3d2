"""Session-22 probe (issues 4 and 7): the Gluon 4-bit LUT kernel (``lowbit.kernels.lut_wgmma_gluon``) against the
committed dispatch (``lowbit.ops.lut.lut_gemm``: fragment kernel up to 8-16 tokens, Triton register-table kernel
above), the Triton register-table kernel itself and cuBLAS bf16, one run, NF4 g128, Llama-3-8B shapes.

    PYTHONPATH=$PWD python3 benchmarks/device/s22_lut_gluon.py --out DIR [--parts ct] [--ms 1,16,64]

Part ``c``: correctness on every shape and M (rel-L2 vs the float32 reference, max |diff| vs the Triton kernel's
exact-scaling path, which shares the summation order). Part ``t``: CUDA-event medians, weights rotated over 3 sets
(> 2x L2 on the large shapes), the Gluon variants (``ctas_per_sm``, ``maxnreg``, ``xpf``) beside the peers.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, time_cuda, time_rotated, write_probe  # noqa: E402
from lowbit.bench.suites.lut import gluon_fn, op_fn, probe_cases, reference_f64, weight_sets, wgmma_fn  # noqa: E402
from lowbit.kernels import lut_wgmma_gluon as LG  # noqa: E402
from lowbit.ops.lut import lut_gemm_ref  # noqa: E402

args = probe_args("ct")  # part x (the 2..8-token crossover against the fragment kernel) runs when named
MS = [int(m) for m in os.environ.get("S22_MS", "1,8,16,32,64").split(",")]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096),
          "8192sq": (8192, 8192)}
doc = {"env": env_info(" ".join(sys.argv)), "note": "NF4 g128, bf16; us = median ms * 1000"}


def variants(M):
    v = {"gluon": {}, "gluon_c2": {"ctas_per_sm": 2}, "gluon_c8": {"ctas_per_sm": 8}}
    if M <= 16:
        v["gluon_r128"] = {"maxnreg": 128}
    if M > 32:
        v["gluon_xpf2"] = {"xpf": 2, "maxnreg": 255}
    else:
        v["gluon_xpf1"] = {"xpf": 1}
    return v


for name, N, K, M, ws, ps, xs in probe_cases(SHAPES, MS):
    if "c" in args.parts:
        p, x = ps[0], xs[0]
        ref = reference_f64(p, x)
        yt = wgmma_fn(p)(x)
        row = {}
        for vn, kw in variants(M).items():
            y = gluon_fn(p, **kw)(x)
            torch.cuda.synchronize()
            row[vn + "_rel"] = ((y.double() - ref).norm() / ref.norm()).item()
            row[vn + "_maxdiff_triton"] = (y.float() - yt.float()).abs().max().item()
        row["triton_rel"] = ((yt.double() - ref).norm() / ref.norm()).item()
        row["op_rel"] = ((op_fn(p)(x).double() - ref).norm() / ref.norm()).item()
        probe_row(doc, f"c_{name}_M{M}", row)
    if "t" in args.parts:
        row = {"M": M, "N": N, "K": K}
        sets = [(xs[i],) for i in range(3)]
        fns = {"cublas": [lambda x, w=w: F.linear(x, w) for w in ws], "op": [op_fn(p) for p in ps],
               "triton_wgmma": [wgmma_fn(p) for p in ps]}
        for vn, kw in variants(M).items():
            fns[vn] = [gluon_fn(p, **kw) for p in ps]
        time_rotated(row, fns, xs)
        row["gluon_split"] = LG.LAST_COMPILED.get("gluon_split")
        best = min(v for k, v in row.items() if k.startswith("gluon") and k.endswith("_us"))
        row["best_gluon_vs_cublas"] = round(row["cublas_us"] / best, 3)
        row["op_vs_cublas"] = round(row["cublas_us"] / row["op_us"], 3)
        probe_row(doc, f"t_{name}_M{M}", row)
if "x" in args.parts:  # the op's range for this kernel: fragment kernel vs this one at 1..12 tokens
    from lowbit.bench.suites.lut import mma_fn

    for name, (N, K) in SHAPES.items():
        ws, ps = weight_sets(N, K)
        for M in (1, 2, 3, 4, 6, 8, 12, 16):
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            row = {"M": M, "N": N, "K": K}
            fns = {"cublas": [lambda x, w=w: F.linear(x, w) for w in ws], "op": [op_fn(p) for p in ps],
                   "fragment": [mma_fn(p) for p in ps], "triton_wgmma": [wgmma_fn(p) for p in ps],
                   "gluon": [gluon_fn(p) for p in ps]}
            time_rotated(row, fns, xs)
            row["gluon_vs_fragment"] = round(row["fragment_us"] / row["gluon_us"], 3)
            row["op_vs_cublas"] = round(row["cublas_us"] / row["op_us"], 3)
            probe_row(doc, f"x_{name}_M{M}", row)
if "f" in args.parts:  # the fragment kernel's 2..8-token launch: its M <= 8 config vs its 9..16-token ones
    from lowbit.bench.suites.lut import mma_fn

    FV = {"m8": {}, "ring": dict(r=1, num_warps=8, ctas_per_sm=2, ring=4, xh=2, sp=True, balance=True, gu=1,
                                 prefetch=False),
          "pf": dict(r=1, num_warps=8, ctas_per_sm=4, prefetch=True, xh=2, gu=1),
          "ring_c4": dict(r=1, num_warps=8, ctas_per_sm=4, ring=4, xh=2, sp=True, balance=True, gu=1, prefetch=False),
          "r2_ring": dict(r=2, num_warps=8, ctas_per_sm=2, ring=4, xh=2, gu=1, prefetch=False)}
    for name, (N, K) in SHAPES.items():
        ws, ps = weight_sets(N, K)
        for M in (1, 2, 4, 8):
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            ref = lut_gemm_ref(xs[0].float(), ps[0]["qmma"], None, ps[0]["scales"], ps[0]["table"], 4, 128, K,
                               layout="mma").double()
            row = {"M": M, "N": N, "K": K}
            fns = {"cublas": [lambda x, w=w: F.linear(x, w) for w in ws], "op": [op_fn(p) for p in ps]}
            fns |= {"frag_" + v: [mma_fn(p, **kw) for p in ps] for v, kw in FV.items()}
            for fn_name, fl in fns.items():
                try:
                    if fn_name.startswith("frag_"):
                        y = fl[0](xs[0])
                        row[fn_name + "_rel"] = round(((y.double() - ref).norm() / ref.norm()).item(), 6)
                    t = time_cuda(lambda i, x: fl[i](x), [(i, xs[i]) for i in range(3)], reps=100)
                    row[fn_name + "_us"] = round(t["median_ms"] * 1000, 2)
                except Exception as exc:
                    row[fn_name + "_err"] = f"{type(exc).__name__}: {exc}"[:200]
            probe_row(doc, f"f_{name}_M{M}", row)
k = LG.LAST_COMPILED.get("gluon")
if k is not None:
    doc["last_kernel"] = {"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared}
print(write_probe(doc, args.out, os.environ.get("S22_NAME", "s22_lut_gluon.json")))
