"""Session-28 probe (issue 3): the Gluon W4A8-FP GEMM (``w4a8_gluon_kernel.py`` beside this script; not in the library: it lost) against the Triton kernel
(the committed ``pick_config`` path: swap-AB fused dequant below M = 512, dequantize-once + ``torch._scaled_mm`` from
512) and the peers in the same run.

    PYTHONPATH=$PWD python3 benchmarks/device/s28_w4a8_gluon.py --out DIR [--parts ct]   (env S28_MS=128,256,...)

Parts: ``c`` correctness: the Gluon kernel vs the Triton kernel with the same split-K plan (bit for bit expected)
and vs the float64 reference (rel-L2), on Llama-3-8B shapes and ragged ones (N = 1000, K = 576, K = 10944, group 64,
bias, residual, M = 1 / 77 / 300); ``t`` timing, the GEMM alone on pre-quantized x (``graph_us``: a CUDA graph of
back-to-back calls over > 2x L2 of weight copies), Gluon variants (``g<pipe>_n<rows>_t<tokens>_s<stages>[_w<warps>][_r<maxnreg>][_c<ctas_per_sm split target>]``) beside
the committed path, cuBLAS bf16 and ``torch._scaled_mm`` FP8 row-wise (x pre-quantized). Writes ``s28_w4a8_gluon.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, graph_us, probe_args, probe_row, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import GROUP, peer_gemm_fns, probe_cases  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import w4a8_gluon_kernel as WG  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import BLOCK_K, _split_k, pick_config, w4a8_fp8_gemm  # noqa: E402
from lowbit.ops.quant import per_token_quant  # noqa: E402

a = probe_args("ct")
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [int(m) for m in os.environ.get("S28_MS", "128,256,512,1024").split(",")]
VARIANTS = os.environ.get("S28_VARIANTS", "g0_n64_t128_s4,g0_n64_t64_s4,g0_n128_t128_s4,g0_n64_t128_s3,g2_n64_t64_s4")
doc = {"env": env_info(" ".join(f"{k}={os.environ[k]}" for k in ("S28_MS", "S28_VARIANTS") if k in os.environ)
                      + " PYTHONPATH=$PWD python3 benchmarks/device/s28_w4a8_gluon.py " + " ".join(sys.argv[1:])),
       "rows": {}}
cdiv = lambda x, y: -(-x // y)


def parse(v):
    d = dict(x[0:1] and (x[0], x[1:]) for x in v.split("_"))
    cfg = dict(pipe=int(d["g"]), block_n=int(d["n"]), block_t=int(d["t"]), stages=int(d["s"]),
               num_warps=int(d.get("w", 4)))
    if "r" in d:
        cfg["maxnreg"] = int(d["r"])
    if "c" in d:
        cfg["ctas_per_sm"] = int(d["c"])
    cfg["unroll"] = 4 if cfg["pipe"] == 2 else 2
    return cfg


def triton_mid(M, N, K):
    """The Triton kernel's fused swap-AB config at any M (the committed mid path)."""
    return dict(pick_config(min(M, 511), N, K), SPLIT_K=_split_k(cdiv(N, 64) * cdiv(M, 128), cdiv(K, BLOCK_K), 132))


def rel(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def part_c():
    from lowbit.formats.w4a8_fp8 import quantize_weight, reference_gemm

    torch.manual_seed(0)
    cases = [(128, 6144, 4096, 128, False, False), (300, 4096, 14336, 128, False, False),
             (77, 1000, 576, 128, True, False), (1, 1000, 576, 64, False, True), (256, 512, 10944, 64, True, True),
             (1024, 4096, 4096, 128, False, False), (65, 28672, 4096, 128, False, False)]
    for M, N, K, G, bias, res in cases:
        w = torch.randn(N, K, device="cuda") * K ** -0.5
        w[:3] = 0  # all-zero groups (rows 0..2)
        codes, sc, invd = quantize_weight(w, G, 4)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        xq, sx = per_token_quant(x, "fp8")
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16) if bias else None
        r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if res else None
        ref = reference_gemm(xq.cpu(), sx.cpu(), codes.cpu(), sc.cpu(), invd.item(), K, G,
                             None if b is None else b.cpu(), residual=None if r is None else r.cpu(),
                             out_dtype=torch.float32)
        cfg = triton_mid(M, N, K)
        tri = w4a8_fp8_gemm(xq, sx, codes, sc, invd.item(), K, G, bias=b, residual=r, config=cfg)
        row = {"M": M, "N": N, "K": K, "G": G, "bias": bias, "res": res, "triton_rel": rel(tri.cpu(), ref),
               "split": cfg["SPLIT_K"]}
        for v in VARIANTS.split(","):
            gc = parse(v)
            try:
                same = WG.w4a8_fp8_gluon(xq, sx, codes, sc, invd.item(), G, bias=b, residual=r, **gc,
                                         split_k=cfg["SPLIT_K"]) if gc["block_n"] == 64 and gc["block_t"] == 128 else None
                y = WG.w4a8_fp8_gluon(xq, sx, codes, sc, invd.item(), G, bias=b, residual=r, **gc)
                torch.cuda.synchronize()
                row[v] = {"rel": rel(y.cpu(), ref), "finite": bool(torch.isfinite(y).all()),
                          "zero_rows_ok": bool((y[:, :3] == 0).all()) if (b is None and r is None) else None}
                if same is not None:
                    row[v]["bitequal_triton"] = bool(torch.equal(same, tri))
                    row[v]["maxdiff_triton"] = (same.float() - tri.float()).abs().max().item()
            except Exception as exc:
                row[v] = f"{type(exc).__name__}: {str(exc)[-400:]}"
        probe_row(doc, f"c M={M} N={N} K={K} G={G} bias={bias} res={res}", row)
    write_probe(doc, a.out, "s28_w4a8_gluon.json")


def part_t():
    for name, N, K, sets, M, x, xq, sx in probe_cases(LAYERS, MS):
        row = {"M": M, "N": N, "K": K}
        fns = {"lib": [lambda c=c, s=s: w4a8_fp8_gemm(xq, sx, c, s, 2.0 ** -8, K, GROUP) for (c, s) in sets]}
        if M >= 512:
            cfg = triton_mid(M, N, K)
            fns["triton_fused"] = [lambda c=c, s=s: w4a8_fp8_gemm(xq, sx, c, s, 2.0 ** -8, K, GROUP, config=cfg)
                                   for (c, s) in sets]
        for v in VARIANTS.split(","):
            gc = parse(v)
            fns[v] = [lambda c=c, s=s, gc=gc: WG.w4a8_fp8_gluon(xq, sx, c, s, 2.0 ** -8, GROUP, **gc) for (c, s) in sets]
        fns.update(peer_gemm_fns(x, N, K))
        ref = fns["lib"][0]()
        for vn, fl in fns.items():
            try:
                out = fl[0]()
                if vn not in ("cublas_bf16", "scaled_mm_fp8"):
                    row[vn + "_rel"] = rel(out.float(), ref.float())
                row[vn] = [round(graph_us(fl), 2) for _ in range(2)]
            except Exception as exc:
                row[vn] = f"{type(exc).__name__}: {str(exc)[-300:]}"
        if "kernel" in WG.LAST_COMPILED and M == MS[0]:
            k = WG.LAST_COMPILED["kernel"]
            row["last_gluon_regs"] = [k.n_regs, k.n_spills, k.metadata.shared]
        probe_row(doc, f"t {name} M={M}", row)
        del fns
        write_probe(doc, a.out, "s28_w4a8_gluon.json")


for part, fn in (("c", part_c), ("t", part_t)):
    if part in a.parts:
        fn()
print("wrote", write_probe(doc, a.out, "s28_w4a8_gluon.json"))
