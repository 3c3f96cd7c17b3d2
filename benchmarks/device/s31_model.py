"""Session-31 model A/B: session 30's defaults (the kv4 decode's scatter epilogue, ``GLUON_CSTORE = False``; the
w4a8-fp8 decode split to 2 programs per SM at every tile height) then session 31's (``"short"``; 1.5 at 32 / 64
tokens), in one process: decode at batch 1 / 16 / 64, ctx 1k / 8k, all 32 Llama-3-8B-shaped layers, ``fireq``
(w4a8-fp8 linears + the INT4 cache) and ``qserve`` beside bf16.

    PYTHONPATH=$PWD python3 benchmarks/device/s31_model.py OUT   (env S31_RECIPES, S31_BATCHES, S31_CTX, S31_BUDGET,
    S31_MODES: run each mode in its own process, the first one's memory is not all given back)
"""
import os
import sys

sys.path.insert(0, os.getcwd())
from lowbit.bench import model as BM  # noqa: E402
from lowbit.kernels import decode_kv4 as DK  # noqa: E402
from lowbit.kernels import w4a8_fp8_gemm as F8  # noqa: E402

recipes = tuple(os.environ.get("S31_RECIPES", "fireq,qserve").split(","))
batches = [int(b) for b in os.environ.get("S31_BATCHES", "1,16,64").split(",")]
ctx = [int(c) for c in os.environ.get("S31_CTX", "1024,8192").split(",")]
budget = float(os.environ.get("S31_BUDGET", "170"))
split31, cstore31 = dict(F8.DECODE_SPLIT_PER_SM), DK.GLUON_CSTORE
for mode in os.environ.get("S31_MODES", "s30,s31").split(","):  # one per process: the first one's memory stays
    F8.DECODE_SPLIT_PER_SM = {16: 2.0, 32: 2.0, 64: 2.0} if mode == "s30" else split31
    DK.GLUON_CSTORE = False if mode == "s30" else cstore31
    BM.run(os.path.join(sys.argv[1], f"model_{mode}"), recipes=recipes, prefill_seqs=[1024],
           decode_batches=batches, decode_ctx=ctx, layers=32, time_budget_s=budget,
           command=f"PYTHONPATH=$PWD python3 benchmarks/device/s31_model.py OUT ({mode} defaults; env "
                   + " ".join(f"{k}={os.environ[k]}" for k in ("S31_RECIPES", "S31_BATCHES", "S31_CTX", "S31_BUDGET",
                                                                     "S31_MODES")
                              if k in os.environ) + ")")
