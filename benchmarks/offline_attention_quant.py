"""Offline sm_90a build (no GPU) of the prefill quantization launch (``kernels.attention_quant._kv_quant_kernel``), INT8
K per token and V per channel, D = 128, 4 warps: registers, the count of ``div.rn.f32`` in the PTX and of the SASS
instructions that implement them (session 36: the IEEE scale quotients; ``foundation`` section).

    PYTHONPATH=<triton 3.6 wheel dir> python3 benchmarks/offline_attention_quant.py [--json PATH]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.getcwd())
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks._offline import PTXAS, assemble, signature  # noqa: E402
from lowbit.kernels import attention_quant as AQ  # noqa: E402

TYPES = {"K": "*bf16", "V": "*bf16", "KC": "*i8", "KS": "*fp32", "VT": "*i8", "VS": "*fp32", "Q": "*bf16",
         "QC": "*i8", "QS": "*fp32", "amax_eps": "fp32"}
CONSTS = dict(HEAD_DIM=128, BLOCK_T=128, V_BLOCK=128, QMAX=127.0, IS_INT8=True, QUANT_V=True, V_CHANNEL=True,
              V_GIVEN=False, K_PER_BLOCK=False, EXACT_FP8=False, QUANT_Q=False, SC_STRIDE=1, VPERM=False,
              NAN_SAFE=False)


def sass_ops(ptx: str) -> Counter:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 8.7", ptx))
        subprocess.run([PTXAS, "-arch=sm_90a", p, "-o", os.path.join(d, "k.cubin")], check=True)
        out = subprocess.run([os.path.join(os.path.dirname(PTXAS), "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stdout
    return Counter(i.split(".")[0] for i in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    sig, c, attrs = signature(AQ._kv_quant_kernel, TYPES, CONSTS)
    k = triton.compile(ASTSource(fn=AQ._kv_quant_kernel, signature=sig, constexprs=c, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    ops = sass_ops(ptx)
    row = assemble(ptx, {"triton": triton.__version__, "kernel": "_kv_quant_kernel", **{k_: str(v) for k_, v in
                                                                                          CONSTS.items()}})
    row.update(ptx_div_rn=ptx.count("div.rn.f32"), ptx_div_full=ptx.count("div.full.f32"),
               sass={op: ops[op] for op in ("FCHK", "CALL", "MUFU", "FFMA", "FMUL")})
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
