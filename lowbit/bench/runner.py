"""``lowbit bench kernels``: run suites on the GPU and write results.

    lowbit bench kernels --suite anchors --out benchmarks/results/h200
"""
from __future__ import annotations

import sys
import traceback

import torch

from lowbit.bench import harness, suites


def run_suites(names: list[str], out_dir: str | None, *, quick: bool = False, ceilings: dict | None = None) -> int:
    if not torch.cuda.is_available():
        print("lowbit bench kernels needs a CUDA GPU (none found). Run it on the GPU machine.", file=sys.stderr)
        return 2
    out_dir = out_dir or f"benchmarks/results/{harness.gpu_slug()}"
    if ceilings is None:
        print("measuring ceilings (copy bandwidth, bf16/fp8/int8 GEMM peaks)...", flush=True)
        ceilings = harness.measure_ceilings()
        print({k: round(v, 2) for k, v in ceilings.items()}, flush=True)
    failed = 0
    for name in names:
        mod = suites.load(name)
        rec = harness.Recorder(name, ceilings=dict(ceilings))
        print(f"== suite {name}", flush=True)
        try:
            mod.run(rec, quick=quick)
        except Exception:
            failed += 1
            traceback.print_exc()
            rec.note("suite aborted: " + traceback.format_exc().strip().splitlines()[-1])
        path = rec.write(out_dir, baseline=getattr(mod, "BASELINE", None), command=" ".join(sys.argv))
        print(open(path.with_suffix(".md")).read(), flush=True)
    return 1 if failed else 0
