"""Channel-wise Absmean Scaling (CAS), FireQ Definition 3.1.

For a linear ``Y = X W^T`` (``W [N_out, N_in]``) CAS rescales the *input channels*::

    W_bar = W Lambda,   Lambda = diag(lambda_i),   lambda_i = (w_bar / absmean(W[:, i])) ^ alpha
    Y = (X Lambda^-1) (W Lambda)^T                 (Eq. 7: exact in float)

``Lambda`` is folded into the weights before INT4 quantization and ``Lambda^-1`` into whatever
produces ``X``, offline, so the float function is unchanged (tested) and there is no runtime
cost. Consumers of one input share one ``Lambda`` (absmean over their concatenated rows).

Placement of ``Lambda^-1`` per projection of a Llama decoder layer (Fig. 1 is not in the text; our
choice, all exact):

============  ==============================  ==============================================
projections   absmean over                     Lambda^-1 folded into
============  ==============================  ==============================================
``qkv``       [q; k; v] columns (hidden)       ``input_layernorm.weight`` (RMSNorm gamma)
``gate_up``   [gate; up] columns (hidden)      ``post_attention_layernorm.weight``
``down``      down columns (intermediate)      ``up_proj`` rows: h = silu(g) * u is linear in u
``o``         o columns, averaged over the     ``v_proj`` rows: o's input channel (head h, d)
              q heads that share a KV head     is sum_t p_t v[t, kv(h), d]; with GQA all q heads
                                               of a KV head must share lambda, hence the average
============  ==============================  ==============================================

Target ``w_bar`` (the paper gives none; the released code uses hand-set constants per model,
0.0096 for gate/up and 0.015 for down of Llama-3-8B): we use the geometric mean of the group's
channel absmeans, so ``prod(lambda) = 1``: the weights keep their overall magnitude (and PTS's
exponent stays meaningful) for any model. ``alpha`` (default 1.0 = the paper's full equalization)
softens it; ``lambda`` is clamped to ``[1/max_scale, max_scale]`` so dead channels (absmean 0)
cannot blow up.

Exceptions: FireQ's code disables CAS for qkv and o (and the paper sets its Lambda_1 "constant for
quantization stability"). ``projections`` selects which groups get CAS. The default is all four:
on the embedded SmolLM2-135M (all linears w4a8-fp8, 8192 tokens, H200) CAS on all four gave
perplexity 19.53 versus 19.77 with FireQ's (gate_up, down) only and 22.34 without CAS
(``benchmarks/results/h200/w4a8_fp8_accuracy.json``); pass ``projections=("gate_up", "down")`` for FireQ's
choice.
"""
from __future__ import annotations

import torch

ALL_PROJECTIONS = ("qkv", "o", "gate_up", "down")
DEFAULT_PROJECTIONS = ALL_PROJECTIONS


def cas_scales(weights: list[torch.Tensor], *, alpha: float = 1.0, max_scale: float = 64.0,
               pool: int = 1) -> torch.Tensor:
    """lambda [N_in] (float32) for the weights sharing one input (Definition 3.1, rule above).

    ``pool > 1`` averages the absmeans over ``pool`` channel blocks (GQA: the q heads of one KV head;
    the absmean vector is viewed as [pool, N_in / pool] and averaged over dim 0) and tiles the result.
    """
    w = torch.cat([x.detach().float() for x in weights], dim=0)
    a = w.abs().mean(dim=0)
    if pool > 1:
        a = a.reshape(pool, -1).mean(0).repeat(pool)
    return _scales_from_absmean(a, alpha=alpha, max_scale=max_scale)


def _scales_from_absmean(a: torch.Tensor, *, alpha: float, max_scale: float) -> torch.Tensor:
    """lambda from the per-input-channel absmeans ``a`` (the rule of ``cas_scales``)."""
    pos = a[a > 0]
    if pos.numel() == 0:
        return torch.ones_like(a)
    target = pos.log().mean().exp()
    lam = (target / a.clamp_min(target / max_scale)) ** alpha
    return lam.clamp(1.0 / max_scale, max_scale)


def _mul(w: torch.Tensor, s: torch.Tensor) -> None:
    """``w *= s`` in place, computed in float32 and rounded once to ``w``'s dtype (``s`` broadcast against ``w``)."""
    w.copy_((w.float() * s.to(w.device)).to(w.dtype))


def _scale_cols(lin, lam):
    _mul(lin.weight.data, lam[None, :])


def _scale_rows(lin, inv):
    _mul(lin.weight.data, inv[:, None])
    if getattr(lin, "bias", None) is not None:
        _mul(lin.bias.data, inv)


def _scale_norm(norm, inv):
    _mul(norm.weight.data, inv)


def _is_float_linear(m) -> bool:
    return isinstance(m, torch.nn.Linear)


def _cas_experts(v, projections, lambdas: dict, *, alpha: float, max_scale: float) -> None:
    """CAS on a mixture-of-experts MLP (``v.experts``: 3-D ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``;
    a shared expert's gate / up join the gate_up group and its gate linear is scaled exactly, as the router; its
    down gets its own Lambda).
    ``down``: each expert its own Lambda (its down columns, its up rows), as a dense layer. ``gate_up``: the router
    and every expert read the one ``post_norm`` output, so they share one Lambda, computed over all experts'
    gate_up rows (the rule of ``cas_scales``) and folded into each expert's gate_up columns and, exactly, into the
    float router's columns (the routing logits are unchanged up to rounding); Lambda^-1 goes into the norm."""
    from lowbit.nn.moe import experts_weights

    gu, dn = experts_weights(v.experts)
    E, two_i, _ = gu.shape
    inter = two_i // 2
    sh = v.shared_expert
    if "down" in projections:
        for e in range(E):
            lam = cas_scales([dn[e]], alpha=alpha, max_scale=max_scale)
            _mul(dn.data[e], lam[None, :])
            _mul(gu.data[e, inter:], (1.0 / lam)[:, None])
            lambdas[(v.index, f"down.{e}")] = lam
        if sh is not None:  # the shared expert's down: its own Lambda, as a dense layer's
            lam = cas_scales([sh.down_proj.weight], alpha=alpha, max_scale=max_scale)
            _scale_cols(sh.down_proj, lam)
            _scale_rows(sh.up_proj, 1.0 / lam)
            lambdas[(v.index, "down.shared")] = lam
    if "gate_up" in projections:
        sums = sum(gu.data[e].float().abs().sum(0) for e in range(E))  # one expert at a time in float32
        rows = E * two_i
        if sh is not None:  # the shared expert's gate / up rows read the same input: the same Lambda
            sums = sums + sh.gate_proj.weight.detach().float().abs().sum(0) + sh.up_proj.weight.detach().float(
            ).abs().sum(0)
            rows += sh.gate_proj.weight.shape[0] + sh.up_proj.weight.shape[0]
        lam = _scales_from_absmean(sums / rows, alpha=alpha, max_scale=max_scale)
        for e in range(E):
            _mul(gu.data[e], lam[None, :])
        _scale_cols(v.router, lam)
        if sh is not None:
            for m in (sh.gate_proj, sh.up_proj, v.shared_gate):  # the float gate exactly, as the router
                _scale_cols(m, lam)
        _scale_norm(v.post_norm, 1.0 / lam)
        lambdas[(v.index, "gate_up")] = lam


@torch.no_grad()
def apply_cas(model, layers=None, *, projections=DEFAULT_PROJECTIONS, alpha: float = 1.0,
              max_scale: float = 64.0) -> dict:
    """Apply CAS in place to the float decoder layers (``lowbit.models.arch.decoder_layers``) of
    ``model`` before quantization. ``layers``: indices (default all). Returns
    ``{"projections": [...], "lambdas": {(layer, group): lambda}, "max_ratio": float}``."""
    from lowbit.models.arch import decoder_layers

    bad = set(projections) - set(ALL_PROJECTIONS)
    if bad:
        raise ValueError(f"projections must be drawn from {ALL_PROJECTIONS}, got {sorted(bad)}")
    views = decoder_layers(model)
    if layers is not None:
        keep = set(layers)
        views = [v for v in views if v.index in keep]
    lambdas = {}
    for v in views:
        lin = v.linears()
        shared = [getattr(v.shared_expert, r) for r in ("gate_proj", "up_proj", "down_proj")] if v.shared_expert \
            is not None else []
        if not all(_is_float_linear(m) for m in (*lin.values(), *shared)) or (
                v.experts is not None and not hasattr(v.experts, "gate_up_proj")):
            raise TypeError(f"layer {v.index}: apply_cas must run on float nn.Linear layers, before quantization")
        # o and down first: their Lambda^-1 rescales v / up rows, which the shared-input groups
        # (qkv, gate_up) then see, so every group ends equalized
        if "o" in projections:
            groups = v.num_heads // v.num_kv_heads
            # o's columns [num_heads * head_dim] -> [kv, group, d]; pool over the group's heads
            a = v.o_proj.weight.detach().float().abs().mean(0).reshape(v.num_kv_heads, groups, v.head_dim).mean(1)
            lam_kv = _scales_from_absmean(a.flatten(), alpha=alpha, max_scale=max_scale).reshape(a.shape)  # [kv, d]
            lam = lam_kv[:, None, :].expand(v.num_kv_heads, groups, v.head_dim).reshape(-1)
            _scale_cols(v.o_proj, lam)
            _scale_rows(v.v_proj, 1.0 / lam_kv.reshape(-1))
            lambdas[(v.index, "o")] = lam
        if "down" in projections and v.experts is None:
            lam = cas_scales([v.down_proj.weight], alpha=alpha, max_scale=max_scale)
            _scale_cols(v.down_proj, lam)
            _scale_rows(v.up_proj, 1.0 / lam)
            lambdas[(v.index, "down")] = lam
        if "qkv" in projections:
            lam = cas_scales([v.q_proj.weight, v.k_proj.weight, v.v_proj.weight], alpha=alpha, max_scale=max_scale)
            for m in (v.q_proj, v.k_proj, v.v_proj):
                _scale_cols(m, lam)
            _scale_norm(v.input_norm, 1.0 / lam)
            lambdas[(v.index, "qkv")] = lam
        if v.experts is not None:  # an MoE MLP: per-expert down groups; one gate_up Lambda for all experts
            _cas_experts(v, projections, lambdas, alpha=alpha, max_scale=max_scale)
            continue
        if "gate_up" in projections:
            lam = cas_scales([v.gate_proj.weight, v.up_proj.weight], alpha=alpha, max_scale=max_scale)
            for m in (v.gate_proj, v.up_proj):
                _scale_cols(m, lam)
            _scale_norm(v.post_norm, 1.0 / lam)
            lambdas[(v.index, "gate_up")] = lam
    ratio = max((float(l.max() / l.min()) for l in lambdas.values()), default=1.0)
    return {"projections": list(projections), "lambdas": lambdas, "max_ratio": ratio}
