"""Device script of area `models` (issue 7): end-to-end checks, profile, model throughput.

    python3 benchmarks/device/model.py --out DIR [--cpu-smoke]

Order (the round gives <= 90 s wall; what matters most runs first):
(1) correctness on the GPU: the fast runner (CUDA graphs) against transformers' greedy
    ``generate``; the fireq recipe (and fireq with ``lm_head=True``) on a tiny random Llama:
    runner vs HF tokens, save -> load -> same greedy tokens;
    session 5: the fused RoPE kernel (``lowbit.kernels.rope``) bit-equal to the eager RoPE, and the
    runner's tokens with and without it (bf16 dense cache, fireq KV4 cache);
(2) no kernels of this area to dump (a note);
(3) ``lowbit.bench.model`` on a Llama-3-8B-shaped model trimmed to 2 decoder layers and scaled to
    32: first a per-section / per-kernel-class profile of one decode step and one prefill (``PROFILE``),
    with every kernel of the CUDA-graph decode step and the gap before it (``profile_<name>.txt``), then
    the throughput table of ``RECIPES`` (options such as ``+rope`` / ``+pdl`` beside the defaults,
    ``lowbit.bench.model.provider_spec``), under a time budget; then a decode_kv4 split sweep at B=1;
(4) optional (env ``LOWBIT_MODEL_PPL=1``; on in R4/R5, off since): the FP32 perplexity gap of the embedded
    model (GPU 13.23 vs CPU 13.443): token hash, parameter checksum, per-window losses with SDPA /
    eager attention and TF32 on / off, compared with the CPU values in ``CPU_REF``;
(5) optional (env ``LOWBIT_MODEL_ABLATION=1``): the FireQ Table 3 ablation on the embedded model.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import traceback

T0 = time.time()
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run of part (1) only")
ap.add_argument("--budget", type=float, default=float(os.environ.get("LOWBIT_MODEL_BUDGET", 140.0)))  # MODEL_LIMIT 150 s (session 3)
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
if a.cpu_smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lowbit.bench.harness import graph_us  # noqa: E402

DEV = "cpu" if a.cpu_smoke or not torch.cuda.is_available() else "cuda"
SUMMARY = []
PPL = os.environ.get("LOWBIT_MODEL_PPL", "0") == "1"  # answered in R5 (ppl_gap.json): off by default since R6
ABLATION = os.environ.get("LOWBIT_MODEL_ABLATION", "0") == "1"
AQ_STUDY = os.environ.get("LOWBIT_MODEL_AQ", "0") == "1"  # answered in R11 (act_quant_study.json): off since R12
# this round's providers (session 5 A/B plan: the fused RoPE kernel and PDL beside the defaults, same run)
# R14 (final): the committed defaults (RoPE kernel, q rotated in the KV4 append, PDL at M=1) for every
# recipe, and the pre-session defaults beside them (``+norope+noropeq+nopdl``; ``bf16+norope``)
RECIPES = ("fireq", "fireq+head", "qserve", "qserve+head", "flute-nf4", "flute-nf4+head", "flute-nf3",
           "int8-attention", "flute-nf4+nofk+dsdpa", "bf16+dk+fk")  # session 8: the committed defaults + the A/B rows
# session 8: env LOWBIT_MODEL_RECIPES (comma-separated providers) picks a round's rows without an edit
if os.environ.get("LOWBIT_MODEL_RECIPES"):
    RECIPES = tuple(r for r in os.environ["LOWBIT_MODEL_RECIPES"].split(",") if r)
PROFILE = ("bf16", "fireq", "fireq+head", "flute-nf4")
if os.environ.get("LOWBIT_MODEL_PROFILE") is not None:
    PROFILE = tuple(r for r in os.environ["LOWBIT_MODEL_PROFILE"].split(",") if r)
DECODE_CTX = [1024, 8192]
# measured on the CPU (FP32, torch 2.11, 1 thread) with the same code: lowbit eval's 8192 tokens
CPU_REF = {"python": "3.11.7", "text_chars": 465126, "text_sha": "71f2ff5d99bdc1f9", "n_ids": 113108,
           "window_id_shas": ['912932461926', '271afb9141ee', '70687c5d107f', '478bb46dfe58', '4514e1f3b199',
                              'ac77d9b82b92', '18391a7ecb63', 'e119576d9156'],
           "ids_sha": "c189faec103a9e9a", "param_abs_sum": 18618625.800991118,
           "window_losses": [2.5449037551879883, 2.6420633792877197, 2.82627010345459, 2.2773489952087402,
                             2.6337947845458984, 2.579805612564087, 2.569411277770996, 2.7140743732452393],
           "perplexity": 13.443}


def left() -> float:
    return a.budget - (time.time() - T0)


def tiny(head_dim=64, hidden=256, dtype=torch.float32, seed=0):
    if a.cpu_smoke:  # the Triton interpreter is slow: smallest legal shapes
        head_dim, hidden = 32, 64
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=hidden // head_dim, num_key_value_heads=max(1, hidden // head_dim // 2),
                      head_dim=head_dim, max_position_embeddings=512, attn_implementation="sdpa")
    with torch.device(DEV):
        m = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    m.generation_config.eos_token_id = None
    return m


def hf_greedy(m, p, n):
    with torch.no_grad():
        return m.generate(p.view(1, -1).to(DEV), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, p.numel():].cpu()


def check(name, fn):
    t = time.time()
    try:
        ok, detail = fn()
        status = "PASS" if ok else "FAIL"
    except NotImplementedError as exc:
        status, detail = "SKIP", str(exc)
    except Exception as exc:
        traceback.print_exc()
        status, detail = "ERROR", f"{type(exc).__name__}: {str(exc)[:300]}"
    line = f"{status:5s} {name}: {detail} ({time.time() - t:.1f}s)"
    print(line, flush=True)
    SUMMARY.append(line)


def runner_vs_hf():
    from lowbit.models.generate import generate

    m = tiny(dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (n,), generator=g) for n in (5, 17, 11)]
    got = generate(m, prompts, 12)
    ref = [hf_greedy(m, p, 12) for p in prompts]
    same = sum(int(torch.equal(x, y)) for x, y in zip(got, ref))
    return same == len(prompts), f"{same}/{len(prompts)} requests identical (fp32, graphs={DEV == 'cuda'})"


def recipe_check(recipe, **opts):
    def fn():
        import lowbit
        from lowbit.models.generate import generate

        m = tiny(dtype=torch.bfloat16 if DEV == "cuda" else torch.float32)
        g = torch.Generator().manual_seed(1)
        calib = [torch.randint(0, 256, (1, 64), generator=g) for _ in range(2)]
        lowbit.quantize_model(m, recipe, calibration=calib, progress=False, **opts)
        prompts = [torch.randint(1, 256, (n,), generator=g) for n in (6, 13)]
        got = generate(m, prompts, 8, prefill_from_cache=True)
        ref = [hf_greedy(m, p, 8) for p in prompts]
        agree = sum(int((x == y).sum()) for x, y in zip(got, ref)) / sum(x.numel() for x in ref)
        with tempfile.TemporaryDirectory() as d:
            lowbit.save_quantized(m, d)
            m2 = lowbit.load_quantized(d, device=DEV)
            ref2 = [hf_greedy(m2, p, 8) for p in prompts]
        same = all(torch.equal(x, y) for x, y in zip(ref, ref2))
        return same, (f"save->load same greedy tokens: {same}; runner (fused, prefill from cache) vs HF generate "
                      f"token agreement {agree:.2f}")
    return fn


def ppl_gap():
    """Why GPU FP32 perplexity (13.23) differs from the CPU's (13.443): same tokens? same weights?
    per-window losses under SDPA / eager attention, TF32 off / on."""
    from lowbit.eval.corpus import load_text, tokenize
    from lowbit.models.loading import load_model

    # R4 found different token ids (119513 vs 113108, same weights): the corpus is CPython's
    # pydoc_data.topics, which changes between Python versions. Record the text itself first.
    text = load_text()
    res = {"python": sys.version.split()[0], "text_chars": len(text),
           "text_sha": hashlib.sha256(text.encode()).hexdigest()[:16]}
    print(json.dumps(res), flush=True)
    t = time.time()
    m, tok = load_model(None, device="cuda")
    ids = tokenize(tok, text)
    res.update({"load_s": time.time() - t, "n_ids": int(ids.numel()),
                "ids_sha": hashlib.sha256(ids[:8192].cpu().numpy().tobytes()).hexdigest()[:16],
                "window_id_shas": [hashlib.sha256(ids[s_:s_ + 1024].cpu().numpy().tobytes()).hexdigest()[:12]
                                   for s_ in range(0, 8192, 1024)],
                "param_abs_sum": float(sum(p.detach().double().abs().sum() for p in m.parameters())),
                "attn_impl": m.config._attn_implementation,
                "tf32_default": torch.backends.cuda.matmul.allow_tf32,
                "matmul_precision": torch.get_float32_matmul_precision()})
    print(json.dumps(res), flush=True)

    def losses(n=8):
        out = []
        with torch.no_grad():
            for s in range(0, 1024 * n, 1024):
                x = ids[s:s + 1024].unsqueeze(0).cuda()
                out.append(m(input_ids=x, labels=x, use_cache=False).loss.float().item())
        return out

    variants = [("sdpa, tf32 off", "sdpa", False), ("sdpa, tf32 on", "sdpa", True),
                ("eager attn, tf32 off", "eager", False)]
    for label, impl, tf32 in variants:
        if left() < 4:
            res[label] = "skipped: time"
            continue
        m.config._attn_implementation = impl
        torch.backends.cuda.matmul.allow_tf32 = tf32
        ls = losses()
        res[label] = {"window_losses": ls, "perplexity": math.exp(sum(ls) / len(ls))}
        print(label, res[label], flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    res["cpu_ref"] = CPU_REF
    with open(os.path.join(a.out, "ppl_gap.json"), "w") as f:
        json.dump(res, f, indent=1)
    same_ids = res["ids_sha"] == CPU_REF["ids_sha"]
    same_w = [x == y for x, y in zip(res["window_id_shas"], CPU_REF["window_id_shas"])]
    dw = abs(res["param_abs_sum"] - CPU_REF["param_abs_sum"]) / CPU_REF["param_abs_sum"]
    v = res.get("sdpa, tf32 off")
    p = v["perplexity"] if isinstance(v, dict) else float("nan")
    wl = [f"{x:.4f}/{y:.4f}" for x, y, ok in zip(v["window_losses"] if isinstance(v, dict) else [],
                                                  CPU_REF["window_losses"], same_w) if ok]
    return True, (f"python {res['python']} vs CPU {CPU_REF['python']}; text {res['text_chars']} vs "
                  f"{CPU_REF['text_chars']} chars; tokens same as CPU: {same_ids}, windows with equal ids: "
                  f"{sum(same_w)}/8 (GPU/CPU loss there: {wl}); |param sum| rel diff {dw:.2e}; "
                  f"GPU ppl (8 windows) {p:.3f} vs CPU {CPU_REF['perplexity']}")


def act_quant_study():
    """(1b) act_quant: FAST path bit-exact vs the reference on the GPU; M=1 latency in a CUDA graph
    per num_warps (the decode step's three shapes), large-M bandwidth of K=14336 per num_warps."""
    from lowbit.formats.common import FP8_E4M3, quantize_per_token
    from lowbit.kernels import act_quant as aq

    res = {"checks": [], "m1": [], "large": []}
    torch.manual_seed(0)
    bad = 0
    for (m, k) in ((1, 4096), (1, 14336), (7, 4100), (2, 20000), (64, 4096)):
        for dt in (FP8_E4M3, torch.int8):
            x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 8).to(torch.bfloat16)
            x[0, 3], x[-1, 5] = 1e-30, -1e-30
            u = torch.randn_like(x)
            w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            for fuse, kw, ref in ((None, {}, lambda: quantize_per_token(x.cpu(), dt)),  # CPU: IEEE division
                                  ("silu_mul", {"up": u}, lambda: aq.per_token_quant_triton(x, dt, fuse="silu_mul", up=u, fast=False)),
                                  ("rmsnorm", {"weight": w, "eps": 1e-5},
                                   lambda: aq.per_token_quant_triton(x, dt, fuse="rmsnorm", weight=w, eps=1e-5, fast=False))):
                q, sc = aq.per_token_quant_triton(x, dt, fuse=fuse, fast=True, **kw)
                qr, sr = ref()
                q, sc, qr, sr = q.cpu(), sc.cpu(), qr.cpu(), sr.cpu()
                nq = int((q.view(torch.int8) != qr.view(torch.int8)).sum())
                nz = int(((q.view(torch.int8) != qr.view(torch.int8)) & (q.float() == 0) & (qr.float() == 0)).sum())
                ns = int((sc != sr).sum())
                ok = nq == nz and ns == 0
                bad += not ok
                res["checks"].append({"m": m, "k": k, "dtype": str(dt), "fuse": fuse, "code_diff": nq,
                                      "signed_zero_diff": nz, "scale_diff": ns, "pass": ok})
    print(f"act_quant FAST vs reference: {len(res['checks']) - bad}/{len(res['checks'])} bit-exact "
          f"(+-0 differences allowed)", flush=True)
    SUMMARY.append(f"{'PASS' if not bad else 'FAIL'} act_quant FAST path bit-exact: {len(res['checks']) - bad}/"
                   f"{len(res['checks'])} cases")
    # M = 1 in a CUDA graph: the decode step's shapes
    x4 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w4 = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    gu = torch.randn(1, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    g, u = gu.split(14336, dim=-1)
    shapes = {"rmsnorm K=4096": lambda **o: aq.per_token_quant_triton(x4, FP8_E4M3, fuse="rmsnorm", weight=w4, eps=1e-5, **o),
              "plain K=4096": lambda **o: aq.per_token_quant_triton(x4, FP8_E4M3, **o),
              "silu_mul K=14336": lambda **o: aq.per_token_quant_triton(g, FP8_E4M3, fuse="silu_mul", up=u, **o)}
    for name, f in shapes.items():
        row = {"case": name, "old (div.rn, default warps)": graph_us(lambda: f(fast=False))}
        for nw in (1, 2, 4, 8, 16):
            if left() < 100:
                break
            row[f"fast w{nw}"] = graph_us(lambda: f(fast=True, num_warps=nw))
        res["m1"].append(row)
        print("act_quant M=1 (us/launch in a graph):", json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                                               for k, v in row.items()}), flush=True)
    # large M, K = 14336 (down's input at prefill): GB/s per num_warps
    M, K = 4096, 14336
    xg = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16)
    gg, uu = xg.split(K, dim=-1)
    xp = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    for name, f, nbytes in (("plain", lambda **o: aq.per_token_quant_triton(xp, FP8_E4M3, **o), M * K * 3),
                            ("silu_mul", lambda **o: aq.per_token_quant_triton(gg, FP8_E4M3, fuse="silu_mul", up=uu, **o), M * K * 5)):
        row = {"case": f"{name} M={M} K={K}"}
        for label, o in (("old", {"fast": False}), ("fast w8", {"num_warps": 8}), ("fast w16", {"num_warps": 16}),
                         ("fast w32", {"num_warps": 32}), ("fast w4", {"num_warps": 4})):
            if left() < 95:
                break
            t = graph_us(lambda: f(**o), n=3, reps=7)
            row[label] = {"us": round(t, 1), "TB/s": round(nbytes / t / 1e6, 2)}
        res["large"].append(row)
        print("act_quant large M:", json.dumps(row), flush=True)
    with open(os.path.join(a.out, "act_quant_study.json"), "w") as f:
        json.dump(res, f, indent=1)
    return True, "see act_quant_study.json"


def rope_kernel_check():
    """lowbit.kernels.rope vs the runner's eager RoPE: Llama-3-8B decode/prefill shapes, bf16 and fp16,
    q+k slices of a fused projection output; bit-equal required."""
    from lowbit.kernels.rope import rope_triton
    from lowbit.models.generate import _rope

    bad, n = [], 0
    g = torch.Generator(device=DEV).manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        for (B, S, H, D) in ((1, 1, 40, 128), (64, 1, 32, 128), (2, 300, 40, 128), (3, 5, 7, 64)):
            if a.cpu_smoke and B * S > 8:
                continue
            y = (torch.randn(B, S, H * D + 1024, generator=g, device=DEV) * 3).to(dt)
            x = y[..., : H * D].view(B, S, H, D)
            ang = torch.rand(B, S, D // 2, generator=g, device=DEV) * 1000
            cos = torch.cat((ang.cos(), ang.cos()), -1).to(dt)
            sin = torch.cat((ang.sin(), ang.sin()), -1).to(dt)
            got = rope_triton(x, cos, sin)
            ref = _rope(x.transpose(1, 2), cos, sin, False).transpose(1, 2)
            n += 1
            diff = got.view(torch.int16) != ref.view(torch.int16)
            if diff.any():
                bad.append(f"{dt} {(B, S, H, D)}: {int(diff.sum())}/{diff.numel()} elements differ, max "
                           f"{(got.float() - ref.float()).abs().max().item():.3g}")
                if len(bad) <= 2:  # which formula does each side follow? (R12: 1-ulp differences)
                    xs = x.float()
                    h = D // 2
                    rot = torch.cat((-xs[..., h:], xs[..., :h]), -1)
                    c, s_ = cos.float()[:, :, None, :], sin.float()[:, :, None, :]
                    p1, p2 = (xs * c).to(dt).float(), (rot * s_).to(dt).float()
                    f_sep = (p1 + p2).to(dt)  # each op rounded (the eager ops)
                    f_fma = (xs.double() * c.double() + p2.double()).float().to(dt)  # x*c contracted into the add
                    f_one = (xs.double() * c.double() + rot.double() * s_.double()).float().to(dt)  # one rounding
                    for i in diff.flatten().nonzero()[:3, 0].tolist():
                        pick = lambda t: t.flatten()[i].item()  # noqa: E731
                        print(f"  rope diff @{i}: x {pick(xs):.6g} rot {pick(rot):.6g} cos {pick(c.expand_as(xs)):.6g} "
                              f"sin {pick(s_.expand_as(xs)):.6g} | kernel {pick(got.float()):.6g} eager {pick(ref.float()):.6g}"
                              f" | sep {pick(f_sep.float()):.6g} fma {pick(f_fma.float()):.6g} "
                              f"one {pick(f_one.float()):.6g}", flush=True)
    return not bad, f"{n - len(bad)}/{n} cases bit-equal" + (f"; {bad}" if bad else "")


def rope_runner_check():
    import lowbit
    from lowbit.models.generate import Generator

    dt = torch.bfloat16
    out = []
    ok = True
    for recipe in (None, "fireq", "flute-nf4", "qserve"):  # session 9: flute-nf4 (float append, LUT PDL), qserve (INT8 PDL)
        if recipe is not None and DEV != "cuda":
            continue  # the interpreter would take minutes per generate
        m = tiny(dtype=dt)
        if recipe:
            g = torch.Generator().manual_seed(1)
            calib = [torch.randint(0, 256, (1, 64), generator=g) for _ in range(2)]
            lowbit.quantize_model(m, recipe, calibration=calib, progress=False)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(1, 256, (n,), generator=g).to(DEV) for n in (6, 13, 9)]
        # reference: the eager RoPE ops, no PDL, residual adds as torch ops (the pre-session runner)
        ref = Generator(m, max_batch=3, max_seq=40, rope_kernel=False, rope_q_append=False,
                        pdl_max_m=0, fused_add=False).generate(prompts, 10)
        variants = [("defaults", {})]
        if recipe == "flute-nf4":
            variants += [("rope kernel + index writes", {"rope_q_append": False})]
        elif recipe and DEV == "cuda":
            variants += [("rope kernel only", {"rope_q_append": False, "pdl_max_m": 0}),
                         ("ropeq, no pdl", {"pdl_max_m": 0})]
        for label, kw in variants:
            got = Generator(m, max_batch=3, max_seq=40, **kw).generate(prompts, 10)
            same = all(torch.equal(x, y) for x, y in zip(ref, got))
            ok &= same
            out.append(f"{recipe or 'bf16'} {label}: {'same' if same else 'DIFFERENT'} tokens")
        if recipe and DEV == "cuda":  # B=1: the PDL path of the default runner (M = 1)
            r1 = Generator(m, max_batch=1, max_seq=40, rope_kernel=False, rope_q_append=False,
                           pdl_max_m=0, fused_add=False).generate(prompts[:1], 10)
            g1 = Generator(m, max_batch=1, max_seq=40).generate(prompts[:1], 10)
            same = torch.equal(r1[0], g1[0])
            ok &= same
            out.append(f"{recipe} B=1 defaults (PDL): {'same' if same else 'DIFFERENT'} tokens")
    return ok, "; ".join(out)


def kv4_split_sweep():
    """decode_kv4 of the runner's B=1 step (Hq 32, Hkv 8, D 128, 1025 cached tokens, page 64): time per
    call inside a CUDA graph for the automatic split count and fixed ones (for the kv4 area)."""
    from lowbit.formats.kv4 import quantize_kv4
    from lowbit.kernels import decode_kv4 as dk
    from lowbit.ops.kv4 import decode_kv4

    B, Hq, Hkv, D, P = 1, 32, 8, 128, 64
    res = {}
    for L in (1025, 8193):
        pages = -(-L // P)
        kc, ks, _ = quantize_kv4(torch.randn(pages, Hkv, P, D, device="cuda"), scale_dtype=torch.float8_e4m3fn)
        vc, vs, _ = quantize_kv4(torch.randn(pages, Hkv, P, D, device="cuda"), scale_dtype=torch.float8_e4m3fn)
        pt = torch.arange(pages, device="cuda", dtype=torch.int32).view(1, pages)
        lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        ref = decode_kv4(q, kc, ks, vc, vs, pt, lens, max_len=L)
        r = res[f"L={L}"] = {"auto_splits": dk.LAST_LAUNCH.get("num_splits")}
        for ns in (0, 4, 8, 16, 32, 64) if L > 2000 else (0, 1, 2, 4, 8, 16, 32):
            if left() < 6:
                break
            f = lambda: decode_kv4(q, kc, ks, vc, vs, pt, lens, max_len=L, num_splits=ns)  # noqa: E731
            o = f()
            r[f"splits={ns or 'auto'}"] = {"us": round(graph_us(f), 2),
                                            "max_diff_vs_auto": float((o.float() - ref.float()).abs().max())}
    with open(os.path.join(a.out, "kv4_split_sweep.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    return True, json.dumps(res)


def main():
    # (1) correctness
    check("runner (CUDA graphs) == HF generate, batched lengths 5/17/11", runner_vs_hf)
    check("RoPE kernel (lowbit.kernels.rope) == eager RoPE, bit for bit", rope_kernel_check)
    check("runner defaults (RoPE kernel, q RoPE in the KV4 / float append, PDL at M=1, fused residual adds) "
          "== eager RoPE / no PDL / torch adds tokens",
          rope_runner_check)
    if a.cpu_smoke:  # the interpreter would take minutes per generate: references from here on
        os.environ["TRITON_INTERPRET"] = "0"
    check("recipe fireq on tiny Llama (hd 64)", recipe_check("fireq"))
    check("recipe fireq lm_head=True on tiny Llama (hd 64)", recipe_check("fireq", lm_head=True))
    if DEV == "cuda" and left() > 70:
        check("recipe qserve on tiny Llama (hd 64)", recipe_check("qserve"))
    if DEV == "cuda" and left() > 60:  # session 9: the LUT lm_head's first GPU check
        check("recipe flute-nf4 lm_head=True on tiny Llama (hd 64)", recipe_check("flute-nf4", lm_head=True))
    if DEV == "cuda" and AQ_STUDY:
        check("act_quant study (FAST path bit-exactness, M=1 warps sweep, large-M bandwidth)", act_quant_study)
    # (2) this area has no Triton kernel of its own
    with open(os.path.join(a.out, "codegen.txt"), "w") as f:
        f.write("area models has no Triton kernels; see the kernels' own areas for PTX dumps\n")
    if DEV != "cuda":
        print("\n".join(SUMMARY))
        return
    # (3) profile + model throughput
    from lowbit.bench import model as bm

    bench_budget = max(10.0, left() - (30.0 if PPL else 15.0))  # 12 s kept for the kv4 split sweep
    print(f"== bench model (budget {bench_budget:.0f}s)", flush=True)
    try:
        bm.run(a.out, quick=True, layers=2, time_budget_s=bench_budget, profile=PROFILE, recipes=RECIPES,
               prefill_seqs=[1024, 4096], decode_batches=[1, 16, 64], decode_ctx=DECODE_CTX,
               command="benchmarks/device/model.py (lowbit.bench.model.run, 2 layers scaled to 32)")
    except Exception:
        traceback.print_exc()
    # (3b) decode attention at B=1, 1k context (the step's second-largest item after the GEMMs): split sweep
    if left() > 12:
        check("decode_kv4 B=1 L=1025/8193 num_splits sweep (us per call in a CUDA graph)", kv4_split_sweep)
    # (4) FP32 perplexity gap GPU vs CPU
    if PPL and left() > 20:
        check("FP32 perplexity gap GPU vs CPU", ppl_gap)
    # (5) ablation
    if ABLATION and left() > 25:
        print(f"== ablation (budget {left() - 5:.0f}s)", flush=True)
        try:
            from lowbit.eval import ablation

            ablation.script(a.out, device="cuda", time_budget_s=left() - 5)
        except Exception:
            traceback.print_exc()
    print("\n== summary")
    print("\n".join(SUMMARY))
    for name in ("model_profile.md", "model_summary.md"):
        p = os.path.join(a.out, name)
        if os.path.exists(p):
            print(open(p).read())
    with open(os.path.join(a.out, "checks.json"), "w") as f:
        json.dump({"checks": SUMMARY, "wall_s": time.time() - T0}, f, indent=1)
    print(f"wall {time.time() - T0:.1f}s")


main()
