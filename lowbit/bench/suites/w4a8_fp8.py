"""w4a8-fp8 (FireQ linear) vs peers: Llama-3-8B / Llama-2-7B linear shapes and the Llama-2-7B FFN.

Providers (all take bf16 activations unless said; weights rotate through > 2x L2):

- ``lowbit-w4a8fp8``: the module's forward (``w4a8_fp8_linear``): per-token FP8 quantization of x
  (Triton; fused into the GEMM when M <= ``FUSED_QUANT_MAX_M``) + the INT4xFP8 GEMM, or from
  ``DEQUANT_MIN_M`` the dequantize-once + ``torch._scaled_mm`` path; activation quantization and
  the dequantization are counted.
- ``lowbit-w4a8fp8 [gemm]``: the GEMM alone on pre-quantized x (for the breakdown).
- ``cublas-bf16`` (baseline), ``scaled_mm-fp8-rowwise`` (pre-quantized x, i.e. without its
  activation quantization), ``scaled_mm-fp8-rowwise+q`` (with torch-op quantization of x),
  ``tinygemm-int4`` (W4A16, M <= 256 only: it is 30x slower than bf16 beyond).

FFN block (Llama-2-7B: gate_up 22016x4096, down 4096x11008): lowbit = fused gate_up GEMM with the
SiLU*mul epilogue, then FP8 quantization of h and the down GEMM; bf16 = two cuBLAS GEMMs with
eager SiLU*mul; fp8 row-wise = quantize x, ``_scaled_mm``, SiLU*mul, quantize h, ``_scaled_mm``.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lowbit.bench import peers
from lowbit.bench.harness import gemm_flops, rotating_inputs, time_cuda

BASELINE = "cublas-bf16"

SHAPES = {
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama2-7b": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
}
MS = [1, 16, 64, 128, 256, 1024, 4096, 8192]
GROUP = 128


def _reps(M: int) -> int:
    return 100 if M <= 256 else (30 if M <= 1024 else 10)


def random_packed(N: int, K: int, dev="cuda"):
    """Random w4a8-fp8 weight fields (timing does not depend on the values)."""
    from lowbit.formats.w4a8_fp8 import padded_k, scale_cols

    codes = torch.randint(0, 256, (N, padded_k(K) // 2), dtype=torch.uint8, device=dev)
    scales = (torch.rand(N, scale_cols(K, GROUP), device=dev) * 4 + 1).to(torch.float8_e4m3fn)
    return codes, scales


def probe_cases(layers: dict, ms, make=None):
    """Cases of the device probes' GEMM-alone timing: per layer ``name -> (N, K)`` and per M, ``(name, N, K, sets, M,
    x, xq, sx)``: ``sets`` rotating weight copies (``make(N, K)``, default ``random_packed``), ``x`` bf16 ``[M, K]``
    and its per-token FP8 ``xq``, ``sx``. The copies are freed after each layer."""
    from lowbit.ops.quant import per_token_quant

    for name, (N, K) in layers.items():
        sets = rotating_inputs(lambda: (make or random_packed)(N, K))
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, sx = per_token_quant(x, "fp8")
            yield name, N, K, sets, M, x, xq, sx
        del sets
        torch.cuda.empty_cache()


def peer_gemm_fns(x, N: int, K: int, copies: int = 3) -> dict:
    """cuBLAS bf16 and ``torch._scaled_mm`` FP8 row-wise (x pre-quantized) on ``copies`` random ``[N, K]`` weights,
    as lists of callables for ``graph_us``."""
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
    mm = [peers.scaled_mm_rowwise(w, quantize_x=False) for w in ws]
    px = peers.fp8_rowwise_act(x)
    return {"cublas_bf16": [lambda w=w: F.linear(x, w) for w in ws], "scaled_mm_fp8": [lambda f=f: f(*px) for f in mm]}


def lowbit_fns(codes, scales, K, *, silu_mul=False):
    from lowbit.ops.w4a8_fp8 import w4a8_fp8_gemm, w4a8_fp8_linear

    full = lambda x: w4a8_fp8_linear(x, codes, scales, 2.0 ** -8, K, GROUP, silu_mul=silu_mul)
    gemm = lambda xq, sx: w4a8_fp8_gemm(xq, sx, codes, scales, 2.0 ** -8, K, GROUP, silu_mul=silu_mul)
    return full, gemm


def linear_rows(rec, models=("llama3-8b", "llama2-7b"), layers=None, ms=MS, *, tinygemm_max_m=256,
                deadline: float | None = None):
    from lowbit.ops.quant import per_token_quant

    dev = "cuda"
    for model in models:
        for layer, (N, K) in SHAPES[model].items():
            if layers is not None and layer not in layers:
                continue
            if deadline is not None and time.time() > deadline:
                rec.note(f"time budget reached before {model} {layer}")
                return
            sets = rotating_inputs(lambda: (torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5,
                                            *random_packed(N, K)))
            for M in ms:
                case = {"model": model, "layer": layer, "M": M, "N": N, "K": K}
                fl = gemm_flops(M, N, K)
                xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in sets]
                reps = _reps(M)
                # lowbit (act quant counted), and the GEMM alone
                fns = [lowbit_fns(c, s, K) for (_, c, s) in sets]
                t = time_cuda(lambda i, x: fns[i][0](x), list(enumerate(xs)), reps=reps)
                rec.record(case, "lowbit-w4a8fp8", t, flops=fl, bytes_moved=2 * M * K + N * K // 2 + 2 * M * N, peak="fp8")
                xq = [per_token_quant(x, "fp8") for x in xs]
                t = time_cuda(lambda i, q, s: fns[i][1](q, s), [(i, *q) for i, q in enumerate(xq)], reps=reps)
                rec.record(case, "lowbit-w4a8fp8 [gemm]", t, flops=fl, bytes_moved=M * K + N * K // 2 + 2 * M * N, peak="fp8")
                # peers
                bf = [peers.cublas_bf16(w) for (w, _, _) in sets]
                t = time_cuda(lambda i, x: bf[i](x), list(enumerate(xs)), reps=reps)
                rec.record(case, "cublas-bf16", t, flops=fl, bytes_moved=2 * (M * K + N * K + M * N), peak="bf16")
                mm = [peers.scaled_mm_rowwise(w, quantize_x=False) for (w, _, _) in sets]
                pq = [peers.fp8_rowwise_act(x) for x in xs]
                t = time_cuda(lambda i, q, s: mm[i](q, s), [(i, *q) for i, q in enumerate(pq)], reps=reps)
                rec.record(case, "scaled_mm-fp8-rowwise", t, flops=fl, bytes_moved=M * K + N * K + 2 * M * N, peak="fp8")
                mmq = [peers.scaled_mm_rowwise(w, quantize_x=True) for (w, _, _) in sets]
                t = time_cuda(lambda i, x: mmq[i](x), list(enumerate(xs)), reps=reps)
                rec.record(case, "scaled_mm-fp8-rowwise+q", t, flops=fl, bytes_moved=2 * M * K + N * K + 2 * M * N, peak="fp8")
                del mm, mmq, pq
                if M <= tinygemm_max_m:
                    try:
                        tg = [peers.tinygemm_int4(w) for (w, _, _) in sets]
                        t = time_cuda(lambda i, x: tg[i](x), list(enumerate(xs)), reps=reps)
                        rec.record(case, "tinygemm-int4", t, flops=fl, bytes_moved=2 * M * K + N * K // 2 + 2 * M * N,
                                   peak="bf16")
                        del tg
                    except peers.PeerUnavailable as exc:
                        rec.record(case, "tinygemm-int4", None, note=str(exc))
            del sets
            torch.cuda.empty_cache()


def ffn_rows(rec, ms=(1, 16, 1024, 4096)):
    """Llama-2-7B FFN block: gate_up + SiLU*mul + down (decode M = batch, prefill M = batch x 1024)."""
    from lowbit.ops.quant import per_token_quant
    from lowbit.ops.w4a8_fp8 import w4a8_fp8_linear

    dev = "cuda"
    (NGU, K), (KD_N, KD) = SHAPES["llama2-7b"]["gate_up"], SHAPES["llama2-7b"]["down"]
    inter = NGU // 2

    def make():
        wgu = torch.randn(NGU, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
        wd = torch.randn(KD_N, KD, device=dev, dtype=torch.bfloat16) * KD ** -0.5
        return (wgu, wd, *random_packed(NGU, K), *random_packed(KD_N, KD))

    sets = rotating_inputs(make)
    for M in ms:
        case = {"model": "llama2-7b", "layer": "ffn", "M": M, "N": inter, "K": K}
        fl = gemm_flops(M, NGU, K) + gemm_flops(M, KD_N, KD)
        xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in sets]
        reps = _reps(M)

        def lowbit_ffn(i, x):
            _, _, cgu, sgu, cd, sd = sets[i]
            h = w4a8_fp8_linear(x, cgu, sgu, 2.0 ** -8, K, GROUP, silu_mul=True)
            return w4a8_fp8_linear(h, cd, sd, 2.0 ** -8, KD, GROUP)

        t = time_cuda(lowbit_ffn, list(enumerate(xs)), reps=reps)
        rec.record(case, "lowbit-w4a8fp8", t, flops=fl, peak="fp8")

        def bf16_ffn(i, x):
            wgu, wd = sets[i][0], sets[i][1]
            gu = F.linear(x, wgu)
            return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], wd)

        t = time_cuda(bf16_ffn, list(enumerate(xs)), reps=reps)
        rec.record(case, "cublas-bf16", t, flops=fl, peak="bf16")
        fp8 = [(peers.scaled_mm_rowwise(s[0], quantize_x=True), peers.scaled_mm_rowwise(s[1], quantize_x=True))
               for s in sets]

        def fp8_ffn(i, x):
            gu = fp8[i][0](x)
            return fp8[i][1](F.silu(gu[:, :inter]) * gu[:, inter:])

        t = time_cuda(fp8_ffn, list(enumerate(xs)), reps=reps)
        rec.record(case, "scaled_mm-fp8-rowwise+q", t, flops=fl, peak="fp8")
        del fp8
        if M <= 16:
            try:
                tg = [(peers.tinygemm_int4(s[0]), peers.tinygemm_int4(s[1])) for s in sets]

                def tg_ffn(i, x):
                    gu = tg[i][0](x)
                    return tg[i][1](F.silu(gu[:, :inter]) * gu[:, inter:])

                t = time_cuda(tg_ffn, list(enumerate(xs)), reps=reps)
                rec.record(case, "tinygemm-int4", t, flops=fl, peak="bf16")
            except peers.PeerUnavailable as exc:
                rec.record(case, "tinygemm-int4", None, note=str(exc))
    del sets
    torch.cuda.empty_cache()
    _ = per_token_quant


def run(rec, quick: bool = False):
    if quick:
        linear_rows(rec, models=("llama3-8b",), ms=[1, 16, 128, 1024, 8192])
        ffn_rows(rec, ms=(1, 16, 1024))
    else:
        linear_rows(rec)
        ffn_rows(rec)
