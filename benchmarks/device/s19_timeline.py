"""Session-19 probe (issue 7): the CUDA-graph timeline of one batch-1 decode step (ctx 1k, Llama-3-8B shapes, 2 layers
+ head) for each recipe named in ``S19_RECIPES`` (default ``flute-nf4,qserve,fireq``): every kernel's time and the gap
before it, to see where weight-only ``flute-nf4`` loses the ~7 us per layer it trails ``qserve`` by.

    PYTHONPATH=$PWD python3 benchmarks/device/s19_timeline.py --out DIR

Writes ``profile_<recipe>.txt`` (top kernels + timeline) and ``s19_timeline.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, write_probe  # noqa: E402
from lowbit.bench.model import _quantize, build_model, profile_provider, provider_spec  # noqa: E402

args = probe_args("t")
doc = {"env": env_info("PYTHONPATH=$PWD python3 benchmarks/device/s19_timeline.py " + " ".join(sys.argv[1:]))}
for name in os.environ.get("S19_RECIPES", "flute-nf4,qserve,fireq").split(","):
    _, _, gopts, _ = provider_spec(name)
    model = build_model(2)
    if not name.startswith("bf16"):
        model = _quantize(model, name)
    res = profile_provider(name, model, args.out, layers=2, prefill=False, extra_decode_batches=(), gen_opts=gopts)
    tl = res["decode"].get("graph_timeline", {})
    probe_row(doc, name, {"graph_step_us": res["decode"].get("graph_us"), "span_us": tl.get("span_us"),
                          "sum_kernel_us": tl.get("sum_kernel_us"), "sum_gap_us": tl.get("sum_gap_us"),
                          "kernels": tl.get("kernels")})
    del model
    torch.cuda.empty_cache()
print(write_probe(doc, args.out, "s19_timeline.json"))
