"""SnapMLA's RoPE-aware per-token FP8 latent format (SnapMLA §3.1, digest part 2.3-2.4).

MLA caches, per token, the latent ``[c | k_R]``: the content part ``c`` (``kv_lora_rank`` = 512 for
DeepSeek-V3) and the decoupled RoPE key ``k_R`` (``qk_rope_head_dim`` = 64), shared by all heads.
In absorbed decoding the same latent is the key (all 576 dims) and the value (the 512 content dims).

Stored fields for one token (three tensors, as the authors' code; digest 2.4):

    content  float8_e4m3fn [..., Dc]   ĉ = FP8(c / s)              (clamped to +-448, RNE)
    scale    float32       [...]       s = max(amax(|c|), AMAX_EPS) / 448   (lowbit's safe scale rule)
    rope     bfloat16      [..., Dr]   k̃_R = BF16(k_R / s)          RoPE part *pre-divided* by s

so that ``dequant = [ĉ * s | k̃_R * s]`` and, for a query quantized the same way per (token, head)
(``q̂_C = FP8(q_C / s_q)``, ``q̃_R = q_R / s_q``), the absorbed score is

    q · k = s_q * s_k * ( ĉ_q · ĉ_k  +  q̃_R · k̃_R )

with all 9 groups (8 FP8 content groups + 1 bf16 RoPE group) summed in ONE fp32 accumulator
("pre-scaled domain alignment", SnapMLA Eq. 6 / digest 2.3) and the two scales applied once after.

Decisions where the sources are silent or contradict themselves (each has a test):
- scale formula: the paper gives none; the authors' fallback code uses amax/448 clamped at 1e-26.
  We use lowbit's one rule ``safe_scale`` (clamp amax at AMAX_EPS = 1e-12): an all-zero latent
  gives codes 0 and a finite 1/s (<= 4.5e14), so the pre-divided RoPE part stays finite in bf16
  (with the 1e-26 clamp it would be ~4.5e28 * k_R: digest 2.12 item 3).
- a non-finite content element (Inf or NaN) gives the token a NaN scale, so the attention outputs that read it
  are NaN as in a bf16 cache (the kernels' maxima skip NaN: ``lowbit.kernels.act_quant.abs_or_inf``).
- the scale covers the content part only (RoPE never enters amax): the RoPE part keeps its own
  range in bf16, which is the point of the scheme (SnapMLA Fig. 3).
- the pre-divided RoPE part is re-rounded to bf16 (relative error <= 2^-9 on top of bf16); the
  paper calls it "unquantized" and does not mention this rounding (digest 2.12 item 3).
- memory: Dc + 4 + 2*Dr bytes per token per layer = 644 B for DeepSeek-V3 (1152 B in bf16).
"""
from __future__ import annotations

import torch

from lowbit.formats.common import FP8_E4M3, FP8_E4M3_MAX, inf_to_nan, round_to, safe_scale

__all__ = ["quantize_latent", "dequantize_latent", "quantize_q", "dequantize_q", "bytes_per_token"]

# Decode numerics shared by the kernel and its reference emulation (lowbit.kernels.mla_decode,
# lowbit.ops.mla): in the lazy online softmax a P scale that must grow is set this many times past
# the need, so that it moves again only rarely (the FP8 P then peaks at 448 / 4 = 112).
P_SCALE_HEADROOM = 4.0


def _split(x: torch.Tensor, dc: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 < dc < x.shape[-1]:
        raise ValueError(f"kv_lora_rank ({dc}) must be in (0, {x.shape[-1]}) for last dim {x.shape[-1]}")
    return x[..., :dc], x[..., dc:]


def quantize_latent(kv: torch.Tensor, kv_lora_rank: int):
    """``kv [..., Dc + Dr]`` (content then RoPE) -> (content fp8 [..., Dc], scale fp32 [...],
    rope bf16 [..., Dr] pre-divided by the scale). Plain-PyTorch reference of Fused-K-Append."""
    c, r = _split(kv.float(), kv_lora_rank)
    # safe_scale's rule, max(amax, AMAX_EPS) / 448, computed as a multiply by the fp32 constant 1/448:
    # CUDA PyTorch divides by a Python scalar that way and CPU PyTorch divides exactly, so the
    # multiply is what every device (and the Triton kernels) rounds alike
    amax = c.abs().amax(dim=-1)
    amax = inf_to_nan(amax)  # an Inf or NaN in the content: NaN scale
    s = safe_scale(amax, 1.0) * (1.0 / FP8_E4M3_MAX)
    inv = 1.0 / s.unsqueeze(-1)
    return round_to(c * inv, FP8_E4M3), s, (r * inv).to(torch.bfloat16)


def dequantize_latent(content: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_latent``: ``[ĉ s | k̃_R s]`` of shape [..., Dc + Dr] in ``dtype``
    (computed in fp32, or float64 when ``dtype`` is float64)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s = scale.to(acc).unsqueeze(-1)
    return torch.cat([content.to(acc) * s, rope.to(acc) * s], dim=-1).to(dtype)


def quantize_q(q: torch.Tensor, kv_lora_rank: int):
    """Fused-Q-Quant reference: absorbed query ``q [..., Dc + Dr]`` -> (q_nope fp8 [..., Dc],
    q_scale fp32 [...], q_rope bf16 [..., Dr] pre-divided by q_scale); one scale per (token, head)
    over the content part, same rule as the latent."""
    return quantize_latent(q, kv_lora_rank)


dequantize_q = dequantize_latent


def bytes_per_token(kv_lora_rank: int = 512, rope_dim: int = 64, fp8: bool = True) -> int:
    """Cache bytes per token per layer: 644 (fp8) or 1152 (bf16) for DeepSeek-V3."""
    return kv_lora_rank + 4 + 2 * rope_dim if fp8 else 2 * (kv_lora_rank + rope_dim)
