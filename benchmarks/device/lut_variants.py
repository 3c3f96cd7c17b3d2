"""Device script: launch-config variants of the LUT fragment kernel (``lut_mma_triton``) at M = 16 / 32 / 64
(and at M = 1: ``variants_m1``, ``--ms 1 qkv o gate_up down``).

For each Llama-3-8B shape (gate_up, down) and 8192^2, 4-bit NF g128, bf16: the current
``mma_config`` default, then row tiles per warp ``r`` x warps per program x {plain, ``xh=2``,
prefetch + ``xh=2``, ``ring=4`` + ``xh=2``}, each timed with ``harness.time_cuda`` (weights rotated
over 2-3 copies) and checked against the default's output (rel-L2). Writes ``lut_variants.json``.

    PYTHONPATH=. python3 benchmarks/device/lut_variants.py --out DIR [shape ...]
    LUT_VARIANTS='{"r4 w8": {"r": 4}}' PYTHONPATH=. python3 benchmarks/device/lut_variants.py --out DIR --ms 1 down

``LUT_VARIANTS`` (JSON, label -> overrides of ``mma_config``) replaces the built-in variant lists.
"""
import argparse
import json
import os
import time

import torch

from lowbit.bench.harness import env_info, time_cuda
from lowbit.bench.suites.lut import SHAPES, make_packed
from lowbit.kernels.lut_gemm import lut_mma_triton, mma_config

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("shapes", nargs="*", default=["gate_up", "down", "8192sq"])
ap.add_argument("--ms", default="16,32,64")
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)
T0 = time.time()
torch.manual_seed(0)
doc = {"suite": "lut_variants", "env": env_info("benchmarks/device/lut_variants.py " + " ".join(args.shapes)),
       "rows": []}


def run(p, x, **cfg):
    return lut_mma_triton(x, p["qmma"], p["qmma_hi"], p["scales"], p["pairs"], p["table"], bits=4, group_size=128,
                          out_features=p["scales"].shape[1], **cfg)


SHAPES = dict(SHAPES, o=(4096, 4096))  # session 9: the attention output projection of the model's decode step


def variants_m1(base):
    """M = 1 (session 9): the decode step's small projections (qkv, o) spend ~9-11 us per launch at
    1.6-2.1 us of bytes (S9a profile): programs per SM, split-K depth and row tiles per program."""
    out = [("default", {})]
    for r, nw in ((2, 8), (1, 8), (2, 4), (1, 4)):
        for cps in (2, 4, 8):
            for extra in ({}, {"prefetch": True}, {"ring": 4, "xh": 2}):
                cfg = dict(base, r=r, num_warps=nw, ctas_per_sm=cps, **extra)
                out.append((f"r{r} w{nw} cps{cps} " + " ".join(f"{k}={v}" for k, v in extra.items()), cfg))
    for r, nw in ((2, 8), (1, 4)):
        for split in (4, 8, 16, 32):
            for extra in ({}, {"prefetch": True}):
                cfg = dict(base, r=r, num_warps=nw, split_k=split, **extra)
                out.append((f"r{r} w{nw} split{split} " + " ".join(f"{k}={v}" for k, v in extra.items()), cfg))
    return out


for name in args.shapes:
    N, K = SHAPES[name]
    packs = [make_packed(torch.randn(N, K, device="cuda"), 4) for _ in range(2 if name == "gate_up" else 3)]
    for M in (int(m) for m in args.ms.split(",")):
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in packs]
        base = mma_config(M, N, K, 4, 128)
        variants = [("default", {})] if M > 1 else variants_m1(base)
        if os.environ.get("LUT_VARIANTS"):  # '{"label": {cfg overrides}, ...}': only these beside the default
            variants = [("default", {})] + [(k, dict(base, **v)) for k, v in json.loads(os.environ["LUT_VARIANTS"]).items()]
        for r, nw in ((2, 8), (2, 4), (4, 4), (1, 4), (1, 8)) if M > 1 and not os.environ.get("LUT_VARIANTS") else ():
            for extra in ({}, {"xh": 2}, {"prefetch": True, "xh": 2}, {"ring": 4, "xh": 2, "prefetch": False}):
                cfg = dict(base, r=r, num_warps=nw, **extra)
                variants.append((f"r{r} w{nw} " + " ".join(f"{k}={v}" for k, v in extra.items()), cfg))
        ref = run(packs[0], xs[0]).float()
        for label, cfg in variants:
            try:
                err = ((run(packs[0], xs[0], **cfg).float() - ref).norm() / ref.norm()).item()
                fns = [(lambda p: (lambda x: run(p, x, **cfg)))(p) for p in packs]
                t = time_cuda(lambda i, x: fns[i](x), list(enumerate(xs)), reps=60, warmup=5)
                row = dict(layer=name, M=M, N=N, K=K, variant=label, cfg=dict(base if not cfg else cfg),
                           us=t["median_ms"] * 1e3, min_us=t["min_ms"] * 1e3, rel_l2_vs_default=err)
                doc["rows"].append(row)
                print(f"[{time.time() - T0:6.1f}] {name:8s} M={M:3d} {label:34s} {row['us']:7.1f} us  err {err:.1e}",
                      flush=True)
            except Exception as exc:  # one failing variant must not lose the others
                print(f"{name} M={M} {label} FAIL {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        with open(os.path.join(args.out, "lut_variants.json"), "w") as f:
            json.dump(doc, f, indent=1)
    del packs
    torch.cuda.empty_cache()
