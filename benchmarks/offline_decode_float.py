"""Offline sm_90a build of the float-cache decode kernel (``lowbit.kernels.decode_float._decode_float_kernel``) with no
GPU: registers, spills, shared memory and the SASS loop, for the plain launch and the session-27 ``APPEND`` /
``FUSE_COMBINE`` forms (Llama-3-8B heads: 4 query rows per KV head, D = 128, the runner's one-page dense cache).

    python3 -m pip download triton==3.6.0 --no-deps -d /tmp/wh && python3 -m pip install --no-deps --target /tmp/t36 /tmp/wh/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_decode_float.py

Session 27 (Triton 3.6): plain 244 / 250 registers (one split / split), no spill; ``APPEND`` 244, ``APPEND`` +
``FUSE_COMBINE`` 250, no spill. A guide for what to time, not a measurement.
"""
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lowbit.kernels import decode_float as DF  # noqa: E402
from benchmarks._offline import report  # noqa: E402

BASE = ["Q", "K", "V", "PT", "LENS", "O", "OP", "MP", "LP"]
BASE_T = ["*bf16"] * 3 + ["*i32", "*i32", "*bf16", "*fp32", "*fp32", "*fp32"]
INTS = ["qk_scale", "SPLIT_LEN", "Hkv", "stride_qb", "stride_qh", "stride_qt", "stride_kp", "stride_kh", "stride_kn",
        "stride_vp", "stride_vh", "stride_vn", "stride_ptb", "stride_ob", "stride_oh", "stride_ot"]
APPEND_INTS = ["NPT", "NPAGES", "stride_knb", "stride_knh", "stride_knt", "stride_vnb", "stride_vnh", "stride_vnt",
               "stride_cb", "stride_ct"]
for append in (False, True):
    for split in (False, True):
        sig = dict(zip(BASE + INTS, BASE_T + ["fp32"] + ["i32"] * 15))
        consts = dict(G=4, TQ=1, BLOCK_M=16, D=128, PAGE=1088, BLOCK_N=DF.DEFAULT_BLOCK_N, SPLIT=split)
        if append:
            sig.update({k: "*bf16" for k in ("KN", "VN", "COS", "SIN")}, **{k: "i32" for k in APPEND_INTS})
            consts.update(APPEND=True, TQ_P2=16, ROW_BF16=True, INTERPRET=False)
        else:
            consts.update({k: None for k in ("KN", "VN", "COS", "SIN")}, **{k: 0 for k in APPEND_INTS})
        if split:
            sig["CNT"] = "*i32"
            consts.update(FUSE_COMBINE=True, SPLITS_P2=16, ROWS_P2=4)
        else:
            consts["CNT"] = None
        sig.update({k: "constexpr" for k in consts})
        k = triton.compile(ASTSource(fn=DF._decode_float_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": DF.DEFAULT_WARPS, "num_stages": DF.DEFAULT_STAGES})
        report(k, dict(ld_global="ld.global", bar_sync="bar.sync", mma="mma", atom="atom."),
               f"append {append}, split {split} (fused combine {split})", None, top=12)
