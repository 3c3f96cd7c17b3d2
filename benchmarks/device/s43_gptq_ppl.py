"""Session 43: the embedded model's GPTQ perplexities after GPTQ moved to the Triton column kernel and TF32 Hessians
(``lowbit.kernels.gptq_block``, ``lowbit.ptq.gptq.hessian_update``), in session 42's setting (``s42_gptq.py``:
bf16 activations, first 8192 tokens, window 1024, calibration 16 x 512 windows of the corpus, seed 0), GPTQ rows
only (session 42's round-to-nearest rows do not change). Needs the embedded model (``s43_final.sh``).

    PYTHONPATH=. python3 benchmarks/device/s43_gptq_ppl.py --out DIR
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, ".")
from lowbit.eval import ablation, pipeline  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--budget", type=float, default=300)
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
L0 = dict(kv=None, attention=None)
ROWS = [("FP32", None, {})]
for label, recipe, opts in [("fireq linears (CAS+PTS)", "fireq", L0), ("fireq full", "fireq", {}),
                            ("qserve linears", "qserve", L0), ("qserve full", "qserve", {}),
                            ("flute-nf4", "flute-nf4", {}), ("flute-nf3", "flute-nf3", {}),
                            ("lut RTN INT4", "flute-nf4", dict(table="int"))]:
    ROWS.append((f"{label} GPTQ", recipe, dict(opts, gptq=True)))
loaded = pipeline.load(None, device="cuda", dtype=torch.float32)
t = time.time()
rows = ablation.run_ablation(loaded.model, loaded.tokenizer, rows=ROWS, time_budget_s=a.budget)
env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
       "seconds": round(time.time() - t, 1)}
with open(os.path.join(a.out, "s43_gptq_ppl.json"), "w") as f:
    json.dump({"env": env, "rows": rows}, f, indent=1, default=str)
print(ablation.to_markdown(rows))
