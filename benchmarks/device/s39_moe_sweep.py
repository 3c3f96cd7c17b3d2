"""Device script (session 39): launch configs of the grouped w4a8-fp8 MoE GEMM (``lowbit.kernels.moe_grouped``
module constants) on the Mixtral-8x7B-shaped experts of ``s39_moe.py``, the whole ``lowbit::moe_w4a8_fp8`` op timed
inside CUDA graphs (``graph_us``, 16 calls over 8 token sets), outputs compared with the default config's.
Writes <out>/s39_moe_sweep.json."""
import argparse
import itertools
import json
import sys

import torch

sys.path[:0] = [".", "benchmarks/device"]
import lowbit.kernels.moe_grouped as MK  # noqa: E402
from lowbit.bench.harness import graph_us  # noqa: E402
from lowbit.nn.moe import QuantExperts  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--tokens", default="1,16,64")
a = ap.parse_args()
from _moe_block import mixtral_block, token_sets  # noqa: E402

block = mixtral_block()
qe = QuantExperts.from_experts(block.experts, "w4a8-fp8", group_size=128).cuda()
default = dict(BLOCK_N=MK.BLOCK_N, NUM_WARPS=MK.NUM_WARPS, NUM_STAGES=MK.NUM_STAGES, SPLIT_TARGET=MK.SPLIT_TARGET)
configs = [default] + [dict(BLOCK_N=bn, NUM_WARPS=w, NUM_STAGES=st, SPLIT_TARGET=sp)
                       for bn, w, st, sp in itertools.product((64, 128), (4, 8), (3, 4, 6), (2.0, 8.0))
                       if not (bn == 64 and w == 8)]
rows = []
for T in [int(t) for t in a.tokens.split(",")]:
    sets = token_sets(block, T)
    ref = None
    for c in configs:
        for k_, v in c.items():
            setattr(MK, k_, v)
        try:
            with torch.no_grad():
                y = qe(*sets[0]).double()
                us = graph_us([(lambda s=s_: qe(*s)) for s_ in sets], n=16, reps=10)
        except Exception as exc:  # a config that does not compile (shared memory)
            rows.append(dict(tokens=T, **c, error=repr(exc)[:200]))
            print(rows[-1], flush=True)
            continue
        ref = y if ref is None else ref
        rows.append(dict(tokens=T, **c, graph_us=round(us, 1), rel_l2_vs_default=((y - ref).norm() / ref.norm()).item()))
        print(rows[-1], flush=True)
    for k_, v in default.items():
        setattr(MK, k_, v)
meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
            command="python3 benchmarks/device/s39_moe_sweep.py --out $OUT", default=default)
json.dump(dict(meta=meta, rows=rows), open(f"{a.out}/s39_moe_sweep.json", "w"), indent=1)
