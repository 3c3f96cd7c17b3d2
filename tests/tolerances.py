"""The one tolerance table of the test suite, and the error metrics it is judged in.

Quantized paths are judged by relative L2 error (||out - ref|| / ||ref||) or SQNR in dB
(20 log10(||ref|| / ||out - ref||)) against a float64 reference; kernel-vs-reference-of-the-same-
numerics checks use ``KERNEL_VS_REF`` (differences only from accumulation order and rounding).
"""
import torch

KERNEL_VS_REF = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    import math

    err = (out.double() - ref.double()).norm().item()
    return float("inf") if err == 0 else 20 * math.log10(ref.double().norm().item() / err)
