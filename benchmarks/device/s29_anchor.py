"""Session-29 probe: what ``lut_gemm(silu_mul=True)`` costs on the fragment-kernel launches that carry
``lut_gemm._smem_anchor`` (SILU_MUL without split-K: 3-bit at M <= 8, the 4-bit ring launch) against the same op
without the epilogue followed by the separate SiLU*mul pass (``ops.lut._silu_mul``), fused gate_up weights of
Llama-3-8B (N = 28672, K = 4096) and a smaller one (N = 8192), NF g128, three weight sets rotated.

    PYTHONPATH=$PWD python3 benchmarks/device/s29_anchor.py --out DIR
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, time_rotated, write_probe  # noqa: E402
from lowbit.bench.suites.lut import make_packed, op_fn  # noqa: E402
from lowbit.formats.common import interleave_rows  # noqa: E402
from lowbit.ops.lut import _silu_mul  # noqa: E402

args = probe_args("a")
doc = {"env": env_info("PYTHONPATH=$PWD python3 " + " ".join(sys.argv)), "note": "us = median ms * 1000"}
for bits in (3, 4):
    for N in (28672, 8192):
        K = 4096
        ps = []
        for s in range(3):
            torch.manual_seed(s)
            w = interleave_rows(torch.randn(N // 2, K, device="cuda"), torch.randn(N // 2, K, device="cuda"), 8)
            ps.append(make_packed(w, bits))
        for M in (1, 4, 8, 16):
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            fused = [op_fn(p, silu_mul=True) for p in ps]
            plain = [op_fn(p) for p in ps]
            two = [(lambda f: (lambda x: _silu_mul(f(x), False)))(f) for f in plain]
            row = {"bits": bits, "N": N, "K": K, "M": M}
            d = (fused[0](xs[0]).float() - two[0](xs[0]).float()).abs().max().item()
            row["max_abs_diff_fused_vs_two"] = d
            time_rotated(row, {"fused": fused, "two_launches": two, "gemm_only": plain}, xs)
            probe_row(doc, f"b{bits}_n{N}_m{M}", row)
print(write_probe(doc, args.out, "s29_anchor.json"))
