"""Session 43: what GPTQ costs at model level on the H200 now that its column loop is a Triton kernel
(``lowbit.kernels.gptq_block``): ``quantize_model(model, recipe, calibration, gptq=True)`` against the same call
without GPTQ, on a Llama-3-8B-shaped model (hidden 4096, MLP 14336, 32 / 8 heads, vocab 128256) with
``--layers`` decoder layers and random weights (no download), in bf16, calibrated on random token windows
(``--samples`` x ``--seq``; the GPTQ paper used 128 x 2048). The seconds of the whole call (Hessians, layer
forwards, GPTQ, packing) and, by difference, what GPTQ adds per layer.

    PYTHONPATH=$PWD python3 benchmarks/device/s43_gptq_model.py --out DIR [--layers 2] [--samples 128 --seq 2048]
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--samples", type=int, default=128)
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--recipes", default="fireq,qserve,flute-nf4")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)

import lowbit  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  num_hidden_layers=a.layers, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
g = torch.Generator().manual_seed(0)
calib = [torch.randint(0, cfg.vocab_size, (1, a.seq), generator=g) for _ in range(a.samples)]
doc = {"env": env_info("PYTHONPATH=$PWD python3 benchmarks/device/s43_gptq_model.py " + " ".join(sys.argv[1:])),
       "config": dict(layers=a.layers, samples=a.samples, seq=a.seq, dtype="bfloat16"), "rows": {}}


def build():
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


for recipe in a.recipes.split(","):
    for gptq in (False, True):
        model = build()
        torch.cuda.synchronize()
        t = time.perf_counter()
        lowbit.quantize_model(model, recipe, calibration=calib, gptq=gptq, progress=False)
        torch.cuda.synchronize()
        sec = time.perf_counter() - t
        doc["rows"][f"{recipe} gptq={gptq}"] = {"seconds": round(sec, 2),
                                               "max_mem_GiB": round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)}
        print(recipe, gptq, round(sec, 2), flush=True)
        del model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    r = doc["rows"]
    r[f"{recipe} gptq_added_s_per_layer"] = round((r[f"{recipe} gptq=True"]["seconds"]
                                                   - r[f"{recipe} gptq=False"]["seconds"]) / a.layers, 2)
with open(os.path.join(a.out, "s43_gptq_model.json"), "w") as f:
    json.dump(doc, f, indent=1)
print(json.dumps(doc["rows"], indent=1))
