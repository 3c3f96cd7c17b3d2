"""Session-27 probe (issue 7, `flute-nf3` at batch 64): launch variants of the 3-bit register-table kernel at 48 / 64
tokens on the four Llama-3-8B linears (gate_up as the fused, row-interleaved weight with SiLU*mul, as the recipe runs
it), against the committed launch (``lut_wgmma.wgmma_config``) and the op; the 3-bit launches at 33..64 tokens were
last swept on the H100 (session 13).

    PYTHONPATH=$PWD python3 benchmarks/device/s27_nf3.py --out DIR   (env S27_M: token counts, S27_REPS: repeats)

Every variant is checked against the float64 reference (rel-L2) before it is timed; three weight sets and inputs
rotated; the repeats interleave the variants.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, time_rotated, write_probe  # noqa: E402
from lowbit.bench.suites.lut import make_packed, op_fn, reference_f64, wgmma_fn  # noqa: E402
from lowbit.formats.common import interleave_rows, silu_mul_ref  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402

args = probe_args("s")
doc = {"env": env_info(" ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("S27_"))
                       + " PYTHONPATH=$PWD python3 " + " ".join(sys.argv)), "note": "us = median ms * 1000"}
REPS = int(os.environ.get("S27_REPS", "2"))
MS = [int(m) for m in os.environ.get("S27_M", "48,64").split(",")]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def variants(M, N, K):
    """Name -> config overrides (None = the committed launch through the kernel's launcher)."""
    base = LW.wgmma_config(M, N, K, 128, 3)
    v = {"base": {}}
    v["smem"] = {"smem_table": True}
    v["sw0"] = {"scale_w": False}
    v["rega"] = {"reg_a": "auto"}
    for c in (1, 2, 3, 4):
        if c != base["ctas_per_sm"]:
            v[f"c{c}"] = {"ctas_per_sm": c}
    if base["one_dot"]:
        v["d8"] = {"rt": 8, "one_dot": False}
    else:
        v["o4"] = {"rt": 4, "one_dot": True}
        v["d4"] = {"rt": 4}
    v["st2"] = {"num_stages": 2}
    v["st4"] = {"num_stages": 4}
    v["nobal"] = {"balance": False}
    v["smem_c2"] = {"smem_table": True, "ctas_per_sm": 2}
    return v


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


if "s" in args.parts:
    for name, (N, K) in SHAPES.items():
        torch.manual_seed(0)
        sets = []
        for _ in range(3):
            if name == "gate_up":
                g = torch.randn(N // 2, K, device="cuda", dtype=torch.bfloat16) * 0.02
                u = torch.randn(N // 2, K, device="cuda", dtype=torch.bfloat16) * 0.02
                sets.append(make_packed(interleave_rows(g, u, 8), 3))
                del g, u
            else:
                sets.append(make_packed(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02, 3))
        fused = name == "gate_up"
        for M in MS:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            ref = reference_f64(sets[0], xs[0]).to(torch.bfloat16)
            if fused:
                ref = silu_mul_ref(ref, 8)
            row = {"M": M, "N": N, "K": K, "base_cfg": {k: str(v) for k, v in LW.wgmma_config(M, N, K, 128, 3).items()}}
            fns = {"op": [op_fn(s, silu_mul=fused) for s in sets]}
            for vn, ov in variants(M, N, K).items():
                try:
                    err = rel(wgmma_fn(sets[0], silu_mul=fused, **ov)(xs[0]), ref)
                    row[f"{vn}_rel"] = round(err, 5)
                    if err < 2e-2:
                        fns[vn] = [wgmma_fn(s, silu_mul=fused, **ov) for s in sets]
                except Exception as exc:  # noqa: BLE001
                    row[f"{vn}_err"] = f"{type(exc).__name__}: {exc}"[:200]
            for r in range(REPS):
                t = time_rotated({}, fns, xs)
                for k, v in t.items():
                    row.setdefault(k, []).append(v)
            probe_row(doc, f"{name}_M{M}", row)
        del sets
        torch.cuda.empty_cache()
    write_probe(doc, args.out, "s27_nf3.json")
