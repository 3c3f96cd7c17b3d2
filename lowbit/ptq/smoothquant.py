"""SmoothQuant-style activation smoothing folded into the preceding RMSNorm (QServe §4 option;
SmoothQuant, Xiao et al. 2023, Eq. 4).

For the linears that read one RMSNorm's output (q/k/v after ``input_norm``, gate/up after
``post_norm``), per input channel j::

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)       (max|W_j| over all rows of those linears)
    X' = X / s   (folded: norm.weight /= s)       W' = W * s  (columns of each linear)

so ``X' W'^T = X W^T`` exactly in float, and per-token INT8 activations see fewer outlier
channels while the 4-bit weights absorb them. ``max|X_j|`` is taken on the norm's output over
the calibration batches. The digest (part 1.5) marks QServe's own use of activation smoothing as
unconfirmed; lowbit offers it as an option, off in the ``qserve`` recipe unless asked for.
Inputs of o_proj/down_proj have no norm to fold into and are left alone, as are mixture-of-experts MLPs
(their router and experts keep their inputs; only their attention is smoothed).
"""
from __future__ import annotations

import torch

from lowbit.models.arch import select_layers
from lowbit.ptq.calibration import reduce_stats

SCALE_MIN, SCALE_MAX = 1e-2, 1e2  # clamp s so a dead channel cannot blow up a weight column


def smoothquant_scales(x_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [K] from the activation absmax [K] and the weights [N_i, K] reading it."""
    w_absmax = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0)
    xa = x_absmax.float().to(w_absmax.device).clamp_min(1e-5)
    s = xa ** alpha / w_absmax.clamp_min(1e-5) ** (1 - alpha)
    return s.clamp(SCALE_MIN, SCALE_MAX)


@torch.no_grad()
def fold_smoothing(norm, linears, s: torch.Tensor) -> None:
    norm.weight.div_(s.to(norm.weight.device, norm.weight.dtype))
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight.device, lin.weight.dtype)[None, :])


@torch.no_grad()
def apply_smoothquant(model, batches, layers=None, alpha: float = 0.5) -> dict:
    """Calibrate on ``batches`` and fold smoothing scales into both RMSNorms of each layer, in
    place. Returns ``{"alpha", "layers": {i: {"attn": s [hidden], "mlp": s [hidden]}}}``.
    Must run before the linears are quantized (they must still be float ``nn.Linear``)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    views, idx = select_layers(model, layers)
    for i in idx:
        for role in ("q_proj", "k_proj", "v_proj") + (("gate_proj", "up_proj") if views[i].experts is None else ()):
            w = getattr(getattr(views[i], role), "weight", None)
            if not isinstance(w, torch.Tensor) or not w.is_floating_point():
                raise ValueError(f"layer {i}: {role} must be a float nn.Linear (apply SmoothQuant before quantizing)")
    mods = {}
    for i in idx:
        mods[f"{i}.attn"] = views[i].input_norm
        if views[i].experts is None:  # a mixture-of-experts MLP is not smoothed (its inputs stay as they are)
            mods[f"{i}.mlp"] = views[i].post_norm
    stats = reduce_stats(model, batches, mods, lambda y: y.abs().flatten(0, -2).amax(0), on="output", reduce="max")
    out = {"alpha": alpha, "layers": {}}
    for i in idx:
        v = views[i]
        res = {}
        parts = [("attn", v.input_norm, [v.q_proj, v.k_proj, v.v_proj])]
        if v.experts is None:
            parts.append(("mlp", v.post_norm, [v.gate_proj, v.up_proj]))
        for part, norm, lins in parts:
            s = smoothquant_scales(stats[f"{i}.{part}"], [lin.weight for lin in lins], alpha)
            fold_smoothing(norm, lins, s)
            res[part] = s.cpu()
        out["layers"][i] = res
    return out
