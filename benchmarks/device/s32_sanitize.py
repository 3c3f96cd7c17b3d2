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

from lowbit.kernels.decode_kv4 import decode_kv4_triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _kv4_cases import CASES, decode_cases  # noqa: E402

bad = 0
for label, args, kw in decode_cases(CASES + ((128, 1, 2, False, [1024, 640, 64]),)):
    o1 = decode_kv4_triton(*args, sraw=True, **kw)
    o0 = decode_kv4_triton(*args, sraw=False, **kw)
    ok = torch.equal(o0, o1)
    bad += not ok
    print(f"{label}: sraw == default {ok}")
torch.cuda.synchronize()
print("mismatches:", bad)
