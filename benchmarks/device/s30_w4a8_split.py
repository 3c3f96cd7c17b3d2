"""Session-30 probe (issue 3): the split-K rule of the fused ``w4a8-fp8`` mid-M tiles (``MID_SPLIT``): "fill" (the
smallest power-of-two split reaching one program per SM; the rule until session 30) against "fit" (the largest one
staying within one program per SM). ``s30_w4a8_mid.json`` found fewer splits faster on qkv / o at M = 128 / 256.

    PYTHONPATH=$PWD python3 benchmarks/device/s30_w4a8_split.py --out DIR   (S30_DECODE=1: the M <= 64 configs, 2 vs
    1 program per SM; written to s30_w4a8_split_decode.json)

Every (layer, M) where the two rules differ: GEMM alone on pre-quantized x, CUDA graph over rotating weight copies
(> 2x L2), 3 alternations, plus cuBLAS bf16 and ``torch._scaled_mm``; rel-L2 between the two. Writes
``s30_w4a8_split.json``.
"""
import os
import sys

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import graph_alternations, graph_us, probe_args, probe_doc, probe_row, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import GROUP, peer_gemm_fns, probe_cases  # noqa: E402
import lowbit.kernels.w4a8_fp8_gemm as W  # noqa: E402

LAYERS = {"l3_qkv": (6144, 4096), "l3_o": (4096, 4096), "l3_down": (4096, 14336), "l2_down": (4096, 11008),
          "tp4_qkv": (1536, 4096), "tp4_o": (4096, 1024), "tp8_gate_up": (3584, 4096), "tp8_down": (4096, 1792)}
MS = [96, 128, 192, 256, 320]


DECODE = os.environ.get("S30_DECODE") == "1"  # the decode configs (M <= 64): 2 vs FIT_PER_SM programs per SM
FIT_PER_SM = float(os.environ.get("S30_FIT_PER_SM", "1"))  # decode: the "fit" rule's programs per SM
MIN_TILES = int(os.environ.get("S30_MIN_TILES", "0"))  # decode: K tiles per split at least (against 4, session 31's run)
LONG_K = os.environ.get("S30_LONG_K") == "1"  # decode: the long-K tiles' rule (1.5 programs per SM) against FIT
if DECODE:
    MS = [16, 32, 64]
    if MIN_TILES:
        LAYERS.update({"l3_gate": (14336, 4096), "tp4_gate_up": (7168, 4096), "n8192": (8192, 4096),
                       "l70_o": (8192, 8192), "k10944": (2048, 10944), "tp2_o": (4096, 2048), "n2048k4096": (2048, 4096)})
    elif LONG_K:
        LAYERS = {"l3_down": (4096, 14336), "l2_down": (4096, 11008), "tp2_down": (4096, 7168),
                  "l70_o": (8192, 8192), "l70_down_tp4": (8192, 7168), "k10944": (2048, 10944)}
    else:
        LAYERS.update({"l3_gate": (14336, 4096), "tp4_gate_up": (7168, 4096), "tp2_qkv": (3072, 4096),
                       "n8192": (8192, 4096), "n5120": (5120, 4096), "n2560": (2560, 2560)})


def cfg_for(rule, M, N, K):
    if DECODE and MIN_TILES:  # "fill" = >= 4 K tiles per split (the rule before), "fit" = >= MIN_TILES
        old = (W.DECODE_MIN_K_TILES, W.LONG_K_MIN_K_TILES)
        W.DECODE_MIN_K_TILES, W.LONG_K_MIN_K_TILES = (({16: MIN_TILES, 32: MIN_TILES, 64: MIN_TILES}, MIN_TILES)
                                                      if rule == "fit" else ({16: 4, 32: 4, 64: 4}, 4))
        try:
            return W.pick_config(M, N, K)
        finally:
            W.DECODE_MIN_K_TILES, W.LONG_K_MIN_K_TILES = old
    if DECODE:  # "fill" = 2 programs per SM (long K: 1.5), "fit" = FIT_PER_SM, for every tile height
        name = "LONG_K_SPLIT_PER_SM" if LONG_K else "DECODE_SPLIT_PER_SM"
        per_sm = (1.5 if LONG_K else 2.0) if rule == "fill" else FIT_PER_SM
        old = getattr(W, name)
        setattr(W, name, {16: per_sm, 32: per_sm, 64: per_sm})
        try:
            return W.pick_config(M, N, K)
        finally:
            setattr(W, name, old)
    old, W.MID_SPLIT = W.MID_SPLIT, rule
    try:
        return W.pick_config(M, N, K)
    finally:
        W.MID_SPLIT = old


def main():
    a = probe_args("t")
    doc = probe_doc("benchmarks/device/s30_w4a8_split.py", ("S30_DECODE", "S30_FIT_PER_SM", "S30_LONG_K", "S30_MIN_TILES"))
    for name, N, K, sets, M, x, xq, sx in probe_cases(LAYERS, MS):
        cf, ct = cfg_for("fill", M, N, K), cfg_for("fit", M, N, K)
        if cf == ct:
            continue
        row = {"N": N, "K": K, "M": M, "fill_split": cf["SPLIT_K"], "fit_split": ct["SPLIT_K"]}
        try:
            y0 = W.w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=cf)
            y1 = W.w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=ct)
            row["rel"] = float(f"{((y1.float() - y0.float()).norm() / y0.float().norm()).item():.2e}")
            graph_alternations(row, {vn: [lambda c=c, s=s, cfg=cfg: W.w4a8_fp8_gemm(xq, sx, c, s, 2.0 ** -8, K, GROUP,
                                                                                 config=cfg) for c, s in sets]
                                      for vn, cfg in (("fill", cf), ("fit", ct))})
            for pn, fl in peer_gemm_fns(x, N, K).items():
                row[pn + "_us"] = round(graph_us(fl), 2)
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:400]
        probe_row(doc, f"{name} M={M}", row)
        write_probe(doc, a.out, "s30_w4a8_split_decode.json" if DECODE else "s30_w4a8_split.json")


if __name__ == "__main__":
    main()
