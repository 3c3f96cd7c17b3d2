"""SmoothAttention (QServe §4, QoQ; seed 003, digest part 1.4): move the fixed outlier channels
of the keys into the queries before the KV cache is quantized to 4 bits.

    Z = (Q Λ)(K Λ^-1)^T = Q K^T,    λ_i = max|K_i| ** alpha   (alpha = 0.5, "good enough")

``max|K_i|`` is the absmax of channel i of ``k_proj``'s output for each KV head, over the
calibration tokens. Λ is folded into the weights at zero runtime cost: row (h, i) of ``k_proj``
(and its bias) is divided by λ[h, i] and the rows of every query head served by KV head h
(GQA: query heads ``h * group .. (h + 1) * group - 1``) are multiplied by it.

RoPE (a [GAP] in the notes, derived in the digest): RoPE rotates channel pairs, so Λ commutes with
it only if both channels of a pair share one λ; we use the larger statistic of the pair,
``λ_i = λ_j = max(max|K_i|, max|K_j|) ** alpha``. The pairing is read from the model
(``lowbit.models.arch.rope_pairing``): "half" pairs (i, i + D/2) (Llama ``rotate_half``),
"interleaved" pairs (2i, 2i + 1). Statistics are taken before RoPE; a rotation mixes only the two
channels of a pair, so the pair's max is the quantity that matters after RoPE too.

Models with a per-head norm on q/k after the projections (``q_norm``/``k_norm``, Qwen3) cannot absorb
Λ into the projections (the norm divides it out again; its weight is shared by all heads while λ is
per KV head). There λ is measured on ``k_norm``'s output and applied **online**, after RoPE, by the
KV cache's per-channel key multiplier (``crs_k = 1 / λ``, queries times λ: ``online_params``). A
pair-shared λ commutes with RoPE, so this is the folded form's arithmetic in another place.
"""
from __future__ import annotations

import torch

from lowbit.models.arch import select_layers
from lowbit.ptq.calibration import reduce_stats

LAMBDA_EPS = 1e-5  # channels whose absmax stays below this keep λ = 1 (nothing to move)


def pair_max(stat: torch.Tensor, pairing: str) -> torch.Tensor:
    """Share a per-channel statistic [..., D] within RoPE pairs (elementwise max of the pair)."""
    D = stat.shape[-1]
    if D % 2:
        raise ValueError(f"head_dim must be even for RoPE pairs, got {D}")
    if pairing == "half":
        a, b = stat[..., : D // 2], stat[..., D // 2:]
        m = torch.maximum(a, b)
        return torch.cat([m, m], dim=-1)
    if pairing == "interleaved":
        s = stat.reshape(*stat.shape[:-1], D // 2, 2)
        m = s.amax(-1, keepdim=True).expand_as(s)
        return m.reshape(stat.shape)
    raise ValueError(f"unknown RoPE pairing {pairing!r}")


def smooth_attention_scales(k_absmax: torch.Tensor, num_kv_heads: int, head_dim: int, pairing: str,
                            alpha: float = 0.5) -> torch.Tensor:
    """λ [num_kv_heads, head_dim] from the per-channel absmax of k_proj's output [Hkv * D]."""
    stat = k_absmax.float().reshape(num_kv_heads, head_dim)
    stat = pair_max(stat, pairing)
    lam = stat.clamp_min(LAMBDA_EPS) ** alpha
    # a channel that never fired carries no outlier: leave it alone rather than blow up q by 1/eps
    return torch.where(stat > LAMBDA_EPS, lam, torch.ones_like(lam))


@torch.no_grad()
def fold_smooth_attention(view, lam: torch.Tensor) -> None:
    """Divide k_proj rows by λ and multiply the q_proj rows of the matching query heads by λ."""
    hkv, d = lam.shape
    group = view.num_heads // view.num_kv_heads
    k, q = view.k_proj, view.q_proj
    lk = lam.reshape(hkv * d).to(k.weight.device)
    lq = lam.repeat_interleave(group, dim=0).reshape(view.num_heads * d).to(q.weight.device)
    k.weight.div_(lk[:, None].to(k.weight.dtype))
    if getattr(k, "bias", None) is not None:
        k.bias.div_(lk.to(k.bias.dtype))
    q.weight.mul_(lq[:, None].to(q.weight.dtype))
    if getattr(q, "bias", None) is not None:
        q.bias.mul_(lq.to(q.bias.dtype))


@torch.no_grad()
def apply_smooth_attention(model, batches, layers=None, alpha: float = 0.5) -> dict:
    """Calibrate on ``batches`` ([1, S] token ids) and fold Λ into q_proj/k_proj in place.

    ``layers``: indices to treat (default all). Returns ``{"alpha", "layers": {i: λ [Hkv, D]},
    "online": [i, ...]}``: the layers in ``online`` have q/k norms and keep their
    weights; their λ must reach the KV cache through ``online_params`` (the ``qserve`` recipe does).
    Must run before the q/k projections are quantized.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    views, idx = select_layers(model, layers)
    for i in idx:
        if not views[i].qk_norm and (not hasattr(views[i].k_proj, "weight")
                                     or not views[i].k_proj.weight.is_floating_point()):
            raise ValueError(f"layer {i}: k_proj must be a float nn.Linear (apply SmoothAttention before quantizing)")
    # the keys RoPE sees: k_proj's output, or k_norm's on q/k-norm models ([B, S, Hkv * D] or [B, S, Hkv, D])
    mods = {str(i): views[i].key_module for i in idx}
    stats = reduce_stats(model, batches, mods, lambda y: y.abs().reshape(y.shape[0] * y.shape[1], -1).amax(0),
                         on="output", reduce="max")
    out = {"alpha": alpha, "layers": {}, "online": []}
    for i in idx:
        v = views[i]
        lam = smooth_attention_scales(stats[str(i)], v.num_kv_heads, v.head_dim, v.rope_pairing, alpha)
        if v.qk_norm:
            out["online"].append(i)
        else:
            fold_smooth_attention(v, lam)
        out["layers"][i] = lam.cpu()
    return out


def online_params(model, report: dict):
    """The λ of ``report["online"]`` layers as ``lowbit.ptq.rope_kv.RopeKVParams`` with
    ``crs_k = 1 / λ`` (one entry per decoder layer, ``crs_k = None`` elsewhere), the form
    ``install_quantized_attention(rope_kv=...)`` applies after RoPE; None when no layer needs it."""
    from lowbit.models.arch import decoder_layers
    from lowbit.ptq.rope_kv import RopeKVParams

    if not report.get("online"):
        return None
    views = decoder_layers(model)
    params = [RopeKVParams(v.index, v.num_heads, v.num_kv_heads, v.head_dim, v.rope_pairing) for v in views]
    for i in report["online"]:
        params[i].crs_k = 1.0 / report["layers"][i].float()
    return params
