"""SnapMLA Table 2 study: how the latent-cache quantization granularity and RoPE handling change the
MLA attention output (digest 2.9).

Configurations (content part / RoPE part of the cached latent):
- ``ours``  per-token FP8 (s = amax/448 over the content) / bf16, pre-divided by s (SnapMLA);
- ``A``     per-token FP8 over all 576 dims, RoPE included (RoPE-unaware), query likewise;
- ``B``     per-tensor static FP8 with scale 1.0 / bf16;
- ``C``     per-tensor dynamic FP8 (one amax/448 for the whole cache) / bf16;
- ``D``     per-block FP8 (one amax/448 per 64-token block, FA3-style) / bf16;
- ``bf16``  the unquantized bf16 cache (floor of the bf16 path);
plus ``ours (kernel)``: the whole SnapMLA decode as lowbit runs it (FP8 query via Fused-Q-Quant,
per-block FP8 P, Triton kernel on the GPU or its emulating reference on the CPU).
For the six cache rows the query is bf16 and attention is computed in float64 on the dequantized
cache, so they isolate the cache format (with an FP8 query, its own error, the same for every
configuration, dominates and hides the differences); the kernel row is the whole FP8 pipeline
(FP8 query, FP8 cache, FP8 P). Metrics against float64 attention on the unquantized values, over the
``[H, 512]`` latent-space output: RMSE, cosine difference (1 - cos) and relative L2.

Data (SnapMLA Fig. 3 describes real LongCat caches: content tightly concentrated around zero,
RoPE part with a much wider range and outlier tails; the figure's numbers are lost, digest 2.3).
We build a DeepSeek-V3-shaped layer (hidden 7168, latent 512, RoPE 64, 128 heads; smaller with
``quick``) with random weights and inject outliers as follows:
1. hidden states h ~ N(0, 1) with 4 "massive activation" channels at 50x (as in LLM residuals);
2. content = RMSNorm(W_DKV h) * g * t, with the norm gain g ~ U(0.01, 0.05) per channel (content
   tightly concentrated around zero; the norm removes the hidden-state outliers) and a per-token
   factor t = exp(N(0, 1)) (ranges ~400x apart across tokens), so that the range varies across
   tokens as the paper says per-tensor scales cannot follow;
3. RoPE key = RoPE(W_KR h) (no norm in MLA), where 4 of the 32 rotary pairs (the low-frequency
   ones, as seen in real keys) get ``rope_outlier`` x larger weights, giving the wide-range,
   heavy-tailed RoPE part;
4. positions 0..L-1 with rope theta 10000; queries for 128 heads at position L-1: q_C ~ N(0, 1)/g
   and q_R ~ RoPE(N(0, 1)), each part scaled so that its share of the scaled score has std 2
   (content) and 1 (RoPE): a peaked, not one-hot, softmax in which the RoPE part matters.
The study sweeps ``rope_outlier`` in (1, 300, 3000, 30000) and reports each configuration at each. The
magnitudes (g, t, the outlier factors) are our choices, not the paper's (its Fig. 3 numbers are
lost): the table shows the mechanisms, not LongCat's numbers.
"""
from __future__ import annotations

import math

import torch

from lowbit.formats.common import FP8_E4M3, FP8_E4M3_MAX, round_to, safe_scale
from lowbit.formats.mla_fp8 import dequantize_latent, quantize_latent

DC, DR = 512, 64


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    ang = pos.double().unsqueeze(-1) * freq
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def make_layer_kv(L: int, H: int, *, hidden: int = 7168, rope_outlier: float = 30.0, seed: int = 0, device="cpu"):
    """(kv [L, 576] fp32, q [H, 576] fp32) from a DeepSeek-V3-shaped MLA layer (module docstring)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(L + 1, hidden, generator=g)
    h[:, :4] *= 50.0
    w_dkv = torch.randn(DC, hidden, generator=g) / math.sqrt(hidden)
    w_kr = torch.randn(DR, hidden, generator=g) / math.sqrt(hidden)
    out_pairs = torch.tensor([DR // 2 - 4, DR // 2 - 3, DR // 2 - 2, DR // 2 - 1])  # low-frequency pairs
    for j in out_pairs.tolist():
        w_kr[j] *= rope_outlier
        w_kr[j + DR // 2] *= rope_outlier
    c = h[:L] @ w_dkv.T
    c = c / c.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    gain = torch.rand(DC, generator=g) * 0.04 + 0.01
    tok = torch.exp(1.0 * torch.randn(L, 1, generator=g))
    c = c * gain * tok
    kr = _rope(h[:L] @ w_kr.T, torch.arange(L)).float()
    kv = torch.cat([c, kr], dim=-1)
    qc = torch.randn(H, DC, generator=g) / gain
    qr = _rope(torch.randn(H, DR, generator=g), torch.full((H,), L - 1)).float()
    # scale the two query parts so that the content scores have std 2 and the RoPE scores std 1
    # (after sm_scale): a peaked but not one-hot softmax, with the RoPE part mattering
    sm = (DC + DR) ** -0.5
    qc = qc * (2.0 / ((qc @ c.T) * sm).std())
    qr = qr * (1.0 / ((qr @ kr.T) * sm).std())
    q = torch.cat([qc, qr], dim=-1)
    return kv.to(device), q.to(device)


def _fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return round_to(x / scale, FP8_E4M3).double() * scale


def quantize_config(kv: torch.Tensor, config: str, block: int = 64) -> torch.Tensor:
    """Dequantized cache (float64 [L, 576]) of one Table-2 configuration."""
    c, r = kv[:, :DC].double(), kv[:, DC:]
    r_bf = r.to(torch.bfloat16).double()
    if config == "ours":
        return dequantize_latent(*quantize_latent(kv, DC), torch.float64)
    if config == "A":
        s = safe_scale(kv.abs().amax(-1), FP8_E4M3_MAX).double().unsqueeze(-1)
        return _fp8(kv.double(), s)
    if config == "B":
        return torch.cat([_fp8(c, torch.ones((), dtype=torch.float64)), r_bf], -1)
    if config == "C":
        s = safe_scale(c.abs().amax(), FP8_E4M3_MAX).double()
        return torch.cat([_fp8(c, s), r_bf], -1)
    if config == "D":
        L = c.shape[0]
        nb = -(-L // block)
        cp = torch.nn.functional.pad(c, (0, 0, 0, nb * block - L)).view(nb, block, DC)
        s = safe_scale(cp.abs().amax(dim=(1, 2)), FP8_E4M3_MAX).double().view(nb, 1, 1)
        return torch.cat([_fp8(cp, s).view(-1, DC)[:L], r_bf], -1)
    if config == "bf16":
        return kv.to(torch.bfloat16).double()
    raise ValueError(f"unknown config {config!r}")


def _attn(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    s = (q.double() @ kv.double().T) * (DC + DR) ** -0.5
    return torch.softmax(s, -1) @ kv[:, :DC].double()


def metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.double().flatten(), ref.double().flatten()
    d = out - ref
    cos = torch.dot(out, ref) / (out.norm() * ref.norm()).clamp_min(1e-300)
    return {"rmse": d.pow(2).mean().sqrt().item(), "cos_diff": (1 - cos).item(),
            "rel_l2": (d.norm() / ref.norm().clamp_min(1e-300)).item()}


def _kernel_row(kv: torch.Tensor, q: torch.Tensor, device) -> torch.Tensor:
    """Our decode as lowbit runs it: FP8 paged cache via Fused-K-Append, mla_decode (FP8 query,
    per-block FP8 P)."""
    from lowbit.ops.mla import mla_append, mla_decode

    L, page = kv.shape[0], 64
    pages = -(-L // page)
    cache = (torch.zeros(pages, page, DC, device=device, dtype=torch.float8_e4m3fn),
             torch.zeros(pages, page, DR, device=device, dtype=torch.bfloat16),
             torch.zeros(pages, page, device=device, dtype=torch.float32))
    mla_append(kv.to(device), cache, torch.arange(L, device=device))
    pt = torch.arange(pages, device=device, dtype=torch.int32).view(1, -1)
    sl = torch.tensor([L], device=device, dtype=torch.int32)
    o = mla_decode(q.to(device, torch.bfloat16).view(1, 1, -1, DC + DR), cache, pt, sl, max_seq_len=L)
    return o.view(-1, DC).double()


def run_study(device="cpu", quick: bool = False, outliers=(1.0, 300.0, 3000.0, 30000.0), kernel: bool = True) -> dict:
    """Table 2: for each RoPE outlier factor and configuration, RMSE / cos-diff / rel-L2 vs float64."""
    L, H, hidden = (512, 16, 1024) if quick else (4096, 128, 7168)
    rows = []
    for f in outliers:
        kv, q = make_layer_kv(L, H, hidden=hidden, rope_outlier=f, device=device)
        ref = _attn(q, kv)
        rng = {"content_absmax": kv[:, :DC].abs().max().item(), "rope_absmax": kv[:, DC:].abs().max().item(),
               "content_std": kv[:, :DC].std().item(), "rope_std": kv[:, DC:].std().item()}
        for cfg in ("ours", "A", "B", "C", "D", "bf16"):
            out = _attn(q.to(torch.bfloat16).double(), quantize_config(kv, cfg))
            rows.append({"rope_outlier": f, "config": cfg, **metrics(out, ref), **rng})
        if kernel:
            try:
                rows.append({"rope_outlier": f, "config": "ours (kernel)", **metrics(_kernel_row(kv, q, device), ref), **rng})
            except Exception as exc:  # the study must not die with the kernel
                rows.append({"rope_outlier": f, "config": "ours (kernel)", "rmse": float("nan"), "cos_diff": float("nan"),
                             "rel_l2": float("nan"), "error": f"{type(exc).__name__}: {exc}"[:200]})
    return {"L": L, "H": H, "hidden": hidden, "rows": rows}


def to_markdown(res: dict) -> str:
    lines = [f"L={res['L']}, H={res['H']}, hidden={res['hidden']}", "",
             "| RoPE outlier | config | RMSE | cos diff | rel L2 | content absmax | RoPE absmax |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['rope_outlier']:g} | {r['config']} | {r['rmse']:.3e} | {r['cos_diff']:.3e} | {r['rel_l2']:.3e} | "
                     f"{r.get('content_absmax', float('nan')):.3g} | {r.get('rope_absmax', float('nan')):.3g} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    res = run_study(device="cuda" if torch.cuda.is_available() else "cpu", quick="--quick" in sys.argv)
    print(to_markdown(res))
