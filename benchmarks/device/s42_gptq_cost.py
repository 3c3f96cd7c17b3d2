"""Session 42: what GPTQ costs on Llama-3-8B-sized matrices (H200): ``gptq_weight`` per projection shape and format
(act-order, random correlated calibration inputs of 8192 tokens), and the proxy-loss ratio GPTQ / RTN on them.

    PYTHONPATH=. python3 benchmarks/device/s42_gptq_cost.py --out $OUT/s42_gptq_cost.json
"""
import argparse
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from lowbit.ptq.gptq import gptq_weight, hessian_update, make_grid, proxy_loss, round_to_nearest  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()
torch.manual_seed(0)
rows = []
SHAPES = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096), "gate": (14336, 4096),
          "up": (14336, 4096), "down": (4096, 14336)}  # lowbit's seven linears of one decoder layer
for name, (n, k) in SHAPES.items():
    if name in ("k", "v", "up"):  # same input as q / gate: reuse its Hessian
        pass
    else:
        base = torch.randn(8192, k // 8, device="cuda") @ torch.randn(k // 8, k, device="cuda") / (k // 8) ** 0.5
        x = base + 0.3 * torch.randn(8192, k, device="cuda")
        h, _ = hessian_update(None, 0, x)
    w = torch.randn(n, k, device="cuda") * 0.02
    for scheme, opts in (("w4a8-fp8", {"pts_exp": 0}), ("w4a8-int8", {}), ("lut", {"bits": 4, "table": "nf"})):
        grid = make_grid(scheme, w, opts)
        torch.cuda.synchronize()
        t = time.perf_counter()
        q, _ = gptq_weight(w, h, grid, 128, act_order=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        r = proxy_loss(w, q, h) / proxy_loss(w, round_to_nearest(w, grid, 128), h)
        rows.append({"shape": name, "n": n, "k": k, "scheme": scheme, "seconds": round(dt, 3), "loss_ratio": round(r, 4)})
        print(rows[-1], flush=True)
per_layer = {s: round(sum(r["seconds"] for r in rows if r["scheme"] == s), 2) for s in ("w4a8-fp8", "w4a8-int8", "lut")}
with open(a.out, "w") as f:
    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
               "rows": rows, "seconds_per_llama3_8b_layer": per_layer,
               "note": "GPTQ's matrix loop only (the Hessians and the layer forwards not counted)"},
              f, indent=1)
print(per_layer)
