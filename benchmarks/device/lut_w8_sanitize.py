"""compute-sanitizer target: session 23's LUT decode option on small ragged cases -- the register-table kernels'
``smem_table`` (Triton at 3 and 4 bits, Gluon), whose pair table lives past Triton's own shared memory (memcheck
catches a table offset or a launch shared size that is off; the 'wide' / ``x_perm`` variants it also ran in
sessions 23-24 were removed in session 26) -- and the W8 (INT8 weight) GEMV / GEMM kernels, never sanitized before.

    compute-sanitizer --tool memcheck python3 benchmarks/device/lut_w8_sanitize.py [--kernels lut,w8]
    compute-sanitizer --tool racecheck python3 benchmarks/device/lut_w8_sanitize.py --kernels lut
    compute-sanitizer --tool memcheck python3 benchmarks/device/lut_w8_sanitize.py --kernels s25   (session 25)
    compute-sanitizer --tool memcheck python3 benchmarks/device/lut_w8_sanitize.py --kernels s26   (session 26)
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
        outs = {"default": LW.lut_wgmma_triton(x, qm, s, pairs, smem_table=False, **kw)}
        eq = {"smem": torch.equal(LW.lut_wgmma_triton(x, qm, s, pairs, smem_table=True, **kw), outs["default"])}
        if bits == 4 and m <= 16 and LGL.supported(x, 4, 128):  # (Gluon against its own byte-table launch)
            g = [LGL.lut_wgmma_gluon(x, qm, s, pairs, group_size=128, out_features=n, smem_table=mode)
                 for mode in (False, True)]
            eq["gluon_smem"] = torch.equal(g[1], g[0])
        torch.cuda.synchronize()
        print(f"lut M={m} N={n} K={k} bits={bits}: " + " ".join(f"{name} eq={bool(v)}" for name, v in eq.items()))

if "s25" in kernels:  # session 25's launches: the stacked dot under 96 registers (down-like, 9..16 tokens), the Gluon
    # kernel with a split target of 2 and one prefetch (gate_up-sized N at 16), the stacked dot at 48 tokens on
    # qkv-sized N, and the float-cache decode without a split (B * Hkv >= 3 programs per SM); ragged shapes
    from lowbit.bench.suites.lut import make_packed, reference_f64
    from lowbit.kernels import lut_wgmma as LW
    from lowbit.kernels import lut_wgmma_gluon as LGL
    from lowbit.kernels.decode_float import LAST_LAUNCH, decode_float_triton

    for m, n, k, gl_ in ((12, 200, 8320, False), (16, 130, 10944, False), (16, 16400, 576, True), (48, 4200, 1000, False),
                         (40, 4200, 1000, False)):
        torch.manual_seed(m + n)
        p = make_packed(torch.randn(n, k, device="cuda"), 4)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if gl_:
            y = LGL.lut_wgmma_gluon(x, p["qmma"], p["scales"], p["pairs"], group_size=128, out_features=n)
        else:
            y = LW.lut_wgmma_triton(x, p["qmma"], p["scales"], p["pairs"], group_size=128, out_features=n, bits=4,
                                    qweight_hi=p["qmma_hi"])
        ref = reference_f64(p, x)
        torch.cuda.synchronize()
        cfg = LGL.gluon_config(m, n) if gl_ else LW.wgmma_config(m, n, k, 128)
        print(f"s25 lut M={m} N={n} K={k} {'gluon' if gl_ else 'triton'} {cfg}: rel-L2 "
              f"{((y.double() - ref).norm() / ref.norm()).item():.2e}")
    B, Hq, Hkv, D = 50, 32, 8, 128
    lens = torch.randint(1, 700, (B,), device="cuda", dtype=torch.int32)
    smax = 704
    kd = torch.randn(B, Hkv, smax, D, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    qq = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    pt = torch.arange(B, dtype=torch.int32, device="cuda")[:, None]
    o1 = decode_float_triton(qq, kd, vd, pt, lens, max_len=smax)
    sp = LAST_LAUNCH["num_splits"]
    o4 = decode_float_triton(qq, kd, vd, pt, lens, max_len=smax, num_splits=4)
    torch.cuda.synchronize()
    print(f"s25 decode_float B={B} Hkv={Hkv} ragged: splits {sp}, rel-L2 vs 4 splits "
          f"{((o1.double() - o4.double()).norm() / o4.double().norm()).item():.2e}")

if "s26" in kernels:  # session 26: the SiLU*mul epilogues of a fused gate_up (rows interleaved by 8) -- the
    # register-table kernel (split-K and not), the fragment kernel (split-K and not, no PDL), the pass after a
    # stacked-dot launch and the standalone pass; ragged K, N a multiple of 16 but not of the tiles
    from lowbit.bench.suites.lut import make_packed, reference_f64
    from lowbit.formats.common import interleave_rows, silu_mul_ref
    from lowbit.kernels import lut_gemm as LG
    from lowbit.kernels import lut_wgmma as LW

    for m, n, k, kern, cfg in ((64, 400, 1000, "wgmma", {}), (40, 208, 10944, "wgmma", {"split_k": 3}),
                               (12, 96, 576, "wgmma", {"one_dot": True, "rt": 4}), (3, 400, 1000, "mma", {}),
                               (5, 208, 10944, "mma", {"split_k": 4})):
        torch.manual_seed(m + n)
        w = torch.randn(n, k, device="cuda")
        p = make_packed(interleave_rows(w[: n // 2], w[n // 2:], 8), 4)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if kern == "wgmma":
            y = LW.lut_wgmma_triton(x, p["qmma"], p["scales"], p["pairs"], group_size=128, out_features=n, bits=4,
                                    silu_mul=True, **cfg)
        else:
            y = LG.lut_mma_triton(x, p["qmma"], None, p["scales"], p["pairs"], p["table"], bits=4, group_size=128,
                                  out_features=n, silu_mul=True, **cfg)
        ref = silu_mul_ref(reference_f64(p, x).to(torch.bfloat16), 8)
        torch.cuda.synchronize()
        print(f"s26 {kern} silu_mul M={m} N={n} K={k} {cfg}: rel-L2 "
              f"{((y.double() - ref.double()).norm() / ref.double().norm()).item():.2e}")
    from lowbit.kernels.silu_mul import silu_mul_triton

    for block in (1, 8):
        yy = torch.randn(7, 2 * 1040, device="cuda", dtype=torch.bfloat16)
        out = silu_mul_triton(yy, block=block, residual=torch.randn(7, 1040, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        print(f"s26 silu_mul pass block={block}: finite {bool(torch.isfinite(out).all())}")

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
