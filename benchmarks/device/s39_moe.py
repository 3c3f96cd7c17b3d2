"""Device script (session 39): one Mixtral-8x7B-shaped MoE block's experts (H = 4096, I = 14336, E = 8, top-2;
random N(0, 0.02) bf16 weights, routing from a random router on random tokens), the grouped ``w4a8-fp8`` schedule
(``lowbit::moe_w4a8_fp8``) against the per-expert schedules of session 38 (sparse eager, dense in graphs) and
transformers' bf16 ``grouped_mm`` experts, eager and inside CUDA graphs (``lowbit.bench.harness.graph_us``, 16 calls
per graph cycling 8 token sets). Router excluded (identical for all). Writes <out>/s39_moe.json.
Session 40: variants ``lowbit lut grouped`` / ``lowbit lut per-expert`` (4-bit NF g128 experts, the fragment layout)
and ``--lut-sweep`` (the lut grouped kernel's ``LUT_*`` knobs); its runs were saved as ``s40_moe_lut*.json``
(``s40_moe_lut_first.json`` ran the option's first form, ``--lut-stages 2,4``, now ``--lut-sweep 'STAGES=2;STAGES=4'``)."""
import argparse
import json
import statistics
import sys
import time

import torch

sys.path[:0] = [".", "benchmarks/device"]
import lowbit  # noqa: E402,F401
from lowbit.bench.harness import graph_us, time_cuda  # noqa: E402
from lowbit.nn.moe import QuantExperts, dense_schedule  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
ap.add_argument("--reps", type=int, default=40)
ap.add_argument("--experts", type=int, default=8)
ap.add_argument("--top-k", type=int, default=2)
ap.add_argument("--hidden", type=int, default=None, help="session 41: block shape other than Mixtral-8x7B's")
ap.add_argument("--intermediate", type=int, default=None)
ap.add_argument("--variants", default="bf16 grouped_mm,lowbit w4a8-fp8 grouped,lowbit w4a8-fp8 per-expert")
ap.add_argument("--lut-sweep", default="", help="session 40: also time the lut grouped kernel with these overrides of "
                "lowbit.kernels.moe_grouped's LUT_* knobs, e.g. 'STAGES=2;PREFETCH=0,SPLIT_TARGET=4'")
ap.add_argument("--profile", action="store_true", help="also list the GPU kernels of one grouped call per token count")
a = ap.parse_args()

from _moe_block import H, I, mixtral_block, token_sets  # noqa: E402

E, K = a.experts, a.top_k
H, I = a.hidden or H, a.intermediate or I
block = mixtral_block(E, K, H, I)
experts = block.experts
t0 = time.time()
qe = QuantExperts.from_experts(experts, "w4a8-fp8", group_size=128).cuda()
qe8 = QuantExperts.from_experts(experts, "w4a8-int8", group_size=128).cuda() if "int8" in a.variants else None
# session 40: flute-nf4 experts (lut, 4-bit NF, g128, the fragment layout)
qlut = (QuantExperts.from_experts(experts, "lut", bits=4, group_size=128).cuda()
        if "lut" in a.variants or a.lut_sweep else None)
print(f"quantized in {time.time() - t0:.1f} s", flush=True)


def lowbit_call(grouped, mod=None):
    def f(x, idx, w):
        m = qe if mod is None else mod
        m.grouped = grouped
        return m(x, idx, w)
    return f


variants = {"bf16 grouped_mm": lambda x, idx, w: experts(x, idx, w),
            "lowbit w4a8-fp8 grouped": lowbit_call(True),
            "lowbit w4a8-fp8 per-expert": lowbit_call(False),
            "lowbit w4a8-int8 grouped": lowbit_call(True, qe8), "lowbit w4a8-int8 per-expert": lowbit_call(False, qe8),
            "lowbit lut grouped": lowbit_call(True, qlut), "lowbit lut per-expert": lowbit_call(False, qlut)}
variants = {k: v for k, v in variants.items() if k in a.variants.split(",")}
for spec in [v for v in a.lut_sweep.split(";") if v]:
    knobs = {f"LUT_{kv.split('=')[0]}": float(kv.split("=")[1]) for kv in spec.split(",")}

    def swept(x, idx, w, knobs=knobs):
        import lowbit.kernels.moe_grouped as mg
        old = {k: getattr(mg, k) for k in knobs}
        for k, v in knobs.items():
            setattr(mg, k, int(v) if v == int(v) and k != "LUT_SPLIT_TARGET" else v)
        try:
            return lowbit_call(True, qlut)(x, idx, w)
        finally:
            for k, v in old.items():
                setattr(mg, k, v)
    variants[f"lowbit lut grouped {spec}"] = swept
own = {"int8": qe8, "lut": qlut}
rows = []
profiles = {}
for T in [int(t) for t in a.tokens.split(",")]:
    sets = [(*s_, int(torch.unique(s_[1]).numel())) for s_ in token_sets(block, T)]
    hit = statistics.mean(s[3] for s in sets)
    with torch.no_grad():
        ref = lowbit_call(False)(*sets[0][:3]).double()
        bf = experts(*sets[0][:3]).double()
    for name, fn in variants.items():
        with torch.no_grad():
            y = fn(*sets[0][:3]).double()
            fam = next((f for f in own if f in name), None)
            if fam:  # against its own per-expert schedule
                r8 = lowbit_call(False, own[fam])(*sets[0][:3]).double()
                err = ((y - r8).norm() / r8.norm()).item()
            else:
                err = ((y - ref).norm() / ref.norm()).item()
            err_bf = ((y - bf).norm() / bf.norm()).item()
            # eager calls, each timed alone (host time included: mode "sync")
            t = time_cuda(fn, [s_[:3] for s_ in sets], warmup=3, reps=a.reps, mode="sync")
            with dense_schedule():
                gus = graph_us([(lambda s=s_, f=fn: f(*s[:3])) for s_ in sets], n=16, reps=10)
        dense_reads_all = name.endswith("per-expert")  # in a graph the per-expert modules take the dense schedule
        gb = hit * 3 * H * I * (2 if name.startswith("bf16") else 0.5) / 1e9
        gb_graph = (E if dense_reads_all else hit) * 3 * H * I * (2 if name.startswith("bf16") else 0.5) / 1e9
        us = t["median_ms"] * 1e3
        rows.append(dict(tokens=T, variant=name, eager_median_us=round(us, 1), eager_min_us=round(t["min_ms"] * 1e3, 1),
                         graph_us=round(gus, 1), experts_hit=hit, weight_gb=round(gb, 3),
                         graph_weight_tb_s=round(gb_graph / (gus * 1e-6) / 1e3, 3),
                         rel_l2_vs_per_expert=round(err, 5), rel_l2_vs_bf16=round(err_bf, 4)))
        print(rows[-1], flush=True)
    if a.profile:  # GPU time per kernel of one eager grouped call (torch.profiler)
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            lowbit_call(True)(*sets[1][:3])
            torch.cuda.synchronize()
        ks = [(e.key[:60], round(e.device_time_total, 1)) for e in prof.key_averages() if e.device_time_total > 0]
        profiles[T] = dict(kernels=sorted(ks, key=lambda r: -r[1]), total_us=round(sum(t for _, t in ks), 1))
        print(T, profiles[T], flush=True)
    base = {r["variant"]: r for r in rows if r["tokens"] == T}
    for r in rows:
        if r["tokens"] == T:
            b = base.get("bf16 grouped_mm")
            if b:
                r["eager_speedup_vs_bf16_grouped_mm"] = round(b["eager_median_us"] / r["eager_median_us"], 2)
                r["graph_speedup_vs_bf16_grouped_mm"] = round(b["graph_us"] / r["graph_us"], 2)
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=__import__("triton").__version__, transformers=__import__("transformers").__version__,
            command="python3 benchmarks/device/s39_moe.py --out $OUT " + " ".join(sys.argv[3:]),
            shape=dict(hidden=H, intermediate=I, experts=E, top_k=K), reps=a.reps,
            note="experts call only (router excluded); graph_us: per call inside a CUDA graph of 16 calls over 8 "
                 "token sets; graph_weight_tb_s = weight bytes read (dense per-expert schedule: all experts) / time")
json.dump(dict(meta=meta, rows=rows, profiles=profiles), open(f"{a.out}/s39_moe.json", "w"), indent=1)
