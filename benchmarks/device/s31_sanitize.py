"""compute-sanitizer target: session 31's default changes on small ragged cases -- the INT4-cache Gluon decode's
vector epilogue (``cstore``: a shared-memory layout change, then 16-byte stores of the split partials or of O; D 64 /
128, 1-2 query tokens, one split and several, signed and zero-point codes), compared bit for bit with the scatter
epilogue, and the w4a8-fp8 decode tiles at 32 / 64 tokens with their new split (1.5 programs per SM) against split 1.

    compute-sanitizer --tool memcheck python3 benchmarks/device/s31_sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/device/s31_sanitize.py kv4
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from lowbit.kernels.decode_kv4 import decode_kv4_triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _kv4_cases import decode_cases  # noqa: E402

parts = sys.argv[1:] or ["kv4", "w4a8"]
bad = 0
if "kv4" in parts:
    for label, args, kw in decode_cases():
        o1 = decode_kv4_triton(*args, cstore=True, **kw)
        o0 = decode_kv4_triton(*args, cstore=False, **kw)
        ok = torch.equal(o0, o1)
        bad += not ok
        print(f"{label}: cstore == scatter {ok}")
if "w4a8" in parts:
    from lowbit.formats.common import FP8_E4M3, quantize_per_token
    from lowbit.formats.w4a8_fp8 import quantize_weight
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    for M, N, K, g in ((33, 4096, 1024, 128), (64, 1000, 2048, 64), (20, 4096, 1152, 128)):
        torch.manual_seed(M + N)
        codes, sc, inv = quantize_weight(torch.randn(N, K, device="cuda") * 0.05, g, 3)
        xq, sx = quantize_per_token(torch.randn(M, K, device="cuda"), FP8_E4M3)
        cfg = pick_config(M, N, K)
        y1 = w4a8_fp8_gemm(xq, sx, codes, sc, inv.item(), K, g, config=cfg)
        y0 = w4a8_fp8_gemm(xq, sx, codes, sc, inv.item(), K, g, config=dict(cfg, SPLIT_K=1))
        rel = ((y1.float() - y0.float()).norm() / y0.float().norm()).item()
        bad += not rel < 1e-2
        print(f"w4a8 M={M} N={N} K={K} split {cfg['SPLIT_K']} vs 1: rel {rel:.2e}")
torch.cuda.synchronize()
print("mismatches:", bad)
