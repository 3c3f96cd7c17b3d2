"""RoPE-aware key smoothing for the INT4 KV cache: RPN (pre-RoPE, folded) + CRS (post-RoPE, online).

FireQ §3.2 (notes §1.7-1.10, §7.6, §8). Keys are split per KV head into

- **CRS pairs**: the ``top_k`` RoPE pairs with the largest post-RoPE max|k| (ranked by
  ``max(max|k_i|, max|k_j|)`` over the calibration tokens), each channel with its *own* factor,
  applied **after** RoPE: ``k_c <- k_c * crs_k[c]``, ``crs_k[c] = beta / max_n |k_c^n|``;
- **RPN pairs**: every other pair (all pairs when CRS is off), one factor per pair, folded into
  ``k_proj`` (exact: a pair scaled by one number commutes with its 2-D rotation):
  ``k_pair <- k_pair * rpn``, ``rpn = alpha / max_n ||(k_i^n, k_j^n)||_2``.

Query side: ``q_proj`` rows get ``1 / rpn`` (the q heads sharing a KV head all get that KV head's
inverse: GQA-aware), and queries are multiplied by ``crs_q = 1 / crs_k`` **after** RoPE (inside the
decode kernel / the prefill path). So ``q . k`` is unchanged in exact arithmetic and the float model
is unchanged by ``apply_rpn``.

Decisions where the paper contradicts itself or is silent (each has a test):

1. **Magnitude convention.** The paper writes ``s = alpha * max||pair||`` and divides, bounding
   keys by ``1/alpha`` (= 1/8). A uniform factor only matters through the FP8 scale range: with
   ``|k| <= 1/8`` a token's scale ``amax / 7 <= 0.018`` sits at or below E4M3's smallest normal
   (2^-6 = 0.0156), in the 2^-9-step subnormal grid, and CRS alone would shrink outlier channels
   to ``1/beta`` next to unscaled regular channels (they would quantize to 0). We follow the
   released code (notes §8): multiply by ``alpha / max`` and ``beta / max``, bounding RPN pair
   norms by alpha and CRS channels by beta, so alpha/beta set where keys land relative to the
   FP8 scale grid. ``convention='paper'`` gives the paper's formula for comparison.
2. **"CRS inverse merged into q_proj"** cannot be exact (t_i != t_j within a pair does not commute
   with RoPE): the inverse is a post-RoPE per-channel multiply on Q (``crs_q``), as in the code.
3. **Outlier selection**: per KV head (Fig. 11 shows one head), by post-RoPE channel max, whole
   pairs. **top_k default** = head_dim // 16: 8 pairs for head_dim 128 (paper), 4 for head_dim 64
   (the same 1/8 of the pairs).
4. RPN on CRS pairs is 1 (the released code resets those pre-RoPE scales), so CRS sees raw keys.
5. Calibration statistic: max over the calibration tokens (paper); data = the batches given
   (the paper does not name its calibration set).
6. **Models with q/k norms (Qwen3)** normalise each head's keys between ``k_proj`` and RoPE, so a
   factor folded into ``k_proj`` would be divided out again, and ``k_norm``'s weight is one vector
   shared by every head while RPN's factors are per KV head. There RPN is applied **online**:
   ``apply_rpn`` multiplies it into the post-RoPE key multiplier (``crs_k <- crs_k * rpn``,
   ``rpn_online``), exact because RPN is one factor per pair and so commutes with the rotation;
   the keys are quantized exactly as with the folded form, and the query side gets ``1 / rpn``
   through ``crs_q`` in the same multiply it already does. The statistics are read after
   ``k_norm`` (the keys RoPE sees). On a Llama (both forms possible) the KV4-only perplexity of the two
   forms agrees within rounding; with W4A8 linears the folded form was 3 % better in perplexity there,
   as it also rescales the k_proj / q_proj rows before their weight quantization (``model`` section,
   session 37).

The RoPE pairing (half-split (i, i + D/2) for Llama, or interleaved) is read from
``lowbit.models.arch``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RopeKVParams", "calibrate_rpn_crs", "apply_rpn", "pair_channels", "default_top_k"]


@dataclass
class RopeKVParams:
    """One decoder layer's key smoothing. Tensors are fp32 ``[Hkv, head_dim]``; ``None`` = off."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    pairing: str
    rpn: torch.Tensor | None = None  # k_proj row multiplier (q_proj gets the inverse)
    crs_k: torch.Tensor | None = None  # post-RoPE key multiplier (1 outside the CRS pairs)
    pairs: torch.Tensor | None = None  # long [Hkv, top_k]: CRS pair indices
    rpn_applied: bool = False
    rpn_online: bool = False  # RPN multiplied into crs_k instead of folded (q/k-norm models, decision 6)

    @property
    def crs_q(self) -> torch.Tensor | None:
        return None if self.crs_k is None else 1.0 / self.crs_k

    def to(self, device) -> "RopeKVParams":
        for name in ("rpn", "crs_k", "pairs"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self


def default_top_k(head_dim: int) -> int:
    """8 CRS pairs for head_dim 128 (FireQ Fig. 10-11); the same 1/8 of the pairs otherwise."""
    return max(1, head_dim // 16)


def pair_channels(head_dim: int, pairing: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second) channel index of each RoPE pair, ``[head_dim/2]`` each."""
    i = torch.arange(head_dim // 2)
    if pairing == "half":
        return i, i + head_dim // 2
    if pairing == "interleaved":
        return 2 * i, 2 * i + 1
    raise ValueError(f"pairing must be 'half' or 'interleaved', got {pairing!r}")


def _rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    from lowbit.ops.kv4 import rotate

    return k * cos + rotate(k, pairing == "interleaved") * sin


@torch.no_grad()
def _key_stats(model, batches, views):
    """Per layer: (max pair norm [Hkv, D/2], post-RoPE max|k| [Hkv, D]) over the calibration tokens."""
    from lowbit.ptq.calibration import hooks

    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no model.rotary_emb: RoPE-aware smoothing needs a RoPE model")
    stats: dict[int, list] = {}
    ctx = {}

    def fn(name, mod, inp, out):
        v = views[name]
        B, S = out.shape[:2]  # k_proj: [B, S, Hkv * D]; k_norm: [B, S, Hkv, D]
        k = out.detach().float().reshape(B, S, v.num_kv_heads, v.head_dim)
        a, b = pair_channels(v.head_dim, v.pairing)
        pn = (k[..., a] ** 2 + k[..., b] ** 2).sqrt().flatten(0, 1).amax(0)  # [Hkv, D/2]
        cos, sin = ctx["cos"], ctx["sin"]  # [B, S, D]
        kr = _rope(k, cos.float()[:, :, None, :], sin.float()[:, :, None, :], v.pairing)
        mx = kr.abs().flatten(0, 1).amax(0)  # [Hkv, D]
        if name in stats:
            stats[name] = [torch.maximum(stats[name][0], pn), torch.maximum(stats[name][1], mx)]
        else:
            stats[name] = [pn, mx]

    device = next(model.parameters()).device
    mods = {v.index: v.key_module for v in views.values()}
    with hooks(mods, fn):
        for ids in batches:
            ids = ids.to(device)
            pos = torch.arange(ids.shape[1], device=device)[None].expand(ids.shape[0], -1)
            dummy = torch.empty(1, device=device, dtype=next(model.parameters()).dtype)
            ctx["cos"], ctx["sin"] = rotary(dummy, pos)
            model(input_ids=ids, use_cache=False)
    return stats


@torch.no_grad()
def calibrate_rpn_crs(model, batches, *, alpha: float = 8.0, beta: float = 8.0, top_k: int | None = None,
                      rpn: bool = True, crs: bool = True, convention: str = "code") -> list[RopeKVParams]:
    """Calibrate RPN and/or CRS on ``batches`` (list of ``[1, S]`` token ids). Returns one
    ``RopeKVParams`` per decoder layer; nothing in the model changes (see ``apply_rpn``)."""
    from lowbit.models.arch import decoder_layers

    if convention not in ("code", "paper"):
        raise ValueError(f"convention must be 'code' or 'paper', got {convention!r}")
    if alpha <= 0 or beta <= 0:
        raise ValueError(f"alpha and beta must be > 0, got {alpha}, {beta}")
    views = {}
    for v in decoder_layers(model):
        v.pairing = v.rope_pairing
        views[v.index] = v
    stats = _key_stats(model, batches, views)
    out = []
    for i, v in views.items():
        D, H = v.head_dim, v.num_kv_heads
        pn, mx = stats[i]
        a, b = pair_channels(D, v.pairing)
        p = RopeKVParams(i, v.num_heads, H, D, v.pairing)
        in_crs = torch.zeros(H, D // 2, dtype=torch.bool)
        if crs:
            k = top_k if top_k is not None else default_top_k(D)
            k = max(0, min(int(k), D // 2))
            score = torch.maximum(mx[:, a], mx[:, b])  # [H, D/2]
            p.pairs = score.topk(k, dim=1).indices.cpu()
            in_crs.scatter_(1, p.pairs, True)
            m = mx.cpu().clamp_min(1e-12)
            t = beta / m if convention == "code" else 1.0 / (beta * m)
            ch = torch.zeros(H, D, dtype=torch.bool)
            ch[:, a] = in_crs
            ch[:, b] = in_crs
            p.crs_k = torch.where(ch, t, torch.ones_like(t)).float()
        if rpn:
            m = pn.cpu().clamp_min(1e-12)
            r = alpha / m if convention == "code" else 1.0 / (alpha * m)
            r = torch.where(in_crs, torch.ones_like(r), r)
            full = torch.ones(H, D)
            full[:, a] = r
            full[:, b] = r
            p.rpn = full.float()
        out.append(p)
    return out


@torch.no_grad()
def apply_rpn(model, params: list[RopeKVParams]) -> list[RopeKVParams]:
    """Fold each layer's RPN into the weights: ``k_proj`` rows (and bias) times ``rpn``, ``q_proj``
    rows of every q head of the group times ``1 / rpn``. Exact for the float model. Idempotent
    (``rpn_applied``); must run before the projections are quantized. On layers with q/k norms
    RPN joins the post-RoPE multiplier instead (decision 6): ``crs_k *= rpn``, weights untouched."""
    from lowbit.models.arch import decoder_layers

    views = decoder_layers(model)
    for p in params:
        if p.rpn is None or p.rpn_applied:
            continue
        v = views[p.layer]
        if v.qk_norm:
            r = p.rpn.float()
            p.crs_k = r if p.crs_k is None else p.crs_k.float().to(r.device) * r
            p.rpn_applied = p.rpn_online = True
            continue
        for name, lin in (("k_proj", v.k_proj), ("q_proj", v.q_proj)):
            if not isinstance(lin, nn.Linear):
                raise TypeError(f"layer {p.layer} {name} is {type(lin).__name__}: apply RPN before quantizing linears")
        r = p.rpn.to(v.k_proj.weight.device, torch.float32)  # [Hkv, D]
        rk = r.reshape(-1)
        rq = r.repeat_interleave(p.num_heads // p.num_kv_heads, dim=0).reshape(-1)
        for lin, s in ((v.k_proj, rk), (v.q_proj, 1.0 / rq)):
            lin.weight.copy_((lin.weight.float() * s[:, None]).to(lin.weight.dtype))
            if lin.bias is not None:
                lin.bias.copy_((lin.bias.float() * s).to(lin.bias.dtype))
        p.rpn_applied = True
    return params
