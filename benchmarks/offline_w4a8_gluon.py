"""Offline sm_90a build of the Gluon W4A8-FP GEMM (``benchmarks/device/w4a8_gluon_kernel.py``, session 28's probe kernel) with no GPU: registers, spills,
shared memory, ptxas's wgmma-serialization notes (C7514 / C7515), the wgmma waits in the PTX and the SASS loop's
opcodes, per launch variant.

    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_w4a8_gluon.py [BLOCK_N:BLOCK_T:STAGES:UNROLL[:GROUP[:PIPE]] ...]
    (env OUT=FILE.json: also the raw rows)
"""
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.tools.disasm import get_sass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._offline import assemble, write_json  # noqa: E402
from lowbit.bench.harness import sass_summary  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "device"))
import w4a8_gluon_kernel as WG  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402


def build(bn, bt, stages, unroll, group=128, pipe=1, bias=False, res=False, split=True):
    c_l = gl.NVMMASharedLayout.get_default_for([bn, 64], gl.uint8)
    x_l = gl.NVMMASharedLayout.get_default_for([bt, 64], gl.float8e4nv)
    sig = {"c_desc": f"tensordesc<u8[{bn}, 64],{c_l}>", "x_desc": f"tensordesc<fp8e4nv[{bt}, 64],{x_l}>",
           "S": "*fp8e4nv", "SX": "*fp32", "Bias": "*bf16", "Res": "*bf16", "Y": "*bf16", "WS": "*fp32",
           "LOCKS": "*i32", "M": "i32", "N": "i32", "NKT": "i32", "PER": "i32", "SPLIT_K": "i32",
           "inv_delta": "fp32", "stride_sn": "i32", "stride_rm": "i32", "stride_ym": "i32"}
    consts = {"GROUP": group, "BLOCK_N": bn, "BLOCK_T": bt, "STAGES": stages, "UNROLL": unroll, "PIPE": pipe, "HAS_BIAS": bias,
              "HAS_RES": res, "USE_SPLIT": split}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (2, 3, 4, 5, 6, 7, 8, 10, 16, 17, 18)}
    return triton.compile(GluonASTSource(fn=WG._w4a8_gluon_kernel, signature=dict(sig, **{c: "constexpr" for c in consts}),
                                         constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": bn // 16})


rows = []
for spec in sys.argv[1:] or ["64:128:4:2", "64:128:4:4", "128:128:4:2", "64:64:4:2"]:
    parts = [int(v) for v in spec.split(":")]
    bn, bt, stages, unroll = parts[:4]
    group = parts[4] if len(parts) > 4 else 128
    pipe = parts[5] if len(parts) > 5 else 1
    k = build(bn, bt, stages, unroll, group, pipe)
    ptx = k.asm["ptx"]
    row = assemble(ptx, {"spec": spec, "shared_B": k.metadata.shared,
                         "wgmma": ptx.count("wgmma.mma_async"),
                         "wgmma_waits": re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)})
    summ = sass_summary(get_sass(k.asm["cubin"]), top=14)
    row.update(sass_loops=summ["sass_loops"], loop_ops=summ.get("loop_ops"))
    rows.append(row)
    print(row, flush=True)
if os.environ.get("OUT"):
    write_json(os.environ["OUT"], rows, "benchmarks/offline_w4a8_gluon.py", sys.argv[1:])
