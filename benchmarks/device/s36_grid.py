"""Session-36 check on the GPU: launches whose batch x heads exceed CUDA's 65535 grid limit (axis 1) run, in batch
slices (``lowbit._utils.by_batch``, session 35), and give the rows of the unsliced calls on a smaller batch.

    PYTHONPATH=$PWD python3 benchmarks/device/s36_grid.py

Per scheme: B = 2049 sequences x 32 query heads (65568 > 65535; GQA 32/8), S = 16, D = 64: the output of the whole
batch on its first 4 and last 4 sequences equals the same call on those 8 sequences alone (``torch.equal``).
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import lowbit  # noqa: E402
from lowbit.ops.kv4 import kv4_quantize  # noqa: E402

B, HQ, HKV, S, D = 2049, 32, 8, 16, 64
torch.manual_seed(0)
q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
idx = torch.tensor([0, 1, 2, 3, B - 4, B - 3, B - 2, B - 1], device="cuda")
for scheme in ("fp8", "fp8-kv4", "int8", "int8-qk"):
    try:
        full = lowbit.api.attention(q, k, v, scheme=scheme, causal=True)[idx]
        part = lowbit.api.attention(q[idx], k[idx], v[idx], scheme=scheme, causal=True)
        print(scheme, "equal" if torch.equal(full, part) else f"DIFF {(full - part).abs().max().item()}", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(scheme, "ERROR", repr(exc)[:300], flush=True)
kk = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)  # 65568 (sequence, head) rows
try:
    full = kv4_quantize(kk, kk)
    part = kv4_quantize(kk[idx], kk[idx])
    print("kv4_quantize", "equal" if all(torch.equal(a[idx], b) for a, b in zip(full, part)) else "DIFF", flush=True)
except Exception as exc:  # noqa: BLE001
    print("kv4_quantize ERROR", repr(exc)[:300], flush=True)
