"""Plot of session 32's committed device result (no GPU needed; reads the JSON, writes a PNG beside it):

- ``s32_kv4_sraw.png``: INT4-cache decode (B=16 / 4 / 1, 32/8 heads, D=128), the scale loads as before vs ``SRAW``
  (32-bit destinations) in two runs (``s32_kv4_sraw.json``: SRAW forced on beside the old default;
  ``s32_kv4_final.json``: the new default beside SRAW forced off), with SDPA flash and the 3x target.

    python3 benchmarks/plot_s32.py [benchmarks/results/h200]
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

D = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200")


def us(rows, key):
    r = rows.get(key)
    return r["ms"] * 1e3 if r and "ms" in r else None


def main():
    r1 = json.load(open(os.path.join(D, "s32_kv4_sraw.json")))["rows"]
    r2 = json.load(open(os.path.join(D, "s32_kv4_final.json")))["rows"]
    shapes = [(16, 8192), (16, 16384), (16, 32768), (4, 8192), (1, 32768)]
    # (label, run rows, key of the variant): run 1's "default" is the old loads, run 2's "off" too
    series = [("old scale loads, run 1", r1, "default"), ("SRAW, run 1", r1, "sraw"),
              ("old scale loads, run 2", r2, "off"), ("committed rule (SRAW from 512 keys / split), run 2", r2, "default")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.18
    for i, (label, rows, key) in enumerate(series):
        xs, ys = [], []
        for j, (B, L) in enumerate(shapes):
            v = us(rows, f"t {key} B={B} L={L} full")
            if v is not None:
                xs.append(j + (i - 1.5) * w)
                ys.append(v)
        ax.bar(xs, ys, w, label=label)
    for j, (B, L) in enumerate(shapes):
        f = us(r2, f"t sdpa-flash B={B} L={L}")
        if f is not None:  # the 3x target: a third of SDPA flash's time in the same run
            ax.hlines(f / 3, j - 2 * w, j + 2 * w, colors="k", linestyles="--",
                      label="SDPA flash / 3 (target)" if j == 0 else None)
    ax.set_xticks(range(len(shapes)), [f"B={B}\nL={L // 1024}k" for B, L in shapes])
    ax.set_ylabel("us (median, CUDA events)")
    ax.set_yscale("log")
    ax.set_title("INT4-cache decode, H200: SRAW scale loads (session 32)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = os.path.join(D, "s32_kv4_sraw.png")
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main()
