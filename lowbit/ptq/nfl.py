"""Learned NormalFloat scales ("NFL"; FLUTE §4.2, "NF (learned)" rows of Tables 1-3).

The NF quantizer ``c = argmin_i |s * T_i - w|`` is refined on calibration text: the per-group
scales ``s`` are trained by gradient descent on the model's next-token loss, through a
straight-through estimator (STE) for the argmin, with every other parameter frozen:

    u = w / s,  q = T[nearest(u)],  W_hat = s * (u + (q - u).detach())
    => dW_hat/ds = q - u  (the LSQ gradient), dW_hat/dw unused (weights frozen).

Paper ambiguities (notes §1.4, §5.8), resolved here:
- granularity of the learned sigma: per *group* (one scale per group, initialised to the absmax
  scale, i.e. learned ``s * sigma_tilde / sigma`` stored directly; the FLUTE repository's
  ``learn_scales`` does the same). The table T stays NormalFloat, so the kernel is unchanged.
- optimizer and schedule: Adam, lr 1e-4, one pass over the calibration batches (the FLUTE
  repository's recipe: 128 x 2048 WikiText-2 tokens for Llama-3). For the embedded
  SmolLM2-135M we scale it down to ``calibration_batches(tok, n_samples=64, seq_len=512)``
  (32k tokens of the corpus tail, disjoint from the perplexity window); the scales train in
  float32 whatever the model dtype.
- which layers: every linear of the decoder layers (q/k/v/o/gate/up/down, and a Qwen2-MoE shared expert's
  gate/up/down; routed MoE experts are not trained: the recipes give them round-to-nearest scales); embeddings and
  lm_head stay in float.

Two entry modes:
- decoder linears are ``nn.Linear`` (float model): the STE above; afterwards each is replaced
  in place by ``LUTLinear.from_linear(..., scales=learned)`` (codes re-chosen under the learned
  scales, exactly as the training forward did);
- decoder linears are already ``LUTLinear`` (original weights gone): codes are frozen and only
  the scales train (``W_hat = T[c] * s``, ``dW_hat/ds = T[c]``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.formats.lut import make_table, nearest_codes
from lowbit.models.arch import decoder_layers


class _STELinear(nn.Module):
    """Training-time stand-in for one decoder linear: fake-quantized weight, learnable scales."""

    def __init__(self, src: nn.Module, *, bits: int, group_size: int, table):
        super().__init__()
        from lowbit.nn.lut import LUTLinear

        self.src = src
        self.group_size = group_size
        self.frozen_codes = isinstance(src, LUTLinear)
        if self.frozen_codes:
            self.bits = src.bits
            self.group_size = group_size = src.group_size
            self.k = src.in_features
            ng = src.scales.shape[0]
            kp = ng * group_size
            codes = src.codes()
            self.register_buffer("vals", F.pad(src.table.float()[codes.long()], (0, kp - self.k)))
            s0 = src.scales.t().float()
            self.bias = None if src.bias is None else src.bias.detach().float()
        else:
            self.bits = bits
            w = src.weight.detach().float()
            self.k = w.shape[1]
            ng = math.ceil(self.k / group_size)
            self.register_buffer("w", F.pad(w, (0, ng * group_size - self.k)).reshape(w.shape[0], ng, group_size))
            self.register_buffer("table", make_table(table, bits).to(w.device))
            s0 = self.w.abs().amax(-1) / self.table.abs().max()
            s0 = s0.clamp_min(1e-8)
            self.bias = None if src.bias is None else src.bias.detach().float()
        self.scales = nn.Parameter(s0.clone())
        self.register_buffer("s0", s0.clone())

    def weight_hat(self) -> torch.Tensor:
        s = self.scales.unsqueeze(-1)
        if self.frozen_codes:
            wh = self.vals.reshape(self.vals.shape[0], -1, self.group_size) * s
        else:
            u = self.w / s
            q = self.table[nearest_codes(u.detach(), self.table).long()]
            wh = s * (u + (q - u).detach())
        return wh.flatten(1)[:, :self.k]

    def forward(self, x):
        y = F.linear(x.float(), self.weight_hat(), self.bias)
        return y.to(x.dtype)


def learn_nf_scales(model, batches, *, lr: float = 1e-4, epochs: int = 1, seed: int = 0, progress: bool = True,
                    bits: int = 4, group_size: int = 128, table="nf", layers=None,
                    dtype: torch.dtype | None = None, skip=()) -> dict:
    """Learn per-group NF scales of every decoder linear on ``batches`` (list of [1, S] token
    ids) and quantize the model in place (see the module docstring). Returns a summary dict:
    ``steps``, ``loss_first``/``loss_last`` (mean of the first / last tenth of the steps),
    ``scale_rel_change`` (mean |s - s0| / s0), ``linears``, and the options used.

    ``bits``/``group_size``/``table`` apply to ``nn.Linear`` inputs (ignored for ``LUTLinear``);
    ``layers``: indices of decoder layers to quantize (default all); ``skip``: linear roles left
    as they are (e.g. ``("down_proj",)``); ``dtype``: LUTLinear activation dtype (default as
    ``LUTLinear.from_linear``).
    """
    from lowbit.nn.lut import LUTLinear

    if not batches:
        raise ValueError("batches must hold at least one [1, S] tensor of token ids")
    if lr <= 0 or epochs < 1:
        raise ValueError(f"need lr > 0 and epochs >= 1, got lr={lr}, epochs={epochs}")
    torch.manual_seed(seed)
    views = decoder_layers(model)
    if layers is not None:
        views = [views[i] for i in layers]
    device = next(model.parameters()).device
    was_training = model.training
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    stand_ins = []
    for v in views:
        for role, lin in (*v.linears().items(), *v.shared_linears().items()):  # (+ Qwen2-MoE's shared expert)
            if role.removeprefix("shared.") in skip:
                continue
            if not isinstance(lin, (nn.Linear, LUTLinear)):
                raise TypeError(f"layer {v.index} {role}: expected nn.Linear or LUTLinear, got {type(lin).__name__}")
            st = _STELinear(lin, bits=bits, group_size=group_size, table=table).to(device)
            v.set_linear(role, st)
            stand_ins.append((v, role, st))
    params = [st.scales for _, _, st in stand_ins]
    opt = torch.optim.Adam(params, lr=lr)
    order = list(range(len(batches)))
    g = torch.Generator().manual_seed(seed)
    losses = []
    total = epochs * len(batches)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="learn NF scales", unit="batch")
    model.eval()  # no dropout; gradients still flow to the scales
    try:
        for _ in range(epochs):
            perm = [order[i] for i in torch.randperm(len(order), generator=g).tolist()]
            for i in perm:
                ids = batches[i].to(device)
                if ids.ndim == 1:
                    ids = ids.unsqueeze(0)
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                with torch.no_grad():
                    for p in params:
                        p.clamp_(min=1e-8)
                losses.append(float(loss.detach()))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{losses[-1]:.4f}")
    finally:
        if bar is not None:
            bar.close()
        # convert to LUTLinear with the learned scales (also on error: never leave stand-ins behind)
        changes = []
        for v, role, st in stand_ins:
            s = st.scales.detach()
            changes.append(((s - st.s0).abs() / st.s0).mean().item())
            if st.frozen_codes:
                with torch.no_grad():
                    st.src.scales.copy_(s.t().to(st.src.scales.dtype))
                v.set_linear(role, st.src)
            else:
                v.set_linear(role, LUTLinear.from_linear(st.src, bits=st.bits, group_size=st.group_size,
                                                         table=table, dtype=dtype, scales=s))
        for p, f in flags.items():
            p.requires_grad_(f)
        model.train(was_training)
    tenth = max(1, len(losses) // 10)
    return {
        "steps": len(losses), "loss_first": sum(losses[:tenth]) / tenth, "loss_last": sum(losses[-tenth:]) / tenth,
        "scale_rel_change": sum(changes) / max(1, len(changes)), "linears": len(stand_ins),
        "bits": bits, "group_size": group_size, "lr": lr, "epochs": epochs, "seed": seed,
        "mode": "frozen-codes" if stand_ins and stand_ins[0][2].frozen_codes else "ste",
    }
