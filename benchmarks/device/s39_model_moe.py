"""Device script (session 39): ``lowbit bench model --arch mixtral-8x7b`` in a shorter form (2 decoder layers
scaled to 32, decode batches 1 / 16 / 64 at ctx 1024, prefill 1024, recipes fireq (grouped MoE schedule) and
flute-nf4 (per-expert dense schedule in graphs)). Writes model_mixtral_8x7b.* into --out."""
import argparse
import sys

sys.path.insert(0, ".")
from lowbit.bench.model import run  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--recipes", default="fireq,flute-nf4")
ap.add_argument("--budget", type=float, default=240)
a = ap.parse_args()
run(a.out, layers=a.layers, recipes=tuple(a.recipes.split(",")), prefill_seqs=[1024], decode_batches=[1, 16, 64],
    decode_ctx=[1024], time_budget_s=a.budget, arch="mixtral-8x7b",
    command=f"python3 benchmarks/device/s39_model_moe.py --out $OUT --layers {a.layers} --recipes {a.recipes}")
