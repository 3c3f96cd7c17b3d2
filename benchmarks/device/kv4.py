"""Device script for area kv4 (FireQ INT4 KV cache + decode, QServe KV4 with zero points).

(1) correctness of the append and decode kernels vs the references on the GPU, (2) what Triton
generated for the decode kernel, (3) a small config sweep + the ``kv4`` bench suite (lowbit vs
SDPA bf16), (4) accuracy on the embedded model: per-layer attention error with real K/V and
perplexity with KV4 (none / RPN / CRS / RPN+CRS / kv4-zp). ``--cpu-smoke`` runs tiny shapes of
(1) under TRITON_INTERPRET=1.
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
ap.add_argument("--quick", action="store_true")
ap.add_argument("--accuracy", action="store_true", help="also the model accuracy tables (~35 s; numerics unchanged since R3)")
ap.add_argument("--skip", default="asm,sweep", help="comma list of sections to skip: check,asm,sweep,gluon,suite,acc "
                "(default: asm,sweep -- the Triton kernel's SASS and sweep are R6's; the Gluon section times both)")
ap.add_argument("--gluon-only", action="store_true", help="(internal) the Gluon section alone, run in a subprocess")
a = ap.parse_args()
if a.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
os.makedirs(a.out, exist_ok=True)

import torch  # noqa: E402

from lowbit.bench.device import Sections  # noqa: E402
from lowbit._utils import capture_cuda_graph  # noqa: E402
from lowbit.bench.harness import env_info  # noqa: E402

DEV = "cpu" if a.cpu_smoke else "cuda"
RESULTS = {}
SHORT_SWEEP = False  # True in the final round: the Gluon section times the defaults only
VARIANT_OK = {}
# (trans, num_warps, BLOCK_N, lazy) checked on the GPU; the sweep times only variants that passed
VARIANTS = [(False, 1, 16, True, 2), (False, 1, 16, True, False)]


def _dump():
    with open(os.path.join(a.out, "kv4_device.json"), "w") as f:  # after every section: a timeout keeps the rest
        json.dump({"env": env_info(" ".join(sys.argv)), **RESULTS}, f, indent=1, default=str)


_S = Sections(skip=a.skip, after=_dump)
T0, SUMMARY, stamp, section = _S.t0, _S.summary, _S.stamp, _S.run


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------- (1) checks
def checks():
    from lowbit.bench.suites.kv4 import random_cache
    from lowbit.ops import kv4 as ops

    res = []
    cases = [  # B, Hq, Hkv, D, TQ, L, page, zp, scale dtype
        (3, 32, 8, 128, 1, 1000, 64, False, torch.float8_e4m3fn),
        (2, 32, 8, 128, 4, 777, 64, False, torch.float8_e4m3fn),
        (2, 8, 1, 64, 2, 300, 16, False, torch.bfloat16),
        (4, 8, 8, 64, 3, 129, 32, True, torch.float8_e4m3fn),
        (2, 32, 8, 128, 1, 9000, 64, True, torch.float8_e4m3fn),
        (1, 32, 8, 128, 1, 20000, 64, False, torch.float8_e4m3fn),
    ]
    if a.cpu_smoke:
        cases = [(2, 4, 2, 64, 2, 40, 16, False, torch.float8_e4m3fn), (2, 4, 1, 64, 1, 33, 16, True, torch.bfloat16)]
    for (B, Hq, Hkv, D, TQ, L, page, zp, sd) in cases:
        name = f"decode B={B} Hq={Hq} Hkv={Hkv} D={D} TQ={TQ} L={L} page={page} zp={zp} scale={str(sd)[6:]}"
        try:
            c = random_cache(B, Hkv, D, L, page=page, zero_point=zp, device=DEV)
            c["k_scale"] = c["k_scale"].to(sd)
            c["v_scale"] = c["v_scale"].to(sd)
            lens = torch.randint(TQ, L + 1, (B,), generator=torch.Generator().manual_seed(1)).to(torch.int32)
            lens[0] = L
            c["lengths"] = lens.to(DEV)
            q = torch.randn(B, Hq, TQ, D, device=DEV, dtype=torch.float32)
            crs = (torch.rand(Hkv, D, device=DEV) + 0.5)
            o = ops.decode_kv4(q, crs_q=crs, **c)
            r = ops.decode_kv4_ref(q, crs_q=crs, **c)
            e = rel(o, r)
            ok = e < 5e-3
            res.append((name, e, ok))
            print(f"{'PASS' if ok else 'FAIL'} {name}: rel-L2 {e:.2e}", flush=True)
        except Exception as exc:
            traceback.print_exc()
            res.append((name, None, False))
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    # numerics of the default QK8 decode (INT8 Q per row) against the fp16-Q float64 reference and
    # against its own reference, Q with outlier channels (x20 on 4 channels)
    try:
        import lowbit.kernels.decode_kv4 as dk

        c = random_cache(2, 8, 128, 4096, device=DEV) if not a.cpu_smoke else random_cache(2, 2, 64, 40, page=16, device=DEV)
        Hq = 32 if not a.cpu_smoke else 8
        q = torch.randn(2, Hq, 1, c["k_codes"].shape[-1] * 2, device=DEV)
        q[..., :4] *= 20
        o = ops.decode_kv4(q, q_int8=True, **c)
        e16 = rel(o, ops.decode_kv4_ref(q, q_int8=False, **c))
        e8 = rel(o, ops.decode_kv4_ref(q, q_int8=True, **c))
        ok = e8 < 5e-3  # e16 is the cost of INT8 Q (a measurement, reported)
        res.append(("decode QK8 numerics (vs its own reference)", e8, ok))
        RESULTS["qk8_error"] = {"vs_fp16_q_ref": e16, "vs_q8_ref": e8, "qk_int8_default": dk.DEFAULT_QK8}
        print(f"{'PASS' if ok else 'FAIL'} decode qk_int8=True, Q with outlier channels: vs fp16-Q reference rel-L2 {e16:.2e}, "
              f"vs its INT8-Q reference {e8:.2e}", flush=True)
        o2 = ops.decode_kv4(q, q_int8=2, **c)
        o16 = ops.decode_kv4(q, q_int8=False, **c)
        r16 = ops.decode_kv4_ref(q, q_int8=False, **c)
        e2_16, e2_2, e16_16 = rel(o2, r16), rel(o2, ops.decode_kv4_ref(q, q_int8=2, **c)), rel(o16, r16)
        ok2 = e2_2 < 5e-3
        res.append(("decode q_int8=2 numerics (vs its own reference)", e2_2, ok2))
        RESULTS["qk8x2_error"] = {"vs_fp16_q_ref": e2_16, "vs_q8x2_ref": e2_2, "fp16_kernel_vs_fp16_q_ref": e16_16}
        print(f"{'PASS' if ok2 else 'FAIL'} decode qk_int8=2, same Q: vs fp16-Q reference rel-L2 {e2_16:.2e} (fp16-Q kernel "
              f"{e16_16:.2e}), vs its own reference {e2_2:.2e}", flush=True)
    except Exception as exc:
        traceback.print_exc()
        res.append(("decode QK8 numerics (vs its own reference)", None, False))
    # append: kernel vs reference bit-exact
    for zp, sd in ((False, torch.float8_e4m3fn), (True, torch.bfloat16)):  # append unchanged since R3 (4 combos there)
        if True:
            name = f"append zp={zp} scale={str(sd)[6:]}"
            try:
                B, H, T, D, page = (3, 8, 37, 128, 16) if not a.cpu_smoke else (3, 2, 3, 64, 16)
                c1 = random_cache(B, H, D, 200, page=page, zero_point=zp, device=DEV)
                for kk in ("k_scale", "v_scale"):
                    c1[kk] = c1[kk].to(sd)
                c2 = {k: v.clone() for k, v in c1.items()}
                start = torch.tensor([0, 17, 150], dtype=torch.int32, device=DEV)
                k = torch.randn(B, H, T, D, device=DEV, dtype=torch.bfloat16) * 3
                v = torch.randn(B, H, T, D, device=DEV, dtype=torch.bfloat16)
                k[0, 0, 0] = 0.0  # all-zero token
                k[0, 1, 1] *= 1e-4  # tiny-amax token (FP8 scale floor)
                k[1, 1, 2] *= 3e-3  # amax in the FP8-subnormal scale range
                ang = torch.rand(B, T, D // 2, device=DEV) * 6.28
                cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16)
                sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
                crs = torch.rand(H, D, device=DEV) + 0.5
                kw = dict(cos=cos, sin=sin, crs_k=crs)
                args = lambda c: (c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], start)  # noqa: E731
                ops.kv4_append(k, v, *args(c1), k_zero=c1.get("k_zero"), v_zero=c1.get("v_zero"), **kw)
                ops.kv4_append_ref(k, v, *args(c2), k_zero=c2.get("k_zero"), v_zero=c2.get("v_zero"), **kw)
                bad = sum(int((c1[n].view(torch.uint8) != c2[n].view(torch.uint8)).sum()) if c1[n].dtype != torch.bfloat16
                          else int((c1[n] != c2[n]).sum()) for n in c1 if n not in ("page_table", "lengths"))
                ok = bad == 0
                res.append((name, float(bad), ok))
                print(f"{'PASS' if ok else 'FAIL'} {name}: {bad} differing stored bytes", flush=True)
            except Exception as exc:
                traceback.print_exc()
                res.append((name, None, False))
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    if not a.cpu_smoke and "sweep" not in a.skip.split(","):  # kernel variants (orientation, warps, BLOCK_N, lazy) for the sweep
        from lowbit.kernels.decode_kv4 import decode_kv4_triton

        for trans, nw, bn, lazy, q8 in VARIANTS:
            for zp in ((False, True) if q8 == 2 else (False,)):
                name = f"variant trans={trans} warps={nw} bn={bn} lazy={lazy} qk_int8={q8} zp={zp}"
                try:
                    # TQ=1, bf16 Q, no CRS: the same compiled kernel as the sweep's (compilation is the budget)
                    B, Hq, Hkv, D, TQ, L = 3, 32, 8, 128, 1, 700
                    c = random_cache(B, Hkv, D, L, zero_point=zp, device=DEV)
                    c["lengths"] = torch.tensor([700, 3, 333], dtype=torch.int32, device=DEV)
                    q = torch.randn(B, Hq, TQ, D, device=DEV, dtype=torch.bfloat16)
                    o = decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"],
                                          c["lengths"], k_zero=c.get("k_zero"), v_zero=c.get("v_zero"),
                                          trans=trans, num_warps=nw, block_n=bn, lazy=lazy, num_splits=3, qk_int8=q8,
                                          gluon=False)  # the Triton kernel (the Gluon one: ops path + gluon section)
                    r = ops.decode_kv4_ref(q, q_int8=q8, **c)
                    e = rel(o, r)
                    ok = e < 5e-3
                    res.append((name, e, ok))
                    VARIANT_OK[(trans, nw, bn, lazy, q8)] = VARIANT_OK.get((trans, nw, bn, lazy, q8), True) and ok
                    print(f"{'PASS' if ok else 'FAIL'} {name}: rel-L2 {e:.2e}", flush=True)
                except Exception as exc:
                    traceback.print_exc()
                    res.append((name, None, False))
                    VARIANT_OK[(trans, nw, bn, lazy, q8)] = False
                    print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
    RESULTS["checks"] = [{"case": n, "err": e, "pass": ok} for n, e, ok in res]
    SUMMARY.append(f"checks: {sum(ok for *_, ok in res)}/{len(res)} PASS")


# ------------------------------------------------------------------------------------- (2) asm
def asm():
    from collections import Counter

    from lowbit.bench.suites.kv4 import random_cache
    from lowbit.kernels.decode_kv4 import decode_kv4_triton

    lines = []
    for trans, nw, bn, lazy, q8 in VARIANTS[:3]:
        if not VARIANT_OK.get((trans, nw, bn, lazy, q8), False):
            continue
        asm_ = True
        if True:
            for zp in (False,):
                c = random_cache(16, 8, 128, 8192, zero_point=zp)
                q = torch.randn(16, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
                _, k = decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"],
                                         c["lengths"], k_zero=c.get("k_zero"), v_zero=c.get("v_zero"),
                                         trans=trans, num_warps=nw, block_n=bn, lazy=lazy, qk_int8=q8, return_kernel=True)
                ptx = k.asm.get("ptx", "")
                try:
                    sass = k.asm["sass"] or ""
                    with open(os.path.join(a.out, f"decode_kv4_t{int(trans)}w{nw}n{bn}q{int(q8)}.sass"), "w") as f:
                        f.write(sass)
                except Exception as exc:  # nvdisasm missing
                    sass = ""
                    print("no sass:", exc)
                tag = f"t{int(trans)}w{nw}n{bn}q{int(q8)}"
                ops_ = Counter(m.group(1).split(".")[0] for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?P\d\s+)?([A-Z0-9_.]+)", sass, re.M))
                info = {
                    "variant": tag, "n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                    "mma": len(re.findall(r"\bmma\.sync", ptx)), "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                    "ld.global.v4": len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)),
                    "cp.async": len(re.findall(r"cp\.async\.(ca|cg)", ptx)), "ldmatrix": len(re.findall(r"ldmatrix", ptx)),
                    "st.shared": len(re.findall(r"st\.shared", ptx)), "ld.shared": len(re.findall(r"ld\.shared", ptx)),
                    "local": len(re.findall(r"\.local", ptx)), "shared_bytes": getattr(getattr(k, "metadata", None), "shared", None),
                    "sass_top": ops_.most_common(14),
                }
                lines.append(json.dumps(info))
                print(info, flush=True)
                for ext in ("ptx", "ttgir"):
                    with open(os.path.join(a.out, f"decode_kv4_{tag}.{ext}"), "w") as f:
                        f.write(k.asm.get(ext, ""))
    with open(os.path.join(a.out, "asm_summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    SUMMARY.append("asm: " + "\n".join(lines))


# ------------------------------------------------------------------------------------- (3) sweep + suite
def _time(fn, sets):
    """time_cuda on the GPU; under --cpu-smoke one call (the sweep's code path is still exercised)."""
    from lowbit.bench.harness import time_cuda

    if a.cpu_smoke:
        t0 = time.time()
        fn(*sets[0])
        return {"median_ms": (time.time() - t0) * 1e3}
    return time_cuda(fn, sets, reps=20, warmup=3)


def sweep():
    from lowbit.bench.harness import rotating_inputs
    from lowbit.bench.suites.kv4 import kv4_bytes, random_cache
    import lowbit.kernels.decode_kv4 as dk
    from lowbit.kernels.decode_kv4 import decode_kv4_triton

    Hq, Hkv, D = (32, 8, 128) if not a.cpu_smoke else (8, 2, 64)
    MIN_WAVES0 = dk.DEFAULT_MIN_WAVES
    rows = []
    # (B, L, trans, warps, block_n, stages, splits, lazy, qk_int8); splits None = choose_splits,
    # ("w", x) = choose_splits with min_waves x; lazy ("maxnreg", n) = register cap n (default: kernel default)
    D0 = ("maxnreg", dk.DEFAULT_MAXNREG)
    configs = [(16, 8192, False, 1, 16, 3, None, D0, False), (16, 8192, False, 1, 16, 3, None, D0, True),
               (16, 8192, False, 1, 16, 3, None, D0, 2), (16, 8192, True, 4, 64, 2, None, True, 2)]
    configs += [(16, 32768, False, 1, 16, 3, None, D0, 2), (1, 32768, False, 1, 16, 3, None, D0, 2)]
    if a.cpu_smoke:  # the code path only, on tiny shapes
        configs = [(2, 40, False, 1, 16, 3, None, True, False), (2, 40, False, 1, 16, 3, ("w", 0.95), ("maxnreg", 128), True)]
    cache = {}
    for (B, L, trans, nw, bn, ns, sp, lazy, q8) in configs:
        mr = 0  # 0 = no cap (the launcher's None means the kernel default)
        if isinstance(lazy, tuple):  # ("maxnreg", n): register cap (occupancy of 1-warp programs)
            mr, lazy = lazy[1], True
        waves = dk.DEFAULT_MIN_WAVES
        if isinstance(sp, tuple):
            waves, sp = sp[1], None
        key = (trans, nw, bn, lazy, q8)
        if not a.cpu_smoke and not VARIANT_OK.get(key, key not in VARIANTS):
            continue
        try:
            if (B, L) not in cache:
                cache.clear()
                if a.cpu_smoke:
                    cache[(B, L)] = [(torch.randn(B, Hq, 1, D, dtype=torch.bfloat16),
                                      random_cache(B, Hkv, D, L, page=16, device="cpu"))]
                else:
                    torch.cuda.empty_cache()
                    cache[(B, L)] = rotating_inputs(lambda: (torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16),
                                                             random_cache(B, Hkv, D, L)))
            sets = cache[(B, L)]
            dk.DEFAULT_MIN_WAVES = waves
            fn = lambda q, c: decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"],  # noqa: E731
                                               c["page_table"], c["lengths"], max_len=L, block_n=bn, num_warps=nw,
                                               num_stages=ns, num_splits=sp, trans=trans, lazy=lazy, maxnreg=mr,
                                               qk_int8=q8)
            if mr:  # a register cap may spill: check it too
                so = fn(*sets[0])
                c0 = sets[0][1]
                from lowbit.ops.kv4 import decode_kv4_ref
                q0 = sets[0][0][:2]
                c2 = dict(c0, lengths=c0["lengths"][:2], page_table=c0["page_table"][:2])
                e = rel(so[:2], decode_kv4_ref(q0, q_int8=q8, **c2))
                if not e < 5e-3:
                    print("maxnreg config WRONG", mr, e, flush=True)
                    continue
            t = _time(fn, sets)
            tb = kv4_bytes(B, Hq, Hkv, D, L, 1, False) / (t["median_ms"] * 1e-3) / 1e12
            nsp = dk.LAST_LAUNCH.get("num_splits")
            r = {"B": B, "L": L, "trans": trans, "warps": nw, "block_n": bn, "stages": ns, "splits": sp, "splits_used": nsp,
                 "lazy": lazy, "qk_int8": q8, "maxnreg": mr or None, "min_waves": waves, "ms": t["median_ms"], "TBps": tb}
            rows.append(r)
            print(r, flush=True)
        except Exception as exc:
            print("sweep config failed", B, L, trans, nw, bn, ns, sp, lazy, q8, type(exc).__name__, str(exc)[:300], flush=True)
    dk.DEFAULT_MIN_WAVES = MIN_WAVES0
    cache.clear()
    if not a.cpu_smoke:
        torch.cuda.empty_cache()
    RESULTS["sweep"] = rows
    if rows:
        best = min((r for r in rows if r["L"] == 8192 and r["B"] == 16 and r["splits"] is None and not r["qk_int8"]),
                   key=lambda r: r["ms"], default=None)  # the default stays fp16 Q (accuracy); QK8 is its own provider
        SUMMARY.append(f"sweep best @B=16 8k: {best}")
        for r in sorted(rows, key=lambda r: (r["B"], r["L"], r["ms"])):
            SUMMARY.append(f"  sweep {r}")
        if best is not None:  # the suite below runs the fastest correct variant
            dk.DEFAULT_TRANS, dk.DEFAULT_WARPS, dk.DEFAULT_STAGES = best["trans"], best["warps"], best["stages"]
            dk.DEFAULT_BLOCK_N, dk.DEFAULT_LAZY = best["block_n"], best["lazy"]
            dk.DEFAULT_MAXNREG = best["maxnreg"]
            dk.DEFAULT_MIN_WAVES = best["min_waves"]
            RESULTS["suite_variant"] = best


# ------------------------------------------------------------------------------------------------ Gluon kernel
def gluon_section():
    """Gluon decode kernel: GPU correctness per case against its reference (both INT8-Q modes),
    registers / spills, and timing against the Triton kernel at B=16. Runs in its own process (a
    fault cannot take the rest of the script with it); writes ``kv4_gluon.json``."""
    import lowbit.kernels.decode_kv4 as dk
    from lowbit.bench.harness import rotating_inputs
    from lowbit.bench.suites.kv4 import kv4_bytes, random_cache
    from lowbit.ops import kv4 as ops

    doc = {"env": env_info(" ".join(sys.argv)), "checks": [], "timing": [], "asm": []}
    out_json = os.path.join(a.out, "kv4_gluon.json")

    def dump():
        with open(out_json, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    cases = [  # B, Hq, Hkv, D, TQ, L, page, zp, scale dtype, crs, block_n
        (3, 32, 8, 128, 1, 1000, 64, False, torch.float8_e4m3fn, True, None),
        (3, 32, 8, 128, 1, 1000, 64, False, torch.float8_e4m3fn, False, 16),
        (2, 32, 8, 128, 4, 777, 64, False, torch.float8_e4m3fn, True, None),
        (2, 8, 1, 64, 2, 300, 16, False, torch.bfloat16, False, None),
        (4, 8, 8, 64, 3, 129, 32, True, torch.float8_e4m3fn, False, None),
        (2, 32, 8, 128, 1, 9000, 64, True, torch.float8_e4m3fn, True, None),
        (1, 32, 8, 128, 1, 20000, 64, False, torch.float8_e4m3fn, False, None),
    ]
    ok_all = True

    def check(name, body, tol, **extra):
        """Run ``body() -> rel-L2 error``; record and print PASS (error < ``tol``) / FAIL (or the exception)."""
        nonlocal ok_all
        try:
            e = body()
            ok = e < tol
        except Exception as exc:
            traceback.print_exc()
            e, ok = f"{type(exc).__name__}: {str(exc)[:300]}", False
        ok_all = ok_all and ok
        doc["checks"].append({"case": name, "err": e, "pass": ok, **{k: f() for k, f in extra.items()}})
        print(f"{'PASS' if ok else 'FAIL'} {name}: rel-L2 {e}", flush=True)
        dump()
        return ok

    def run_checks(q8, cases, **kw):
        for (B, Hq, Hkv, D, TQ, L, page, zp, sd, crs_on, bn) in cases:
            def body():
                c = random_cache(B, Hkv, D, L, page=page, zero_point=zp)
                c["k_scale"], c["v_scale"] = c["k_scale"].to(sd), c["v_scale"].to(sd)
                lens = torch.randint(TQ, L + 1, (B,), generator=torch.Generator().manual_seed(1)).to(torch.int32)
                lens[0] = L
                c["lengths"] = lens.cuda()
                q = torch.randn(B, Hq, TQ, D, device="cuda", dtype=torch.bfloat16)
                crs = (torch.rand(Hkv, D, device="cuda") + 0.5) if crs_on else None
                o = dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"],
                                         c["lengths"], k_zero=c.get("k_zero"), v_zero=c.get("v_zero"), crs_q=crs,
                                         qk_int8=q8, gluon=True, block_n=bn, **kw)
                torch.cuda.synchronize()
                return rel(o, ops.decode_kv4_ref(q, crs_q=crs, q_int8=q8, **c))

            check(f"gluon q8={q8} B={B} Hq={Hq} Hkv={Hkv} D={D} TQ={TQ} L={L} page={page} zp={zp} bn={bn} {kw or ''}",
                  body, 5e-3, splits=lambda: dk.LAST_LAUNCH.get("num_splits"))

    run_checks(2, cases)
    n0 = len(doc["checks"])
    run_checks(2, cases[:1] + cases[3:6], cstore=False)  # the epilogue's scatter stores (the default until session 31)
    cstore_ok = all(c["pass"] for c in doc["checks"][n0:])
    n0 = len(doc["checks"])
    run_checks(2, cases[:1], pdl=False)  # the combine as a plain launch (the default until round 12)
    pdl_ok = all(c["pass"] for c in doc["checks"][n0:])

    def graph_check(**kw):  # CUDA-graph capture + replay of a decode step vs the eager result (bit-equal)
        def body():
            c = random_cache(4, 8, 128, 3000)
            q = torch.randn(4, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
            f = lambda: dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"],  # noqa: E731
                                             c["page_table"], c["lengths"], max_len=3000, qk_int8=2, gluon=True, **kw)
            f()
            g, out = capture_cuda_graph(f)
            q.copy_(torch.randn_like(q))
            ref2 = f().clone()
            g.replay()
            torch.cuda.synchronize()
            return rel(out, ref2)

        return check(f"gluon cuda-graph B=4 L=3000 {kw}", body, 1e-6)

    pdl_ok = graph_check() and pdl_ok  # the default (pdl) captured in a CUDA graph
    doc["all_pass"] = ok_all
    # registers / spills of the main configurations
    for bn, st, q8 in ((32, 3, 2),):
        try:
            c = random_cache(2, 8, 128, 512)
            q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
            _, k = dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"],
                                        c["lengths"], qk_int8=q8, gluon=True, block_n=bn, num_stages=st, return_kernel=True)
            info = {"bn": bn, "stages": st, "q8": q8, "n_regs": getattr(k, "n_regs", None),
                    "n_spills": getattr(k, "n_spills", None), "shared": getattr(k.metadata, "shared", None)}
        except Exception as exc:
            info = {"bn": bn, "stages": st, "q8": q8, "error": str(exc)[:300]}
        doc["asm"].append(info)
        print(info, flush=True)
    dump()
    # timing: Triton vs Gluon at B=16 (32/8 heads, D=128), same inputs
    Hq, Hkv, D = 32, 8, 128
    short = [  # the defaults (final round: the suite needs the time)
        (16, 8192, True, 2, None, None, None, None, None), (16, 8192, True, 2, None, None, None, "nocombine", None),
        (16, 32768, True, 2, None, None, None, None, None), (16, 8192, False, 2, None, None, None, None, None),
        (16, 8192, False, 0, None, None, None, None, None),
    ]
    D0 = (True, 2, None, None, None, None, None)  # gluon, q8, block_n, stages, maxnreg, lazy, splits: the defaults
    NC = (True, 2, None, None, None, "nocombine", None)
    SC = {"cstore": False}  # the epilogue's scatter stores (default until session 31)
    configs = [  # (B, L, gluon, q8, block_n, stages, maxnreg, lazy, splits[, kwargs]); lazy "nocombine": main kernel alone
        (16, 8192, *D0), (16, 8192, *D0, {"pdl": False}), (16, 8192, *D0, SC),
        (16, 8192, *NC), (16, 8192, *NC, SC),
        (16, 8192, *D0),  # the default again (drift)
        (16, 8192, *D0, {"zp": True}), (16, 8192, *D0, {"zp": True, **SC}),
        (16, 32768, *D0), (16, 32768, *D0, {"pdl": False}), (16, 32768, *D0, {"cstore": True}),
        (16, 1024, True, 2, None, None, None, "nocombine", 16),  # fixed cost of a wave: 2 key blocks per program
        (16, 1024, True, 2, None, None, None, "nocombine", 16, SC),
        (1, 32768, *D0), (1, 32768, *D0, SC), (4, 8192, *D0), (4, 8192, *D0, SC),
        (16, 8192, True, 2, None, None, None, None, 12), (16, 8192, True, 2, None, None, None, None, 8),
        (16, 8192, True, 2, None, None, None, "nocombine", 16, {"_probe": True}),  # one key block per program: the fixed part
        (16, 8192, True, 2, None, None, None, "nocombine", 16, {"_probe": True, **SC}),
    ]
    if SHORT_SWEEP:
        configs = short
    cache = {}
    main_ok = all(c["pass"] for c in doc["checks"][:2])  # the B=16 timing shape's kernels (TQ=1, bn 32 / 16)
    for cfg in configs:
        (B, L, gl_, q8, bn, st, mr, lazy, nsp), xkw = cfg[:9], dict(cfg[9] if len(cfg) > 9 else {})
        zp = xkw.pop("zp", False)  # a kv4-zp cache
        contig = xkw.pop("contig", False)  # pages of a sequence consecutive in the pool (identity page order)
        if gl_ and not main_ok:
            continue
        if "pdl" in xkw and not pdl_ok or "cstore" in xkw and not cstore_ok:
            continue
        try:
            if (B, L, zp) not in cache:
                cache.clear()
                torch.cuda.empty_cache()
                cache[(B, L, zp)] = rotating_inputs(lambda: (torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16),
                                                             random_cache(B, Hkv, D, L, zero_point=zp)))
            sets = cache[(B, L, zp)]
            if contig:
                sets = [(q_, dict(c_, page_table=torch.arange(c_["page_table"].numel(), device="cuda",
                                                              dtype=torch.int32).view_as(c_["page_table"])))
                        for q_, c_ in sets]
            skip = lazy == "nocombine"  # the main kernel alone (its partials are not combined): the combine's cost
            lz = None if skip else lazy
            fn = lambda q, c: dk.decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"],  # noqa: E731
                                                  c["page_table"], c["lengths"], max_len=L, qk_int8=q8, gluon=gl_,
                                                  block_n=bn, num_stages=st, maxnreg=mr, lazy=lz, num_splits=nsp,
                                                  _skip_combine=skip, k_zero=c.get("k_zero"),
                                                  v_zero=c.get("v_zero"), **xkw)
            fn(*sets[0])
            t = _time(fn, sets)
            tb = kv4_bytes(B, Hq, Hkv, D, L, 1, zp) / (t["median_ms"] * 1e-3) / 1e12
            r = {"B": B, "L": L, "gluon": gl_, "q8": q8, "block_n": bn, "stages": st, "maxnreg": mr, "lazy": lazy,
                 "splits": dk.LAST_LAUNCH.get("num_splits"), **xkw, "zp": zp, "contig": contig,
                 "ms": t["median_ms"],
                 "TBps": tb}
        except Exception as exc:
            r = {"B": B, "L": L, "gluon": gl_, "q8": q8, "block_n": bn, "stages": st, "error": str(exc)[:300]}
        doc["timing"].append(r)
        print(r, flush=True)
        dump()
    cache.clear()
    # the launch floor: an (almost) empty kernel on the decode grid (B*Hkv=128 x 16 splits, one warp), alone and
    # followed by a second small launch (the combine's place), in the same timing loop
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _touch(X):
            tl.store(X + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), 1.0)

        xbuf = torch.empty(128 * 16, device="cuda")
        one = lambda x: _touch[(128, 16)](x, num_warps=1)  # noqa: E731
        two = lambda x: (_touch[(128, 16)](x, num_warps=1), _touch[(128, 4)](x, num_warps=4))  # noqa: E731
        for name, f in (("empty grid 128x16", one), ("empty grid + second launch", two)):
            f(xbuf)
            t = _time(f, [(xbuf,)])
            doc["timing"].append({"probe": name, "ms": t["median_ms"]})
            print(doc["timing"][-1], flush=True)
    except Exception as exc:
        print("probe failed", type(exc).__name__, str(exc)[:300], flush=True)
    doc["all_pass"] = ok_all
    dump()


def run_gluon_subprocess():
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--out", a.out, "--gluon-only"]
    try:
        subprocess.run(cmd, timeout=float(os.environ.get("KV4_GLUON_TIMEOUT", 50)), check=False)
    except subprocess.TimeoutExpired:
        print("gluon section: timeout", flush=True)
    try:
        doc = json.load(open(os.path.join(a.out, "kv4_gluon.json")))
    except Exception as exc:
        SUMMARY.append(f"gluon: no result ({exc})")
        return
    RESULTS["gluon"] = doc
    npass = sum(c["pass"] for c in doc["checks"])
    SUMMARY.append(f"gluon checks: {npass}/{len(doc['checks'])} PASS")
    for c in doc["checks"]:
        if not c["pass"]:
            SUMMARY.append(f"  FAIL {c['case']}: {c['err']}")
    SUMMARY.append("gluon asm: " + json.dumps(doc["asm"]))
    for r in doc["timing"]:
        SUMMARY.append(f"  gluon-sweep {r}")


def suite():
    from lowbit.bench import runner

    runner.run_suites(["kv4"], a.out, quick=a.quick, ceilings=None)
    try:
        doc = json.load(open(os.path.join(a.out, "kv4.json")))
        cell = {}
        for r in doc["rows"]:
            if "median_ms" in r:
                cell[(tuple(sorted(r["case"].items())), r["provider"])] = r
        for r in doc["rows"]:
            if r["provider"].startswith("lowbit-kv4") and "median_ms" in r and "L" in r["case"]:
                base_case = dict(r["case"], tq=1)
                base = cell.get((tuple(sorted(base_case.items())), "sdpa-flash-bf16"))
                sp = f" {base['median_ms'] / r['median_ms']:.2f}x sdpa-flash" if base else ""
                SUMMARY.append(f"{r['provider']} {r['case']}: {r['median_ms']:.4f} ms {r.get('TBps', 0):.2f} TB/s{sp}")
    except Exception as exc:
        SUMMARY.append(f"suite summary failed: {exc}")


# ------------------------------------------------------------------------------------- (4) accuracy
def accuracy():
    from lowbit.bench.suites.kv4 import accuracy_tables

    budget = float(os.environ.get("KV4_BUDGET_S", 100))
    doc = accuracy_tables(device=DEV, quick=a.quick or a.cpu_smoke, log=stamp, deadline=T0 + budget - 8)
    RESULTS["accuracy"] = doc
    with open(os.path.join(a.out, "kv4_accuracy.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(a.out, "kv4_accuracy.md"), "w") as f:
        f.write(doc.get("markdown", ""))
    SUMMARY.append("accuracy:\n" + doc.get("markdown", ""))


if a.gluon_only:
    gluon_section()
    sys.exit(0)
section("check", checks)
if not a.cpu_smoke:
    section("gluon", run_gluon_subprocess)
    section("asm", asm)
section("sweep", sweep)
if not a.cpu_smoke:
    section("suite", suite)
if a.accuracy:
    section("acc", accuracy)

with open(os.path.join(a.out, "kv4_device.json"), "w") as f:
    json.dump(RESULTS, f, indent=1, default=str)
stamp("== summary")
print("\n".join(SUMMARY))
