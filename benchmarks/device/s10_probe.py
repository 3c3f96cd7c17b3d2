"""Session-10 probe (device): launch-level A/Bs that a model round cannot resolve (its noise is ~1-2%).

    python3 benchmarks/device/s10_probe.py --out DIR

(c) the W4A8 INT8 GEMM at M = 1, x pre-quantized, PDL launch (the runner's batch-1 call): ``DP4A_CONFIG``
    (dp4a on CUDA cores) vs the default wgmma config, per Llama-3-8B projection.
Each timing: per-call time inside a CUDA graph of >= 20 back-to-back calls, median of 15 replays; the two
settings alternate 7 times (medians of the 7 reported with the spread). The weights rotate over enough copies
that one replay streams > 2x L2 (``copies``). Output: ``s10_probe.json``.

``benchmarks/results/h200/s10_probe.json`` also holds parts (a) and (b), measured with this script at commit
d97c436 and removed with the knobs they measured: (a) LUT fragment kernel at M = 1 with one row tile per warp
for layers of <= 4096 x 4096 weights (o_proj 10.13 vs 9.85 us: slower with the weights streamed from HBM;
an H100 run without weight rotation, where o_proj's 8.4 MB sat in L2, had shown 7.33 vs 8.28: `results/h100/s10_probe_unrotated.json`), (b) the
decode_float combine as a PDL launch (B=1 L=1025 7.86 vs 7.74 us, B=16 L=8193 126.7 vs 126.6: no gain).
"""
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lowbit.bench.harness import env_info, graph_us, probe_args, rotation_copies as copies  # noqa: E402

a = probe_args("c")


def ab(set_flag, fn, rounds=7):
    """Alternate the two settings; returns {setting: {median, min, max}} over the rounds."""
    res = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            set_flag(on)
            res[on].append(graph_us(fn))
    return {("on" if k else "off"): {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                                    "max": round(max(v), 3)} for k, v in res.items()}


doc = {"suite": "s10_probe", "env": env_info("benchmarks/device/s10_probe.py --parts " + a.parts)}
if "c" in a.parts:
    from lowbit.formats.w4a8_int8 import quantize as qoq  # noqa: E402
    from lowbit.kernels import w4a8_int8_gemm as ik  # noqa: E402
    from lowbit.ops.w4a8_int8 import w4a8_int8_gemm  # noqa: E402

    doc["int8_m1_dp4a"] = {}
    for name, (N, K) in {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}.items():
        w0 = qoq(torch.randn(N, K, device="cuda"), 128)
        ws = [w0] + [type(w0)(w0.qweight.clone(), w0.wscale.clone(), w0.gscale.clone(), w0.gzs.clone(), K, 128)
                     for _ in range(copies(N * K // 2) - 1)]
        xq = torch.randint(-127, 128, (1, K), device="cuda", dtype=torch.int8)
        sx = torch.rand(1, device="cuda") + 0.5
        fns = [lambda w=w: w4a8_int8_gemm(xq, sx, w.qweight, w.wscale, w.gscale, w.gzs, None, pdl=True) for w in ws]
        saved = ik.DP4A_M1_MAX_N
        setting = {True: dict(saved, rows=1 << 62), False: dict(saved, rows=0)}  # dp4a on / off (row-major codes)
        ik.DP4A_M1_MAX_N = setting[False]
        ref = fns[0]()
        r = ab(lambda on: setattr(ik, "DP4A_M1_MAX_N", setting[on]), fns)
        ik.DP4A_M1_MAX_N = setting[True]
        r["same_output"] = bool(torch.equal(fns[0](), ref))
        r["copies"] = len(ws)
        ik.DP4A_M1_MAX_N = saved
        doc["int8_m1_dp4a"][f"{name} N={N} K={K}"] = r
        print(name, r, flush=True)
with open(os.path.join(a.out, "s10_probe.json"), "w") as f:
    json.dump(doc, f, indent=1)
