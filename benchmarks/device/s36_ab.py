"""Session-36 A/B against the previous tree (4787e38), in one process on the same inputs (``bash
benchmarks/make_ab_tree.sh 4787e38`` builds the renamed copy ``lowbit_old``; method of ``s34_nan_ab.py``).

    PYTHONPATH=$PWD:$PWD/.ab_old python3 benchmarks/device/s36_ab.py --out DIR [--parts qa]

The change: the prefill quantization scales (``kernels.attention_quant``'s K / V / Q launch, the KV4 -> FP8
conversion, the attention kernel's Q prologue) are IEEE quotients instead of Triton's ``/`` (``div.full.f32``).
Trees: ``new`` (the tree the probe runs in), ``rn`` (an optional copy ``lowbit_rn``, built by
``make_ab_tree.sh $(git stash create) lowbit_rn`` from a working state), ``old``. Parts: ``q`` the quantization
launches alone (B=4, H=32, D=128, bf16, S 1024 / 4096): per tree the
number of scales that differ from the CPU reference (IEEE) and the per-launch us (CUDA graphs, alternating); ``a``
the whole ``api.attention`` call of ``fp8``, ``int8``, ``int8-qk`` and ``fp8-kv4`` (float K / V), causal and not:
max |new - old| and us of each tree.
Committed runs (``benchmarks/results/h200/s36_ab_r*.json``): r1 parts q, a with ``new`` = ``tl.div_rn`` (the committed
form) and no third tree; r2 parts q, a with ``new`` = Markstein's step (not kept) and ``rn`` = ``tl.div_rn`` (part q's
last row ran out of memory: the CUDA graphs of three trees).
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), ".ab_old"))
import lowbit  # noqa: E402
import lowbit_old  # noqa: E402

try:
    import lowbit_rn  # noqa: E402
except ImportError:
    lowbit_rn = None
TREES = {"new": lowbit, **({"rn": lowbit_rn} if lowbit_rn else {}), "old": lowbit_old}
from lowbit.bench.harness import alternate_us, probe_row, run_probe_parts, time_cuda  # noqa: E402
from lowbit.formats import attention_quant as aq  # noqa: E402

B, H, D = 4, 32, 128


def diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def n_diff(a, b) -> int:
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return int((a != b).sum().item())


def part_q(doc):
    import importlib

    mods = {t: importlib.import_module(f"{m.__name__}.kernels.attention_quant") for t, m in TREES.items()}
    fp8 = torch.float8_e4m3fn
    for S in (1024, 4096):
        torch.manual_seed(S)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cases = {
            "fp8 kv+q (block K/V scales, vperm)": lambda M: M.quantize_kv_triton(
                k, v, dtype=fp8, q=q, v_granularity="block", k_block=128, vperm=True),
            "int8 kv (token K, channel V)": lambda M: M.quantize_kv_triton(k, v, dtype=torch.int8),
            "kv4->fp8 from float": lambda M: M.kv4_to_fp8_triton(k, None, v, None, block=128, vperm=True,
                                                                 from_float=True),
        }
        cpu = {"k": k.cpu(), "v": v.cpu(), "q": q.cpu()}
        refs = {
            # (output index of the launch, reference scales)
            "fp8 kv+q (block K/V scales, vperm)": ((1, aq.quantize_k_block(cpu["k"], fp8, 128)[1]),
                                                   (3, aq.quantize_v(cpu["v"], fp8, granularity="block")[1]),
                                                   (5, aq.quantize_qk(cpu["q"], fp8)[1])),
            "int8 kv (token K, channel V)": ((1, aq.quantize_qk(cpu["k"], torch.int8)[1]),
                                             (3, aq.quantize_v(cpu["v"], torch.int8, granularity="channel")[1])),
        }
        for name, fn in cases.items():
            row = {"S": S}
            try:
                outs = {t: fn(M) for t, M in mods.items()}
                if name in refs:
                    for t, o in outs.items():
                        row[f"scales_differing_from_cpu_ref_{t}"] = sum(n_diff(o[i], r) for i, r in refs[name])
                    row["n_scales"] = sum(r.numel() for _, r in refs[name])
                row["codes_differing_new_old"] = sum(n_diff(a, b) for a, b in zip(outs["new"], outs["old"])
                                                     if a is not None and a.dtype != torch.float32)
                row["scales_differing_new_old"] = sum(n_diff(a, b) for a, b in zip(outs["new"], outs["old"])
                                                      if a is not None and a.dtype == torch.float32)
                if "rn" in outs:
                    row["elements_differing_new_rn"] = sum(n_diff(a, b) for a, b in zip(outs["new"], outs["rn"])
                                                           if a is not None)
                t = alternate_us({k: (lambda M=M: fn(M)) for k, M in mods.items()}, rounds=5)
                row.update(us=t, **{f"{k}_over_old": round(t[k]["median"] / t["old"]["median"], 4) for k in t})
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)[:600]
            probe_row(doc, f"q {name} S={S}", row)


def part_a(doc):
    for S in (1024, 4096):
        torch.manual_seed(S)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for scheme in ("fp8", "int8", "int8-qk", "fp8-kv4"):
            for causal in (False, True):
                row = {"S": S, "causal": causal}
                try:
                    fns = {t: (lambda m=m: m.api.attention(q, k, v, scheme=scheme, causal=causal))
                           for t, m in TREES.items()}
                    outs = {t: f() for t, f in fns.items()}
                    row.update({f"max_abs_diff_{t}_old": diff(o, outs["old"]) for t, o in outs.items() if t != "old"})
                    if "rn" in outs:
                        row["max_abs_diff_new_rn"] = diff(outs["new"], outs["rn"])
                    res = {t: [] for t in fns}
                    for _ in range(5):
                        for key, f in fns.items():
                            res[key].append(time_cuda(f, [()], warmup=3, reps=20)["median_ms"] * 1e3)
                    t = {key: {"median": round(sorted(x)[2], 3), "min": round(min(x), 3), "max": round(max(x), 3)}
                         for key, x in res.items()}
                    row.update(us=t, **{f"{k}_over_old": round(t[k]["median"] / t["old"]["median"], 4) for k in t})
                except Exception as exc:  # noqa: BLE001
                    row["error"] = repr(exc)[:600]
                probe_row(doc, f"a {scheme} S={S} causal={causal}", row)


def main():
    run_probe_parts("benchmarks/device/s36_ab.py", {"q": part_q, "a": part_a},
                    "qa", "s36_ab.json")


if __name__ == "__main__":
    main()
