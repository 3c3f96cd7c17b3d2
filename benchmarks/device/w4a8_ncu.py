"""Device helper: launch the w4a8-fp8 GEMM (default config, pre-quantized x) 3 times for Nsight Compute.

    ncu --clock-control none --kernel-name regex:_w4a8_fp8_gemm --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        python3 benchmarks/device/w4a8_ncu.py M LAYER [CONFIG-DICT] [--sass FILE] [--gluon DICT]

LAYER is a Llama-3-8B layer of ``lowbit.bench.suites.w4a8_fp8.SHAPES``; ``--sass FILE`` writes the compiled
kernel's SASS there (needs PYTHONPATH=$PWD under ncu).
"""
import argparse

import torch

from lowbit.bench.suites.w4a8_fp8 import GROUP, SHAPES, random_packed
from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm
from lowbit.ops.quant import per_token_quant

ap = argparse.ArgumentParser()
ap.add_argument("M", type=int)
ap.add_argument("layer", choices=sorted(SHAPES["llama3-8b"]))
ap.add_argument("config", nargs="?", default="{}", help="a literal dict of pick_config overrides")
ap.add_argument("--sass", help="write the compiled kernel's SASS to this file")
ap.add_argument("--gluon", help="a literal dict of overrides: launch session 28's Gluon probe kernel (w4a8_gluon_kernel.py beside this script) "
                "instead (ncu --kernel-name regex:_w4a8_gluon)")
args = ap.parse_args()
N, K = SHAPES["llama3-8b"][args.layer]
cfg = {**pick_config(args.M, N, K), **eval(args.config)}  # noqa: S307 (a literal dict)
codes, scales = random_packed(N, K)
xq, sx = per_token_quant(torch.randn(args.M, K, device="cuda", dtype=torch.bfloat16), "fp8")
for _ in range(3):
    if args.gluon:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import w4a8_gluon_kernel as WG

        cfg = eval(args.gluon)  # noqa: S307 (a literal dict)
        WG.w4a8_fp8_gluon(xq, sx, codes, scales, 2.0 ** -8, GROUP, **cfg)
        k = WG.LAST_COMPILED["kernel"]
    else:
        _, k = w4a8_fp8_gemm(xq, sx, codes, scales, 2.0 ** -8, K, GROUP, config=cfg, return_compiled=True)
torch.cuda.synchronize()
print("config", cfg, "regs", k.n_regs, "spills", k.n_spills, "shared", k.metadata.shared)
if args.sass:
    from triton.tools.disasm import get_sass

    with open(args.sass, "w") as f:
        f.write(get_sass(k.asm["cubin"]))
