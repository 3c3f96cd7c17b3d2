"""Offline sm_90a build of the Gluon INT4-cache decode kernel (``lowbit.kernels.decode_kv4._decode_kv4_gluon_kernel``)
with no GPU: PTX counts (mma.sync by type, cp.async, shared loads, prmt, barriers), registers / spills from ptxas and
the SASS per key block (loop lengths and opcodes, bundled cuobjdump), for the launcher's default constexprs (4 query
heads per KV head, one query token, D=128, pages of 64) or those given.

    python3 -m pip download triton==3.6.0 --no-deps -d /tmp/wh && python3 -m pip install --no-deps --target /tmp/t36 /tmp/wh/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_kv4.py [--stages 2] [--maxnreg 128] [--zp] [--half 32] [--vsub] [--ptx FILE]

The numbers guide which variants to time; they are not a measurement.
"""
import argparse
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lowbit.kernels import decode_kv4 as K  # noqa: E402
from benchmarks._offline import kv4_gluon_types, report, signature, write_json  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--zp", action="store_true")
ap.add_argument("--stages", type=int, default=K.GLUON_STAGES)
ap.add_argument("--maxnreg", type=int, default=K.GLUON_MAXNREG, help="0: none")
ap.add_argument("--half", type=int, default=64)
ap.add_argument("--ptx", help="also write the PTX here")
ap.add_argument("--json", help="append this build's row to the rows of this JSON file (created with the environment)")
ap.add_argument("--vsub", action="store_true", help="V codes as fp16 subnormals (VSUB, session 27)")
ap.add_argument("--cstore", action="store_true", help="the epilogue's stores as whole vectors (CSTORE, session 30)")
ap.add_argument("--nosplit", action="store_true", help="one split: O written directly")
ap.add_argument("--sraw", action="store_true", help="the scales as raw 32-bit loads (SRAW, session 32)")
args = ap.parse_args()

bn, half = 32, args.half
consts = dict(G=4, TQ=1, BLOCK_Q=8, HALF=half, PAGE=64, BLOCK_N=bn, ZERO_POINT=args.zp, HAS_CRS=False, SPLIT=not args.nosplit,
              QK8=2, LV=K._v_load_layout(bn, half), CL=K._copy_layout(half), STAGES=args.stages, PDL=True,
              PROBE=False, STAMP=False, VSUB=args.vsub, CSTORE=args.cstore, SRAW=args.sraw)
sig, consts, attrs = signature(K._decode_kv4_gluon_kernel, kv4_gluon_types(args.zp), consts)
k = triton.compile(GluonASTSource(fn=K._decode_kv4_gluon_kernel, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 1, **({"maxnreg": args.maxnreg} if args.maxnreg else {})})
label = (f"zp {args.zp}, stages {args.stages}, maxnreg {args.maxnreg}, vsub {args.vsub}, "
         f"cstore {args.cstore}, split {not args.nosplit}, sraw {args.sraw}")
row = report(k, dict(mma_e4m3="e4m3.e4m3", mma_s8="s8.s8", mma_f16="f16.f16", cp_async="cp.async.",
                     ld_shared="ld.shared", prmt="prmt", bar_sync="bar.sync", st_global="st.global"),
             label, args.ptx, top=40)
if args.json:
    import json

    rows = json.load(open(args.json))["rows"] if os.path.exists(args.json) else []
    write_json(args.json, rows + [{"variant": label, "argv": " ".join(sys.argv[1:]), **row}], "benchmarks/offline_kv4.py",
               ["<see each row argv>"])
