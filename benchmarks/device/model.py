"""Device script of area `models` (issue 7): end-to-end checks, model throughput, FireQ Table 3.

    python3 benchmarks/device/model.py --out DIR [--cpu-smoke]

(1) correctness on the GPU: the fast runner (CUDA graphs) against transformers' greedy
    ``generate``; each available recipe on a tiny random Llama (runner vs HF tokens, and
    save -> load -> same greedy tokens); (2) no kernels of this area to dump (a note);
(3) ``lowbit.bench.model`` on a Llama-3-8B-shaped model trimmed to 2 decoder layers and scaled
    to 32 (see that module), under a time budget; (4) the ablation table (FireQ Table 3 layout) on
    the embedded model if time is left. Budget: <= 100 s wall.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import traceback

T0 = time.time()
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run of part (1) only")
ap.add_argument("--budget", type=float, default=97.0)
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
if a.cpu_smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEV = "cpu" if a.cpu_smoke or not torch.cuda.is_available() else "cuda"
SUMMARY = []


def left() -> float:
    return a.budget - (time.time() - T0)


def tiny(head_dim=64, hidden=256, dtype=torch.float32, seed=0):
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


def recipe_check(recipe):
    def fn():
        import lowbit
        from lowbit.models.generate import generate

        m = tiny(dtype=torch.bfloat16 if DEV == "cuda" else torch.float32)
        g = torch.Generator().manual_seed(1)
        calib = [torch.randint(0, 256, (1, 64), generator=g) for _ in range(2)]
        lowbit.quantize_model(m, recipe, calibration=calib, progress=False)
        prompts = [torch.randint(1, 256, (n,), generator=g) for n in (6, 13)]
        got = generate(m, prompts, 8, prefill_from_cache=True)
        ref = [hf_greedy(m, p, 8) for p in prompts]
        agree = sum(int((x == y).sum()) for x, y in zip(got, ref)) / sum(x.numel() for x in ref)
        with tempfile.TemporaryDirectory() as d:
            lowbit.save_quantized(m, d)
            m2 = lowbit.load_quantized(d, device=DEV)
            ref2 = [hf_greedy(m2, p, 8) for p in prompts]
        same = all(torch.equal(x, y) for x, y in zip(ref, ref2))
        return same, f"save->load same greedy tokens: {same}; runner (prefill from cache) vs HF generate token agreement {agree:.2f}"
    return fn


def main():
    # (1) correctness
    check("runner (CUDA graphs) == HF generate, batched lengths 5/17/11", runner_vs_hf)
    for r in ("fireq", "qserve", "flute-nf4", "flute-nf3", "int8-attention"):
        if left() < 75 and DEV == "cuda":
            SUMMARY.append(f"SKIP  recipe {r}: time")
            continue
        check(f"recipe {r} on tiny Llama (hd 64)", recipe_check(r))
    # (2) this area has no Triton kernel of its own
    with open(os.path.join(a.out, "codegen.txt"), "w") as f:
        f.write("area models has no Triton kernels; see the kernels' own areas for PTX dumps\n")
    if DEV != "cuda":
        print("\n".join(SUMMARY))
        return
    # (3) model throughput
    from lowbit.bench import model as bm

    try:
        import gguf  # noqa: F401
        have_gguf = True
    except ImportError:
        have_gguf = False
    bench_budget = max(10.0, left() - (30.0 if have_gguf else 6.0))
    print(f"== bench model (budget {bench_budget:.0f}s)", flush=True)
    try:
        bm.run(a.out, quick=True, layers=2, time_budget_s=bench_budget, profile=True,
               command="benchmarks/device/model.py (lowbit.bench.model.run quick, 2 layers scaled to 32)")
    except Exception:
        traceback.print_exc()
    # (4) ablation (needs the embedded model: gguf must be importable on this machine)
    if not have_gguf:
        SUMMARY.append("SKIP  ablation: the gguf package is not installed here (embedded model cannot load)")
    if have_gguf and left() > 25:
        print(f"== ablation (budget {left() - 5:.0f}s)", flush=True)
        try:
            from lowbit.eval import ablation

            ablation.script(a.out, device="cuda", time_budget_s=left() - 5)
        except Exception:
            traceback.print_exc()
    elif have_gguf:
        SUMMARY.append("SKIP  ablation: time")
    print("\n== summary")
    print("\n".join(SUMMARY))
    p = os.path.join(a.out, "model_summary.md")
    if os.path.exists(p):
        print(open(p).read())
    with open(os.path.join(a.out, "checks.json"), "w") as f:
        json.dump({"checks": SUMMARY, "wall_s": time.time() - T0}, f, indent=1)
    print(f"wall {time.time() - T0:.1f}s")


main()
