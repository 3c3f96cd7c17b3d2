"""Offline sm_90a build of the register-table LUT kernel with no GPU: registers, spills, shared memory and the wgmma
waits of each launch variant, from Triton's PTX assembled by the ptxas bundled with Triton; ``ldmatrix`` /
``bar.sync`` counts show whether the decoded tile goes through shared memory (it does not with ``REG_A``). (Session
13's ``--kernel mma`` mode, the fragment kernel's ``prmt`` option, left with that option in session 14; its outputs
stay in ``benchmarks/results/offline/lut_mma_prmt_bits{4,3}_s13.json``.)

    python3 benchmarks/offline_ptx.py [--bm 64] [--rt 8] [--bits 4] [--out FILE.json]
    PYTHONPATH=/tmp/t36 python3 benchmarks/offline_ptx.py --decode --bm 16   # byte tables vs smem_table (session 23)

``--decode`` builds only the op's 4-bit launches (``wgmma_config``) at ``--bm`` tokens with each decode and adds the
SASS main loop's length and opcodes (session 23: 560 -> 391 SASS per loop at 16 tokens with ``smem_table``).

What the device's Triton 3.6 + ptxas emit can differ from this machine's Triton: the numbers are a guide for which
variants to time, not a measurement (session 12: 239 registers offline vs 239 on the H100 for the default at 64
tokens, 120 vs 123 at 16). The PTX's ``.version`` line is lowered to what the bundled ptxas reads when it is newer.
"""
import argparse
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lowbit.kernels import lut_wgmma as LW  # noqa: E402
from benchmarks._offline import assemble, write_json  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--bm", type=int, default=64, help="tokens per program (BLOCK_M)")
ap.add_argument("--rt", type=int, default=8, help="16-row tiles per program")
ap.add_argument("--bits", type=int, default=4)
ap.add_argument("--stages", type=int, default=3)
ap.add_argument("--out", help="also write the rows as JSON (with versions and the command)")
ap.add_argument("--decode", action="store_true",
                help="only the op's 4-bit launches (wgmma_config at --bm tokens, two dots rt 8 / one dot rt 4, reg_a) "
                     "with the byte-table decode vs smem_table (SMEM_TAB 1), with the SASS loop's "
                     "opcodes")
ap.add_argument("--caps", default="",
                help="with --decode: also build the byte-table and smem_table launches under these register caps (comma list; "
                     "session 25: a fifth program per SM needs <= 102 registers)")
args = ap.parse_args()

SIG = {"X": "*bf16", "Q": "*i32", "QH": "*i32", "S": "*bf16", "P": "*bf16", "Y": "*bf16", "WS": "*fp32", "LOCKS": "*i32",
       "M": "i32", "N": "i32", "NRT": "i32", "NC": "i32", "NG": "i32", "GROUPS_PER_SPLIT": "i32", "SPLIT_K": "i32",
       "stride_xm": "i32", "stride_sg": "i32", "stride_ym": "i32", "TAB_OFF": "i32"}
# pointers and the strides / N divisible by 16, as Triton specializes them for the Llama shapes
ATTRS = {(i,): [["tt.divisibility", 16]] for i in list(range(8)) + [9, 10, 15, 16, 17]}


def build(one_dot: bool, scale_w: int, rt: int, reg_a: bool = False, smem_tab: int = 0, maxnreg=None) -> dict:
    consts = {"GROUP": 128, "RT": rt, "BLOCK_M": args.bm, "USE_SPLIT": True, "EMU": False, "PREFETCH": True,
              "ONE_DOT": one_dot, "BITS": args.bits, "SCALE_W": scale_w,
              "REG_A": reg_a, "SMEM_TAB": smem_tab}
    sig = dict(SIG, **{k: "constexpr" for k in consts})
    opts = {"num_warps": 4, "num_stages": args.stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(ASTSource(fn=LW._lut_wgmma_kernel, signature=sig, constexprs=consts, attrs=ATTRS),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    row = {"shared_B": k.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
           "waits": re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx), "cp.async": ptx.count("cp.async.cg"),
           "prmt": ptx.count("prmt.b32"), "ld.shared.b32": ptx.count("ld.shared.b32"),
           "ldmatrix": ptx.count("ldmatrix"), "bar.sync": ptx.count("bar.sync")}
    if args.decode:  # the SASS main loop (cuobjdump bundled with Triton)
        from triton.tools.disasm import get_sass

        from lowbit.bench.harness import sass_summary

        row.update(sass_summary(get_sass(k.asm["cubin"]), top=16))
        row.pop("sass_top", None)
    return assemble(ptx, row)


rows = {}
if args.decode:  # the op's configs at this token count (wgmma_config, --bits), default decode vs SMEM_TAB
    from lowbit.kernels.lut_wgmma import wgmma_config

    for shape, (n, kk) in {"gate_up": (28672, 4096), "down": (4096, 14336)}.items():
        cfg = wgmma_config(args.bm, n, kk, 128, args.bits)
        rt, one_dot, sw = cfg["rt"], cfg["one_dot"], int(cfg["scale_w"])
        reg_a = cfg["reg_a"] == "auto" and rt * (16 if one_dot else 8) == 64
        # (the 'wide' table and x_perm rows of sessions 23-24 went with those options in session 26)
        for st in (0, 1):
            name = f"{shape} rt{rt} {'one_dot' if one_dot else 'two dots'} " + ["byte tables", "smem_table"][st]
            rows[name] = build(one_dot, sw, rt, reg_a, st, cfg.get("maxnreg"))
            print(f"{name:40s}", {k: rows[name][k] for k in ("regs", "spill_B", "shared_B", "serialized",
                                                              "sass_loops")}, flush=True)
        for cap, st in ((int(c), st) for c in args.caps.split(",") if c for st in (0, 1)):
            name = f"{shape} rt{rt} {'one_dot' if one_dot else 'two dots'} {['byte tables', 'smem_table'][st]} " \
                   f"maxnreg {cap}"
            rows[name] = build(one_dot, sw, rt, reg_a, st, cap)
            print(f"{name:40s}", {k: rows[name][k] for k in ("regs", "spill_B", "shared_B", "serialized",
                                                              "sass_loops")}, flush=True)
for one_dot, rt in (() if args.decode else ((False, args.rt), (True, args.rt // 2))):
    for sw in (0, 1, 2):
        for reg_a in (False, True):  # REG_A: 4-bit, 64-row tiles, not with the 'asm' scaling
            if reg_a and (args.bits != 4 or rt * (16 if one_dot else 8) != 64 or sw == 2):
                continue
            name = (f"{'one_dot rt' if one_dot else 'two dots rt'}{rt} scale_w={['off', 'on', 'asm'][sw]}"
                    + (" reg_a" if reg_a else ""))
            rows[name] = build(one_dot, sw, rt, reg_a)
            print(f"{name:40s}", rows[name], flush=True)
if args.out:
    write_json(args.out, rows, "benchmarks/offline_ptx.py", sys.argv[1:], config=vars(args))
