"""Session 42: GPTQ (``lowbit.ptq.gptq``) against round to nearest on the embedded model, on the H200, in the setting
of the README's accuracy table (``lowbit.eval.ablation``: bf16 activations, first 8192 tokens, window 1024,
calibration = the corpus, 16 x 512 tokens, seed 0). Needs the embedded model (``round.sh``'s two GGUF parts).

    PYTHONPATH=. python3 benchmarks/device/s42_gptq.py --out $OUT/s42_gptq

Session 43 re-ran the GPTQ rows after GPTQ moved to the Triton column kernel and TF32 Hessians
(``--gptq-only --name s43_gptq_ppl``, through ``s43_final.sh``).
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
ap.add_argument("--budget", type=float, default=400)
ap.add_argument("--gptq-only", action="store_true", help="FP32 and the GPTQ rows only")
ap.add_argument("--name", default="s42_gptq_ablation", help="output files' stem")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
L0 = dict(kv=None, attention=None)
ROWS = [("FP32", None, {})] + ([] if a.gptq_only else [("BF16", None, {})])
for label, recipe, opts in [("fireq linears (CAS+PTS)", "fireq", L0), ("fireq full", "fireq", {}),
                            ("qserve linears", "qserve", L0), ("qserve full", "qserve", {}),
                            ("flute-nf4", "flute-nf4", {}), ("flute-nf3", "flute-nf3", {}),
                            ("lut RTN INT4", "flute-nf4", dict(table="int"))]:
    if not a.gptq_only:
        ROWS.append((f"{label} RTN", recipe, dict(opts)))
    ROWS.append((f"{label} GPTQ", recipe, dict(opts, gptq=True)))
loaded = pipeline.load(None, device="cuda", dtype=torch.float32)
t = time.time()
rows = ablation.run_ablation(loaded.model, loaded.tokenizer, rows=ROWS, time_budget_s=a.budget)
env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
       "seconds": round(time.time() - t, 1)}
with open(os.path.join(a.out, a.name + ".json"), "w") as f:
    json.dump({"env": env, "rows": rows}, f, indent=1, default=str)
with open(os.path.join(a.out, a.name + ".md"), "w") as f:
    f.write(ablation.to_markdown(rows) + "\n")
print(ablation.to_markdown(rows))
