"""Session-27 check: the split counts decode_kv4 picks (two calls per shape: the rule, then the cached residency) after the residency cache was keyed per compiled variant.

    PYTHONPATH=$PWD python3 benchmarks/device/s27_splits_check.py
"""
import torch, sys, os
sys.path.insert(0, os.getcwd())
from lowbit.bench.suites.kv4 import random_cache
from lowbit.kernels import decode_kv4 as dk
for (B, L) in [(16, 8192), (16, 32768), (1, 32768), (64, 1024), (16, 8192)]:
    c = random_cache(B, 8, 128, L)
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    r = []
    for _ in range(2):
        dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"], max_len=L)
        r.append(dk.LAST_LAUNCH["num_splits"])
    print(B, L, r)
