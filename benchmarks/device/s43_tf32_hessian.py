"""Session 43: the accuracy of a Hessian ``2/T x^T x`` of bf16 activations on the TF32 tensor cores against the float32
GEMM (CUDA cores) and TF32 on float32 data, each against float64: max |error| / max |H| (the numbers the ``model``
section quotes for the TF32 Hessians that were tried and taken out).

    PYTHONPATH=$PWD python3 benchmarks/device/s43_tf32_hessian.py --out DIR
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from lowbit.bench.harness import env_info, probe_args, probe_row, write_probe  # noqa: E402


def rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def gemm(x, tf32):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        return (x.T @ x) * (2.0 / x.shape[0])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def main():
    args = probe_args("t")
    doc = {"env": env_info("PYTHONPATH=$PWD python3 benchmarks/device/s43_tf32_hessian.py " + " ".join(sys.argv[1:]))}
    g = torch.Generator(device="cuda").manual_seed(0)
    for t, k in ((2048, 1024), (2048, 4096)):
        x = (torch.randn(t, k, device="cuda", generator=g) * torch.rand(k, device="cuda", generator=g) * 4)
        xb = x.to(torch.bfloat16)
        ref_b = (xb.double().T @ xb.double()) * (2.0 / t)
        ref_f = (x.double().T @ x.double()) * (2.0 / t)
        probe_row(doc, f"T{t} K{k}", {"tf32_bf16_data": rel(gemm(xb.float(), True), ref_b),
                                      "fp32_gemm_bf16_data": rel(gemm(xb.float(), False), ref_b),
                                      "tf32_fp32_data": rel(gemm(x, True), ref_f)})
    print(write_probe(doc, args.out, "s43_tf32_hessian.json"))


if __name__ == "__main__":
    main()
