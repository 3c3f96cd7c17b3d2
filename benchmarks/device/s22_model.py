"""Session-22 model check: decode B = 1 / 16 at ctx 1k and prefill 16 x 1024 for flute-nf4 (+head8) and fireq beside
bf16, after the LUT small-M launch changes. ``PYTHONPATH=$PWD python3 benchmarks/device/s22_model.py OUT``."""
import os, sys, time
sys.path.insert(0, os.getcwd())
from lowbit.bench import model as BM
t0 = time.time()
B = [int(b) for b in os.environ.get("S22_BATCHES", "1,16").split(",")]
BM.run(os.path.join(sys.argv[1], "model"), recipes=tuple(os.environ.get("S22_RECIPES", "flute-nf4,flute-nf4+head8,fireq")
                                                          .split(",")), prefill_seqs=[1024],
       decode_batches=B, decode_ctx=[1024], time_budget_s=200,
       command="benchmarks/device/s22_model.py (session 22: fragment small-M launches, Gluon 8..16 tokens)")
print("model_s", time.time() - t0)
