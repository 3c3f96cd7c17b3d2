"""compute-sanitizer target: the warp-specialized Gluon MLA decode kernels (``lowbit.kernels.mla_decode_wgmma``, bf16
and FP8) on two small cases each (MTP rows, ragged lengths, one below a block, splits), shuffled pages of 64.

    compute-sanitizer --tool memcheck python3 benchmarks/device/mla_wgmma_sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/device/mla_wgmma_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from lowbit.bench.suites.mla import make_caches  # noqa: E402
from lowbit.kernels import mla_decode_wgmma as W  # noqa: E402
from lowbit.kernels.mla_quant import latent_quant_triton  # noqa: E402
from lowbit.ops.mla import _rows  # noqa: E402

for B, H, Sq, lens, splits in [(2, 64, 2, [300, 37], None), (1, 128, 1, [700], 2)]:
    c = make_caches(B, max(lens), fp8=True, bf16=True, seed=1)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Sq, H, 576, device="cuda", dtype=torch.bfloat16)
    R = Sq * H
    q3 = q.reshape(B, R, 576)
    kw = dict(num_heads=H, sm_scale=576 ** -0.5, max_seq_len=max(lens), page_size=64, num_splits=splits)
    o = W.mla_decode_wgmma(q3[..., :512], q3[..., 512:], _rows(c["bf16"][0]), _rows(c["bf16"][1]), c["page_table"], sl,
                           **kw)
    qc, qs, qr = latent_quant_triton(q.reshape(-1, 576), 512)
    o8 = W.mla_decode_wgmma_fp8(qc.view(B, R, 512), qr.view(B, R, 64), qs.view(B, R), _rows(c["fp8"][0]),
                                _rows(c["fp8"][1]), c["fp8"][2].reshape(-1), c["page_table"], sl, **kw)
    torch.cuda.synchronize()
    print(f"B={B} H={H} Sq={Sq} lens={lens} splits={splits}: bf16 finite={bool(torch.isfinite(o).all())} "
          f"fp8 finite={bool(torch.isfinite(o8).all())}")
