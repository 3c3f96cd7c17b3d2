"""Offline sm_90a build of the Gluon few-rows FP8 MLA decode kernel (``lowbit.kernels.mla_decode_gluon``) with no GPU:
PTX instruction counts (cp.async, ldmatrix, mma.sync, shared loads / stores, barriers, e4m3 conversions), shared memory,
the registers / spills ptxas reports, and the SASS per block (the loops' lengths, the longest one's opcodes, from the
bundled cuobjdump), for the launcher's default constexprs or those given.

    python3 -m pip download triton==3.6.0 --no-deps -d /tmp/wh && python3 -m pip install --no-deps --target /tmp/t36 /tmp/wh/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_mla_few.py [--stages 3] [--block-n 16] [--maxnreg 0] [--pv16] [--ptx FILE]

Use the device's Triton (3.6) as above: Gluon's API differs between releases (3.9 renamed async_copy_global_to_shared).
The numbers guide which variants to time; they are not a measurement.
"""
import argparse
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lowbit.kernels import mla_decode_gluon as G  # noqa: E402
from benchmarks._offline import report  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--stages", type=int, default=G.STAGES)
ap.add_argument("--pv16", action="store_true")
ap.add_argument("--block-n", type=int, default=G.BLOCK_N)
ap.add_argument("--maxnreg", type=int, default=G.MAXNREG, help="0: none")
ap.add_argument("--no-split", action="store_true", help="one split (output written directly, bf16)")
ap.add_argument("--ptx", help="also write the PTX here")
args = ap.parse_args()

split = not args.no_split
sig = {"QC": "*fp8e4nv", "QR": "*bf16", "QS": "*fp32", "KC": "*fp8e4nv", "KR": "*bf16", "KS": "*fp32", "PT": "*i32",
       "SEQ": "*i32", "O": "*fp32" if split else "*bf16", "LSE": "*fp32", "sm_scale_log2e": "fp32", "H": "i32",
       "SQ": "i32", "ROWS": "i32", "chunk": "i32", "stride_qc": "i32", "stride_qr": "i32", "stride_pt": "i32",
       "stride_o": "i32", "stride_os": "i32", "stride_ls": "i32"}
consts = dict(stride_kc=512, stride_kr=64, DC=512, DR=64, PAGE=64, BLOCK_N=args.block_n, STAGES=args.stages, SPLIT=split,
              PV16=args.pv16, NW=G.NUM_WARPS, CLC=G._copy_layout(512 // G.NUM_WARPS, 16),
              CLR=G._copy_layout(64 // G.NUM_WARPS, 8),
              CLS=G._scale_layout())
sig.update({k: "constexpr" for k in consts})
attrs = {(i,): [["tt.divisibility", 16]] for i in list(range(10)) + [15, 16, 17, 18, 19, 20]}
k = triton.compile(GluonASTSource(fn=G._mla_decode_few_kernel, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": G.NUM_WARPS, **({"maxnreg": args.maxnreg} if args.maxnreg else {})})
report(k, dict(cp_async="cp.async", ldmatrix="ldmatrix", mma_sync="mma.sync", ld_shared="ld.shared",
               st_shared="st.shared", bar_sync="bar.sync", cvt_e4m3="e4m3x2"),
       f"stages {args.stages}, pv16 {args.pv16}, block_n {args.block_n}, maxnreg {args.maxnreg}, split {split}", args.ptx, top=48)
