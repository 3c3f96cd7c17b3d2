"""Session-25 probe (issue 7): the kernels of one CUDA-graph decode step of the weight-only ``flute-nf4`` recipe at
batch 64, ctx 1k (Llama-3-8B shapes, 2 layers + head, ``lowbit.bench.model``'s model and runner), in GPU order with
the idle gap before each (``lowbit.bench.model.graph_timeline``): where the step's time goes against 1.5x bf16.

    PYTHONPATH=$PWD python3 benchmarks/device/s25_profile.py OUT   (env S25_BATCH, S25_RECIPE)
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench import model as BM  # noqa: E402
from lowbit.bench.harness import env_info  # noqa: E402
from lowbit.models.generate import Generator  # noqa: E402

out = sys.argv[1]
B = int(os.environ.get("S25_BATCH", "64"))
recipe = os.environ.get("S25_RECIPE", "flute-nf4")
ctx, layers = 1024, 2
model = BM.build_model(layers)
if recipe != "bf16":
    BM._quantize(model, recipe)
gen = Generator(model, max_batch=B, max_seq=ctx + 1, layers=layers)
dev = next(model.parameters()).device
tok = torch.randint(0, model.config.vocab_size, (B,), device=dev)
pos = torch.full((B,), ctx, device=dev)
gen.decode(tok, pos)  # capture
tl = BM.graph_timeline(lambda: gen.decode(tok, pos), reps=5)
text = BM.timeline_text(tl, f"{recipe}: decode B={B} ctx {ctx}, CUDA-graph replay ({layers} layers + head)")
print(text)
doc = {"env": env_info(" ".join(sys.argv)), "recipe": recipe, "batch": B, "ctx": ctx, "layers": layers, "timeline": tl}
with open(os.path.join(out, f"s25_profile_{recipe}_B{B}.json"), "w") as f:
    json.dump(doc, f, indent=1)
