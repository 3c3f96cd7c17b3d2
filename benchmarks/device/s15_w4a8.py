"""Session-15 probe (issue 3): the w4a8-fp8 GEMM at M = 128 / 256 (0.71-1.15x cuBLAS bf16 in R14), config
variants against the committed ``pick_config`` and the peers in the same run.

    PYTHONPATH=$PWD python3 benchmarks/device/s15_w4a8.py --out DIR [--parts ta]

Parts: ``t`` timing, the GEMM alone on pre-quantized x (``graph_us``: a CUDA graph of back-to-back calls over
> 2x L2 of weight copies, so the codes stream from HBM), variants: ``kstep2`` (two K tiles per loop
iteration), ``accstep`` (+ ``ACC_STEP``: the FP32 promotion once per 2 K tiles = 256 products instead of 128;
the kernel flag was removed after that run, and the row with it: it is in the committed JSON only),
``bm64`` (64-token tiles), ``bn128w8`` (128 weight rows, 8 warps), ``st3`` / ``st5`` (pipeline stages), ``split2x``,
``fast_acc`` (FAST_ACC: a no-op beside ACC_TILE, measured so) -- that list with S15_W4A8_PLAN=r1; the second run's:
``defer`` (``DEFER``: each tile's product promoted one iteration later, so those adds fill the next tile's
wgmma shadow), ``sword`` (group scales as one 4-byte word), their combinations (S15_W4A8_PLAN=mid: default vs
defer only, for other M: S15_MS=96,256,384 -> s15_w4a8_mid.json, S15_MS=1,16,64 -> s15_w4a8_decode.json); peers cuBLAS bf16 and
``torch._scaled_mm`` FP8 row-wise (pre-quantized x); ``a`` accuracy of the promotion intervals on an all-positive
K = 14336 product (rel-L2 vs float64; where FP8 accumulation loses bits). Writes ``s15_w4a8.json``.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, graph_us, probe_args, probe_row, write_probe  # noqa: E402
from lowbit.bench.suites.w4a8_fp8 import GROUP, peer_gemm_fns, probe_cases  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import BLOCK_K, _split_k, pick_config, w4a8_fp8_gemm  # noqa: E402
from lowbit.ops.quant import per_token_quant  # noqa: E402

a = probe_args("at")
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [int(m) for m in os.environ.get("S15_MS", "128,256").split(",")]
doc = {"env": env_info("PYTHONPATH=$PWD python3 benchmarks/device/s15_w4a8.py " + " ".join(sys.argv[1:])), "rows": {}}
cdiv = lambda x, y: -(-x // y)


def variants(M, N, K):
    d = dict(pick_config(M, N, K), DEFER=False)  # the default before session 15 (DEFER is the default since)
    kt = cdiv(K, BLOCK_K)
    if os.environ.get("S15_W4A8_PLAN") == "mid":  # the third run: other M of the mid path (s15_w4a8_mid.json)
        return {"default": d, "defer": dict(d, DEFER=True)}
    bm64 = dict(d, BLOCK_M=64, SPLIT_K=_split_k(cdiv(N, d["BLOCK_N"]) * cdiv(M, 64), kt, 132))
    if os.environ.get("S15_W4A8_PLAN") == "r1":  # the first run's list (s15_w4a8_r1.json)
        return {"default": d, "kstep2": dict(d, KSTEP=2), "bm64": bm64,
                "bn128w8": dict(d, BLOCK_N=128, num_warps=8,
                                SPLIT_K=_split_k(cdiv(N, 128) * cdiv(M, d["BLOCK_M"]), kt, 132)),
                "st3": dict(d, num_stages=3), "st5": dict(d, num_stages=5), "split2x": dict(d, SPLIT_K=d["SPLIT_K"] * 2),
                "fast_acc": dict(d, FAST_ACC=True)}
    return {"default": d, "defer": dict(d, DEFER=True), "bm64": bm64, "defer_bm64": dict(bm64, DEFER=True),
            "sword": dict(d, SWORD=True), "sword_defer": dict(d, SWORD=True, DEFER=True),
            "defer_st3": dict(d, DEFER=True, num_stages=3)}


def sass_info(k):
    from triton.tools.disasm import get_sass

    sass = get_sass(k.asm["cubin"])
    return {"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared,
            "wgmma_wait0": sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"),
            "wgmma_wait1": sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1"), "qgmma": sass.count("QGMMA")}


def part_t():
    for name, N, K, sets, M, x, xq, sx in probe_cases(LAYERS, MS):
        row = {"M": M, "N": N, "K": K}
        fns = {}
        for vn, cfg in variants(M, N, K).items():
            fns[vn] = [lambda c=c, s=s, cfg=cfg: w4a8_fp8_gemm(xq, sx, c, s, 2.0 ** -8, K, GROUP, config=cfg)
                       for (c, s) in sets]
            row[vn + "_cfg"] = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "SPLIT_K", "num_warps", "num_stages")}
        fns.update(peer_gemm_fns(x, N, K))
        ref = fns["default"][0]()
        if M == MS[0]:
            for vn, cfg in variants(M, N, K).items():
                try:
                    _, k = w4a8_fp8_gemm(xq, sx, *sets[0], 2.0 ** -8, K, GROUP, config=cfg, return_compiled=True)
                    row[vn + "_sass"] = sass_info(k)
                except Exception as exc:
                    row[vn + "_sass"] = f"{type(exc).__name__}: {str(exc)[-200:]}"
        for vn, fl in fns.items():
            try:
                out = fl[0]()
                if vn not in ("cublas_bf16", "scaled_mm_fp8"):
                    row[vn + "_rel"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row[vn] = [round(graph_us(fl), 2) for _ in range(2)]
            except Exception as exc:
                row[vn] = f"{type(exc).__name__}: {str(exc)[-300:]}"
        probe_row(doc, f"t {name} M={M}", row)
        del fns
        write_probe(doc, a.out, "s15_w4a8.json")


def part_a():
    from lowbit.formats.w4a8_fp8 import dequantize_weight, quantize_weight

    torch.manual_seed(0)
    N, K, M = 256, 14336, 128
    w = torch.rand(N, K, device="cuda") * 0.05
    codes, sc, invd = quantize_weight(w, GROUP, 6)
    x = torch.rand(M, K, device="cuda").to(torch.bfloat16)
    xq, sx = per_token_quant(x, "fp8")
    wd = dequantize_weight(codes, sc, K, GROUP).double()[:, :K] * invd.double()
    ref = (xq.double() * sx.double()[:, None]) @ wd.t()
    row = {}
    for vn, cfg in variants(M, N, K).items():
        y = w4a8_fp8_gemm(xq, sx, codes, sc, invd.item(), K, GROUP, out_dtype=torch.float32, config=cfg).double()
        row[vn] = ((y - ref).norm() / ref.norm()).item()
    probe_row(doc, "a all-positive K=14336 M=128 N=256 rel-L2 vs float64", row)


for part, fn in (("a", part_a), ("t", part_t)):
    if part in a.parts:
        fn()
print("wrote", write_probe(doc, a.out, "s15_w4a8.json"))
