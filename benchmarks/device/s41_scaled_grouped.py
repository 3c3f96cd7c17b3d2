"""Device probe (session 41): can ``torch._scaled_grouped_mm`` (FP8 row-wise, one launch for all experts) serve as the
``w4a8-fp8`` experts' prefill GEMM, as ``torch._scaled_mm`` serves the dense large-M path? Per shape (gate_up / down
of Qwen3-30B-A3B and Mixtral-8x7B experts) and routed row count: the experts' weights dequantized to FP8 once
(``dequantize_to_fp8`` per expert, stacked), then (a) ``torch._scaled_grouped_mm`` over the rows sorted by expert
(random top-k routing: group sizes not multiples of 16), (b) lowbit's grouped kernel (``moe_gemm_triton``) on the
codes; outputs compared with an fp32 product of three experts' rows. Writes <out>/s41_scaled_grouped.json."""
import argparse
import json
import sys

import torch

sys.path[:0] = ["."]
from lowbit.bench.harness import time_cuda  # noqa: E402
from lowbit.formats.common import FP8_E4M3, quantize_per_token  # noqa: E402
from lowbit.formats.w4a8_fp8 import quantize_weight  # noqa: E402
from lowbit.kernels.moe_grouped import moe_gemm_triton  # noqa: E402
from lowbit.kernels.w4a8_fp8_gemm import dequantize_to_fp8  # noqa: E402
from lowbit.ops.moe import route  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
a = ap.parse_args()
print("has _scaled_grouped_mm:", hasattr(torch, "_scaled_grouped_mm"), flush=True)
CASES = [("qwen3 gate_up", 128, 1536, 2048, 8, [4096, 16384]), ("qwen3 down", 128, 2048, 768, 8, [16384]),
         ("mixtral gate_up", 8, 28672, 4096, 2, [4096, 16384]), ("mixtral down", 8, 4096, 14336, 2, [16384])]
rows_out = []
for name, E, N, K, k, Ts in CASES:
    g = torch.Generator(device="cuda").manual_seed(0)
    codes, scales = [], []
    for _ in range(E):
        c, s, _ = quantize_weight(torch.randn(N, K, device="cuda", generator=g) * 0.02, 128, 0)
        codes.append(c.contiguous())
        scales.append(s.contiguous())
    wf = torch.stack([dequantize_to_fp8(c, s, K, 128) for c, s in zip(codes, scales)])  # [E, N, Kp]
    inv = torch.ones(E, device="cuda")
    for T in Ts:
        idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        _, row_tok, off = route(idx, E)
        R = T * k
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        xq, sx = quantize_per_token(x, FP8_E4M3)
        a_s, s_s = xq[row_tok.long()], sx[row_tok.long()].float()
        sb = inv[:, None].expand(E, N).contiguous()
        rec = dict(case=name, E=E, N=N, K=K, rows=R, flop=2 * R * N * K)
        try:
            def sgm():
                return torch._scaled_grouped_mm(a_s, wf.transpose(1, 2), s_s, sb, offs=off[1:], out_dtype=torch.bfloat16)
            y = sgm()
            t = time_cuda(lambda: sgm(), [()], warmup=3, reps=20)
            rec["sgm_us"] = round(t["median_ms"] * 1e3, 1)
            for e in (0, E // 2, E - 1):  # fp32 reference of three experts' rows (cuBLASLt's _scaled_mm needs M % 16)
                s0, s1 = int(off[e]), int(off[e + 1])
                ref = (a_s[s0:s1].float() @ wf[e].float().t()) * s_s[s0:s1, None] * sb[e][None, :]
                err = ((y[s0:s1].float() - ref).norm() / ref.norm()).item()
                rec["sgm_rel_l2_vs_fp32"] = max(rec.get("sgm_rel_l2_vs_fp32", 0.0), err)
        except Exception as exc:  # noqa: BLE001 (the probe records what PyTorch says)
            rec["sgm_error"] = repr(exc)[:400]
        t = time_cuda(lambda: moe_gemm_triton("w4a8-fp8", xq, sx, row_tok, off, [codes, scales], inv, K, 128,
                                              torch.bfloat16, R, T), [()], warmup=3, reps=20)
        rec["lowbit_grouped_us"] = round(t["median_ms"] * 1e3, 1)
        t = time_cuda(lambda: torch.stack([dequantize_to_fp8(c, s, K, 128) for c, s in zip(codes, scales)]), [()],
                      warmup=2, reps=10)
        rec["dequant_loop_us"] = round(t["median_ms"] * 1e3, 1)
        for kk in ("sgm_us", "lowbit_grouped_us"):
            if kk in rec:
                rec[kk.replace("_us", "_tflops")] = round(rec["flop"] / rec[kk] / 1e6, 1)
        print(rec, flush=True)
        rows_out.append(rec)
    wf = codes = scales = None
    torch.cuda.empty_cache()
json.dump(dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                         triton=__import__("triton").__version__,
                         command="python3 benchmarks/device/s41_scaled_grouped.py --out $OUT"), rows=rows_out),
          open(f"{a.out}/s41_scaled_grouped.json", "w"), indent=1)
