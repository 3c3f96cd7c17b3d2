"""Session-10 probe (device): two launch-level A/Bs that the model round could not resolve (noise ~1-2%).

    python3 benchmarks/device/s10_probe.py --out DIR

(a) LUT fragment kernel at M = 1 (4-bit NF, g128, bf16): ``SMALL_LAYER_NK`` on (o_proj 4096 x 4096 takes
    r1 w8 cps2) vs off (r2 w8 cps2), per Llama-3-8B projection;
(b) ``decode_float`` (split-KV + combine, bf16, Hq 32 / Hkv 8, D 128, page 64): ``COMBINE_PDL`` on vs off at
    B=1 L=1025 and B=16 L=8193.
Each timing: per-call time inside a CUDA graph of 20 back-to-back calls, median of 15 replays; the two
settings alternate 7 times (medians of the 7 reported with the spread). Output: ``s10_probe.json``.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lowbit._utils import capture_cuda_graph  # noqa: E402
from lowbit.bench.harness import env_info  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)


def graph_us(fn, n=20, reps=15):
    fn()
    torch.cuda.synchronize()
    g, _ = capture_cuda_graph(lambda: [fn() for _ in range(n)])
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n)
    return sorted(ts)[len(ts) // 2]


def ab(set_flag, fn, rounds=7):
    """Alternate the two settings; returns {setting: {median, min, max}} over the rounds."""
    res = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            set_flag(on)
            res[on].append(graph_us(fn))
    return {("on" if k else "off"): {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                                    "max": round(max(v), 3)} for k, v in res.items()}


doc = {"suite": "s10_probe", "env": env_info("benchmarks/device/s10_probe.py"), "lut_m1": {}, "decode_float": {}}
# (a) LUT
from lowbit.bench.suites.lut import SHAPES, make_packed  # noqa: E402
from lowbit.kernels import lut_gemm  # noqa: E402

shapes = dict(SHAPES, o=(4096, 4096))
keep = lut_gemm.SMALL_LAYER_NK
for name in ("o", "qkv", "down", "gate_up"):
    if name not in shapes:
        continue
    N, K = shapes[name]
    p = make_packed(torch.randn(N, K, device="cuda"), 4)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)

    def fn(p=p, x=x):
        return lut_gemm.lut_mma_triton(x, p["qmma"], p["qmma_hi"], p["scales"], p["pairs"], p["table"], bits=4,
                                       group_size=128, out_features=p["scales"].shape[1])

    ref = fn()
    r = ab(lambda on: setattr(lut_gemm, "SMALL_LAYER_NK", keep if on else 0), fn)
    lut_gemm.SMALL_LAYER_NK = keep
    r["cfg_on"] = lut_gemm.mma_config(1, N, K, 4, 128)
    r["same_output"] = bool(torch.equal(fn(), ref))
    doc["lut_m1"][f"{name} N={N} K={K}"] = r
    print(name, r, flush=True)
# (b) decode_float
from lowbit.bench.suites.kv4 import random_float_pages  # noqa: E402
from lowbit.kernels import decode_float as dfk  # noqa: E402
from lowbit.ops import kv4 as ops  # noqa: E402

for B, L in ((1, 1025), (16, 8193)):
    k, v, pt, lengths = random_float_pages([L] * B, 8, 64, 128, torch.bfloat16, seed=0, device="cuda")
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)

    def fn(q=q, k=k, v=v, pt=pt, lengths=lengths, L=L):
        return ops.decode_float(q, k, v, pt, lengths, max_len=L)

    dfk.COMBINE_PDL = False
    ref = fn()
    r = ab(lambda on: setattr(dfk, "COMBINE_PDL", on), fn)
    r["splits"] = dfk.LAST_LAUNCH.get("num_splits")
    dfk.COMBINE_PDL = True
    r["same_output"] = bool(torch.equal(fn(), ref))
    doc["decode_float"][f"B={B} L={L}"] = r
    print(B, L, r, flush=True)
with open(os.path.join(a.out, "s10_probe.json"), "w") as f:
    json.dump(doc, f, indent=1)
