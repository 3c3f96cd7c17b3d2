"""Plots of session 31's committed device results (no GPU needed; reads the JSON, writes PNGs beside it):

- ``s31_kv4_epilogue.png``: INT4-cache decode, scatter vs vector (``cstore``) epilogue vs the default rule vs SDPA
  flash (``s31_kv4_op16.json``, one run);
- ``s31_w4a8_decode_split.png``: w4a8-fp8 decode GEMM, the split rule before vs after session 31 vs cuBLAS bf16
  (``s31_w4a8_decode_split15.json``, ``s31_w4a8_min_tiles8.json``).

    python3 benchmarks/plot_s31.py [benchmarks/results/h200]
"""
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

D = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200")


def kv4():
    rows = json.load(open(os.path.join(D, "s31_kv4_op16.json")))["rows"]
    shapes = [(16, 8192), (16, 16384), (16, 32768), (4, 8192), (4, 32768), (1, 32768)]
    series = [("scatter", "scatter epilogue (session 30)"), ("cstore", "vector epilogue"),
              ("default", "default (vector below 2048 keys / split)"), ("sdpa-flash", "SDPA flash, bf16 cache")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.2
    for i, (key, label) in enumerate(series):
        xs, ys = [], []
        for j, (B, L) in enumerate(shapes):
            r = rows.get(f"t {key} B={B} L={L}" + ("" if key == "sdpa-flash" else " full"))
            if r and "ms" in r:
                xs.append(j + (i - 1.5) * w)
                ys.append(r["ms"] * 1e3)
        ax.bar(xs, ys, w, label=label)
    ax.set_xticks(range(len(shapes)), [f"B={B}\nL={L // 1024}k" for B, L in shapes])
    ax.set_ylabel("us (median, CUDA events)")
    ax.set_yscale("log")
    ax.set_title("INT4-cache decode, 32/8 heads, D=128, H200 (session 31, s31_kv4_op16.json)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(D, "s31_kv4_epilogue.png"), dpi=120)


def w4a8():
    pts = []
    for f in ("s31_w4a8_decode_split15.json", "s31_w4a8_min_tiles8.json"):
        for k, r in json.load(open(os.path.join(D, f)))["rows"].items():
            if "fill_us" in r:
                pts.append((f"{k} ({'1.5/SM' if '15' in f else '>=8 K tiles'})", statistics.median(r["fill_us"]),
                            statistics.median(r["fit_us"]), r.get("cublas_bf16_us")))
    fig, ax = plt.subplots(figsize=(12, 5))
    xs = range(len(pts))
    ax.plot(xs, [p[1] for p in pts], "o", label="rule before the probe ((1.5/SM) rows: 2 programs per SM; "
                                                 "(>=8 K tiles) rows: >= 4 K tiles per split)")
    ax.plot(xs, [p[2] for p in pts], "s", label="candidate (kept: 1.5/SM at M = 32 / 64; >= 8 K tiles at M = 64 "
                                                 "and on long K)")
    ax.plot(xs, [p[3] for p in pts], "x", label="cuBLAS bf16")
    ax.set_xticks(list(xs), [p[0] for p in pts], rotation=90, fontsize=6)
    ax.set_ylabel("us, GEMM alone (median of 3)")
    ax.set_title("w4a8-fp8 decode GEMM split-K rules, H200 (session 31)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(D, "s31_w4a8_decode_split.png"), dpi=120)


if __name__ == "__main__":
    kv4()
    w4a8()
