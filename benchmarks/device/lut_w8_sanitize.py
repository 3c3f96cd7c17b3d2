"""compute-sanitizer target: session 23's LUT decode options on small ragged cases -- the register-table kernel's
``smem_table`` (True / 'wide', with and without ``x_perm``, 3 and 4 bits), the Gluon kernel's ``smem_table``, the
fragment kernel's ``wide`` -- whose pair table lives past Triton's own shared memory (memcheck catches a table offset
or a launch shared size that is off), and the W8 (INT8 weight) GEMV / GEMM kernels, never sanitized before.

    compute-sanitizer --tool memcheck python3 benchmarks/device/lut_w8_sanitize.py [--kernels lut,w8]
    compute-sanitizer --tool racecheck python3 benchmarks/device/lut_w8_sanitize.py --kernels lut
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--kernels", default="lut,w8")
kernels = ap.parse_args().kernels.split(",")

if "lut" in kernels:
    from lowbit.formats.lut import pack_codes_mma, pair_table, quantize_lut
    from lowbit.kernels import lut_gemm as LG
    from lowbit.kernels import lut_wgmma as LW
    from lowbit.kernels import lut_wgmma_gluon as LGL

    for m, n, k, bits in ((16, 200, 576, 4), (33, 96, 1000, 4), (64, 130, 512, 4), (20, 70, 640, 3), (1, 300, 1111, 4),
                          (8, 500, 4096, 4)):
        torch.manual_seed(m + n)
        q = quantize_lut(torch.randn(n, k, device="cuda"), bits=bits, group_size=128, scale_dtype=torch.bfloat16)
        qm, qh = pack_codes_mma(q.codes, bits, 128, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        s, pairs = q.scales.t().contiguous(), pair_table(q.table, bits, torch.bfloat16).cuda()
        kw = dict(group_size=128, out_features=n, bits=bits, qweight_hi=qh)
        outs = {"default": LW.lut_wgmma_triton(x, qm, s, pairs, **kw)}
        for mode in (True, "wide"):
            outs[f"smem_{mode}"] = LW.lut_wgmma_triton(x, qm, s, pairs, smem_table=mode, **kw)
            outs[f"smem_{mode}_xperm"] = LW.lut_wgmma_triton(x, qm, s, pairs, smem_table=mode, x_perm=True, **kw)
            if bits == 4 and m <= 16 and LGL.supported(x, 4, 128):
                outs[f"gluon_{mode}"] = LGL.lut_wgmma_gluon(x, qm, s, pairs, group_size=128, out_features=n,
                                                            smem_table=mode)
        eq = {name: torch.equal(o, outs["default"]) for name, o in outs.items() if name != "default"}
        if bits == 4 and m <= 16:  # (compared with its own default launch: another kernel, another summation order)
            args = (x, qm, None, s, pairs, q.table.cuda())
            yf = LG.lut_mma_triton(*args, bits=4, group_size=128, out_features=n)
            eq["fragment_wide"] = torch.equal(LG.lut_mma_triton(*args, bits=4, group_size=128, out_features=n,
                                                                wide=True), yf)
        torch.cuda.synchronize()
        print(f"lut M={m} N={n} K={k} bits={bits}: " + " ".join(f"{name} eq={bool(v)}" for name, v in eq.items()))

if "w8" in kernels:
    from lowbit.kernels.w8_gemm import w8_gemm_triton
    from lowbit.formats.w8 import quantize_w8
    from lowbit.ops.w8 import w8_linear

    for m, n, k in ((1, 1000, 4096), (4, 777, 1000), (3, 500, 1001), (16, 300, 10944), (100, 130, 640)):
        torch.manual_seed(m + n)
        c, sc = quantize_w8(torch.randn(n, k, device="cuda"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = w8_linear(x, c, sc, b)
        y32 = w8_gemm_triton(x, c, sc, None, torch.float32)
        torch.cuda.synchronize()
        print(f"w8 M={m} N={n} K={k}: finite={bool(torch.isfinite(y).all() and torch.isfinite(y32).all())}")
