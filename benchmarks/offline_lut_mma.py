"""Offline sm_90a build of the LUT fragment kernel (``lowbit.kernels.lut_gemm._lut_mma_kernel``) with no GPU:
registers / spills (ptxas), PTX counts and the SASS of its loop (lengths, opcodes; bundled cuobjdump) for the M = 1
4-bit g128 config of ``mma_config`` or the options given.

    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_lut_mma.py [--r 2] [--warps 8] [--prefetch]
        [--gu 1] [--nt 1] [--xh 0] [--ring 0] [--sass FILE]

(``/tmp/t36``: the device's Triton 3.6, installed as in ``benchmarks/offline_kv4.py``.) A guide to which variants to
time, not a measurement.
"""
import argparse
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lowbit.kernels import lut_gemm as L  # noqa: E402
from benchmarks._offline import report, write_json  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--r", type=int, default=2)
ap.add_argument("--warps", type=int, default=8)
ap.add_argument("--gu", type=int, default=1)
ap.add_argument("--prefetch", action="store_true")
ap.add_argument("--nt", type=int, default=1, help="n-tiles of 8 tokens (M = 9..16: 2)")
ap.add_argument("--xh", type=int, default=0)
ap.add_argument("--ring", type=int, default=0)
ap.add_argument("--sass", help="write the SASS here")
ap.add_argument("--out", help="append the row (with the options) to this JSON file's rows")
args = ap.parse_args()

names = ["X", "Q", "QH", "S", "P", "T", "Y", "WS", "LOCKS", "M", "N", "K", "NRT", "NC", "NG", "GROUPS_PER_SPLIT",
         "SPLIT_K", "stride_xm", "stride_sg", "stride_ym"]
types = ["*bf16", "*i32", "*i32", "*bf16", "*i32", "*fp32", "*bf16", "*fp32", "*i32"] + ["i32"] * 11
sig = dict(zip(names, types))
consts = dict(BITS=4, GROUP=128, NT=args.nt, R=args.r, W=args.warps, IS_BF16=True, USE_SPLIT=True, INTERPRET=False,
              PREFETCH=args.prefetch, S_BF16=True, GU=args.gu, XH=args.xh, RING=args.ring,
              RING_BASE=L.mma_table_bytes(4) if args.ring else 0, SP=False, PDL=False)

sig.update({k: "constexpr" for k in consts})
attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}
k = triton.compile(ASTSource(fn=L._lut_mma_kernel, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": args.warps, "num_stages": 1})
row = report(k, dict(ld_global="ld.global", ld_shared="ld.shared", mma="mma.sync", bar="bar.sync"),
       f"r {args.r}, warps {args.warps}, gu {args.gu}, prefetch {args.prefetch}, nt {args.nt}, xh {args.xh}, "
       f"ring {args.ring}",
       top=30)
if args.out:  # one file collects the variants (each run appends its row)
    import json

    prev = json.load(open(args.out))["rows"] if os.path.exists(args.out) else []
    write_json(args.out, prev + [dict(row, options=vars(args))], "benchmarks/offline_lut_mma.py", sys.argv[1:])
if args.sass:
    from triton.tools.disasm import get_sass

    with open(args.sass, "w") as f:
        f.write(get_sass(k.asm["cubin"]))
