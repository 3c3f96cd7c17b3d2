"""Reference attention (float math, GQA, bottom-right causal mask) and the ``sdpa`` scheme.

``attention_ref`` is the one reference every attention kernel, test and benchmark compares to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(sq: int, skv: int, device=None) -> torch.Tensor:
    """Bool [sq, skv], True where attended: query i (the last sq positions) sees keys j <= i + skv - sq."""
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(skv, device=device).unsqueeze(0)
    return j <= i + (skv - sq)


def expand_kv(k: torch.Tensor, hq: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hq, S, D] by repeating each KV head Hq/Hkv times (GQA)."""
    rep = hq // k.shape[1]
    return k if rep == 1 else k.repeat_interleave(rep, dim=1)


def attention_ref(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """softmax(q k^T * sm_scale) v computed in ``dtype`` (float64 by default); returns ``dtype``.

    Rows that attend to nothing (impossible with the bottom-right mask when Sq <= Skv) give 0.
    """
    D = q.shape[-1]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    qf, kf, vf = q.to(dtype), expand_kv(k, q.shape[1]).to(dtype), expand_kv(v, q.shape[1]).to(dtype)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * sm_scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, vf)


def sdpa_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """Scheme ``sdpa``: unquantized torch SDPA in the input dtype (the bf16 baseline)."""
    Sq, Skv = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if causal and Sq != Skv:
        mask = causal_mask(Sq, Skv, q.device)
        return F.scaled_dot_product_attention(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]),
                                              attn_mask=mask, scale=sm_scale)
    if gqa:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)
