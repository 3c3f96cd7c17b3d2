"""Device script (session 38): host (CPU) time per eager call of each lowbit linear at M = 1 (Llama-3-8B gate_up
shape), against its GPU time in a CUDA graph: how much an eager caller (transformers' path, MoE experts) pays for
launching. Also one MoE experts call under torch.profiler (CPU self time by op). Writes <out>/s38_host.json."""
import argparse
import json
import sys
import time

import torch

sys.path.insert(0, ".")
import lowbit  # noqa: E402
from lowbit.bench.harness import graph_us  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()
torch.manual_seed(0)
N, K = 28672, 4096
lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
mods = {"bf16": lin}
for name, scheme, opts in (("w4a8-fp8", "w4a8-fp8", {}), ("lut nf4", "lut", dict(bits=4)), ("w4a8-int8", "w4a8-int8", {})):
    mods[name] = lowbit.quantize_linear(lin, scheme, group_size=128, **opts)
x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
rows = []
for name, m in mods.items():
    with torch.no_grad():
        for _ in range(5):
            m(x)
        torch.cuda.synchronize()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            m(x)
        host = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n * 1e6
        g = graph_us(lambda: m(x))
    rows.append(dict(linear=name, host_us_per_call=round(host, 1), eager_wall_us_per_call=round(wall, 1),
                     graph_gpu_us=round(g, 1)))
    print(rows[-1], flush=True)

# the MoE experts call, profiled
from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: E402

from lowbit.nn.moe import QuantExperts  # noqa: E402

cfg = MixtralConfig(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)
with torch.device("cuda"):
    ex = MixtralExperts(cfg).to(torch.bfloat16)
with torch.no_grad():
    ex.gate_up_proj.normal_(0, 0.02)
    ex.down_proj.normal_(0, 0.02)
qe = QuantExperts.from_experts(ex, "w4a8-fp8")
xs = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
idx = torch.tensor([[1, 5]], device="cuda")
w = torch.tensor([[0.6, 0.4]], device="cuda")
with torch.no_grad():
    for _ in range(3):
        qe(xs, idx, w)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        qe(xs, idx, w)
    torch.cuda.synchronize()
    moe_wall = (time.perf_counter() - t0) / 20 * 1e6
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            qe(xs, idx, w)
        torch.cuda.synchronize()
table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
print("moe experts wall us/call", round(moe_wall, 1))
print(table)
json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, command="python3 benchmarks/device/s38_host.py",
               rows=rows, moe_w4a8_fp8_wall_us=round(moe_wall, 1), moe_profile=table),
          open(f"{a.out}/s38_host.json", "w"), indent=1)
