"""Public entry points. Each one validates its arguments, then dispatches through
``lowbit.registry`` to the implementation (imported lazily)."""
from __future__ import annotations

import torch

from lowbit import registry
from lowbit._utils import FLOAT_DTYPES, check_sm_scale, check_tensor


def schemes() -> list[dict]:
    """Every linear and attention scheme: name, kind, devices, description, paper, defaults."""
    return [
        {"name": e.name, "kind": e.kind, "devices": list(e.devices), "description": e.description,
         "paper": e.paper, "defaults": dict(e.options)}
        for e in registry.entries() if e.kind != "recipe"
    ]


def recipes() -> list[dict]:
    """Every model-level recipe usable with ``quantize_model``."""
    return [
        {"name": e.name, "devices": list(e.devices), "description": e.description, "paper": e.paper}
        for e in registry.entries("recipe")
    ]


def quantize_linear(linear: torch.nn.Linear, scheme: str, **options) -> torch.nn.Module:
    """Quantize one ``nn.Linear`` with ``scheme`` (see ``schemes()``); returns a new module."""
    entry = registry.get("linear", scheme)
    if not isinstance(linear, torch.nn.Linear):
        raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
    if linear.weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"linear.weight must be float16, bfloat16 or float32, got {linear.weight.dtype}")
    if linear.weight.device.type not in entry.devices:
        raise ValueError(f"linear is on {linear.weight.device}; scheme {scheme!r} runs on {', '.join(entry.devices)}")
    if linear.in_features < 1:
        raise ValueError(f"linear must have in_features >= 1 to be quantized, got {linear.in_features}")
    if options.get("dtype") is not None and options["dtype"] not in FLOAT_DTYPES:
        raise TypeError(f"dtype (the activation / output dtype) must be torch.float16, torch.bfloat16 or "
                        f"torch.float32, got {options['dtype']!r}")
    return entry.load().from_linear(linear, **options)


def attention(q, k, v, *, scheme: str, causal: bool = False, sm_scale: float | None = None, **options):
    """Attention with quantized operands.

    q ``[B, Hq, Sq, D]``, k and v ``[B, Hkv, Skv, D]`` with Hq a multiple of Hkv (GQA/MQA).
    Output is shaped like q, in q's dtype. With ``causal=True`` and Sq < Skv the queries are the
    last Sq positions (bottom-right aligned mask, as FlashAttention 2), so decode and chunked
    prefill use this same call. ``sm_scale`` defaults to 1/sqrt(D).
    """
    entry = registry.get("attention", scheme)
    check_tensor(q, "q", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=4)
    check_tensor(k, "k", dtype=q.dtype, ndim=4)
    check_tensor(v, "v", dtype=q.dtype, ndim=4)
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"q, k, v must share batch size: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {list(k.shape)} and v {list(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"q and k must have the same head_dim, got {D} and {k.shape[3]}")
    if D < 1:
        raise ValueError(f"q, k, v must have head_dim >= 1, got shape {list(q.shape)}")
    if k.shape[1] < 1 or Hq % k.shape[1]:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({k.shape[1]})")
    # (a SymBool is a bool torch.compile traces, e.g. ``causal=T > 1`` under dynamic shapes: ``in`` cannot compare it)
    if not isinstance(causal, (bool, torch.SymBool)) and causal not in (True, False):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if causal and Sq > k.shape[2]:
        raise ValueError(f"causal attention needs Sq <= Skv, got Sq={Sq}, Skv={k.shape[2]}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in entry.devices:
        raise ValueError(f"q, k, v are on {q.device}; scheme {scheme!r} runs on {', '.join(entry.devices)}")
    sm_scale = check_sm_scale(sm_scale, D)
    return entry.load()(q, k, v, causal=bool(causal), sm_scale=sm_scale, **options)


def quantize_model(model, recipe: str, calibration=None, **options):
    """Quantize a transformers causal LM in place with ``recipe`` (see ``recipes()``); returns it."""
    entry = registry.get("recipe", recipe)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers *ForCausalLM), got {type(model).__name__}")
    if not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers *ForCausalLM (a module with .config), "
                        f"got {type(model).__name__}")
    return entry.load()(model, calibration=calibration, **options)


def save_quantized(model, path) -> None:
    """Write a quantized model as safetensors + versioned JSON metadata (no pickle)."""
    from lowbit.models.checkpoint import save_quantized as _save

    _save(model, path)


def load_quantized(path, *, device: str | None = None):
    """Read a checkpoint written by ``save_quantized``; validates every tensor."""
    from lowbit.models.checkpoint import load_quantized as _load

    return _load(path, device=device)
