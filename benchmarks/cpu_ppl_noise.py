"""CPU script (session 39): the noise floor of an activation-quantized recipe's perplexity. The embedded
SmolLM2-135M's down projections are scaled by (1 + eps), |eps| <= 3e-7 (a change of the float function far below
any measurable effect: the float perplexity moves in the 7th digit), then quantized with ``--recipe`` (default
``fireq`` with linears only, as issue 3's PTS / CAS ablation) and scored. Per-token FP8 / INT8 activations turn
such perturbations into whole quantization steps wherever a value sits near a rounding boundary, so the spread of
these perplexities is the smallest difference between two recipe variants that means anything.

    python3 benchmarks/cpu_ppl_noise.py --out benchmarks/results/cpu/s39_ppl_noise.json
"""
import argparse
import copy
import json
import platform
import sys
import time

import torch

sys.path.insert(0, ".")
import lowbit  # noqa: E402
from lowbit.eval import pipeline  # noqa: E402
from lowbit.eval.corpus import calibration_batches, describe_source, load_text, tokenize  # noqa: E402
from lowbit.eval.perplexity import perplexity  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--recipe", default="fireq")
ap.add_argument("--options", default='{"kv": null, "attention": null}', help="JSON recipe options")
ap.add_argument("--eps", default="0,1e-7,-1e-7,3e-7")
ap.add_argument("--max-tokens", type=int, default=8192)
a = ap.parse_args()
loaded = pipeline.load(None, device="cpu", dtype=torch.float32)
dense, tok = loaded.model, loaded.tokenizer
ids = tokenize(tok, load_text())
calib = calibration_batches(tok, n_samples=8, seq_len=256, seed=0)
opts = json.loads(a.options)
rows = []
for eps in (float(e) for e in a.eps.split(",")):
    m = copy.deepcopy(dense)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.down_proj.weight.mul_(1 + eps)
    t = time.time()
    f = perplexity(m, ids, max_tokens=a.max_tokens, window=1024).perplexity
    q = lowbit.quantize_model(m, a.recipe, calibration=calib, progress=False, **opts)
    rows.append(dict(eps=eps, float_ppl=f, ppl=perplexity(q, ids, max_tokens=a.max_tokens, window=1024).perplexity,
                     seconds=round(time.time() - t, 1)))
    print(rows[-1], flush=True)
ps = [r["ppl"] for r in rows]
json.dump(dict(meta=dict(torch=torch.__version__, transformers=__import__("transformers").__version__,
                         python=platform.python_version(), corpus=describe_source(), max_tokens=a.max_tokens,
                         window=1024, recipe=a.recipe, options=opts,
                         command="python3 benchmarks/cpu_ppl_noise.py " + " ".join(sys.argv[1:])),
               rows=rows, spread=max(ps) - min(ps), spread_rel=(max(ps) - min(ps)) / min(ps)),
          open(a.out, "w"), indent=1)
