"""Device helper: launch lowbit's quantized prefill attention 3 times for Nsight Compute.

    ncu --clock-control none --kernel-name regex:_attn_fwd --launch-skip 2 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
        python3 benchmarks/device/attn_ncu.py [fp8|int8] [S] [causal]

B = 4, H = 32, D = 128, bf16 inputs (issue 8 / 9's shape), S = 4096 non-causal by default. Run from the repository
root with PYTHONPATH=$PWD.
"""
import sys

import torch

import lowbit

scheme = sys.argv[1] if len(sys.argv) > 1 else "fp8"
S = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
q, k, v = (torch.randn(4, 32, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(3):
    lowbit.api.attention(q, k, v, scheme=scheme, causal=causal)
torch.cuda.synchronize()
print("ok", scheme, S, causal)
