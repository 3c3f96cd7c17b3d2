"""Device script for area attention_prefill (issue 9 INT8 FlashAttention, issue 8 FP8 prefill).

(1) correctness of the kernels vs the float32 replay of the same numerics and vs float64,
(2) what Triton generated (wgmma types, 16-byte loads, registers, spills),
(3) timing: lowbit fp8 / int8 / int8-qk / fp8-kv4 vs SDPA cuDNN / FA2, SageAttention 1.0.6 and
    INT-FlashAttention's Triton kernels (``.refcode/int_fa``, carried by the lead, never committed),
(4) INT-FA Tables 1-2 (MRE vs float64) and the embedded model: per-layer error + perplexity.
``--cpu-smoke`` runs (1) on tiny shapes under TRITON_INTERPRET=1.
"""
import argparse
import json
import os
import re
import sys
import time
import traceback

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--cpu-smoke", action="store_true")
ap.add_argument("--skip", default="", help="comma list: check,asm,sweep,suite,mre,model")
ap.add_argument("--ws-child", default="", help="internal: warp-specialization probe variants (child process)")
ap.add_argument("--ab-child", default="", help="internal: 'gluon' runs the Gluon checks and A/B rows (child process)")
ap.add_argument("--budget", type=float, default=86.0, help="seconds; later sections shrink or skip")
ap.add_argument("--plan", default=os.environ.get("LOWBIT_AP_PLAN", "ab"), choices=("split", "tune", "final", "ws", "ab"),
                help="split: fused-K/V checks, the quantization/attention split, config sweep at 1k (session 2); "
                     "tune: checks of new paths, config sweep, accuracy first; final: the benchmark suite first; "
                     "ws: the warp-specialization probe first (session 3); "
                     "ab: short checks, then the session-4 A/B list (ab_variants) on the attention launch")
a = ap.parse_args()
if a.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
os.makedirs(a.out, exist_ok=True)
T0 = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, ".refcode", "int_fa"))

import torch  # noqa: E402

DEV = "cpu" if a.cpu_smoke else "cuda"


def _watchdog():  # a hung kernel must not eat the round: write what we have and leave
    import threading

    def run():
        time.sleep(max(a.budget, 5.0))
        print(f"[watchdog] {a.budget:.0f}s reached: writing results and exiting", flush=True)
        try:
            dump()
        finally:
            os._exit(3)

    threading.Thread(target=run, daemon=True).start()


if not a.cpu_smoke and not a.ws_child and not a.ab_child:
    _watchdog()
PLAN = a.plan
SUMMARY = []
RESULTS = {}
SUITE_REC = []


def left():
    return a.budget - (time.time() - T0)


def stamp(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def section(name, fn, need=0.0):
    if name in a.skip.split(","):
        return
    if left() < need:
        SUMMARY.append(f"{name}: skipped ({left():.0f}s left < {need:.0f}s)")
        return
    stamp(f"== {name}")
    try:
        fn()
    except Exception:
        traceback.print_exc()
        SUMMARY.append(f"{name}: EXCEPTION {traceback.format_exc().strip().splitlines()[-1]}")
    stamp(f"== {name} done")


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def dump():
    if SUITE_REC and "suite_json" not in RESULTS:  # the watchdog may stop the suite: keep its rows
        RESULTS["suite_rows_partial"] = list(SUITE_REC[0].rows)
    with open(os.path.join(a.out, "attention_prefill_results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


# ------------------------------------------------------------------------------------- (1) checks
def kernel_call(q, k, v, mode, causal, cfg, fused=False):
    """The op's kernels called directly with a config override (default numerics of ``mode``)."""
    from lowbit.kernels.attention_prefill import attention_prefill_triton, default_config
    from lowbit.kernels.attention_quant import kv4_to_fp8_triton, quantize_kv_triton

    D = q.shape[-1]
    cfg = {**default_config(mode, D, causal, q.shape[2]), **cfg}
    bn = cfg["BLOCK_N"]
    sm = D ** -0.5
    if mode == "fp8-kv4":
        from lowbit.formats.kv4 import quantize_kv4

        kc, ks, _ = quantize_kv4(k)
        vc, vs, _ = quantize_kv4(v)
        if fused:
            return attention_prefill_triton(q, kc, ks, vc, vs, mode="fp8-kv4", causal=causal, sm_scale=sm, config=cfg)
        kc, ks, vt, vs = kv4_to_fp8_triton(kc, ks, vc, vs, block=bn)
        return attention_prefill_triton(q, kc, ks, vt, vs, mode="fp8", causal=causal, sm_scale=sm, config=cfg, k_block=bn)
    if mode == "int8-qk":
        kc, ks, _, _ = quantize_kv_triton(k, None, dtype=torch.int8)
        return attention_prefill_triton(q, kc, ks, v.contiguous(), None, mode=mode, causal=causal, sm_scale=sm, config=cfg)
    if mode == "fp8":
        qp = bool(cfg.get("gluon") or cfg.get("q_pre"))
        res = quantize_kv_triton(k, v, dtype=torch.float8_e4m3fn, k_block=bn, v_granularity="block", q=q if qp else None)
        kc, ks, vt, vs = res[:4]
        if cfg.get("vperm"):  # VPERM V^T
            from lowbit.kernels.attention_prefill_gluon import permute_vt

            vt = permute_vt(vt)
        return attention_prefill_triton(q, kc, ks, vt, vs, mode=mode, causal=causal, sm_scale=sm, config=cfg, k_block=bn,
                                        q_codes=res[4:] if qp else None)
    kc, ks, vt, vs = quantize_kv_triton(k, v, dtype=torch.int8, v_granularity="channel")
    if cfg.get("vperm"):
        from lowbit.kernels.attention_prefill_gluon import permute_vt

        vt = permute_vt(vt)
    return attention_prefill_triton(q, kc, ks, vt, vs, mode=mode, causal=causal, sm_scale=sm, config=cfg)


def checks():
    from lowbit.ops.attention import attention_ref
    from lowbit.ops.attention_prefill import fp8_kv4_attention, quant_attention, reference

    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    if DEV == "cuda" and PLAN == "split":  # default (fused K/V) paths: GQA, D 64/256, odd S, causal
        base = [(2, 8, 8, 1008, 1008, 128)]
        cases = [("fp8", False, base[0], {}), ("int8", False, base[0], {})]
    elif DEV == "cuda" and PLAN == "ws":  # the default paths, short (the ws probe checks its own variants)
        base = [(2, 8, 8, 1008, 1008, 128)]
        cases = [("fp8", False, base[0], {}), ("int8", True, base[0], {}), ("fp8", True, (1, 8, 2, 496, 1008, 128), {})]
    elif DEV == "cuda" and PLAN == "gluon":  # the Gluon kernel against the reference numerics
        base = [(2, 8, 8, 1008, 1008, 128)]
        g = {"gluon": True}
        g, gp, vp = {"gluon": True}, {"gluon": True, "vperm": True}, {"vperm": True}
        cases = [("fp8", False, base[0], {}), ("fp8", True, (1, 8, 2, 496, 1008, 128), {}),  # the defaults (op)
                 ("int8", False, base[0], {}), ("int8", True, (1, 8, 2, 496, 1008, 128), {}),
                 ("fp8-kv4", True, base[0], {}), ("int8", False, (1, 4, 4, 272, 272, 64), {}),
                 ("fp8", True, (1, 4, 1, 333, 200, 128), gp), ("fp8", False, (1, 4, 4, 200, 333, 128), gp),
                 ("fp8", True, (1, 8, 2, 496, 1008, 128), g)]
    elif DEV == "cuda" and PLAN == "ab":  # the A/B options against the reference numerics
        base = [(2, 8, 8, 1008, 1008, 128)]
        cases = []  # session 5: the A/B child checks the defaults and the options
    elif DEV == "cuda" and PLAN == "final":  # the default paths only (their kernels are the suite's)
        base = [(2, 8, 8, 1008, 1008, 128)]
        cases = [("fp8", False, base[0], {}), ("int8", True, base[0], {}), ("int8-qk", False, base[0], {}),
                 ("fp8-kv4", True, base[0], {}), ("fp8", True, (1, 8, 2, 496, 1008, 128), {})]
    elif DEV == "cuda":
        base = [(2, 8, 8, 1008, 1008, 128)]
        cases = [(m, c, base[0], {}) for m in ("fp8", "int8") for c in (False, True)]
        m64 = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, tma=True)
        cases += [(m, False, base[0], {"tma": True}) for m in ("fp8", "int8", "int8-qk", "fp8-kv4-fused")]
        cases += [(m, False, base[0], m64) for m in ("fp8", "int8")]
        cases += [("fp8", True, (1, 8, 2, 496, 1008, 128), {"tma": True}), ("int8", True, (1, 8, 2, 496, 1008, 128), {}),
                  ("int8", False, (1, 4, 4, 272, 272, 64), {}), ("fp8", False, (1, 2, 2, 400, 400, 256), {}),
                  ("int8-pblock", True, base[0], {})]
    else:
        base = [(1, 2, 2, 40, 40, 32)]
        cases = [(m, c, base[0], {}) for m in ("fp8", "int8", "int8-qk", "fp8-kv4", "fp8-kv4-fused", "int8-pblock")
                 for c in (False, True)]
        cases += [("fp8", True, (1, 4, 2, 20, 45, 32), {}), ("int8", True, (1, 4, 2, 20, 45, 32), {})]
    rows = []
    for mode, causal, (B, Hq, Hkv, Sq, Skv, D), cfg in cases:
        tag = f"{mode:8s} causal={int(causal)} B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Skv={Skv} D={D} {cfg or ''}"
        try:
            torch.manual_seed(len(rows))
            q = torch.randn(B, Hq, Sq, D, device=DEV, dtype=dt)
            k = torch.randn(B, Hkv, Skv, D, device=DEV, dtype=dt)
            v = torch.randn(B, Hkv, Skv, D, device=DEV, dtype=dt)
            fused = mode == "fp8-kv4-fused"
            pblock = mode == "int8-pblock"
            m = "fp8-kv4" if fused else ("int8" if pblock else mode)
            if cfg:  # kernel-level call with a config override (TMA path)
                o = kernel_call(q, k, v, m, causal, cfg, fused=fused)
            elif fused:
                from lowbit.formats.kv4 import quantize_kv4

                kv = (*quantize_kv4(k)[:2], *quantize_kv4(v)[:2])
                o = fp8_kv4_attention(q, causal=causal, kv4=kv, fused=True)
            else:
                o = quant_attention(q, k, v, mode=m, causal=causal, p_scale="block" if pblock else "running")
            if DEV == "cuda":
                torch.cuda.synchronize()
            r = reference(q, k, v, mode=m, causal=causal, fused=fused, p_scale="block" if pblock else "running")
            f = attention_ref(q, k, v, causal=causal)
            e_same, e64, eref = rel(o, r), rel(o, f), rel(r, f)
            ok = bool(torch.isfinite(o).all()) and e_same < 1.5e-2 and e64 < eref * 1.2 + 2e-3
            rows.append({"case": tag, "vs_same_numerics": e_same, "vs_fp64": e64, "ref_vs_fp64": eref, "pass": ok})
            print(f"{'PASS' if ok else 'FAIL'} {tag}  vs-same-numerics {e_same:.2e}  vs-fp64 {e64:.3e}  (ref vs fp64 {eref:.3e})", flush=True)
            del q, k, v, o, r, f
        except Exception as exc:
            traceback.print_exc()
            rows.append({"case": tag, "error": f"{type(exc).__name__}: {exc}"[:300], "pass": False})
            print(f"FAIL {tag} {type(exc).__name__}: {exc}", flush=True)
    # the fused K/V prologue writes the codes of the separate pass: identical outputs
    for mode in () if DEV == "cuda" else ("fp8", "int8", "int8-qk"):  # GPU: R4 (max |diff| 0)
        try:
            from lowbit.kernels.attention_prefill import quant_attention_triton

            torch.manual_seed(7)
            q, k, v = (torch.randn(2, 8, 1000, 128, device=DEV, dtype=dt) if DEV == "cuda" else
                       torch.randn(1, 2, 40, 32, dtype=dt) for _ in range(3))
            kw = dict(mode=mode, causal=True, sm_scale=0.1, v_granularity="block" if mode == "fp8" else "channel",
                      k_per_block=mode == "fp8")
            o1 = quant_attention_triton(q, k, v, fuse_kv=True, **kw)
            o2 = quant_attention_triton(q, k, v, fuse_kv=False, **kw)
            ok = bool(torch.equal(o1, o2))
            rows.append({"case": f"{mode} fused K/V == two launches", "pass": ok, "max_abs_diff": (o1 - o2).abs().max().item()})
            print(f"{'PASS' if ok else 'FAIL'} {mode} fused K/V == two launches (max |diff| {(o1 - o2).abs().max().item():.3g})", flush=True)
        except Exception as exc:
            traceback.print_exc()
            rows.append({"case": f"{mode} fused == 2 launches", "error": str(exc)[:300], "pass": False})
    # zero inputs and huge logits stay finite
    for mode in () if DEV == "cuda" and PLAN in ("split", "gluon", "ab") else ("fp8", "int8"):
        try:
            z = torch.zeros(1, 2, 300, 128 if DEV == "cuda" else 32, device=DEV, dtype=dt)
            o = quant_attention(z, z, z, mode=mode, causal=True)
            big = torch.randn_like(z) * 3e3
            o2 = quant_attention(big, big, big, mode=mode)
            ok = bool(torch.isfinite(o).all() and (o == 0).all() and torch.isfinite(o2).all())
            rows.append({"case": f"{mode} zeros/huge", "pass": ok})
            print(f"{'PASS' if ok else 'FAIL'} {mode} zero inputs -> 0, huge logits finite", flush=True)
        except Exception as exc:
            traceback.print_exc()
            rows.append({"case": f"{mode} zeros/huge", "error": str(exc)[:300], "pass": False})
    RESULTS["checks"] = rows
    n_ok = sum(r["pass"] for r in rows)
    SUMMARY.append(f"checks: {n_ok}/{len(rows)} PASS")
    dump()


# ------------------------------------------------------------------------------------- (2) asm
def asm():
    from lowbit.kernels import attention_prefill as kap
    from lowbit.kernels import attention_quant as kaq

    lines = []
    for fn in (kap._attn_fwd, kaq._kv_quant_kernel):
        for dev_cache in getattr(fn, "device_caches", {}).values():
            cache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for key, kern in list(cache.items()):
                try:
                    ptx = kern.asm.get("ptx", "")
                    c = kern.metadata.constants if hasattr(kern.metadata, "constants") else {}
                    wg = re.findall(r"wgmma\.mma_async\S*", ptx)
                    kinds = sorted({w for w in wg})
                    info = {
                        "kernel": kern.metadata.name, "n_regs": kern.n_regs, "n_spills": kern.n_spills,
                        "num_warps": kern.metadata.num_warps, "num_stages": kern.metadata.num_stages,
                        "shared": kern.metadata.shared,
                        "wgmma": len(wg), "wgmma_kinds": kinds[:8], "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
                        "ld_global_v4": len(re.findall(r"ld\.global[^;]*\.v4", ptx)),
                        "cp_async": len(re.findall(r"cp\.async\.(?:cg|ca)", ptx)),
                        "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                        "local": len(re.findall(r"\b(?:ld|st)\.local", ptx)),
                        "ex2": len(re.findall(r"ex2\.approx", ptx)),
                        "magic_rne": ptx.count("0f4B400000"),
                        "specialization": str(c)[:300],
                    }
                    lines.append(info)
                except Exception as exc:
                    lines.append({"error": str(exc)})
    with open(os.path.join(a.out, "asm.txt"), "w") as f:
        for info in lines:
            f.write(json.dumps(info, default=str) + "\n")
    for info in lines:
        print(json.dumps({k: info.get(k) for k in ("kernel", "n_regs", "n_spills", "num_warps", "num_stages", "shared",
                                                   "wgmma", "wgmma_kinds", "mma_sync", "ld_global_v4", "cp_async",
                                                   "local")}, default=str), flush=True)
    RESULTS["asm"] = lines
    dump()


# ------------------------------------------------------------------------------------- (3a) sweep
def sweep():
    from lowbit.bench.harness import attention_flops, time_cuda
    from lowbit.kernels.attention_prefill import attention_prefill_triton
    from lowbit.kernels.attention_quant import quantize_kv_triton

    B, H, S, D = 4, 32, 4096, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fl = attention_flops(B, H, S, S, D, False)
    rows = []
    base = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    t1 = dict(base, tma=True)
    m64 = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, tma=True)  # 2 CTAs per SM
    variants = [  # (mode, config, per-block K scale, V granularity, exp16), most informative first
        ("fp8", base, True, "block", False),
        ("fp8", t1, True, "block", False),
        ("fp8", m64, True, "block", False),
        ("fp8", dict(m64, num_stages=3), True, "block", False),
        ("int8", t1, False, "channel", False),
        ("int8", m64, False, "channel", False),
        ("fp8", dict(m64, num_stages=3), False, "channel", False),
        ("fp8", dict(t1, BLOCK_N=64), True, "block", False),
        ("int8", base, False, "channel", False),
        ("fp8", dict(m64, tma=False), True, "block", False),
        ("fp8", dict(m64, num_stages=3), True, "block", True),
        ("int8", dict(m64, num_stages=3), True, "block", False),
        ("fp8", dict(t1, num_stages=2), True, "block", False),
    ]
    if PLAN == "final":  # what R2 did not measure
        variants = [("int8", dict(m64, num_stages=3), False, "channel", False),
                    ("fp8", dict(m64, num_stages=4), True, "block", False),
                    ("fp8", dict(m64, num_stages=3), True, "block", True)]
    for mode, cfg, kblk, vg, e16 in variants:
        if left() < 12:
            break
        dt = torch.float8_e4m3fn if mode == "fp8" else torch.int8
        try:
            kb = cfg["BLOCK_N"] if kblk else None
            kc, ks, vt, vs = quantize_kv_triton(k, v, dtype=dt, k_block=kb, v_granularity=vg)
            if left() < 10:
                break
            fn = lambda: attention_prefill_triton(q, kc, ks, vt, vs, mode=mode, causal=False, sm_scale=D ** -0.5,
                                                  config=dict(cfg, exp16=e16), k_block=kb)
            fn()
            t = time_cuda(lambda: fn(), [()], warmup=3, reps=20)
            tf = fl / t["median_ms"] / 1e9
            label = f"{mode} {cfg} k_block={kb} v={vg} exp16={int(e16)}"
            rows.append({"mode": mode, **cfg, "k_block": kb, "v": vg, "exp16": e16, "ms": t["median_ms"], "TFLOPs": tf})
            print(f"sweep {label}: {t['median_ms']:.3f} ms {tf:.0f} TFLOP/s", flush=True)
            SUMMARY.append(f"sweep S=4096 attn-only {label}: {tf:.0f} TFLOP/s")
        except Exception as exc:
            rows.append({"mode": mode, **cfg, "error": str(exc)[:200]})
            print(f"sweep {mode} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    for mode, dt, kb, vg in (("fp8", torch.float8_e4m3fn, 128, "block"), ("int8", torch.int8, None, "channel")):
        for nw in ((4,) if PLAN == "final" else (4, 8)):
            if left() < 8:
                break
            fn = lambda: quantize_kv_triton(k, v, dtype=dt, k_block=kb, v_granularity=vg, num_warps=nw)
            fn()
            t = time_cuda(lambda: fn(), [()], warmup=3, reps=20)
            tbs = (2 * k.numel() * 2 + 2 * k.numel()) / (t["median_ms"] * 1e-3) / 1e12
            rows.append({"mode": f"kv-quant-{mode}", "num_warps": nw, "ms": t["median_ms"], "TBps": tbs})
            print(f"kv quant {mode} warps={nw}: {t['median_ms']:.3f} ms {tbs:.2f} TB/s", flush=True)
            SUMMARY.append(f"K/V quantization S=4096 {mode} warps={nw}: {t['median_ms']:.3f} ms ({tbs:.2f} TB/s)")
    RESULTS["sweep"] = rows
    dump()


# ------------------------------------------------------------------------------------- (3b) suite
def suite():
    from lowbit.bench import harness
    from lowbit.bench.suites import attention_prefill as s

    ceil = {}
    rec = harness.Recorder("attention_prefill", ceilings=ceil)
    SUITE_REC.append(rec)
    big = left() > 48
    provs = None
    if PLAN == "split":
        provs = {"sdpa-cudnn", "lowbit-fp8", "lowbit-fp8-attn-only", "lowbit-int8", "lowbit-int8-attn-only"}
        big = False
    if PLAN == "ws":
        provs = {"sdpa-cudnn", "lowbit-fp8", "lowbit-int8", "lowbit-fp8-attn-only", "lowbit-fp8-kvquant-only"}
        big = False
    if PLAN == "ab":
        provs = {"sdpa-cudnn", "lowbit-fp8", "lowbit-fp8-plain", "lowbit-int8", "lowbit-int8-plain",
                 "sageattention-1.0.6", "lowbit-fp8-kv4", "lowbit-int8-qk"}
        big = left() > 40
    if PLAN == "final":
        provs = {"sdpa-cudnn", "lowbit-fp8", "lowbit-int8", "lowbit-int8-qk", "lowbit-fp8-kv4", "lowbit-fp8-attn-only",
                 "lowbit-int8-attn-only", "sageattention-1.0.6", "int-fa-full-int8", "int-fa-half-int8"}
    lens = [1024, 4096, 16384] if big else [1024, 4096]
    if PLAN == "ab":  # session 5: the A/B child times 1k / 4k / 16k kernel-only; the suite end to end
        lens = [4096, 16384, 1024] if left() > 38 else [4096, 1024]
    s.run(rec, quick=False, seq_lens=lens,
          causals=(False, True), providers=provs)
    path = rec.write(a.out, baseline=s.BASELINE, command="benchmarks/device/attention_prefill.py")
    print(open(path.with_suffix(".md")).read(), flush=True)
    RESULTS["suite_json"] = str(path)
    cell = {(r["case"]["S"], r["case"]["causal"], r["provider"]): r for r in rec.rows}
    for (S, c, p), r in sorted(cell.items(), key=lambda x: (x[0][0], x[0][1])):
        if p.startswith("lowbit") and "median_ms" in r:
            base = cell.get((S, c, "sdpa-cudnn"), {})
            sage = cell.get((S, c, "sageattention-1.0.6"), {})
            fa = cell.get((S, c, "int-fa-full-int8"), {})
            parts = [f"{p} S={S} causal={int(c)}: {r['TFLOPs']:.0f} TF/s"]
            if "median_ms" in base:
                parts.append(f"{base['median_ms'] / r['median_ms']:.2f}x cuDNN")
            if "median_ms" in sage:
                parts.append(f"{sage['median_ms'] / r['median_ms']:.2f}x Sage")
            if "median_ms" in fa:
                parts.append(f"{fa['median_ms'] / r['median_ms']:.2f}x INT-FA")
            SUMMARY.append(", ".join(parts))


# ------------------------------------------------------------------------------------- (3c) A/B
AB_FP8 = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2, tma=True, maxnreg=168)  # fp8 default
AB_INT8 = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, tma=True)  # int8 default


def ab_variants():
    """Session 4 A/B list (attention launch alone, pre-quantized Q/K/V, same inputs), most wanted
    first; the first row of each (mode, S, causal) is the committed default: rel = rel-L2 vs it."""
    v = []  # session 5 (R13): plain V^T (the R12 default) vs VPERM (the new default) vs the Gluon kernel
    for S, causal in ((4096, False), (16384, False), (1024, False), (4096, True)):
        v += [("fp8", S, causal, dict(AB_FP8)), ("fp8", S, causal, dict(AB_FP8, vperm=True)),
              ("fp8", S, causal, dict(AB_FP8, gluon=True, vperm=True))]
    for S, causal in ((4096, False), (16384, False), (1024, False), (4096, True)):
        v += [("int8", S, causal, dict(AB_INT8)), ("int8", S, causal, dict(AB_INT8, vperm=True))]
    if os.environ.get("LOWBIT_AP_AB_OLD") != "1":  # session 4's tl rows: measured in R11 (poly slower, BN 64 slower)
        return [tuple(x) for x in json.loads(os.environ["LOWBIT_AP_AB"])] if os.environ.get("LOWBIT_AP_AB") else v
    v += [("fp8", 4096, False, dict(AB_FP8, poly=1)),
          ("fp8", 4096, False, dict(AB_FP8, BLOCK_N=64, maxnreg=128)),
          ("fp8", 4096, False, dict(AB_FP8, BLOCK_N=64, num_stages=3, maxnreg=128)),
          ("fp8", 4096, False, dict(AB_FP8, BLOCK_M=128, num_warps=8, maxnreg=0)),
          ("int8", 4096, False, dict(AB_INT8)), ("int8", 4096, False, dict(AB_INT8, poly=1)),
          ("int8", 4096, False, dict(AB_INT8, BLOCK_N=64, num_stages=2, maxnreg=168))]
    spec = os.environ.get("LOWBIT_AP_AB")  # override: JSON list of [mode, S, causal, config]
    return [tuple(x) for x in json.loads(spec)] if spec else v


def ab():
    from lowbit.bench.harness import attention_flops, time_cuda
    from lowbit.kernels.attention_prefill import attention_prefill_triton
    from lowbit.kernels.attention_quant import quantize_kv_triton

    B, H, D = (4, 32, 128) if DEV == "cuda" else (1, 2, 32)
    data, ref, rows = {}, {}, []
    want_gluon = a.ab_child == "gluon"
    for mode, S, causal, cfg in ab_variants():
        if DEV == "cuda" and not want_gluon:
            continue  # session 5: the child runs every row (tl and Gluon), the parent none
        if DEV == "cpu":  # smoke: the plain default rows once per (mode, causal)
            if cfg not in (AB_FP8, AB_INT8) or any(r["mode"] == mode and r["causal"] == causal for r in rows):
                continue
            S = 40
        if left() < 7:
            SUMMARY.append(f"ab: stopped at {mode} S={S} {cfg} (time)")
            break
        row = {"mode": mode, "S": S, "causal": causal, **cfg}
        if DEV == "cpu" and cfg.get("gluon"):
            continue
        try:
            if (S,) not in data:
                data.clear()
                g = torch.Generator(device=DEV).manual_seed(3)
                data[(S,)] = tuple(torch.randn(B, H, S, D, device=DEV, generator=g).to(
                    torch.bfloat16 if DEV == "cuda" else torch.float32) for _ in range(3))
            q, k, v = data[(S,)]
            bn = cfg["BLOCK_N"] if DEV == "cuda" else 16
            qk = (mode, S, bn)
            if qk not in data:
                if mode == "fp8":
                    data[qk] = quantize_kv_triton(k, v, dtype=torch.float8_e4m3fn, k_block=bn, v_granularity="block", q=q)
                else:
                    data[qk] = quantize_kv_triton(k, v, dtype=torch.int8, v_granularity="channel")
            kc, ks, vt, vs = data[qk][:4]
            qcodes = data[qk][4:] if mode == "fp8" else None
            if cfg.get("vperm"):  # VPERM V^T
                from lowbit.kernels.attention_prefill_gluon import permute_vt

                if qk + ("p",) not in data:
                    data[qk + ("p",)] = permute_vt(vt)
                vt = data[qk + ("p",)]
            c = dict(cfg, q_tma=False)
            if DEV == "cpu":
                c.update(BLOCK_M=16, BLOCK_N=16, num_stages=1)
                c.pop("maxnreg", None)
            fn = lambda: attention_prefill_triton(q, kc, ks, vt, vs, mode=mode, causal=causal, sm_scale=D ** -0.5,
                                                  config=c, k_block=bn if mode == "fp8" else None, q_codes=qcodes)
            t0 = time.time()
            o = fn()
            if DEV == "cuda":
                torch.cuda.synchronize()
            row["compile_s"] = time.time() - t0
            rk = (mode, S, causal)
            if rk in ref:
                row["rel_vs_default"] = rel(o.float(), ref[rk].float())
            else:
                ref[rk] = o.clone()
            row["finite"] = bool(torch.isfinite(o).all())
            if DEV == "cuda":
                t = time_cuda(lambda: fn(), [()], warmup=3, reps=40 if S <= 1024 else 15)
                row["ms"] = t["median_ms"]
                row["TFLOPs"] = attention_flops(B, H, S, S, D, causal) / t["median_ms"] / 1e9
            msg = (f"ab {mode} S={S} causal={int(causal)} {cfg}: " + (f"{row['ms']:.4f} ms {row['TFLOPs']:.0f} TF/s " if "ms" in row else "")
                   + f"rel {row.get('rel_vs_default')} finite {row['finite']}")
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
            msg = f"ab {mode} S={S} causal={int(causal)} {cfg}: ERROR {row['error'][:200]}"
        rows.append(row)
        print(msg, flush=True)
        SUMMARY.append(msg)
        RESULTS["ab"] = rows
        dump()
    data.clear()



# ------------------------------------------------------------------------------------- (4a) MRE
def int_fa_accuracy_providers():
    try:
        from flash_atten_full_int8 import attention_full_int8
        from flash_atten_int8 import attention_int8
    except Exception as exc:
        print(f"INT-FA not importable: {exc}")
        return {}

    def per_token(x):
        s = x.float().abs().amax(-1) / 127
        return torch.round(x.float() / s[..., None]).to(torch.int8), s

    def full(q, k, v, causal):
        qi, qs = per_token(q)
        ki, ks = per_token(k)
        vs = v.float().abs().amax(dim=(2, 3)) / 127
        vi = torch.round(v.float() / vs[..., None, None]).to(torch.int8)
        return attention_full_int8(qi, ki, vi, qs.half(), ks.half(), vs.half(), causal, q.shape[-1] ** -0.5)

    def half(q, k, v, causal):
        qi, qs = per_token(q)
        ki, ks = per_token(k)
        return attention_int8(qi, ki, v.half(), qs.half(), ks.half(), causal, q.shape[-1] ** -0.5)

    return {"int-fa-full-int8": full, "int-fa-half-int8": half}


def mre_tables():
    from lowbit.eval.attention_error import lowbit_providers, synthetic_table

    provs = lowbit_providers()
    try:
        from sageattention import sageattn

        provs["sageattention-1.0.6"] = lambda q, k, v, c: sageattn(q.half(), k.half(), v.half(), tensor_layout="HND", is_causal=c)
    except Exception as exc:
        print(f"sage not importable: {exc}")
    provs.update(int_fa_accuracy_providers())
    provs["sdpa-bf16"] = lambda q, k, v, c: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)
    rows = []

    def show(r):
        if "mre" in r:
            print(f"  {r['dist']:7s} S={r['S']:5d} B={r['B']} H={r['H']} {r['provider']:20s} MRE {100 * r['mre']:7.3f}%  "
                  f"last4 {100 * r['mre_last4']:7.3f}%  relL2 {r['rel_l2']:.4f}", flush=True)
        else:
            print(f"  {r['dist']} S={r['S']} {r['provider']}: {r.get('error')}", flush=True)

    # the target shape at 1k (B=4, H=32), then 2k-16k on B=1, H=4 (float64 reference cost);
    # the final plan runs the lengths the tuning round did not reach
    if PLAN != "final":
        rows += synthetic_table(provs, seq_lens=(1024,), B=4, H=32, on_row=show)
        dump()
        lens = (2048, 4096, 8192, 16384) if left() > 40 else (4096,)
    else:
        lens = (16384, 2048, 8192)
    for S in lens:
        if left() < 6:
            break
        rows += synthetic_table(provs, seq_lens=(S,), B=1, H=4, on_row=show)
        RESULTS["mre"] = rows
        dump()
    RESULTS["mre"] = rows
    for dist in ("normal", "uniform"):
        for p in ("lowbit-int8", "lowbit-int8-tensorV", "lowbit-int8-pblock", "lowbit-int8-qk", "lowbit-fp8",
                  "lowbit-fp8-kv4", "int-fa-full-int8", "int-fa-half-int8", "sageattention-1.0.6"):
            r = next((r for r in rows if r["provider"] == p and r["dist"] == dist and r["S"] == 1024 and "mre" in r), None)
            if r:
                SUMMARY.append(f"MRE {dist} 1k {p}: {100 * r['mre']:.3f}% (last-4 {100 * r['mre_last4']:.3f}%)")
    dump()


# ------------------------------------------------------------------------------------- (4b) model
def model():
    from lowbit.eval.attention_error import capture_qkv, layer_errors, model_perplexity
    from lowbit.eval.corpus import load_text, tokenize
    from lowbit.models.loading import load_model

    m, tok = load_model(None, device="cuda")
    stamp("model loaded")
    ids = tokenize(tok, load_text())
    cap = capture_qkv(m, ids[:1024])
    from lowbit.ops import attention_prefill as ap

    provs = {
        "int8": lambda q, k, v, c, sm: ap.int8_attention(q, k, v, causal=c, sm_scale=sm),
        "int8-tensorV": lambda q, k, v, c, sm: ap.int8_attention(q, k, v, causal=c, sm_scale=sm, v_granularity="tensor"),
        "int8-pblock": lambda q, k, v, c, sm: ap.int8_attention(q, k, v, causal=c, sm_scale=sm, p_scale="block"),
        "int8-qk": lambda q, k, v, c, sm: ap.int8_qk_attention(q, k, v, causal=c, sm_scale=sm),
        "fp8": lambda q, k, v, c, sm: ap.fp8_attention(q, k, v, causal=c, sm_scale=sm),
        "fp8-kv4": lambda q, k, v, c, sm: ap.fp8_kv4_attention(q, k, v, causal=c, sm_scale=sm),
        "sdpa-bf16": lambda q, k, v, c, sm: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=c, scale=sm, enable_gqa=True),
    }
    rows = layer_errors(cap, provs)
    RESULTS["layers"] = rows
    for p in provs:
        vals = [r["rel_l2"] for r in rows if r["provider"] == p and "rel_l2" in r]
        if vals:
            line = f"layer rel-L2 {p}: mean {sum(vals) / len(vals):.4f} max {max(vals):.4f} (" + " ".join(f"{x:.3f}" for x in vals) + ")"
            print(line, flush=True)
            SUMMARY.append(line.split(" (")[0])
    dump()
    ppl = {}
    for scheme in (None, "int8", "int8-qk", "fp8"):
        if left() < 8:
            break
        ppl[scheme or "fp32-sdpa"] = model_perplexity(m, ids, scheme, dtype=torch.bfloat16 if scheme else None)
        print(f"perplexity {scheme or 'fp32-sdpa'}: {ppl[scheme or 'fp32-sdpa']:.4f}", flush=True)
    RESULTS["perplexity"] = ppl
    SUMMARY.append("perplexity (8192 tokens, window 1024): " + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items()))
    dump()


# ------------------------------------------------------------------------------------- (3c) 1k / causal sweep
def sweep_split():
    """Fused fp8 / int8 (quantization included) per config at S=1k (causal and not) and 4k causal."""
    from lowbit.bench.harness import attention_flops, time_cuda
    from lowbit.kernels.attention_prefill import quant_attention_triton

    B, H, D = 4, 32, 128
    m64 = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, tma=True)
    variants = [  # (S, causal, mode, config), most informative first (two launches: fuse_kv=False)
        (1024, False, "fp8", dict(m64, num_stages=2, maxnreg=168)),  # 3 CTAs per SM (74 KB smem, 168 regs)
        (1024, False, "fp8", m64),  # the default, same run
        (1024, True, "fp8", dict(m64, num_stages=2, maxnreg=168)),
        (4096, False, "fp8", dict(m64, num_stages=2, maxnreg=168)),
        (4096, True, "fp8", dict(m64, num_stages=2, maxnreg=168)),
        (4096, False, "int8", m64),
        (4096, False, "int8", dict(m64, i8opt=0)),  # R3's int8 loop (clamp, FADD + FMUL), same run
        (4096, False, "int8", dict(m64, i8opt=1)),
        (4096, False, "int8", dict(m64, i8opt=2)),
        (4096, False, "int8", dict(m64, num_stages=2, maxnreg=168)),
        (1024, False, "fp8", dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, tma=True)),
        (1024, False, "fp8", dict(m64, BLOCK_N=64)),
    ]
    data = {}
    rows = []
    for S, causal, mode, cfg in variants:
        if left() < 32:  # keep ~30 s for the suite
            break
        if S not in data:
            data.clear()
            data[S] = [tuple(torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                       for _ in range(2)]
        sets = data[S]
        fl = attention_flops(B, H, S, S, D, causal)
        try:
            kw = dict(mode=mode, causal=causal, sm_scale=D ** -0.5, v_granularity="block" if mode == "fp8" else "channel",
                      k_per_block=mode == "fp8", config=cfg, fuse_kv=False)
            fn = lambda q, k, v: quant_attention_triton(q, k, v, **kw)
            fn(*sets[0])
            t = time_cuda(fn, sets, warmup=3, reps=30 if S == 1024 else 10)
            tf = fl / t["median_ms"] / 1e9
            label = f"S={S} causal={int(causal)} {mode} {cfg}"
            rows.append({"S": S, "causal": causal, "mode": mode, **cfg, "ms": t["median_ms"], "TFLOPs": tf})
            print(f"sweep-split {label}: {t['median_ms']:.4f} ms {tf:.0f} TFLOP/s", flush=True)
            SUMMARY.append(f"sweep fused {label}: {t['median_ms']:.4f} ms {tf:.0f} TF/s")
        except Exception as exc:
            rows.append({"S": S, "mode": mode, **cfg, "error": str(exc)[:200]})
            print(f"sweep-split {S} {mode} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    RESULTS["sweep_split"] = rows
    data.clear()
    dump()


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _ws_probe_kernel(desc_q, desc_k, desc_v, desc_qs, desc_ks, desc_vs, Out, qk_scale, N_CTX,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
                     SCALES: tl.constexpr = True):
    """Probe only (session 3, R7): lowbit's fp8 numerics (per-token Q scale, per-block K and V
    scales, P = 256 exp2(S - m) in FP8, P.V in a fresh accumulator) with EVERY load through a TMA
    descriptor, Q pre-quantized: the form Triton 3.6's Hopper warp specialization accepts (a
    pointer load anywhere, even outside the loop, asserts in WSLowerToken.cpp:73). Scales of a
    block are read as a [1, 4] tile (16 bytes, the TMA minimum) of a replicated buffer."""
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    qo = off_hz * N_CTX + start_m * BLOCK_M
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q = desc_q.load([qo, 0])
    if SCALES:
        qs = desc_qs.load([qo]) * qk_scale
    else:  # R9: q / k / v only (no small TMA boxes), as Triton's tutorial kernel
        qs = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
    off = off_hz * N_CTX
    nb = off_hz * (N_CTX // BLOCK_N)
    for start_n in tl.range(0, N_CTX, BLOCK_N, warp_specialize=WS):
        if SCALES:
            qsb = qs * tl.max(tl.max(desc_ks.load([nb + start_n // BLOCK_N, 0]), 1), 0)
        else:
            qsb = qs
        t = tl.dot(q, desc_k.load([off, 0]).T)
        m_ij = tl.maximum(m_i, tl.max(t, 1) * qsb)
        p = tl.math.exp2(t * qsb[:, None] - (m_ij - 8.0)[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = desc_v.load([off_hz * HEAD_DIM, start_n])
        pv = tl.dot(p.to(tl.float8e4nv), vt.T)
        if SCALES:
            acc = acc * alpha[:, None] + pv * tl.max(tl.max(desc_vs.load([nb + start_n // BLOCK_N, 0]), 1), 0)
        else:
            acc = acc * alpha[:, None] + pv
        m_i = m_ij
        off += BLOCK_N
    acc = acc / l_i[:, None]
    offs_m = qo + tl.arange(0, BLOCK_M)
    tl.store(Out + offs_m[:, None].to(tl.int64) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], acc.to(tl.bfloat16))


def ws_probe_child(spec):
    """Runs in a child process (a hang or an assert must not take the round): one JSON line per
    variant. spec: 'S:BM:WS:stages:warps[:maxnreg],...'."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from lowbit.bench.harness import attention_flops, time_cuda

    B, H, D, BN = (4, 32, 128, 128) if DEV == "cuda" and not os.environ.get("LOWBIT_AP_SMALL") else (1, 2, 128, 128)
    data = {}
    ref = {}
    for item in spec.split(","):
        if item.startswith("R"):
            real_variant(item, data, ref)
            continue
        f = item.split(":")
        S, BM, ws, st, nw = int(f[0]), int(f[1]), f[2] == "1", int(f[3]), int(f[4])
        mr = int(f[5]) if len(f) > 5 else 0
        sc = f[6] != "0" if len(f) > 6 else True
        t0 = time.time()
        try:
            if S not in data:
                data.clear()
                g = torch.Generator(device=DEV).manual_seed(0)
                q = torch.randn(B * H * S, D, device=DEV, generator=g).to(torch.float8_e4m3fn)
                k = torch.randn(B * H * S, D, device=DEV, generator=g).to(torch.float8_e4m3fn)
                vt = torch.randn(B * H * D, S, device=DEV, generator=g).to(torch.float8_e4m3fn)
                qs = torch.rand(B * H * S, device=DEV, generator=g) * 0.01 + 0.005
                ks = (torch.rand(B * H * S // BN, 1, device=DEV, generator=g) * 0.01 + 0.005).expand(-1, 4).contiguous()
                vs = (torch.rand(B * H * S // BN, 1, device=DEV, generator=g) * 0.01 + 0.005).expand(-1, 4).contiguous()
                data[S] = (q, k, vt, qs, ks, vs)
            q, k, vt, qs, ks, vs = data[S]
            out = torch.empty(B * H * S, D, device=DEV, dtype=torch.bfloat16)
            ds = (TensorDescriptor(q, list(q.shape), [D, 1], [BM, D]), TensorDescriptor(k, list(k.shape), [D, 1], [BN, D]),
                  TensorDescriptor(vt, list(vt.shape), [S, 1], [D, BN]), TensorDescriptor(qs, list(qs.shape), [1], [BM]),
                  TensorDescriptor(ks, list(ks.shape), [4, 1], [1, 4]), TensorDescriptor(vs, list(vs.shape), [4, 1], [1, 4]))
            kw = {"maxnreg": mr} if mr else {}
            fn = lambda: _ws_probe_kernel[(S // BM, B * H)](*ds, out, 0.1275, S, HEAD_DIM=D, BLOCK_M=BM, BLOCK_N=BN,
                                                          WS=ws, SCALES=sc, num_warps=nw, num_stages=st, **kw)
            fn()
            if DEV == "cpu":  # smoke: compare with a float64 replay of the probe's math
                qf = q.double().view(B * H, S, D) * qs.double().view(B * H, S, 1)
                kf = k.double().view(B * H, S, D) * ks[:, 0].double().view(B * H, S // BN, 1).repeat_interleave(BN, 1)
                vf = vt.double().view(B * H, D, S).transpose(1, 2) * vs[:, 0].double().view(B * H, S // BN, 1).repeat_interleave(BN, 1)
                o = torch.softmax(qf @ kf.transpose(1, 2) * (0.1275 / 1.4426950408889634), -1) @ vf
                print("WSPROBE-SMOKE rel", rel(out.view(B * H, S, D), o), flush=True)
                continue
            torch.cuda.synchronize()
            tc = time.time() - t0
            err = None
            if S in ref:
                err = rel(out.float(), ref[S].float())
            else:
                ref[S] = out.clone()
            if os.environ.get("LOWBIT_AP_SMALL"):
                print("WSPROBE " + json.dumps({"S": S, "BM": BM, "ws": ws, "ran": True, "rel_vs_first": err}), flush=True)
                continue
            t = time_cuda(lambda: fn(), [()], warmup=3, reps=30 if S <= 1024 else 10)
            tf = attention_flops(B, H, S, S, D, False) / t["median_ms"] / 1e9
            print("WSPROBE " + json.dumps({"S": S, "BM": BM, "ws": ws, "stages": st, "warps": nw, "maxnreg": mr,
                                           "scales": sc, "ms": t["median_ms"], "TFLOPs": tf, "rel_vs_first": err,
                                           "compile_s": tc}), flush=True)
        except Exception as exc:
            print("WSPROBE " + json.dumps({"S": S, "BM": BM, "ws": ws, "stages": st, "warps": nw,
                                           "error": f"{type(exc).__name__}: {str(exc)[-300:]}"}), flush=True)


def real_variant(item, data, ref):
    """'R:S:causal:BM:ws:stages:warps:maxnreg:q_pre[:mode[:q_tma]]' -> lowbit's path of ``mode``
    (default fp8; two launches, quantization included) with that config; rel / max |diff| vs the first R
    variant of the same S, causal and mode (run the default first)."""
    from lowbit.bench.harness import attention_flops, time_cuda
    from lowbit.kernels.attention_prefill import quant_attention_triton

    f = item.split(":")
    S, causal, BM, ws, st, nw, mr, qp = (int(f[1]), f[2] == "1", int(f[3]), f[4] == "1", int(f[5]), int(f[6]),
                                         int(f[7]), f[8] == "1")
    mode = f[9] if len(f) > 9 else "fp8"
    qt = f[10] != "0" if len(f) > 10 else True
    B, H, D = (4, 32, 128) if DEV == "cuda" and not os.environ.get("LOWBIT_AP_SMALL") else (1, 2, 128)
    cfg = dict(BLOCK_M=BM, BLOCK_N=128, num_warps=nw, num_stages=st, tma=True, ws=ws, q_pre=qp, q_tma=qt)
    if mr:
        cfg["maxnreg"] = mr
    row = {"kind": "real", "mode": mode, "S": S, "causal": causal, **cfg}
    t0 = time.time()
    try:
        key = ("real", S)
        if key not in data:
            for kk in [x for x in data if x != key]:
                del data[kk]
            g = torch.Generator(device=DEV).manual_seed(1)
            data[key] = [tuple(torch.randn(B, H, S, D, device=DEV, generator=g).to(torch.bfloat16) for _ in range(3))
                         for _ in range(2)]
        sets = data[key]
        kw = dict(mode=mode, causal=causal, sm_scale=D ** -0.5, v_granularity="block" if mode == "fp8" else "channel",
                  k_per_block=mode == "fp8", config=cfg, fuse_kv=False)
        fn = lambda q, k, v: quant_attention_triton(q, k, v, **kw)
        o = fn(*sets[0])
        if DEV == "cuda":
            torch.cuda.synchronize()
        row["compile_s"] = time.time() - t0
        rk = ("real", S, causal, mode)
        if rk in ref:
            row["rel_vs_first"] = rel(o.float(), ref[rk].float())
            row["maxabs_vs_first"] = (o.float() - ref[rk].float()).abs().max().item()
        else:
            ref[rk] = o.clone()
        if DEV == "cuda" and not os.environ.get("LOWBIT_AP_SMALL"):
            t = time_cuda(fn, sets, warmup=3, reps=30 if S <= 1024 else 10)
            row["ms"] = t["median_ms"]
            row["TFLOPs"] = attention_flops(B, H, S, S, D, causal) / t["median_ms"] / 1e9
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
    print("WSPROBE " + json.dumps(row), flush=True)


def _sanitizer():
    import glob
    import shutil

    found = shutil.which("compute-sanitizer") or sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))
    return found if isinstance(found, str) else (found[-1] if found else None)


def ws_experiment(spec=None, timeout=36.0):
    """Session 3: the Q pre-pass (``q_pre``) and Triton 3.6's Hopper automatic warp specialization
    (``ws``) on lowbit's kernel and on an all-TMA fp8 probe. ``;`` separates groups, each run in
    its own child process (a device fault is sticky for the whole CUDA context: R7 lost every
    variant after the first fault); a group starting with ``SAN|`` runs at a tiny shape under
    compute-sanitizer memcheck (where the fault is); ``,`` separates the variants of a group."""
    import subprocess

    spec = spec or os.environ.get("LOWBIT_AP_WS", ";".join([
        "R:4096:0:64:0:2:4:168:0,R:4096:0:64:0:2:4:168:1:fp8:0,R:1024:0:64:0:2:4:168:0,R:1024:0:64:0:2:4:168:1:fp8:0,"
        "R:4096:1:64:0:2:4:168:0,R:4096:1:64:0:2:4:168:1:fp8:0",
        "SAN|R:256:0:128:1:2:4:0:1",
        "R:4096:0:64:0:3:4:0:0:int8,R:4096:0:64:0:2:4:168:1:int8:0,R:4096:0:64:0:3:4:0:1:int8:0",
        "4096:64:0:2:4:168,4096:128:1:2:4",
        "SAN|R:256:0:64:0:2:4:168:1",
        "R:4096:0:64:0:2:4:168:0,R:4096:0:64:0:2:4:168:1",
        "R:4096:0:64:0:2:4:168:0,R:4096:0:128:1:2:4:0:1,R:1024:0:64:0:2:4:168:0,R:1024:0:128:1:2:4:0:1",
    ]))
    rows = []
    t_end = time.time() + timeout
    for group in spec.split(";"):
        rem = min(t_end - time.time(), left() - 4)
        if rem < 6:
            SUMMARY.append(f"WS group skipped (time): {group}")
            continue
        san = group.startswith("SAN|")
        g = group[4:] if san else group
        cmd = [sys.executable, os.path.abspath(__file__), "--out", a.out, "--ws-child", g]
        env = dict(os.environ)
        if san:
            tool = _sanitizer()
            if tool is None:
                SUMMARY.append("compute-sanitizer not found")
                continue
            cmd = [tool, "--tool", "memcheck", "--print-limit", "8"] + cmd
            env["LOWBIT_AP_SMALL"] = "1"
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=rem, env=env)
            text = r.stdout + "\n" + r.stderr[-2500:]
        except subprocess.TimeoutExpired as exc:
            text = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            text += "\n[ws probe child timed out]"
        for line in text.splitlines():
            if line.startswith("WSPROBE "):
                row = json.loads(line[8:])
                row["group"] = group[:60]
                rows.append(row)
                if "ms" in row and row.get("kind") == "real":
                    SUMMARY.append(f"WS real {row['mode']} (quant incl.) S={row['S']} causal={int(row['causal'])} "
                                   f"BM={row['BLOCK_M']} ws={int(row['ws'])} st={row['num_stages']} w={row['num_warps']} "
                                   f"maxnreg={row.get('maxnreg', 0)} q_pre={int(row['q_pre'])} q_tma={int(row['q_tma'])}: "
                                   f"{row['ms']:.4f} ms {row['TFLOPs']:.0f} TF/s (max|diff| vs first {row.get('maxabs_vs_first')})")
                elif "ms" in row:
                    SUMMARY.append(f"WS probe S={row['S']} BM={row['BM']} ws={int(row['ws'])} st={row['stages']} "
                                   f"w={row['warps']} maxnreg={row['maxnreg']}: {row['ms']:.4f} ms {row['TFLOPs']:.0f} TF/s "
                                   f"(rel vs first {row['rel_vs_first']})")
                else:
                    SUMMARY.append(f"WS {'sanitizer ' if san else ''}row: {json.dumps(row)[:400]}")
        print(f"---- group {group} ----", flush=True)
        print(text[-(5000 if san else 2500):], flush=True)
        with open(os.path.join(a.out, "ws_children.txt"), "a") as f:
            f.write(f"---- group {group} ----\n{text}\n")
    RESULTS["ws_probe"] = rows
    dump()


if a.ws_child:
    ws_probe_child(a.ws_child)
    sys.exit(0)


def gluon_child(timeout):
    """The Gluon kernel's checks and A/B rows in a child process (a device fault is sticky for
    the whole CUDA context: the parent's rows survive it)."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--out", a.out, "--ab-child", "gluon", "--budget", str(timeout)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 5)
        text = r.stdout + "\n" + r.stderr[-3000:]
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")) + "\n[gluon child timed out]"
    print(text, flush=True)
    with open(os.path.join(a.out, "gluon_child.txt"), "w") as f:
        f.write(text)
    for line in text.splitlines():
        if line.startswith(("ab ", "PASS", "FAIL", "checks:")):
            SUMMARY.append("gluon child: " + line)


if a.ab_child:
    PLAN = "gluon"
    section("ab", ab)
    section("check", checks)
    print("\n==== summary ====")
    for s_ in SUMMARY:
        print(s_)
    with open(os.path.join(a.out, "attention_prefill_gluon_results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    sys.exit(0)


if PLAN == "ab":
    if DEV == "cuda":
        section("gluon", lambda: gluon_child(float(os.environ.get("LOWBIT_AP_GLUON_S", "42"))), need=20)
    else:
        section("ab", ab)
    if DEV == "cuda":  # session 5: default vs Gluon vs the peers, quantization included
        section("suite", suite, need=16)
if DEV == "cuda" and PLAN == "ws":
    section("ws", lambda: ws_experiment(timeout=56.0), need=10)
section("check", checks, need=20 if DEV == "cuda" and PLAN == "ws" else 0)
if DEV == "cuda" and PLAN == "ws":
    section("asm", asm)
    section("suite", suite, need=20)
elif DEV == "cuda" and PLAN == "split":
    section("sweep_split", sweep_split, need=15)
    section("suite", suite, need=25)
elif DEV == "cuda" and PLAN == "ab":
    pass  # R11 dumped the default kernels' asm
elif DEV == "cuda" and PLAN == "tune":
    section("asm", asm)
    section("sweep", sweep, need=15)
    section("mre", mre_tables, need=15)
    section("model", model, need=30)
    section("suite", suite, need=30)
elif DEV == "cuda" and PLAN == "final":  # session 5: the committed defaults and the peers first
    section("suite", suite, need=30)
    section("asm", asm)
    section("mre", mre_tables, need=12)
elif DEV == "cuda":
    section("asm", asm)
    section("suite", suite, need=30)
    if os.environ.get("LOWBIT_AP_WS_LAST", "1") == "1":  # WS on the q/k/v-only probe (no small TMA boxes)
        section("ws", lambda: ws_experiment("4096:64:0:2:4:168:0,4096:128:1:2:4:0:0", timeout=14.0), need=12)
    section("mre", mre_tables, need=15)
    section("model", model, need=30)
print("\n==== summary ====")
for s in SUMMARY:
    print(s)
print(f"total {time.time() - T0:.1f}s")
dump()
