"""Session 33: the embedded model's perplexity with a ``kv4-zp`` (QServe KV4) cache under the FP8 scale rule since
session 33 (``lowbit.formats.kv4``: nearest, or the next value up where nearest would clip the top code) and the
rule before (always nearest), same process, CPU reference path.

    python3 benchmarks/s33_kvzp_rounding.py [--tokens 8192] [--out benchmarks/results/cpu/s33_kvzp_rounding.json]
"""
import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lowbit.formats.kv4 as fk  # noqa: E402
from lowbit.eval.corpus import load_text, tokenize  # noqa: E402
from lowbit.eval.perplexity import perplexity  # noqa: E402
from lowbit.models.hf_attention import install_quantized_attention, uninstall_quantized_attention  # noqa: E402
from lowbit.models.loading import load_model  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--out", default="benchmarks/results/cpu/s33_kvzp_rounding.json")
ap.add_argument("--device", default="cpu", help="cpu (reference path) or cuda (the kernels)")
args = ap.parse_args()
torch.manual_seed(0)
model, tok = load_model(None, device=args.device)
ids = tokenize(tok, load_text())
rows = {"fp32 (no KV quantization)": perplexity(model, ids, max_tokens=args.tokens).perplexity}
orig = fk.round_scale
variants = (("kv4-zp, nearest scale unless it clips, then up (session 33)", True),
            ("kv4-zp, nearest scale always (before)", False))
if args.device != "cpu":  # the GPU cache is written by the append kernel, which this switch does not reach
    variants = (("kv4-zp (session 33 rule; the append kernel)", True),)
for name, up in variants:
    fk.round_scale = (lambda s, sd=fk.FP8_E4M3, up=False, _o=orig, _u=up: _o(s, sd, up=up and _u))
    t0 = time.time()
    install_quantized_attention(model, kv="kv4-zp")
    rows[name] = perplexity(model, ids, max_tokens=args.tokens).perplexity
    uninstall_quantized_attention(model)
    print(f"{name}: {rows[name]:.4f} ({time.time() - t0:.0f} s)", flush=True)
fk.round_scale = orig
print(json.dumps(rows, indent=1))
os.makedirs(os.path.dirname(args.out), exist_ok=True)
gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
json.dump({"env": {"machine": gpu or f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores",
                   "torch": torch.__version__, "commit": os.environ.get("S33_COMMIT", "unknown"), "command": "python3 benchmarks/s33_kvzp_rounding.py "
                   + " ".join(sys.argv[1:]), "model": "SmolLM2-135M-Instruct (embedded, FP32)",
                   "tokens": args.tokens},
           "ppl": rows}, open(args.out, "w"), indent=1)
