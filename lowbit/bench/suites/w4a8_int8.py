"""QServe W4A8 INT8 linear (``w4a8-int8``) against cuBLAS bf16, and the FFN block against FireQ's
``w4a8-fp8`` (when ``lowbit.nn.w4a8_fp8`` exists).

Linear rows: Llama-3-8B shapes (qkv, o, gate_up, down), M in {1, 16, 64, 128, 1024, 4096};
providers ``cublas-bf16`` (baseline), ``lowbit-w4a8-int8`` (bf16 x in, per-token INT8
quantization counted), ``lowbit-w4a8-int8-gemm`` (x already INT8: the GEMM alone) and
``lowbit-w4a8-fp8`` (FireQ's linear, its quantization counted) if present.
FFN rows: Llama-2-7B (hidden 4096, intermediate 11008): gate_up GEMM, SiLU*mul, down GEMM,
for decode batches 1-64 and prefill M = batch x 1024.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.bench import peers
from lowbit.bench.harness import gemm_flops, rotating_inputs, time_cuda
from lowbit.formats import w4a8_int8 as fmt

BASELINE = "cublas-bf16"

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LLAMA2_7B_FFN = (4096, 11008)  # hidden, intermediate
MS = [1, 16, 64, 128, 1024, 4096]


def _reps(m: int) -> int:
    return 30 if m >= 4096 else 60 if m >= 1024 else 100


TILED = True  # the codes' layout: W4A8INT8Linear's default (row-tiled; every shape here has N % 64 == 0)


def _qoq(n: int, k: int, dev="cuda"):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
    q = fmt.quantize(w, 128)
    return fmt.tile_codes(q.qweight) if TILED else q.qweight, q.wscale, q.gscale, q.gzs


def _weight_bytes(n, k):
    return n * k // 2 + n * 4 + 2 * n * (k // 128)


def fp8_linear_factory():
    """FireQ's W4A8FP8Linear.from_linear, or None when the w4a8_fp8 area has not landed."""
    try:
        from lowbit.nn.w4a8_fp8 import W4A8FP8Linear
    except Exception:
        return None
    return W4A8FP8Linear


def linear_rows(rec, quick: bool = False, ms=None, layers=None):
    from lowbit.ops.quant import per_token_quant
    from lowbit.ops.w4a8_int8 import w4a8_int8_gemm, w4a8_int8_linear

    dev = "cuda"
    ms = ms or ([1, 16, 1024] if quick else MS)
    fp8cls = fp8_linear_factory()
    if fp8cls is None:
        rec.note("lowbit.nn.w4a8_fp8 not present: no w4a8-fp8 linear rows")
    for layer in layers or LLAMA3_8B:
        N, K = LLAMA3_8B[layer]
        wb = rotating_inputs(lambda: (torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5,))
        wq = rotating_inputs(lambda: _qoq(N, K))
        fp8mods = None
        if fp8cls is not None:
            try:
                fp8mods = []
                for (w,) in wb:
                    lin = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
                    lin.weight.data.copy_(w)
                    fp8mods.append(fp8cls.from_linear(lin, group_size=128))
            except Exception as exc:
                rec.note(f"w4a8-fp8 from_linear failed: {type(exc).__name__}: {exc}"[:200])
                fp8mods = None
        for M in ms:
            case = {"layer": layer, "M": M, "N": N, "K": K}
            fl = gemm_flops(M, N, K)
            reps = _reps(M)
            xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(max(len(wb), len(wq)))]
            t = time_cuda(lambda w, x: F.linear(x, w), [(w, xs[i]) for i, (w,) in enumerate(wb)], reps=reps)
            rec.record(case, "cublas-bf16", t, flops=fl, bytes_moved=2 * (M * K + N * K + M * N), peak="bf16")
            try:
                t = time_cuda(lambda x, *w: w4a8_int8_linear(x, *w, tiled=TILED), [(xs[i], *w) for i, w in enumerate(wq)],
                              reps=reps)
                rec.record(case, "lowbit-w4a8-int8", t, flops=fl, peak="int8",
                           bytes_moved=2 * M * K + _weight_bytes(N, K) + 2 * M * N)
                xq = [per_token_quant(xs[i], "int8") for i in range(len(wq))]
                t = time_cuda(lambda a, s, *w: w4a8_int8_gemm(a, s, *w, out_dtype=torch.bfloat16, tiled=TILED),
                              [(*xq[i], *w) for i, w in enumerate(wq)], reps=reps)
                rec.record(case, "lowbit-w4a8-int8-gemm", t, flops=fl, peak="int8",
                           bytes_moved=M * K + 4 * M + _weight_bytes(N, K) + 2 * M * N)
                del xq
            except Exception as exc:
                rec.record(case, "lowbit-w4a8-int8", None, note=f"{type(exc).__name__}: {exc}"[:200])
            if fp8mods:
                try:
                    t = time_cuda(lambda m, x: m(x), [(m, xs[i]) for i, m in enumerate(fp8mods)], reps=reps)
                    rec.record(case, "lowbit-w4a8-fp8", t, flops=fl, peak="fp8",
                               bytes_moved=2 * M * K + N * K // 2 + 2 * M * N)
                except Exception as exc:
                    rec.record(case, "lowbit-w4a8-fp8", None, note=f"{type(exc).__name__}: {exc}"[:200])
            del xs
        del wb, wq, fp8mods
        torch.cuda.empty_cache()


def _ffn_int8(hidden: int, inter: int, fused: bool):
    """w4a8-int8 FFN: x -> gate_up (w4a8_int8_linear: INT8 quantization inside the GEMM for small M)
    -> SiLU*mul -> INT8 -> down GEMM. ``fused``: SiLU*mul and its quantization run inside the down
    GEMM for small M (``w4a8_int8_silu_mul_linear``: decode FFN = 2 launches), else in act_quant."""
    from lowbit.ops.quant import per_token_quant
    from lowbit.ops.w4a8_int8 import w4a8_int8_gemm, w4a8_int8_linear, w4a8_int8_silu_mul_linear

    gu = _qoq(2 * inter, hidden)
    dn = _qoq(hidden, inter)

    def ffn(x):
        h = w4a8_int8_linear(x, *gu, tiled=TILED)
        if fused:
            return w4a8_int8_silu_mul_linear(h, *dn, tiled=TILED)
        q, s = per_token_quant(F.silu(h[:, :inter]) * h[:, inter:], "int8")
        return w4a8_int8_gemm(q, s, *dn, out_dtype=x.dtype, tiled=TILED)

    return ffn


def _ffn_fp8(hidden: int, inter: int):
    cls = fp8_linear_factory()
    dev = "cuda"
    gu = torch.nn.Linear(hidden, 2 * inter, bias=False, device=dev, dtype=torch.bfloat16)
    dn = torch.nn.Linear(inter, hidden, bias=False, device=dev, dtype=torch.bfloat16)
    for lin in (gu, dn):
        torch.nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
    gq, dq = cls.from_linear(gu, group_size=128), cls.from_linear(dn, group_size=128)

    def ffn(x):
        h = gq(x)
        return dq(F.silu(h[:, :inter]) * h[:, inter:])

    return ffn


def _ffn_fp8_fused(hidden: int, inter: int):
    """FireQ's own fused MLP: gate/up interleaved in one w4a8-fp8 weight, SiLU*mul in its epilogue."""
    from lowbit.formats.common import interleave_rows
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    dev = "cuda"
    g = torch.randn(inter, hidden, device=dev, dtype=torch.bfloat16) * hidden ** -0.5
    u = torch.randn(inter, hidden, device=dev, dtype=torch.bfloat16) * hidden ** -0.5
    gu = W4A8FP8Linear.from_weight(interleave_rows(g, u), None, group_size=128, dtype=torch.bfloat16,
                                   activation="silu_mul")
    dn = torch.nn.Linear(inter, hidden, bias=False, device=dev, dtype=torch.bfloat16)
    torch.nn.init.normal_(dn.weight, std=inter ** -0.5)
    dq = W4A8FP8Linear.from_linear(dn, group_size=128)
    return lambda x: dq(gu(x))


def _ffn_bf16(hidden: int, inter: int):
    dev = "cuda"
    gu = torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * hidden ** -0.5
    dn = torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) * inter ** -0.5

    def ffn(x):
        h = F.linear(x, gu)
        return F.linear(F.silu(h[:, :inter]) * h[:, inter:], dn)

    return ffn


def ffn_rows(rec, quick: bool = False, ms=None):
    """Llama-2-7B FFN block; FireQ's claim: its FFN runs 1.68x QServe's at batch 16."""
    hidden, inter = LLAMA2_7B_FFN
    ms = ms or ([1, 16, 64, 1024] if quick else [1, 4, 16, 32, 64, 1024, 4096, 16384])
    providers = {"cublas-bf16": lambda: _ffn_bf16(hidden, inter),
                 "w4a8-int8": lambda: _ffn_int8(hidden, inter, fused=False),
                 "w4a8-int8-fused": lambda: _ffn_int8(hidden, inter, fused=True)}
    if fp8_linear_factory() is not None:
        providers["w4a8-fp8"] = lambda: _ffn_fp8(hidden, inter)
        providers["w4a8-fp8-fused"] = lambda: _ffn_fp8_fused(hidden, inter)
    else:
        rec.note("FFN: lowbit.nn.w4a8_fp8 not present, the FireQ-vs-QServe ratio was not measured")
    # 3 weight sets per provider (> 2x L2 in total for the 4-bit weights: 3 x 67 MB)
    fns = {}
    for name, make in providers.items():
        try:
            fns[name] = [make() for _ in range(3)]
        except Exception as exc:
            rec.note(f"FFN provider {name} unavailable: {type(exc).__name__}: {exc}"[:200])
    for M in ms:
        case = {"ffn": "llama2-7b", "M": M}
        fl = gemm_flops(M, 2 * inter, hidden) + gemm_flops(M, hidden, inter)
        xs = [torch.randn(M, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for name, fl3 in fns.items():
            try:
                t = time_cuda(lambda i, x: fl3[i](x), [(i, x) for i, x in enumerate(xs)], reps=_reps(M))
                rec.record(case, name, t, flops=fl, peak="int8" if "int8" in name else "fp8" if "fp8" in name else "bf16")
            except Exception as exc:
                rec.record(case, name, None, note=f"{type(exc).__name__}: {exc}"[:200])
        del xs
    del fns
    torch.cuda.empty_cache()


def run(rec, quick: bool = False):
    for part in (linear_rows, ffn_rows):
        try:
            part(rec, quick)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            rec.note(f"{part.__name__} aborted: {type(exc).__name__}: {exc}"[:300])
