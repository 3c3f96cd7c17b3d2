"""Session-29 probe (issue 5): the W4A8 INT8 GEMM's x tiles by TMA (``XTMA``) against its pointer loads, at the
committed configs (in-register dequantization, and the W8 path where ``use_w8`` takes it, its per-call
``dequantize_w8`` counted), GEMM alone on pre-quantized x, row-tiled codes (the module's layout), ``graph_us`` over
> 2x L2 of weight copies, beside cuBLAS bf16 and ``torch._scaled_mm`` FP8 (x pre-quantized). Outputs are compared bit
for bit first.

    PYTHONPATH=$PWD python3 benchmarks/device/s29_int8_xtma.py --out DIR   (env S29_MS=64,128,256,1024,4096)
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import graph_us, probe_args, probe_doc, probe_row, rotating_inputs, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import peer_gemm_fns  # noqa: E402
from lowbit.bench.suites.w4a8_int8 import LLAMA3_8B, _qoq  # noqa: E402
from lowbit.kernels.w4a8_int8_gemm import dequantize_w8, launch, pick_config, use_w8  # noqa: E402
from lowbit.ops.quant import per_token_quant  # noqa: E402

a = probe_args("x")
MS = [int(m) for m in os.environ.get("S29_MS", "64,128,256,1024,4096").split(",")]
doc = probe_doc("benchmarks/device/s29_int8_xtma.py", ("S29_MS",))


def fn(q, xq, xs, K, xtma):
    qw, ws, gs, gz = q
    M, N, KP = xq.shape[0], qw.shape[0], 2 * qw.shape[1]
    w8 = use_w8(M, N, KP)
    cfg = dict(pick_config(M, N, KP, 128, w8=w8, tiled=True), XTMA=xtma)

    def f():
        w = dequantize_w8(qw, gs, gz, tiled=True) if w8 else None
        return launch(xq, xs, qw, ws, gs, gz, None, K, 128, torch.bfloat16, config=cfg, w8=w, tiled=True)[0]
    return f, w8


for name, (N, K) in LLAMA3_8B.items():
    sets = rotating_inputs(lambda: _qoq(N, K))
    for M in MS:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        xq, xs = per_token_quant(x, "int8")
        f0, w8 = fn(sets[0], xq, xs, K, False)
        f1, _ = fn(sets[0], xq, xs, K, True)
        row = {"N": N, "K": K, "M": M, "w8_path": w8, "bitequal": bool(torch.equal(f0(), f1()))}
        for rep in range(2):
            for vn, t in (("base", False), ("xtma", True)):
                row.setdefault(vn + "_us", []).append(round(graph_us([fn(s, xq, xs, K, t)[0] for s in sets]), 2))
        for pn, pf in peer_gemm_fns(x, N, K).items():
            row[pn + "_us"] = round(graph_us(pf), 2)
        probe_row(doc, f"{name}_m{M}", row)
    del sets
    torch.cuda.empty_cache()
print(write_probe(doc, a.out, "s29_int8_xtma.json"))
