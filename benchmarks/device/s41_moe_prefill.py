"""Device script (session 41): MoE experts at prefill sizes (more than ``GROUPED_MAX_TOKENS`` tokens). Per block shape
(Qwen3-30B-A3B: H 2048, I 768, 128 experts top-8; Mixtral-8x7B: H 4096, I 14336, 8 experts top-2; random N(0, 0.02)
bf16 weights, routing by the block's random router on random tokens) and token count, eager calls (``time_cuda``,
router excluded): transformers' bf16 ``grouped_mm`` experts; lowbit's per-expert (sparse) schedule, which such calls
took until session 41; the grouped schedule (``lowbit::moe_*``) forced at these sizes, optionally with overrides of
``lowbit.kernels.moe_grouped``'s knobs. Writes <out>/s41_moe_prefill.json."""
import argparse
import json
import sys
import time

import torch

sys.path[:0] = [".", "benchmarks/device"]
import lowbit  # noqa: E402,F401
import lowbit.kernels.moe_grouped as mg  # noqa: E402
import lowbit.nn.moe as nm  # noqa: E402
from lowbit.bench.harness import time_cuda  # noqa: E402
from lowbit.nn.moe import QuantExperts  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--shapes", default="qwen3:128,1024,4096,16384;mixtral:128,1024,4096")
ap.add_argument("--schemes", default="w4a8-fp8,w4a8-int8,lut")
ap.add_argument("--sparse", default="1", help="also time the per-expert schedule (0: no)")
ap.add_argument("--knobs", default="", help="';'-separated override sets of moe_grouped knobs, e.g. 'BLOCK_M_MAX=128'")
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--limit", type=float, default=1e9, help="stop starting new shapes after this many seconds")
ap.add_argument("--f64", default="", help="'shape:T,...' where each output is also compared with a float64 MoE over the "
                "experts' dequantized weights (no activation or intermediate rounding)")
a = ap.parse_args()
from _moe_block import mixtral_block, token_sets  # noqa: E402

SHAPES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2)}
rows, t_start = [], time.time()


def moe_f64(q, x, idx, w):
    """float64 MoE over the dequantized experts (``module.dequantize()``), silu(gate) * up unrounded."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xd, wd = x.double(), w.double()
    for e in range(q.num_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            g = xd[tok] @ q.gate_up[e].dequantize().double().t()
            i_ = g.shape[1] // 2
            h = torch.nn.functional.silu(g[:, :i_]) * g[:, i_:]
            out.index_add_(0, tok, (h @ q.down[e].dequantize().double().t()) * wd[tok, slot, None])
    return out


def run_knobs(fn, spec):
    import lowbit.ops.moe as om

    mods = {k: (mg if hasattr(mg, k) else om) for k in spec}  # lowbit.kernels.moe_grouped's, else lowbit.ops.moe's

    def g(*args):
        old = {k: getattr(mods[k], k) for k in spec}
        for k, v in spec.items():
            setattr(mods[k], k, v)
        try:
            return fn(*args)
        finally:
            for k, v in old.items():
                setattr(mods[k], k, v)
    return g


knob_sets = [{}] + [{kv.split("=")[0]: (float(kv.split("=")[1]) if "." in kv else int(kv.split("=")[1]))
                     for kv in s.split(",")} for s in a.knobs.split(";") if s]
for part in a.shapes.split(";"):
    name, toks = part.split(":")
    H, I, E, K = SHAPES[name]
    block = mixtral_block(E, K, H, I)
    quant = {s: QuantExperts.from_experts(block.experts, s, group_size=128, **({"bits": 4} if s == "lut" else {})).cuda()
             for s in a.schemes.split(",")}
    for T in [int(t) for t in toks.split(",")]:
        if time.time() - t_start > a.limit:
            print("time limit: skipping", name, T, flush=True)
            continue
        sets = [s_[:3] for s_ in token_sets(block, T, n=3)]
        flop = 2 * T * K * 3 * H * I

        f64 = f"{name}:{T}" in a.f64.split(",")

        def record(variant, fn, ref=None, q=None):
            with torch.no_grad():
                y = fn(*sets[0])
                err = None if ref is None else ((y.double() - ref).norm() / ref.norm()).item()
                e64 = None
                if f64 and q is not None:
                    r64 = moe_f64(q, *sets[0])
                    e64 = round(((y.double() - r64).norm() / r64.norm()).item(), 6)
                t = time_cuda(fn, sets, warmup=2, reps=a.reps, mode="gpu")
            us = t["median_ms"] * 1e3
            rows.append(dict(shape=name, tokens=T, variant=variant, median_us=round(us, 1),
                             min_us=round(t["min_ms"] * 1e3, 1), tflops=round(flop / us / 1e6, 1),
                             rel_l2_vs_sparse=None if err is None else round(err, 6), rel_l2_vs_f64=e64))
            print(rows[-1], flush=True)
            return y

        with torch.no_grad():
            record("bf16 grouped_mm", lambda x, i, w: block.experts(x, i, w))
            for s, q in quant.items():
                ref = None
                if a.sparse == "1":
                    q.grouped = False
                    ref = record(f"lowbit {s} sparse", lambda x, i, w, q=q: q(x, i, w), q=q).double()
                q.grouped = True
                for spec in knob_sets:
                    old = nm.GROUPED_MAX_TOKENS
                    nm.GROUPED_MAX_TOKENS = 1 << 30
                    try:
                        label = f"lowbit {s} grouped" + (" " + ",".join(f"{k}={v}" for k, v in spec.items()) if spec else "")
                        record(label, run_knobs(lambda x, i, w, q=q: q(x, i, w), spec), ref, q=q)
                    except Exception as exc:  # a knob set that does not compile: say so, go on
                        print("FAILED", s, spec, repr(exc)[:300], flush=True)
                    finally:
                        nm.GROUPED_MAX_TOKENS = old
        torch.cuda.empty_cache()
    block = quant = None
    torch.cuda.empty_cache()
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
            transformers=__import__("transformers").__version__,
            command="python3 benchmarks/device/s41_moe_prefill.py --out $OUT " + " ".join(sys.argv[3:]),
            shapes={k: dict(hidden=v[0], intermediate=v[1], experts=v[2], top_k=v[3]) for k, v in SHAPES.items()},
            note="eager calls, router excluded, time_cuda mode gpu (median of reps over 3 token sets); tflops = "
                 "2 T k 3 H I / time; rel_l2 against the per-expert (sparse) schedule's output; rel_l2_vs_f64 (--f64 cases): against a float64 MoE "
                 "over the dequantized experts")
json.dump(dict(meta=meta, rows=rows), open(f"{a.out}/s41_moe_prefill.json", "w"), indent=1)
