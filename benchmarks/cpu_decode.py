"""CPU greedy decoding speed of the embedded SmolLM2-135M, unquantized and per recipe (the plain-PyTorch reference
paths): ms per generated token for 8 new tokens after a warm-up forward, and the tokens.

    OMP_NUM_THREADS=2 python3 benchmarks/cpu_decode.py [--json FILE] fp32 fireq flute-nf4 qserve
"""
import argparse
import copy
import json
import platform
import sys
import time

import torch

from lowbit.eval import pipeline

ap = argparse.ArgumentParser()
ap.add_argument("recipes", nargs="+")
ap.add_argument("--json")
ap.add_argument("--new-tokens", type=int, default=8)
a = ap.parse_args()
torch.manual_seed(0)
loaded = pipeline.load(None, device="cpu", dtype=torch.float32)
base, tok = loaded.model, loaded.tokenizer
calib = pipeline.calibration(tok, n_samples=4, seq_len=128, seed=0)
rows = []
for name in a.recipes:
    m = base if name == "fp32" else pipeline.quantize(copy.deepcopy(base), name, calibration=calib)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        m(ids)
        t0 = time.perf_counter()
        out = m.generate(ids, max_new_tokens=a.new_tokens, do_sample=False)
        dt = time.perf_counter() - t0
    row = {"recipe": name, "ms_per_token": round(dt / a.new_tokens * 1000, 1),
           "tokens": tok.decode(out[0, ids.shape[1]:])}
    rows.append(row)
    print(row, flush=True)
if a.json:
    with open(a.json, "w") as f:
        json.dump({"command": "python3 " + " ".join(sys.argv), "machine": platform.platform(),
                   "python": platform.python_version(), "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
