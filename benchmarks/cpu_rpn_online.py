"""Session 37, CPU: RPN applied online (post-RoPE key multiplier, the form q/k-norm models such as Qwen3 get) against
RPN folded into k_proj / q_proj, on the embedded SmolLM2-135M (a Llama, where both forms apply): ``fireq`` perplexity
over the first 2048 tokens of the embedded corpus, same calibration, same process, with W4A8 linears and with the
KV4 cache alone (``linear=None``). In exact arithmetic the two forms quantize the same keys; with W4A8 linears they
also differ in what the weight quantization of k_proj / q_proj sees (folded: rows scaled by RPN before it).

    python3 benchmarks/cpu_rpn_online.py [OUT_JSON]   (session 37: benchmarks/results/cpu/rpn_online_s37.json)
"""
import json
import sys
import time

import torch

import lowbit
import lowbit.ptq.rope_kv as rk
from lowbit.eval.corpus import load_text, tokenize
from lowbit.eval.perplexity import perplexity
from lowbit.models.loading import load_model

_fold = rk.apply_rpn


def _online(model, params):
    """``apply_rpn`` with every layer treated as a q/k-norm layer (decision 6): RPN joins ``crs_k``."""
    for p in params:
        if p.rpn is not None and not p.rpn_applied:
            r = p.rpn.float()
            p.crs_k = r if p.crs_k is None else p.crs_k.float() * r
            p.rpn_applied = p.rpn_online = True
    return params


res = {}
configs = {"fireq": {}, "fireq, KV4 only (linear=None)": {"linear": None}}
for cname, opts in configs.items():
    for name, fn in (("folded", _fold), ("online", _online)):
        rk.apply_rpn = fn
        torch.manual_seed(0)
        model, tok = load_model(None, dtype=torch.float32, device="cpu")
        ids = tokenize(tok, load_text(None))
        t0 = time.time()
        lowbit.quantize_model(model, "fireq", tokenizer=tok, progress=False, **opts)
        r = perplexity(model, ids, max_tokens=2048, window=1024, progress=False)
        res[f"{cname}: {name}"] = {"perplexity": r.perplexity, "tokens": r.tokens_scored,
                                   "seconds": time.time() - t0}
        print(cname, name, res[f"{cname}: {name}"], flush=True)
rk.apply_rpn = _fold
out = {"what": __doc__.split("\n\n")[0], "torch": torch.__version__, "rows": res}
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
