"""Session-26 probe (issue 7): the fused gate_up of the weight-only recipes, SiLU*mul in the LUT GEMM's epilogue.

    PYTHONPATH=$PWD python3 benchmarks/device/s26_probe.py --out DIR [--parts g]   (env S26_REPS: A/B repeats)

Part ``g``: Llama-3-8B gate_up (two 14336 x 4096 halves), bf16, at 1 / 8 / 12 / 16 / 32 / 48 / 64 / 128 tokens:
``plain`` = the stacked gate_up through the op then the runner's SiLU*mul launch (``fused_rows_triton``, what the
unfused recipe runs) against ``fused`` = the rows interleaved by 8 through ``lut_gemm(silu_mul=True)`` (the
register-table kernel's epilogue from 8 tokens, else the GEMM then one ``kernels.silu_mul`` pass); three weight sets
and inputs rotated, repeats interleaved; rel-L2 of both to the float64 reference's SiLU*mul.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, time_rotated, write_probe  # noqa: E402
from lowbit.bench.suites.lut import make_packed, op_fn, reference_f64  # noqa: E402
from lowbit.formats.common import interleave_rows, silu_mul_ref  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402
from lowbit.kernels.act_quant import fused_rows_triton  # noqa: E402

args = probe_args("g")
doc = {"env": env_info(" ".join(sys.argv)), "note": "us = median ms * 1000"}
REPS = int(os.environ.get("S26_REPS", "3"))


def plain(p, inter):
    f = op_fn(p)

    def run(x):
        g, u = f(x).split(inter, dim=-1)
        return fused_rows_triton(g, fuse="silu_mul", up=u)
    return run


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


if "g" in args.parts:
    inter, K = 14336, 4096
    torch.manual_seed(0)
    sets = []
    for _ in range(3):
        g = torch.randn(inter, K, device="cuda", dtype=torch.bfloat16) * 0.02
        u = torch.randn(inter, K, device="cuda", dtype=torch.bfloat16) * 0.02
        sets.append((make_packed(torch.cat([g, u]), 4), make_packed(interleave_rows(g, u, 8), 4)))
        del g, u
    for M in (1, 8, 12, 16, 32, 48, 64, 128):
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        row = {"M": M}
        ps, pf = sets[0]
        ref = silu_mul_ref(reference_f64(pf, xs[0]).to(torch.bfloat16), 8)
        row["rel_plain"] = rel(plain(ps, inter)(xs[0]), ref)
        row["rel_fused"] = rel(op_fn(pf, silu_mul=True)(xs[0]), ref)
        row["split_fused"] = LW.LAST_COMPILED.get("wgmma_split") if M >= 8 else None
        for r in range(REPS):
            t = time_rotated({}, {"plain": [plain(s[0], inter) for s in sets],
                                  "fused": [op_fn(s[1], silu_mul=True) for s in sets]}, xs)
            for k, v in t.items():
                row.setdefault(k, []).append(v)
        probe_row(doc, f"gate_up_M{M}", row)
    write_probe(doc, args.out, os.environ.get("S26_NAME", "s26_probe.json"))
