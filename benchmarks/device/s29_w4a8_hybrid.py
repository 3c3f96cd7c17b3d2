"""Session-29 probe (issue 3, M = 128..256): does wave quantization cost the fused W4A8-FP GEMM, and does the hybrid
split (``HYB_FULL``: whole tiles first, the remaining n-tiles split-K in the same launch) recover it?

Nsight Compute (session 29, gate_up M = 128) showed 448 programs of 64 weight rows at 2 per SM (222 registers, 81 KB
shared): 1.70 waves. Part ``w`` times the committed config at M = 128 on N = 16896 / 22528 / 28672 / 33792 (1, 1.33,
1.70, 2 waves of 264); part ``h`` the hybrid variants beside the committed path and the peers (cuBLAS bf16,
``torch._scaled_mm`` FP8 row-wise with x pre-quantized), GEMM alone on pre-quantized x (``graph_us`` over > 2x L2 of
weight copies); part ``r`` the committed rule (``pick_config`` with ``HYB_FULL``) against the same config
without it at M = 128..511; part ``o`` more programs per SM (``sN_rR``: N stages, register cap R; env S29_CAPS)
with the hybrid rule at each variant's residency; part ``d`` dequantize-once + ``_scaled_mm`` at M = 256..511; part ``m``
the hybrid split on the decode tiles (M = 1 / 16, gate_up and lm_head); part ``x`` the x tiles by TMA (``XTMA``)
and the codes by TMA at M = 128 / 256; part ``y`` with XTMA: 3 stages, TMA codes, a register cap (env S29_YCAPS),
with the hybrid rule at each variant's residency; part ``z`` XTMA on the 64-row decode configs and at M = 96. Every variant is compared with the committed path's output first (rel-L2; split-K reorders sums).

    PYTHONPATH=$PWD python3 benchmarks/device/s29_w4a8_hybrid.py --out DIR [--parts whrodmxyz]   (env S29_MS=128,256)
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import graph_us, probe_args, probe_doc, probe_row, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import GROUP, peer_gemm_fns, probe_cases  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm  # noqa: E402

a = probe_args("wh")
MS = [int(m) for m in os.environ.get("S29_MS", "128,256").split(",")]
doc = probe_doc("benchmarks/device/s29_w4a8_hybrid.py", ("S29_MS",))


def fns(sets, xq, sx, K, cfg):
    return [lambda c=c, s=s: w4a8_fp8_gemm(xq, sx, c, s, 2.0 ** -8, K, GROUP, config=cfg) for c, s in sets]


def rel(a_, b_):
    return ((a_.float() - b_.float()).norm() / b_.float().norm()).item()


def compare_and_time(row, variants, sets, xq, sx, K, y0, reps):
    """Each variant's rel-L2 against ``y0`` on the first weight set, then ``reps`` alternations of their graph times."""
    for vn, cfg in variants.items():
        y = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=cfg)
        row[vn + "_rel"] = float(f"{rel(y, y0):.2e}")
    for rep in range(reps):
        for vn, cfg in variants.items():
            row.setdefault(vn + "_us", []).append(round(graph_us(fns(sets, xq, sx, K, cfg)), 2))


if "w" in a.parts:
    layers = {f"n{n}": (n, 4096) for n in (16896, 22528, 28672, 33792)}
    for name, N, K, sets, M, x, xq, sx in probe_cases(layers, [128]):
        cfg = pick_config(M, N, K)
        row = {"N": N, "K": K, "M": M, "programs": -(-N // cfg["BLOCK_N"]) * cfg["SPLIT_K"],
               "base_us": round(graph_us(fns(sets, xq, sx, K, cfg)), 2)}
        probe_row(doc, f"w_{name}_m{M}", row)

if "h" in a.parts:
    layers = {"gate_up": (28672, 4096)}
    for name, N, K, sets, M, x, xq, sx in probe_cases(layers, MS):
        base = pick_config(M, N, K)
        ntiles = -(-N // base["BLOCK_N"])
        mt = -(-M // base["BLOCK_M"])
        variants = {"base": base}
        for s in (2, 4):
            variants[f"split{s}"] = dict(base, SPLIT_K=s)
        fulls = (264 // mt, 132 // mt) if mt == 1 else (3 * 264 // mt, 2 * 264 // mt)
        for f in fulls:
            for s in (2, 3, 4, 8):
                variants[f"hyb{f}_s{s}"] = dict(base, SPLIT_K=s, HYB_FULL=f)
        ref = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=base)
        row = {"N": N, "K": K, "M": M, "n_tiles": ntiles, "m_tiles": mt}
        compare_and_time(row, variants, sets, xq, sx, K, ref, 2)  # two alternations of every variant
        for pn, pf in peer_gemm_fns(x, N, K).items():
            row[pn + "_us"] = round(graph_us(pf), 2)
        probe_row(doc, f"h_{name}_m{M}", row)
if "r" in a.parts:  # the committed rule (pick_config with HYB_FULL) vs the same config without it
    for lname, (N, K), ms in (("gate_up", (28672, 4096), (128, 192, 256, 320, 384, 448)),
                              ("qkv", (6144, 4096), (256, 320, 384, 448, 511))):
        for name, N, K, sets, M, x, xq, sx in probe_cases({lname: (N, K)}, ms):
            rule = pick_config(M, N, K)
            plain = {k: v for k, v in rule.items() if k != "HYB_FULL"}
            plain["SPLIT_K"] = 1 if "HYB_FULL" in rule else rule["SPLIT_K"]
            row = {"N": N, "K": K, "M": M, "rule": {k: rule.get(k) for k in ("SPLIT_K", "HYB_FULL")}}
            y0 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=plain)
            y1 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=rule)
            row["rule_rel"] = float(f"{rel(y1, y0):.2e}")
            for rep in range(3):
                for vn, cfg in (("plain", plain), ("rule", rule)):
                    row.setdefault(vn + "_us", []).append(round(graph_us(fns(sets, xq, sx, K, cfg)), 2))
            for pn, pf in peer_gemm_fns(x, N, K).items():
                row[pn + "_us"] = round(graph_us(pf), 2)
            probe_row(doc, f"r_{name}_m{M}", row)
if "o" in a.parts:  # more programs per SM: fewer stages / a register cap, with the hybrid rule at the new residency
    from lowbit.kernels.w4a8_fp8_gemm import BLOCK_K, hybrid_split

    caps = os.environ.get("S29_CAPS", "s4,s3,s3_r168,s2_r168,s3_r128,s2_r128").split(",")
    for name, N, K, sets, M, x, xq, sx in probe_cases({"gate_up": (28672, 4096), "qkv": (6144, 4096),
                                                      "o": (4096, 4096), "down": (4096, 14336)}, [128, 256]):
        if M == 256 and name in ("o", "down"):
            continue
        base = pick_config(M, N, K)
        y0 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=base)
        row = {"N": N, "K": K, "M": M, "base": {k: base.get(k) for k in ("SPLIT_K", "HYB_FULL", "num_stages")}}
        variants = {"base": base}
        for c in caps:
            d = dict(x_[0:1] and (x_[0], int(x_[1:])) for x_ in c.split("_"))
            cfg = {k: v for k, v in base.items() if k not in ("HYB_FULL",)}
            cfg["SPLIT_K"] = 1 if "HYB_FULL" in base else base["SPLIT_K"]
            cfg["num_stages"] = d["s"]
            if "r" in d:
                cfg["maxnreg"] = d["r"]
            try:
                _, k = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=cfg, return_compiled=True)
            except Exception as exc:
                row[c + "_err"] = f"{type(exc).__name__}: {exc}"[:160]
                continue
            regs, spills, shared = k.n_regs, k.n_spills, k.metadata.shared
            ctas = min(65536 // (max(regs, 1) * 128), 232448 // (shared + 1024), 16)
            row[c + "_res"] = {"regs": regs, "spills": spills, "shared": shared, "ctas": ctas}
            variants[c] = cfg
            if cfg["SPLIT_K"] == 1:
                h = hybrid_split(-(-N // 64), -(-M // 128), -(-K // BLOCK_K), ctas * 132)
                if h:
                    variants[c + "_hyb"] = dict(cfg, **h)
        compare_and_time(row, variants, sets, xq, sx, K, y0, 2)
        probe_row(doc, f"o_{name}_m{M}", row)

if "d" in a.parts:  # dequantize-once + torch._scaled_mm (the M >= 512 path) below 512
    for lname, (N, K), ms in (("gate_up", (28672, 4096), (256, 384, 448, 511)), ("qkv", (6144, 4096), (384, 448, 511))):
        for name, N, K, sets, M, x, xq, sx in probe_cases({lname: (N, K)}, ms):
            fused, deq = pick_config(M, N, K), pick_config(512, N, K)
            row = {"N": N, "K": K, "M": M}
            for rep in range(2):
                for vn, cfg in (("fused", fused), ("dequant_scaled_mm", deq)):
                    row.setdefault(vn + "_us", []).append(round(graph_us(fns(sets, xq, sx, K, cfg)), 2))
            probe_row(doc, f"d_{name}_m{M}", row)
if "m" in a.parts:  # decode (128-row TMA tiles): whole tiles on every SM, the rest split-K (tiny fp32 partials at M <= 16)
    for name, N, K, sets, M, x, xq, sx in probe_cases({"gate_up": (28672, 4096), "lm_head": (128256, 4096)}, [1, 16]):
        base = pick_config(M, N, K)
        nt = -(-N // base["BLOCK_N"])
        variants = {"base": base}
        for f in range(132, nt, 132):
            if nt - f <= 264:
                for sp in (2, 4):
                    variants[f"hyb{f}_s{sp}"] = dict(base, SPLIT_K=sp, HYB_FULL=f)
        y0 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=base)
        row = {"N": N, "K": K, "M": M, "n_tiles": nt}
        compare_and_time(row, variants, sets, xq, sx, K, y0, 3)
        probe_row(doc, f"m_{name}_m{M}", row)
if "x" in a.parts:  # x tiles by TMA (XTMA), and the codes by TMA too, at M = 128 / 256
    for name, N, K, sets, M, x, xq, sx in probe_cases({"gate_up": (28672, 4096), "qkv": (6144, 4096),
                                                      "o": (4096, 4096), "down": (4096, 14336)}, [128, 256]):
        base = pick_config(M, N, K)
        variants = {"base": base, "xtma": dict(base, XTMA=True), "xtma_tma": dict(base, XTMA=True, TMA=True),
                    "tma": dict(base, TMA=True)}
        y0 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=base)
        row = {"N": N, "K": K, "M": M, "base": {k: base.get(k) for k in ("SPLIT_K", "HYB_FULL")}}
        for vn, cfg in variants.items():
            y, k = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=cfg, return_compiled=True)
            row[vn + "_bitequal"] = bool(torch.equal(y, y0))
            row[vn + "_res"] = {"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared}
        for rep in range(3):
            for vn, cfg in variants.items():
                row.setdefault(vn + "_us", []).append(round(graph_us(fns(sets, xq, sx, K, cfg)), 2))
        probe_row(doc, f"x_{name}_m{M}", row)
if "y" in a.parts:  # with XTMA: fewer stages / TMA codes / a register cap for 3 programs per SM, + the hybrid rule
    from lowbit.kernels.w4a8_fp8_gemm import BLOCK_K, hybrid_split

    caps = os.environ.get("S29_YCAPS", "s4,s3,s3_t,s3_r168,s3_t_r168").split(",")
    for name, N, K, sets, M, x, xq, sx in probe_cases({"gate_up": (28672, 4096), "qkv": (6144, 4096),
                                                      "o": (4096, 4096), "down": (4096, 14336)}, [128, 256]):
        base = pick_config(M, N, K)
        y0 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=base)
        row = {"N": N, "K": K, "M": M, "base": {k: base.get(k) for k in ("SPLIT_K", "HYB_FULL")}}
        variants = {"base": base}
        for c in caps:
            cfg = dict(base, XTMA=True)
            for tok in c.split("_"):
                if tok[0] == "s":
                    cfg["num_stages"] = int(tok[1:])
                elif tok[0] == "r":
                    cfg["maxnreg"] = int(tok[1:])
                elif tok == "t":
                    cfg["TMA"] = True
            y, k = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=cfg, return_compiled=True)
            regs, shared = k.n_regs, k.metadata.shared
            ctas = min(65536 // (-(-regs // 8) * 8 * 128), 233472 // (shared + 1024))
            row[c + "_res"] = {"regs": regs, "spills": k.n_spills, "shared": shared, "ctas": ctas,
                               "bitequal": bool(torch.equal(y, y0))}
            variants[c] = cfg
            if ctas != 2:  # the hybrid rule at this residency (from the unsplit plan)
                plain = {kk: v for kk, v in cfg.items() if kk != "HYB_FULL"}
                mt, nt, kt = -(-M // 128), -(-N // 64), -(-K // BLOCK_K)
                from lowbit.kernels.w4a8_fp8_gemm import _split_k
                sp = _split_k(nt * mt, kt, 132)
                plain["SPLIT_K"] = sp
                variants[c + "_plain"] = plain
                if sp == 1:
                    h = hybrid_split(nt, mt, kt, ctas * 132)
                    if h:
                        variants[c + "_hyb"] = dict(plain, **h)
        for rep in range(3):
            for vn, cfg in variants.items():
                row.setdefault(vn + "_us", []).append(round(graph_us(fns(sets, xq, sx, K, cfg)), 2))
        probe_row(doc, f"y_{name}_m{M}", row)
if "z" in a.parts:  # XTMA on the 64-row decode configs (CAT, one K tile per step) and at M = 96 (the new mid default)
    for name, N, K, sets, M, x, xq, sx in probe_cases({"qkv": (6144, 4096), "o": (4096, 4096),
                                                      "gate_up": (28672, 4096)}, [16, 32, 64, 96]):
        on = pick_config(M, N, K)
        if M <= 64 and (on.get("KSTEP", 1) != 1 or not on.get("CAT")):
            continue
        off = dict(on, XTMA=False)
        on = dict(on, XTMA=True)
        y0 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=off)
        y1 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=on)
        row = {"N": N, "K": K, "M": M, "bitequal": bool(torch.equal(y0, y1)),
               "config": {k: on.get(k) for k in ("BLOCK_M", "BLOCK_N", "SPLIT_K", "HYB_FULL")}}
        for rep in range(3):
            for vn, cfg in (("off", off), ("xtma", on)):
                row.setdefault(vn + "_us", []).append(round(graph_us(fns(sets, xq, sx, K, cfg)), 2))
        probe_row(doc, f"z_{name}_m{M}", row)
print(write_probe(doc, a.out, "s29_w4a8_hybrid.json"))
