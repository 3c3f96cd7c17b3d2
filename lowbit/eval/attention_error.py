"""Accuracy of quantized attention: INT-FlashAttention Tables 1-2 and the embedded model.

1. ``synthetic_table``: Q, K, V drawn i.i.d. from N(0, 1) or U(-0.5, 0.5) (INT-FA §4.2), one
   layer of attention, sequence lengths 1k-16k. Metrics against a **float64** reference:
   ``mre`` = mean(|out - ref| / (|ref| + 1e-5)), INT-FA's mean relative error, averaged over **all**
   output elements; ``mre_last4`` = the same over the last 4 elements of the flattened output only,
   which is what their released script computed (``CALC_NUM = 4``; a 4-element sample makes their
   tables noisy); and the relative L2 error. Their reference was fp16 attention with an fp32
   softmax; ours is float64.
2. ``capture_qkv`` + ``layer_errors``: the model's own post-RoPE Q, K, V per layer (captured by an
   attention function registered with transformers' ``AttentionInterface``), attention error per
   layer of each scheme against float64.
3. ``model_perplexity``: perplexity with a scheme's attention installed in every layer (prefill
   without padding: the causal mask is the plain lower triangle; ``lowbit.eval.perplexity``).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from lowbit.formats.attention_quant import mre
from lowbit.ops.attention import attention_ref

__all__ = ["synthetic_qkv", "reference", "synthetic_table", "capture_qkv", "layer_errors",
           "model_perplexity", "use_attention", "lowbit_providers"]


def synthetic_qkv(dist: str, B: int, H: int, S: int, D: int, *, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """(q, k, v) [B, H, S, D] from ``dist`` 'normal' (N(0,1)) or 'uniform' (U(-0.5, 0.5))."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (3, B, H, S, D)
    if dist == "normal":
        x = torch.randn(shape, generator=g, device=device)
    elif dist == "uniform":
        x = torch.rand(shape, generator=g, device=device) - 0.5
    else:
        raise ValueError(f"dist must be 'normal' or 'uniform', got {dist!r}")
    x = x.to(dtype)
    return x[0], x[1], x[2]


def reference(q, k, v, *, causal: bool = False, sm_scale: float | None = None, heads_per_chunk: int = 4):
    """float64 attention computed a few heads at a time (bounded memory at 16k tokens)."""
    outs = []
    rep = q.shape[1] // k.shape[1]
    for h0 in range(0, q.shape[1], heads_per_chunk):
        h1 = min(q.shape[1], h0 + heads_per_chunk)
        kv0, kv1 = h0 // rep, (h1 - 1) // rep + 1
        qq = q[:, h0:h1]
        kk, vv = k[:, kv0:kv1], v[:, kv0:kv1]
        if rep > 1:  # align the chunk's heads with their KV heads
            idx = torch.arange(h0, h1, device=q.device) // rep - kv0
            kk, vv = kk[:, idx], vv[:, idx]
        outs.append(attention_ref(qq, kk, vv, causal=causal, sm_scale=sm_scale))
    return torch.cat(outs, dim=1)


def lowbit_providers() -> dict[str, Callable]:
    """name -> fn(q, k, v, causal) for lowbit's schemes (bf16/fp16 inputs)."""
    from lowbit.ops import attention_prefill as ap

    return {
        "lowbit-int8": lambda q, k, v, c: ap.int8_attention(q, k, v, causal=c),
        "lowbit-int8-tensorV": lambda q, k, v, c: ap.int8_attention(q, k, v, causal=c, v_granularity="tensor"),
        "lowbit-int8-pblock": lambda q, k, v, c: ap.int8_attention(q, k, v, causal=c, p_scale="block"),
        "lowbit-int8-qk": lambda q, k, v, c: ap.int8_qk_attention(q, k, v, causal=c),
        "lowbit-fp8": lambda q, k, v, c: ap.fp8_attention(q, k, v, causal=c),
        "lowbit-fp8-kv4": lambda q, k, v, c: ap.fp8_kv4_attention(q, k, v, causal=c),
    }


def synthetic_table(providers: dict[str, Callable], *, dists=("normal", "uniform"),
                    seq_lens=(1024, 2048, 4096, 8192, 16384), B: int = 1, H: int = 8, D: int = 128,
                    causal: bool = False, device="cuda", dtype=torch.bfloat16, seed: int = 0,
                    on_row: Callable | None = None) -> list[dict]:
    """Rows {dist, S, provider, mre, mre_last4, rel_l2} (see the module docstring)."""
    rows = []
    for dist in dists:
        for S in seq_lens:
            q, k, v = synthetic_qkv(dist, B, H, S, D, device=device, dtype=dtype, seed=seed)
            ref = reference(q, k, v, causal=causal)
            for name, fn in providers.items():
                row = {"dist": dist, "S": S, "B": B, "H": H, "D": D, "provider": name}
                try:
                    out = fn(q, k, v, causal)
                    row.update(mre=mre(out, ref), mre_last4=mre(out, ref, last=4),
                               rel_l2=((out.double() - ref).norm() / ref.norm()).item(),
                               finite=bool(torch.isfinite(out).all()))
                except Exception as exc:  # a failing peer must not stop the table
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                rows.append(row)
                if on_row:
                    on_row(row)
            del q, k, v, ref
    return rows


# ------------------------------------------------------------------------------- model integration
_CAPTURE_NAME = "lowbit_capture"
_SCHEME_NAME = "lowbit_scheme"


def _hf_output(o):
    return o.transpose(1, 2).contiguous(), None  # [B, H, S, D] -> [B, S, H, D]


def use_attention(model, fn: Callable | None):
    """Route every attention layer of an HF model through ``fn(q, k, v, sm_scale) -> o`` (q/k/v
    ``[B, H, S, D]`` post-RoPE, k/v with the KV heads), causal, no padding. ``fn=None`` restores
    SDPA. Returns the model."""
    from transformers import AttentionInterface

    if fn is None:
        model.set_attn_implementation("sdpa")
        return model

    def attn(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        sm = scaling if scaling is not None else query.shape[-1] ** -0.5
        return _hf_output(fn(query, key, value, sm))

    AttentionInterface.register(_SCHEME_NAME, attn)
    model.set_attn_implementation(_SCHEME_NAME)
    return model


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor) -> list[tuple]:
    """One forward pass; returns per layer (q, k, v) post-RoPE, ``[1, H, S, D]`` on the model's device."""
    caught: list[tuple] = []

    def fn(q, k, v, sm):
        caught.append((q.detach().clone(), k.detach().clone(), v.detach().clone(), sm))
        from lowbit.ops.attention import sdpa_attention

        return sdpa_attention(q, k, v, causal=True, sm_scale=sm)

    use_attention(model, fn)
    try:
        model(input_ids=input_ids.to(next(model.parameters()).device).view(1, -1), use_cache=False)
    finally:
        use_attention(model, None)
    return caught


def layer_errors(captured: list[tuple], providers: dict[str, Callable], *, dtype=torch.bfloat16) -> list[dict]:
    """Per layer and provider: rel-L2 and MRE of causal attention on the captured Q/K/V (cast to
    ``dtype``, as the kernels take it) against float64 on the float32 originals."""
    rows = []
    for i, (q, k, v, sm) in enumerate(captured):
        ref = reference(q.double(), k.double(), v.double(), causal=True, sm_scale=sm)
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        for name, fn in providers.items():
            row = {"layer": i, "provider": name}
            try:
                out = fn(qd, kd, vd, True, sm) if _takes_scale(fn) else fn(qd, kd, vd, True)
                row.update(rel_l2=((out.double() - ref).norm() / ref.norm()).item(), mre=mre(out, ref))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
    return rows


def _takes_scale(fn) -> bool:
    try:
        import inspect

        return len(inspect.signature(fn).parameters) >= 5
    except (TypeError, ValueError):
        return False


def model_perplexity(model, ids: torch.Tensor, scheme: str | None, *, max_tokens: int = 8192,
                     window: int = 1024, dtype=None, **options) -> float:
    """Perplexity (``lowbit.eval.perplexity``) with ``lowbit.attention(..., scheme=scheme)`` in every
    layer (None = SDPA). ``dtype`` casts Q/K/V before the scheme (e.g. bf16 on the GPU)."""
    from lowbit.api import attention
    from lowbit.eval.perplexity import perplexity

    if scheme is None:
        use_attention(model, None)
    else:
        def fn(q, k, v, sm):
            dt = dtype or q.dtype
            o = attention(q.to(dt), k.to(dt), v.to(dt), scheme=scheme, causal=True, sm_scale=sm, **options)
            return o.to(q.dtype)

        use_attention(model, fn)
    try:
        return perplexity(model, ids, max_tokens=max_tokens, window=window).perplexity
    finally:
        use_attention(model, None)


def summary_line(rows: list[dict], provider: str, dist: str, S: int) -> str:
    for r in rows:
        if r["provider"] == provider and r["dist"] == dist and r["S"] == S and "mre" in r:
            return f"{provider} {dist} S={S}: MRE {100 * r['mre']:.3f}% (last-4 {100 * r['mre_last4']:.3f}%), rel-L2 {r['rel_l2']:.4f}"
    return f"{provider} {dist} S={S}: n/a"


def _isfinite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)
