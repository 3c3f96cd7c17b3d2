"""Quantized prefill attention: the ONE reference of its operand formats and of its numerics.

Operand formats (every tensor keeps the attention layout ``[B, H, S, D]``)
--------------------------------------------------------------------------
``Q``, ``K``: symmetric, one scale per token per head (INT-FlashAttention §3.2, FireQ App. D)::

    codes  int8 or float8_e4m3fn [B, H, S, D]
    scale  float32 [B, H, S]          scale = max(amax, AMAX_EPS) / qmax  (lowbit.formats.common)

``V`` (INT8 or FP8 E4M3), one scale per channel per block of ``v_block`` tokens::

    codes  [B, H, S, D]
    scale  float32 [B, H, cdiv(S, v_block), D]

  ``v_granularity="channel"`` (the int8 default; the authors' stated future work, and what their
  CUDA code does): amax over the ``v_block`` tokens of each channel. ``"block"``: one scale per ``v_block`` tokens (the fp8 default, ``[B, H, NB]``).
  ``"tensor"`` (the paper's Algorithm 1): one amax per (batch, head) over all tokens and
  channels, written into every entry so both share one layout. A per-channel scale factors out
  of the sum over tokens in ``P V``, so the kernel
  multiplies the ``[BLOCK_M, D]`` block product once per KV block (``BLOCK_N`` divides ``v_block``).

``P`` (the softmax numerator, always taken against the **running** row max ``m``, Algorithm 1):

* INT8 (``mode="int8"``): ``P = round(127 * exp(S - m))`` in [0, 127], i.e. the fixed scale
  S_P = 1/R with R = 127 (the paper's "R = 256" in §3.2 would overflow INT8; the digest §1.3).
  Rounding is to nearest even (the fp32 adder with 1.5*2^23, as everywhere in lowbit). The exp2
  argument is ``S2 - (m - log2 127) - (|m| + c q_s) 2^-21``: the small margin (< 2^-11 for
  |m| < 1024, and it cancels in O = acc / l) bounds the fp32 rounding of m and of the one-FFMA
  argument, so the row max never rounds to 128 (which would wrap) and no per-score clamp is
  needed; c q_s is the offset of the per-block-K form (0 with per-token K).
  ``l`` is summed from the **quantized** P (Algorithm 1 line 13; their Triton code sums the
  float P instead): numerator and denominator then carry the same rounding and the factor R
  cancels in O = acc / l. Option ``p_block`` (not the paper): P against the *block's* row max
  ``m_b`` instead, ``P = round(127 exp(S - m_b))``, and the block's P V and row sum are multiplied
  by ``beta = exp(m_b - m) <= 1`` in fp32: a block far below the running max (e.g. after an
  attention sink) keeps 7 bits instead of rounding to zero.
* FP8 (``mode="fp8"``): ``P = fp8(256 * exp(S - m))``: 256 = 2^8 is exact, keeps P <= 256 < 448
  (no overflow, the running max makes exp(S - m) <= 1), and moves the small probabilities out of
  E4M3's subnormal range (down to 2^-17 of the row max instead of 2^-9). ``l`` is summed from the
  fp32 P (as FlashAttention-3); the 256 cancels in O = acc / l.
* ``mode="int8-qk"`` (half-INT8): P in the input's 16-bit float dtype, V unquantized.
* ``mode="fp8-kv4"``: K and V are KV4 (``lowbit.formats.kv4``: INT4 codes, per-token FP8 scales).
  The INT4 codes are exact in FP8; the K scale multiplies the columns of S; the per-token V scale
  cannot leave the sum over tokens, so it is folded into P as ``P * (s_v / max_block(s_v))``
  (still <= 256) and the block max multiplies the block product.

Scores use log2 units: ``S2 = (q_code . k_code) * (q_scale * sm_scale * log2(e)) * k_scale`` and
``exp2``; the 1/sqrt(d) temperature, absent from INT-FlashAttention's equations, is folded into
the Q scale. ``attention_quant_ref`` below replays the kernel's block loop in float32 (same block
size, same running max, same roundings), so the kernel must match it to accumulation order.
"""
from __future__ import annotations

import math

import torch

from lowbit.formats.common import FP8_E4M3, INT8_MAX, QMAX, round_to, safe_scale

__all__ = [
    "MODES", "V_BLOCK", "P_SCALE_FP8", "P_SCALE_INT8", "LOG2E",
    "quantize_qk", "quantize_k_block", "quantize_v", "dequantize_v", "quantize_p_int8", "quantize_p_fp8",
    "quantize_qkv", "kv4_to_fp8_blocks", "attention_quant_ref", "mre",
]

MODES = ("fp8", "int8", "int8-qk", "fp8-kv4")
V_BLOCK = 128  # tokens per V scale block (default)
V_GRANULARITIES = ("channel", "block", "tensor")
P_SCALE_FP8 = 256.0  # P in FP8 is stored as 256 * exp(S - m)  (2^8: exact, <= 448)
P_SCALE_INT8 = INT8_MAX  # R = 127
LOG2E = 1.4426950408889634
_RNE_MAGIC = 12582912.0  # 1.5 * 2^23


def _code_dtype(mode: str) -> torch.dtype:
    return torch.int8 if mode in ("int8", "int8-qk") else FP8_E4M3


def quantize_qk(x: torch.Tensor, dtype: torch.dtype):
    """Per token per head: x [..., S, D] -> (codes [..., S, D], scale float32 [..., S]).

    ``lowbit.formats.common``'s scale rule; the codes are ``cast(clamp(x * (1 / scale)))`` with the
    reciprocal rounded once per scale (IEEE), so the kernels multiply instead of dividing per
    element (the division's slow path dominated the memory-bound quantization kernels).
    """
    if dtype not in QMAX:
        raise ValueError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    xf = x.float()
    scale = safe_scale(xf.abs().amax(dim=-1), QMAX[dtype])
    return round_to(xf * (1.0 / scale).unsqueeze(-1), dtype), scale


def quantize_k_block(x: torch.Tensor, dtype: torch.dtype, block: int):
    """One scale per block of ``block`` tokens per head: x [B, H, S, D] -> (codes, scale [B, H, cdiv(S, block)])."""
    B, H, S, D = x.shape
    nb = -(-S // block)
    xf = x.float()
    pad = nb * block - S
    xp = torch.nn.functional.pad(xf, (0, 0, 0, pad)) if pad else xf
    scale = safe_scale(xp.abs().reshape(B, H, nb, block * D).amax(dim=-1), QMAX[dtype])
    rcp = (1.0 / scale).repeat_interleave(block, dim=2)[:, :, :S]
    return round_to(xf * rcp.unsqueeze(-1), dtype), scale


def quantize_v(v: torch.Tensor, dtype: torch.dtype, *, granularity: str = "channel", block: int = V_BLOCK):
    """V [B, H, S, D] -> (codes [B, H, S, D], scale float32).

    ``granularity``: ``"channel"`` (per channel per ``block`` tokens, scale ``[B, H, NB, D]``),
    ``"block"`` (one scale per ``block`` tokens, ``[B, H, NB]``) or ``"tensor"`` (one per batch and
    head, the paper's S_V, written into every block: ``[B, H, NB]``); NB = cdiv(S, block).
    """
    if granularity not in V_GRANULARITIES:
        raise ValueError(f"v_granularity must be one of {V_GRANULARITIES}, got {granularity!r}")
    if dtype not in QMAX:
        raise ValueError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    if block <= 0:
        raise ValueError(f"v_block must be positive, got {block}")
    B, H, S, D = v.shape
    nb = -(-S // block)
    vf = v.float()
    pad = nb * block - S
    vp = torch.nn.functional.pad(vf, (0, 0, 0, pad)) if pad else vf
    amax = vp.abs().reshape(B, H, nb, block, D).amax(dim=3)  # [B, H, nb, D]
    if granularity == "block":
        amax = amax.amax(dim=3)
    elif granularity == "tensor":
        amax = amax.amax(dim=(2, 3), keepdim=True)[..., 0].expand(B, H, nb)
    scale = safe_scale(amax, QMAX[dtype]).contiguous()
    rcp = (1.0 / scale).repeat_interleave(block, dim=2)[:, :, :S]
    if rcp.ndim == 3:
        rcp = rcp.unsqueeze(-1)
    return round_to(vf * rcp, dtype), scale


def dequantize_v(codes: torch.Tensor, scale: torch.Tensor, *, block: int = V_BLOCK) -> torch.Tensor:
    S = codes.shape[2]
    full = scale.repeat_interleave(block, dim=2)[:, :, :S]
    return codes.float() * (full if full.ndim == 4 else full.unsqueeze(-1))


def quantize_p_int8(p127: torch.Tensor) -> torch.Tensor:
    """``p127 = 127 * exp(S - m)`` in [0, 127] (fp32) -> the rounded values (fp32 integers)."""
    return (p127 + _RNE_MAGIC) - _RNE_MAGIC


def quantize_p_fp8(p256: torch.Tensor) -> torch.Tensor:
    """``p256 = 256 * exp(S - m)`` in [0, 256] -> FP8 E4M3 (RNE; never clips: 256 < 448)."""
    return p256.to(FP8_E4M3)


def quantize_qkv(q, k, v, *, mode: str, v_granularity: str = "channel", v_block: int = V_BLOCK,
                 k_block: int | None = None):
    """Quantize the three operands as the kernels do. Returns a dict of codes and scales.

    ``k_block``: one K scale per block of ``k_block`` keys (must equal the kernel's BLOCK_N)
    instead of one per key; the kernel then folds it into the per-row Q scale.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    dt = _code_dtype(mode)
    qc, qs = quantize_qk(q, dt)
    out = {"mode": mode, "q": qc, "q_scale": qs, "v_block": v_block}
    if mode == "fp8-kv4":
        from lowbit.formats.kv4 import quantize_kv4

        out["k"], out["k_scale"], _ = quantize_kv4(k)
        out["v"], out["v_scale"], _ = quantize_kv4(v)
        return out
    if k_block:
        out["k"], out["k_scale"] = quantize_k_block(k, dt, k_block)
        out["k_block"] = k_block
    else:
        out["k"], out["k_scale"] = quantize_qk(k, dt)
    if mode == "int8-qk":
        out["v"], out["v_scale"] = v, None
    else:
        out["v"], out["v_scale"] = quantize_v(v, dt, granularity=v_granularity, block=v_block)
    return out


def kv4_to_fp8_blocks(k_codes, k_scale, v_codes, v_scale, *, block: int = 128) -> dict:
    """``fp8-kv4`` default path: dequantize KV4 (code * scale, fp32) and requantize K and V to
    FP8 with one scale per ``block`` keys (the ``fp8`` scheme's operands). Returns the K/V
    entries of a ``quantize_qkv`` dict (V codes [B, H, S, D], scales [B, H, NB])."""
    from lowbit.formats.kv4 import dequantize_kv4

    k = dequantize_kv4(k_codes, k_scale, dtype=torch.float32)
    v = dequantize_kv4(v_codes, v_scale, dtype=torch.float32)
    kc, ks = quantize_k_block(k, FP8_E4M3, block)
    vc, vs = quantize_v(v, FP8_E4M3, granularity="block", block=block)
    return {"k": kc, "k_scale": ks, "k_block": block, "v": vc, "v_scale": vs, "v_block": block}


def _expand(t: torch.Tensor, hq: int) -> torch.Tensor:
    rep = hq // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _int8_sub(s0: torch.Tensor, cq) -> torch.Tensor:
    """The INT8 P's row constant: ``(s0 - log2 127) + (|s0| + c q_s) 2^-21`` (fp32), the rounding
    margin that keeps every code <= 127 without a clamp (module docstring)."""
    return (s0 - math.log2(P_SCALE_INT8)) + (s0.abs() + cq) * 2.0 ** -21


def _h(x: torch.Tensor) -> torch.Tensor:
    """fp16 rounding (RNE), back in fp32."""
    return x.to(torch.float16).float()


def attention_quant_ref(qq: dict, *, causal: bool, sm_scale: float, block_n: int = 128,
                        out_dtype: torch.dtype = torch.float32, p_block: bool = False,
                        exp16: bool = False) -> torch.Tensor:
    """Replay the kernel's numerics in float32 on operands from ``quantize_qkv``.

    Loop over KV blocks of ``block_n`` keys with the running max ``m``, ``alpha = exp2(m_old - m)``,
    P quantized per ``mode`` (module docstring), ``acc = acc * alpha + (P V_block) * v_scale`` and
    O = acc / l. ``exp16`` (fp8): the softmax numerator from an fp16 exponential of the
    fp16-rounded argument (the kernel's ``ex2.approx.f16x2``, emulated as exact exp2): P =
    h(2^h(x + 8)), l sums those. Returns ``[B, Hq, Sq, D]`` in ``out_dtype``.
    """
    if exp16 and qq["mode"] != "fp8":
        raise ValueError(f"exp16 applies to mode fp8 only, got {qq['mode']!r}")
    mode = qq["mode"]
    qc, qs = qq["q"], qq["q_scale"]
    B, Hq, Sq, D = qc.shape
    if mode == "fp8-kv4":
        from lowbit.formats.int4 import unpack_int4

        kf = unpack_int4(qq["k"], signed=True).float()
        vf = unpack_int4(qq["v"], signed=True).float()
        ks = qq["k_scale"].float()
        vtok = _expand(qq["v_scale"].float(), Hq)
    else:
        kf, ks = qq["k"].float(), qq["k_scale"].float()
        vf = qq["v"].float()
        if mode == "int8-qk":
            vf = qq["v"]  # 16-bit float
    Skv = kf.shape[2]
    kf, ks, vf = _expand(kf, Hq), _expand(ks, Hq), _expand(vf, Hq)
    vsc = _expand(qq["v_scale"], Hq) if mode in ("fp8", "int8") else None
    v_block = qq.get("v_block", V_BLOCK)
    if mode in ("fp8", "int8") and v_block % block_n:
        raise ValueError(f"block_n ({block_n}) must divide v_block ({v_block})")
    qk_scale = (qs.float() * (sm_scale * LOG2E)).unsqueeze(-1)  # [B, H, Sq, 1]
    dots = torch.matmul(qc.float(), kf.transpose(-1, -2))  # exact for int8 codes (|sum| < 2^24)
    k_block = qq.get("k_block")
    # t = the dot in the kernel's form; score (log2 units) = (t - c) * qsb. INT8 dots arrive as
    # fp32 bit patterns of 1.5*2^23 + dot (exact, no I2F); with per-block K scales the offset c
    # stays in t and folds into the exp2 argument, per-key K scales fold it per column.
    if mode in ("int8", "int8-qk"):
        t2 = dots + _RNE_MAGIC
    else:
        t2 = dots
    c = 0.0
    if k_block:  # kernel: (q_scale * k_scale_block) first, then times the dot
        if k_block != block_n:
            raise ValueError(f"k_block ({k_block}) must equal block_n ({block_n})")
        qsb2 = (qk_scale * ks.unsqueeze(-2)).repeat_interleave(k_block, dim=-1)[..., :Skv]  # [B, H, Sq, Skv]
        if mode in ("int8", "int8-qk"):
            c = _RNE_MAGIC
    else:
        ksr = ks.unsqueeze(-2)
        t2 = t2 * ksr - _RNE_MAGIC * ksr if mode in ("int8", "int8-qk") else t2 * ksr
        qsb2 = qk_scale.expand(B, Hq, Sq, Skv)
    if causal:
        i = torch.arange(Sq, device=qc.device).unsqueeze(1)
        j = torch.arange(Skv, device=qc.device).unsqueeze(0)
        t2 = t2.masked_fill(j > i + (Skv - Sq), float("-inf"))
    m = torch.full((B, Hq, Sq), float("-inf"), device=qc.device)
    l = torch.zeros((B, Hq, Sq), device=qc.device)
    acc = torch.zeros((B, Hq, Sq, D), device=qc.device)
    c_acc = torch.ones((), device=qc.device)  # scaled accumulator: acc holds O / c_acc
    for n0 in range(0, Skv, block_n):
        t = t2[..., n0:n0 + block_n]
        qsb = qsb2[..., n0:n0 + block_n]
        qsb_row = qsb[..., 0]
        mb = (t.amax(dim=-1) - c) * qsb_row
        m_new = torch.maximum(m, mb)
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - m_use)

        def arg(sub):  # the exp2 argument as the kernel forms it
            return t * qsb - (c * qsb_row + sub).unsqueeze(-1)

        vb = vf[:, :, n0:n0 + block_n]
        if mode == "int8":
            if p_block:  # P against the block's row max, block rescaled by beta = exp2(m_block - m)
                mb_use = torch.where(torch.isinf(mb), m_use, mb)
                beta = torch.exp2(mb_use - m_use)
                p = quantize_p_int8(torch.exp2(arg(_int8_sub(mb_use, c * qsb_row))))
                l = l * alpha + p.sum(-1) * beta
                pv = torch.matmul(p, vb) * beta.unsqueeze(-1)
            else:
                p = quantize_p_int8(torch.exp2(arg(_int8_sub(m_use, c * qsb_row))))
                l = l * alpha + p.sum(-1)
                pv = torch.matmul(p, vb)
        elif mode == "fp8":
            p = _h(torch.exp2(_h(arg(m_use - 8.0)))) if exp16 else torch.exp2(arg(m_use - 8.0))
            l = l * alpha + p.sum(-1)
            pv = torch.matmul(quantize_p_fp8(p).float(), vb)
        elif mode == "fp8-kv4":
            p = torch.exp2(arg(m_use - 8.0))
            l = l * alpha + p.sum(-1)
            sv = vtok[..., n0:n0 + block_n]
            svmax = sv.amax(dim=-1, keepdim=True).clamp_min(1e-30)
            r = sv * (1.0 / svmax)
            pv = torch.matmul(quantize_p_fp8(p * r.unsqueeze(-2)).float(), vb)
        else:  # int8-qk
            p = torch.exp2(arg(m_use))
            l = l * alpha + p.sum(-1)
            pv = torch.matmul(p.to(vb.dtype).float(), vb.float())
        # the kernel's accumulator update, per V scale kind (see the module docstring)
        if mode == "fp8-kv4" or (vsc is not None and vsc.ndim == 3):
            sb = svmax.unsqueeze(-1) if mode == "fp8-kv4" else vsc[:, :, n0 // v_block].reshape(B, Hq, 1, 1)
            acc = acc * (alpha.unsqueeze(-1) * (c_acc / sb)) + pv
            c_acc = sb
        elif vsc is not None:
            acc = acc * alpha.unsqueeze(-1) + pv * vsc[:, :, n0 // v_block].unsqueeze(-2)
        else:
            acc = acc * alpha.unsqueeze(-1) + pv
        m = m_new
    return (acc * (c_acc / l.clamp_min(1e-30).unsqueeze(-1))).to(out_dtype)


def mre(out: torch.Tensor, ref: torch.Tensor, *, last: int | None = None, eps: float = 1e-5) -> float:
    """INT-FlashAttention's mean relative error ``mean(|out - ref| / (|ref| + eps))``.

    ``last=None`` averages over all elements (lowbit's choice); their script used ``last=4``.
    """
    o, r = out.double().reshape(-1), ref.double().reshape(-1)
    if last is not None:
        o, r = o[-last:], r[-last:]
    return ((o - r).abs() / (r.abs() + eps)).mean().item()
