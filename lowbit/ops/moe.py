"""Mixture-of-experts op over ``w4a8-fp8`` experts: ``lowbit::moe_w4a8_fp8``, the whole expert MLP of a decode
step in six launches and no host read (``lowbit.nn.moe`` calls it; its module docstring has the arithmetic).

``moe_w4a8_fp8(x [T, H], top_k_index [T, k], top_k_weights [T, k], gate_up (codes, scales, inv_delta) per expert,
down (...) per expert) -> [T, H]`` in x's dtype:

1. route: the ``T k`` (token, slot) pairs sorted by expert id (stable), ``offsets [E + 1]`` of each expert's rows
   (ids < 0 count with expert 0 and ids >= E after the last expert: both are computed or skipped, never added;
   one launch, ``lowbit.kernels.moe_route``);
2. per-token FP8 quantization of x (``lowbit.kernels.act_quant``);
3. gate_up: the grouped GEMM (``lowbit.kernels.moe_w4a8_fp8``), each sorted row reading its token's x;
4. ``silu(gate) * up`` quantized per row to FP8 in one pass (the eager roundings, ``formats.common.silu_mul_ref``);
5. down: the grouped GEMM over those rows;
6. combine: ``y * weight`` rounded to x's dtype, added per token in increasing expert order into zeros (the order
   and roundings of the sparse schedule's ``index_add_``), slots without an expert skipped; one launch, which also
   sums down's split-K partials.

So every output equals the per-expert modules' (the sparse schedule) up to the GEMMs' accumulation order (split-K).
Without the GPU or the interpreter the same steps run with the float64 references of ``lowbit.formats.w4a8_fp8``
(``reference_gemm`` per expert). Weights: one ``W4A8FP8Linear``'s ``codes`` / ``scales`` per expert, all of one
shape; gate_up's rows are the expert's gate rows then its up rows (transformers' ``gate_up_proj``), no bias.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit._utils import check_same_device, check_tensor, device_table, run_op, use_triton
from lowbit.formats.common import FP8_E4M3, quantize_per_token, silu_mul_ref
from lowbit.formats.w4a8_fp8 import GROUP_SIZES, padded_k, reference_gemm, scale_cols

ROUTE_MAX_ROWS = 1024  # (token, slot) pairs up to which the one-program routing kernel runs (else ``route``)


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``pos``, ``row_tok``, ``offsets``) of the (token, slot) pairs stably sorted by ``key = clamp(id, 0, E)``
    (``lowbit.kernels.moe_route`` states the contract; this is its plain-PyTorch reference, with no host read)."""
    T, k = top_k_index.shape
    key = top_k_index.reshape(-1).clamp(0, num_experts)
    order = torch.argsort(key, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=key.device)
    counts.scatter_add_(0, key.long(), torch.ones_like(key, dtype=torch.int32))
    offsets = F.pad(torch.cumsum(counts[:num_experts], 0, dtype=torch.int32), (1, 0))
    return pos.to(torch.int32), (order // max(k, 1)).to(torch.int32), offsets


def combine(y: torch.Tensor, pos: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """The sorted rows' outputs ``y [R, H]`` (or FP32 split-K partials ``[S, R, H]``, summed in split order) ->
    ``[T, H]`` in ``dtype``: per token, ``(y * weight).to(dtype)`` of its slots added into zeros in increasing row
    (= expert) order, slots whose id lies outside ``[0, E)`` skipped (reference of ``kernels.moe_route``)."""
    if y.dim() == 3:
        acc = y[0].clone()
        for p in range(1, y.shape[0]):
            acc += y[p]
        y = acc.to(dtype)
    T, k = top_k_index.shape
    rows, perm = pos.view(T, k).long().sort(dim=1)
    ids = top_k_index.gather(1, perm)
    w = top_k_weights.gather(1, perm)
    out = torch.zeros((T, y.shape[1]), dtype=dtype, device=y.device)
    for j in range(k):
        valid = ((ids[:, j] >= 0) & (ids[:, j] < num_experts))[:, None]
        out = torch.where(valid, out + (y[rows[:, j]] * w[:, j, None]).to(dtype), out)
    return out


def _grouped_ref(a, sx, row_map, offsets, codes, scales, inv_delta, k, group_size, out_dtype, rows):
    """The float64 reference of the grouped GEMM: ``reference_gemm`` per expert over its rows (others zero)."""
    out = torch.zeros((rows, codes[0].shape[0]), dtype=out_dtype, device=a.device)
    off = offsets.tolist()
    inv = inv_delta.tolist()
    for e in range(len(codes)):
        s, t = off[e], min(off[e + 1], rows)
        if t > s:
            idx = row_map[s:t].long() if row_map is not None else torch.arange(s, t, device=a.device)
            out[s:t] = reference_gemm(a[idx], sx[idx], codes[e], scales[e], inv[e], k, group_size, None,
                                      out_dtype=out_dtype)
    return out


def _experts(x, top_k_index, top_k_weights, gu_codes, gu_scales, gu_inv, dn_codes, dn_scales, dn_inv, group_size):
    """Steps 1-6 of the module docstring, with the kernels or (CPU) the references."""
    T, k = top_k_index.shape
    E, H, inter = len(gu_codes), x.shape[1], gu_codes[0].shape[0] // 2
    rows = T * k
    if use_triton(x, gu_codes[0]):
        from lowbit.kernels.act_quant import per_token_quant_triton
        from lowbit.kernels.moe_route import combine_triton, route_triton
        from lowbit.kernels.moe_w4a8_fp8 import moe_w4a8_fp8_gemm_triton as gemm

        pos, row_tok, offsets = (route_triton if rows <= ROUTE_MAX_ROWS else route)(top_k_index, E)
        xq, sx = per_token_quant_triton(x, FP8_E4M3)
        g = gemm(xq, sx, row_tok, offsets, gu_codes, gu_scales, gu_inv, H, group_size, x.dtype, rows, T)
        hq, sh = per_token_quant_triton(g[:, :inter], FP8_E4M3, fuse="silu_mul", up=g[:, inter:])
        y = gemm(hq, sh, None, offsets, dn_codes, dn_scales, dn_inv, inter, group_size, x.dtype, rows, T,
                 partials=True)
        return combine_triton(y, pos, top_k_index, top_k_weights, E, x.dtype)
    pos, row_tok, offsets = route(top_k_index, E)
    xq, sx = quantize_per_token(x, FP8_E4M3)
    g = _grouped_ref(xq, sx, row_tok, offsets, gu_codes, gu_scales, gu_inv, H, group_size, x.dtype, rows)
    hq, sh = quantize_per_token(silu_mul_ref(g, inter), FP8_E4M3)
    y = _grouped_ref(hq, sh, None, offsets, dn_codes, dn_scales, dn_inv, inter, group_size, x.dtype, rows)
    return combine(y, pos, top_k_index, top_k_weights, E, x.dtype)


@torch.library.custom_op("lowbit::moe_w4a8_fp8", mutates_args=())
def _moe_w4a8_fp8(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gu_codes: list[torch.Tensor], gu_scales: list[torch.Tensor], gu_inv_delta: torch.Tensor,
                  dn_codes: list[torch.Tensor], dn_scales: list[torch.Tensor], dn_inv_delta: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    return _experts(x, top_k_index, top_k_weights, gu_codes, gu_scales, gu_inv_delta, dn_codes, dn_scales,
                    dn_inv_delta, group_size)


@_moe_w4a8_fp8.register_fake
def _(x, top_k_index, top_k_weights, gu_codes, gu_scales, gu_inv_delta, dn_codes, dn_scales, dn_inv_delta,
      group_size):
    return torch.empty_like(x)


def inv_delta_table(pts_exps: list[int], codes: list[torch.Tensor]) -> torch.Tensor:
    """fp32 ``[E]`` of the experts' PTS ``2^-n`` on the codes' device, kept while the codes live unchanged."""
    return device_table(lambda: [2.0 ** -n for n in pts_exps], torch.float32, codes, ("inv_delta", *pts_exps))


def moe_w4a8_fp8(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 gate_up: tuple[list[torch.Tensor], list[torch.Tensor], list[int]],
                 down: tuple[list[torch.Tensor], list[torch.Tensor], list[int]], group_size: int = 128, *,
                 weights_checked: bool = False) -> torch.Tensor:
    """The expert MLP of a MoE layer (module docstring). ``gate_up`` / ``down``: per expert ``(codes, scales,
    pts_exp)`` lists of ``W4A8FP8Linear`` buffers (gate_up ``[2I, H]``, down ``[H, I]``). ``weights_checked``: the
    caller built them consistent (``lowbit.nn.moe.QuantExperts``): only their count and x are checked."""
    check_tensor(x, "x", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=2)
    T, H = x.shape
    check_tensor(top_k_index, "top_k_index", dtype=(torch.int32, torch.int64), ndim=2)
    check_tensor(top_k_weights, "top_k_weights", ndim=2)
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != T:
        raise ValueError(f"top_k_index {list(top_k_index.shape)} and top_k_weights {list(top_k_weights.shape)} "
                         f"must both be [tokens, k] with tokens = {T}")
    gu_codes, gu_scales, gu_exp = gate_up
    dn_codes, dn_scales, dn_exp = down
    E = len(gu_codes)
    if E == 0 or not (len(gu_scales) == len(gu_exp) == len(dn_codes) == len(dn_scales) == len(dn_exp) == E):
        raise ValueError("gate_up and down need the same number (>= 1) of experts' codes, scales and pts_exp")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    two_i = gu_codes[0].shape[0]
    if dn_codes[0].dim() != 2 or dn_codes[0].shape[0] != H:
        raise ValueError(f"x has {H} features but the experts' down projections give {list(dn_codes[0].shape)[:1]}")
    if not weights_checked:
        if two_i % 2:
            raise ValueError(f"gate_up has {two_i} rows: not gate rows then as many up rows")
        for name, cs, ss, n, kk in (("gate_up", gu_codes, gu_scales, two_i, H), ("down", dn_codes, dn_scales, H,
                                                                                  two_i // 2)):
            for e in range(E):
                check_tensor(cs[e], f"{name} codes[{e}]", dtype=torch.uint8, shape=[n, padded_k(kk) // 2])
                check_tensor(ss[e], f"{name} scales[{e}]", dtype=FP8_E4M3, shape=[n, scale_cols(kk, group_size)])
                if cs[e].stride(1) != 1 or ss[e].stride(1) != 1 or cs[e].stride(0) != cs[0].stride(0) or \
                        ss[e].stride(0) != ss[0].stride(0):
                    raise ValueError(f"{name} codes / scales of expert {e}: rows must be contiguous with one stride")
        check_same_device(x=x, top_k_index=top_k_index, top_k_weights=top_k_weights, gate_up=gu_codes[0],
                          down=dn_codes[0])
    if T == 0 or top_k_index.shape[1] == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    return run_op(_moe_w4a8_fp8, x, top_k_index.contiguous(), top_k_weights.contiguous(), list(gu_codes),
                  list(gu_scales), inv_delta_table(list(gu_exp), list(gu_codes)), list(dn_codes), list(dn_scales),
                  inv_delta_table(list(dn_exp), list(dn_codes)), int(group_size))
