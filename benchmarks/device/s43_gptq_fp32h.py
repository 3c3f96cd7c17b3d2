"""Session 43 A/B: ``s42_gptq.py --gptq-only`` with the Hessians on the float32 GEMM (the input cast to float32
first, so ``hessian_update`` takes its non-TF32 path: session 42's arithmetic), to tell the TF32 Hessians' effect on
the embedded model's GPTQ perplexities from run-to-run chaos. Arguments as s42_gptq.py's."""
import runpy
import sys

import lowbit.ptq.gptq as g

_orig = g.hessian_update
g.hessian_update = lambda h, n, x: _orig(h, n, x.float())
sys.argv = ["benchmarks/device/s42_gptq.py"] + sys.argv[1:]
runpy.run_path("benchmarks/device/s42_gptq.py", run_name="__main__")
