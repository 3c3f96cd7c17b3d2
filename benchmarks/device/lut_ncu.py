"""Device helper: launch the LUT fragment kernel (default config) 3 times for Nsight Compute.

    ncu --clock-control none --kernel-name regex:_lut_mma --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        python3 benchmarks/device/lut_ncu.py M SHAPE [CONFIG-DICT]
"""
import sys

import torch

from lowbit.bench.suites.lut import SHAPES, make_packed
from lowbit.kernels.lut_gemm import lut_mma_triton

M, name = int(sys.argv[1]), sys.argv[2]
cfg = eval(sys.argv[3]) if len(sys.argv) > 3 else {}  # noqa: S307 (a literal dict of launch overrides)
N, K = SHAPES[name]
p = make_packed(torch.randn(N, K, device="cuda"), 4)
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    lut_mma_triton(x, p["qmma"], p["qmma_hi"], p["scales"], p["pairs"], p["table"], bits=4, group_size=128,
                   out_features=N, **cfg)
torch.cuda.synchronize()
