"""Session 37: why the ``w4a8-int8`` linear at M = 4096 ran 0.07-0.25 ms longer than its GEMM on pre-quantized
codes (``s37_w4a8_int8_bigm*.json``): the per-token quantization launch alone (INT8 and FP8, K = 4096 / 14336,
M = 16 .. 8192), the linear and the GEMM, each timed by ``lowbit.bench.harness.time_cuda`` in one process.

    PYTHONPATH=$PWD python3 benchmarks/device/s37_actquant.py OUT
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench import harness  # noqa: E402
from lowbit.bench.suites.w4a8_int8 import _qoq  # noqa: E402
from lowbit.ops.quant import per_token_quant  # noqa: E402
from lowbit.ops.w4a8_int8 import w4a8_int8_gemm, w4a8_int8_linear  # noqa: E402

out = sys.argv[1]
rows = []
for K in (4096, 14336):
    for M in (16, 1024, 4096, 8192):
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for name, dt in (("int8", "int8"), ("fp8", "fp8")):
            t = harness.time_cuda(lambda x: per_token_quant(x, dt), [(x,) for x in xs], reps=50)
            gbs = (M * K * 3 + 4 * M) / (t["median_ms"] * 1e-3) / 1e9
            rows.append({"K": K, "M": M, "what": f"quant-{name}", **t, "GB_s": gbs})
            print(K, M, name, round(t["median_ms"] * 1e3, 1), "us", round(gbs), "GB/s", flush=True)
        if M >= 1024:
            N = 28672 if K == 4096 else 4096
            w = _qoq(N, K)
            xq = [per_token_quant(x, "int8") for x in xs]
            t1 = harness.time_cuda(lambda x: w4a8_int8_linear(x, *w, tiled=True), [(x,) for x in xs], reps=20)
            t2 = harness.time_cuda(lambda a, s: w4a8_int8_gemm(a, s, *w, out_dtype=torch.bfloat16, tiled=True), xq,
                                   reps=20)
            rows.append({"K": K, "M": M, "N": N, "what": "linear", **t1})
            rows.append({"K": K, "M": M, "N": N, "what": "gemm", **t2})
            print(K, M, N, "linear", round(t1["median_ms"], 4), "gemm", round(t2["median_ms"], 4), "min",
                  round(t1["min_ms"], 4), round(t2["min_ms"], 4), flush=True)
            del w, xq
        del xs
        torch.cuda.empty_cache()
harness.write_probe({"env": harness.env_info("PYTHONPATH=$PWD python3 benchmarks/device/s37_actquant.py OUT"),
                     "rows": rows}, out, "s37_actquant.json")
