"""Session-30 probe (issue 5): the split-K target of the ``w4a8-int8`` GEMM's small/mid-M buckets (``auto_split``,
``CONFIGS``' programs per SM: 2 at M = 33..128). The FP8 kernel's mid-M tiles ran 4-41 % faster with at most one
program per SM at K <= 4096 (``s30_w4a8_split.json``); the same question here: 1, 1.5 and 2 programs per SM (run 1: 1 vs 2, ``s30_int8_split_r1.json``).

    PYTHONPATH=$PWD python3 benchmarks/device/s30_int8_split.py --out DIR

Llama-3-8B layers and tensor-parallel shards, M = 64 / 96 / 128, row-tiled codes (the modules' layout), x
pre-quantized, CUDA graph over rotating weight copies (> 2x L2), 3 alternations; bit-equality of the outputs.
Writes ``s30_int8_split.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import graph_alternations, graph_us, probe_args, probe_doc, probe_row, rotating_inputs, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import peer_gemm_fns  # noqa: E402
from lowbit.bench.suites.w4a8_int8 import _qoq  # noqa: E402
from lowbit.kernels.w4a8_int8_gemm import CONFIGS, auto_split, launch, pick_config  # noqa: E402
from lowbit.ops.quant import per_token_quant  # noqa: E402

LAYERS = {"l3_qkv": (6144, 4096), "l3_o": (4096, 4096), "l3_gate_up": (28672, 4096), "l3_down": (4096, 14336),
          "tp4_qkv": (1536, 4096), "tp4_o": (4096, 1024), "tp8_gate_up": (3584, 4096), "tp8_down": (4096, 1792)}
MS = [int(m) for m in os.environ.get("S30_MS", "64,96,128").split(",")]  # session 31: S30_MS=16,32


def cfg_for(M, N, KP, ctas):
    """The committed config with the auto split aimed at ``ctas`` programs per SM (a float: 1.5 = 198 programs)."""
    cfg = pick_config(M, N, KP, 128, tiled=True)
    bound = min(b for b in CONFIGS if M <= b)
    bm, bn, split, _, _, _, extra = CONFIGS[bound]
    if split == 0:
        slots = int(ctas * 132)
        cfg["SPLIT_K"] = auto_split(M, N, KP, bm, bn, slots, 1, max(4, extra.get("KSTEP", 1)))
    return cfg


def fn(q, xq, xs, K, cfg):
    qw, ws, gs, gz = q
    return lambda: launch(xq, xs, qw, ws, gs, gz, None, K, 128, torch.bfloat16, config=dict(cfg), tiled=True)[0]


def main():
    a = probe_args("t")
    doc = probe_doc("benchmarks/device/s30_int8_split.py", ("S30_MS",))
    for name, (N, K) in LAYERS.items():
        sets = rotating_inputs(lambda: _qoq(N, K))
        KP = 2 * sets[0][0].shape[1]
        for M in MS:
            cfgs = {"ctas2": cfg_for(M, N, KP, 2), "ctas1": cfg_for(M, N, KP, 1), "ctas1.5": cfg_for(M, N, KP, 1.5)}
            if M <= 32:  # the committed 16-token bucket aims at 4 programs per SM (session 31: also tried at 32)
                cfgs["ctas4"] = cfg_for(M, N, KP, 4)
            c2 = cfgs["ctas4" if M <= 16 else "ctas2"]
            if all(c == c2 for c in cfgs.values()):
                continue
            row = {"N": N, "K": K, "M": M, **{f"split_{vn}": c["SPLIT_K"] for vn, c in cfgs.items()}}
            try:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                xq, xs = per_token_quant(x, "int8")
                y0 = fn(sets[0], xq, xs, K, c2)()
                row["bitequal"] = all(bool(torch.equal(fn(sets[0], xq, xs, K, c)(), y0)) for c in cfgs.values())
                graph_alternations(row, {vn: [fn(s, xq, xs, K, cfg) for s in sets] for vn, cfg in cfgs.items()})
                for pn, pf in peer_gemm_fns(x, N, K).items():
                    row[pn + "_us"] = round(graph_us(pf), 2)
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:400]
            probe_row(doc, f"{name} M={M}", row)
            write_probe(doc, a.out, "s30_int8_split.json")
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
