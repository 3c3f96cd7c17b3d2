"""Session-17 probe: the Gluon FP8 MLA decode for few rows per sequence (``lowbit.kernels.mla_decode_gluon``).

(c) correctness vs the float64 reference and vs the reference emulating the per-block FP8 P (MTP, ragged lengths,
one split and several); (t) times at H=16 (memory-bound) against the Triton FP8 FEW tile and the bf16 FEW tile, same
caches, CUDA events (``lowbit.bench.harness.time_cuda``), TB/s on the fewest bytes (644 / 1152 B per token).

    python3 benchmarks/device/s17_mla_few.py --out DIR [--parts ct]
Env: S17_VARIANTS (comma list of gluon variants: st<stages>, pv16, pv8t, bn<block_n>, r<maxnreg>, c<ctas_per_sm>;
'+' joins), S17_CHECK_KW (comma list of launcher keyword sets for the checks, 'stages=1+maxnreg=168'; '' = defaults), S17_CASES ("B:L,B:L").
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from lowbit.bench.harness import env_info, time_cuda  # noqa: E402

out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
parts = sys.argv[sys.argv.index("--parts") + 1] if "--parts" in sys.argv else "ct"
os.makedirs(out_dir, exist_ok=True)
DOC = {"env": env_info("python3 benchmarks/device/s17_mla_few.py " + " ".join(sys.argv[1:])), "checks": [], "times": []}
T0 = time.time()


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def checks():
    from lowbit.kernels.mla_decode_gluon import mla_decode_few_gluon
    from lowbit.kernels.mla_quant import latent_quant_triton
    from lowbit.bench.suites.mla import make_caches
    from lowbit.ops.mla import mla_decode_ref

    cases = [  # B, H, Sq, lens, splits, pv16
        (3, 16, 1, [5000, 777, 64], None, False),
        (3, 16, 1, [5000, 777, 64], 1, False),
        (2, 8, 2, [3001, 129], 3, False),
        (2, 4, 4, [1000, 37], None, False),
        (2, 16, 1, [4096, 33], None, True),
        (1, 10, 1, [2049], 2, False),
        (2, 32, 1, [3001, 129], None, False),  # 2 row blocks (launcher only; the dispatch takes <= 16 rows)
        (2, 16, 2, [1000, 37], 2, False),
    ]
    kws = [dict(kw.split("=") for kw in v.split("+")) if v else {} for v in os.environ.get("S17_CHECK_KW", "").split(",")]
    for (B, H, Sq, lens, splits, pv16), kw in [(c, k) for c in cases for k in kws]:
        kw = {k: int(v) for k, v in kw.items()}
        name = f"B{B} H{H} Sq{Sq} lens{lens} splits{splits} pv16={pv16} {kw}"
        try:
            c = make_caches(B, max(lens), fp8=True, bf16=False, seed=1)
            cache = c["fp8"]
            sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
            q = torch.randn(B, Sq, H, 576, device="cuda", dtype=torch.bfloat16)
            qc, qs, qr = latent_quant_triton(q.reshape(-1, 576), 512)
            R = Sq * H
            o, plan = mla_decode_few_gluon(qc.view(B, R, 512), qr.view(B, R, 64), qs.view(B, R),
                                           *(x.flatten(0, 1) for x in cache), c["page_table"], sl, num_heads=H,
                                           sm_scale=576 ** -0.5, max_seq_len=max(lens), page_size=64, num_splits=splits,
                                           pv16=pv16, return_plan=True, **kw)
            torch.cuda.synchronize()
            emu = mla_decode_ref(q, cache, c["page_table"], sl, p_block=(plan["block_n"], plan["chunk"], 0.0,
                                 torch.float16 if pv16 else torch.float8_e4m3fn, "row"))
            ref = mla_decode_ref(q, cache, c["page_table"], sl)
            e_emu, e_ref = rel(o.view(B, Sq, H, 512), emu), rel(o.view(B, Sq, H, 512), ref)
            ok = e_emu < 4e-3 and e_ref < 2e-2 and bool(torch.isfinite(o).all())
            row = dict(name=name, rel_emu=e_emu, rel_f64=e_ref, splits=plan["splits"], ok=ok)
        except Exception as exc:  # keep going: report
            import traceback
            row = dict(name=name, error=f"{type(exc).__name__}: {exc}"[:2000], tb=traceback.format_exc()[-3000:], ok=False)
        print(("PASS " if row["ok"] else "FAIL ") + json.dumps({k: v for k, v in row.items() if k != "tb"}), flush=True)
        if "tb" in row:
            print(row["tb"], flush=True)
        DOC["checks"].append(row)


def times():
    from lowbit.bench.suites.mla import make_caches
    from lowbit.kernels.mla_decode import mla_decode_triton
    from lowbit.kernels.mla_decode_gluon import mla_decode_few_gluon
    from lowbit.kernels.mla_quant import latent_quant_triton

    H = int(os.environ.get("S17_H", "16"))
    cases = [tuple(int(v) for v in c.split(":")) for c in os.environ.get("S17_CASES", "128:16384,32:65536,64:4096").split(",")]
    variants = os.environ.get("S17_VARIANTS", "st3,st2").split(",")
    for B, L in cases:
        if time.time() - T0 > float(os.environ.get("S17_UNTIL", "400")):
            break
        c = make_caches(B, L, fp8=True, bf16=True)
        q = torch.randn(B, H, 576, device="cuda", dtype=torch.bfloat16)
        qc, qs, qr = latent_quant_triton(q.view(-1, 576), 512)
        fp8_args = (qc.view(B, H, 512), qr.view(B, H, 64), qs.view(B, H), *(x.flatten(0, 1) for x in c["fp8"]),
                    c["page_table"], c["seq_lens"])
        kv = c["bf16"]
        bf_args = (q[..., :512], q[..., 512:], None, kv[0].flatten(0, 1), kv[1].flatten(0, 1), None, c["page_table"],
                   c["seq_lens"])
        common = dict(num_heads=H, sm_scale=576 ** -0.5, max_seq_len=L, page_size=64)
        fns = {"bf16 FEW (Triton)": lambda: mla_decode_triton(*bf_args, fp8=False, **common),
               "fp8 FEW (Triton, tokens-as-M)": lambda: mla_decode_triton(*fp8_args, fp8=True, gluon=False, **common)}
        for v in variants:
            kw = dict(stages=3)
            for tok in v.split("+"):
                if tok.startswith("st"):
                    kw["stages"] = int(tok[2:])
                elif tok in ("pv16", "pv8t"):
                    kw[tok] = True
                elif tok.startswith("r") and tok[1:].isdigit():
                    kw["maxnreg"] = int(tok[1:])
                elif tok.startswith("c") and tok[1:].isdigit():
                    kw["ctas_per_sm"] = int(tok[1:])
                elif tok.startswith("bn"):
                    kw["block_n"] = int(tok[2:])
            fns[f"fp8 gluon {v}"] = (lambda kw=kw: mla_decode_few_gluon(*fp8_args, **common, **kw))
        ref = None
        for name, fn in fns.items():
            row = dict(B=B, H=H, L=L, name=name)
            try:
                o = fn()
                torch.cuda.synchronize()
                if "fp8" in name:
                    ref = o if ref is None else ref
                    row["rel_vs_first_fp8"] = rel(o.float(), ref.float())
                t = time_cuda(fn, [()], warmup=3, reps=30)
                nbytes = B * L * (1152 if name.startswith("bf16") else 644)
                row.update(ms=t["median_ms"], min_ms=t["min_ms"], TBps=nbytes / t["median_ms"] / 1e9)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            print(json.dumps(row), flush=True)
            DOC["times"].append(row)
        torch.cuda.empty_cache()


def ncu_launch():
    """Part n: the Gluon kernel alone 3 times at B=128 H=16 L=16k (for ncu --launch-skip 2 --launch-count 1)."""
    from lowbit.bench.suites.mla import make_caches
    from lowbit.kernels.mla_decode_gluon import mla_decode_few_gluon
    from lowbit.kernels.mla_quant import latent_quant_triton

    B, H, L = 128, 16, 16384
    c = make_caches(B, L, fp8=True, bf16=False)
    q = torch.randn(B, H, 576, device="cuda", dtype=torch.bfloat16)
    qc, qs, qr = latent_quant_triton(q.view(-1, 576), 512)
    for _ in range(3):
        mla_decode_few_gluon(qc.view(B, H, 512), qr.view(B, H, 64), qs.view(B, H), *(x.flatten(0, 1) for x in c["fp8"]),
                             c["page_table"], c["seq_lens"], num_heads=H, sm_scale=576 ** -0.5, max_seq_len=L,
                             page_size=64)
    torch.cuda.synchronize()


if "n" in parts:
    ncu_launch()
if "c" in parts:
    checks()
if "t" in parts:
    times()
with open(os.path.join(out_dir, "s17_mla_few.json"), "w") as f:
    json.dump(DOC, f, indent=1, default=str)
print(f"done in {time.time() - T0:.0f} s")
