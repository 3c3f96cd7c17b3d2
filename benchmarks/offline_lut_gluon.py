"""Offline sm_90a build of the Gluon LUT kernel (``lowbit.kernels.lut_wgmma_gluon``) with no GPU: registers, spills,
shared memory, the wgmma waits in the PTX, ptxas's wgmma-serialization notes (C7514 / C7515: the reason to check) and
the SASS loop's opcodes, per token block.

    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_lut_gluon.py [BLOCK_M ...]   # the device's Triton 3.6
    SMEM_TAB=0,1 PYTHONPATH=/tmp/t36 python3 benchmarks/offline_lut_gluon.py 16   # with smem_table
    (env OUT=FILE.json: also the raw rows)

Session 22 (Triton 3.6, its ptxas): no serialization note; 96 / 133 / 169 / 255 registers at 8 / 16 / 32 / 64 tokens
(64: activation prefetch one chunk ahead, ``XPF = 1``), loop of 565 SASS per group pair at 16 tokens (246 ``PRMT``).
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
from lowbit.kernels import lut_wgmma_gluon as LG  # noqa: E402

SIG = {"X": "*bf16", "Q": "*i32", "S": "*bf16", "P": "*bf16", "Y": "*bf16", "WS": "*fp32", "LOCKS": "*i32",
       "M": "i32", "N": "i32", "NRT": "i32", "NC": "i32", "NG": "i32", "GROUPS_PER_SPLIT": "i32", "SPLIT_K": "i32",
       "stride_xm": "i32", "stride_sg": "i32", "stride_ym": "i32", "TAB_OFF": "i32"}
ATTRS = {(i,): [["tt.divisibility", 16]] for i in list(range(7)) + [8, 9, 14, 15, 16]}

MODES = [int(m) for m in os.environ.get("SMEM_TAB", "0").split(",")]  # 0 byte tables, 1 smem_table
rows = []
for bm, mode in [(int(a), m) for a in (sys.argv[1:] or [8, 16, 32, 64]) for m in MODES]:
    consts = {"GROUP": 128, "BLOCK_M": bm, "USE_SPLIT": True, "XPF": LG.gluon_config(bm)["xpf"], "SMEM_TAB": mode}
    k = triton.compile(GluonASTSource(fn=LG._lut_gluon_kernel, signature=dict(SIG, **{c: "constexpr" for c in consts}),
                                      constexprs=consts, attrs=ATTRS),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    row = assemble(ptx, {"BLOCK_M": bm, "XPF": consts["XPF"], "SMEM_TAB": mode, "shared_B": k.metadata.shared,
                         "wgmma_waits": re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)})
    summ = sass_summary(get_sass(k.asm["cubin"]), top=12)
    row.update(sass_loops=summ["sass_loops"], loop_ops=summ.get("loop_ops"))
    rows.append(row)
    print(row, flush=True)
if os.environ.get("OUT"):  # raw rows as JSON, with the environment
    write_json(os.environ["OUT"], rows, "benchmarks/offline_lut_gluon.py", sys.argv[1:],
               env_vars={"SMEM_TAB": os.environ.get("SMEM_TAB", "0")})
