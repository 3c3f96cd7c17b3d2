"""Device script (session 38): one Mixtral-8x7B-shaped MoE block's experts (H = 4096, I = 14336, E = 8, top-2;
random N(0, 0.02) bf16 weights, routing from a random router on random tokens) -- transformers' bf16 experts (eager
loop, and its graph-safe ``grouped_mm``) vs lowbit ``QuantExperts`` (w4a8-fp8, lut NF4 g128, w4a8-int8), per call,
the router excluded (identical for all). Median of CUDA-event times over eager calls cycling 8 token sets; with
``--graphs`` also ``lowbit.bench.harness.graph_us`` (16 calls per graph, one per token set in turn) of bf16
``grouped_mm`` and lowbit's experts (their dense schedule at <= 64 tokens). Writes <out>/s38_moe.json."""
import argparse
import json
import statistics
import sys
import time

import torch

sys.path[:0] = [".", "benchmarks/device"]
import lowbit  # noqa: E402,F401
from lowbit.bench.harness import time_cuda  # noqa: E402
from lowbit.nn.moe import QuantExperts  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--tokens", default="1,4,16,64,1024")
ap.add_argument("--reps", type=int, default=40)
ap.add_argument("--graphs", action="store_true", help="also time the graph-capturable paths inside CUDA graphs")
a = ap.parse_args()

from _moe_block import H, I, mixtral_block, token_sets  # noqa: E402  (session 39: one block builder)

E, K = 8, 2
block = mixtral_block(E, K)
experts = block.experts

variants = {}
variants["bf16 eager"] = ("eager", experts)
variants["bf16 grouped_mm"] = ("grouped_mm", experts)
t0 = time.time()
for name, scheme, opts in (("lowbit w4a8-fp8", "w4a8-fp8", {}), ("lowbit lut nf4", "lut", dict(bits=4)),
                           ("lowbit w4a8-int8", "w4a8-int8", {})):
    variants[name] = (None, QuantExperts.from_experts(experts, scheme, group_size=128, **opts).cuda())
print(f"quantized in {time.time() - t0:.1f} s", flush=True)


def call(kind, mod, x, idx, w):
    if kind is not None:
        experts.config._experts_implementation = kind
    return mod(x, idx, w)


rows = []
for T in [int(t) for t in a.tokens.split(",")]:
    sets = [(*s_, int(torch.unique(s_[1]).numel())) for s_ in token_sets(block, T)]
    ref = None
    for name, (kind, mod) in variants.items():
        with torch.no_grad():
            try:
                y = call(kind, mod, *sets[0][:3])
            except Exception as exc:  # a peer path that does not run here
                rows.append(dict(tokens=T, variant=name, error=repr(exc)[:300]))
                print(T, name, "error", repr(exc)[:200], flush=True)
                continue
            if ref is None:
                ref = y.double()
            err = ((y.double() - ref).norm() / ref.norm()).item()
            # eager calls, each timed alone (host time included; session 39: the harness's "sync" mode)
            t = time_cuda(lambda *xs, k_=kind, m_=mod: call(k_, m_, *xs), [s_[:3] for s_ in sets], warmup=3,
                          reps=a.reps, mode="sync")
        hit = statistics.mean(s[3] for s in sets)
        gb = hit * 3 * H * I * (2 if name.startswith("bf16") else 0.5) / 1e9  # weight bytes of the hit experts
        us = t["median_ms"] * 1e3
        rows.append(dict(tokens=T, variant=name, median_us=round(us, 1), min_us=round(t["min_ms"] * 1e3, 1),
                         experts_hit=hit, weight_gb=round(gb, 3), weight_tb_s=round(gb / (us * 1e-6) / 1e3, 3),
                         rel_l2_vs_bf16_eager=round(err, 4)))
        print(rows[-1], flush=True)
    if a.graphs and T <= 64:  # CUDA-graph timings of the graph-capturable paths (bf16 grouped_mm, lowbit dense)
        from lowbit.bench.harness import graph_us

        for name, (kind, mod) in variants.items():
            if kind == "eager":
                continue
            with torch.no_grad():
                fns = [(lambda s=s_, k=kind, m=mod: call(k, m, *s[:3])) for s_ in sets]
                us = graph_us(fns, n=16, reps=10)
            hit = 8 if kind is None else statistics.mean(s[3] for s in sets)  # the dense schedule reads every expert
            gb = hit * 3 * H * I * (2 if name.startswith("bf16") else 0.5) / 1e9
            rows.append(dict(tokens=T, variant=name + " (CUDA graph)", median_us=round(us, 1), weight_gb=round(gb, 3),
                             weight_tb_s=round(gb / (us * 1e-6) / 1e3, 3)))
            print(rows[-1], flush=True)
    base = {r["variant"]: r.get("median_us") for r in rows if r["tokens"] == T}
    for r in rows:
        if r["tokens"] == T and r.get("median_us"):
            r["speedup_vs_bf16_eager"] = round(base["bf16 eager"] / r["median_us"], 2)
            if base.get("bf16 grouped_mm"):
                r["speedup_vs_bf16_grouped_mm"] = round(base["bf16 grouped_mm"] / r["median_us"], 2)
            if base.get("bf16 grouped_mm (CUDA graph)"):
                r["speedup_vs_bf16_grouped_mm_graph"] = round(base["bf16 grouped_mm (CUDA graph)"] / r["median_us"], 2)
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, command="python3 benchmarks/device/s38_moe.py",
            shape=dict(hidden=H, intermediate=I, experts=E, top_k=K), reps=a.reps,
            note="experts call only (router excluded); weight_tb_s = weight bytes of the experts hit / time")
json.dump(dict(meta=meta, rows=rows), open(f"{a.out}/s38_moe.json", "w"), indent=1)
