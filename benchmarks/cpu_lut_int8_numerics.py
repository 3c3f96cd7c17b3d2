"""CPU numerics study (session 22, no GPU): would an INT8 compute path for the weight-only LUT format keep its accuracy?

The LUT kernels decode each 4-bit code into a 16-bit operand (22 integer instructions per 8 codes), and that decode
bounds them at 16-64 tokens (README lut section, session 22). An INT8 tensor-core path would decode into bytes
(~12 per 8 codes, no interleave) if (a) the table were rounded to INT8 (``T8 = round(127 T / max|T|)``, one float
scale per table) and (b) the bf16 activations went in as two INT8 planes per row (``formats.common.int8_planes``,
~15 bits, the w8 / kv4 rule), the products summed exactly in INT32 per scale group. This script measures what each
of the two roundings costs on the embedded model: perplexity of ``flute-nf4`` (and ``flute-nf3``) with the LUT
linears' forward replaced by float emulations of (a), (b) and (a)+(b), beside the unmodified recipe; plus the rel-L2
of one projection's output on random activations against the unrounded product.

    python3 benchmarks/cpu_lut_int8_numerics.py [--max-tokens 8192] [--out FILE.json]
"""
import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lowbit.eval.corpus import load_text, tokenize  # noqa: E402
from lowbit.eval.perplexity import perplexity  # noqa: E402
from lowbit.eval.pipeline import load, quantize  # noqa: E402
from lowbit.formats.common import int8_planes  # noqa: E402
from lowbit.nn.lut import LUTLinear  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--max-tokens", type=int, default=8192)
ap.add_argument("--recipes", default="flute-nf4,flute-nf3")
ap.add_argument("--out")
args = ap.parse_args()


def int8_table(table: torch.Tensor) -> torch.Tensor:
    """(a): the table rounded to INT8 steps of max|T| / 127 (returned dequantized, float32)."""
    step = table.abs().max().clamp_min(1e-30) / 127
    return torch.round(table / step).clamp(-127, 127) * step


def planes(x: torch.Tensor) -> torch.Tensor:
    """(b): each row as two INT8 planes (``int8_planes``), dequantized."""
    hi, lo, a = int8_planes(x)
    return (hi.float() + lo.float() / 254) * (a / 127).unsqueeze(-1)


def emulate(mode: str):
    """A LUTLinear forward with the weight from the (rounded) table and the (rounded) activations, float32 math."""
    def fwd(self, x, *, pdl=False):
        codes = self.codes().long()
        table = int8_table(self.table.float()) if "table" in mode else self.table.float()
        s = self.scales.float().t().repeat_interleave(self.group_size, dim=1)[:, :self.in_features]
        w = table[codes] * s
        xin = planes(x) if "planes" in mode else x.float()
        y = xin @ w.t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)
    return fwd


doc = {"env": {"python": platform.python_version(), "torch": torch.__version__, "device": "cpu",
               "command": "python3 benchmarks/cpu_lut_int8_numerics.py " + " ".join(sys.argv[1:]),
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, "rows": {}}
orig = LUTLinear.forward
for recipe in args.recipes.split(","):
    loaded = load(None, device="cpu", dtype=torch.float32)
    ids = tokenize(loaded.tokenizer, load_text())
    model = quantize(loaded.model, recipe)
    row = {}
    for mode in ("kernel numerics", "table", "planes", "table+planes"):
        LUTLinear.forward = orig if mode == "kernel numerics" else emulate(mode)
        t0 = time.time()
        with torch.no_grad():
            row[mode] = round(perplexity(model, ids, max_tokens=args.max_tokens).perplexity, 4)
        print(recipe, mode, row[mode], f"{time.time() - t0:.0f}s", flush=True)
    LUTLinear.forward = orig
    # one projection: rel-L2 of each rounding on random activations against the unrounded float64 product
    lin = next(m for m in model.modules() if isinstance(m, LUTLinear))
    x = torch.randn(64, lin.in_features)
    with torch.no_grad():
        ref = emulate("")(lin, x.double()).double()
        for mode in ("table", "planes", "table+planes"):
            y = emulate(mode)(lin, x).double()
            row[f"rel_l2_{mode} (random x, first LUT linear)"] = float((y - ref).norm() / ref.norm())
    doc["rows"][recipe] = row
    print(recipe, row, flush=True)
LUTLinear.forward = orig
if args.out:
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
