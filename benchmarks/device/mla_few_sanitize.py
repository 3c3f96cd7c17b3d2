"""compute-sanitizer target: the Gluon few-rows FP8 MLA decode (``lowbit.kernels.mla_decode_gluon``) on two small
cases (MTP rows, ragged lengths, splits), FP8 caches with shuffled pages of 64.

    compute-sanitizer --tool memcheck python3 benchmarks/device/mla_few_sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/device/mla_few_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from lowbit.bench.suites.mla import make_caches  # noqa: E402
from lowbit.kernels.mla_decode_gluon import mla_decode_few_gluon  # noqa: E402
from lowbit.kernels.mla_quant import latent_quant_triton  # noqa: E402

for B, H, Sq, lens, splits in [(2, 4, 4, [300, 37], None), (1, 16, 1, [700], 2)]:
    c = make_caches(B, max(lens), fp8=True, bf16=False, seed=1)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Sq, H, 576, device="cuda", dtype=torch.bfloat16)
    qc, qs, qr = latent_quant_triton(q.reshape(-1, 576), 512)
    R = Sq * H
    o = mla_decode_few_gluon(qc.view(B, R, 512), qr.view(B, R, 64), qs.view(B, R), *(x.flatten(0, 1) for x in c["fp8"]),
                             c["page_table"], sl, num_heads=H, sm_scale=576 ** -0.5, max_seq_len=max(lens),
                             page_size=64, num_splits=splits)
    torch.cuda.synchronize()
    print(f"B={B} H={H} Sq={Sq} lens={lens} splits={splits}: finite={bool(torch.isfinite(o).all())}")
