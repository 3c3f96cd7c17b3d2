"""Session-14 probe (device): the register-table kernel under a register cap (``maxnreg``: more programs per SM,
some spills; offline sm_90a build: M = 32 two-dot tile 167 -> 128 registers with 140 B of spills) against the
committed configs, 4-bit NF g128, CUDA graphs over > 2x L2 of weight copies (``alternate_us``, 3 rounds).

    python3 benchmarks/device/s14_maxnreg.py --out DIR
Output: ``s14_maxnreg.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lowbit._utils import resident_ctas  # noqa: E402
from lowbit.bench.harness import alternate_us, env_info, probe_args, probe_row, rotating_inputs, write_probe  # noqa: E402
from lowbit.bench.suites.lut import make_packed  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402

a = probe_args("")
doc = {"suite": "s14_maxnreg", "env": env_info("benchmarks/device/s14_maxnreg.py"), "rows": {}}
CASES = [("gate_up", 28672, 4096, 32), ("qkv", 6144, 4096, 32), ("o", 4096, 4096, 64), ("down", 4096, 14336, 64),
         ("gate_up", 28672, 4096, 16), ("qkv", 6144, 4096, 16), ("o", 4096, 4096, 16)]
if os.environ.get("S14_CASES"):  # e.g. "qkv:16,o:16": a subset
    CASES = [c for c in CASES if f"{c[0]}:{c[3]}" in os.environ["S14_CASES"].split(",")]
for name, N, K, M in CASES:
    ws = rotating_inputs(lambda: (torch.randn(N, K, device="cuda") * K ** -0.5,), min_sets=3)
    packs = [make_packed(w, 4) for (w,) in ws]
    del ws
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    var = {"default": {}, "maxnreg128": {"maxnreg": 128}, "maxnreg160": {"maxnreg": 160}}
    row, fns = {"info": {}}, {}
    for vn, ov in var.items():
        p = packs[0]
        y = LW.lut_wgmma_triton(x, p["qmma"], p["scales"], p["pairs"], group_size=128, out_features=N, **ov)
        k = LW.LAST_COMPILED["wgmma"]
        row["info"][vn] = {"regs": k.n_regs, "spills": k.n_spills, "resident": resident_ctas(k, 4),
                           "split": LW.LAST_COMPILED["wgmma_split"]}
        if vn == "default":
            y0 = y
        else:
            row["info"][vn]["max_diff"] = (y.float() - y0.float()).abs().max().item()
        fns[vn] = [lambda p=p, ov=ov: LW.lut_wgmma_triton(x, p["qmma"], p["scales"], p["pairs"], group_size=128,
                                                          out_features=N, **ov) for p in packs]
    row["us"] = alternate_us(fns, rounds=3)
    key = f"{name} N={N} K={K} M={M}"
    probe_row(doc, key, row)
    del packs
    torch.cuda.empty_cache()
write_probe(doc, a.out, "s14_maxnreg.json")
