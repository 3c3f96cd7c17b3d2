"""Session 43: GPTQ's column loop by the Triton kernel (``lowbit.kernels.gptq_block``) against the PyTorch loop on the
H200, Llama-3-8B shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336), float32, random
correlated calibration inputs (8192 tokens: a rank-K/8 mix plus noise). Per shape, format and act-order:
``gptq_weight`` seconds with ``kernel=True`` (after a compile warm-up) and, where affordable (qkv, o, one format on
gate_up and down), with ``kernel=False``; proxy losses of both, the fraction of differing Q elements and whether Q
and the group parameters are equal bit for bit. Part ``b``: rows per program x warps of the kernel on gate_up;
``c``: the kernel path's GPU time by kernel (torch.profiler) on gate_up and down.

    PYTHONPATH=. python3 benchmarks/device/s43_gptq_kernel.py --out $OUT/s43 [--parts abc]
"""
import sys
import time

import torch

sys.path.insert(0, ".")
from lowbit.bench.harness import probe_row, run_probe_parts  # noqa: E402
from lowbit.kernels import gptq_block  # noqa: E402
from lowbit.ptq.gptq import gptq_weight, hessian_update, make_grid, proxy_loss  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FORMATS = {"fp8": ("w4a8-fp8", {"pts_exp": 0}), "fp8_pts2": ("w4a8-fp8", {"pts_exp": 2}), "int8": ("w4a8-int8", {}),
           "nf4": ("lut", {"bits": 4, "table": "nf"})}
TORCH_LOOP = {("qkv", f) for f in FORMATS} | {("o", f) for f in FORMATS} | {("gate_up", "fp8"), ("down", "int8")}
GS = 128


def _hessian(k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(8192, k // 8, device="cuda", generator=g) @ torch.randn(k // 8, k, device="cuda", generator=g)
    x = base / (k // 8) ** 0.5 + 0.3 * torch.randn(8192, k, device="cuda", generator=g)
    return hessian_update(None, 0, x)[0]


def _timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def _warm_up():
    """Compile every (format, act-order) variant on a small matrix of K = 4096 (the parameters' row stride is a
    specialized argument: K / 128 groups as in the timed shapes), so the timings hold no compilation."""
    w, h = torch.randn(64, 4096, device="cuda") * 0.02, _hessian(4096)
    for scheme, opts in FORMATS.values():
        for act_order in (False, True):
            gptq_weight(w, h, make_grid(scheme, w, opts), GS, act_order=act_order, kernel=True)


def part_a(doc):
    _warm_up()
    for name, (n, k) in SHAPES.items():
        h = _hessian(k)
        w = torch.randn(n, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) * 0.02
        for fname, (scheme, opts) in FORMATS.items():
            grid = make_grid(scheme, w, opts)
            for act_order in (True, False):
                (q1, s1), t1 = _timed(lambda: gptq_weight(w, h, grid, GS, act_order=act_order, kernel=True))
                row = {"n": n, "k": k, "scheme": scheme, "opts": opts, "act_order": act_order,
                       "kernel_s": round(t1, 4), "kernel_loss": proxy_loss(w, q1, h)}
                if (name, fname) in TORCH_LOOP and (act_order or name == "o"):
                    (q0, s0), t0 = _timed(lambda: gptq_weight(w, h, grid, GS, act_order=act_order, kernel=False))
                    row.update(torch_s=round(t0, 3), torch_loss=proxy_loss(w, q0, h), speedup=round(t0 / t1, 1),
                               q_differ=(q0 != q1).float().mean().item(),
                               q_bitwise=torch.equal(q0.view(torch.int32), q1.view(torch.int32)),
                               params_equal=all(torch.equal(s0[f], s1[f]) for f in s0))
                probe_row(doc, f"{name}/{fname}/{'act' if act_order else 'seq'}", row)


def _kernel_ms(fn) -> tuple:
    """(``fn``'s result, the GPU milliseconds of its ``_gptq_block_kernel`` launches, of all its kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    return (out, sum(e.device_time_total for e in ev if "gptq_block" in e.key) / 1e3,
            sum(e.device_time_total for e in ev) / 1e3, ev)


def part_b(doc):
    """Rows per program x warps on gate_up (w4a8-fp8, act-order): the kernel's launch shape, by its GPU time."""
    n, k = SHAPES["gate_up"]
    h = _hessian(k)
    w = torch.randn(n, k, device="cuda") * 0.02
    grid = make_grid("w4a8-fp8", w, {"pts_exp": 0})
    ref, saved = None, (gptq_block.BLOCK_R, gptq_block.NUM_WARPS)
    for br, nw in ((4, 1), (8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 4), (32, 8), (64, 4)):
        gptq_block.BLOCK_R, gptq_block.NUM_WARPS = br, nw
        gptq_weight(w[:256], h, grid, GS, act_order=True, kernel=True)  # compile
        (q, _), kern, total, _ = _kernel_ms(lambda: gptq_weight(w, h, grid, GS, act_order=True, kernel=True))
        ref = q if ref is None else ref
        probe_row(doc, f"gate_up/fp8/block_r{br}_w{nw}", {"kernel_ms": round(kern, 2), "gpu_ms": round(total, 2),
                                                           "same_q": torch.equal(q, ref)})
    gptq_block.BLOCK_R, gptq_block.NUM_WARPS = saved


def part_c(doc):
    """Where the kernel path's GPU time goes (torch.profiler, by kernel name) on gate_up and down."""
    _warm_up()
    for name in ("gate_up", "down"):
        n, k = SHAPES[name]
        h = _hessian(k)
        w = torch.randn(n, k, device="cuda") * 0.02
        grid = make_grid("w4a8-fp8", w, {"pts_exp": 0})
        _, kern, total, ev = _kernel_ms(lambda: gptq_weight(w, h, grid, GS, act_order=True, kernel=True))
        top = sorted(ev, key=lambda e: -e.device_time_total)[:8]
        probe_row(doc, f"{name}/fp8/act/profile", {"gpu_ms": round(total, 2), "kernel_ms": round(kern, 2),
                                                   "top_ms": {e.key[:80]: round(e.device_time_total / 1e3, 2)
                                                              for e in top}})


if __name__ == "__main__":
    run_probe_parts("benchmarks/device/s43_gptq_kernel.py", {"a": part_a, "b": part_b, "c": part_c}, "abc",
                    "s43_gptq_kernel.json")
