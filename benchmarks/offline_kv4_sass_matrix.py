"""Offline sm_90a builds (Triton 3.6, no GPU) of the Gluon INT4-cache decode kernel over 11 constexpr configurations
of the default options (signed / zero-point codes, D 64 / 128, split or not, CSTORE on / off, G x TQ, CRS, one or two
INT8 Q planes, VSUB, 2 / 3 stages): the SASS of each into DIR (``c<i>.sass``, and the PTX without .loc / .file lines)
and its md5, for a before / after comparison of a refactor. Options a tree's kernel still has but the configurations
do not name (session 31 removed LEAN, ILP, SRING, PTA, AHEAD, LAZY and the swizzle parameters) are set to their off
values, so the same script builds both trees.

    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_kv4_sass_matrix.py DIR [TREE] [i ...]
"""
import hashlib
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.tools.disasm import get_sass

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
tree = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].isdigit() else os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, tree)
from lowbit.kernels import decode_kv4 as K  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _offline import kv4_gluon_types, signature  # noqa: E402

configs = [  # zp, half, split, cstore, G, TQ, crs, qk8, vsub, stages
    (False, 64, True, True, 4, 1, False, 2, 0, 2), (False, 64, True, False, 4, 1, False, 2, 0, 2),
    (False, 64, False, True, 4, 1, False, 2, 0, 2), (True, 64, True, True, 4, 1, False, 2, 1, 2),
    (True, 64, False, False, 4, 1, False, 2, 1, 2), (False, 32, True, True, 2, 2, True, 2, 0, 2),
    (True, 32, True, False, 8, 1, True, 1, 1, 2), (False, 64, True, True, 4, 2, True, 1, 0, 2),
    (False, 64, True, True, 4, 1, False, 2, 1, 2), (True, 64, True, True, 4, 1, False, 2, 0, 2),
    (False, 64, True, True, 4, 1, False, 2, 0, 3),
]
only = [int(i) for i in sys.argv[2:] if i.isdigit()]
for i, (zp, half, split, cstore, G, TQ, crs, qk8, vsub, stages) in enumerate(configs):
    if only and i not in only:
        continue
    consts = dict(G=G, TQ=TQ, BLOCK_Q=8, HALF=half, PAGE=64, BLOCK_N=32, ZERO_POINT=zp, HAS_CRS=crs, SPLIT=split,
                  QK8=qk8, LV=K._v_load_layout(32, half), CL=K._copy_layout(half), STAGES=stages,
                  PDL=split, PROBE=False, STAMP=False, VSUB=vsub, CSTORE=cstore,
                  # options of older trees (removed in session 31), off
                  AHEAD=False, LEAN=False, ILP=False, SRING=False, PTA=False, LAZY=False, SW_VEC=1, SW_PHASE=1,
                  SW_MAX=1)
    sig, consts, attrs = signature(K._decode_kv4_gluon_kernel, kv4_gluon_types(zp), consts)
    k = triton.compile(GluonASTSource(fn=K._decode_kv4_gluon_kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "maxnreg": 128})
    ptx = "\n".join(ln for ln in k.asm["ptx"].splitlines()
                    if not re.match(r"\s*\.(loc|file)\b", ln) and "debug" not in ln)
    sass = get_sass(k.asm["cubin"])
    open(f"{out}/c{i}.ptx", "w").write(ptx)
    open(f"{out}/c{i}.sass", "w").write(sass)
    print(i, hashlib.md5(sass.encode()).hexdigest()[:10], len(sass.splitlines()), flush=True)
