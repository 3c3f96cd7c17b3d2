"""Device script for area w4a8_fp8 (FireQ linear, issue 3). Run on one H100/H200:

    python3 benchmarks/device/w4a8_fp8.py --out DIR [--budget 95]
    TRITON_INTERPRET=1 python3 benchmarks/device/w4a8_fp8.py --out /tmp/x --cpu-smoke

(1) kernel vs float64 reference on the GPU (rel-L2, PASS/FAIL per case); (2) what Triton generated
for the GEMM (wgmma, 16-byte loads, spills, registers) -> ptx_report.txt; (3) timings vs peers
(suite ``lowbit.bench.suites.w4a8_fp8``) -> w4a8_fp8.json/md/png; (4) perplexity of the embedded
model with all decoder linears w4a8-fp8: neither / PTS / CAS / both -> accuracy.json/md.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

T0 = time.time()
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--budget", type=float, default=86.0, help="seconds of wall time for the whole script")
ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (interpreter), no timing")
ap.add_argument("--acc-tokens", type=int, default=None, help="perplexity tokens (default 8192; 256 with --cpu-smoke)")
ap.add_argument("--skip", default=os.environ.get("W4A8_SKIP", "sweep,decide,acc"),
                help="comma list of phases to skip: decode,check,ptx,bench,ffn,acc,sweep,decide")
ap.add_argument("--ms", default=os.environ.get("W4A8_MS", ""),
                help="comma list of M for the bench phase (both models); default: the full table's M")
args = ap.parse_args()
OUT = Path(args.out)
OUT.mkdir(parents=True, exist_ok=True)
SKIP = set(filter(None, args.skip.split(",")))
DEV = "cpu" if args.cpu_smoke else "cuda"
SUMMARY: list[str] = []
FULL_CHECK = os.environ.get("W4A8_FULL_CHECK", "0") == "1"  # every R3 check case too (final round)
ROUND = int(os.environ.get("W4A8_ROUND", "5"))  # which decision experiments run (R4: A-D; R5+: E, A)


def left() -> float:
    return args.budget - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------- (1) correctness
def _write_rows(name: str, rows: list) -> None:
    """``rows`` as ``{"env": ..., "rows": rows}`` (GPU, versions, command with every committed JSON)."""
    from lowbit.bench.harness import env_info

    (OUT / name).write_text(json.dumps({"env": env_info(f"benchmarks/device/w4a8_fp8.py ({name})"), "rows": rows},
                                       indent=1))


def check():
    from lowbit.formats.common import FP8_E4M3, quantize_per_token
    from lowbit.formats.common import interleave_rows
    from lowbit.formats.w4a8_fp8 import quantize_weight, reference_gemm
    from lowbit.kernels.act_quant import per_token_quant_triton
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    cases = [  # M, N, K, g, flags
        (1, 4096, 4096, 128, {}), (3, 200, 576, 128, {"bias": True}), (16, 1536, 576, 64, {}),
        (17, 576, 1536, 32, {}), (64, 1000, 4096, 128, {"res": True}), (200, 4096, 1000, 128, {}),
        (1024, 4096, 4096, 128, {}), (4, 2 * 1536, 576, 128, {"silu": True}),
        (300, 2 * 640, 576, 128, {"silu": True, "res": True, "bias": True}),
    ]
    if args.cpu_smoke:
        cases = [(3, 72, 200, 128, {"bias": True}), (17, 64, 160, 32, {"silu": True, "res": True})]
    elif not FULL_CHECK:  # numerics of these paths unchanged since R3: keep the group-64/32 scale loads
        cases = [c for c in cases if c[3] != 128]
    rows = []
    for M, N, K, g, fl in cases:
        name = f"M={M} N={N} K={K} g={g} {','.join(fl) or 'plain'}"
        try:
            torch.manual_seed(M + N + K)
            w = torch.randn(N, K, device=DEV) * 0.02
            w[0, :g] = 0.0  # an all-zero group
            if fl.get("silu"):
                w = interleave_rows(w[: N // 2], w[N // 2:])
            codes, sc, invd = quantize_weight(w, g, 6)
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            xq, sx = per_token_quant_triton(x, FP8_E4M3)
            # the reference on the CPU: torch's CUDA "tensor / python scalar" multiplies by the
            # reciprocal (1 ulp off true division), its CPU path divides like the kernel
            xq_r, sx_r = (t.to(DEV) for t in quantize_per_token(x.cpu(), FP8_E4M3))
            aq_ok = torch.equal(xq.view(torch.int8), xq_r.view(torch.int8)) and torch.equal(sx, sx_r)
            if not aq_ok:
                nq = int((xq.view(torch.int8) != xq_r.view(torch.int8)).sum())
                ns = int((sx != sx_r).sum())
                log(f"  act_quant mismatch: {nq} codes, {ns} scales (max scale rel diff "
                    f"{((sx - sx_r).abs() / sx_r).max().item():.2e})")
            bias = torch.randn(N, device=DEV, dtype=torch.bfloat16) if fl.get("bias") else None
            nout = N // 2 if fl.get("silu") else N
            res = torch.randn(M, nout, device=DEV, dtype=torch.bfloat16) if fl.get("res") else None
            y = w4a8_fp8_gemm(xq, sx, codes, sc, invd.item(), K, g, bias=bias, residual=res,
                              silu_mul=bool(fl.get("silu")), out_dtype=torch.bfloat16)
            ref = reference_gemm(xq, sx, codes, sc, invd.item(), K, g, bias, residual=res,
                                 silu_mul=bool(fl.get("silu")), out_dtype=torch.bfloat16)
            e = rel(y, ref)
            finite = bool(torch.isfinite(y).all())
            ok = e < 1e-2 and finite and aq_ok
            rows.append({"case": name, "rel_l2": e, "act_quant_bitexact": aq_ok, "pass": ok})
            log(f"check {name}: rel-L2 {e:.2e} act_quant bit-exact {aq_ok} {'PASS' if ok else 'FAIL'}")
        except Exception as exc:
            traceback.print_exc()
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:300], "pass": False})
            log(f"check {name}: FAIL {type(exc).__name__}: {exc}")
    rows.extend(_new_path_checks())
    if not args.cpu_smoke:
        rows.extend(_pdl_graph_checks())
    # a long-K case for FP8 accumulation (promotion every K=64 vs fast accumulation): all-positive
    if not args.cpu_smoke and FULL_CHECK:
        for fast in (False, True, "tile"):
            try:
                K = 14336
                w = torch.rand(256, K, device=DEV) * 0.02
                codes, sc, invd = quantize_weight(w, 128, 8)
                x = torch.rand(8, K, device=DEV, dtype=torch.bfloat16)
                xq, sx = per_token_quant_triton(x, FP8_E4M3)
                cfg = dict(BLOCK_M=64, BLOCK_N=128, SPLIT_K=1, SWAP_AB=False, num_warps=4, num_stages=3, GROUP_M=1,
                           FAST_ACC=fast is True, ACC_TILE=fast == "tile")
                y = w4a8_fp8_gemm(xq, sx, codes, sc, invd.item(), K, 128, out_dtype=torch.float32, config=cfg)
                ref = reference_gemm(xq, sx, codes, sc, invd.item(), K, 128, out_dtype=torch.float32)
                e = rel(y, ref)
                lim = 1e-3 if fast is True else 5e-4  # promotion every K=64: ~1e-4 left from the fast in-chunk sums
                rows.append({"case": f"long-K all-positive fp32 out FAST_ACC={fast}", "rel_l2": e, "pass": e < lim})
                log(f"check long-K accumulation FAST_ACC={fast}: rel-L2 {e:.2e} {'PASS' if e < lim else 'FAIL'}")
            except Exception as exc:
                traceback.print_exc()
                rows.append({"case": f"long-K FAST_ACC={fast}", "error": str(exc)[:300], "pass": False})
    # the arithmetic dequant path (LUT=False) on one case, and the LUT fallback switch
    if not args.cpu_smoke and FULL_CHECK:
        try:
            args_ = _lut_false_case()
            rows.append(args_)
            log(f"check LUT=False path: rel-L2 {args_['rel_l2']:.2e} {'PASS' if args_['pass'] else 'FAIL'}")
        except Exception as exc:
            traceback.print_exc()
            rows.append({"case": "LUT=False", "error": str(exc)[:300], "pass": False})
        lut_errors = [r for r in rows if "error" in r and r["case"] != "LUT=False"]
        if lut_errors and len(lut_errors) == len([r for r in rows if r["case"] != "LUT=False"]):
            os.environ["LOWBIT_W4A8_LUT"] = "0"
            SUMMARY.append("every LUT case failed: LOWBIT_W4A8_LUT=0 (arithmetic dequant) for the rest of the run")
    _write_rows("check.json", rows)
    n_ok = sum(r["pass"] for r in rows)
    SUMMARY.append(f"correctness: {n_ok}/{len(rows)} PASS")


def _new_path_checks():
    """Session 2 paths: activation quantization fused into the GEMM (decode), single-launch split-K,
    dequantize-once + FP8 GEMM (Triton W_FP8 / torch._scaled_mm)."""
    from lowbit.formats.common import FP8_E4M3, quantize_per_token
    from lowbit.formats.common import interleave_rows
    from lowbit.formats.w4a8_fp8 import quantize_weight, reference_gemm, tile_codes
    from lowbit.kernels.act_quant import per_token_quant_triton
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm, w4a8_fp8_linear_fused

    cases = [  # M, N, K, g, kind, flags ("lc": LUT2 + CAT on the default config, R12; "tiled-*": R11)
        (1, 17000, 1000, 128, "lc", {"bias": True}), (3, 1000, 4096, 128, "lc", {"res": True}),
        (5, 3000, 1000, 64, "lc", {}), (16, 4096, 14336, 128, "lc", {}), (1, 4096, 14336, 128, "lc", {}),
        (200, 4096, 1000, 32, "lc", {}), (2, 2 * 8448, 576, 64, "lc", {"silu": True}),
        (17, 576, 1536, 32, "lc", {"res": True}), (128, 28672, 4096, 128, "lc", {}),
        (1, 17000, 1000, 128, "tiled-default", {"bias": True}), (2, 2 * 8448, 576, 64, "tiled-default", {"silu": True}),
        (1, 4096, 4096, 128, "fused", {}), (3, 200, 576, 64, "fused", {"bias": True}),
        (16, 1536, 576, 128, "fused", {"res": True}), (1, 4096, 14336, 128, "fused", {}),
        (8, 2 * 1536, 576, 128, "fused", {"silu": True}), (17, 576, 1536, 32, "fused", {}),
        (1, 4096, 14336, 128, "sem", {}), (5, 1000, 4096, 128, "reduce", {"bias": True}),
        (300, 1280, 576, 128, "dequant", {"silu": True, "res": True, "bias": True}),
        (1024, 4096, 4096, 128, "dequant", {}), (1024, 4096, 4096, 128, "scaled_mm", {}),
        (300, 1280, 576, 128, "scaled_mm", {"silu": True, "res": True, "bias": True}),
        (1, 17000, 1000, 128, "default", {"bias": True}), (2, 2 * 8448, 576, 64, "default", {"silu": True}),
        (3, 1000, 4096, 128, "default", {"res": True}), (16, 4096, 14336, 128, "default", {}),
        (1, 4096, 14336, 128, "tma", {}), (5, 3000, 1000, 64, "kstep", {}),
    ]
    if args.cpu_smoke:
        cases = [(1, 72, 200, 128, "fused", {"bias": True}), (3, 64, 160, 32, "fused", {"silu": True, "res": True}),
                 (2, 64, 600, 128, "sem", {}), (20, 64, 200, 64, "dequant", {"bias": True}),
                 (3, 136, 300, 32, "tiled-default", {"bias": True}), (20, 72, 200, 64, "tiled-dequant", {}),
                 (3, 136, 300, 32, "lc", {"bias": True})]
    rows = []
    if not args.cpu_smoke:  # R3 saw 1-17 act-quant codes per 10^6 differ from the CPU reference: which?
        try:
            torch.manual_seed(11)
            x = torch.randn(1024, 4096, device=DEV, dtype=torch.bfloat16)
            xq, sx = per_token_quant_triton(x, FP8_E4M3)
            xr, sr = quantize_per_token(x.cpu(), FP8_E4M3)
            bad = (xq.cpu().view(torch.int8) != xr.view(torch.int8)).nonzero()[:6]
            diag = []
            for m, k in bad.tolist():
                v = x[m, k].float().item()
                q_exact = v / sr[m].double().item()
                diag.append(f"row {m} v={v!r} scale={sr[m].item()!r} (gpu scale {sx[m].item()!r}) v/s={q_exact!r} "
                            f"fp32 v/s={(x[m, k].float().cpu() / sr[m]).item()!r} gpu={xq[m, k].float().item()} "
                            f"ref={xr[m, k].float().item()}")
            log(f"act-quant diag: {int((xq.cpu().view(torch.int8) != xr.view(torch.int8)).sum())} code mismatches; "
                + " | ".join(diag))
            rows.append({"case": "act-quant GPU vs CPU reference M=1024 K=4096", "mismatches": len(bad), "diag": diag,
                         "pass": True})
        except Exception as exc:
            log(f"act-quant diag failed: {exc}")
    for M, N, K, g, kind, fl in cases:
        name = f"{kind} M={M} N={N} K={K} g={g} {','.join(fl) or 'plain'}"
        try:
            torch.manual_seed(M + N + K + 1)
            w = torch.randn(N, K, device=DEV) * 0.02
            w[0, :g] = 0.0
            if fl.get("silu"):
                w = interleave_rows(w[: N // 2], w[N // 2:])
            codes, sc, invd = quantize_weight(w, g, 6)
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            x[M // 2] = 0.0  # an all-zero row -> zero output (bias/residual aside)
            xq_r, sx_r = (t.to(DEV) for t in quantize_per_token(x.cpu(), FP8_E4M3))
            bias = torch.randn(N, device=DEV, dtype=torch.bfloat16) if fl.get("bias") else None
            nout = N // 2 if fl.get("silu") else N
            res = torch.randn(M, nout, device=DEV, dtype=torch.bfloat16) if fl.get("res") else None
            kw = dict(bias=bias, residual=res, silu_mul=bool(fl.get("silu")), out_dtype=torch.bfloat16)
            ref = reference_gemm(xq_r, sx_r, codes, sc, invd.item(), K, g, bias, residual=res,
                                 silu_mul=bool(fl.get("silu")), out_dtype=torch.bfloat16)
            extra = {}
            if kind == "fused":
                y = w4a8_fp8_linear_fused(x, codes, sc, invd.item(), K, g, **kw)
                xq, sx = per_token_quant_triton(x, FP8_E4M3)
                y2 = w4a8_fp8_gemm(xq, sx, codes, sc, invd.item(), K, g, **kw)
                extra["equal_to_unfused"] = bool(torch.equal(y, y2))
            else:
                cfg = dict(pick_config(M, N, K))
                tiled = kind.startswith("tiled-")
                if tiled:
                    codes = tile_codes(codes)
                    kind = kind[len("tiled-"):]
                if kind == "default":
                    pass
                elif kind == "lc":
                    cfg.update(LUT2=True, CAT=True)
                elif kind == "tma":
                    cfg.update(TMA=True, SWORD=True)
                elif kind == "kstep":
                    cfg.update(KSTEP=2, TMA=True, SWORD=True, SPLIT_K=3)
                elif kind == "sem":
                    cfg.update(SPLIT_K=4, SK_SEM=True)
                elif kind == "reduce":
                    cfg.update(SPLIT_K=4, SK_SEM=False)
                else:
                    cfg.update(MODE=kind, BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, SWAP_AB=False, num_warps=8,
                               num_stages=3, GROUP_M=8, ACC_TILE=True)
                y = w4a8_fp8_gemm(xq_r, sx_r, codes, sc, invd.item(), K, g, config=cfg, tiled=tiled, **kw)
            e = ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
            zero_ok = True
            if bias is None and res is None:
                zero_ok = bool(y[M // 2].eq(0).all())
            ok = e < 1e-2 and bool(torch.isfinite(y).all()) and zero_ok
            rows.append({"case": name, "rel_l2": e, "zero_row_ok": zero_ok, "pass": ok, **extra})
            log(f"check {name}: rel-L2 {e:.2e} zero-row {zero_ok} {extra} {'PASS' if ok else 'FAIL'}")
        except Exception as exc:
            traceback.print_exc()
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:300], "pass": False})
            log(f"check {name}: FAIL {type(exc).__name__}: {exc}")
    return rows


def _pdl_graph_checks():
    """R12: the PDL act_quant -> GEMM op with LUT2 + CAT, eager and captured in a CUDA graph, equals the
    plain path bit for bit."""
    from lowbit._utils import capture_cuda_graph
    from lowbit.formats.w4a8_fp8 import quantize_weight
    from lowbit.kernels import w4a8_fp8_gemm as kmod
    from lowbit.ops.quant import per_token_quant
    from lowbit.ops.w4a8_fp8 import _w4a8_fp8_linear_pdl, w4a8_fp8_gemm

    rows = []
    for M, N, K in [(1, 28672, 4096), (16, 4096, 14336), (3, 6144, 4096)]:
        name = f"pdl-op+LUT2+CAT eager and CUDA graph M={M} N={N} K={K}"
        old = dict(kmod.DECODE_FLAGS)
        try:
            torch.manual_seed(M + N)
            codes, sc, invd = quantize_weight(torch.randn(N, K, device=DEV) * 0.02, 128, 6)
            inv = invd.item()
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            y0 = w4a8_fp8_gemm(*per_token_quant(x, "fp8"), codes, sc, inv, K, 128, out_dtype=torch.bfloat16)
            kmod.DECODE_FLAGS.update(LUT2=True, CAT=True)
            ye = _w4a8_fp8_linear_pdl(x, codes, sc, inv, K, 128, None, None, False)
            graph, out = capture_cuda_graph(lambda: _w4a8_fp8_linear_pdl(x, codes, sc, inv, K, 128, None, None, False))
            ok_g = True
            for _ in range(3):
                graph.replay()
                torch.cuda.synchronize()
                ok_g &= bool(torch.equal(out, y0))
            ok = bool(torch.equal(ye, y0)) and ok_g
            rows.append({"case": name, "eager_equal": bool(torch.equal(ye, y0)), "graph_equal": ok_g, "pass": ok})
            log(f"check {name}: eager equal {torch.equal(ye, y0)} graph equal {ok_g} {'PASS' if ok else 'FAIL'}")
        except Exception as exc:
            traceback.print_exc()
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:300], "pass": False})
            log(f"check {name}: FAIL {type(exc).__name__}: {exc}")
        finally:
            kmod.DECODE_FLAGS.clear()
            kmod.DECODE_FLAGS.update(old)
    return rows


def _lut_false_case():
    from lowbit.formats.common import FP8_E4M3, quantize_per_token
    from lowbit.formats.w4a8_fp8 import quantize_weight, reference_gemm
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    torch.manual_seed(7)
    M, N, K = 40, 1536, 576
    w = torch.randn(N, K, device=DEV) * 0.02
    codes, sc, invd = quantize_weight(w, 128, 6)
    xq, sx = quantize_per_token(torch.randn(M, K, device=DEV, dtype=torch.bfloat16), FP8_E4M3)
    cfg = dict(pick_config(M, N, K), LUT=False)
    y = w4a8_fp8_gemm(xq, sx, codes, sc, invd.item(), K, 128, config=cfg)
    ref = reference_gemm(xq, sx, codes, sc, invd.item(), K, 128)
    e = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    return {"case": "LUT=False", "rel_l2": e, "pass": e < 1e-2}


# ------------------------------------------------------------------------- (2) PTX report
def ptx_report_impl():
    from lowbit.bench.suites.w4a8_fp8 import random_packed
    from lowbit.formats.common import FP8_E4M3
    from lowbit.kernels.act_quant import per_token_quant_triton
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    lines = []
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_linear_fused

    for M, N, K, fused in [(1, 28672, 4096, True), (16, 28672, 4096, False), (128, 28672, 4096, False)]:
        codes, sc = random_packed(N, K)
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        xq, sx = per_token_quant_triton(x, FP8_E4M3)
        cfg = dict(pick_config(M, N, K), fused_quant=fused)
        if fused:
            _, ker = w4a8_fp8_linear_fused(x, codes, sc, 1.0, K, 128, return_compiled=True)
        else:
            _, ker = w4a8_fp8_gemm(xq, sx, codes, sc, 1.0, K, 128, return_compiled=True)
        ptx = ker.asm.get("ptx", "")
        n_regs = getattr(ker, "n_regs", None)
        n_spills = getattr(ker, "n_spills", None)
        lines.append(f"== M={M} N={N} K={K} config={cfg}")
        lines.append(f"n_regs={n_regs} n_spills={n_spills} shared={getattr(ker, 'shared', None)}")
        for pat in ("wgmma.mma_async", "mma.sync", "ld.global.v4", "ld.global.nc.v4", "cp.async.cg", "cp.async.bulk",
                    "ld.local", "st.local", "cvt.rn.satfinite.e4m3x2", "cvt.rn.f16", "ex2.approx"):
            lines.append(f"  {pat:28s} {len(re.findall(re.escape(pat), ptx))}")
        wg = sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", ptx)))
        lines.append("  wgmma variants: " + ", ".join(wg[:6]))
        (OUT / f"gemm_M{M}{'_fused' if fused else ''}.ptx").write_text(ptx)
        SUMMARY.append(f"PTX M={M}: wgmma={len(re.findall('wgmma.mma_async', ptx))} "
                       f"ld.v4={len(re.findall(r'ld.global(.nc)?.v4', ptx))} regs={n_regs} spills={n_spills}")
    (OUT / "ptx_report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


# ------------------------------------------------------------------------- (3) timing
def bench(phases):
    from lowbit.bench import harness
    from lowbit.bench.suites import w4a8_fp8 as suite

    rec = harness.Recorder("w4a8_fp8", ceilings={"hbm_TBps": 4.15, "bf16_TFLOPs": 719.0, "fp8_TFLOPs": 1223.0})
    rec.note("ceilings: ANCHORS.md values (H200), not re-measured in this run")
    deadline = T0 + args.budget - (55 if 'sweep' not in SKIP else 12)  # keep time for decide/accuracy/writing
    try:
        if "bench" in phases and args.ms:  # a subset of M (session 15: the mid-M rows after DEFER)
            ms = [int(m) for m in args.ms.split(",")]
            suite.linear_rows(rec, models=("llama3-8b", "llama2-7b"), ms=ms, deadline=deadline)
        elif "bench" in phases:
            suite.linear_rows(rec, models=("llama3-8b",), ms=[1, 16, 64, 128, 256, 1024, 4096, 8192], deadline=deadline)
            suite.linear_rows(rec, models=("llama2-7b",), ms=[1, 16, 128, 1024, 4096], deadline=deadline)
        if "ffn" in phases and time.time() < deadline:
            suite.ffn_rows(rec, ms=(1, 16, 1024, 4096))
    except Exception:
        traceback.print_exc()
        rec.note("bench aborted: " + traceback.format_exc().strip().splitlines()[-1])
    path = rec.write(OUT, baseline=suite.BASELINE, command=" ".join(sys.argv))
    md = path.with_suffix(".md").read_text()
    print(md, flush=True)
    # summary: speedups vs bf16 and ratios of interest
    by = {}
    for r in rec.rows:
        if "median_ms" in r:
            by[(tuple(sorted(r["case"].items())), r["provider"])] = r["median_ms"]
    cases = sorted({k[0] for k in by}, key=lambda c: (dict(c)["model"], dict(c)["layer"], dict(c)["M"]))
    SUMMARY.append("| model | layer | M | lowbit ms | x bf16 | x tinygemm | lowbit / fp8-rowwise(no q) |")
    for c in cases:
        lb = by.get((c, "lowbit-w4a8fp8"))
        if lb is None:
            continue
        bf, tg, f8 = by.get((c, "cublas-bf16")), by.get((c, "tinygemm-int4")), by.get((c, "scaled_mm-fp8-rowwise"))
        d = dict(c)
        SUMMARY.append(f"| {d['model']} | {d['layer']} | {d['M']} | {lb:.4f} | {bf / lb if bf else float('nan'):.2f} | "
                       f"{tg / lb if tg else float('nan'):.2f} | {lb / f8 if f8 else float('nan'):.2f} |")


# ------------------------------------------------------------------------- (3b) config sweep
def _c(bm, bn, sk, swap, w, st, gm=1, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=sk, SWAP_AB=swap, num_warps=w, num_stages=st, GROUP_M=gm, **kw)


SWEEP = [  # (N, K, M, configs)
    (28672, 4096, 16, [_c(16, 64, 1, True, 4, 4), _c(16, 64, 1, True, 4, 6), _c(16, 128, 1, True, 4, 4),
                       _c(16, 64, 2, True, 4, 4), _c(16, 64, 1, True, 8, 4), _c(16, 64, 1, True, 4, 4, FAST_ACC=True)]),
    (4096, 14336, 16, [_c(16, 64, 8, True, 4, 4), _c(16, 64, 4, True, 4, 4), _c(16, 64, 16, True, 4, 4),
                       _c(16, 64, 8, True, 4, 6)]),
    (4096, 14336, 128, [_c(64, 128, 1, False, 4, 4, 8), _c(64, 128, 2, False, 4, 4, 8), _c(64, 128, 4, False, 4, 4, 8),
                        _c(64, 64, 2, False, 4, 4, 8), _c(128, 128, 4, False, 8, 4, 8)]),
    (28672, 4096, 1024, [_c(128, 128, 1, False, 8, 4, 8), _c(128, 128, 1, False, 8, 3, 8, ACC_TILE=True),
                         _c(128, 128, 1, False, 8, 3, 8), _c(64, 128, 1, False, 4, 4, 8),
                         _c(128, 128, 1, False, 4, 4, 8, FAST_ACC=True), _c(128, 256, 1, False, 8, 3, 8, FAST_ACC=True)]),
]


def sweep(until: float):
    from lowbit.bench.harness import time_cuda
    from lowbit.bench.suites.w4a8_fp8 import random_packed
    from lowbit.formats.common import FP8_E4M3
    from lowbit.kernels.act_quant import per_token_quant_triton
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    rows = []
    for N, K, M, cfgs in SWEEP:
        sets = [random_packed(N, K) for _ in range(3)]
        xq, sx = per_token_quant_triton(torch.randn(M, K, device=DEV, dtype=torch.bfloat16), FP8_E4M3)
        for cfg in cfgs:
            if time.time() > until:
                rows.append({"N": N, "K": K, "M": M, "config": cfg, "skipped": "time"})
                continue
            try:
                t = time_cuda(lambda c, s: w4a8_fp8_gemm(xq, sx, c, s, 1.0, K, 128, config=cfg), sets,
                              warmup=3, reps=20 if M <= 64 else 10)
                rows.append({"N": N, "K": K, "M": M, "config": cfg, "median_ms": t["median_ms"]})
                log(f"sweep N={N} K={K} M={M} {cfg}: {t['median_ms']:.4f} ms")
            except Exception as exc:
                rows.append({"N": N, "K": K, "M": M, "config": cfg, "error": str(exc)[:300]})
                log(f"sweep N={N} K={K} M={M} {cfg}: ERROR {type(exc).__name__}: {str(exc)[:200]}")
        del sets
    (OUT / "sweep.json").write_text(json.dumps(rows, indent=1))
    for N, K, M, _ in SWEEP:
        ok = [r for r in rows if r["N"] == N and r["M"] == M and "median_ms" in r]
        if ok:
            b = min(ok, key=lambda r: r["median_ms"])
            SUMMARY.append(f"sweep best N={N} K={K} M={M}: {b['median_ms']:.4f} ms {b['config']}")


# ------------------------------------------------------------------------- (3a) decode sweep (session 3)
# R7 (H200, M=1): gate_up default 29.9 us, SWORD 27.4, TMA 28.9, KSTEP=2 33.8, stream-K 264/132 30.9/38.6,
# no-dequant skeleton on the same bytes 20.6, read-only probes 24.3 (GEMM row pattern, 224 CTAs) / 17.5
# (contiguous); lm_head 111.7 -> TMA 86.1, KSTEP=2+SWORD 90.5; down 18.8 (no variant faster); .rounds/r7.
# R8: TMA+SWORD gate_up 26.8, + KSTEP=2 (3 stages) 25.4, lm_head 78.6 / 77.2; down 128 rows + TMA + SWORD
# 16.1 vs 18.8; stream-K 396/528 27.6/28.4, rotated K start no change; M=128: nothing beat the default.
DECODE_SHAPES = {"gate_up": (28672, 4096), "lm_head": (128256, 4096), "down": (4096, 14336), "qkv": (6144, 4096),
                 "o": (4096, 4096),
                 # R12 wave diagnostics: 132 / 264 programs of 128 rows (1 / 2 per SM) vs gate_up's 224
                 "gu_w1": (16896, 4096), "gu_w2": (33792, 4096)}
_B128 = [dict(KSTEP=1, num_stages=4), dict(KSTEP=2, num_stages=4), dict(KSTEP=4, num_stages=2),
         dict(SPLIT_K=2), dict(SWORD=False, TMA=False, KSTEP=1, num_stages=4)]
_DOWN = [dict(KSTEP=2, num_stages=3), dict(SPLIT_K=4), dict(SPLIT_K=16),
         dict(BLOCK_N=64, TMA=False, SWORD=False)]
_QO = [dict(BLOCK_N=128, TMA=True, SWORD=True), dict(BLOCK_N=128, TMA=True, SWORD=True, SPLIT_K=8),
       dict(BLOCK_N=128, TMA=True, SWORD=True, KSTEP=2, num_stages=3), dict(SWORD=True)]
# R11: wave balance at decode (gate_up: 224 CTAs of 128 rows on 132 SMs = 1.7 waves) with 64-row TMA
# tiles; M = 128 with 128 weight rows per CTA (x re-read from L2 half as often), 8 warps, TMA.
_B64 = [dict(BLOCK_N=64, KSTEP=2, num_stages=3), dict(BLOCK_N=64, SPLIT_K=2), dict(SPLIT_K=4),
        dict(BLOCK_N=64, SPLIT_K=2, KSTEP=1, num_stages=4)]  # 448 / 896 / 896 / 896 programs
_M128 = [dict(BLOCK_N=128, num_warps=8, num_stages=3), dict(BLOCK_N=128, num_warps=8), dict(BLOCK_N=128, num_warps=8, TMA=True, SWORD=True),
         dict(TMA=True, SWORD=True)]
# R11 (H200): LUT2 gate_up M=1 24.1 vs 25.3 us (M=128 58.5 vs 58.1); TILED 25.1 / 56.2 (M=128) / down M=128
# 36.0 vs 38.5; PDL act_quant+gemm -1.0..-1.3 us at M=1 but +2.4 (down) / +0.6 (qkv) at M=16; 64-row tiles,
# split-K 2/4 and 8-warp 128-row M=128 tiles all slower (.rounds/r11/w4a8_fp8).
# R12: same-round A/B of LUT2 on every decode shape (the flip candidate), PDL with / without the GEMM's
# early trigger (ABAB), 256-row gate_up tiles (112 programs: one wave), wave diagnostics gu_w1 / gu_w2.
# CAT: [w_lo | w_hi] as one K=128 dot per tile (offline sm_90 SASS: gate_up loop 589 -> 552 instructions
# per iteration with LUT2, 4 -> 2 wgmma waits; down 306 -> 290; qkv 232 -> 215).
_L2 = dict(LUT2=True)
_LC = dict(LUT2=True, CAT=True)
# R12 -> committed defaults: LUT2 + CAT (decode wide-N / 64-row paths and M = 65..511), LUT2 (long K),
# PDL for M = 1. R13: same-round A/B against the old default (both flags off), down with CAT, gate_up
# pipeline shape with the new loop (KSTEP=4, 4 stages, 2 warpgroups of 64 rows).
_OLD = dict(LUT2=False, CAT=False)
# R13 (same-round A/B, committed vs _OLD): gate_up M=1 23.6 vs 25.6 us, M=16 24.1 vs 25.8; down 16.1 vs 16.3,
# M=16 17.7 vs 18.3 (CAT 16.7 / 17.9); qkv 11.7 vs 12.2; o 10.2 vs 10.5; lm_head 73.7 vs 77.2; M=128 gate_up
# 54.6 vs 58.8, down 34.3 vs 38.7; gate_up KSTEP=4 23.7, 4 stages 23.7, 8 warps 36.2 (.rounds/r13/w4a8_fp8).
# R14 (final): the committed defaults vs the old default once more, then the full table.
DECODE_CASES = [  # (shape, M, variants on top of pick_config)
    ("gate_up", 1, [_OLD]), ("down", 1, [_OLD]), ("qkv", 1, [_OLD]), ("o", 1, [_OLD]),
    ("gate_up", 16, [_OLD]), ("down", 16, [_OLD]),
    ("gate_up", 128, [_OLD]), ("down", 128, [_OLD]), ("lm_head", 1, [_OLD]),
]
TILED_AB = os.environ.get("W4A8_TILED_AB", "0") == "1"  # R11 ran every variant on tile-major codes too


def decode_sweep(until: float):
    """Decode (M = 1, 16) and M = 128 GEMM variants around pick_config, activation quantization
    alone and cuBLAS bf16, Llama-3-8B shapes + lm_head. Every variant's output is compared with the
    default's on the same inputs (bit-equal expected, except stream-K / split-K: summation order)."""
    from lowbit.bench import peers
    from lowbit.bench.harness import time_cuda
    from lowbit.bench.suites.w4a8_fp8 import random_packed
    from lowbit.formats.common import FP8_E4M3
    from lowbit.formats.w4a8_fp8 import tile_codes
    from lowbit.kernels import w4a8_fp8_gemm as G
    from lowbit.kernels.act_quant import per_token_quant_triton

    rows = []

    def rec(shape, M, label, fn, sets, reps=60, nbytes=None, extra=None):
        if time.time() > until:
            rows.append({"shape": shape, "M": M, "label": label, "skipped": "time"})
            return None
        try:
            t = time_cuda(fn, sets, warmup=3, reps=reps)["median_ms"]
            r = {"shape": shape, "M": M, "label": label, "median_us": t * 1e3, **(extra or {})}
            if nbytes:
                r["TBps"] = nbytes / (t * 1e-3) / 1e12
            rows.append(r)
            log(f"decode {shape} M={M} {label}: {t * 1e3:.1f} us" + (f" ({r['TBps']:.2f} TB/s)" if nbytes else "")
                + (f" {extra}" if extra else ""))
            return t
        except Exception as exc:
            rows.append({"shape": shape, "M": M, "label": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            log(f"decode {shape} M={M} {label}: ERROR {type(exc).__name__}: {str(exc)[:200]}")
            return None

    cache = {}
    for shape, M, variants in DECODE_CASES:
        if time.time() > until:
            rows.append({"shape": shape, "M": M, "skipped": "time"})
            continue
        N, K = DECODE_SHAPES[shape]
        wbytes = N * K // 2 + N * K // 128
        if shape not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            nsets = max(2, min(8, -(-int(2.5 * 50e6) // wbytes) + 1))
            cache[shape] = [random_packed(N, K) for _ in range(nsets)]
        sets = cache[shape]
        idx = [(i,) for i in range(len(sets))]
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        xq, sx = per_token_quant_triton(x, FP8_E4M3)
        cfg = G.pick_config(M, N, K)
        y0 = G.w4a8_fp8_gemm(xq, sx, *sets[0], 0.01, K, 128)
        rec(shape, M, f"gemm default {cfg}", lambda i: G.w4a8_fp8_gemm(xq, sx, *sets[i], 0.01, K, 128), idx,
            nbytes=wbytes)
        if M in (1, 16) and shape in ("gate_up", "down", "qkv", "o"):
            # A/B of the module path (w4a8_fp8_linear: act quant counted), committed flags, ABA: the committed
            # PDL rule (M <= PDL_LINEAR_MAX_M) vs PDL off / on (R13)
            from lowbit.ops.w4a8_fp8 import w4a8_fp8_linear
            yl0 = None
            committed = (G.PDL_LINEAR_MAX_M, G.PDL_NOSPLIT_MAX_M)
            on = G.use_pdl_linear(M, N, K)
            for label, pmax in [("committed", committed), ("PDL off" if on else "PDL on", (0, 0) if on else (64, 64)),
                                ("committed", committed)]:
                try:
                    G.PDL_LINEAR_MAX_M, G.PDL_NOSPLIT_MAX_M = pmax
                    yl = w4a8_fp8_linear(x, *sets[0], 0.01, K, 128)
                    yl0 = yl if yl0 is None else yl0
                    rec(shape, M, f"linear op {label} (PDL max M, no-split max M = {pmax})",
                        lambda i: w4a8_fp8_linear(x, *sets[i], 0.01, K, 128), idx,
                        nbytes=wbytes, extra={"equal_to_default": bool(torch.equal(yl, yl0)), "rel_to_default": 0.0})
                finally:
                    G.PDL_LINEAR_MAX_M, G.PDL_NOSPLIT_MAX_M = committed
        # A/B: the same configs on tile-major codes (lowbit.formats.w4a8_fp8.tile_codes), same run
        tkey = ("tiled", shape)
        if TILED_AB and tkey not in cache:
            cache[tkey] = [(tile_codes(c), sc) for c, sc in sets]
        tsets = cache.get(tkey)
        for extra in ([None] if TILED_AB else []) + variants:
            for tiled in (((False, True) if extra is not None else (True,)) if TILED_AB else (False,)):
                c2 = dict(cfg, **(extra or {}))
                ss = tsets if tiled else sets
                try:
                    y = G.w4a8_fp8_gemm(xq, sx, *ss[0], 0.01, K, 128, config=c2, tiled=tiled)
                    err = ((y.float() - y0.float()).norm() / y0.float().norm()).item()
                    eq = {"equal_to_default": bool(torch.equal(y, y0)), "rel_to_default": err}
                except Exception as exc:
                    eq = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                rec(shape, M, f"gemm{' TILED' if tiled else ''} {extra or 'default'}",
                    lambda i, c2=c2, ss=ss, tiled=tiled: G.w4a8_fp8_gemm(xq, sx, *ss[i], 0.01, K, 128, config=c2,
                                                                          tiled=tiled),
                    idx, nbytes=wbytes, extra=eq)
        if shape == "gate_up" and M == 1:  # the same bytes without dequantization (W_FP8 loop)
            K2 = sets[0][0].shape[1]
            xq2, sx2 = per_token_quant_triton(torch.randn(1, K2, device=DEV, dtype=torch.bfloat16), FP8_E4M3)
            for extra in ({},):
                c3 = dict(G.pick_config(1, N, K2), **extra)
                rec(shape, M, f"no-dequant probe (W_FP8 on codes as fp8 [N,{K2}]) {extra}",
                    lambda i: G._launch(xq2, sx2, sets[i][0].view(FP8_E4M3), sets[i][1], 1.0, K2, 128, None, None,
                                        False, torch.bfloat16, c3, quant_a=False, w_fp8=True), idx, nbytes=N * K2)
        try:
            if shape.startswith("gu_"):  # diagnostics: no peer
                raise RuntimeError("no bf16 peer for diagnostic shapes")
            wb = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
            lin = peers.cublas_bf16(wb)
            rec(shape, M, "cublas-bf16", lambda i: lin(x), [(0,)], nbytes=2 * N * K)
            del wb, lin
        except Exception as exc:
            log(f"decode {shape} bf16: {exc}")
        _write_rows("decode.json", rows)
    cache.clear()
    torch.cuda.empty_cache()
    _write_rows("decode.json", rows)
    for r in rows:
        if "median_us" in r:
            SUMMARY.append(f"decode {r['shape']} M={r['M']} {r['label'][:90]}: {r['median_us']:.1f} us"
                           + (f" {r['TBps']:.2f} TB/s" if "TBps" in r else "")
                           + (f" eq={r['equal_to_default']} rel={r['rel_to_default']:.1e}" if "equal_to_default" in r
                              else ""))


# ------------------------------------------------------------------------- (3c) decisions (session 2)
GU, DN = (28672, 4096), (4096, 14336)  # Llama-3-8B gate_up, down


def decide(until: float):
    """Timings behind the dispatch choices, in priority order: (A) activation quantization fused
    into the decode GEMM vs a separate launch; (B) decode GEMM configs; (C) M = 128 swap-AB;
    (D) M >= 1024 dequantize-once + FP8 GEMM (Triton / _scaled_mm) vs the fused-dequant kernel."""
    from lowbit.bench import peers
    from lowbit.bench.harness import time_cuda
    from lowbit.bench.suites.w4a8_fp8 import random_packed
    from lowbit.formats.common import FP8_E4M3
    from lowbit.kernels.act_quant import per_token_quant_triton
    from lowbit.kernels.w4a8_fp8_gemm import (dequantize_to_fp8, pick_config, w4a8_fp8_gemm,
                                              w4a8_fp8_linear_fused)

    rows = []
    cache = {}

    def weights(NK):
        if NK not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[NK] = [random_packed(*NK) for _ in range(3)]
        return cache[NK]

    def rec(exp, NK, M, label, fn, reps):
        if time.time() > until:
            rows.append({"exp": exp, "N": NK[0], "K": NK[1], "M": M, "label": label, "skipped": "time"})
            return None
        try:
            t = time_cuda(fn, [(i,) for i in range(3)], warmup=3, reps=reps)["median_ms"]
            rows.append({"exp": exp, "N": NK[0], "K": NK[1], "M": M, "label": label, "median_ms": t})
            log(f"decide {exp} N={NK[0]} K={NK[1]} M={M} {label}: {t * 1e3:.1f} us")
            return t
        except Exception as exc:
            rows.append({"exp": exp, "N": NK[0], "K": NK[1], "M": M, "label": label, "error": str(exc)[:300]})
            log(f"decide {exp} {label}: ERROR {type(exc).__name__}: {str(exc)[:200]}")
            return None

    def exp_a():  # fused activation quantization at decode
        for NK in (GU, DN):
            N, K = NK
            W = weights(NK)
            for M in (1, 4, 16):
                x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
                q = per_token_quant_triton(x, FP8_E4M3)
                cfg = pick_config(M, N, K)
                rec("A", NK, M, "fused-quant", lambda i: w4a8_fp8_linear_fused(x, *W[i], 0.01, K, 128), 100)
                rec("A", NK, M, "separate-quant", lambda i: w4a8_fp8_gemm(*per_token_quant_triton(x, FP8_E4M3), *W[i],
                                                                            0.01, K, 128), 100)
                rec("A", NK, M, "gemm-only", lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128), 100)
                if cfg["SPLIT_K"] > 1:
                    c2 = dict(cfg, SK_SEM=False)
                    rec("A", NK, M, "gemm-only reduce-kernel",
                        lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128, config=c2), 100)
                if M in (1, 16):
                    wb = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
                    rec("A", NK, M, "cublas-bf16", lambda i: torch.nn.functional.linear(x, wb), 100)
                    del wb

    def _c(bm, bn, sk, swap, w, st, gm=1, **kw):
        return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=sk, SWAP_AB=swap, num_warps=w, num_stages=st, GROUP_M=gm, **kw)

    def exp_b():  # decode GEMM configs (pre-quantized x; fused quant on the best later)
        grid = {GU: [_c(16, 64, 1, True, 4, 4, SWORD=False), _c(16, 64, 2, True, 4, 4), _c(16, 128, 2, True, 4, 4),
                     _c(16, 64, 4, True, 4, 4), _c(16, 64, 1, True, 4, 6), _c(16, 64, 1, True, 4, 4, IMPRECISE=0),
                     _c(16, 64, 1, True, 4, 4, ACC_TILE=True), _c(16, 128, 1, True, 4, 4)],
                DN: [_c(16, 64, 4, True, 4, 4, SWORD=False), _c(16, 64, 2, True, 4, 4), _c(16, 64, 8, True, 4, 4),
                     _c(16, 128, 4, True, 4, 4), _c(16, 64, 4, True, 4, 6), _c(16, 64, 4, True, 4, 4, IMPRECISE=0),
                     _c(16, 64, 4, True, 4, 4, ACC_TILE=True)]}
        for NK, cfgs in grid.items():
            N, K = NK
            W = weights(NK)
            for M in (1, 16):
                q = per_token_quant_triton(torch.randn(M, K, device=DEV, dtype=torch.bfloat16), FP8_E4M3)
                rec("B", NK, M, f"default {pick_config(M, N, K)}", lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128), 50)
                for cfg in cfgs:
                    rec("B", NK, M, str(cfg), lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128, config=cfg), 50)

    def exp_c():  # M = 128: swap-AB keeps the dequantized weight in registers (wgmma A operand)
        for NK in (GU, DN):
            N, K = NK
            W = weights(NK)
            M = 128
            q = per_token_quant_triton(torch.randn(M, K, device=DEV, dtype=torch.bfloat16), FP8_E4M3)
            sk = 4 if NK == DN else 1
            cfgs = [None, _c(128, 64, sk, True, 4, 4, ACC_TILE=True), _c(128, 128, sk, True, 8, 4, ACC_TILE=True),
                    _c(64, 64, sk, True, 4, 4), _c(128, 64, sk, True, 4, 4),
                    _c(128, 128, sk, False, 8, 4, 8, ACC_TILE=True)]
            for cfg in cfgs:
                rec("C", NK, M, str(cfg or f"default {pick_config(M, N, K)}"),
                    lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128, config=cfg), 30)
            wb = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
            xb = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            rec("C", NK, M, "cublas-bf16", lambda i: torch.nn.functional.linear(xb, wb), 30)
            del wb

    def exp_d():  # large M: dequantize once + FP8 GEMM
        big = dict(BLOCK_M=128, BLOCK_N=128, SPLIT_K=1, SWAP_AB=False, num_warps=8, num_stages=3, GROUP_M=8,
                   ACC_TILE=True)
        for NK in (GU, DN):
            N, K = NK
            W = weights(NK)
            wb = torch.randn(N, K, device=DEV, dtype=torch.bfloat16)
            mm = peers.scaled_mm_rowwise(wb, quantize_x=False)
            del wb
            rec("D", NK, 0, "dequantize_to_fp8 alone", lambda i: dequantize_to_fp8(*W[i], K, 128), 10)
            for M in (1024, 4096):
                x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
                q = per_token_quant_triton(x, FP8_E4M3)
                pq = peers.fp8_rowwise_act(x)
                reps = 10 if M == 1024 else 5
                rec("D", NK, M, "scaled_mm-fp8-rowwise (no act quant)", lambda i: mm(*pq), reps)
                rec("D", NK, M, "act-quant alone", lambda i: per_token_quant_triton(x, FP8_E4M3), reps)
                for label, cfg in [("dequant+scaled_mm", dict(big, MODE="scaled_mm")),
                                   ("dequant+triton 128x128 w8", dict(big, MODE="dequant")),
                                   ("dequant+triton 128x128 w8 st4", dict(big, MODE="dequant", num_stages=4)),
                                   ("dequant+triton 128x128 w4 st4", dict(big, MODE="dequant", num_warps=4, num_stages=4)),
                                   ("fused-dequant default", None)]:
                    rec("D", NK, M, label, lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128, config=cfg), reps)
            del mm

    def exp_e():  # R5: M = 256 / 512 crossover, swap-AB fused-dequant vs dequantize-once + _scaled_mm
        swap = lambda M, N, K: dict(BLOCK_M=128, BLOCK_N=64, SPLIT_K=1 if N > 8192 else (4 if K > 8192 else 2),
                                    SWAP_AB=True, num_warps=4, num_stages=4, GROUP_M=1, ACC_TILE=True, SWORD=False)
        for NK in (GU, DN, (4096, 4096)):
            N, K = NK
            W = weights(NK)
            for M in (256, 512):
                q = per_token_quant_triton(torch.randn(M, K, device=DEV, dtype=torch.bfloat16), FP8_E4M3)
                c1 = swap(M, N, K)
                rec("E", NK, M, f"fused-dequant swap {c1}", lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128, config=c1), 30)
                c2 = dict(pick_config(1024, N, K), MODE="scaled_mm")
                rec("E", NK, M, "dequant+scaled_mm", lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128, config=c2), 30)

    def exp_f():  # R5: decode tiles around the R4 winner (BLOCK_N=128, ACC_TILE, 16-byte scale chunk)
        base = dict(BLOCK_M=16, SWAP_AB=True, num_warps=4, GROUP_M=1, ACC_TILE=True, SWORD=False)
        grid = {GU: [dict(base, BLOCK_N=128, SPLIT_K=1, num_stages=3), dict(base, BLOCK_N=128, SPLIT_K=1, num_stages=5),
                     dict(base, BLOCK_N=256, SPLIT_K=1, num_stages=4), dict(base, BLOCK_N=128, SPLIT_K=1, num_stages=4,
                                                                          num_warps=8)],
                DN: [dict(base, BLOCK_N=64, SPLIT_K=4, num_stages=4), dict(base, BLOCK_N=128, SPLIT_K=8, num_stages=4),
                     dict(base, BLOCK_N=64, SPLIT_K=8, num_stages=5)]}
        for NK, cfgs in grid.items():
            N, K = NK
            W = weights(NK)
            for M in (1, 16):
                q = per_token_quant_triton(torch.randn(M, K, device=DEV, dtype=torch.bfloat16), FP8_E4M3)
                rec("F", NK, M, f"default {pick_config(M, N, K)}", lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128), 50)
                for cfg in cfgs:
                    rec("F", NK, M, str(cfg), lambda i: w4a8_fp8_gemm(*q, *W[i], 0.01, K, 128, config=cfg), 50)

    exps = (exp_e, exp_f, exp_a) if ROUND >= 5 else (exp_a, exp_d, exp_b, exp_c)
    for fn in exps:
        try:
            fn()
        except Exception:
            traceback.print_exc()
            rows.append({"exp": fn.__name__, "error": traceback.format_exc().strip().splitlines()[-1][:300]})
        (OUT / "decide.json").write_text(json.dumps(rows, indent=1))
    cache.clear()
    torch.cuda.empty_cache()
    for r in rows:
        if "median_ms" in r:
            SUMMARY.append(f"decide {r['exp']} N={r['N']} K={r['K']} M={r['M']} {r['label']}: {r['median_ms'] * 1e3:.1f} us")


# ------------------------------------------------------------------------- (4) accuracy
def accuracy():
    from lowbit.eval.corpus import load_text, tokenize
    from lowbit.eval.perplexity import perplexity
    from lowbit.models.arch import decoder_layers
    from lowbit.models.loading import load_model
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear
    from lowbit.ptq.pts import pts_exponent, subnormal_groups, underflow_groups

    t = time.time()
    model, tok = load_model(None, device=DEV)
    log(f"acc: model loaded in {time.time() - t:.1f}s")
    ids = tokenize(tok, load_text()).to(DEV)
    max_tokens = args.acc_tokens or (8192 if not args.cpu_smoke else 256)
    rows = []

    def quantize_all(m, pts):
        stats = {"underflow_groups": 0, "subnormal_groups": 0, "groups": 0, "pts_exp": []}
        for view in decoder_layers(m):
            for role, lin in view.linears().items():
                w = lin.weight.detach()
                scaled = w.float() * 2.0 ** (pts_exponent(w) if pts else 0)
                stats["underflow_groups"] += underflow_groups(scaled, 128)
                stats["subnormal_groups"] += subnormal_groups(scaled, 128)
                stats["groups"] += w.shape[0] * -(-w.shape[1] // 128)
                q = W4A8FP8Linear.from_linear(lin, group_size=128, pts=pts)
                stats["pts_exp"].append(q.pts_exp)
                view.set_linear(role, q)
        return stats

    def cas(m, projections):
        try:
            from lowbit.ptq.cas import apply_cas
        except ImportError:
            return None
        return apply_cas(m, projections=projections)

    t = time.time()
    r = perplexity(model, ids, max_tokens=max_tokens)
    rows.append({"row": "FP32 (float model)", "ppl": r.perplexity})
    log(f"acc FP32 ppl {r.perplexity:.3f} ({time.time() - t:.1f}s)")
    gu_d, every = ("gate_up", "down"), ("qkv", "o", "gate_up", "down")
    for label, use_cas, pts in [("W4A8 neither", None, False), ("W4A8 + PTS", None, True),
                                ("W4A8 + CAS(gate_up,down)", gu_d, False), ("W4A8 + CAS(gate_up,down) + PTS", gu_d, True),
                                ("W4A8 + CAS(all)", every, False), ("W4A8 + CAS(all) + PTS", every, True)]:
        if left() < 8:
            rows.append({"row": label, "skipped": "time budget"})
            continue
        try:
            t = time.time()
            m = copy.deepcopy(model)
            info = None
            if use_cas:
                info = cas(m, use_cas)
                if info is None:
                    rows.append({"row": label, "skipped": "lowbit.ptq.cas not available"})
                    continue
            st = quantize_all(m, pts)
            r = perplexity(m, ids, max_tokens=max_tokens)
            rows.append({"row": label, "ppl": r.perplexity, "underflow_groups": st["underflow_groups"],
                         "subnormal_groups": st["subnormal_groups"],
                         "groups": st["groups"], "pts_exp_min": min(st["pts_exp"]), "pts_exp_max": max(st["pts_exp"])})
            log(f"acc {label}: ppl {r.perplexity:.3f} underflow groups {st['underflow_groups']}/{st['groups']} "
                f"subnormal-scale groups {st['subnormal_groups']} "
                f"pts n in [{min(st['pts_exp'])}, {max(st['pts_exp'])}] ({time.time() - t:.1f}s)")
            del m
            (OUT / "accuracy.json").write_text(json.dumps({"max_tokens": max_tokens, "rows": rows}, indent=1))
        except Exception as exc:
            traceback.print_exc()
            rows.append({"row": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
    (OUT / "accuracy.json").write_text(json.dumps({"max_tokens": max_tokens, "window": 1024, "rows": rows}, indent=1))
    md = ["| linears w4a8-fp8 (g128), no KV quant | perplexity | groups with underflowing / subnormal FP8 scale |",
          "|---|---|---|"]
    for r in rows:
        cnt = f"{r['underflow_groups']} / {r['subnormal_groups']} of {r['groups']}" if "groups" in r else ""
        md.append(f"| {r['row']} | {r.get('ppl', float('nan')):.3f} | {cnt} |")
    (OUT / "accuracy.md").write_text("\n".join(md) + "\n")
    SUMMARY.extend(md)


def main():
    log(f"torch {torch.__version__}, device {DEV}, {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}")
    phases = {"decode", "check", "decide", "ptx", "bench", "ffn", "sweep", "acc"} - SKIP
    if args.cpu_smoke:
        phases = {"check"}
    for name, fn in [("decode", lambda: decode_sweep(T0 + float(os.environ.get("W4A8_DECODE_S", "47")))),
                     ("check", check), ("ptx", ptx_report_impl), ("bench", lambda: bench(phases)),
                     ("decide", lambda: decide(T0 + args.budget - 8)),
                     ("sweep", lambda: sweep(T0 + args.budget - 38)), ("acc", accuracy)]:
        if name == "check" and not args.cpu_smoke and left() < 14:
            SUMMARY.append("check: skipped (time budget)")
            continue
        if name in phases or (name == "bench" and "ffn" in phases):
            try:
                fn()
            except Exception:
                traceback.print_exc()
                SUMMARY.append(f"{name}: aborted ({traceback.format_exc().strip().splitlines()[-1]})")
            log(f"phase {name} done")
    print("\n==== SUMMARY ====")
    print("\n".join(SUMMARY))
    (OUT / "summary.txt").write_text("\n".join(SUMMARY) + "\n")


if __name__ == "__main__":
    main()
