"""FLUTE lookup-table GEMM vs cuBLAS bf16, torch int4 tinygemm and bitsandbytes NF4.

Shapes: Llama-3-8B gate_up (N=28672, K=4096), down (4096, 14336), qkv (6144, 4096) and
8192 x 8192; bf16 activations (bnb NF4 runs fp16, as in ANCHORS). Bytes counted for the LUT
rows: packed codes (bits/8 per weight) + 16-bit group scales + x + y, i.e. 4.125 bits per
weight at 4-bit g128; the roofline is bytes / measured HBM bandwidth.

Rows beyond the targets: the lookup variants (``load`` / ``select`` / ``affine``), the FMA vs
padded-dot path at M = 1, and the dequantize + cuBLAS path at large M (the crossover that sets
``lowbit.ops.lut.MAX_KERNEL_M``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.bench import peers
from lowbit.bench.harness import gemm_flops, rotating_inputs, time_cuda
from lowbit.formats.lut import pack_lut, pair_table, quantize_lut  # noqa: F401

BASELINE = "cublas-bf16"
SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "8192sq": (8192, 8192), "qkv": (6144, 4096)}


def make_packed(w: torch.Tensor, bits: int, group_size: int = 128, table="nf") -> dict:
    """Quantize + pack ``w`` [N, K] on its device: the tensors ``lowbit.ops.lut.lut_gemm`` takes."""
    q = quantize_lut(w, bits=bits, group_size=group_size, table=table, scale_dtype=torch.bfloat16)
    qw, qh, st = pack_lut(q)
    p = {"qweight": qw, "qweight_hi": qh, "scales": st, "table": q.table.to(w.device), "bits": bits,
         "group_size": group_size, "pairs": pair_table(q.table, bits, torch.bfloat16).to(w.device)}
    from lowbit.kernels.lut_gemm import MMA_GROUPS

    if group_size in MMA_GROUPS.get(bits, ()):
        from lowbit.formats.lut import pack_codes_mma

        p["qmma"], p["qmma_hi"] = pack_codes_mma(q.codes, bits, group_size, w.shape[1])
    return p


def weight_sets(N: int, K: int, bits: int = 4, group_size: int = 128, n: int = 3) -> tuple[list, list]:
    """Probe helper: ``n`` random bf16 ``[N, K]`` weights on the GPU (seed 0; rotated so that a pass streams from
    HBM on the large shapes) and their ``make_packed`` forms."""
    torch.manual_seed(0)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    return ws, [make_packed(w, bits, group_size) for w in ws]


def probe_cases(shapes: dict, ms, bits: int = 4):
    """Probe helper: for each ``name -> (N, K)`` of ``shapes`` (weights made once, ``weight_sets``) and each token
    count of ``ms``: ``(name, N, K, M, ws, ps, xs)`` with 3 random bf16 inputs ``xs`` ``[M, K]``."""
    for name, (N, K) in shapes.items():
        ws, ps = weight_sets(N, K, bits)
        for M in ms:
            yield name, N, K, M, ws, ps, [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def reference_f64(p: dict, x: torch.Tensor) -> torch.Tensor:
    """The float32 reference product of packed weight ``p`` (``make_packed``, fragment layout) with ``x``, as
    float64 (the probes' rel-L2 baseline)."""
    from lowbit.ops.lut import lut_gemm_ref

    return lut_gemm_ref(x.float(), p["qmma"], p["qmma_hi"], p["scales"], p["table"], p["bits"], p["group_size"],
                        x.shape[1], layout="mma").double()


def mma_fn(p: dict, **cfg):
    """Callable x -> y through the tensor-core fragment kernel (``lut_mma_triton``)."""
    from lowbit.kernels.lut_gemm import lut_mma_triton

    N = p["scales"].shape[1]
    return lambda x: lut_mma_triton(x, p["qmma"], p["qmma_hi"], p["scales"], p["pairs"], p["table"], bits=p["bits"],
                                    group_size=p["group_size"], out_features=N, **cfg)


def op_fn(p: dict, **kw):
    """Callable x -> y through the op on the fragment-layout codes (``LUTLinear``'s default dispatch); ``kw``: more
    ``lut_gemm`` options (e.g. ``silu_mul``)."""
    from lowbit.ops.lut import lut_gemm

    return lambda x: lut_gemm(x, p["qmma"], p["qmma_hi"], p["scales"], p["table"], bits=p["bits"],
                              group_size=p["group_size"], pairs=p["pairs"], layout="mma", **kw)


def wgmma_fn(p: dict, **cfg):
    """Callable x -> y through the register-table kernel (``lut_wgmma_triton``; ``cfg`` overrides its config)."""
    from lowbit.kernels.lut_wgmma import lut_wgmma_triton

    N = p["scales"].shape[1]
    return lambda x: lut_wgmma_triton(x, p["qmma"], p["scales"], p["pairs"], group_size=p["group_size"],
                                      out_features=N, bits=p["bits"], qweight_hi=p["qmma_hi"], **cfg)


def gluon_fn(p: dict, **cfg):
    """Callable x -> y through the Gluon register-table kernel (4-bit; ``cfg`` overrides its config)."""
    from lowbit.kernels.lut_wgmma_gluon import lut_wgmma_gluon

    N = p["scales"].shape[1]
    return lambda x: lut_wgmma_gluon(x, p["qmma"], p["scales"], p["pairs"], group_size=p["group_size"],
                                     out_features=N, **cfg)


def lut_bytes(M: int, N: int, K: int, bits: int, group_size: int) -> float:
    return N * K * bits / 8 + N * (K // group_size) * 2 + 2 * M * K + 2 * M * N


def lut_fn(p: dict, lookup: str = "load", **cfg):
    """Callable x -> y on packed weights ``p``; ``cfg`` overrides the kernel config (sweeps)."""
    from lowbit.kernels.lut_gemm import lut_gemm_triton
    from lowbit.ops.lut import lut_gemm

    if not cfg:
        if lookup == "load" and "qmma" in p:  # the default layout of LUTLinear where it exists
            return op_fn(p)
        return lambda x: lut_gemm(x, p["qweight"], p["qweight_hi"], p["scales"], p["table"], bits=p["bits"],
                                  group_size=p["group_size"], lookup=lookup)
    N = p["scales"].shape[1]
    return lambda x: lut_gemm_triton(x, p["qweight"], p["qweight_hi"], p["scales"], p["table"], bits=p["bits"],
                                     group_size=p["group_size"], out_features=N, lookup=lookup,
                                     pairs=p["pairs"] if lookup == "pair" else None, **cfg)


def dequant_cublas_fn(p: dict, K: int):
    from lowbit.kernels.lut_gemm import lut_dequant_triton

    N = p["scales"].shape[1]

    def f(x):
        w = lut_dequant_triton(p["qweight"], p["qweight_hi"], p["scales"], p["table"], bits=p["bits"],
                               group_size=p["group_size"], out_features=N, in_features=K, dtype=x.dtype)
        return F.linear(x, w)
    return f


def mma_dequant_cublas_fn(p: dict, K: int):
    from lowbit.kernels.lut_gemm import lut_dequant_mma_triton

    N = p["scales"].shape[1]

    def f(x):
        w = lut_dequant_mma_triton(p["qmma"], p["qmma_hi"], p["scales"], p["table"], bits=p["bits"],
                                   group_size=p["group_size"], out_features=N, in_features=K, dtype=x.dtype)
        return F.linear(x, w)
    return f


def _weights(N, K, n_sets=3):
    return rotating_inputs(lambda: (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5,),
                           min_sets=n_sets)


def _time(rec, case, provider, fns, xs, *, flops, byts, reps=100):
    t = time_cuda(lambda i, x: fns[i](x), [(i, x) for i, x in enumerate(xs)], reps=reps, warmup=5)
    return rec.record(case, provider, t, flops=flops, bytes_moved=byts, peak="bf16")


def _try(rec, case, provider, thunk):
    try:
        return thunk()
    except peers.PeerUnavailable as exc:
        rec.record(case, provider, None, note=str(exc))
    except Exception as exc:  # one failing provider must not lose the others
        rec.record(case, provider, None, note=f"{type(exc).__name__}: {exc}"[:200])


def target_rows(rec, quick: bool, shapes=("gate_up", "down", "8192sq"), ms=(1, 8, 16, 32), bits_list=(4, 3),
                peers_on=True, extra=None, on_shape_done=None):
    """The issue's table: every M in ``ms`` on ``shapes`` (M = 8 since session 22: the small-batch launches the op
    re-tuned there, beside the peers); ``extra(name, ws, packs, xs, case)`` adds rows."""
    for name in shapes:
        N, K = SHAPES[name]
        ws = _weights(N, K)
        packs = {b: [make_packed(w, b) for (w,) in ws] for b in bits_list}
        bf = [peers.cublas_bf16(w) for (w,) in ws]
        tg = bn = None
        if peers_on:
            tg = _try(rec, {"layer": name}, "tinygemm-int4", lambda: [peers.tinygemm_int4(w) for (w,) in ws])
            bn = _try(rec, {"layer": name}, "bnb-nf4", lambda: [peers.bnb_nf4(w) for (w,) in ws])
        for M in ms:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in ws]
            case = {"layer": name, "M": M, "N": N, "K": K}
            fl = gemm_flops(M, N, K)
            _time(rec, case, "cublas-bf16", bf, xs, flops=fl, byts=2 * (M * K + N * K + M * N))
            if tg:
                _try(rec, case, "tinygemm-int4", lambda: _time(rec, case, "tinygemm-int4", tg, xs, flops=fl,
                                                             byts=lut_bytes(M, N, K, 4, 128) + N * K // 64))
            if bn:
                xh = [x.half() for x in xs]
                _try(rec, case, "bnb-nf4", lambda: _time(rec, case, "bnb-nf4", bn, xh, flops=fl,
                                                       byts=lut_bytes(M, N, K, 4, 128)))
            for b in bits_list:
                fns = [lut_fn(p) for p in packs[b]]
                _try(rec, case, f"lut{b}-nf-g128", lambda: _time(rec, case, f"lut{b}-nf-g128", fns, xs, flops=fl,
                                                                 byts=lut_bytes(M, N, K, b, 128)))
            for b in bits_list:  # the fragment kernel, A/B to the op's choice (the register-table kernel at M >= 9)
                if M >= 9 and "qmma" in packs[b][0]:
                    mk = [mma_fn(p) for p in packs[b]]
                    _try(rec, case, f"lut{b}-mma-kernel", lambda: _time(rec, case, f"lut{b}-mma-kernel", mk, xs,
                                                                        flops=fl, byts=lut_bytes(M, N, K, b, 128)))
            if extra is not None:
                extra(name, ws, packs, xs, case)
        del ws, packs, bf, tg, bn
        torch.cuda.empty_cache()
        if on_shape_done is not None:
            on_shape_done(name)


def crossover_rows(rec, quick: bool, name="gate_up", ms=(64, 128, 256, 512, 1024)):
    """Kernel vs dequantize + cuBLAS at larger M (4-bit g128)."""
    N, K = SHAPES[name]
    ws = _weights(N, K)
    packs = [make_packed(w, 4) for (w,) in ws]
    bf = [peers.cublas_bf16(w) for (w,) in ws]
    for M in ms:
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in ws]
        case = {"layer": name, "M": M, "N": N, "K": K}
        fl = gemm_flops(M, N, K)
        _time(rec, case, "cublas-bf16", bf, xs, flops=fl, byts=2 * (M * K + N * K + M * N), reps=50)
        kern = [lut_fn(p, block_m=min(64, max(16, M)) if M <= 64 else 64) for p in packs]
        _try(rec, case, "lut4-kernel", lambda: _time(rec, case, "lut4-kernel", kern, xs, flops=fl,
                                                     byts=lut_bytes(M, N, K, 4, 128), reps=50))
        op = [lut_fn(p) for p in packs]  # the op's dispatch (LUTLinear): register-table kernel up to M = 128
        _try(rec, case, "lut4-op", lambda: _time(rec, case, "lut4-op", op, xs, flops=fl,
                                                 byts=lut_bytes(M, N, K, 4, 128), reps=50))
        dq = [dequant_cublas_fn(p, K) for p in packs]
        _try(rec, case, "lut4-dequant+cublas", lambda: _time(rec, case, "lut4-dequant+cublas", dq, xs, flops=fl,
                                                             byts=lut_bytes(M, N, K, 4, 128), reps=50))
        if "qmma" in packs[0]:  # the fragment layout: its kernel and its dequantize kernel + cuBLAS
            mk = [mma_fn(p) for p in packs]
            _try(rec, case, "lut4-mma-kernel", lambda: _time(rec, case, "lut4-mma-kernel", mk, xs, flops=fl,
                                                             byts=lut_bytes(M, N, K, 4, 128), reps=50))
            if M == 64:  # the pre-session-8 M = 33..64 config, for the same-round A/B
                mo = [mma_fn(p, r=1, num_warps=8, ctas_per_sm=4, prefetch=True, gu=1, ring=0, xh=0) for p in packs]
                _try(rec, case, "lut4-mma-kernel r1 w8 pf (old)",
                     lambda: _time(rec, case, "lut4-mma-kernel r1 w8 pf (old)", mo, xs, flops=fl,
                                   byts=lut_bytes(M, N, K, 4, 128), reps=50))
            md = [mma_dequant_cublas_fn(p, K) for p in packs]
            _try(rec, case, "lut4-mma-dequant+cublas", lambda: _time(rec, case, "lut4-mma-dequant+cublas", md, xs,
                                                                     flops=fl, byts=lut_bytes(M, N, K, 4, 128),
                                                                     reps=50))
    del ws, packs, bf
    torch.cuda.empty_cache()


def run(rec, quick: bool = False):
    for part in (target_rows, crossover_rows):
        try:
            part(rec, quick)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            rec.note(f"{part.__name__} aborted: {type(exc).__name__}: {exc}"[:300])
