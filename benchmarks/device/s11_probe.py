"""Session-11 probe (device): how far the M = 1 INT4-weight GEMMs sit from what a Triton kernel can read.

    python3 benchmarks/device/s11_probe.py --out DIR [--parts ab]

(a) read ceilings per Llama-3-8B projection (packed INT4 codes, N x K/2 bytes, rotated over > 2x L2, CUDA
    graph of back-to-back launches, as ``graph_us``): ``flat`` = one contiguous stream, 16-byte loads,
    ``BYTES`` per program; ``tile`` = the W4A8-INT8 kernel's exact access pattern (64 rows x 64 bytes per
    k-tile, KSTEP tiles per iteration, one program per 64 rows) with an xor in place of the math.
(b) the W4A8-INT8 GEMM at M = 1 (x pre-quantized, PDL launch as the runner issues it): config variants of
    the dp4a path and the wgmma default, row-major vs row-tiled codes, alternated over 5 rounds (median, min,
    max); and M = 16 / 128 with the default configs, row-major vs row-tiled codes.
(d) the committed M = 1 defaults through the op (``lowbit.ops.w4a8_int8.w4a8_int8_gemm``, PDL): row-tiled codes
    vs row-major codes, 7 alternations.
Output: ``s11_probe.json``.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lowbit.bench.harness import alternate_us as rounds, env_info, probe_args, rotation_copies as copies  # noqa: E402

a = probe_args("ab")
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}


@triton.jit
def _flat_read(P, OUT, n_words, BYTES: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * (BYTES // 4) + tl.arange(0, BYTES // 4)
    v = tl.load(P + offs, mask=offs < n_words, other=0)
    tl.store(OUT + pid, tl.xor_sum(v, axis=0))


@triton.jit
def _tile_read(W, OUT, KP2, stride_wn, BLOCK_N: tl.constexpr, KSTEP: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = W + rn.to(tl.int64)[:, None] * stride_wn + tl.arange(0, 64)[None, :]
    acc = tl.zeros([BLOCK_N, 64], dtype=tl.int32)
    for k in range(0, KP2, 64 * KSTEP):
        for j in tl.static_range(KSTEP):
            acc ^= tl.load(ptrs + k + j * 64).to(tl.int32)
    tl.store(OUT + rn, tl.xor_sum(acc, axis=1))


doc = {"suite": "s11_probe", "env": env_info("benchmarks/device/s11_probe.py --parts " + a.parts)}
if "a" in a.parts:
    doc["read_ceiling"] = {}
    out = torch.empty(1 << 20, device="cuda", dtype=torch.int32)
    for name, (N, K) in LAYERS.items():
        nb = N * K // 2
        ws = [torch.randint(0, 255, (N, K // 2), device="cuda", dtype=torch.uint8) for _ in range(copies(nb))]
        fns = {}
        for by in (4096, 16384):
            fns[f"flat{by}"] = [lambda w=w, by=by: _flat_read[(triton.cdiv(nb, by),)](w.view(torch.int32), out, nb // 4, BYTES=by, num_warps=4) for w in ws]
        for ks, nw in ((4, 4), (8, 4), (4, 8)):
            fns[f"tile_k{ks}_w{nw}"] = [lambda w=w, ks=ks, nw=nw: _tile_read[(N // 64,)](w, out, K // 2, w.stride(0), BLOCK_N=64, KSTEP=ks, num_warps=nw) for w in ws]
        fns["torch_sum"] = [lambda w=w: w.view(torch.int64).sum() for w in ws]
        r = rounds(fns)
        for k, v in r.items():
            v["TBps"] = round(nb / (v["median"] * 1e-6) / 1e12, 3)
        r["bytes"] = nb
        r["copies"] = len(ws)
        doc["read_ceiling"][f"{name} N={N} K={K}"] = r
        print(name, json.dumps(r), flush=True)
        del ws
if "b" in a.parts:
    from lowbit.formats.w4a8_int8 import quantize as qoq  # noqa: E402
    from lowbit.kernels import w4a8_int8_gemm as ik  # noqa: E402

    doc["int8_m1_configs"] = {}
    base = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1, DP4A=True, KSTEP=4)
    for name, (N, K) in LAYERS.items():
        w0 = qoq(torch.randn(N, K, device="cuda"), 128)
        ws = [w0] + [type(w0)(w0.qweight.clone(), w0.wscale.clone(), w0.gscale.clone(), w0.gzs.clone(), K, 128)
                     for _ in range(copies(N * K // 2) - 1)]
        xq = torch.randint(-127, 128, (1, K), device="cuda", dtype=torch.int8)
        sx = torch.rand(1, device="cuda") + 0.5

        def split(ctas, bn=64, ks=4):
            return ik.auto_split(1, N, K, 16, bn, 132, ctas, max(ik.MIN_TILES_PER_SPLIT, ks))
        wg = ik.pick_config(1, N, K, 128, num_sms=132, fused=True)
        variants = {  # name -> (config, tiled codes)
            "wgmma_rows": (wg, False),
            "wgmma_tiled": (wg, True),
            "dp4a_rows": (dict(base, SPLIT_K=split(4)), False),
            "dp4a_tiled": (dict(base, SPLIT_K=split(4)), True),
            "dp4a_tiled_w8": (dict(base, num_warps=8, SPLIT_K=split(4)), True),
            "dp4a_tiled_bn128_w8": (dict(base, BLOCK_N=128, num_warps=8, SPLIT_K=split(4, bn=128)), True),
            "dp4a_tiled_ctas8": (dict(base, SPLIT_K=split(8)), True),
            "dp4a_tiled_k8": (dict(base, KSTEP=8, SPLIT_K=split(4, ks=8)), True),
        }
        from lowbit.formats.w4a8_int8 import tile_codes  # noqa: E402
        wts = [type(w)(tile_codes(w.qweight), w.wscale, w.gscale, w.gzs, K, 128) for w in ws]
        fns = {}
        outs = {}
        for vname, (cfg, tiled) in variants.items():
            wl = wts if tiled else ws
            fns[vname] = [lambda w=w, cfg=cfg, t=tiled: ik.launch(xq, sx, w.qweight, w.wscale, w.gscale, w.gzs, None, K, 128,
                                                                  torch.bfloat16, cfg, pdl=True, tiled=t)[0] for w in wl]
            outs[vname] = fns[vname][0]()
        ref = outs["wgmma_rows"]
        r = rounds(fns)
        nb = N * K // 2
        for k, v in r.items():
            v["TBps_codes"] = round(nb / (v["median"] * 1e-6) / 1e12, 3)
            v["same_output"] = bool(torch.equal(outs[k], ref))
            v["config"] = dict(variants[k][0], tiled=variants[k][1])
        r["copies"] = len(ws)
        doc["int8_m1_configs"][f"{name} N={N} K={K}"] = r
        print(name, json.dumps({k: v["median"] for k, v in r.items() if isinstance(v, dict)}), flush=True)
        # (c) M = 16 / 128 with the default configs: tiled vs row-major codes (x pre-quantized)
        for M in (16, 128):
            xm = torch.randint(-127, 128, (M, K), device="cuda", dtype=torch.int8)
            sm = torch.rand(M, device="cuda") + 0.5
            f2 = {lab: [lambda w=w, t=t: ik.w4a8_int8_gemm_triton(xm, sm, w.qweight, w.wscale, w.gscale, w.gzs, None, K, 128,
                                                                    torch.bfloat16, tiled=t) for w in wl]
                  for lab, wl, t in (("rows", ws, False), ("tiled", wts, True))}
            same = bool(torch.equal(f2["rows"][0](), f2["tiled"][0]()))
            rr = rounds(f2)
            rr["same_output"] = same
            doc["int8_m1_configs"][f"{name} N={N} K={K}"][f"M={M}"] = rr
            print(name, M, json.dumps(rr), flush=True)
        del ws, wts
if "d" in a.parts:  # the committed M = 1 defaults: row-tiled codes (new) vs row-major codes (previous)
    from lowbit.formats.w4a8_int8 import quantize as qoq, tile_codes  # noqa: E402
    from lowbit.ops.w4a8_int8 import w4a8_int8_gemm  # noqa: E402

    doc["int8_m1_defaults"] = {}
    for name, (N, K) in LAYERS.items():
        w0 = qoq(torch.randn(N, K, device="cuda"), 128)
        ws = [w0.qweight] + [w0.qweight.clone() for _ in range(copies(N * K // 2) - 1)]
        wts = [tile_codes(q) for q in ws]
        xq = torch.randint(-127, 128, (1, K), device="cuda", dtype=torch.int8)
        sx = torch.rand(1, device="cuda") + 0.5
        f = {lab: [lambda q=q, t=t: w4a8_int8_gemm(xq, sx, q, w0.wscale, w0.gscale, w0.gzs, None, pdl=True, tiled=t)
                   for q in ql] for lab, ql, t in (("rows", ws, False), ("tiled", wts, True))}
        same = bool(torch.equal(f["rows"][0](), f["tiled"][0]()))
        r = rounds(f, 7)
        r["same_output"] = same
        r["copies"] = len(ws)
        doc["int8_m1_defaults"][f"{name} N={N} K={K}"] = r
        print("defaults", name, json.dumps(r), flush=True)
        del ws, wts
with open(os.path.join(a.out, "s11_probe.json"), "w") as f:
    json.dump(doc, f, indent=1)
