"""The peers lowbit is measured against, each as a factory returning a callable.

A factory raises ``PeerUnavailable`` with the reason when the peer cannot run on this machine
(package missing, backend refused); suites record that as a skipped row with the note.
Wheels for the packages the GPU machine lacks: ``../shared/tools/peer-wheels``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class PeerUnavailable(RuntimeError):
    pass


# ---------------------------------------------------------------- linear layers (y = x W^T)
def cublas_bf16(w: torch.Tensor):
    """cuBLAS through ``F.linear`` in w's dtype."""
    return lambda x: F.linear(x, w)


def fp8_rowwise_weight(w: torch.Tensor):
    """Row-wise FP8 E4M3 weight for ``torch._scaled_mm``: (w_fp8 [N, K], scale fp32 [1, N])."""
    s = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (w.float() / s).to(torch.float8_e4m3fn), s.t().contiguous()


def fp8_rowwise_act(x: torch.Tensor):
    s = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (x.float() / s).to(torch.float8_e4m3fn), s


def scaled_mm_rowwise(w: torch.Tensor, *, quantize_x: bool):
    """``torch._scaled_mm`` FP8 row-wise. With ``quantize_x`` the callable takes bf16 x and
    quantizes it with plain torch ops (counted); otherwise it takes (x_fp8, x_scale)."""
    wq, ws = fp8_rowwise_weight(w)
    wt = wq.t()  # column-major view, as _scaled_mm wants

    def mm(xq, xs):
        return torch._scaled_mm(xq, wt, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

    if quantize_x:
        return lambda x: mm(*fp8_rowwise_act(x))
    return mm


def tinygemm_int4(w: torch.Tensor, group_size: int = 128):
    """torch int4 tinygemm ``_weight_int4pack_mm``: asymmetric uint4, bf16 scales and zeros."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        raise PeerUnavailable("torch has no _weight_int4pack_mm")
    N, K = w.shape
    if K % group_size or K % 128:
        raise PeerUnavailable(f"tinygemm needs K % 128 == 0 and K % group_size == 0 (K={K})")
    wg = w.float().reshape(N, K // group_size, group_size)
    mn, mx = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((mx - mn).clamp_min(1e-6) / 15)
    zero_min = mn
    q = ((wg - mn) / scale).round().clamp(0, 15).to(torch.int32).reshape(N, K)
    # tinygemm's zero convention: w = (q - 8) * scale + zero, zero = min + 8 * scale
    zeros = zero_min + 8 * scale
    sz = torch.stack([scale.squeeze(-1), zeros.squeeze(-1)], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    try:
        wp = torch.ops.aten._convert_weight_to_int4pack(packed_u8.contiguous(), 8)
    except Exception as exc:  # pragma: no cover - depends on torch build
        raise PeerUnavailable(f"_convert_weight_to_int4pack failed: {exc}")
    return lambda x: torch.ops.aten._weight_int4pack_mm(x, wp, group_size, sz)


def bnb_nf4(w: torch.Tensor, block: int = 128):
    """bitsandbytes NF4 (``matmul_4bit``), fp16 activations as in ANCHORS."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf
    except Exception as exc:
        raise PeerUnavailable(f"bitsandbytes not importable: {exc}")
    wq, state = bf.quantize_4bit(w.to(torch.float16), blocksize=block, quant_type="nf4")
    return lambda x: bnb.matmul_4bit(x, wq.t(), quant_state=state)


# ---------------------------------------------------------------- attention
def sdpa(backend: str):
    """SDPA restricted to one backend: 'flash', 'cudnn', 'efficient' or 'math'."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]

    def run(q, k, v, causal=False):
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  enable_gqa=q.shape[1] != k.shape[1])
    return run


def sageattention():
    """SageAttention 1.0.6 (INT8 QK^T, fp16 PV), HND layout."""
    try:
        from sageattention import sageattn
    except Exception as exc:
        raise PeerUnavailable(f"sageattention not importable: {exc}")
    return lambda q, k, v, causal=False: sageattn(q, k, v, tensor_layout="HND", is_causal=causal)
