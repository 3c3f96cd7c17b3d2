"""Session-30 probe (issue 3): tile shapes of the fused ``w4a8-fp8`` kernel for the small-N layers (qkv, o) at
M = 128 / 256, where it runs slower than cuBLAS bf16 (s29: qkv 0.91x, o 0.90x GEMM alone at M = 128). The committed
mid-M tile is 128 x-rows x 64 weight rows, 4 warps, split-K to one wave; tried here: 128 weight rows with 8 warps (two
warpgroups on one x tile), other split counts and stage counts.

    PYTHONPATH=$PWD python3 benchmarks/device/s30_w4a8_mid.py --out DIR   (env S30_MS=128,256)

GEMM alone on pre-quantized x, CUDA graph over rotating weight copies (> 2x L2), 3 alternations; rel-L2 against the
committed config (the same products in another split order: ~1e-7 expected). Writes ``s30_w4a8_mid.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import graph_us, probe_args, probe_doc, probe_row, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import GROUP, peer_gemm_fns, probe_cases  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm  # noqa: E402

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096)}


def fns(sets, xq, sx, K, cfg):
    return [lambda c=c, s=s: w4a8_fp8_gemm(xq, sx, c, s, 2.0 ** -8, K, GROUP, config=cfg) for c, s in sets]


def main():
    a = probe_args("t")
    doc = probe_doc("benchmarks/device/s30_w4a8_mid.py", ("S30_MS",))
    ms = [int(m) for m in os.environ.get("S30_MS", "128,256").split(",")]
    for name, N, K, sets, M, x, xq, sx in probe_cases(LAYERS, ms):
        base = pick_config(M, N, K)
        variants = {"base": base}
        for sk in (1, 2, 4):
            if sk != base["SPLIT_K"]:
                variants[f"n64_s{sk}"] = dict(base, SPLIT_K=sk)
        for sk in (2, 4, 8):
            for st in (3, 4):
                variants[f"n128_w8_s{sk}_st{st}"] = dict(base, BLOCK_N=128, num_warps=8, SPLIT_K=sk, num_stages=st)
        y0 = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=base)
        row = {"N": N, "K": K, "M": M, "base": {k: base.get(k) for k in ("BLOCK_N", "SPLIT_K", "num_stages")}}
        ok = {}
        for vn, cfg in variants.items():
            try:
                y, k = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=cfg, return_compiled=True)
                torch.cuda.synchronize()
                row[vn + "_rel"] = float(f"{((y.float() - y0.float()).norm() / y0.float().norm()).item():.2e}")
                row[vn + "_res"] = {"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared}
                ok[vn] = cfg
            except Exception as exc:  # noqa: BLE001
                row[vn + "_error"] = repr(exc)[:300]
        for rep in range(3):
            for vn, cfg in ok.items():
                row.setdefault(vn + "_us", []).append(round(graph_us(fns(sets, xq, sx, K, cfg)), 2))
        for pn, fl in peer_gemm_fns(x, N, K).items():
            row[pn + "_us"] = round(graph_us(fl), 2)
        probe_row(doc, f"{name} M={M}", row)
        write_probe(doc, a.out, "s30_w4a8_mid.json")


if __name__ == "__main__":
    main()
