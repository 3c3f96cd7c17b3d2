"""Device helper: launch lowbit's MLA decode (the committed dispatch) 3 times for Nsight Compute.

    ncu --clock-control none --kernel-name regex:_mla_ws_kernel --launch-skip 2 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
        python3 benchmarks/device/mla_ncu.py [fp8|bf16] [B L H]

Default: the FP8 latent cache, B = 32, L = 16384, 128 heads, one query token (issue 6's compute-bound case). Run from
the repository root with PYTHONPATH=$PWD.
"""
import sys

import torch

from lowbit.bench.suites.mla import make_caches
from lowbit.ops.mla import mla_decode

kind = sys.argv[1] if len(sys.argv) > 1 else "fp8"
B, L, H = (int(v) for v in sys.argv[2:5]) if len(sys.argv) > 4 else (32, 16384, 128)
c = make_caches(B, L, fp8=kind == "fp8", bf16=kind == "bf16")
q = torch.randn(B, 1, H, 576, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    mla_decode(q, c[kind], c["page_table"], c["seq_lens"], max_seq_len=L)
torch.cuda.synchronize()
print("ok", kind, B, L, H)
