"""Offline PTX fingerprints (sm_90a, Triton 3.6, no GPU) of the decode-side kernels: the RoPE kernel, the KV append
(float pages and KV4), the float-cache decode (plain / APPEND x split with the fused combine) and the Gluon KV4
decode (signed / zero-point x VSUB). Each row: the PTX hash without debug lines, then the hash of its opcode counts
(equal counts with a different PTX hash = the same instructions reordered / renumbered). Session 27's review mend
used it to show that its refactors left the kernels unchanged (``benchmarks/results/offline/ptx_hash_s27_mend.json``).

    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_ptx_hash_decode.py $PWD > OUT.json
"""
import collections
import hashlib
import json
import re
import sys

sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from lowbit.kernels import decode_float as DF, kv4_append as KA, rope as RO, decode_kv4 as K
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _offline import kv4_gluon_types, signature

def h(k):
    lines = [ln for ln in k.asm["ptx"].splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:)", ln)]
    txt = re.sub(r"\.section\s+\.debug.*", "", "\n".join(lines), flags=re.S)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"^\s+([a-z][a-z0-9._]+)", txt, flags=re.M))
    return hashlib.sha1(txt.encode()).hexdigest()[:12] + " ops " + hashlib.sha1(str(sorted(ops.items())).encode()).hexdigest()[:12]

T = GPUTarget("cuda", 90, 32)
out = {}
# rope kernel
sig = dict(X="*bf16", COS="*bf16", SIN="*bf16", OUT="*bf16", S="i32", H="i32", **{k: "i32" for k in
      ["stride_xb", "stride_xs", "stride_xh", "stride_cb", "stride_cs", "stride_ob", "stride_os", "stride_oh"]})
c = dict(D=128, BLOCK_H=8, BF16=True, INTERPRET=False, PDL=False); sig.update({k: "constexpr" for k in c})
out["rope"] = h(triton.compile(ASTSource(fn=RO._rope_kernel, signature=sig, constexprs=c), target=T, options={"num_warps": 4}))
# kv4_append float + rope + rope_q; and kv4 path
names = ["K","V","COS","SIN","CRSK","PT","START","KC","KS","KZ","VC","VS","VZ","Q","QO","T","NPT","NPAGES",
 "stride_kb","stride_kh","stride_kt","stride_vb","stride_vh","stride_vt","stride_cb","stride_ct","stride_ptb",
 "stride_cp","stride_ch","stride_cn","stride_sp","stride_sh","stride_qb","stride_qh","stride_qt","stride_ob","stride_oh","stride_ot"]
for fl in (True, False):
    types = ["*bf16"]*5+["*i32","*i32"]+(["*bf16"]*6 if fl else ["*u8","*fp8e4nv","*fp8e4nv","*u8","*fp8e4nv","*fp8e4nv"])+["*bf16","*bf16"]+["i32"]*23
    sig = dict(zip(names, types))
    c = dict(HALF=64, PAGE=64, ROPE=True, INTERLEAVED=False, HAS_CRS=False, ZERO_POINT=False, SCALE_KIND=0 if fl else 1,
             ROPE_Q=True, G=4, ROW_BF16=True, INTERPRET=False, FLOAT=fl)
    sig.update({k: "constexpr" for k in c})
    out[f"kv4_append_float{fl}"] = h(triton.compile(ASTSource(fn=KA._kv4_append_kernel, signature=sig, constexprs=c), target=T, options={"num_warps": 4}))
# decode_float forms
base = ["Q","K","V","PT","LENS","O","OP","MP","LP"]; bt = ["*bf16"]*3+["*i32","*i32","*bf16","*fp32","*fp32","*fp32"]
ints = ["qk_scale","SPLIT_LEN","Hkv","stride_qb","stride_qh","stride_qt","stride_kp","stride_kh","stride_kn","stride_vp","stride_vh","stride_vn","stride_ptb","stride_ob","stride_oh","stride_ot"]
ai = ["NPT","NPAGES","stride_knb","stride_knh","stride_knt","stride_vnb","stride_vnh","stride_vnt","stride_cb","stride_ct"]
for app in (False, True):
    for sp in (False, True):
        sig = dict(zip(base+ints, bt+["fp32"]+["i32"]*15))
        c = dict(G=4, TQ=1, BLOCK_M=16, D=128, PAGE=1088, BLOCK_N=64, SPLIT=sp)
        if app:
            sig.update({k: "*bf16" for k in ("KN","VN","COS","SIN")}, **{k: "i32" for k in ai}); c.update(APPEND=True, TQ_P2=16, ROW_BF16=True, INTERPRET=False)
        else:
            c.update({k: None for k in ("KN","VN","COS","SIN")}, **{k: 0 for k in ai})
        if sp:
            sig["CNT"] = "*i32"; c.update(FUSE_COMBINE=True, SPLITS_P2=16, ROWS_P2=4)
        else:
            c["CNT"] = None
        sig.update({k: "constexpr" for k in c})
        out[f"decode_float_app{app}_split{sp}"] = h(triton.compile(ASTSource(fn=DF._decode_float_kernel, signature=sig, constexprs=c), target=T, options={"num_warps": 4, "num_stages": 3}))
# gluon kv4 decode
for zp in (False, True):
    for vs in (False, True):
        c = dict(G=4, TQ=1, BLOCK_Q=8, HALF=64, PAGE=64, BLOCK_N=32, ZERO_POINT=zp, HAS_CRS=False, SPLIT=True, QK8=2,
                 LV=K._v_load_layout(32, 64), CL=K._copy_layout(64), STAGES=2, PDL=True, PROBE=False, STAMP=False,
                 VSUB=vs)
        sig, c, attrs = signature(K._decode_kv4_gluon_kernel, kv4_gluon_types(zp), c)
        out[f"gluon_kv4_zp{zp}_vsub{vs}"] = h(triton.compile(GluonASTSource(fn=K._decode_kv4_gluon_kernel, signature=sig, constexprs=c, attrs=attrs), target=T, options={"num_warps": 1, "maxnreg": 128}))
print(json.dumps(out, indent=1))
