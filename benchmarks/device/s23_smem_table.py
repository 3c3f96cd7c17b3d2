"""Session-23 probe (issues 4 and 7): the register-table LUT kernel's ``smem_table`` option (the code pairs looked up
in the fragment kernel's lane-duplicated pair table in shared memory, ``lowbit.kernels.lut_wgmma._lds_decode_asm``:
8 integer instructions + 4 ``ld.shared`` per 8 codes instead of the byte tables' 22 integer instructions; offline
sm_90a SASS of the main loop at 16 / 32 / 64 tokens, gate_up: 560 -> 391, 628 -> 457, 738 -> 581) against the
default decode, the committed dispatch and cuBLAS bf16, one run, NF4 g128, Llama-3-8B shapes. (Sessions 23-24 also
ran ``smem_table='wide'``, ``x_perm`` and the fragment kernel's ``wide`` here -- ``S23_MORE=3`` and part ``f`` --
all slower; removed with those options in session 26: the script at 59ef336 has them.)

    PYTHONPATH=$PWD python3 benchmarks/device/s23_smem_table.py --out DIR [--parts ct]   (env S23_MS, S23_NAME,
        S23_BITS=3 for the 3-bit codes; S23_MORE=1, S23_MORE=2: session 24's 2-stage table variants; S23_MORE=4: launch-shape variants around the committed config; S23_MORE=5: the re-shaped config vs the previous;
        S23_MORE=6: register caps for one more resident program per SM (session 25);
        S23_GLUON=1: the Gluon kernel's split target / activation prefetch grid at M <= 16)

Part ``c``: correctness per shape and M: the option's output against the default decode at the same fixed split
(bit-equal expected: same values, same summation order) and rel-L2 to the float64 reference. Part ``t``: CUDA-event medians, weights rotated over 3 sets (> 2x L2 on the large shapes):
cuBLAS, the op, the Triton kernel with each decode (its committed launch config; ``balance`` plans the split from
each variant's own residency), and at M <= 16 the fragment kernel and the Gluon kernel with each decode.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, time_rotated, write_probe  # noqa: E402
from lowbit.bench.suites.lut import gluon_fn, mma_fn, op_fn, probe_cases, reference_f64, wgmma_fn  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402

args = probe_args("ct")
MS = [int(m) for m in os.environ.get("S23_MS", "9,16,32,64,128").split(",")]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096),
          "8192sq": (8192, 8192)}
doc = {"env": env_info(" ".join(sys.argv)), "note": "NF4 g128, bf16; us = median ms * 1000"}
BITS = int(os.environ.get("S23_BITS", "4"))  # 3: the flute-nf3 codes (the table built from the 3-bit pairs)
doc["bits"] = BITS
# the committed decode, the byte tables and the 32 KB table (shift + LOP3 per address). Every variant compiles its
# own kernels (about 2 s each, with the split-K residency build): S23_MORE=1 adds the second-tier ones.
VARIANTS = {"wgmma": {}, "wgmma_nosmem": {"smem_table": False}, "wgmma_smem": {"smem_table": True}}
if os.environ.get("S23_MORE") == "1":
    VARIANTS |= {  # the other committed tile shape (one stacked dot over 4 row tiles / two dots over 8)
                 "wgmma_smem_o4": {"smem_table": True, "rt": 4, "one_dot": True},
                 "wgmma_smem_d8": {"smem_table": True, "rt": 8, "one_dot": False}}
if os.environ.get("S23_MORE") == "2":  # session 24: the table with one activation stage less (33..64 tokens, where
    # the 80 KB of the 3-stage table launch halve the resident programs); "wgmma" is the committed dispatch
    VARIANTS = {"wgmma": {}, "wgmma_nosmem": {"smem_table": False}, "wgmma_smem": {"smem_table": True},
                "wgmma_smem_s2": {"smem_table": True, "num_stages": 2}, "wgmma_nosmem_s2": {"smem_table": False,
                                                                                            "num_stages": 2}}
if os.environ.get("S23_MORE") == "4":  # session 24: the launch shape around the committed config, with the table on
    # (fewer registers at 32 tokens, 95 vs 112, more shared memory): tile, split target, pipeline depth
    VARIANTS = {"wgmma": {}, "wgmma_o4": {"rt": 4, "one_dot": True}, "wgmma_d8": {"rt": 8, "one_dot": False},
                "wgmma_c4": {"ctas_per_sm": 4}, "wgmma_c1": {"ctas_per_sm": 1}, "wgmma_s2": {"num_stages": 2},
                "wgmma_s4": {"num_stages": 4}}
if os.environ.get("S23_MORE") == "5":  # session 24: the re-shaped 16 / 32-token config vs the one before it
    def _prev(M, N, K):  # wgmma_config (4-bit, M <= 32) as committed before s24_shapes.json
        c = dict(rt=8, one_dot=False, ctas_per_sm=2, maxnreg=128 if M <= 16 else None)
        if M <= 16:
            return c
        if N >= 16384:
            return dict(c, ctas_per_sm=4)
        return dict(c, rt=4, one_dot=True) if (N <= 4096 or K >= 8192) else c
    VARIANTS = {"wgmma": {}, "wgmma_prev": _prev}
if os.environ.get("S23_MORE") == "6":  # session 25: register caps for one more resident program per SM (offline sm_90a:
    # 16 tokens 127 -> 96 registers, 36 B spill: 5 programs of 44 KB; 32 tokens o4 117 -> 96, gate_up d8 167 -> 128
    # (72 B spill); 64 tokens o4 195 -> 168 (2 stages + table: 164, no spill, 64 KB: 3 programs instead of 2))
    def _cap(level):
        def f(M, N, K):
            c = LW.wgmma_config(M, N, K, 128, BITS)
            if level == 2 and M <= 32:
                return dict(c, ctas_per_sm=c["ctas_per_sm"] + 1)  # the split target alone
            if M <= 16:
                return dict(c, maxnreg=96, ctas_per_sm=5) if level == 0 else dict(c, rt=4, one_dot=True, maxnreg=96,
                                                                                   ctas_per_sm=5)
            if M <= 32:
                return dict(c, maxnreg=96 if c["one_dot"] else 128, ctas_per_sm=5 if c["one_dot"] else 4) \
                    if level == 0 else dict(c, rt=4, one_dot=True, maxnreg=96, ctas_per_sm=5)
            if level == 0:
                return dict(c, maxnreg=168, ctas_per_sm=3)
            if level == 2:  # byte tables, 2 stages: 161 registers, 32 KB
                return dict(c, rt=4, one_dot=True, smem_table=False, num_stages=2, maxnreg=168, ctas_per_sm=3)
            return dict(c, rt=4, one_dot=True, smem_table=True, num_stages=2, maxnreg=168, ctas_per_sm=3)
        return f
    VARIANTS = {"wgmma": {}, "wgmma_cap": _cap(0), "wgmma_cap_o4": _cap(1), "wgmma_cap_s2": _cap(2)}
# S23_GLUON=1 (session 24, for the next device run): the Gluon kernel's launch knobs with the table, at 8..16 tokens,
# where it leads on qkv / o but trails the Triton kernel on the larger weights (down M = 16 27.1 vs 25.7 us)
GLUON_MORE = {} if os.environ.get("S23_GLUON") != "1" else {
    f"gluon_c{c}_x{x}": {"ctas_per_sm": c, "xpf": x} for c in (2, 4, 8) for x in (1, 2)}


for name, N, K, M, ws, ps, xs in probe_cases(SHAPES, MS, BITS):
    if "c" in args.parts:
        p, x = ps[0], xs[0]
        ref = reference_f64(p, x)
        row = {}
        if M <= 16 and BITS == 4:  # the Gluon kernel's options against its default launch
            row["gluon_smem_bit_equal"] = bool(torch.equal(gluon_fn(p, smem_table=True)(x),
                                                           gluon_fn(p, smem_table=False)(x)))
        for split in (1, 4):
            y0 = wgmma_fn(p, split_k=split, smem_table=False)(x)
            y1 = wgmma_fn(p, split_k=split, smem_table=True)(x)
            torch.cuda.synchronize()
            tag = f"smem_split{split}"
            row[tag + "_bit_equal"] = bool(torch.equal(y0, y1))
            row[tag + "_maxdiff"] = (y0.float() - y1.float()).abs().max().item()
            row[tag + "_rel"] = ((y1.double() - ref).norm() / ref.norm()).item()
        probe_row(doc, f"c_{name}_M{M}", row)
    if "t" in args.parts:
        row = {"M": M, "N": N, "K": K}
        fns = {"cublas": [lambda x, w=w: F.linear(x, w) for w in ws], "op": [op_fn(p) for p in ps]}
        var = {vn: (kw(M, N, K) if callable(kw) else kw) for vn, kw in VARIANTS.items()}
        fns |= {vn: [wgmma_fn(p, **kw) for p in ps] for vn, kw in var.items()}
        if M <= 16:
            fns["fragment"] = [mma_fn(p) for p in ps]
            if BITS == 4:  # the Gluon register-table kernel (the op's 8..16-token launch on qkv / o) and its options
                for gn, gkw in ({"gluon": {}, "gluon_nosmem": {"smem_table": False},
                                 "gluon_smem": {"smem_table": True}} | GLUON_MORE).items():
                    fns[gn] = [gluon_fn(p, **gkw) for p in ps]
        time_rotated(row, fns, xs)
        for vn in VARIANTS:  # the compiled launch of each variant (registers, split, shared bytes)
            try:
                wgmma_fn(ps[0], **var[vn])(xs[0])
                k = LW.LAST_COMPILED["wgmma"]
                row[vn + "_regs"], row[vn + "_split"] = k.n_regs, LW.LAST_COMPILED["wgmma_split"]
                row[vn + "_shared"] = k.packed_metadata[2]
            except Exception as exc:  # (its error is in the timing entry)
                row[vn + "_info_err"] = f"{type(exc).__name__}"
        for vn in VARIANTS:
            if vn != "wgmma" and vn + "_us" in row and "wgmma_us" in row:
                row[vn + "_speedup"] = round(row["wgmma_us"] / row[vn + "_us"], 3)
                row[vn + "_vs_cublas"] = round(row["cublas_us"] / row[vn + "_us"], 3)
        row["op_vs_cublas"] = round(row["cublas_us"] / row["op_us"], 3)
        probe_row(doc, f"t_{name}_M{M}", row)
print(write_probe(doc, args.out, os.environ.get("S23_NAME", "s23_smem_table.json")))
