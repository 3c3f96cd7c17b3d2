"""Offline sm_90 PTX fingerprints of the grouped MoE kernels' decode launches (no GPU; session 41): ``_moe_w4a8_fp8_kernel``,
``_moe_w4a8_int8_kernel`` and ``_moe_lut_kernel`` at the row steps / split-K counts of 1-64 tokens, gathered and
direct rows (int8), compiled for their default constexprs (``SPLIT_M = 1``) with the debug sections removed. Session
41 compared this tree with fd8e006 (``git archive fd8e006 lowbit | tar -x -C T``): all 16 equal after the split-row
form moved into its own helper (``moe_grouped._program_rows``); with the split folded into ``_program`` they differed
and the decode launches ran 15-30 % slower on the H200 (``benchmarks/results/h200/s41_ab_block_*.json``).

    python3 benchmarks/offline_ptx_hash_moe.py TREE OUT.json     # prints one "name lines sha1" row per launch
"""
import os, sys, re, hashlib
tree = os.path.abspath(sys.argv[1]); sys.path.insert(0, tree)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lowbit.kernels import moe_grouped as MG

def build(fn, sig, consts, opts):
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    s = {k: v for k, v in sig.items() if k in fn.arg_names} | {k: "constexpr" for k in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in sig and sig[n].startswith("*")}
    k = triton.compile(ASTSource(fn=fn, signature=s, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    return k.asm["ptx"]
fp8sig = {"A": "*fp8e4nv", "Sx": "*fp32", "RowMap": "*i32", "Offsets": "*i32", "CodePtrs": "*i64", "ScalePtrs": "*i64",
          "InvDelta": "*fp32", "C": "*bf16", "Ws": "*fp32", "N": "i32", "K": "i32", "R": "i32", "stride_am": "i32",
          "stride_bn": "i32", "stride_sn": "i32", "stride_cm": "i32"}
lutsig = {"A": "*bf16", "RowMap": "*i32", "Offsets": "*i32", "QPtrs": "*i64", "QHPtrs": "*i64", "SPtrs": "*i64", "PPtrs": "*i64",
          "C": "*bf16", "Ws": "*fp32", "N": "i32", "K": "i32", "R": "i32", "NRT": "i32", "NC": "i32", "NG": "i32",
          "stride_am": "i32", "stride_sg": "i32", "stride_cm": "i32", "TAB_OFF": "i32"}
int8sig = {"A": "*i8", "Sx": "*fp32", "RowMap": "*i32", "Offsets": "*i32", "CodePtrs": "*i64", "S1Ptrs": "*i64",
           "S2Ptrs": "*i64", "ZsPtrs": "*i64", "C": "*bf16", "Ws": "*fp32", "N": "i32", "K": "i32", "R": "i32", "KP": "i32",
           "stride_am": "i32", "stride_wn": "i32", "stride_gn": "i32", "stride_cm": "i32"}
out = {}
for bm, sk in [(16, 4), (16, 1), (32, 2), (64, 1)]:
    for g in (True, False):
        c = dict(GROUP_SIZE=128, BLOCK_M=bm, BLOCK_N=128, SPLIT_K=sk, GATHER=g, TILED=True, USE_ASM=True, SPLIT_M=1)
        out[f"int8 bm{bm} sk{sk} g{g}"] = build(MG._moe_w4a8_int8_kernel, int8sig, c, {"num_warps": 4, "num_stages": 4})
    c = dict(GROUP=128, BLOCK_M=bm, BLOCK_N=128, SPLIT_K=sk, GATHER=True, LUT=True, SWORD=True, SPLIT_M=1)
    out[f"fp8 bm{bm} sk{sk}"] = build(MG._moe_w4a8_fp8_kernel, fp8sig, c, {"num_warps": 4, "num_stages": 4})
    c = dict(GROUP=128, BITS=4, BLOCK_M=bm, SPLIT_K=sk, GATHER=True, EMU=False, PREFETCH=True, SMEM_TAB=1, SPLIT_M=1)
    out[f"lut bm{bm} sk{sk}"] = build(MG._moe_lut_kernel, lutsig, c, {"num_warps": 4, "num_stages": 2})
import json
def clean(p): return [l for l in p.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:)", l)]
def code(p):
    return p.split(".section\t.debug")[0].split(".section .debug")[0]
json.dump({k: clean(code(v)) for k, v in out.items()}, open(sys.argv[2], "w"))
for k, v in out.items():
    body = clean(code(v)); print(k, len(body), hashlib.sha1("\n".join(body).encode()).hexdigest()[:10])
