"""Mixture-of-experts ops over ``w4a8-fp8``, ``w4a8-int8`` and ``lut`` experts: ``lowbit::moe_w4a8_fp8``,
``lowbit::moe_w4a8_int8`` and ``lowbit::moe_lut``, the whole expert MLP of a decode step in six launches (seven when
gate_up splits K: its partials summed by PyTorch; ``lut`` has no activation quantization: five) and no host read
(``lowbit.nn.moe`` calls them; its module docstring has the arithmetic).

``moe_w4a8_fp8(x [T, H], top_k_index [T, k], top_k_weights [T, k], gate_up (codes, scales, inv_delta) per expert,
down (...) per expert) -> [T, H]`` in x's dtype:

1. route: the ``T k`` (token, slot) pairs sorted by expert id (stable), ``offsets [E + 1]`` of each expert's rows
   (ids < 0 count with expert 0 and ids >= E after the last expert: both are computed or skipped, never added;
   one launch, ``lowbit.kernels.moe_route``);
2. per-token quantization of x (FP8 or INT8, ``lowbit.kernels.act_quant``);
3. gate_up: the grouped GEMM (``lowbit.kernels.moe_grouped``), each sorted row reading its token's x;
4. ``silu(gate) * up`` quantized per row in one pass (the eager roundings, ``formats.common.silu_mul_ref``);
5. down: the grouped GEMM over those rows;
6. combine: ``y * weight`` rounded to x's dtype, added per token in increasing expert order into zeros (the order
   and roundings of the sparse schedule's ``index_add_``), slots without an expert skipped; one launch, which also
   sums down's split-K partials.

So every output equals the per-expert modules' (the sparse schedule) up to the GEMMs' accumulation order (split-K).
``lut`` (weight-only, bf16 / fp16 activations in the modules' dtype): steps 2 and 4 become a plain
``silu(gate) * up`` in that dtype (``kernels.silu_mul``, the eager roundings); its GEMM rounds the table values to the
activation dtype and scales each group's FP32 sum exactly, as the dense LUT kernels do at 4 bits
(``lowbit.kernels.lut_wgmma``), so against the per-expert modules it differs by their accumulation order; also by
the weight's rounding where those round ``T[c] * s`` once to 16 bits (3-bit experts given >= 9 tokens:
``lut_wgmma``'s ``scale_w``; ~2e-4 relative) and, on the CPU, by the reference's unrounded float32 table.
Without the GPU or the interpreter the same steps run with the formats' float64 references
(``w4a8_fp8.reference_gemm`` / ``w4a8_int8.gemm_ref`` per expert). Weights: one module's buffers per expert, all of
one shape; gate_up's rows are the expert's gate rows then its up rows (transformers' ``gate_up_proj``), no bias.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit._utils import check_choice, check_same_device, check_tensor, device_table, run_op, use_triton
from lowbit.formats.common import FP8_E4M3, quantize_per_token, silu_mul_ref
from lowbit.formats.w4a8_fp8 import GROUP_SIZES, padded_k, reference_gemm, scale_cols

ROUTE_MAX_ROWS = 1024  # (token, slot) pairs up to which the one-program routing kernel runs (else ``route``)
# ``lut``: from this many mean routed rows per hit expert (prefill), the GEMMs dequantize every routed expert's weight
# once (one launch, ``lut_gemm.lut_dequant_mma_experts_triton``: the per-expert modules' large-M numerics) and run
# PyTorch's grouped bf16 GEMM (``torch._grouped_mm``, FP32 accumulation) instead of the LUT kernel, whose
# weight tile is decoded again for every 64-row step (session 41, ``_lut_dequant_gemm``)
LUT_DEQUANT_ROWS = 256
# ``w4a8-fp8`` with fewer than ``FP8_DEQUANT_MAX_EXPERTS`` experts, from this many mean routed rows per hit expert: every
# routed expert's weight dequantized to FP8 once (``w4a8_fp8_gemm.dequantize_experts_to_fp8``: the values the kernels
# build in registers) and ``torch._scaled_grouped_mm`` row-wise (scale_a = the rows' x scales, scale_b = each expert's
# PTS delta^-1), as the dense large-M path runs ``torch._scaled_mm``. Session 41 (H200, ``s41_scaled_grouped.json``,
# GEMM alone): Mixtral-8x7B's experts 1027-1079 TFLOP/s against 497-522 for the grouped kernel; Qwen3-30B-A3B's 128
# small experts 229-332 against 423-525, hence the expert bound
FP8_DEQUANT_ROWS = 512
FP8_DEQUANT_MAX_EXPERTS = 16


def weight_rows(scheme: str, fields) -> int:
    """N, the output rows of an expert projection, from its per-expert fields (``moe_gemm_triton``'s layouts, as in
    ``QuantExperts.grouped_weights``): ``lut`` from its scales ``[G, N]``, the W4A8 formats from their codes
    ``[N, Kp / 2]``; gate_up's N is 2I."""
    return fields[2][0].shape[1] if scheme == "lut" else fields[0][0].shape[0]


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


def _grouped_ref(scheme, a, sx, row_map, offsets, weights, params, k, group_size, out_dtype, rows, tiled, bits=4):
    """The reference of the grouped GEMM (``lowbit.kernels.moe_grouped``): each format's reference GEMM per expert over
    its rows (float64 ``w4a8_fp8.reference_gemm``, ``w4a8_int8.gemm_ref``; ``lut``: ``ops.lut.lut_gemm_ref``, the
    per-expert modules' CPU path, with the ``[qweight, qweight_hi, scales, pairs, table]`` fields); rows of no expert
    are zero."""
    from lowbit.formats.w4a8_int8 import gemm_ref as int8_gemm_ref

    n = weights[2][0].shape[1] if scheme == "lut" else weights[0][0].shape[0]
    out = torch.zeros((rows, n), dtype=out_dtype, device=a.device)
    off = offsets.tolist()
    inv = params.tolist() if params is not None else None
    for e in range(len(weights[0])):
        s, t = off[e], min(off[e + 1], rows)
        if t > s:
            idx = row_map[s:t].long() if row_map is not None else torch.arange(s, t, device=a.device)
            f = [w[e] for w in weights]
            if scheme == "lut":
                from lowbit.ops.lut import lut_gemm_ref

                q, qh, sc, _, table = f
                out[s:t] = lut_gemm_ref(a[idx], q, qh if bits == 3 else None, sc, table, bits, group_size, k,
                                        layout="mma").to(out_dtype)
            elif scheme == "w4a8-fp8":
                out[s:t] = reference_gemm(a[idx], sx[idx], f[0], f[1], inv[e], k, group_size, None,
                                          out_dtype=out_dtype)
            else:
                out[s:t] = int8_gemm_ref(a[idx], sx[idx], *f, None, out_dtype, tiled=tiled)
    return out


_QDTYPE = {"w4a8-fp8": FP8_E4M3, "w4a8-int8": torch.int8}


def _experts(scheme, x, top_k_index, top_k_weights, gu, gu_params, dn, dn_params, group_size, tiled=(False, False),
             bits=4):
    """Steps 1-6 of the module docstring, with the kernels or (CPU) the references. ``gu`` / ``dn``: the weight
    fields, each a list over the experts (``lowbit.kernels.moe_grouped.moe_gemm_triton``; ``lut``: with the float32
    tables last, for the reference); ``tiled``: (gate_up's, down's) INT8 code layout. ``lut`` (weight-only) skips the
    two quantizations: x goes in as it is, and ``silu(gate) * up`` is rounded to x's dtype."""
    T, k = top_k_index.shape
    lut = scheme == "lut"
    E, H = len(gu[0]), x.shape[1]
    inter = weight_rows(scheme, gu) // 2
    rows = T * k
    qd = _QDTYPE.get(scheme)
    if use_triton(x, gu[0][0]):
        from lowbit.kernels.act_quant import per_token_quant_triton
        from lowbit.kernels.moe_grouped import moe_gemm_triton
        from lowbit.kernels.moe_route import combine_triton, route_triton
        from lowbit.kernels.silu_mul import silu_mul_triton

        form = _dequant_wanted(scheme, rows, E, x, inter)  # the prefill form of both GEMMs, or the grouped kernel

        def gemm(a, sa, rmap, w, p, kk, tl_, **kw):
            if form and lut:
                return _lut_dequant_gemm(a, rmap, offsets, w, kk, group_size, bits)
            if form:
                return _fp8_dequant_gemm(a, sa, rmap, offsets, w, p, kk, group_size, x.dtype)
            return moe_gemm_triton(scheme, a, sa, rmap, offsets, w, p, kk, group_size, x.dtype, rows, T,
                                   tiled=tl_, bits=bits, **kw)

        pos, row_tok, offsets = (route_triton if rows <= ROUTE_MAX_ROWS else route)(top_k_index, E)
        xq, sx = (x, None) if lut else per_token_quant_triton(x, qd)
        g = gemm(xq, sx, row_tok, gu, gu_params, H, tiled[0])
        if lut:  # gate columns [0, I), up [I, 2I): one block of I
            hq, sh = silu_mul_triton(g, block=inter), None
        else:
            hq, sh = per_token_quant_triton(g[:, :inter], qd, fuse="silu_mul", up=g[:, inter:])
        y = gemm(hq, sh, None, dn, dn_params, inter, tiled[1], partials=True)
        return combine_triton(y, pos, top_k_index, top_k_weights, E, x.dtype)
    pos, row_tok, offsets = route(top_k_index, E)
    xq, sx = (x, None) if lut else quantize_per_token(x, qd)
    g = _grouped_ref(scheme, xq, sx, row_tok, offsets, gu, gu_params, H, group_size, x.dtype, rows, tiled[0], bits)
    h = silu_mul_ref(g, inter)
    hq, sh = (h, None) if lut else quantize_per_token(h, qd)
    y = _grouped_ref(scheme, hq, sh, None, offsets, dn, dn_params, inter, group_size, x.dtype, rows, tiled[1], bits)
    return combine(y, pos, top_k_index, top_k_weights, E, x.dtype)


def _torch_grouped_gemms() -> bool:
    """PyTorch >= 2.9 with ``torch._grouped_mm`` / ``torch._scaled_grouped_mm``: earlier builds lack their CUTLASS
    kernels on some devices and loop over the groups on the host (a device sync; no CUDA-graph capture). Measured on
    2.11 (H200) and run on the CPU with 2.13."""
    try:
        major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 9) and hasattr(torch, "_grouped_mm") and hasattr(torch, "_scaled_grouped_mm")


def prefill_form(scheme: str, x: torch.Tensor, num_experts: int, inter: int) -> bool:
    """Can experts of ``scheme`` (``num_experts`` of them, intermediate size ``inter``) take the prefill form for
    ``x [T, H]``: PyTorch's grouped GEMM exists for it (``_torch_grouped_gemms``) on this device (Hopper; Blackwell
    too for ``lut``; the CPU: the interpreter's runs, the FP8 one through ``_scaled_grouped_ref``), and
    - ``lut`` (``_lut_dequant_gemm``): bf16, H and ``inter`` multiples of 8 (``torch._grouped_mm``'s 16-byte rows);
    - ``w4a8-fp8`` (``_fp8_dequant_gemm``): fewer than ``FP8_DEQUANT_MAX_EXPERTS`` experts, H and ``inter`` multiples
      of 128 (no padded K; cuBLASLt's FP8 alignment);
    no other scheme has one."""
    if scheme == "lut":
        ok = x.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and inter % 8 == 0
    elif scheme == "w4a8-fp8":
        ok = num_experts < FP8_DEQUANT_MAX_EXPERTS and x.shape[1] % 128 == 0 and inter % 128 == 0
    else:
        return False
    if not ok or not _torch_grouped_gemms():
        return False
    if x.is_cuda:
        from lowbit._utils import cuda_major

        return cuda_major(x.device) in ((9, 10) if scheme == "lut" else (9,))
    return True


def _dequant_wanted(scheme: str, rows: int, E: int, x: torch.Tensor, inter: int) -> bool:
    """The prefill form from ``LUT_DEQUANT_ROWS`` / ``FP8_DEQUANT_ROWS`` mean rows per hit expert, where it exists."""
    need = {"lut": LUT_DEQUANT_ROWS, "w4a8-fp8": FP8_DEQUANT_ROWS}.get(scheme)
    return need is not None and rows >= need * min(E, rows) and prefill_form(scheme, x, E, inter)


def _lut_dequant_gemm(a, row_map, offsets, weights, k, group_size, bits):
    """The grouped ``lut`` GEMM at prefill sizes: every routed expert's ``W_hat = T[c] * s`` dequantized into one
    ``[E, N, K]`` buffer in ``a``'s dtype (the per-expert modules' large-M numerics: float32 product rounded once),
    then ``torch._grouped_mm`` over the sorted rows (``a[row_map]`` where given) -> ``[rows, N]``; rows no expert
    owns (after ``offsets[E]``) are unspecified, as ``moe_gemm_triton`` leaves them."""
    from lowbit.kernels.lut_gemm import lut_dequant_mma_experts_triton

    q, qh, sc, _, table = weights
    w = lut_dequant_mma_experts_triton(q, qh, sc, table, offsets, bits=bits, group_size=group_size,
                                       out_features=sc[0].shape[1], in_features=k, dtype=a.dtype)
    rows_in = a[row_map.long()] if row_map is not None else a
    return torch._grouped_mm(rows_in, w.transpose(1, 2), offs=offsets[1:])


def _fp8_dequant_gemm(a, sa, row_map, offsets, weights, inv_delta, k, group_size, out_dtype):
    """The grouped ``w4a8-fp8`` GEMM at prefill sizes (``FP8_DEQUANT_ROWS``): the routed experts' FP8(q * sigma)
    ``[E, N, K]`` in one launch, then ``torch._scaled_grouped_mm(a[row_map], W^T, sa[row_map], inv_delta[e] per
    column)`` in bf16 (cast to ``out_dtype``: fp16 calls get bf16-rounded outputs), the per-expert modules' large-M
    numerics (``_scaled_mm`` row-wise, also bf16 there); rows after ``offsets[E]`` are unspecified."""
    from lowbit.kernels.w4a8_fp8_gemm import dequantize_experts_to_fp8

    codes, scales = weights
    w = dequantize_experts_to_fp8(codes, scales, offsets, k, group_size)
    if row_map is not None:
        a, sa = a[row_map.long()], sa[row_map.long()]
    sb = inv_delta.float()[:, None].expand(w.shape[0], w.shape[1]).contiguous()
    if a.is_cuda:
        y = torch._scaled_grouped_mm(a, w.transpose(1, 2), sa.float(), sb, offs=offsets[1:], out_dtype=torch.bfloat16)
    else:
        y = _scaled_grouped_ref(a, w, sa.float(), sb, offsets)
    return y.to(out_dtype)


def _scaled_grouped_ref(a, w, sa, sb, offsets):
    """CPU stand-in of ``torch._scaled_grouped_mm`` (PyTorch has no CPU kernel): per expert ``(a @ w_e^T) * sa *
    sb_e`` in float32, rounded to bf16; rows after ``offsets[E]`` zero."""
    y = torch.zeros((a.shape[0], w.shape[1]), dtype=torch.bfloat16)
    off = offsets.tolist()
    for e in range(w.shape[0]):
        s0, s1 = off[e], off[e + 1]
        if s1 > s0:
            y[s0:s1] = ((a[s0:s1].float() @ w[e].float().t()) * sa[s0:s1, None] * sb[e][None, :]).to(torch.bfloat16)
    return y


@torch.library.custom_op("lowbit::moe_w4a8_fp8", mutates_args=())
def _moe_w4a8_fp8(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gu_codes: list[torch.Tensor], gu_scales: list[torch.Tensor], gu_pts: list[int],
                  dn_codes: list[torch.Tensor], dn_scales: list[torch.Tensor], dn_pts: list[int],
                  group_size: int) -> torch.Tensor:
    # the PTS factors as a device table built here, inside the op (torch.compile traces none of it)
    return _experts("w4a8-fp8", x, top_k_index, top_k_weights, [gu_codes, gu_scales],
                    inv_delta_table(gu_pts, gu_codes), [dn_codes, dn_scales], inv_delta_table(dn_pts, dn_codes),
                    group_size)


@_moe_w4a8_fp8.register_fake
def _(x, top_k_index, top_k_weights, gu_codes, gu_scales, gu_pts, dn_codes, dn_scales, dn_pts, group_size):
    return x.new_empty(x.shape)


@torch.library.custom_op("lowbit::moe_w4a8_int8", mutates_args=())
def _moe_w4a8_int8(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gu_qweight: list[torch.Tensor], gu_s1: list[torch.Tensor], gu_s2: list[torch.Tensor],
                   gu_zs: list[torch.Tensor], dn_qweight: list[torch.Tensor], dn_s1: list[torch.Tensor],
                   dn_s2: list[torch.Tensor], dn_zs: list[torch.Tensor], group_size: int, gu_tiled: bool,
                   dn_tiled: bool) -> torch.Tensor:
    return _experts("w4a8-int8", x, top_k_index, top_k_weights, [gu_qweight, gu_s1, gu_s2, gu_zs], None,
                    [dn_qweight, dn_s1, dn_s2, dn_zs], None, group_size, (gu_tiled, dn_tiled))


@_moe_w4a8_int8.register_fake
def _(x, top_k_index, top_k_weights, gu_qweight, gu_s1, gu_s2, gu_zs, dn_qweight, dn_s1, dn_s2, dn_zs, group_size,
      gu_tiled, dn_tiled):
    return x.new_empty(x.shape)


@torch.library.custom_op("lowbit::moe_lut", mutates_args=())
def _moe_lut(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             gu_qweight: list[torch.Tensor], gu_qweight_hi: list[torch.Tensor], gu_scales: list[torch.Tensor],
             gu_pairs: list[torch.Tensor], gu_table: list[torch.Tensor], dn_qweight: list[torch.Tensor],
             dn_qweight_hi: list[torch.Tensor], dn_scales: list[torch.Tensor], dn_pairs: list[torch.Tensor],
             dn_table: list[torch.Tensor], bits: int, group_size: int) -> torch.Tensor:
    return _experts("lut", x, top_k_index, top_k_weights, [gu_qweight, gu_qweight_hi, gu_scales, gu_pairs, gu_table],
                    None, [dn_qweight, dn_qweight_hi, dn_scales, dn_pairs, dn_table], None, group_size, bits=bits)


@_moe_lut.register_fake
def _(x, top_k_index, top_k_weights, gu_qweight, gu_qweight_hi, gu_scales, gu_pairs, gu_table, dn_qweight,
      dn_qweight_hi, dn_scales, dn_pairs, dn_table, bits, group_size):
    return x.new_empty(x.shape)


def inv_delta_table(pts_exps: list[int], codes: list[torch.Tensor]) -> torch.Tensor:
    """fp32 ``[E]`` of the experts' PTS ``2^-n`` on the codes' device (``lowbit._utils.device_table``)."""
    return device_table(tuple(2.0 ** -int(n) for n in pts_exps), torch.float32, codes[0].device)


def _check_routing(x, top_k_index, top_k_weights):
    check_tensor(x, "x", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=2)
    check_tensor(top_k_index, "top_k_index", dtype=(torch.int32, torch.int64), ndim=2)
    check_tensor(top_k_weights, "top_k_weights", dtype=(torch.float16, torch.bfloat16, torch.float32), ndim=2)
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index {list(top_k_index.shape)} and top_k_weights {list(top_k_weights.shape)} "
                         f"must both be [tokens, k] with tokens = {x.shape[0]}")


def _check_fields(name, names, fields, shapes, dtypes):
    """Every expert's fields: the given shapes and dtypes, one device, contiguous rows, one stride per field."""
    for f, fs, shape, dt in zip(names, fields, shapes, dtypes):
        for e, t in enumerate(fs):
            check_tensor(t, f"{name} {f}[{e}]", dtype=dt, shape=shape)
            if t.device != fields[0][0].device:
                raise ValueError(f"{name} {f}[{e}] is on {t.device}, expert 0 on {fields[0][0].device}")
            if t.stride(-1) != 1 or t.stride(0) != fs[0].stride(0):
                raise ValueError(f"{name} {f}[{e}]: rows must be contiguous with one stride for all experts")


def _common(x, top_k_index, gu, dn):
    """Checks shared by the grouped ops: expert counts, x against down's rows, the first expert's device (every
    expert's: ``_check_fields``, or the caller with ``weights_checked``)."""
    E = len(gu[0])
    if E == 0 or any(len(f) != E for f in (*gu, *dn)):
        raise ValueError("gate_up and down need the same number (>= 1) of experts' weight tensors in every field")
    if dn[0][0].dim() < 1 or dn[0][0].shape[0] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but the experts' down projections give "
                         f"{list(dn[0][0].shape)[:1]}")
    if gu[0][0].shape[0] % 2:
        raise ValueError(f"gate_up has {gu[0][0].shape[0]} rows: not gate rows then as many up rows")
    check_same_device(x=x, top_k_index=top_k_index, gate_up=gu[0][0], down=dn[0][0])


def moe_w4a8_fp8(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 gate_up: tuple[list[torch.Tensor], list[torch.Tensor], list[int]],
                 down: tuple[list[torch.Tensor], list[torch.Tensor], list[int]], group_size: int = 128, *,
                 weights_checked: bool = False) -> torch.Tensor:
    """The expert MLP of a MoE layer (module docstring) over ``w4a8-fp8`` experts. ``gate_up`` / ``down``: per expert
    ``(codes, scales, pts_exp)`` lists of ``W4A8FP8Linear`` buffers (gate_up ``[2I, H]``, down ``[H, I]``).
    ``weights_checked``: the caller built them consistent (``lowbit.nn.moe.QuantExperts``): only their count, x and
    the routing are checked."""
    _check_routing(x, top_k_index, top_k_weights)
    gu, dn = list(gate_up[:2]), list(down[:2])
    check_choice(group_size, "group_size", GROUP_SIZES)
    _common(x, top_k_index, gu, dn)
    if len(gate_up[2]) != len(gu[0]) or len(down[2]) != len(dn[0]):
        raise ValueError("gate_up and down need one pts_exp per expert")
    if not weights_checked:
        H, two_i = x.shape[1], gu[0][0].shape[0]
        for name, f, n, kk in (("gate_up", gu, two_i, H), ("down", dn, H, two_i // 2)):
            _check_fields(name, ("codes", "scales"), f, ([n, padded_k(kk) // 2], [n, scale_cols(kk, group_size)]),
                          (torch.uint8, FP8_E4M3))
    if x.shape[0] == 0 or top_k_index.shape[1] == 0:
        return torch.zeros_like(x)
    return run_op(_moe_w4a8_fp8, x.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous(), gu[0], gu[1],
                  [int(n) for n in gate_up[2]], dn[0], dn[1], [int(n) for n in down[2]], int(group_size))


def moe_w4a8_int8(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up: tuple[list[torch.Tensor], ...], down: tuple[list[torch.Tensor], ...],
                  group_size: int = 128, *, tiled: tuple[bool, bool] = (True, True),
                  weights_checked: bool = False) -> torch.Tensor:
    """The expert MLP of a MoE layer over ``w4a8-int8`` experts (QServe's W4A8): ``gate_up`` / ``down`` per expert
    ``(qweight, wscale, gscale, gzs)`` lists of ``W4A8INT8Linear`` buffers; ``group_size`` a multiple of 128 or -1
    (per-channel); ``tiled``: (gate_up's, down's) codes row-tiled (the modules' default where N % 64 == 0). INT8 per-token activations, exact INT32
    dots, ``float32(acc) * sx * s1`` (``lowbit.formats.w4a8_int8.gemm_ref``)."""
    from lowbit.formats.w4a8_int8 import padded_k as int8_padded_k

    _check_routing(x, top_k_index, top_k_weights)
    gu, dn = list(gate_up), list(down)
    if len(gu) != 4 or len(dn) != 4:
        raise ValueError("gate_up and down need the four fields (qweight, wscale, gscale, gzs) per expert")
    if group_size != -1 and (group_size < 128 or group_size % 128):
        raise ValueError(f"group_size must be a multiple of 128 or -1 (per-channel) for the grouped MoE GEMM, got "
                         f"{group_size}")
    _common(x, top_k_index, gu, dn)
    if not weights_checked:
        H, two_i = x.shape[1], gu[0][0].shape[0]
        for name, f, n, kk in (("gate_up", gu, two_i, H), ("down", dn, H, two_i // 2)):
            kp = int8_padded_k(kk, group_size)
            G = 1 if group_size == -1 else kp // group_size
            _check_fields(name, ("qweight", "wscale", "gscale", "gzs"), f, ([n, kp // 2], [n], [n, G], [n, G]),
                          (torch.uint8, torch.float32, torch.uint8, torch.uint8))
    if x.shape[0] == 0 or top_k_index.shape[1] == 0:
        return torch.zeros_like(x)
    return run_op(_moe_w4a8_int8, x.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous(), *gu, *dn,
                  int(group_size), bool(tiled[0]), bool(tiled[1]))


def moe_lut(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up: tuple[list[torch.Tensor], ...], down: tuple[list[torch.Tensor], ...], bits: int = 4,
            group_size: int = 128, *, weights_checked: bool = False) -> torch.Tensor:
    """The expert MLP of a MoE layer over ``lut`` experts (FLUTE's weight-only lookup-table format): ``gate_up`` /
    ``down`` per expert ``(qweight, qweight_hi, scales, pairs, table)`` lists of ``LUTLinear`` buffers in the fragment
    layout (``layout='mma'``: 4-bit with group 64 / 128 / 256, 3-bit with 128 / 256; ``qweight_hi`` None or the codes
    again at 4 bits); ``x`` bf16 or fp16, the dtype of the scales and pairs (the modules' dtype)."""
    from lowbit.formats.lut import mma_layout_ok, mma_packed_shapes

    _check_routing(x, top_k_index, top_k_weights)
    if bits not in (3, 4) or group_size not in (64, 128, 256) or not mma_layout_ok(bits, group_size):
        raise ValueError(f"bits and group_size must fit the fragment layout (4-bit: group 64 / 128 / 256; 3-bit: 128 / "
                         f"256), got bits={bits}, group_size={group_size}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bf16 or fp16 (the experts' activation dtype) for lut experts, got {x.dtype}")
    gu, dn = list(gate_up), list(down)
    if len(gu) != 5 or len(dn) != 5:
        raise ValueError("gate_up and down need the five fields (qweight, qweight_hi, scales, pairs, table) per expert")
    for name, f in (("gate_up", gu), ("down", dn)):
        if f[1] is None or any(t is None for t in f[1]):
            if bits == 3:
                raise ValueError(f"{name} qweight_hi: 3-bit experts need their high-bit planes, got None")
            f[1] = f[0]
    E = len(gu[0])
    if E == 0 or any(len(f) != E for f in (*gu, *dn)):
        raise ValueError("gate_up and down need the same number (>= 1) of experts' weight tensors in every field")
    two_i = gu[2][0].shape[1] if gu[2][0].dim() == 2 else -1
    if two_i < 0 or two_i % 2:
        raise ValueError(f"gate_up scales {list(gu[2][0].shape)}: not [groups, 2I] (gate rows then as many up rows)")
    if dn[2][0].dim() != 2 or dn[2][0].shape[1] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but the experts' down projections give "
                         f"{list(dn[2][0].shape)[1:]}")
    check_same_device(x=x, top_k_index=top_k_index, gate_up=gu[0][0], down=dn[0][0])
    if not weights_checked:
        H = x.shape[1]
        for name, f, n, kk in (("gate_up", gu, two_i, H), ("down", dn, H, two_i // 2)):
            qs, _, hs = mma_packed_shapes(n, kk, bits, group_size)
            ng = -(-kk // group_size)
            shapes = (list(qs), list(hs) if bits == 3 else list(qs), [ng, n], [4 ** bits, 2], [2 ** bits])
            _check_fields(name, ("qweight", "qweight_hi", "scales", "pairs", "table"), f, shapes,
                          (torch.int32, torch.int32, x.dtype, x.dtype, torch.float32))
            for fname, fs in (("qweight", f[0]), ("qweight_hi", f[1]), ("pairs", f[3])):
                for e, t in enumerate(fs):
                    if not t.is_contiguous():  # the kernel reads them at their packed strides
                        raise ValueError(f"{name} {fname}[{e}] must be contiguous")
    if x.shape[0] == 0 or top_k_index.shape[1] == 0:
        return torch.zeros_like(x)
    return run_op(_moe_lut, x.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous(), *gu, *dn, int(bits),
                  int(group_size))
