"""Session-29 model A/B: the activation tiles by TMA (``XTMA``) in the w4a8-fp8 and w4a8-int8 GEMMs switched off
(configs patched), then on (the committed defaults), in one process: prefill 16 x 1024 and decode at batch 64, ctx
1k, all 32 Llama-3-8B-shaped layers, ``fireq`` and ``qserve`` beside bf16.

    PYTHONPATH=$PWD python3 benchmarks/device/s29_model.py OUT   (env S29_RECIPES, S29_BATCHES, S29_LAYERS)
"""
import os
import sys

sys.path.insert(0, os.getcwd())
from lowbit.bench import model as BM  # noqa: E402
from lowbit.kernels import w4a8_fp8_gemm as F8  # noqa: E402
from lowbit.kernels import w4a8_int8_gemm as I8  # noqa: E402

recipes = tuple(os.environ.get("S29_RECIPES", "fireq,qserve").split(","))
batches = [int(b) for b in os.environ.get("S29_BATCHES", "64").split(",")]
layers = int(os.environ.get("S29_LAYERS", "32"))
pick_f8 = F8.pick_config
configs_i8 = dict(I8.CONFIGS)
for mode in ("off", "on"):
    if mode == "off":
        F8.pick_config = lambda *a, **k: {**pick_f8(*a, **k), "XTMA": False}
        I8.CONFIGS.clear()
        I8.CONFIGS.update({b: (*v[:6], {k: x for k, x in v[6].items() if k != "XTMA"}) for b, v in configs_i8.items()})
    else:
        F8.pick_config = pick_f8
        I8.CONFIGS.clear()
        I8.CONFIGS.update(configs_i8)
    BM.run(os.path.join(sys.argv[1], f"model_xtma_{mode}"), recipes=recipes, prefill_seqs=[1024],
           decode_batches=batches, decode_ctx=[1024], layers=layers, time_budget_s=170,
           command=f"PYTHONPATH=$PWD python3 benchmarks/device/s29_model.py OUT (XTMA {mode}; env "
                   + " ".join(f"{k}={os.environ[k]}" for k in ("S29_RECIPES", "S29_BATCHES", "S29_LAYERS")
                              if k in os.environ) + ")")
