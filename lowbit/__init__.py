"""lowbit: fast low-bit LLM inference on NVIDIA Hopper GPUs.

``import lowbit`` is light (torch only); transformers and the kernels load on first use.

    import lowbit
    qlinear = lowbit.quantize_linear(linear, "w4a8-fp8", group_size=128)
    out = lowbit.attention(q, k, v, scheme="fp8", causal=True)
    model = lowbit.quantize_model(model, "fireq")
"""
from __future__ import annotations

__version__ = "0.1.0"

from lowbit.api import (  # noqa: E402
    attention,
    load_quantized,
    quantize_linear,
    quantize_model,
    recipes,
    save_quantized,
    schemes,
)

__all__ = [
    "__version__", "attention", "quantize_linear", "quantize_model", "save_quantized",
    "load_quantized", "schemes", "recipes",
]
