"""Session-30 probe (issue 3): launch shape of the whole-weight INT4 -> FP8 dequantization of the ``w4a8-fp8`` large-M
path (``dequantize_to_fp8``: one program per BLOCK_N rows x 128 columns). In s30_w4a8_chunk it moved 1.5 bytes per
weight element at ~2.9 TB/s (gate_up 60 us of the 234 us GEMM at M = 1024).

    PYTHONPATH=$PWD python3 benchmarks/device/s30_dequant.py --out DIR

Per Llama-3-8B layer: CUDA graph over rotating weight copies (> 2x L2), us and TB/s (codes + scales read, FP8 written)
for (block_n, num_warps) variants; outputs compared with the default launch (bit-equal expected); ``cat``: torch.cat of
the codes with themselves, the same read : write mix as a plain copy (the bandwidth ceiling of these bytes).
Writes ``s30_dequant.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import graph_us, probe_args, probe_doc, probe_row, rotating_inputs, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import GROUP, random_packed  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import dequantize_to_fp8  # noqa: E402

LAYERS = {"gate_up": (28672, 4096), "qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
VARIANTS = [(64, 4), (32, 4), (64, 8), (128, 4), (128, 8), (256, 8), (32, 2), (64, 2)]


def main():
    args = probe_args("t")
    doc = probe_doc("benchmarks/device/s30_dequant.py")
    for name, (N, K) in LAYERS.items():
        sets = rotating_inputs(lambda: random_packed(N, K))
        ref = dequantize_to_fp8(*sets[0], K, GROUP)
        nbytes = sets[0][0].numel() + sets[0][1].numel() + ref.numel()
        row = {"layer": name, "N": N, "K": K, "bytes": nbytes}
        for bn, nw in VARIANTS:
            v = f"bn{bn}_w{nw}"
            try:
                got = dequantize_to_fp8(*sets[0], K, GROUP, block_n=bn, num_warps=nw)
                row[f"{v}_equal"] = bool(torch.equal(got.view(torch.uint8), ref.view(torch.uint8)))
                us = graph_us([lambda c=c, s=s: dequantize_to_fp8(c, s, K, GROUP, block_n=bn, num_warps=nw)
                               for c, s in sets], n=max(12, len(sets)), reps=10)
                row[f"{v}_us"] = us
                row[f"{v}_tbs"] = nbytes / us / 1e6
            except Exception as exc:  # noqa: BLE001
                row[f"{v}_error"] = repr(exc)[:300]
        # the read : write mix of the dequantization without its arithmetic: torch.cat of the codes with themselves
        # (reads N x Kp/2 bytes, writes N x Kp): the bandwidth a plain copy kernel reaches on these bytes
        us = graph_us([lambda c=c: torch.cat([c, c], 1) for c, _ in sets], n=max(12, len(sets)), reps=10)
        cat_bytes = 3 * sets[0][0].numel()
        row.update(cat_us=us, cat_tbs=cat_bytes / us / 1e6)
        probe_row(doc, name, row)
        write_probe(doc, args.out, "s30_dequant.json")
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
