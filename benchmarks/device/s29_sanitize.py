"""compute-sanitizer target: session 29's W4A8 launches on small ragged cases -- the x tiles as TMA boxes (``XTMA``)
in the w4a8-fp8 GEMM (mid-M and 64-token decode tiles; rows past M, columns past K) and in the w4a8-int8 GEMM
(in-register and W8 paths), and the fp8 hybrid split (``HYB_FULL``: whole tiles, then split-K tiles in one launch,
the last arriver reducing). Each output is compared bit for bit with the pointer-load / unsplit-plan launch.

    compute-sanitizer --tool memcheck python3 benchmarks/device/s29_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from lowbit.formats import w4a8_int8 as fmt8  # noqa: E402
from lowbit.formats.common import FP8_E4M3, quantize_per_token  # noqa: E402
from lowbit.formats.w4a8_fp8 import quantize_weight  # noqa: E402
from lowbit.kernels import w4a8_int8_gemm as I8  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm  # noqa: E402

for M, N, K, g, extra in ((70, 200, 576, 64, {}), (130, 320, 1024, 128, {}), (40, 130, 640, 128, {}),
                          (130, 640, 1152, 128, {"SPLIT_K": 2, "HYB_FULL": 4}),
                          (200, 448, 4096, 32, {"SPLIT_K": 3, "HYB_FULL": 5})):
    torch.manual_seed(M + N)
    codes, sc, inv = quantize_weight(torch.randn(N, K, device="cuda") * 0.05, g, 3)
    xq, sx = quantize_per_token(torch.randn(M, K, device="cuda"), FP8_E4M3)
    base = dict(pick_config(M, N, K), **extra)
    y0 = w4a8_fp8_gemm(xq, sx, codes, sc, inv.item(), K, g, config=dict(base, XTMA=False))
    y1 = w4a8_fp8_gemm(xq, sx, codes, sc, inv.item(), K, g, config=dict(base, XTMA=True))
    if "HYB_FULL" in extra:  # a second launch: the arrival counters were reset by the last arrivers
        y2 = w4a8_fp8_gemm(xq, sx, codes, sc, inv.item(), K, g, config=dict(base, XTMA=True))
        ok = torch.equal(y1, y2)
    else:
        ok = True
    torch.cuda.synchronize()
    print(f"fp8 M={M} N={N} K={K} g={g} {extra}: xtma bit-equal {torch.equal(y0, y1)}, repeat equal {ok}", flush=True)

for M, N, K, g, bm, w8 in ((70, 72, 400, 128, 64, False), (130, 64, 1024, 64, 128, False), (130, 64, 384, 128, 64, True)):
    torch.manual_seed(M + K)
    qw = fmt8.quantize(torch.randn(N, K, device="cuda"), g)
    xq, xs = quantize_per_token(torch.randn(M, K, device="cuda"), torch.int8)
    kw = {"w8": I8.dequantize_w8(qw.qweight, qw.gscale, qw.gzs)} if w8 else {}
    cfg = dict(BLOCK_M=bm, BLOCK_N=64, SPLIT_K=1, num_warps=4, num_stages=3)
    outs = [I8.launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, K, qw.effective_group_size,
                      torch.bfloat16, config=dict(cfg, XTMA=t), **kw)[0] for t in (False, True)]
    torch.cuda.synchronize()
    print(f"int8 M={M} N={N} K={K} g={g} w8={w8}: xtma bit-equal {torch.equal(outs[0], outs[1])}", flush=True)
