"""Quantized prefill attention schemes: ``fp8``, ``fp8-kv4``, ``int8`` and ``int8-qk``.

Each public function has the attention-scheme signature of ``lowbit.registry``::

    fn(q, k, v, *, causal=False, sm_scale=None, **options) -> Tensor

q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Skv, D]`` (fp16, bf16 or fp32; Hq a multiple of Hkv),
output shaped like q in q's dtype; causal masks are bottom-right aligned when Sq < Skv.
Numerics: ``lowbit.formats.attention_quant`` (formats and the float32 replay of the kernel);
kernels: ``lowbit.kernels.attention_quant`` (K/V quantization, V transposed) and
``lowbit.kernels.attention_prefill`` (the attention, Q quantized inside). On CUDA, or on the CPU
under ``TRITON_INTERPRET=1``, the kernels run; otherwise the float32 replay of the same numerics.

The timed path on the GPU is two launches: the quantization of K/V (V transposed) and, for
``fp8``, of Q (``q_pre``, session 3: bit-identical codes, 1-2% faster than quantizing Q in each
attention program's prologue, which ``int8`` / ``int8-qk`` still do), then the attention. ``FUSE_KV = True`` makes it one launch (the first
programs of each KV head quantize its K and V, the others wait for them): same codes, measured
slower. It is wrapped as ``torch.library`` ops with fake implementations, so
``torch.compile(fullgraph=True)`` and CUDA graphs capture them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit._utils import (by_batch, check_sm_scale, check_tensor, interpret_mode, run_op, triton_available, use_triton,
                           warn_once)
from lowbit.formats.attention_quant import MODES, V_BLOCK, V_GRANULARITIES, attention_quant_ref, quantize_qkv
from lowbit.formats.common import FP8_E4M3

__all__ = ["fp8_attention", "fp8_kv4_attention", "int8_attention", "int8_qk_attention", "quant_attention",
           "reference"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# K/V quantization inside the attention launch (``quant_attention_triton(fuse_kv=True)``) rather
# than a separate pass; same codes either way. Off: measured slower on the H200 (R4: fp8 S=1k
# 0.2226 vs 0.1576 ms, S=4k 2.010 vs 1.598 ms for the two launches)
FUSE_KV = False
_KERNEL_DIMS = (64, 128, 256)


def _ref_block_n(mode: str, head_dim: int) -> int:
    """The BLOCK_N the kernel would use (the reference replays the same blocks)."""
    from lowbit.kernels.attention_prefill import default_config

    return default_config(mode, head_dim, False, 1)["BLOCK_N"] if triton_available() else 128


def _kernel_dim(d: int) -> int | None:
    """Head dim the kernel runs at (zero-padded up), or None when it cannot."""
    if interpret_mode():
        p = 16
        while p < d:
            p *= 2
        return p
    for kd in _KERNEL_DIMS:
        if d <= kd:
            return kd
    return None


# ------------------------------------------------------------------------------- torch.library ops
@torch.library.custom_op("lowbit::quant_attention_prefill", mutates_args=())
def _quant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, causal: bool,
                     sm_scale: float, v_granularity: str, v_block: int, k_granularity: str,
                     p_block: bool) -> torch.Tensor:
    D = q.shape[-1]
    kd = _kernel_dim(D)
    bn = _ref_block_n(mode, kd or D)
    k_block = bn if k_granularity == "block" else None
    if use_triton(q, k, v) and kd is not None:
        from lowbit.kernels.attention_prefill import quant_attention_triton

        if kd != D:
            warn_once(f"quantized attention: head_dim {D} zero-padded to {kd} for the kernel")
            q, k, v = (F.pad(t, (0, kd - D)) for t in (q, k, v))
        o = by_batch(lambda q_, k_, v_: quant_attention_triton(  # grid axis 1: batch x query heads
            q_, k_, v_, mode=mode, causal=causal, sm_scale=sm_scale, v_granularity=v_granularity, v_block=v_block,
            k_per_block=k_block is not None, p_block=p_block, fuse_kv=FUSE_KV), q.shape[1], q, k, v)
        # (contiguous, as the fake implementation's empty_like(q): a strided view here gave torch.compile other
        # strides than the traced graph assumed)
        return o[..., :D].contiguous() if kd != D else o
    return _reference(q, k, v, mode, causal, sm_scale, v_granularity, v_block, k_block, bn, p_block=p_block)


def _reference(q, k, v, mode, causal, sm_scale, v_granularity, v_block, k_block, bn, fused=False, p_block=False):
    vq = v if not (mode == "int8-qk" and v.dtype == torch.float32) else v.to(torch.bfloat16)
    qq = quantize_qkv(q, k, vq, mode=mode, v_granularity=v_granularity, v_block=v_block, k_block=k_block)
    if mode == "fp8-kv4" and not fused:
        from lowbit.formats.attention_quant import kv4_to_fp8_blocks

        qq = {"mode": "fp8", "q": qq["q"], "q_scale": qq["q_scale"],
              **kv4_to_fp8_blocks(qq["k"], qq["k_scale"], qq["v"], qq["v_scale"], block=bn)}
    return attention_quant_ref(qq, causal=causal, sm_scale=sm_scale, block_n=bn, out_dtype=q.dtype, p_block=p_block)


def reference(q, k, v, *, mode: str, causal: bool = False, sm_scale: float | None = None,
              v_granularity: str | None = None, v_block: int = V_BLOCK, k_granularity: str | None = None,
              fused: bool = False, p_scale: str = "running") -> torch.Tensor:
    """The float32 replay of exactly what ``quant_attention`` (or ``fp8_kv4_attention`` with
    ``fused``) computes with the same options, on any device: what the kernels are checked against."""
    D = q.shape[-1]
    kd = _kernel_dim(D) or D
    bn = _ref_block_n("fp8" if mode == "fp8-kv4" else mode, kd)
    kg = k_granularity or DEFAULT_K.get(mode, "token")
    vg = v_granularity or DEFAULT_V.get(mode, "channel")
    return _reference(q, k, v, mode, causal, check_sm_scale(sm_scale, D), vg, v_block, bn if kg == "block" else None, bn,
                      fused, p_scale == "block")


@_quant_attention.register_fake
def _(q, k, v, mode, causal, sm_scale, v_granularity, v_block, k_granularity, p_block):
    return torch.empty_like(q)


def _via_fp8_blocks(q, k, k_scale, v, v_scale, causal: bool, sm_scale: float) -> torch.Tensor:
    """``fp8-kv4``'s default kernel path: one launch converts K / V to the ``fp8`` scheme's operands (one FP8 scale per
    key block; V^T in the VPERM key order where the block allows it), then the ``fp8`` attention kernel; batch slices
    past grid axis 1's limit. ``k_scale`` / ``v_scale`` None: ``k`` / ``v`` are float, quantized to KV4 inside the
    conversion launch (``kv4_to_fp8_triton(from_float=True)``: the codes stay in registers); else KV4 codes."""
    from lowbit.kernels.attention_prefill import VPERM_FP8, attention_prefill_triton
    from lowbit.kernels.attention_quant import kv4_to_fp8_triton

    bn = _ref_block_n("fp8", q.shape[-1])
    vp = bool(VPERM_FP8) and bn % 32 == 0  # V^T in the VPERM key order (see the kernel's default_config)
    from_float = k_scale is None

    def run(q_, k_, v_, *scales):
        ks_, vs_ = scales if scales else (None, None)
        kc, ks, vt, vs = kv4_to_fp8_triton(k_, ks_, v_, vs_, block=bn, vperm=vp, from_float=from_float)
        return attention_prefill_triton(q_, kc, ks, vt, vs, mode="fp8", causal=causal, sm_scale=sm_scale,
                                        v_block=bn, k_block=bn, config={"vperm": vp})

    return by_batch(run, q.shape[1], q, k, v, *(() if from_float else (k_scale, v_scale)))


@torch.library.custom_op("lowbit::fp8_kv4_attention_prefill", mutates_args=())
def _fp8_kv4_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                       v_scale: torch.Tensor, causal: bool, sm_scale: float, fused: bool) -> torch.Tensor:
    D = q.shape[-1]
    bn = _ref_block_n("fp8", D)
    if use_triton(q, k_codes, v_codes) and _kernel_dim(D) == D:
        from lowbit.kernels.attention_prefill import attention_prefill_triton

        if fused:
            return by_batch(lambda *t: attention_prefill_triton(*t, mode="fp8-kv4", causal=causal, sm_scale=sm_scale),
                            q.shape[1], q, k_codes, k_scale, v_codes, v_scale)
        return _via_fp8_blocks(q, k_codes, k_scale, v_codes, v_scale, causal, sm_scale)
    if use_triton(q):
        warn_once(f"fp8-kv4 attention: head_dim {D} has no kernel; using the PyTorch reference")
    from lowbit.formats.attention_quant import kv4_to_fp8_blocks, quantize_qk

    qc, qs = quantize_qk(q, FP8_E4M3)
    if fused:
        qq = {"mode": "fp8-kv4", "q": qc, "q_scale": qs, "k": k_codes, "k_scale": k_scale,
              "v": v_codes, "v_scale": v_scale}
    else:
        qq = {"mode": "fp8", "q": qc, "q_scale": qs, **kv4_to_fp8_blocks(k_codes, k_scale, v_codes, v_scale, block=bn)}
    return attention_quant_ref(qq, causal=causal, sm_scale=sm_scale, block_n=bn, out_dtype=q.dtype)


@_fp8_kv4_attention.register_fake
def _(q, k_codes, k_scale, v_codes, v_scale, causal, sm_scale, fused):
    return torch.empty_like(q)


@torch.library.custom_op("lowbit::fp8_kv4_attention_float_prefill", mutates_args=())
def _fp8_kv4_attention_float(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                             sm_scale: float) -> torch.Tensor:
    """``fp8-kv4`` on float K / V, default (unfused) numerics: where the kernels run, one launch quantizes K / V to KV4
    and converts them to the ``fp8`` operands (``kv4_to_fp8_triton(from_float=True)``: the KV4 codes stay in
    registers), then the ``fp8`` kernel; elsewhere ``kv4_quantize`` and the KV4 op's path."""
    D = q.shape[-1]
    if use_triton(q, k, v) and _kernel_dim(D) == D:
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        return _via_fp8_blocks(q, k, None, v, None, causal, sm_scale)
    from lowbit.ops.kv4 import kv4_quantize

    return run_op(_fp8_kv4_attention, q, *kv4_quantize(k, v), causal, sm_scale, False)


@_fp8_kv4_attention_float.register_fake
def _(q, k, v, causal, sm_scale):
    return torch.empty_like(q)


# ------------------------------------------------------------------------------- validation
def _check_qkv(q, k, v, causal):
    check_tensor(q, "q", dtype=_FLOATS, ndim=4)
    check_tensor(k, "k", dtype=q.dtype, ndim=4)
    check_tensor(v, "v", dtype=q.dtype, ndim=4)
    B, Hq, Sq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {list(k.shape)} and v {list(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v must be [B={B}, Hkv, Skv, D={D}], got {list(k.shape)}")
    _check_common(q, k.shape[1], k.shape[2], causal)


def _check_common(q, hkv, skv, causal):
    B, Hq, Sq, D = q.shape
    if hkv == 0 or Hq % hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({hkv})")
    if causal and Sq > skv:
        raise ValueError(f"causal attention needs Sq <= Skv, got Sq={Sq}, Skv={skv}")
    if D > 256:
        raise ValueError(f"head_dim must be <= 256, got {D}")


# per-mode defaults: FP8 keeps ~2^-4 relative precision at any scale, so one scale per KV block
# loses nothing measurable and saves a multiply per score (K) and per output element (V); INT8
# codes are absolute, so int8 keeps the papers' per-token K and per-channel V scales.
DEFAULT_K = {"fp8": "block", "int8": "token", "int8-qk": "token"}
DEFAULT_V = {"fp8": "block", "int8": "channel"}


def quant_attention(q, k, v, *, mode: str, causal: bool = False, sm_scale: float | None = None,
                    v_granularity: str | None = None, v_block: int = V_BLOCK,
                    k_granularity: str | None = None, p_scale: str = "running") -> torch.Tensor:
    """Quantized attention with ``mode`` in ``('fp8', 'int8', 'int8-qk', 'fp8-kv4')``.

    ``k_granularity``: ``'token'`` (one K scale per key, the papers') or ``'block'`` (one per
    kernel KV block, folded into the per-row Q scale: one multiply per score less).
    ``v_granularity``: ``'channel'`` (per channel per ``v_block`` tokens), ``'block'`` (one scale
    per ``v_block`` tokens) or ``'tensor'`` (per batch and head, INT-FlashAttention's S_V).
    Defaults per mode: ``DEFAULT_K`` / ``DEFAULT_V``. ``p_scale`` (int8): ``'running'`` (the
    paper: P = round(127 exp(S - m_running))) or ``'block'`` (against the block's row max, the block
    rescaled in fp32; keeps small blocks from rounding to zero).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    k_granularity = k_granularity or DEFAULT_K.get(mode, "token")
    v_granularity = v_granularity or DEFAULT_V.get(mode, "channel")
    if v_granularity not in V_GRANULARITIES:
        raise ValueError(f"v_granularity must be one of {V_GRANULARITIES}, got {v_granularity!r}")
    if not isinstance(v_block, int) or v_block < 128 or v_block & (v_block - 1):
        raise ValueError(f"v_block must be a power of two >= 128, got {v_block!r}")
    if p_scale not in ("running", "block"):
        raise ValueError(f"p_scale must be 'running' or 'block', got {p_scale!r}")
    if p_scale == "block" and mode != "int8":
        raise ValueError("p_scale='block' applies to mode 'int8' only")
    if k_granularity not in ("token", "block"):
        raise ValueError(f"k_granularity must be 'token' or 'block', got {k_granularity!r}")
    if mode == "fp8-kv4":
        return fp8_kv4_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    _check_qkv(q, k, v, causal)
    return run_op(_quant_attention, q, k, v, mode, bool(causal), check_sm_scale(sm_scale, q.shape[-1]), v_granularity,
                  v_block, k_granularity, p_scale == "block")


def fp8_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                  v_granularity: str | None = None, v_block: int = V_BLOCK, k_granularity: str | None = None) -> torch.Tensor:
    """Scheme ``fp8`` (FireQ App. D): FP8 E4M3 Q per token, K and V one scale per KV block by
    default (``k_granularity='token'`` / ``v_granularity='channel'`` for finer scales), FP8 P
    (x256), FP8 tensor-core dots, fp32 O."""
    return quant_attention(q, k, v, mode="fp8", causal=causal, sm_scale=sm_scale,
                           v_granularity=v_granularity, v_block=v_block, k_granularity=k_granularity)


def int8_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                   v_granularity: str | None = None, v_block: int = V_BLOCK, k_granularity: str | None = None,
                   p_scale: str = "running") -> torch.Tensor:
    """Scheme ``int8`` (INT-FlashAttention Alg. 1, full INT8): INT8 Q/K per token, INT8 V per
    channel per ``v_block`` tokens (``v_granularity='tensor'``: the paper's per-tensor S_V),
    INT8 P = round(127 exp(S - m_running)), INT32 dots, l from the quantized P."""
    return quant_attention(q, k, v, mode="int8", causal=causal, sm_scale=sm_scale,
                           v_granularity=v_granularity, v_block=v_block, k_granularity=k_granularity,
                           p_scale=p_scale)


def int8_qk_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                      k_granularity: str | None = None) -> torch.Tensor:
    """Scheme ``int8-qk`` (half-INT8, INT-FlashAttention §4): INT8 Q/K per token for QK^T,
    P and V in the input's 16-bit dtype (bf16 for fp32 inputs) for PV, fp32 accumulation."""
    return quant_attention(q, k, v, mode="int8-qk", causal=causal, sm_scale=sm_scale, k_granularity=k_granularity)


def fp8_kv4_attention(q, k=None, v=None, *, causal: bool = False, sm_scale: float | None = None,
                      kv4: tuple | None = None, fused: bool = False) -> torch.Tensor:
    """Scheme ``fp8-kv4`` (FireQ §3.2): FP8 Q per token; K and V in KV4 (``lowbit.formats.kv4``:
    INT4 codes [B, Hkv, Skv, D/2] uint8, per-token FP8 E4M3 scales [B, Hkv, Skv]).

    Default (``fused=False``): one memory-bound pass dequantizes the KV4 blocks and requantizes
    them to FP8 with one scale per KV block (V transposed), then the ``fp8`` kernel runs: every
    query block of a head reuses the converted tiles, where the fused kernel redoes the INT4
    unpacking in every query block (2.4x the loop's instructions, see the kernel docstring).
    ``fused=True``: the attention kernel reads the INT4 codes itself (exact in FP8), K scale on
    the columns of S, V scale folded into P.

    Pass either float ``k``/``v`` (quantized to KV4 here: on the kernels' path inside the conversion launch, session
    35; ``fused=True`` quantizes them with ``lowbit.ops.kv4.kv4_quantize``) or ``kv4=(k_codes, k_scale, v_codes,
    v_scale)`` as read from a KV4 cache (then ``k``/``v`` must be None).
    """
    check_tensor(q, "q", dtype=_FLOATS, ndim=4)
    if kv4 is None:
        if k is None or v is None:
            raise ValueError("fp8_kv4_attention needs k and v, or kv4=(k_codes, k_scale, v_codes, v_scale)")
        _check_qkv(q, k, v, causal)
        if q.shape[-1] % 2:
            raise ValueError(f"kv4 needs an even head_dim, got {q.shape[-1]}")
        if not fused:  # one launch: float -> KV4 -> the fp8 operands
            return run_op(_fp8_kv4_attention_float, q, k, v, bool(causal), check_sm_scale(sm_scale, q.shape[-1]))
        from lowbit.ops.kv4 import kv4_quantize

        kc, ksc, vc, vsc = kv4_quantize(k, v)  # one Triton launch (D a power of two) or quantize_kv4
    else:
        if k is not None or v is not None:
            raise ValueError("pass either k/v or kv4=(...), not both")
        if not isinstance(kv4, (tuple, list)) or len(kv4) != 4:
            raise TypeError("kv4 must be a tuple (k_codes, k_scale, v_codes, v_scale)")
        kc, ksc, vc, vsc = kv4
        B, Hq, Sq, D = q.shape
        check_tensor(kc, "kv4 k_codes", dtype=torch.uint8, ndim=4)
        hkv, skv = kc.shape[1], kc.shape[2]
        check_tensor(kc, "kv4 k_codes", shape=(B, hkv, skv, D // 2))
        check_tensor(vc, "kv4 v_codes", dtype=torch.uint8, shape=(B, hkv, skv, D // 2))
        scale_dts = (FP8_E4M3, torch.bfloat16, torch.float32)
        check_tensor(ksc, "kv4 k_scale", dtype=scale_dts, shape=(B, hkv, skv))
        check_tensor(vsc, "kv4 v_scale", dtype=scale_dts, shape=(B, hkv, skv))
        _check_common(q, hkv, skv, causal)
        if D % 2:
            raise ValueError(f"kv4 needs an even head_dim, got {D}")
    kc, ksc, vc, vsc = (t.contiguous() for t in (kc, ksc, vc, vsc))
    for name, t in (("k_codes", kc), ("v_codes", vc)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
    return run_op(_fp8_kv4_attention, q, kc, ksc, vc, vsc, bool(causal), check_sm_scale(sm_scale, q.shape[-1]),
                  bool(fused))
