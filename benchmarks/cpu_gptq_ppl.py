"""CPU script (session 42): GPTQ (``lowbit.ptq.gptq``) against round to nearest on the embedded SmolLM2-135M, each
recipe's linears only (no KV / attention quantization, FireQ Table 3's and FLUTE Table 2's linear columns), float32
model, perplexity over the corpus's first ``--max-tokens`` tokens (windows of 1024), calibration = the recipes'
default (16 x 512 tokens, seed 0). Rows: fp32; per recipe RTN, GPTQ (act_order, the default) and GPTQ in column order.

    python3 benchmarks/cpu_gptq_ppl.py --out benchmarks/results/cpu/s42_gptq_ppl.json
    python3 benchmarks/cpu_gptq_ppl.py --lm-head --recipes fireq,flute-nf4 --variants rtn,gptq \
        --out benchmarks/results/cpu/s42_gptq_ppl_lm_head.json
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
from lowbit.eval.corpus import describe_source, load_text, tokenize  # noqa: E402
from lowbit.eval.perplexity import perplexity  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--recipes", default="flute-nf4,fireq,qserve,flute-nf3")
ap.add_argument("--max-tokens", type=int, default=8192)
ap.add_argument("--variants", default="rtn,gptq,gptq-no-act-order")
ap.add_argument("--lm-head", action="store_true", help="lm_head=True too (the head quantized with the linears' scheme)")
a = ap.parse_args()

torch.manual_seed(0)
loaded = pipeline.load(None, device="cpu", dtype=torch.float32)
model, tok = loaded.model, loaded.tokenizer
ids = tokenize(tok, load_text())
rows = []


def dump():
    with open(a.out, "w") as f:
        json.dump({"command": "python3 " + " ".join(sys.argv), "corpus": describe_source(), "max_tokens": a.max_tokens,
                   "window": 1024, "torch": torch.__version__, "machine": platform.machine(),
                   "cpu_threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


t = time.time()
rows.append({"recipe": "fp32", "variant": "-", "ppl": perplexity(model, ids, max_tokens=a.max_tokens).perplexity,
             "quantize_s": 0.0})
print(rows[-1], flush=True)
VARIANTS = {"rtn": False, "gptq": True, "gptq-no-act-order": {"act_order": False}}
LINEARS_ONLY = {"fireq": dict(kv=None, attention=None), "qserve": dict(kv=None, attention=None),
                "flute-nf4": {}, "flute-nf3": {}}
for r in a.recipes.split(","):
    for v in a.variants.split(","):
        m = copy.deepcopy(model)
        t = time.time()
        m = lowbit.quantize_model(m, r, gptq=VARIANTS[v], progress=False, lm_head=a.lm_head, **LINEARS_ONLY[r])
        qs = time.time() - t
        rep = m.lowbit_recipe["reports"].get("gptq")
        rows.append({"recipe": r, "variant": v, "lm_head": a.lm_head, "ppl": perplexity(m, ids, max_tokens=a.max_tokens).perplexity,
                     "quantize_s": round(qs, 1), "gptq_report": rep})
        print(rows[-1], flush=True)
        dump()
        del m
dump()
