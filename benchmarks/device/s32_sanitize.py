"""compute-sanitizer target: session 32's ``SRAW`` scale loads in the INT4-cache Gluon decode (inline-PTX
``ld.global.nc.u8`` of the next block's token scales / zero points) on small ragged cases (D 64 / 128, 1-2 query
tokens, one split and several, signed and zero-point codes, lengths that end inside a page and on a page edge),
compared bit for bit with the default loads.

    compute-sanitizer --tool memcheck python3 benchmarks/device/s32_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from lowbit.bench.suites.kv4 import random_cache  # noqa: E402
from lowbit.kernels.decode_kv4 import decode_kv4_triton  # noqa: E402

bad = 0
for D, TQ, splits, zp, lens in ((128, 1, None, False, [700, 5, 513]), (128, 1, 1, False, [300, 1, 77]),
                                (64, 2, None, True, [650, 33, 129]), (128, 2, 1, True, [97, 64, 2]),
                                (128, 1, 2, False, [1024, 640, 64])):
    torch.manual_seed(D + TQ)
    c = random_cache(3, 8, D, max(lens), device="cuda", zero_point=zp)
    c["lengths"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 32 if TQ == 1 else 16, TQ, D, device="cuda", dtype=torch.bfloat16)
    args = (q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"])
    kw = dict(gluon=True, num_splits=splits, k_zero=c.get("k_zero"), v_zero=c.get("v_zero"))
    o1 = decode_kv4_triton(*args, sraw=True, **kw)
    o0 = decode_kv4_triton(*args, sraw=False, **kw)
    ok = torch.equal(o0, o1)
    bad += not ok
    print(f"kv4 D={D} TQ={TQ} splits={splits} zp={zp}: sraw == default {ok}")
torch.cuda.synchronize()
print("mismatches:", bad)
