"""Device helper: launch the committed INT4-cache decode (Gluon kernel, default options) 3 times for Nsight Compute.

    ncu --clock-control none --kernel-name regex:_decode_kv4_gluon --launch-skip 2 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
        python3 benchmarks/device/kv4_ncu.py [B L]

B sequences of L keys (default 16 x 8192), 32 query / 8 KV heads, D = 128, signed codes, one query token: the
shape of issue 8's 8k target. Run from the repository root with PYTHONPATH=$PWD. ``KV4_OPTS``: a JSON dict of
launcher options (e.g. ``{"sraw": true}``).
"""
import json
import os
import sys

import torch

from lowbit.bench.suites.kv4 import random_cache
from lowbit.kernels import decode_kv4 as dk

B, L = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16, 8192)
c = random_cache(B, 8, 128, L)
q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"],
                         max_len=L, qk_int8=2, gluon=True, **json.loads(os.environ.get("KV4_OPTS", "{}")))
torch.cuda.synchronize()
print("splits", dk.LAST_LAUNCH.get("num_splits"))
