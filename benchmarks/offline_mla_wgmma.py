"""Offline sm_90a build of the warp-specialized Gluon bf16 MLA decode kernel (``lowbit.kernels.mla_decode_wgmma``) with no GPU:
PTX counts (wgmma, TMA copies, barriers, mbarrier waits), shared memory, registers / spills from ptxas and the SASS per block (the
loops' lengths and opcodes, bundled cuobjdump).

    python3 -m pip download triton==3.6.0 --no-deps -d /tmp/wh && python3 -m pip install --no-deps --target /tmp/t36 /tmp/wh/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_mla_wgmma.py [--fp8] [--no-split] [--pv-regs 192] [--maxnreg 168] [--ptx FILE]

The numbers guide which variants to time; they are not a measurement.
"""
import argparse
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lowbit.kernels import mla_decode_wgmma as W  # noqa: E402
from benchmarks._offline import report  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--no-split", action="store_true", help="one split (output written directly, bf16)")
ap.add_argument("--fp8", action="store_true", help="the SnapMLA FP8 form")
ap.add_argument("--pv-regs", type=int, default=W.WS_PV_REGS)
ap.add_argument("--maxnreg", type=int, default=W.WS_MAXNREG)
ap.add_argument("--stages", type=int, default=W.FP8_STAGES, help="FP8: TMA ring depth")
ap.add_argument("--ptx", help="also write the PTX here")
args = ap.parse_args()

split = not args.no_split
host = torch.empty(4096, 576, dtype=torch.bfloat16)  # a CPU tensor stands in for the cache: only the types matter


def desc(cols, block_rows, dt=torch.bfloat16, gdt=gl.bfloat16):
    lay = gl.NVMMASharedLayout.get_default_for([block_rows, cols], gdt)
    t = host.to(dt) if dt != torch.bfloat16 else host
    return mangle_type(TensorDescriptor(t, [4096, cols], [576, 1], [block_rows, cols], lay))


f8 = (torch.float8_e4m3fn, gl.float8e4nv)
sig = {"qc_desc": desc(512, W.BM, *f8) if args.fp8 else desc(512, W.BM), "qr_desc": desc(64, W.BM),
       "kc_desc": desc(512, W.BN, *f8) if args.fp8 else desc(512, W.BN), "kr_desc": desc(64, W.BN)}
if args.fp8:
    ks = torch.empty(64, 64, dtype=torch.float32)
    sig["ks_desc"] = mangle_type(TensorDescriptor(ks, [64, 64], [64, 1], [1, 64],
                                                  gl.NVMMASharedLayout.get_default_for([1, 64], gl.float32)))
    sig["QS"] = "*fp32"
sig.update({"PT": "*i32", "SEQ": "*i32", "O": "*fp32" if split else "*bf16", "LSE": "*fp32", "sm_scale_log2e": "fp32",
            "H": "i32", "SQ": "i32", "ROWS": "i32", "chunk": "i32", "stride_pt": "i32", "stride_o": "i32",
            "stride_os": "i32", "stride_ls": "i32"})
consts = dict(DC=512, DR=64, PAGE=64, SPLIT=split, PV_REGS=args.pv_regs)
if args.fp8:
    consts["STAGES"] = args.stages
fn, opts = (W._mla_ws_fp8_kernel if args.fp8 else W._mla_ws_kernel), {"num_warps": 4, "maxnreg": args.maxnreg}
sig.update({k: "constexpr" for k in consts})
first = 6 if args.fp8 else 4  # pointer arguments after the descriptors
attrs = {(i,): [["tt.divisibility", 16]] for i in list(range(first, first + 4)) + [first + 9 + k for k in range(4)]}
k = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=opts)
print("tensordesc_meta", getattr(k.metadata, "tensordesc_meta", None))
report(k, dict(wgmma="wgmma.mma_async", tma="cp.async.bulk.tensor", bar_sync="bar.sync", mbar_wait="mbarrier.try_wait",
               st_shared="st.shared", ld_shared="ld.shared"),
       f"fp8 {args.fp8}, split {split}, pv_regs {args.pv_regs}, maxnreg {args.maxnreg}", args.ptx, top=48)
