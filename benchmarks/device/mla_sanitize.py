"""compute-sanitizer target: lowbit's Gluon MLA decode kernels on small cases (MTP rows, ragged lengths, one below a
block, splits), shuffled pages of 64: the few-rows FP8 kernel (``lowbit.kernels.mla_decode_gluon``, ``few``) and the
warp-specialized bf16 and FP8 kernels (``lowbit.kernels.mla_decode_wgmma``, ``ws``).

    compute-sanitizer --tool memcheck python3 benchmarks/device/mla_sanitize.py [--kernels few,ws]
    compute-sanitizer --tool racecheck python3 benchmarks/device/mla_sanitize.py [--kernels few,ws]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from lowbit.bench.suites.mla import make_caches  # noqa: E402
from lowbit.kernels import mla_decode_wgmma as W  # noqa: E402
from lowbit.kernels.mla_decode_gluon import mla_decode_few_gluon  # noqa: E402
from lowbit.kernels.mla_quant import latent_quant_triton  # noqa: E402
from lowbit.ops.mla import _rows  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--kernels", default="few,ws")
kernels = ap.parse_args().kernels.split(",")
CASES = {"few": [(2, 4, 4, [300, 37], None), (1, 16, 1, [700], 2)],
         "ws": [(2, 64, 2, [300, 37], None), (1, 128, 1, [700], 2)]}

for kind in kernels:
    for B, H, Sq, lens, splits in CASES[kind]:
        c = make_caches(B, max(lens), fp8=True, bf16=kind == "ws", seed=1)
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(B, Sq, H, 576, device="cuda", dtype=torch.bfloat16)
        R = Sq * H
        kw = dict(num_heads=H, sm_scale=576 ** -0.5, max_seq_len=max(lens), page_size=64, num_splits=splits)
        qc, qs, qr = latent_quant_triton(q.reshape(-1, 576), 512)
        a8 = (qc.view(B, R, 512), qr.view(B, R, 64), qs.view(B, R), _rows(c["fp8"][0]), _rows(c["fp8"][1]),
              c["fp8"][2].reshape(-1), c["page_table"], sl)
        outs = {}
        if kind == "few":
            outs["fp8"] = mla_decode_few_gluon(*a8, **kw)
        else:
            q3 = q.reshape(B, R, 576)
            outs["bf16"] = W.mla_decode_wgmma(q3[..., :512], q3[..., 512:], None, _rows(c["bf16"][0]),
                                              _rows(c["bf16"][1]), None, c["page_table"], sl, **kw)
            outs["fp8"] = W.mla_decode_wgmma(*a8, **kw)
        torch.cuda.synchronize()
        print(f"{kind} B={B} H={H} Sq={Sq} lens={lens} splits={splits}: "
              + " ".join(f"{k} finite={bool(torch.isfinite(o).all())}" for k, o in outs.items()))
