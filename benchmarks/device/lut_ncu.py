"""Device helper: launch a LUT kernel (default config) 3 times for Nsight Compute.

    ncu --clock-control none --kernel-name regex:_lut_mma --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        python3 benchmarks/device/lut_ncu.py M SHAPE [CONFIG-DICT] [--kernel mma|wgmma] [--sass FILE]

``--kernel wgmma`` launches the register-table kernel (``lut_wgmma_triton``; ncu regex ``_lut_wgmma``) instead of
the fragment kernel; ``--sass FILE`` writes the compiled kernel's SASS (Triton's ``asm['sass']``) there.
"""
import argparse

import torch

from lowbit.bench.suites.lut import SHAPES, make_packed
from lowbit.kernels import lut_gemm, lut_wgmma

ap = argparse.ArgumentParser()
ap.add_argument("M", type=int)
ap.add_argument("shape", choices=sorted(SHAPES))
ap.add_argument("config", nargs="?", default="{}", help="a literal dict of launch overrides")
ap.add_argument("--kernel", choices=("mma", "wgmma"), default="mma")
ap.add_argument("--bits", type=int, default=4)
ap.add_argument("--sass", help="write the compiled kernel's SASS to this file")
args = ap.parse_args()
cfg = eval(args.config)  # noqa: S307 (a literal dict of launch overrides)
N, K = SHAPES[args.shape]
p = make_packed(torch.randn(N, K, device="cuda"), args.bits)
x = torch.randn(args.M, K, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    if args.kernel == "wgmma":
        lut_wgmma.lut_wgmma_triton(x, p["qmma"], p["scales"], p["pairs"], group_size=128, out_features=N,
                                   bits=args.bits, qweight_hi=p["qmma_hi"], **cfg)
    else:
        lut_gemm.lut_mma_triton(x, p["qmma"], p["qmma_hi"], p["scales"], p["pairs"], p["table"], bits=args.bits,
                                group_size=128, out_features=N, **cfg)
torch.cuda.synchronize()
if args.sass:
    k = (lut_wgmma if args.kernel == "wgmma" else lut_gemm).LAST_COMPILED["wgmma" if args.kernel == "wgmma" else "mma"]
    with open(args.sass, "w") as f:
        f.write(k.asm.get("sass", "") or "(no sass)")
