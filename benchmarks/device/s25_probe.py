"""Session-25 probe (issues 4 and 7): two levers of the weight-only decode at batch 16 / 64.

    PYTHONPATH=$PWD python3 benchmarks/device/s25_probe.py --out DIR [--parts lfa]   (env S25_REPS: A/B repeats,
        S25_NAME: the JSON's name)

Part ``l``: same-run A/B, repeated and interleaved, of the LUT launches that won in ``s25_caps.json`` (one run)
against the op's committed dispatch: down-like weights at 16 tokens with one stacked dot over 4 row tiles under a
96-register cap (5 programs per SM), gate_up at 16 tokens through the Gluon kernel with a split target of 2
programs per SM and one activation prefetch, qkv at 64 tokens with one stacked dot, the shared pair table, 2
stages and a 168-register cap (3 programs per SM); bit-equality / rel-L2 against the op per candidate.

Part ``a`` (named to run): the session-25 dispatch (the op) against the launch it replaced, where it changed
(``prev_dispatch``), at 9 / 12 / 16 / 40 / 48 / 64 tokens, three interleaved repeats, rel-L2 of both to float64.

Part ``q`` (named to run): qkv at 48 / 64 tokens, the op and its two launches (two dots over 8 row tiles, one
stacked dot over 4) called directly, with their split counts and registers, and the op with its config patched to
the stacked dot (``op_o4``).

Part ``f``: the float-cache decode kernel (``lowbit.kernels.decode_float``, what the weight-only recipes' runner
uses over its dense bf16 cache: one page of L + 64 per request) at B = 16 / 64, L = 1k / 8k, 32 / 8 heads, D = 128:
key block x stages x warps x split count, K / V / q sets rotated, beside SDPA on exactly L keys (flash). Bytes = K + V
of the L keys.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, time_cuda, time_rotated, write_probe  # noqa: E402
from lowbit.bench.suites.lut import gluon_fn, op_fn, probe_cases, reference_f64, wgmma_fn  # noqa: E402
from lowbit.kernels import lut_wgmma as LW  # noqa: E402
from lowbit.kernels.decode_float import LAST_LAUNCH, decode_float_triton  # noqa: E402

args = probe_args("lf")
doc = {"env": env_info(" ".join(sys.argv)), "note": "us = median ms * 1000"}
REPS = int(os.environ.get("S25_REPS", "3"))


# (shape, M) -> candidate name -> builder(p, M, N, K)
def _o4(**extra):  # the register-table kernel's committed config at (M, N, K), as one stacked dot over 4 row tiles
    return lambda p, M, N, K: wgmma_fn(p, **dict(LW.wgmma_config(M, N, K, 128), rt=4, one_dot=True, **extra))


CANDS = {
    ("down", 16): {"o4_cap96_c5": _o4(maxnreg=96, ctas_per_sm=5)},
    ("8192sq", 16): {"gluon_c2_x1": lambda p, M, N, K: gluon_fn(p, ctas_per_sm=2, xpf=1)},
    ("gate_up", 16): {"gluon_c2_x1": lambda p, M, N, K: gluon_fn(p, ctas_per_sm=2, xpf=1)},
    ("qkv", 64): {"o4_smem_s2_cap168": _o4(smem_table=True, num_stages=2, maxnreg=168, ctas_per_sm=3), "o4": _o4()},
}
SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096), "8192sq": (8192, 8192)}

if "l" in args.parts:
    for name, N, K, M, ws, ps, xs in probe_cases(SHAPES, (16, 64)):
        cands = CANDS.get((name, M))
        if not cands:
            continue
        row = {"M": M, "N": N, "K": K}
        y0 = op_fn(ps[0])(xs[0])
        for cn, mk in cands.items():
            y1 = mk(ps[0], M, N, K)(xs[0])
            row[cn + "_bit_equal_op"] = bool(torch.equal(y0, y1))
            row[cn + "_rel_op"] = ((y1.double() - y0.double()).norm() / y0.double().norm()).item()
        fns = {"cublas": [lambda x, w=w: F.linear(x, w) for w in ws], "op": [op_fn(p) for p in ps]}
        fns |= {cn: [mk(p, M, N, K) for p in ps] for cn, mk in cands.items()}
        for r in range(REPS):  # interleaved repeats: op, candidates, op, ...
            sub = time_rotated({}, fns, xs)
            for k, v in sub.items():
                row.setdefault(k, []).append(v)
        for k in [k for k in row if k.endswith("_us")]:
            row[k + "_median"] = sorted(row[k])[len(row[k]) // 2]
        for cn in cands:
            if cn + "_us_median" in row:
                row[cn + "_speedup_vs_op"] = round(row["op_us_median"] / row[cn + "_us_median"], 3)
        probe_row(doc, f"l_{name}_M{M}", row)

def prev_dispatch(p, M, N, K):
    """The op's launch before session 25 where it changed (None where it did not): gate_up-sized N at 9..16 tokens on
    the Triton kernel (not Gluon), down-like weights at 9..16 with two dots over 8 row tiles (128 registers, 4
    programs), qkv-sized N at 33..64 with two dots."""
    cfg = LW.wgmma_config(M, N, K, 128)
    if 9 <= M <= 16 and N >= 16384:
        return wgmma_fn(p, **cfg)
    if 9 <= M <= 16 and N <= 4096 and K >= 8192:
        return wgmma_fn(p, **dict(cfg, rt=8, one_dot=False, maxnreg=128, ctas_per_sm=4))
    if 33 <= M <= 64 and 4096 < N < 16384 and K < 8192:
        return wgmma_fn(p, **dict(cfg, rt=8, one_dot=False))
    return None


if "a" in args.parts:  # the session-25 dispatch (the op) against the previous launch, where it changed
    AB = {"qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
    for name, N, K, M, ws, ps, xs in probe_cases(AB, (9, 12, 16, 40, 48, 64)):
        if prev_dispatch(ps[0], M, N, K) is None:
            continue
        y0, y1 = op_fn(ps[0])(xs[0]), prev_dispatch(ps[0], M, N, K)(xs[0])
        ref = reference_f64(ps[0], xs[0])
        row = {"M": M, "N": N, "K": K, "op_rel_ref": ((y0.double() - ref).norm() / ref.norm()).item(),
               "prev_rel_ref": ((y1.double() - ref).norm() / ref.norm()).item()}
        fns = {"cublas": [lambda x, w=w: F.linear(x, w) for w in ws], "op": [op_fn(p) for p in ps],
               "prev": [prev_dispatch(p, M, N, K) for p in ps]}
        for r in range(REPS):
            sub = time_rotated({}, fns, xs)
            for k, v in sub.items():
                row.setdefault(k, []).append(v)
        for k in [k for k in row if k.endswith("_us")]:
            row[k + "_median"] = sorted(row[k])[len(row[k]) // 2]
        if "op_us_median" in row and "prev_us_median" in row:
            row["op_speedup_vs_prev"] = round(row["prev_us_median"] / row["op_us_median"], 3)
            row["op_vs_cublas"] = round(row["cublas_us_median"] / row["op_us_median"], 3)
        probe_row(doc, f"a_{name}_M{M}", row)

if "q" in args.parts:  # qkv at 33..64 tokens: the two launches of the disagreeing A/Bs, called directly
    for name, N, K, M, ws, ps, xs in probe_cases({"qkv": (6144, 4096)}, (48, 64)):
        cfg = LW.wgmma_config(M, N, K, 128)
        var = {"d8": dict(cfg, rt=8, one_dot=False), "o4": dict(cfg, rt=4, one_dot=True)}
        row = {"M": M, "N": N, "K": K}
        for vn, kw in var.items():
            wgmma_fn(ps[0], **kw)(xs[0])
            row[vn + "_split"], row[vn + "_regs"] = LW.LAST_COMPILED["wgmma_split"], LW.LAST_COMPILED["wgmma"].n_regs
        fns = {"op": [op_fn(p) for p in ps]} | {vn: [wgmma_fn(p, **kw) for p in ps] for vn, kw in var.items()}
        _cfg = LW.wgmma_config

        def _with_o4(f):  # the op with its config patched to the stacked dot (the route of s25_ab.json's 'op')
            def g(x):
                LW.wgmma_config = lambda *a, **k: dict(_cfg(*a, **k), rt=4, one_dot=True)
                try:
                    return f(x)
                finally:
                    LW.wgmma_config = _cfg
            return g
        fns["op_o4"] = [_with_o4(op_fn(p)) for p in ps]
        for r in range(REPS):
            for k, v in time_rotated({}, fns, xs).items():
                row.setdefault(k, []).append(v)
        probe_row(doc, f"q_{name}_M{M}", row)

if "f" in args.parts:
    H, HKV, D = 32, 8, 128
    for B in (16, 64):
        for L in (1024, 8192):
            smax = L + 64
            sets = [(torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16),
                     torch.randn(B, HKV, smax, D, device="cuda", dtype=torch.bfloat16),
                     torch.randn(B, HKV, smax, D, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
            lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
            pt = torch.arange(B, dtype=torch.int32, device="cuda")[:, None]
            byts = 2 * B * HKV * L * D * 2
            row = {"B": B, "L": L, "bytes": byts}

            def sdpa(q, kd, vd):
                return F.scaled_dot_product_attention(q, kd[:, :, :L], vd[:, :, :L], enable_gqa=True)

            ref = sdpa(*sets[0]).float()
            t = time_cuda(sdpa, sets, reps=100)
            row["sdpa_exact_us"] = round(t["median_ms"] * 1000, 2)
            for bn in (32, 64):
                for st in (2, 3, 4):
                    for nw in (4, 8):
                        for ns in (None, 1, 2, 4, 8):
                            tag = f"bn{bn}_s{st}_w{nw}_sp{ns or 'auto'}"

                            def fn(q, kd, vd, bn=bn, st=st, nw=nw, ns=ns):
                                return decode_float_triton(q, kd, vd, pt, lengths, max_len=smax, num_splits=ns,
                                                           block_n=bn, num_warps=nw, num_stages=st)
                            try:
                                out = fn(*sets[0]).float()
                                used = LAST_LAUNCH["num_splits"]
                                t = time_cuda(fn, sets, reps=100)
                                row[tag + "_us"] = round(t["median_ms"] * 1000, 2)
                                row[tag + "_splits"] = used
                                row[tag + "_rel"] = ((out - ref).norm() / ref.norm()).item()
                            except Exception as exc:
                                row[tag + "_err"] = f"{type(exc).__name__}: {exc}"[:160]
            us = {k[:-3]: v for k, v in row.items() if k.endswith("_us") and k.startswith("bn")}
            best = min(us, key=us.get)
            row["best"], row["best_us"] = best, us[best]
            row["best_TBps"] = round(byts / us[best] / 1e6, 2)
            row["default_us"] = us["bn64_s3_w4_spauto"]
            probe_row(doc, f"f_B{B}_L{L}", row)
            del sets

print(write_probe(doc, args.out, os.environ.get("S25_NAME", "s25_probe.json")))
