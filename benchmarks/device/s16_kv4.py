"""Session-16 probe (issue 8): where the INT4-KV decode kernel's time goes at B = 16, 32/8 heads, D = 128.

    PYTHONPATH=$PWD python3 benchmarks/device/s16_kv4.py --out DIR [--parts acts]

Parts: ``a`` SASS of the default kernel; ``f`` ``decode_float`` and the kv4 Triton kernel at 2 vs 3 stages; ``c`` each variant of ``VARIANTS`` against the float64 reference,
repeated and under a CUDA graph; ``t`` time vs context length (the default launch, the main kernel alone, and the
one-key-block ``PROBE`` grid) beside SDPA flash bf16; ``s`` the ``STAMP`` probe: per program
``%globaltimer`` / ``%clock64`` at entry, loop start, loop end and exit plus the SM id, summarised (start skew,
phase lengths, programs resident per SM); ``k`` three launches of the default at L = 8k and nothing else (for
Nsight Compute). Writes ``s16_kv4.json``.
"""
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, rotating_inputs, time_cuda, write_probe  # noqa: E402
from lowbit.bench.suites.kv4 import kv4_bytes, random_cache  # noqa: E402
from lowbit.kernels import decode_kv4 as dk  # noqa: E402

args = probe_args("cts")
B, HQ, HKV, D = 16, 32, 8, 128
LS = [int(x) for x in os.environ.get("S16_LS", "1024,2048,4096,8192,16384,32768").split(",")]
# the committed s16_kv4.json also has rows "steal2/4/8" ({"steal": C}: chunks of C key blocks claimed through a
# per-(b, h) atomic counter): correct, slower at every shape, removed from the kernel after that run
VARIANTS = {"default": {}, **json.loads(os.environ.get("S16_VARIANTS", "{}"))}  # e.g. {"bn64": {"block_n": 64}}
CASES = [(16, 1024), (16, 4096), (16, 8192), (16, 16384), (16, 32768), (1, 8192), (1, 32768), (4, 8192)]
if os.environ.get("S16_CASES"):  # "B:L,B:L"
    CASES = [tuple(int(v) for v in c.split(":")) for c in os.environ["S16_CASES"].split(",")]
doc = {"env": env_info(" ".join(f"{k}='{v}'" for k, v in sorted(os.environ.items()) if k.startswith("S16_"))
                      + " PYTHONPATH=$PWD python3 benchmarks/device/s16_kv4.py " + " ".join(sys.argv[1:])),
       "shape": {"B": B, "Hq": HQ, "Hkv": HKV, "D": D}}


TQ = int(os.environ.get("S16_TQ", "1"))  # query tokens per sequence in parts t / s (MTP: 2-4)
SDPA_LS = [int(x) for x in os.environ.get("S16_SDPA_LS", "8192,32768").split(",")]  # context lengths timed with SDPA flash
ZP = os.environ.get("S16_ZP") == "1"  # part t over QServe's zero-point caches (kv4-zp; session 27)


def call(q, c, L, **kw):
    rows = kw.pop("_max_rows", None)  # the Gluon kernel's row limit (G * TQ) for this call only
    if rows is not None:
        old, dk.GLUON_MAX_ROWS = dk.GLUON_MAX_ROWS, rows
        try:
            return call(q, c, L, **kw)
        finally:
            dk.GLUON_MAX_ROWS = old
    return dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"],
                                c["lengths"], max_len=L, k_zero=c.get("k_zero"), v_zero=c.get("v_zero"),
                                **{"qk_int8": 2, "gluon": True, **kw})


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def part_c():
    """Each variant against the float64 reference (same numerics: two INT8 Q planes) on ragged batches,
    1-4 query tokens, GQA / MQA, D 64 / 128, pages 16 / 64, zero points and CRS; three calls in a row
    (the counters must be back at 0) and a CUDA-graph replay."""
    from lowbit._utils import capture_cuda_graph
    from lowbit.ops.kv4 import decode_kv4_ref

    cases = [  # B, Hq, Hkv, D, TQ, lengths, page, zp, crs
        (3, 32, 8, 128, 1, [1000, 3001, 77], 64, False, False),
        (2, 32, 8, 128, 4, [4099, 257], 64, False, True),
        (4, 8, 1, 64, 2, [300, 129, 2048, 33], 16, False, False),
        (2, 32, 8, 128, 1, [9000, 8191], 64, True, False),
        (16, 32, 8, 128, 1, [8192] * 16, 64, False, False),
    ]
    for name, kw in VARIANTS.items():
        for B_, Hq, Hkv, D_, TQ, lens, page, zp, crs_on in cases:
            key = f"c {name} B={B_} Hq={Hq} Hkv={Hkv} D={D_} TQ={TQ} L={max(lens)} page={page} zp={zp} crs={crs_on}"
            try:
                c = random_cache(B_, Hkv, D_, max(lens), page=page, zero_point=zp)
                c["lengths"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
                q = torch.randn(B_, Hq, TQ, D_, device="cuda", dtype=torch.bfloat16)
                crs = (torch.rand(Hkv, D_, device="cuda") + 0.5) if crs_on else None
                ref = decode_kv4_ref(q, crs_q=crs, q_int8=2, **c)
                errs = []
                for _ in range(3):
                    o = call(q, c, max(lens), crs_q=crs, **kw)
                    torch.cuda.synchronize()
                    errs.append(rel(o, ref))
                f = lambda: call(q, c, max(lens), crs_q=crs, **kw)  # noqa: E731
                g, out = capture_cuda_graph(f)
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
                errs.append(rel(out, ref))
                row = {"errs": errs, "pass": max(errs) < 5e-3, "splits": dk.LAST_LAUNCH.get("num_splits")}
                if name != "default":  # bit for bit the default's output?
                    row["bitequal_default"] = bool(torch.equal(o, call(q, c, max(lens), crs_q=crs)))
                probe_row(doc, key, row)
            except Exception as exc:  # noqa: BLE001
                probe_row(doc, key, {"error": repr(exc)[:600], "pass": False})


def sets_for(L, b=B):  # noqa: D103
    return rotating_inputs(lambda: (torch.randn(b, HQ, TQ, D, device="cuda", dtype=torch.bfloat16),
                                    random_cache(b, HKV, D, L, zero_point=ZP)))


def part_t():
    for B_, L in CASES:
        sets = sets_for(L, B_)
        nb = kv4_bytes(B_, HQ, HKV, D, L, TQ, ZP)
        for name, kw in VARIANTS.items():
            modes = [("full", {})]
            if name == "default" and B_ == B:
                modes += [("main", {"_skip_combine": True}), ("probe", {"_skip_combine": True, "_probe": True})]
            if name != "default" and not all(r.get("pass") for k, r in doc.get("rows", {}).items()
                                             if k.startswith(f"c {name} ")):
                continue
            for mode, extra in modes:
                key = f"t {name} B={B_} L={L} {mode}" + (" zp" if ZP else "")
                try:
                    fn = lambda q, c: call(q, c, L, **kw, **extra)  # noqa: E731
                    fn(*sets[0])
                    t = time_cuda(fn, sets, reps=100)
                    probe_row(doc, key, {"B": B_, "L": L, "variant": name, "mode": mode, "ms": t["median_ms"],
                                         "splits": dk.LAST_LAUNCH.get("num_splits"),
                                         "TBps": nb / (t["median_ms"] * 1e-3) / 1e12})
                except Exception as exc:  # noqa: BLE001
                    probe_row(doc, key, {"error": repr(exc)[:400]})
        if L in SDPA_LS:
            qs = [(torch.randn(B_, HQ, TQ, D, device="cuda", dtype=torch.bfloat16),
                   torch.randn(B_, HKV, L, D, device="cuda", dtype=torch.bfloat16),
                   torch.randn(B_, HKV, L, D, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def sdpa(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            try:
                t = time_cuda(sdpa, qs, reps=100)
                probe_row(doc, f"t sdpa-flash B={B_} L={L}", {"B": B_, "L": L, "ms": t["median_ms"]})
            except Exception as exc:  # noqa: BLE001
                probe_row(doc, f"t sdpa-flash B={B_} L={L}", {"error": repr(exc)[:400]})
            del qs
        del sets
        torch.cuda.empty_cache()


def pct(xs, ps=(0, 10, 50, 90, 100)):
    xs = sorted(xs)
    return {f"p{p}": round(xs[min(len(xs) - 1, int(p / 100 * (len(xs) - 1) + 0.5))], 3) for p in ps}


def part_s():
    for L in (8192,):
        sets = sets_for(L)
        q, c = sets[0]
        for name, kw in VARIANTS.items():
            key = f"s {name} L={L}"
            try:
                for i in range(3):  # warm (compile, occupancy, split plan), then the stamped launch
                    call(*sets[i % len(sets)], L, **kw, _skip_combine=True)
                torch.cuda.synchronize()
                call(q, c, L, **kw, _skip_combine=True, _probe="stamp1" if os.environ.get("S16_STAMP_PROBE") else "stamp")
                torch.cuda.synchronize()
                ts = dk.LAST_LAUNCH["stamps"].cpu()
                g0 = ts[:, 0].min().item()
                start = ((ts[:, 0] - g0).double() / 1e3).tolist()  # us since the first program started
                end = ((ts[:, 3] - g0).double() / 1e3).tolist()
                pro = (ts[:, 5] - ts[:, 4]).double().tolist()  # cycles
                loop = (ts[:, 6] - ts[:, 5]).double().tolist()
                epi = (ts[:, 7] - ts[:, 6]).double().tolist()
                sm = ts[:, 8].tolist()
                per_sm = {}
                for s_, a_, e_ in zip(sm, start, end):
                    per_sm.setdefault(s_, []).append((a_, e_))
                conc = []  # most programs of one SM running at the same time
                for iv in per_sm.values():
                    ev = sorted([(a_, 1) for a_, _ in iv] + [(e_, -1) for _, e_ in iv])
                    n = best = 0
                    for _, d in ev:
                        n += d
                        best = max(best, n)
                    conc.append(best)
                late = sum(1 for a_ in start if a_ > min(end))  # programs that started after some program ended
                # session 30: is the spread of the ends within an SM (its programs progress unevenly) or across SMs?
                ends_sm = [[e_ for _, e_ in iv] for iv in per_sm.values()]
                n_sm = [len(v) for v in ends_sm]
                by_n = {n: [statistics.mean(v) for v in ends_sm if len(v) == n] for n in sorted(set(n_sm))}
                extra = {"within_sm_spread_us": pct([max(v) - min(v) for v in ends_sm]),
                         "sm_mean_end_us": pct([statistics.mean(v) for v in ends_sm]),
                         "sm_min_end_us": pct([min(v) for v in ends_sm]),
                         "sm_max_end_us": pct([max(v) for v in ends_sm]),
                         "sm_mean_end_by_programs": {str(n): round(statistics.mean(v), 3) for n, v in by_n.items()}}
                if os.environ.get("S16_RAW"):  # every program's stamps (JSON beside the probe's)
                    with open(os.path.join(args.out, f"s16_stamps_{name}_L{L}.json"), "w") as f:
                        json.dump({"columns": ["t_entry_ns", "t_loop_ns", "t_loop_end_ns", "t_exit_ns", "c_entry",
                                               "c_loop", "c_loop_end", "c_exit", "sm"], "rows": ts.tolist()}, f)
                probe_row(doc, key, {
                    "L": L, "variant": name, "programs": len(start), "splits": dk.LAST_LAUNCH.get("num_splits"),
                    "span_us": round(max(end), 3), "start_us": pct(start), "end_us": pct(end),
                    "prologue_cyc": pct(pro), "loop_cyc": pct(loop), "epilogue_cyc": pct(epi),
                    "sms": len(per_sm), "programs_per_sm": pct([len(v) for v in per_sm.values()]),
                    "concurrent_per_sm": pct(conc), "started_after_first_end": late,
                    "mean_phase_cyc": [round(statistics.mean(x)) for x in (pro, loop, epi)], **extra})
            except Exception as exc:  # noqa: BLE001
                probe_row(doc, key, {"error": repr(exc)[:400]})
        del sets
        torch.cuda.empty_cache()


def part_a():
    """SASS of the default kernel (and the one-plane Q variant): written beside the JSON, summarised in it."""
    from triton.tools.disasm import get_sass

    from lowbit.bench.harness import sass_summary

    sets = sets_for(1024, 2)
    for name, kw in (("default", {}), ("q8_1", {"qk_int8": 1})):
        try:
            q, c = sets[0]
            _, k = dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"],
                                        c["lengths"], max_len=1024, gluon=True, return_kernel=True,
                                        **{"qk_int8": 2, **kw})
            sass = get_sass(k.asm["cubin"])
            with open(os.path.join(args.out, f"s16_kv4_{name}.sass"), "w") as f:
                f.write(sass)
            probe_row(doc, f"a {name}", {"regs": k.n_regs, "spills": k.n_spills, **sass_summary(sass, top=60)})
        except Exception as exc:  # noqa: BLE001
            probe_row(doc, f"a {name}", {"error": repr(exc)[:400]})


def part_f():
    """``decode_float`` (the bf16 / fp16 paged cache of the weight-only recipes): cp.async stages 2 / 3 (default 3) and
    the kv4 Triton kernel (the MTP / fp16-Q path) at 2 stages, ``graph_us`` of back-to-back calls over rotated caches."""
    from lowbit.bench.harness import graph_us
    from lowbit.bench.suites.kv4 import random_float_pages
    from lowbit.kernels.decode_float import decode_float_triton

    for B_, L in CASES:
        try:
            pages = [random_float_pages([L] * B_, HKV, 64, D, seed=i) for i in range(3)]
            q = torch.randn(B_, HQ, TQ, D, device="cuda", dtype=torch.bfloat16)
            row = {"B": B_, "L": L, "TQ": TQ}
            for st in (3, 2):
                fl = [lambda p=p, st=st: decode_float_triton(q, *p, max_len=L, num_stages=st) for p in pages]
                row[f"float_st{st}"] = [round(graph_us(fl), 2) for _ in range(2)]
            o3 = decode_float_triton(q, *pages[0], max_len=L, num_stages=3)
            o2 = decode_float_triton(q, *pages[0], max_len=L, num_stages=2)
            row["float_st2_rel_vs_st3"] = rel(o2, o3)
            del pages
            sets = sets_for(L, B_)
            for st in (3, 2):
                fl = [lambda qq=qq, c=c, st=st: call(qq, c, L, gluon=False, num_stages=st) for qq, c in sets]
                row[f"kv4_triton_st{st}"] = [round(graph_us(fl), 2) for _ in range(2)]
            del sets
            probe_row(doc, f"f B={B_} L={L} TQ={TQ}", row)
        except Exception as exc:  # noqa: BLE001
            probe_row(doc, f"f B={B_} L={L} TQ={TQ}", {"error": repr(exc)[:400]})
        torch.cuda.empty_cache()


def part_k():
    L = 8192
    sets = sets_for(L)
    for i in range(3):
        call(*sets[i % len(sets)], L, _skip_combine=True)
    torch.cuda.synchronize()


for p in args.parts:
    {"a": part_a, "c": part_c, "f": part_f, "t": part_t, "s": part_s, "k": part_k}[p]()
    if p != "k":
        write_probe(doc, args.out, "s16_kv4.json")
