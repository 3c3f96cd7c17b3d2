"""Session-14 A/B (device): the register-table kernel's ``balance`` split (the committed M <= 64 default) against the
committed-before rule (``balance=False``), an alternative tie-break (``fill``: the most programs that fit one wave)
and the fragment kernel, 4-bit NF g128, timed both ways the project uses:
``time_cuda`` (CUDA events around each call, 3+ rotated weight sets: the lut area's method) and ``graph_us``
(a CUDA graph of 20 back-to-back calls over > 2x L2 of weight copies: the probes' and the decode step's method).

    python3 benchmarks/device/s14_split_ab.py --out DIR
Output: ``s14_split_ab.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lowbit._utils import resident_ctas  # noqa: E402
from lowbit.bench.harness import (env_info, graph_us, probe_args, probe_row, rotating_inputs, time_cuda,
                                  write_probe)  # noqa: E402
from lowbit.bench.suites.lut import make_packed  # noqa: E402
from lowbit.kernels import lut_gemm as LG  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402

a = probe_args("")
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096), "8192sq": (8192, 8192)}


def fill_split(tiles, ng, sms, resident):
    """The alternative tie-break (session 14 A/B): among the splits with the fewest groups on the busiest SM
    (``balanced_split``'s measure), the most programs that still fit one wave of ``resident`` per SM."""
    cands = {}
    for s in range(1, ng + 1):
        if s > 1 and -(-ng // s) == -(-ng // (s - 1)):
            continue
        n = tiles * s
        if n > max(4 * resident, 8) * sms:
            break
        cands[s] = -(-n // sms) * -(-ng // s)
    best = min(cands.values())
    ties = [s for s, c in cands.items() if c == best]
    fit = [s for s in ties if tiles * s <= resident * sms]
    return max(fit) if fit else min(ties)
doc = {"suite": "s14_split_ab", "env": env_info("benchmarks/device/s14_split_ab.py"), "rows": {}}
for name, (N, K) in LAYERS.items():
    ws = rotating_inputs(lambda: (torch.randn(N, K, device="cuda") * K ** -0.5,), min_sets=3)
    packs = [make_packed(w, 4) for (w,) in ws]
    del ws
    for M in (16, 32, 64):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        var = {"balance": {}, "no_balance": {"balance": False}}
        cfg = LW.wgmma_config(M, N, K, 128)
        p0 = packs[0]
        LW.lut_wgmma_triton(x, p0["qmma"], p0["scales"], p0["pairs"], group_size=128, out_features=N)
        occ = resident_ctas(LW.LAST_COMPILED["wgmma"], cfg["num_warps"])
        tiles = -(-(-(-N // 16)) // cfg["rt"]) * -(-M // cfg["block_m"])
        s_fill = fill_split(tiles, -(-K // 128), LG._sm_count(x.device), occ)
        var["fill"] = {"split_k": s_fill}
        fns = {vn: [lambda p=p, ov=ov: LW.lut_wgmma_triton(x, p["qmma"], p["scales"], p["pairs"], group_size=128,
                                                           out_features=N, **ov) for p in packs]
               for vn, ov in var.items()}
        fns["fragment"] = [lambda p=p: LG.lut_mma_triton(x, p["qmma"], None, p["scales"], p["pairs"], p["table"], bits=4,
                                                         group_size=128, out_features=N) for p in packs]
        fns["cublas_bf16"] = [lambda w=w: torch.nn.functional.linear(x, w) for w in
                              [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]]
        row = {}
        for rnd in range(2):
            for vn, fl in fns.items():
                ev = time_cuda(lambda i: fl[i](), [(i,) for i in range(len(fl))], reps=100, warmup=5)["median_ms"] * 1e3
                gr = graph_us(fl)
                row.setdefault(vn, {"events_us": [], "graph_us": []})
                row[vn]["events_us"].append(round(ev, 2))
                row[vn]["graph_us"].append(round(gr, 2))
        LW.lut_wgmma_triton(x, packs[0]["qmma"], packs[0]["scales"], packs[0]["pairs"], group_size=128, out_features=N)
        row["split_balance"] = LW.LAST_COMPILED["wgmma_split"]
        row["split_fill"], row["resident"], row["tiles"] = s_fill, occ, tiles
        key = f"{name} N={N} K={K} M={M}"
        probe_row(doc, key, row)
    del packs
    torch.cuda.empty_cache()
write_probe(doc, a.out, "s14_split_ab.json")
