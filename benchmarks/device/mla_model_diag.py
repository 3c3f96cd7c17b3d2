"""Diagnostic (session 18): the tiny DeepSeek-V3 model of tests/test_mla_model.py at the latent widths 512 + 64 and 16
heads, greedy 16 steps from three prompts with the bf16 latent cache, the FP8 cache through the Gluon few-rows kernel and
the FP8 cache through the Triton tile (GLUON_FEW off): the bf16 greedy margins (top-1 minus top-2 score) of the first
steps, where each FP8 run first leaves the bf16 tokens, and its scores' rel-L2 to bf16 per step up to there.

    python3 benchmarks/device/mla_model_diag.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import lowbit.kernels.mla_decode as MD  # noqa: E402
from lowbit.models.deepseek import install_fp8_mla, uninstall_fp8_mla  # noqa: E402
from tests.test_mla_model import tiny_deepseek  # noqa: E402

for seed in (0, 1, 2):
    torch.manual_seed(seed)
    m = tiny_deepseek(heads=16, kv_lora_rank=512, rope=64).to("cuda")
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(seed + 1)).to("cuda")
    res = {}
    with torch.no_grad():
        for name, fp8, gl in (("bf16", False, True), ("fp8-gluon", True, True), ("fp8-triton", True, False)):
            MD.GLUON_FEW = gl
            install_fp8_mla(m, fp8=fp8)
            out = m.generate(prompt, max_new_tokens=16, do_sample=False, output_scores=True, return_dict_in_generate=True)
            uninstall_fp8_mla(m)
            res[name] = out
    b = res["bf16"]
    top2 = [torch.topk(s[0].float(), 2).values for s in b.scores]
    print("seed", seed, "bf16 margins", [round(float(t[0] - t[1]), 4) for t in top2[:6]])
    for name in ("fp8-gluon", "fp8-triton"):
        f = res[name]
        same = (f.sequences == b.sequences)[0, 12:].tolist()
        first = same.index(False) if False in same else 16
        errs = [float((f.scores[i].float() - b.scores[i].float()).norm() / b.scores[i].float().norm()) for i in range(min(first + 1, 16))]
        print(" ", name, "first divergence", first, "score rel-L2 per step", [f"{e:.2e}" for e in errs])
