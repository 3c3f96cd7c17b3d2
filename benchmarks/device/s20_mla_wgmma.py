"""Session-20 probe (issue 6): the warp-specialized Gluon MLA decode kernels (``lowbit.kernels.mla_decode_wgmma``)
beside the Triton kernels and the ANCHORS bmm path, same run.

    PYTHONPATH=$PWD python3 benchmarks/device/s20_mla_wgmma.py --out DIR [--parts c|t]

Part ``c``: correctness against the float64 reference and the Triton kernel (ragged lengths, MTP, 64 / 128 heads,
fp16, one / several splits, non-finite values in the slots past a sequence's length). Part ``t``: median ms of
B in {32, 128}, H = 128, L in {4k, 16k}, Sq in {1, 2} (inputs rotated over > 2x L2). Part ``f``: the FP8 form, its
correctness (against the reference that emulates its FP8 P, float64 and the Triton wide tile) and timing beside the
Triton FP8 tile and the bf16 form.
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, l2_bytes, probe_args, probe_row, time_cuda, write_probe  # noqa: E402
from lowbit.bench.suites.mla import DC, DR, PAGE, bmm_path, cache_bytes, flops, make_caches, poison_tail  # noqa: E402
from lowbit.kernels import mla_decode_wgmma as W  # noqa: E402
from lowbit.kernels.mla_decode import mla_decode_triton  # noqa: E402
from lowbit.ops.mla import _rows, mla_decode_ref  # noqa: E402

args = probe_args("ctf")  # part r (the dispatch boundary at 64 rows) runs only when named
# Kernel options timed in session 20 and removed since (s20_mla_wgmma_fp8_r1..r4.json): the transpose as 16 x 8 bytes
# per thread, in its own 2-warp partition, split between the warpgroups, with 8 x 4 lanes, a no-transpose timing probe; session 21
# (s21_mla_wgmma_strided.json): a thread's 4 transpose tokens 16 apart, P stored in that K order (2-4% slower)
# session 21: the 3-stage TMA ring with one value-tile buffer (the default since, ``ws``) beside the 2-stage ring
FP8_TT_VARIANTS = {"ws": {"stages": 3}, "ws_s2": {"stages": 2}}
FP8_TIME_VARIANTS = {"ws": {"stages": 3}, "ws_s2": {"stages": 2}}
VARIANTS = {"ws": {}, "ws_r224": {"ws_regs": (224, 168)}}  # bf16 form (kernel options of session 20 removed)
doc = {"env": env_info(" ".join(sys.argv))}


def run_both(q, cache, pt, sl, L, H, num_splits=None, dt=torch.bfloat16, **kw):
    B, Sq = q.shape[:2]
    q3 = q.reshape(B, Sq * H, DC + DR)
    qc, qr = q3[..., :DC], q3[..., DC:]
    kc, kr = _rows(cache[0]), _rows(cache[1])
    sm = (DC + DR) ** -0.5
    ok = W.supported(Sq * H, DC, DR, PAGE, qc, qr, kc, kr)
    w = W.mla_decode_wgmma(qc, qr, None, kc, kr, None, pt, sl, num_heads=H, sm_scale=sm, max_seq_len=L, page_size=PAGE,
                           num_splits=num_splits, **kw) if ok else None
    t = mla_decode_triton(qc, qr, None, kc, kr, None, pt, sl, num_heads=H, sm_scale=sm, max_seq_len=L,
                          page_size=PAGE, fp8=False, out_dtype=dt, num_splits=num_splits)
    return ok, w, t


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fp8_args(q, cache, H):
    from lowbit.kernels.mla_quant import latent_quant_triton

    B, Sq = q.shape[:2]
    R = Sq * H
    qc, qs, qr = latent_quant_triton(q.reshape(-1, DC + DR), DC)
    return (qc.view(B, R, DC), qr.view(B, R, DR), qs.view(B, R), _rows(cache[0]), _rows(cache[1]),
            cache[2].reshape(-1))


def timing_inputs(B, H, Sq, L, fp8=True):
    """Rotated timing inputs (>= 2x L2 where they fit, at most 3 sets): the queries, the caches, the bf16 form's
    arguments and (``fp8``) the FP8 form's."""
    n = max(1, min(3, -(-2 * l2_bytes() // cache_bytes(B, L, fp8))))
    sets = [make_caches(B, L, fp8=fp8, bf16=True, seed=i) for i in range(n)]
    qs = [torch.randn(B, Sq, H, DC + DR, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    ab = [(q.reshape(B, Sq * H, DC + DR)[..., :DC], q.reshape(B, Sq * H, DC + DR)[..., DC:], None,
           _rows(s_["bf16"][0]), _rows(s_["bf16"][1]), None, s_["page_table"], s_["seq_lens"])
          for q, s_ in zip(qs, sets)]
    a8 = ([fp8_args(q, s_["fp8"], H) + (s_["page_table"], s_["seq_lens"]) for q, s_ in zip(qs, sets)]
          if fp8 else None)
    return qs, sets, ab, a8


if "c" in args.parts:
    for (B, H, Sq, L, lens, splits, dt, nan) in [
        (2, 128, 1, 4096, None, None, torch.bfloat16, False),
        (3, 128, 1, 1000, [1000, 77, 513], None, torch.bfloat16, False),
        (3, 128, 1, 1000, [1000, 77, 513], 1, torch.bfloat16, False),
        (2, 64, 2, 2050, [2050, 130], None, torch.bfloat16, False),
        (2, 128, 4, 700, [700, 64], 3, torch.float16, False),
        (2, 128, 1, 1000, [1000, 333], None, torch.bfloat16, True),
    ]:
        key = f"c B={B} H={H} Sq={Sq} L={L} lens={lens} splits={splits} {dt} nan={nan}"
        try:
            c = make_caches(B, L, fp8=False, bf16=True, seed=1)
            kv = c["bf16"]
            cache = (kv[0].to(dt), kv[1].to(dt), None) if dt != torch.bfloat16 else kv
            sl = c["seq_lens"] if lens is None else torch.tensor(lens, dtype=torch.int32, device="cuda")
            if nan:  # non-finite values in every slot past each sequence's length
                poison_tail(c["page_table"], sl.tolist(), _rows(cache[0]), _rows(cache[1]))
            q = torch.randn(B, Sq, H, DC + DR, device="cuda", dtype=dt)
            ref = mla_decode_ref(q, cache, c["page_table"], sl).reshape(B, Sq * H, DC)
            for vname, kw in VARIANTS.items():
                ok, w, t = run_both(q, cache, c["page_table"], sl, L, H, splits, dt, **kw)
                row = {"supported": ok, "triton_rel": rel(t, ref)}
                if ok:
                    row.update(wgmma_rel=rel(w, ref), wgmma_vs_triton=rel(w, t), finite=bool(torch.isfinite(w).all()))
                    row["pass"] = row["finite"] and row["wgmma_rel"] < 2 * row["triton_rel"] + 1e-3
                probe_row(doc, f"{key} {vname}", row)
        except Exception as exc:  # noqa: BLE001
            probe_row(doc, key, {"error": repr(exc)[:600]})

if "t" in args.parts:
    for (B, H, Sq, L) in [(32, 128, 1, 4096), (32, 128, 1, 16384), (128, 128, 1, 4096), (128, 128, 1, 16384),
                          (32, 128, 2, 16384)]:
        key = f"t B={B} H={H} Sq={Sq} L={L}"
        try:
            qs, sets, a, _ = timing_inputs(B, H, Sq, L, fp8=False)
            row = {"B": B, "H": H, "Sq": Sq, "L": L, "tflop": flops(B, H, Sq, L) / 1e12}
            reps = 20 if row["tflop"] > 1 else 50
            sm = (DC + DR) ** -0.5

            def fw(*x, kw=None):
                return W.mla_decode_wgmma(*x, num_heads=H, sm_scale=sm, max_seq_len=L,
                                          page_size=PAGE, **kw)

            def ft(*x):
                return mla_decode_triton(*x, num_heads=H, sm_scale=sm, max_seq_len=L,
                                         page_size=PAGE, fp8=False)
            fns = {f"wgmma_{v}": (lambda *x, kw=kw: fw(*x, kw=kw)) for v, kw in VARIANTS.items()}
            fns["triton"] = ft
            for name, fn in fns.items():
                t = time_cuda(fn, a, warmup=5, reps=reps)
                row[f"{name}_ms"] = t["median_ms"]
                row[f"{name}_tflops"] = row["tflop"] / (t["median_ms"] * 1e-3)
            best = min(VARIANTS, key=lambda v: row[f"wgmma_{v}_ms"])
            row["best"] = best
            row["wgmma_ms"] = row[f"wgmma_{best}_ms"]
            if Sq == 1:
                b_args = [(q.view(B, H, DC + DR), s["dense"]) for q, s in zip(qs, sets)]
                row["bmm_ms"] = time_cuda(bmm_path, b_args, warmup=3, reps=reps)["median_ms"]
                row["wgmma_vs_bmm"] = row["bmm_ms"] / row["wgmma_ms"]
                row["triton_vs_bmm"] = row["bmm_ms"] / row["triton_ms"]
            row["wgmma_vs_triton"] = row["triton_ms"] / row["wgmma_ms"]
            _, plan = W.mla_decode_wgmma(*a[0], num_heads=H, sm_scale=sm, max_seq_len=L, page_size=PAGE,
                                         return_plan=True)
            row["splits"] = plan["splits"]
            probe_row(doc, key, row)
            del sets, qs, a
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            probe_row(doc, key, {"error": repr(exc)[:600]})


if "f" in args.parts:  # the FP8 form: correctness, then timing beside the Triton FP8 tile and the bf16 forms
    for (B, H, Sq, L, lens, splits, nan) in [
        (2, 128, 1, 4096, None, None, False), (3, 128, 1, 1000, [1000, 77, 513], None, False),
        (3, 128, 1, 1000, [1000, 77, 513], 1, False), (2, 64, 2, 2050, [2050, 130], None, False),
        (2, 128, 4, 700, [700, 64], 3, False), (2, 128, 1, 1000, [1000, 333], None, True)]:
        key = f"f B={B} H={H} Sq={Sq} L={L} lens={lens} splits={splits} nan={nan}"
        try:
            c = make_caches(B, L, fp8=True, bf16=False, seed=1)
            cache = c["fp8"]
            sl = c["seq_lens"] if lens is None else torch.tensor(lens, dtype=torch.int32, device="cuda")
            if nan:
                poison_tail(c["page_table"], sl.tolist(), _rows(cache[0]), _rows(cache[1]), cache[2].reshape(-1))
            q = torch.randn(B, Sq, H, DC + DR, device="cuda", dtype=torch.bfloat16)
            a = fp8_args(q, cache, H)
            sm = (DC + DR) ** -0.5
            ok = W.supported(Sq * H, DC, DR, PAGE, a[0], a[1], a[3], a[4], a[2], a[5])
            row = {"supported": ok}
            t = mla_decode_triton(*a, c["page_table"], sl, num_heads=H, sm_scale=sm, max_seq_len=L, page_size=PAGE,
                                  fp8=True, num_splits=splits, gluon=False)
            ref = mla_decode_ref(q, cache, c["page_table"], sl).reshape(B, Sq * H, DC)
            row["triton_rel"] = rel(t, ref)
            for tt, kw in FP8_TT_VARIANTS.items():
                if not ok:
                    break
                w, plan = W.mla_decode_wgmma(*a, c["page_table"], sl, num_heads=H, sm_scale=sm, max_seq_len=L,
                                                 page_size=PAGE, num_splits=splits, return_plan=True, **kw)
                emu = mla_decode_ref(q, cache, c["page_table"], sl, p_block=(64, plan["chunk"], 0.0,
                                                                              torch.float8_e4m3fn, "row"))
                row.update({f"{tt}_rel": rel(w, ref), f"{tt}_vs_emu": rel(w, emu.reshape(B, Sq * H, DC)),
                            f"{tt}_vs_triton": rel(w, t), f"{tt}_finite": bool(torch.isfinite(w).all()),
                            "splits": plan["splits"]})
                row[f"{tt}_pass"] = row[f"{tt}_finite"] and row[f"{tt}_vs_emu"] < 5e-3 and row[f"{tt}_rel"] < 3e-2
            probe_row(doc, key, row)
        except Exception as exc:  # noqa: BLE001
            probe_row(doc, key, {"error": repr(exc)[:600]})
    for (B, H, Sq, L) in [(32, 128, 1, 4096), (32, 128, 1, 16384), (128, 128, 1, 4096), (128, 128, 1, 16384),
                          (32, 128, 2, 16384)]:
        key = f"g B={B} H={H} Sq={Sq} L={L}"
        try:
            qs_, sets, ab, a8 = timing_inputs(B, H, Sq, L)
            row = {"B": B, "H": H, "Sq": Sq, "L": L, "tflop": flops(B, H, Sq, L) / 1e12}
            reps = 20 if row["tflop"] > 1 else 50
            sm = (DC + DR) ** -0.5
            fns = {f"ws_fp8_{name}": ((lambda *x, kw=kw: W.mla_decode_wgmma(*x, num_heads=H, sm_scale=sm,
                                                                             max_seq_len=L, page_size=PAGE, **kw)),
                                      a8) for name, kw in FP8_TIME_VARIANTS.items()}
            fns.update({
                "triton_fp8": (lambda *x: mla_decode_triton(*x, num_heads=H, sm_scale=sm, max_seq_len=L, page_size=PAGE,
                                                            fp8=True, gluon=False), a8),
                "ws_bf16": (lambda *x: W.mla_decode_wgmma(*x, num_heads=H, sm_scale=sm, max_seq_len=L,
                                                          page_size=PAGE), ab),
            })
            for name, (fn, arg) in fns.items():
                t = time_cuda(fn, arg, warmup=5, reps=reps)
                row[f"{name}_ms"] = t["median_ms"]
                row[f"{name}_tflops"] = row["tflop"] / (t["median_ms"] * 1e-3)
            best = min(FP8_TIME_VARIANTS, key=lambda v: row[f"ws_fp8_{v}_ms"])
            row["best_fp8"] = best
            row["fp8_vs_bf16"] = row["ws_bf16_ms"] / row[f"ws_fp8_{best}_ms"]
            probe_row(doc, key, row)
            del sets, qs_, a8, ab
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            probe_row(doc, key, {"error": repr(exc)[:600]})

if "r" in args.parts:  # 64 rows per sequence (the smallest the warp-specialized kernels take): both forms vs the tiles
    for (B, H, Sq, L) in [(32, 64, 1, 16384), (128, 64, 1, 4096), (32, 16, 4, 16384), (64, 32, 2, 8192)]:
        key = f"r B={B} H={H} Sq={Sq} L={L}"
        try:
            qs_, sets, ab, a8 = timing_inputs(B, H, Sq, L)
            sm = (DC + DR) ** -0.5
            row = {"B": B, "H": H, "Sq": Sq, "L": L, "rows": Sq * H}
            for name, arg, fp8, g in (("ws_bf16", ab, False, None), ("tile_bf16", ab, False, False),
                                      ("ws_fp8", a8, True, None), ("tile_fp8", a8, True, False)):
                def fn(*x, fp8=fp8, g=g):
                    return mla_decode_triton(*x, num_heads=H, sm_scale=sm, max_seq_len=L, page_size=PAGE, fp8=fp8,
                                             gluon=g)
                row[f"{name}_ms"] = time_cuda(fn, arg, warmup=5, reps=30)["median_ms"]
            probe_row(doc, key, row)
            del sets, qs_, a8, ab
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001
            probe_row(doc, key, {"error": repr(exc)[:600]})

write_probe(doc, args.out, "s20_mla_wgmma.json")
