"""Session-23 probe (issues 4 and 7): the register-table LUT kernel's ``smem_table`` option (the code pairs looked up
in the fragment kernel's lane-duplicated pair table in shared memory, ``lowbit.kernels.lut_wgmma._lds_decode_asm``:
8 integer instructions + 4 ``ld.shared`` per 8 codes instead of the byte tables' 22 integer instructions; offline
sm_90a SASS of the main loop at 16 / 32 / 64 tokens, gate_up: 560 -> 391, 628 -> 457, 738 -> 581) against the
default decode, the committed dispatch and cuBLAS bf16, one run, NF4 g128, Llama-3-8B shapes; ``smem_table='wide'``
(64 KB, one ``prmt`` per address: 335 / 390 / 518 SASS at 16 / 32 / 64 tokens) beside it.

    PYTHONPATH=$PWD python3 benchmarks/device/s23_smem_table.py --out DIR [--parts ctf]   (env S23_MS, S23_NAME,
        S23_BITS=3 for the 3-bit codes: parts c / t, the fragment kernel's wide table is 4-bit only; S23_MORE=1,
        S23_MORE=2: session 24's 2-stage table variants; S23_MORE=3: x handed over already permuted, x_perm='given';
        S23_MORE=4: launch-shape variants around the committed config; S23_MORE=5: the re-shaped config vs the previous;
        S23_MORE=6: register caps for one more resident program per SM (session 25);
        S23_GLUON=1: the Gluon kernel's split target / activation prefetch grid at M <= 16)

Part ``c``: correctness per shape and M: the option's output against the default decode at the same fixed split
(bit-equal expected: same values, same summation order; the 4-way split rows with ``x_perm`` as well) and rel-L2 to
the float64 reference. Part ``t``: CUDA-event medians, weights rotated over 3 sets (> 2x L2 on the large shapes):
cuBLAS, the op, the Triton kernel with each decode (its committed launch config; ``balance`` plans the split from
each variant's own residency), and at M <= 16 the fragment kernel and the Gluon kernel with each decode. Part ``f``
(run when named): the fragment kernel's committed launches at 1 / 4 / 8 / 16 tokens with its 32 KB table vs
``wide=True`` (64 KB, one ``prmt`` per lookup address; offline SASS per loop at M = 1 278 -> 213, 78 -> 64
registers; the 16-token ``pf`` launch 198 -> 166), bit-equality checked per row.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from lowbit.bench import peers  # noqa: E402
from lowbit.bench.harness import env_info, probe_args, probe_row, time_rotated, write_probe  # noqa: E402
from lowbit.bench.suites.lut import mma_fn, probe_cases, reference_f64  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402
from lowbit.kernels import lut_wgmma_gluon as LGL  # noqa: E402
from lowbit.ops.lut import lut_gemm  # noqa: E402

args = probe_args("ct")
MS = [int(m) for m in os.environ.get("S23_MS", "9,16,32,64,128").split(",")]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096),
          "8192sq": (8192, 8192)}
doc = {"env": env_info(" ".join(sys.argv)), "note": "NF4 g128, bf16; us = median ms * 1000"}
BITS = int(os.environ.get("S23_BITS", "4"))  # 3: the flute-nf3 codes (the table built from the 3-bit pairs)
doc["bits"] = BITS
# the committed decode, the 32 KB table (shift + LOP3 per address), the 64 KB one (one prmt per address; 2 programs
# per SM by shared memory at 16-32 tokens), each also with x copied into the relabelled column order first (one
# permute copy per call, timed with the GEMM). Every variant compiles its own kernels (about 2 s each, with the
# split-K residency build): S23_MORE=1 adds the second-tier ones.
VARIANTS = {"wgmma": {}, "wgmma_smem": {"smem_table": True}, "wgmma_wide": {"smem_table": "wide"},
            "wgmma_smem_xperm": {"smem_table": True, "x_perm": True},
            "wgmma_wide_xperm": {"smem_table": "wide", "x_perm": True}}
if os.environ.get("S23_MORE") == "1":
    VARIANTS |= {"wgmma_wide_s2": {"smem_table": "wide", "num_stages": 2},  # one activation stage less (-4..16 KB)
                 # the other committed tile shape (one stacked dot over 4 row tiles / two dots over 8)
                 "wgmma_smem_o4": {"smem_table": True, "rt": 4, "one_dot": True},
                 "wgmma_smem_d8": {"smem_table": True, "rt": 8, "one_dot": False},
                 "wgmma_xperm": {"x_perm": True}}
if os.environ.get("S23_MORE") == "2":  # session 24: the table with one activation stage less (33..64 tokens, where
    # the 80 KB of the 3-stage table launch halve the resident programs); "wgmma" is the committed dispatch
    VARIANTS = {"wgmma": {}, "wgmma_nosmem": {"smem_table": False}, "wgmma_smem": {"smem_table": True},
                "wgmma_smem_s2": {"smem_table": True, "num_stages": 2}, "wgmma_nosmem_s2": {"smem_table": False,
                                                                                            "num_stages": 2}}
if os.environ.get("S23_MORE") == "3":  # session 24: x already in the relabelled order (x_perm='given': what a producer
    # kernel writing that order would hand over; the permute copy is outside the timing), with each table
    VARIANTS = {"wgmma": {}, "wgmma_xperm": {"x_perm": True}, "wgmma_xgiven": {"x_perm": "given"},
                "wgmma_nosmem_xgiven": {"smem_table": False, "x_perm": "given"},
                "wgmma_smem_xgiven": {"smem_table": True, "x_perm": "given"},
                "wgmma_wide_xgiven": {"smem_table": "wide", "x_perm": "given"}}
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
if BITS == 3:  # 3-bit above 32 tokens runs without reg_a (so without x_perm); offline, reg_a + 'wide' + x_perm also
    # removes the wgmma serialization (C7515) of the committed split-K 64-token config: 849 -> 642 SASS per chunk
    VARIANTS["wgmma_wide_xperm_rega"] = {"smem_table": "wide", "x_perm": True, "reg_a": True}




def op(p):
    return lambda x: lut_gemm(x, p["qmma"], p["qmma_hi"], p["scales"], p["table"], bits=p["bits"], group_size=128,
                              layout="mma")


_XP: dict = {}  # x_perm='given': each activation set's permuted copy, made once (outside the timing)


def tri(p, **kw):
    N = p["scales"].shape[1]
    f = lambda x: LW.lut_wgmma_triton(x, p["qmma"], p["scales"], p["pairs"], group_size=128,  # noqa: E731
                                      out_features=N, bits=p["bits"], qweight_hi=p["qmma_hi"], **kw)
    if kw.get("x_perm") != "given":
        return f
    ck = LW.MMA_CHUNK[p["bits"]]
    return lambda x: f(_XP.setdefault(id(x), (x, LW.permute_x(x, ck)))[1])


def glu(p, **kw):
    N = p["scales"].shape[1]
    return lambda x: LGL.lut_wgmma_gluon(x, p["qmma"], p["scales"], p["pairs"], group_size=128, out_features=N, **kw)


for name, N, K, M, ws, ps, xs in probe_cases(SHAPES, MS, BITS):
    if "c" in args.parts:
        p, x = ps[0], xs[0]
        ref = reference_f64(p, x)
        row = {}
        if M <= 16 and BITS == 4:  # the Gluon kernel's options against its default launch
            yg = glu(p)(x)
            for mode in (True, "wide"):
                row[f"gluon_{'wide' if mode == 'wide' else 'smem'}_bit_equal"] = bool(
                    torch.equal(glu(p, smem_table=mode)(x), yg))
        for split in (1, 4):
            y0 = tri(p, split_k=split)(x)
            for mode in (True, "wide"):
                y1 = tri(p, split_k=split, smem_table=mode, x_perm=split == 4)(x)
                torch.cuda.synchronize()
                tag = f"{'wide' if mode == 'wide' else 'smem'}_split{split}"
                row[tag + "_bit_equal"] = bool(torch.equal(y0, y1))
                row[tag + "_maxdiff"] = (y0.float() - y1.float()).abs().max().item()
                row[tag + "_rel"] = ((y1.double() - ref).norm() / ref.norm()).item()
        probe_row(doc, f"c_{name}_M{M}", row)
    if "t" in args.parts:
        row = {"M": M, "N": N, "K": K}
        fns = {"cublas": [lambda x, w=w: F.linear(x, w) for w in ws], "op": [op(p) for p in ps]}
        var = {vn: (kw(M, N, K) if callable(kw) else kw) for vn, kw in VARIANTS.items()}
        fns |= {vn: [tri(p, **kw) for p in ps] for vn, kw in var.items()}
        if M <= 16:
            fns["fragment"] = [mma_fn(p) for p in ps]
            if BITS == 4:  # the Gluon register-table kernel (the op's 8..16-token launch on qkv / o) and its options
                for gn, gkw in ({"gluon": {}, "gluon_smem": {"smem_table": True},
                                 "gluon_wide": {"smem_table": "wide"}} | GLUON_MORE).items():
                    fns[gn] = [glu(p, **gkw) for p in ps]
        time_rotated(row, fns, xs)
        for vn in VARIANTS:  # the compiled launch of each variant (registers, split, shared bytes)
            try:
                tri(ps[0], **var[vn])(xs[0])
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
if "f" in args.parts:  # the fragment kernel's committed launches at 1..16 tokens, default table vs ``wide``
    for name, N, K, M, ws, ps, xs in probe_cases(SHAPES, (1, 4, 8, 16), BITS):
        y0, y1 = mma_fn(ps[0])(xs[0]), mma_fn(ps[0], wide=True)(xs[0])
        row = {"M": M, "N": N, "K": K, "wide_bit_equal": bool(torch.equal(y0, y1))}
        fns = {"cublas": [lambda x, w=w: F.linear(x, w) for w in ws], "op": [op(p) for p in ps],
               "fragment": [mma_fn(p) for p in ps], "fragment_wide": [mma_fn(p, wide=True) for p in ps]}
        try:  # issue 4's M = 1 peer (>= 1.3x torch int4 tinygemm)
            fns["tinygemm"] = [peers.tinygemm_int4(w) for w in ws]
        except peers.PeerUnavailable as exc:
            row["tinygemm_err"] = str(exc)[:200]
        time_rotated(row, fns, xs)
        if "fragment_wide_us" in row and "fragment_us" in row:
            row["wide_speedup"] = round(row["fragment_us"] / row["fragment_wide_us"], 3)
        for fn_name in ("op", "fragment", "fragment_wide"):
            if "tinygemm_us" in row and fn_name + "_us" in row:
                row[fn_name + "_vs_tinygemm"] = round(row["tinygemm_us"] / row[fn_name + "_us"], 3)
        probe_row(doc, f"f_{name}_M{M}", row)
print(write_probe(doc, args.out, os.environ.get("S23_NAME", "s23_smem_table.json")))
