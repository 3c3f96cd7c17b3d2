"""Offline sm_90a PTX fingerprints of the LUT kernels' launches (no GPU): the register-table kernel (Triton), the
fragment kernel (``mma_config``'s launches, with and without PDL and the SiLU*mul epilogue) and the Gluon kernel, each
compiled for its default constexprs and hashed with the debug lines (``.loc``, ``.file``, ``$L__tmp`` labels, the
debug sections) removed. A refactor that must not change the generated code compares the fingerprints of two trees.

    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_ptx_hash.py [TREE] [--sorted] > a.json   # TREE: a checkout (.)

``--sorted`` hashes the PTX lines sorted: the same instructions in another order (a schedule change) compare equal.

(``/tmp/t36``: the device's Triton 3.6, installed as in ``benchmarks/offline_kv4.py``.) Session 26: the removal of
the 'wide' tables and ``x_perm`` left every fingerprint unchanged, and session 26's SiLU*mul work left every launch
without it unchanged against 59ef336 (``benchmarks/results/offline/ptx_hash_s26.json``).
"""
import hashlib
import json
import os
import re
import sys

SORTED = "--sorted" in sys.argv
_args = [a for a in sys.argv[1:] if a != "--sorted"]
sys.path.insert(0, os.path.abspath(_args[0] if _args else "."))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lowbit.kernels import lut_gemm as LG  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402


def fingerprint(ptx: str) -> str:
    lines = [ln for ln in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:)", ln)]
    ptx = "\n".join(sorted(lines) if SORTED else lines)
    return hashlib.sha1(re.sub(r"\.section\s+\.debug.*", "", ptx, flags=re.S).encode()).hexdigest()[:12]


def build(fn, sig: dict, consts: dict, attrs: dict, opts: dict) -> str:
    """Compile ``fn`` with the constexprs it has (a tree without a flag compiles its default)."""
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    s = {k: v for k, v in sig.items() if k in fn.arg_names} | {k: "constexpr" for k in consts}
    k = triton.compile(ASTSource(fn=fn, signature=s, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    return fingerprint(k.asm["ptx"])


out = {"triton": triton.__version__, "sorted": SORTED}
SIG = {"X": "*bf16", "Q": "*i32", "QH": "*i32", "S": "*bf16", "P": "*bf16", "Y": "*bf16", "WS": "*fp32", "LOCKS": "*i32",
       "M": "i32", "N": "i32", "NRT": "i32", "NC": "i32", "NG": "i32", "GROUPS_PER_SPLIT": "i32", "SPLIT_K": "i32",
       "stride_xm": "i32", "stride_sg": "i32", "stride_ym": "i32", "TAB_OFF": "i32"}
ATTRS = {(i,): [["tt.divisibility", 16]] for i in list(range(8)) + [9, 10, 15, 16, 17]}
# (BLOCK_M, RT, ONE_DOT, SMEM_TAB, BITS, SCALE_W, REG_A, SILU_MUL): the op's configs at 16 / 32 / 64 tokens
for bm, rt, od, st, bits, sw, ra, silu in [(16, 8, False, 1, 4, 0, True, False), (16, 4, True, 1, 4, 0, True, False),
                                           (64, 8, False, 1, 4, 0, True, True), (64, 4, True, 0, 4, 0, True, False),
                                           (32, 4, True, 1, 3, 1, True, False), (64, 8, False, 0, 3, 1, False, False),
                                           (16, 8, False, 0, 4, 0, True, False)]:
    c = {"GROUP": 128, "RT": rt, "BLOCK_M": bm, "USE_SPLIT": True, "EMU": False, "PREFETCH": True, "ONE_DOT": od,
         "BITS": bits, "SCALE_W": sw, "REG_A": ra, "SMEM_TAB": st, "SILU_MUL": silu}
    out[f"wgmma bm{bm} rt{rt} one_dot={od} smem={st} bits{bits} scale_w={sw} reg_a={ra} silu={silu}"] = build(
        LW._lut_wgmma_kernel, SIG, c, ATTRS, {"num_warps": 4, "num_stages": 3})
names = ["X", "Q", "QH", "S", "P", "T", "Y", "WS", "LOCKS", "M", "N", "K", "NRT", "NC", "NG", "GROUPS_PER_SPLIT",
         "SPLIT_K", "stride_xm", "stride_sg", "stride_ym"]
MSIG = dict(zip(names, ["*bf16", "*i32", "*i32", "*bf16", "*i32", "*fp32", "*bf16", "*fp32", "*i32"] + ["i32"] * 11))
MATTRS = {(i,): [["tt.divisibility", 16]] for i in range(9)}
for M, N, K, bits in [(1, 28672, 4096, 4), (4, 4096, 14336, 4), (8, 6144, 4096, 4), (1, 28672, 4096, 3),
                      (12, 4096, 4096, 4)]:
    cfg = LG.mma_config(M, N, K, bits, 128)
    gu = min(int(cfg.get("gu", 1)), 8 // (128 // (64 if bits == 4 else 128)))
    for pdl, silu in ((False, False), (True, False), (False, True)):
        c = dict(BITS=bits, GROUP=128, NT=cfg["nt"], R=cfg["r"], W=cfg["num_warps"], IS_BF16=True, USE_SPLIT=True,
                 INTERPRET=False, PREFETCH=bool(cfg.get("prefetch", False)) and gu == 1 and not cfg.get("ring"),
                 S_BF16=True, GU=gu, XH=int(cfg.get("xh", 0)), RING=int(cfg.get("ring", 0)),
                 RING_BASE=LG.mma_table_bytes(bits) if cfg.get("ring") else 0, SP=bool(cfg.get("sp", False)),
                 PDL=pdl, SILU_MUL=silu)
        out[f"mma M{M} N{N} K{K} bits{bits} pdl={pdl} silu={silu}"] = build(
            LG._lut_mma_kernel, MSIG, c, MATTRS, {"num_warps": cfg["num_warps"], "num_stages": 1})
try:  # the Gluon kernel (its own AST source)
    from triton.experimental.gluon._runtime import GluonASTSource

    from lowbit.kernels import lut_wgmma_gluon as LGL

    GSIG = {k: v for k, v in SIG.items() if k != "QH"}
    GATTRS = {(i,): [["tt.divisibility", 16]] for i in list(range(7)) + [8, 9, 14, 15, 16]}
    for bm, n in ((8, 4096), (16, 6144), (16, 28672)):
        gc = LGL.gluon_config(bm, n)
        consts = {"GROUP": 128, "BLOCK_M": gc["block_m"], "USE_SPLIT": True, "XPF": gc["xpf"],
                  "SMEM_TAB": int(bool(gc.get("smem_table")))}
        k = triton.compile(GluonASTSource(fn=LGL._lut_gluon_kernel, signature=GSIG | {c: "constexpr" for c in consts},
                                          constexprs=consts, attrs=GATTRS),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out[f"gluon bm{bm} N{n}"] = fingerprint(k.asm["ptx"])
except ImportError as exc:  # pragma: no cover - a Triton without Gluon
    out["gluon"] = f"unavailable: {exc}"
print(json.dumps(out, indent=1))
