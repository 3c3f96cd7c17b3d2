"""Fast generation for (quantized) Llama-family models: a gpt-fast style runner.

``model.generate`` of transformers keeps working on every lowbit model; this runner is the
throughput path. It reuses the model's own modules (embeddings, RMSNorms, rotary embedding, the
seven linears of each layer, whatever quantized modules a recipe installed, ``lm_head``) but owns
the loop, the KV cache and the attention calls, so the decode step is a fixed-shape function
that is captured once per batch size in a CUDA graph (no Python or launch overhead per token).

Batched requests of different lengths: prompts are right-padded into one ``[B, S]`` prefill
(causal attention means a real token never sees the padding after it); each request then decodes
at its own position ``pos[b]`` (writes go to slot ``pos[b]``, attention sees keys ``<= pos[b]``),
so stale padding slots are overwritten before they are ever attended to.

KV cache backends (chosen from the recipe record ``model.lowbit_recipe``, or ``kv=``):

- ``None``: a static cache in the model's dtype, ``[B, Hkv, S_max, D]`` per layer; decode
  attention is ``F.scaled_dot_product_attention`` with the G = Hq/Hkv query heads of one KV head
  as G query rows (no K/V copy for GQA) and a per-request length mask;
- ``'kv4'`` / ``'kv4-zp'``: the paged INT4 cache of ``lowbit.ops.kv4`` (FireQ / QServe layout:
  codes ``uint8 [pages, Hkv, PAGE, D/2]``, one scale per token per head, page table ``int32
  [B, pages_per_seq]``), written with ``kv4_append`` (post-RoPE keys, CRS scales applied there)
  and read with the split-KV ``decode_kv4`` kernel (CRS inverse on Q inside).

Prefill attention: ``lowbit.attention(q, k, v, scheme=..., causal=True)`` with the recipe's
prefill scheme ('fp8', 'int8', ... or 'sdpa'), on post-RoPE Q/K/V in the model dtype; only the
last real token of each request goes through ``lm_head`` (serving convention).

Fusions (``fuse=True``, default; ``_FusedLayer``): q/k/v run as one GEMM and gate/up as one
(``_fuse_rows``); with W4A8 projections (w4a8-fp8 / w4a8-int8) the runner quantizes activations
itself, each in ONE launch of ``lowbit.kernels.act_quant`` fused with the op producing them:
``RMSNorm -> per-token quant`` (shared by q/k/v, by gate/up, and by a quantized ``lm_head``),
``SiLU(gate) * up -> per-token quant`` (down's input), then calls the GEMM op on the codes; the
residual adds of ``o_proj``/``down_proj`` go into the w4a8-fp8 epilogue. RoPE cos/sin are computed
once per forward (shared by all layers). The codes and scales are bit-identical to the eager
modules' (tests), so fused and unfused runs give the same tokens.

RoPE (session 5): one launch of ``lowbit.kernels.rope`` rotates q and k together (they are adjacent
slices of the fused q/k/v output) with transformers' rounding (each half-precision op rounded, bit
for bit; ``ROPE_KERNEL``); over the KV4 cache the decode step rotates q inside the ``kv4_append``
launch that already rotates k (``ROPE_Q_APPEND``), so RoPE costs no launch of its own; over the float
cache with lowbit's decode kernel (``dense_decode='kernel'``) one ``float_append_triton`` launch per
layer rotates q and k (the same half-precision bits) and writes the new k/v slots. At batch 1
(``pdl_max_m``) the W4A8-FP8 act-quant and GEMM kernels are programmatic dependent launches (Hopper),
so each launch overlaps the previous kernel's tail inside the CUDA graph; same numerics.

CPU: the same code runs eagerly (no graphs); kernels run under the Triton interpreter or fall
back to their references, so tests compare the runner's greedy tokens with ``model.generate``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowbit._utils import capture_cuda_graph, check_int, interpret_mode, triton_available, use_triton
from lowbit.models.arch import check_llama_family, check_window

__all__ = ["Generator", "generate"]


@dataclass
class _Arch:
    embed: nn.Module
    layers: list
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module
    hq: int
    hkv: int
    d: int
    interleaved: bool


def _arch(model) -> _Arch:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise ValueError(f"Generator supports Llama-family *ForCausalLM models, got {type(model).__name__}")
    check_llama_family(model)
    cfg = model.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return _Arch(inner.embed_tokens, list(inner.layers), inner.norm, inner.rotary_emb, model.lm_head, hq, hkv, d,
                 bool(getattr(cfg, "rope_interleave", False)))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [B, H, S, D], cos/sin [B, S, D] (HF layout: the half pattern repeated)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin



# ------------------------------------------------------------------------------ fusion
def _fuse_rows(mods):
    """One module computing ``cat([m(x) for m in mods], -1)``, or None when the modules cannot be
    stacked exactly. ``nn.Linear``: weights concatenated. ``QuantLinear``: same class, same
    ``config()`` (e.g. the same PTS exponent), every buffer either stacking along the rows as
    ``QuantLinear.fuse_layout`` says (``(dim, r)``: size ``out_features / r`` along ``dim``, every
    module's out_features a multiple of ``r``: concatenated along ``dim``; default ``(0, 1)``,
    row-major; ``(dim, r, align)``: also every module but the last a multiple of ``align`` rows) or
    identical across modules (shared, e.g. a table), after the class's ``prepare_fusion`` hook had
    its chance to make them stackable (e.g. tiled codes back to row-major); the fused module comes from
    ``cls.empty`` and must have the same buffer shapes, else None (never an inexact fusion). The
    originals' tensors become views of the fused ones (narrowed along ``dim``), so no memory is
    duplicated and the transformers path keeps working."""
    from lowbit.nn.base import QuantLinear

    if all(type(m) is nn.Linear for m in mods):
        if len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in mods}) != 1:
            return None
        w = torch.cat([m.weight.detach() for m in mods], 0)
        f = nn.Linear(mods[0].in_features, w.shape[0], bias=mods[0].bias is not None, device=w.device,
                      dtype=w.dtype)
        f.weight = nn.Parameter(w, requires_grad=False)
        if f.bias is not None:
            f.bias = nn.Parameter(torch.cat([m.bias.detach() for m in mods], 0), requires_grad=False)
        a = 0
        for m in mods:
            b = a + m.out_features
            m.weight = nn.Parameter(f.weight[a:b], requires_grad=False)
            if f.bias is not None:
                m.bias = nn.Parameter(f.bias[a:b], requires_grad=False)
            a = b
        return f
    cls = type(mods[0])
    if not isinstance(mods[0], QuantLinear) or any(type(m) is not cls for m in mods):
        return None
    m0 = mods[0]
    if len({(m.in_features, m.dtype) for m in mods}) != 1:
        return None
    cls.prepare_fusion(mods)  # e.g. a layout change in place that makes the modules stackable
    try:
        cfgs = [m.config() for m in mods]
    except NotImplementedError:
        return None
    if any(c != cfgs[0] for c in cfgs):
        return None
    names = [n for n, _ in m0.named_buffers(recurse=False)]
    try:
        lays = [m.fuse_layout() for m in mods]
    except NotImplementedError:
        return None
    plan = {}
    for n in names:
        ts = [dict(m.named_buffers(recurse=False)).get(n) for m in mods]
        if any(t is None for t in ts):
            return None
        lay = {lay_m.get(n, (0, 1)) for lay_m in lays}
        if len(lay) != 1:
            return None
        lay = lay.pop()
        if lay is not None:
            d, r, align = (*lay, 1)[:3]
            stacks = all(
                t.ndim > d and r >= 1 and m.out_features % r == 0 and t.shape[d] == m.out_features // r
                and t.shape[:d] + t.shape[d + 1:] == ts[0].shape[:d] + ts[0].shape[d + 1:]
                for t, m in zip(ts, mods)) and all(m.out_features % align == 0 for m in mods[:-1])
            if stacks:
                plan[n] = ("rows", d, r, torch.cat(ts, d))
                continue
        if all(t.shape == ts[0].shape and torch.equal(t, ts[0]) for t in ts):
            plan[n] = ("shared", 0, 1, ts[0])
        else:
            return None
    out = sum(m.out_features for m in mods)
    try:
        f = cls.empty(m0.in_features, out, "bias" in plan, m0.dtype, **cfgs[0])
    except Exception:
        return None
    fb = dict(f.named_buffers(recurse=False))
    if set(fb) != set(plan):
        return None
    for n, (_, _, _, t) in plan.items():
        if fb[n].shape != t.shape or fb[n].dtype != t.dtype:
            return None
    f = f.to(plan[names[0]][3].device)
    for n, (_, _, _, t) in plan.items():
        f._buffers[n] = t
    a = 0
    for m in mods:
        for n, (kind, d, r, t) in plan.items():
            if kind == "rows":
                m._buffers[n] = t.narrow(d, a // r, m.out_features // r)
        a += m.out_features
    return f


# RoPE of q (and k) by ``lowbit.kernels.rope`` (one launch, same bits as the eager ops) instead of
# transformers' four ops per tensor. R13 A/B (H200, Llama-3-8B shapes, tokens/s, same run): decode B=1 1k
# fireq 326 -> 345, bf16 138 -> 141; prefill 16 x 1024 fireq 63.0k -> 70.1k; bit-equal to the eager ops (8/8
# GPU cases, R13) and the same greedy tokens (bf16 and fireq runners).
ROPE_KERNEL = True
# decode over the KV4 cache: q rotated inside the append kernel (``kv4_append``'s ROPE_Q), one launch
# fewer per layer. R12 + R13 A/B vs ``ROPE_KERNEL`` alone: B=1 1k 346 / 345 vs 343 / 345, 8k 337 / 345 vs
# 337 / 341, B=16 1k 4897 / 5026 vs 4868 / 4972 (same greedy tokens). Session 9: also the float cache with
# dense_decode='kernel' (``float_append_triton``: q and k rotated, k/v written; S9a: flute-nf4 B=1 1k 330 vs 314).
ROPE_Q_APPEND = True
# the residual adds of projections without a residual epilogue (INT8, LUT, bf16) left pending and done by
# the next RMSNorm launch (act-quant or float rows kernel, ``add=``: one launch instead of two, same bits).
FUSED_ADD = True
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # RoPE values depend on the position only
_ACT_FORMAT = {"w4a8-fp8": "fp8", "w4a8-int8": "int8"}  # scheme -> per-token activation format
_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # weight * norm(x).to(dtype)


def _quant_rows(x2: torch.Tensor, fmt: str, *, norm: nn.Module | None = None, up: torch.Tensor | None = None,
                pdl: bool = False, add: torch.Tensor | None = None):
    """Per-token quantization of ``x2 [M, K]`` to ``fmt`` ('fp8' / 'int8') in ONE launch, optionally
    fused with the op producing it: ``norm`` (an HF RMSNorm: quantize ``norm(x2)``) or ``up``
    (quantize ``silu(x2) * up``). Kernel ``lowbit.kernels.act_quant`` (bit-exact with the eager
    modules followed by ``quantize_per_token``); without Triton the eager modules + reference.
    ``pdl``: launch it as a programmatic dependent launch (``lowbit.kernels.act_quant``; same codes).
    ``add`` (with ``norm``): the pending residual update: quantize ``norm(x2 + add)`` and return
    ``(codes, scales, x2 + add)`` (the add fused into the same launch, bit-equal to torch's add)."""
    from lowbit.formats.common import FP8_E4M3, quantize_per_token

    dtype = FP8_E4M3 if fmt == "fp8" else torch.int8
    if add is not None and not use_triton(x2):
        x2 = x2 + add
        return (*_quant_rows(x2, fmt, norm=norm, up=up), x2)
    if use_triton(x2):
        from lowbit.kernels.act_quant import per_token_quant_triton

        if norm is not None:
            return per_token_quant_triton(x2, dtype, fuse="rmsnorm", weight=norm.weight,
                                          eps=float(norm.variance_epsilon), pdl=pdl, add=add)
        if up is not None:
            return per_token_quant_triton(x2, dtype, fuse="silu_mul", up=up, pdl=pdl)
        return per_token_quant_triton(x2, dtype, pdl=pdl)
    if norm is not None:
        x2 = norm(x2)
    elif up is not None:
        x2 = F.silu(x2) * up
    return quantize_per_token(x2, dtype)


def _float_rows(x: torch.Tensor, *, norm: nn.Module | None = None, up: torch.Tensor | None = None,
                pdl: bool = False, add: torch.Tensor | None = None):
    """``norm(x)`` (an HF RMSNorm) or ``silu(x) * up`` for float (weight-only) projections: one launch
    of ``lowbit.kernels.act_quant.fused_rows_triton`` (the eager rounding of each intermediate) where
    Triton runs, else the eager modules. ``pdl``: a programmatic dependent launch (same values).
    ``add`` (with ``norm``): returns ``(norm(x + add), x + add)``, the residual add in the same launch."""
    if use_triton(x):
        from lowbit.kernels.act_quant import fused_rows_triton

        if norm is not None:
            return fused_rows_triton(x, fuse="rmsnorm", weight=norm.weight, eps=float(norm.variance_epsilon), pdl=pdl,
                                     add=add)
        return fused_rows_triton(x, fuse="silu_mul", up=up, pdl=pdl)
    if add is not None:
        x = x + add
        return norm(x), x
    return norm(x) if norm is not None else F.silu(x) * up


def _fusable_norm(norm, dtype) -> bool:
    """The act-quant kernel's RMSNorm is HF Llama's: only fuse those, with a weight in x's dtype."""
    w = getattr(norm, "weight", None)
    return (type(norm).__name__ in _RMSNORMS and hasattr(norm, "variance_epsilon") and w is not None
            and w.dtype == dtype)


def _rows(x: torch.Tensor) -> int:
    """Rows of ``x`` as a projection sees them (the leading dims flattened)."""
    return x.numel() // x.shape[-1]


class _Proj:
    """One projection of the runner: the module, and whether it takes pre-quantized activations.

    ``aq``: 'fp8' (``W4A8FP8Linear``) or 'int8' (``W4A8INT8Linear``) when the module's forward is
    "per-token quantize x, then a GEMM on codes" (so the runner may quantize x itself, fused with
    the op that produced it, and call the GEMM op directly), else None (float input only)."""

    def __init__(self, mod: nn.Module):
        self.mod = mod
        self.aq = _ACT_FORMAT.get(getattr(mod, "scheme", None))
        self.res_epilogue = self.aq == "fp8"  # its GEMM adds a residual in the epilogue (``residual=``)
        self.silu_mul = getattr(mod, "activation", None) == "silu_mul"
        self.pdl_max_m = 0  # set by the Generator: programmatic dependent launch up to this many rows
        # a LUT projection on the fragment kernel: called with ``pdl=`` (its float rows kernels follow suit)
        self.lut = getattr(mod, "scheme", None) == "lut" and getattr(mod, "layout", None) == "mma"

    def pdl(self, m: int) -> bool:
        """Launch this projection's act-quant (or float rows) + GEMM as programmatic dependent launches
        for ``m`` rows?"""
        return (self.aq is not None or self.lut) and 0 < m <= self.pdl_max_m

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``mod(x)``; ``residual`` (``res_epilogue`` modules only) is added in the GEMM epilogue."""
        if residual is not None:
            return self.mod(x, residual=residual)
        # LUT at batch 1: a PDL launch. (Its residual add is left to the next norm launch: the kernel with the
        # add in its epilogue was bit-equal but slower, S9 probe on the H200, M = 1: down 27.7 vs 19.5 us.)
        return self.mod(x, pdl=True) if self.lut and self.pdl(_rows(x)) else self.mod(x)

    def gemm(self, xq: torch.Tensor, sx: torch.Tensor, lead, dtype, residual: torch.Tensor | None = None):
        """The module's GEMM on per-token codes ``xq [M, K]`` / scales ``sx [M]`` -> ``[*lead, N]``
        (+ ``residual`` in the epilogue, ``res_epilogue`` modules only); at ``pdl(M)`` rows a programmatic
        dependent launch after the PDL act-quant (FP8 since session 5, INT8 since session 9)."""
        m = self.mod
        pdl = self.pdl(xq.shape[0])
        if self.aq == "fp8":
            from lowbit.ops.w4a8_fp8 import w4a8_fp8_gemm

            res = None if residual is None else residual.reshape(xq.shape[0], -1)
            y = w4a8_fp8_gemm(xq, sx, m.codes, m.scales, m.inv_delta, m.in_features, m.group_size, m.bias,
                              residual=res, silu_mul=self.silu_mul, out_dtype=dtype, pdl=pdl)
        else:  # int8 (QServe)
            from lowbit.ops.w4a8_int8 import w4a8_int8_gemm

            y = w4a8_int8_gemm(xq, sx, m.qweight, m.wscale, m.gscale, m.gzs, m.bias, out_dtype=dtype, pdl=pdl,
                               tiled=m.tiled)
        return y.reshape(*lead, y.shape[-1])


def _moe_graphs(experts, max_batch: int, dtype: torch.dtype | None = None) -> tuple[bool, bool]:
    """(can a CUDA graph capture this MoE experts module's decode, does the ``Generator`` capture it by default).
    lowbit's experts: their grouped (``w4a8-fp8``, ``w4a8-int8``, ``lut`` called in its experts' dtype: the runner's
    ``dtype``) or dense schedule, up to ``DENSE_MAX_TOKENS`` tokens; by default
    the dense one only up to ``DENSE_GRAPH_MAX_EXPERTS`` experts (``lowbit.nn.moe``). transformers' experts: only bf16 ones with the
    ``grouped_mm`` implementation on Hopper / Blackwell, where PyTorch's ``_grouped_mm`` stays on the device (timed
    inside a CUDA graph in ``benchmarks/results/h200/s38_moe_graph.json``; elsewhere it reads the offsets on the
    host, a review finding); never transformers' eager loop (``nonzero``)."""
    from lowbit.nn.moe import DENSE_GRAPH_MAX_EXPERTS, DENSE_MAX_TOKENS, QuantExperts

    if isinstance(experts, QuantExperts):
        ok = max_batch <= DENSE_MAX_TOKENS
        spec = experts.grouped_weights()
        grouped = spec is not None and (spec["scheme"] != "lut" or dtype is None or spec["dtype"] == dtype)
        return ok, ok and (experts.num_experts <= DENSE_GRAPH_MAX_EXPERTS or grouped)
    w = getattr(experts, "gate_up_proj", None)
    ok = (getattr(getattr(experts, "config", None), "_experts_implementation", None) == "grouped_mm"
          and isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16)
    if ok and w.device.type == "cuda":
        from lowbit._utils import cuda_major

        ok = cuda_major(w.device) in (9, 10)
    return ok, ok


class _FusedLayer:
    """Per-layer plan of the runner.

    - ``qkv``: q/k/v stacked into one projection where they stack exactly (``_fuse_rows``), else None;
    - ``gate_up``: gate/up stacked (output ``[gate | up]``), or the recipe's own fused gate_up with
      SiLU*mul from its GEMM (a ``nn.base.FusedMLP``: ``nn.w4a8_fp8.fuse_mlp``, ``nn.lut.fuse_mlp``), else None;
    - with W4A8 projections (``_Proj.aq``), the input RMSNorms are fused into the activation
      quantization (``norm_q`` / ``post_q``: one launch gives the codes shared by q/k/v, and by
      gate/up), SiLU*mul is fused into the quantization of ``down``'s input, and the residual adds of
      ``o_proj`` / ``down_proj`` go into the w4a8-fp8 epilogue.
    """

    def __init__(self, layer, dtype, fuse: bool = True, float_kernels: bool = False):
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj]) if fuse else None
        self.split = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
        self.q, self.k, self.v = _Proj(attn.q_proj), _Proj(attn.k_proj), _Proj(attn.v_proj)
        self.o = _Proj(attn.o_proj)
        self.qkv_p = _Proj(self.qkv) if self.qkv is not None else None
        self.gate_up = self.gate_up_p = None
        self.mlp = mlp
        self.down = None
        if fuse and hasattr(mlp, "gate_up") and hasattr(mlp, "down_proj") \
                and getattr(mlp.gate_up, "activation", None) == "silu_mul":
            self.gate_up_p, self.down = _Proj(mlp.gate_up), _Proj(mlp.down_proj)  # output silu(g) * u
            self.gate_up = mlp.gate_up
        elif all(hasattr(mlp, r) for r in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            self.down = _Proj(mlp.down_proj)
            self.act = mlp.act_fn
            self.inter = mlp.gate_proj.out_features
            if fuse:
                self.gate_up = _fuse_rows([mlp.gate_proj, mlp.up_proj])
                self.gate_up_p = _Proj(self.gate_up) if self.gate_up is not None else None
            if self.gate_up_p is None:
                self.gate_p, self.up_p = _Proj(mlp.gate_proj), _Proj(mlp.up_proj)
        # where the runner quantizes activations itself (same format for every consumer)
        first = self.qkv_p.aq if self.qkv_p is not None else None
        self.norm_q = first if fuse and first and _fusable_norm(self.in_norm, dtype) else None
        self.o_q = self.o.aq if fuse else None
        gu = self.gate_up_p.aq if self.gate_up_p is not None else None
        self.post_q = gu if fuse and gu and _fusable_norm(self.post_norm, dtype) else None
        silu_act = type(getattr(self, "act", None)).__name__ in ("SiLU", "SiLUActivation")
        # float (weight-only / bf16) inputs: RMSNorm and SiLU*mul as one launch each (``_float_rows``)
        fk = fuse and float_kernels
        self.norm_f = fk and not self.norm_q and _fusable_norm(self.in_norm, dtype)
        self.post_f = fk and not self.post_q and _fusable_norm(self.post_norm, dtype)
        self.silu_f = fk and silu_act
        self.fused_add = FUSED_ADD  # set by the Generator (``fused_add``)
        self.down_q = self.down.aq if (fuse and self.down is not None and self.down.aq and
                                       self.gate_up_p is not None and not self.gate_up_p.silu_mul and
                                       silu_act) else None

    # ---------------------------------------------------------------------------- compute
    def qkv_proj(self, x: torch.Tensor, pend: torch.Tensor | None = None):
        """``x`` (the residual stream ``[B, S, H]``) plus the pending update ``pend`` (or None) ->
        q, k, v ``[B, S, *]`` (input norm included) and the residual stream ``x + pend``."""
        if self.qkv_p is not None:
            h, x = self._norm(x, pend, self.in_norm, self.norm_q, self.norm_f, self.qkv_p)
            y = self.qkv_p.gemm(*h, x.shape[:-1], x.dtype) if self.norm_q else self.qkv_p(h)
            return (*y.split(self.split, dim=-1), x)
        h, x = self._norm(x, pend, self.in_norm, None, self.norm_f, self.q)
        return self.q(h), self.k(h), self.v(h), x

    def _norm(self, x, pend, norm, q_fmt, fused, consumer):
        """``consumer``'s input ``norm(x + pend)`` (``pend``: a residual update not yet added, or None)
        and the residual stream ``x + pend``: per-token codes ``(xq [M, K], sx [M])`` when ``q_fmt``
        (the add, norm and quantization in one launch), the float value of one ``_float_rows`` launch
        when ``fused``, else the eager add and norm."""
        if q_fmt:
            x2 = x.reshape(-1, x.shape[-1])
            pdl = consumer.pdl(x2.shape[0])
            if pend is None:
                return _quant_rows(x2, q_fmt, norm=norm, pdl=pdl), x
            xq, sx, r = _quant_rows(x2, q_fmt, norm=norm, pdl=pdl, add=pend.reshape(x2.shape))
            return (xq, sx), r.reshape(x.shape)
        if fused:
            pdl = consumer.pdl(_rows(x))
            if pend is None:
                return _float_rows(x, norm=norm, pdl=pdl), x
            return _float_rows(x, norm=norm, pdl=pdl, add=pend)
        if pend is not None:
            x = x + pend
        return norm(x), x

    def _residual(self, proj: _Proj, x: torch.Tensor, run):
        """The residual stream after ``x + proj(...)`` as ``(x, pend)`` (the stream is ``x + pend``; pend
        None: ``x`` itself). ``run(residual)`` computes the projection: given ``residual=x`` where its GEMM
        epilogue adds it (``proj.res_epilogue``: W4A8-FP8), else None; the update is then left pending for
        the next norm launch to add (``fused_add``), or added at once."""
        if proj.res_epilogue:
            return run(x), None
        y = run(None)
        return (x, y) if self.fused_add else (x + y, None)

    def finish(self, x: torch.Tensor, o: torch.Tensor):
        """``x + o_proj(o)`` then the MLP block with its residual. Returns ``(x, pend)``: the layer's
        output is ``x + pend`` (``pend`` None: ``x`` itself; see ``_residual``)."""
        lead = x.shape[:-1]
        if self.o_q:  # separate quant + GEMM (R4, w4a8_fp8 area: faster than quantizing in the GEMM)
            o2 = o.reshape(-1, o.shape[-1])
            xq, sx = _quant_rows(o2, self.o_q, pdl=self.o.pdl(o2.shape[0]))
            x, pend = self._residual(self.o, x, lambda r: self.o.gemm(xq, sx, lead, x.dtype, residual=r))
        else:
            x, pend = self._residual(self.o, x, lambda r: self.o(o, residual=r))
        if self.gate_up_p is None and self.down is None:  # some other MLP: the module itself
            if pend is not None:
                x = x + pend
            return x + self.mlp(self.post_norm(x)), None
        if self.post_q:
            (xq, sx), x = self._norm(x, pend, self.post_norm, self.post_q, False, self.gate_up_p)
            gu = self.gate_up_p.gemm(xq, sx, lead, x.dtype)
        elif self.gate_up_p is not None:
            h, x = self._norm(x, pend, self.post_norm, None, self.post_f, self.gate_up_p)
            gu = self.gate_up_p(h)
        else:
            h, x = self._norm(x, pend, self.post_norm, None, self.post_f, self.gate_p)
            gu = None
            a = self.act(self.gate_p(h)) * self.up_p(h)
        if gu is not None:
            if self.gate_up_p.silu_mul:
                a = gu
            elif self.down_q:
                g, u = gu.reshape(-1, gu.shape[-1]).split(self.inter, dim=-1)
                xq, sx = _quant_rows(g, self.down_q, up=u, pdl=self.down.pdl(g.shape[0]))
                return self._residual(self.down, x, lambda r: self.down.gemm(xq, sx, lead, x.dtype, residual=r))
            else:
                g, u = gu.split(self.inter, dim=-1)
                a = _float_rows(g, up=u, pdl=self.down.pdl(_rows(g))) if self.silu_f else self.act(g) * u
        return self._residual(self.down, x, lambda r: self.down(a, residual=r))


# ---------------------------------------------------------------------------- KV backends
# The dense cache's kernel decode as ONE launch (``lowbit.kernels.decode_float.decode_float_append_triton``, the
# launcher of op ``lowbit::decode_float_append``, called directly as the runner calls ``float_append_triton``: q / k
# rotated, k / v written, attention, the split combine by the last program) instead of three (the append, the
# decode, the combine). Session 27; False keeps the three launches (bench token ``+attn3``).
FUSED_FLOAT_DECODE = True


class DenseKV:
    """Static float cache, one ``[B, Hkv, S_max, D]`` K and V per layer.

    Decode attention (``kernel``): False = SDPA with a length mask (transformers' path: the bf16
    baseline), True = ``lowbit.ops.kv4.decode_float``, the split-KV Triton kernel, reading this
    cache as one page of ``S_max`` tokens per request (``page_table[b] = [b]``, ``lengths = pos + 1``)."""

    name = "dense"
    rope_in_append = False

    sm_scale: float | None = None  # softmax scale (None: D^-0.5); the Generator sets the model's own

    def __init__(self, n_layers, batch, hkv, smax, d, dtype, device, *, kernel: bool = False):
        smax = -(-smax // 64) * 64  # aligned key length: SDPA's memory-efficient kernel takes the mask
        self.k = [torch.zeros(batch, hkv, smax, d, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.smax = smax
        self.keys_pos = torch.arange(smax, device=device)
        self.kernel = bool(kernel)
        self.page_table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def rope_in_decode(self) -> bool:
        """Decode may take pre-RoPE q/k (``q_rope``): with the kernel, one ``float_append_triton`` launch
        per layer rotates q and k and writes k/v (instead of a rope launch + two index_put writes)."""
        return self.kernel

    def write_prefill(self, layer, k, v, lengths, cos=None, sin=None):
        S = k.shape[2]
        self.k[layer][: k.shape[0], :, :S] = k
        self.v[layer][: v.shape[0], :, :S] = v

    def step_state(self, pos, rows):
        """What every layer's ``decode`` of one step shares (computed once per step): the length
        mask of the new tokens (SDPA) or the lengths ``pos + 1`` and write slots ``pos`` (the kernel)."""
        B = pos.shape[0]
        if self.kernel:  # lengths and the int32 write slots of float_append_triton
            start = pos.to(torch.int32)
            return pos, rows, start + 1, start
        return pos, rows, self.keys_pos.view(1, 1, 1, -1) <= pos.view(B, 1, 1, 1), None

    def decode(self, layer, q, k, v, st, cos=None, sin=None, q_rope=False, qk_norm=None):
        """q [B, Hq, 1, D], k/v [B, Hkv, 1, D] post-RoPE (pre-RoPE q and k with ``q_rope``: rotated by the
        append launch, same bits; ``qk_norm`` = (w_q, w_k, eps): normalised there first, Qwen3); writes slot
        pos[b] then attends (``st`` from ``step_state``)."""
        pos, rows, mask, start = st
        B, Hq, _, D = q.shape
        kc, vc = self.k[layer][:B], self.v[layer][:B]
        if q_rope and FUSED_FLOAT_DECODE:  # one launch: rotate q / k, write k / v, attend, combine the splits
            from lowbit.kernels.decode_float import decode_float_append_triton

            return decode_float_append_triton(q, k, v, kc, vc, self.page_table[:B], mask, cos=cos, sin=sin,
                                              sm_scale=self.sm_scale or D ** -0.5, max_len=self.smax,
                                              qk_norm=qk_norm)
        if q_rope:  # kernel mode only (rope_in_decode); the dense cache is one page per request
            from lowbit.kernels.kv4_append import float_append_triton

            qo = torch.empty(B, 1, Hq, D, device=q.device, dtype=q.dtype).transpose(1, 2)
            float_append_triton(k, v, kc, vc, self.page_table[:B], start, cos=cos, sin=sin, q=q, q_out=qo,
                                qk_norm=qk_norm)
            q = qo
        else:
            kc[rows, :, pos] = k[:, :, 0]
            vc[rows, :, pos] = v[:, :, 0]
        hkv = kc.shape[1]
        if self.kernel:  # mask = lengths (int32 [B]) from step_state
            from lowbit.ops.kv4 import decode_float

            return decode_float(q, kc, vc, self.page_table[:B], mask, sm_scale=self.sm_scale or D ** -0.5,
                                max_len=self.smax)
        qg = q.view(B, hkv, Hq // hkv, D)
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=self.sm_scale)
        return o.reshape(B, Hq, 1, D)


class PagedKV4:
    """Paged INT4 cache through ``lowbit.ops.kv4`` (see module docstring). Request b owns pages
    ``[b * P, (b + 1) * P)``; ``lengths`` counts cached tokens including the new one."""

    name = "kv4"

    sm_scale: float | None = None  # softmax scale (None: D^-0.5); the Generator sets the model's own

    def __init__(self, n_layers, batch, hkv, smax, d, dtype, device, *, zero_point=False, page=64, crs=None,
                 scale_dtype=torch.float8_e4m3fn, splits: int | None = None):
        from lowbit.ops import kv4 as kv4ops  # noqa: F401  (fails early with ImportError)

        self.ops = kv4ops
        self.page = page
        self.pages_per_seq = math.ceil(smax / page)
        self.smax = self.pages_per_seq * page
        n_pages = batch * self.pages_per_seq
        self.zero_point = zero_point

        def alloc():
            codes = torch.zeros(n_pages, hkv, page, d // 2, dtype=torch.uint8, device=device)
            scale = torch.zeros(n_pages, hkv, page, dtype=scale_dtype, device=device)
            zero = torch.zeros(n_pages, hkv, page, dtype=torch.uint8, device=device) if zero_point else None
            return codes, scale, zero

        self.kc, self.ks, self.kz, self.vc, self.vs, self.vz = [], [], [], [], [], []
        for _ in range(n_layers):
            c, s, z = alloc()
            self.kc.append(c), self.ks.append(s), self.kz.append(z)
            c, s, z = alloc()
            self.vc.append(c), self.vs.append(s), self.vz.append(z)
        self.page_table = torch.arange(n_pages, device=device, dtype=torch.int32).view(batch, self.pages_per_seq)
        # per layer CRS: (crs_k [Hkv, D] multiplies post-RoPE K, crs_q = 1 / crs_k for Q) or None
        self.crs = crs or [None] * n_layers
        self.splits = int(splits or 0)  # decode_kv4's split-KV count (0 = the kernel's own choice)

    def bytes(self) -> int:
        ts = [t for t in self.kc + self.ks + self.kz + self.vc + self.vs + self.vz if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def _cache_kw(self, layer):
        kw = dict(k_codes=self.kc[layer], k_scale=self.ks[layer], v_codes=self.vc[layer], v_scale=self.vs[layer])
        if self.zero_point:
            kw.update(k_zero=self.kz[layer], v_zero=self.vz[layer])
        return kw

    rope_in_append = True  # keys arrive pre-RoPE; kv4_append rotates them in fp32 (as the HF path)
    rope_in_decode = True  # decode may take pre-RoPE q too (``q_rope``: kv4_append's ROPE_Q)

    def write_prefill(self, layer, k, v, lengths, cos=None, sin=None):
        B = k.shape[0]
        start = torch.zeros(B, dtype=torch.int32, device=k.device)
        crs = self.crs[layer]
        self.ops.kv4_append(k, v, page_table=self.page_table[:B], start=start, cos=cos, sin=sin,
                            crs_k=None if crs is None else crs[0], **self._cache_kw(layer))

    def read_prefill(self, layer, q, S):
        """(q, k, v) for prefill attention from the cache itself: K/V dequantized from INT4 (CRS-scaled
        keys, so q gets the CRS inverse), i.e. what ``install_quantized_attention``'s HF path attends."""
        from lowbit.formats.kv4 import dequantize_kv4

        B = q.shape[0]
        pt = self.page_table[:B].long()

        def gather(codes, scale, zero):
            c = codes[pt].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :S]
            s_ = scale[pt].permute(0, 2, 1, 3).flatten(2, 3)[:, :, :S]
            z = None if zero is None else zero[pt].permute(0, 2, 1, 3).flatten(2, 3)[:, :, :S]
            return dequantize_kv4(c, s_, z, dtype=q.dtype)

        k = gather(self.kc[layer], self.ks[layer], self.kz[layer])
        v = gather(self.vc[layer], self.vs[layer], self.vz[layer])
        crs = self.crs[layer]
        if crs is not None:
            G = q.shape[1] // crs[1].shape[0]
            q = (q.float() * crs[1].repeat_interleave(G, 0)[None, :, None, :]).to(q.dtype)
        return q, k, v

    def step_state(self, pos, rows):
        """int32 write positions and lengths of one decode step (once per step, not per layer)."""
        start = pos.to(torch.int32)
        return start, start + 1

    def decode(self, layer, q, k, v, st, cos=None, sin=None, q_rope=False, qk_norm=None):
        """``q_rope``: q arrives pre-RoPE and the append kernel rotates it too (``ROPE_Q``, one launch); ``qk_norm``
        = (w_q, w_k, eps): q and k normalised there first (Qwen3)."""
        start, lengths = st
        B = q.shape[0]
        crs = self.crs[layer]
        if q_rope:
            from lowbit.kernels.kv4_append import kv4_append_triton

            qo = torch.empty(B, q.shape[2], q.shape[1], q.shape[3], device=q.device, dtype=q.dtype).transpose(1, 2)
            kv4_append_triton(k, v, page_table=self.page_table[:B], start=start, cos=cos, sin=sin,
                              crs_k=None if crs is None else crs[0], q=q, q_out=qo, qk_norm=qk_norm,
                              **self._cache_kw(layer))
            q = qo
        else:
            self.ops.kv4_append(k, v, page_table=self.page_table[:B], start=start, cos=cos, sin=sin,
                                crs_k=None if crs is None else crs[0], **self._cache_kw(layer))
        return self.ops.decode_kv4(q, page_table=self.page_table[:B], lengths=lengths, max_len=self.smax,
                                   crs_q=None if crs is None else crs[1], num_splits=self.splits,
                                   sm_scale=self.sm_scale, **self._cache_kw(layer))


def _attn_configs(layers):
    """The per-layer config ``install_quantized_attention`` left on each ``self_attn`` (or None)."""
    return [getattr(layer.self_attn, "_lowbit", None) for layer in layers]


def _qk_norm_args(attn, dtype):
    """The kernels' ``qk_norm = (w_q, w_k, eps)`` of an attention block with q / k norms (Qwen3) that
    ``lowbit.kernels.rope.rms_pair`` computes exactly (transformers' RMSNorm classes, weights ``[D]`` in the
    activations' dtype, one eps), or None (no such norms, or ones that keep their own forward)."""
    norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
    if not all(type(n).__name__ in _RMSNORMS and getattr(n, "weight", None) is not None and n.weight.dtype == dtype
               and n.weight.ndim == 1 for n in norms) or norms[0].variance_epsilon != norms[1].variance_epsilon:
        return None
    return norms[0].weight, norms[1].weight, norms[0].variance_epsilon


def _crs(cfgs, device):
    """Per-layer (crs_k, crs_q) fp32 ``[Hkv, D]`` from the installed attention, or None each."""
    out = []
    for c in cfgs:
        k = getattr(c, "crs_k", None) if c is not None else None
        out.append(None if k is None else (k.to(device, torch.float32), 1.0 / k.to(device, torch.float32)))
    return out if any(o is not None for o in out) else None


# ---------------------------------------------------------------------------------- runner
class Generator:
    """Prefill + CUDA-graph decode over a static or paged INT4 cache (module docstring).

    ``kv``: 'auto' (from ``model.lowbit_recipe``), None, 'kv4' or 'kv4-zp'. ``prefill``: 'auto'
    (the recipe's attention scheme, else 'sdpa') or a scheme name. ``layers``: run only the first
    ``layers`` decoder layers (benchmarks of trimmed models). ``cuda_graphs``: default True on CUDA; a
    mixture-of-experts model runs its MLP blocks as modules and can be captured only when its experts are lowbit's
    (``QuantExperts``: grouped schedule for ``w4a8-fp8`` / ``w4a8-int8`` experts, else the dense one) with
    ``max_batch <= lowbit.nn.moe.DENSE_MAX_TOKENS``, or transformers' float experts with
    ``config._experts_implementation = "grouped_mm"`` (else True is refused: the routing is read on the host); the
    default captures dense-schedule experts only up to ``DENSE_GRAPH_MAX_EXPERTS`` per layer.
    ``fuse``: run q/k/v as one projection and gate/up as one where the modules stack exactly
    (``_fuse_rows``; the original modules then share the fused storage).
    ``prefill_from_cache``: with an INT4 cache, prefill attends the K/V dequantized from the cache
    (the semantics of ``install_quantized_attention``'s transformers path and of perplexity with a
    KV4 cache) instead of the fresh float K/V (default; FireQ App. D prefills from unquantized
    (FP8) K/V and it saves a dequantization pass).
    ``rope_kernel``: RoPE of q (and of k where the cache does not rotate it) in one launch of
    ``lowbit.kernels.rope`` (bf16 / fp16, half-split RoPE; the same bits as ``_apply_rope``);
    None = ``ROPE_KERNEL``. ``rope_q_append`` (CUDA or the interpreter; decode over the KV4 cache or
    the float cache with ``dense_decode='kernel'``): q (and k) are rotated by the append launch instead
    (same bits); None = ``ROPE_Q_APPEND``. ``decode_splits``: split-KV count of the KV4
    decode attention (None = ``lowbit.kernels.decode_kv4.choose_splits``; an experiment knob).
    ``pdl_max_m``: up to this many rows (B x S) the W4A8 projections' act-quant and GEMM kernels (FP8;
    INT8 and the LUT projections' float-rows and GEMM kernels since session 9) are launched as
    programmatic dependent launches (Hopper; same numerics, each launch overlaps its producer's tail);
    None = ``lowbit.kernels.w4a8_fp8_gemm.PDL_LINEAR_MAX_M`` (1: the decode step at batch 1), 0 = off.
    ``dense_decode`` (float cache, ``kv=None``): 'sdpa' (masked SDPA, transformers' path), 'kernel'
    (``lowbit.ops.kv4.decode_float``, split-KV Triton) or 'auto' = 'kernel' on CUDA for a model
    quantized by lowbit (``model.lowbit_recipe``), 'sdpa' otherwise (the bf16 baseline stays HF + SDPA).
    ``float_kernels``: RMSNorm and SiLU*mul feeding float (weight-only, bf16) projections as one Triton
    launch each (``lowbit.kernels.act_quant.fused_rows_triton``) instead of the eager modules; 'auto' =
    on CUDA for lowbit-quantized models (the W4A8 projections fuse them into their quantization anyway).
    ``fused_add``: the residual adds of projections without a residual epilogue (INT8, LUT, bf16) are
    left pending and done by the next RMSNorm's launch (act-quant, or float rows with ``float_kernels``;
    eager add + norm otherwise), bit-equal to torch's add; None = ``FUSED_ADD``, False = add at once.
    """

    def __init__(self, model, *, max_batch: int, max_seq: int, kv="auto", prefill="auto",
                 cuda_graphs: bool | None = None, page_size: int = 64, layers: int | None = None,
                 prefill_from_cache: bool = False, fuse: bool = True, rope_kernel: bool | None = None,
                 rope_q_append: bool | None = None, decode_splits: int | None = None, pdl_max_m: int | None = None,
                 dense_decode: str = "auto", float_kernels: bool | str = "auto", fused_add: bool | None = None):
        self.model = model
        self.a = _arch(model)
        if layers is not None:
            self.a.layers = self.a.layers[:layers]
        p = next(model.parameters())
        self.device, self.dtype = p.device, self.a.embed.weight.dtype
        info = getattr(model, "lowbit_recipe", None) or {}
        cfgs = _attn_configs(self.a.layers)
        installed = cfgs[0] if cfgs else None
        if kv == "auto":
            kv = installed.kv if installed is not None else info.get("kv")
        self.kv = None if kv == "bf16" else kv
        if self.kv not in (None, "kv4", "kv4-zp"):
            raise ValueError(f"kv must be 'auto', None, 'bf16', 'kv4' or 'kv4-zp', got {kv!r}")
        if prefill == "auto":
            scheme = installed.prefill if installed is not None else info.get("attention")
        else:
            scheme = prefill
        self.prefill_scheme = scheme or "sdpa"
        if self.prefill_scheme == "fp8-kv4":
            self.prefill_scheme = "fp8"  # the cache is empty before prefill: same math on fresh K/V
        self.max_batch, self.max_seq = int(max_batch), int(max_seq)
        if self.max_batch < 1 or self.max_seq < 2:
            raise ValueError("max_batch must be >= 1 and max_seq >= 2")
        for layer in self.a.layers:  # full causal attention equals a sliding window only up to its width
            check_window(layer.self_attn, self.max_seq, "Generator(max_seq=...)")
        n = len(self.a.layers)
        if dense_decode not in ("auto", "sdpa", "kernel"):
            raise ValueError(f"dense_decode must be 'auto', 'sdpa' or 'kernel', got {dense_decode!r}")
        quantized_on_gpu = bool(info) and self.device.type == "cuda"  # the 'auto' rule of both options below
        if dense_decode == "auto":  # lowbit's kernel for lowbit-quantized models; SDPA for plain ones (baseline)
            dense_decode = "kernel" if quantized_on_gpu else "sdpa"
        self.dense_decode = dense_decode
        if self.kv is None:
            self.cache = DenseKV(n, self.max_batch, self.a.hkv, self.max_seq, self.a.d, self.dtype, self.device,
                                 kernel=dense_decode == "kernel")
        else:
            crs = _crs(cfgs, self.device)
            self.cache = PagedKV4(n, self.max_batch, self.a.hkv, self.max_seq, self.a.d, self.dtype, self.device,
                                  zero_point=self.kv == "kv4-zp", page=page_size, crs=crs, splits=decode_splits)
        self.prefill_from_cache = bool(prefill_from_cache) and self.kv is not None
        if float_kernels not in ("auto", True, False):
            raise ValueError(f"float_kernels must be 'auto', True or False, got {float_kernels!r}")
        if float_kernels == "auto":  # like dense_decode: lowbit-quantized models only (the baseline stays eager)
            float_kernels = quantized_on_gpu
        self.float_kernels = bool(float_kernels)
        self.fused = [_FusedLayer(layer, self.dtype, fuse, self.float_kernels) for layer in self.a.layers]
        self.fused_add = FUSED_ADD if fused_add is None else bool(fused_add)
        for f in self.fused:
            f.fused_add = self.fused_add
        self.head = _Proj(self.a.lm_head)
        if pdl_max_m is None:
            try:
                from lowbit.kernels.w4a8_fp8_gemm import PDL_LINEAR_MAX_M as pdl_max_m
            except ImportError:  # no Triton: nothing to launch
                pdl_max_m = 0
        self.pdl_max_m = int(pdl_max_m)
        for f in self.fused:
            for pr in (f.qkv_p, f.q, f.k, f.v, f.o, f.gate_up_p, f.down, getattr(f, "gate_p", None),
                       getattr(f, "up_p", None)):
                if pr is not None:
                    pr.pdl_max_m = self.pdl_max_m
        self.head.pdl_max_m = self.pdl_max_m
        self.head_q = self.head.aq if fuse and self.head.aq and _fusable_norm(self.a.norm, self.dtype) else None
        # MoE blocks: lowbit's quantized experts take their grouped or dense schedule (no host read) at decode sizes,
        # which a CUDA graph captures; transformers' float experts mostly read the routing on the host (_moe_graphs)
        moe = [i for i, layer in enumerate(self.a.layers) if hasattr(getattr(layer, "mlp", None), "experts")]
        plans = [_moe_graphs(self.a.layers[i].mlp.experts, self.max_batch, self.dtype) for i in moe]
        if cuda_graphs and not all(ok for ok, _ in plans):
            raise ValueError(f"cuda_graphs=True: layers {moe[:8]} are mixture-of-experts MLPs whose experts read the "
                             "routing on the host (float experts other than bf16 grouped_mm on sm90 / sm100, or "
                             "max_batch above lowbit.nn.moe.DENSE_MAX_TOKENS); run them with cuda_graphs=False (the "
                             "default for them)")
        default = all(d for _, d in plans)
        self.cuda_graphs = (self.device.type == "cuda" and default) if cuda_graphs is None else bool(cuda_graphs)
        self._graphs: dict[int, tuple] = {}
        self.rows = torch.arange(self.max_batch, device=self.device)
        self.profile_sections = False  # torch.profiler labels per section (eager profiling only)
        self._rope_table = None
        if getattr(self.a.rotary, "rope_type", "default") in _STATIC_ROPE:
            pos = torch.arange(self.max_seq, device=self.device).view(1, -1)
            c, s_, ss = self._rope_compute(torch.empty(0, device=self.device, dtype=self.dtype), pos)
            self._rope_table = (c[0], s_[0], None if ss is None else ss[0])
        # the attention's own softmax scale (transformers' ``scaling``: d^-0.5 for Llama, attention_multiplier for Granite)
        self.sm_scale = float(getattr(self.a.layers[0].self_attn, "scaling", self.a.d ** -0.5)) if self.a.layers \
            else self.a.d ** -0.5
        self.cache.sm_scale = self.sm_scale
        self.rope_kernel = ROPE_KERNEL if rope_kernel is None else bool(rope_kernel)
        self.rope_q_append = ROPE_Q_APPEND if rope_q_append is None else bool(rope_q_append)

    # -------------------------------------------------------------------------- pieces
    def _sec(self, name: str):
        """A ``torch.profiler`` label around one section when ``profile_sections`` is on."""
        return torch.profiler.record_function(name) if self.profile_sections else contextlib.nullcontext()

    def _rope_tables(self, x, pos_ids):
        """cos/sin ``[B, S, D]`` of the model's rotary embedding, once per forward (all layers share
        them), and ``sin_signed`` for ``_apply_rope``. For RoPE types whose values depend only on
        the position, they are gathered from tables computed once by the model's own rotary module
        over ``arange(max_seq)`` (element for element the same products; 3 gathers per decode step
        instead of ~8 launches); dynamic types are recomputed per call."""
        if self._rope_table is not None:
            c, s_, ss = self._rope_table
            return c[pos_ids], s_[pos_ids], None if ss is None else ss[pos_ids]
        return self._rope_compute(x, pos_ids)

    def _rope_compute(self, x, pos_ids):
        cos, sin = self.a.rotary(x, pos_ids)
        half = self.a.d // 2
        sin_signed = None if self.a.interleaved else torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos, sin, sin_signed

    def _apply_rope(self, x, cos, sin, sin_signed):
        """HF's ``x * cos + rotate_half(x) * sin`` on ``x [B, H, S, D]`` (a transposed view of the
        projection output). ``rotate_half(x) * sin == cat(x2, x1) * sin_signed`` (negation is exact,
        so the roundings are HF's). Computed on the ``[B, S, H, D]`` view, where the last two dims
        are dense: every kernel reads and writes in memory order (vectorized), the output is dense
        and ``torch.roll``'s hidden ``.contiguous()`` copy is gone (R4: 1.07 ms of a 16 x 1024
        prefill layer)."""
        if sin_signed is None:
            return _rope(x, cos, sin, True)
        xs = x.transpose(1, 2)
        h = self.a.d // 2
        rot = torch.cat((xs[..., h:], xs[..., :h]), dim=-1)
        return (xs * cos.unsqueeze(2) + rot * sin_signed.unsqueeze(2)).transpose(1, 2)

    def _qkv(self, i, layer, x, rope, pend=None, q_in_append: bool = False):
        attn = layer.self_attn
        B, S, _ = x.shape
        with self._sec("norm+qkv"):
            q, k, v, x = self.fused[i].qkv_proj(x, pend)
        q = q.reshape(B, S, -1, self.a.d).transpose(1, 2)
        k = k.reshape(B, S, -1, self.a.d).transpose(1, 2)
        v = v.reshape(B, S, -1, self.a.d).transpose(1, 2)
        with self._sec("rope"):
            has_norms = hasattr(attn, "q_norm")  # Qwen3: per head, before RoPE
            qk_norm = _qk_norm_args(attn, q.dtype) if has_norms else None
            kernel = not q_in_append and self._rope_kernel_ok(q) and (qk_norm is not None or not has_norms)
            if has_norms and not kernel and not q_in_append:  # (q_in_append: the append launch norms them)
                q, k = attn.q_norm(q), attn.k_norm(k)
            cos, sin, _ = rope
            if q_in_append:  # the cache's append kernel rotates q and k (decode, ``rope_q_append``)
                pass
            elif kernel:  # one launch: (q / k norms +) RoPE of q, and of k unless the cache's append rotates it
                q, k = self._rope_qk(q, k, rope, with_k=not self.cache.rope_in_append, qk_norm=qk_norm)
            else:
                q = self._apply_rope(q, *rope)
                if not self.cache.rope_in_append:
                    k = self._apply_rope(k, *rope)
        return q, k, v, cos, sin, x

    def _q_in_append(self, layer) -> bool:
        """Decode: rotate q inside the cache's append launch (``rope_q_append``) for this layer? (q/k norms too,
        where ``_qk_norm_args`` takes them: the append launch applies them first.)"""
        attn = layer.self_attn
        return (self.rope_q_append and self.cache.rope_in_decode
                and (not hasattr(attn, "q_norm") or _qk_norm_args(attn, self.dtype) is not None)
                and (self.device.type == "cuda" or interpret_mode()) and triton_available()
                and self.dtype in (torch.bfloat16, torch.float16)
                and not self.a.interleaved and self.a.d >= 16 and not self.a.d & (self.a.d - 1))

    def _rope_kernel_ok(self, x) -> bool:
        """Use ``lowbit.kernels.rope`` (one launch, the same bits as ``_apply_rope``) for ``x``?"""
        if not self.rope_kernel or self.a.interleaved:
            return False
        if not use_triton(x):
            return False
        from lowbit.kernels.rope import rope_supported

        return rope_supported(x.transpose(1, 2))

    def _rope_qk(self, q, k, rope, *, with_k: bool, qk_norm=None):
        """RoPE of q (and k when ``with_k``), ``[B, H, S, D]`` transposed views, by the fused kernel. When
        k directly follows q in memory (slices of the fused q/k/v output), both go in ONE launch over
        the ``[B, S, Hq + Hkv, D]`` view; the results are views of one dense buffer. ``qk_norm`` = the
        block's ``_qk_norm_args`` (Qwen3): applied by the same launch first; k is then normalised even
        where it is not rotated."""
        from lowbit.kernels.rope import rope_triton

        cos, sin = rope[0], rope[1]
        qs = q.transpose(1, 2)
        hq = qs.shape[2]
        if qk_norm is not None:
            wq, wk, eps = qk_norm
            kw_q = dict(qk_norm=(wq, wq, eps))
            kw_both = dict(qk_norm=qk_norm, q_heads=hq, rotate_heads=None if with_k else hq)
            kw_k = dict(qk_norm=(wk, wk, eps), rotate_heads=None if with_k else 0)
        else:
            kw_q = kw_both = kw_k = {}
        if not with_k and qk_norm is None:
            return rope_triton(qs, cos, sin).transpose(1, 2), k
        ks = k.transpose(1, 2)
        (B, S, hq, D), hk = qs.shape, ks.shape[2]
        # strides of size-1 dims are arbitrary (reshape of a [B, 1, N] slice): compare the others
        same = all(n == 1 or a == b for a, b, n in zip(qs.stride()[:2], ks.stride()[:2], (B, S)))
        dense_heads = (hq == 1 or qs.stride(2) == D) and (hk == 1 or ks.stride(2) == D)
        if (same and dense_heads and ks.shape[:2] == qs.shape[:2] and ks.shape[3] == D and qs.dtype == ks.dtype
                and ks.untyped_storage().data_ptr() == qs.untyped_storage().data_ptr()
                and ks.data_ptr() == qs.data_ptr() + hq * D * qs.element_size()):
            both = qs.as_strided((B, S, hq + hk, D), (qs.stride(0), qs.stride(1), D, 1))
            out = rope_triton(both, cos, sin, **kw_both)
            return out[:, :, :hq].transpose(1, 2), out[:, :, hq:].transpose(1, 2)
        return (rope_triton(qs, cos, sin, **kw_q).transpose(1, 2),
                rope_triton(ks, cos, sin, **kw_k).transpose(1, 2))

    def _rope_k(self, k, rope):
        """RoPE of keys alone (prefill over a KV4 cache, whose append rotates its own copy)."""
        if self._rope_kernel_ok(k):
            from lowbit.kernels.rope import rope_triton

            return rope_triton(k.transpose(1, 2), rope[0], rope[1]).transpose(1, 2)
        return self._apply_rope(k, *rope)

    def _finish(self, i, layer, x, o):
        B, S = x.shape[:2]
        with self._sec("o_proj+mlp"):
            return self.fused[i].finish(x, o.transpose(1, 2).reshape(B, S, -1))

    def _logits(self, h, pend=None):
        """Final norm + ``lm_head`` of ``h [B, H]`` (+ the pending residual update ``pend``) -> fp32
        logits; with a W4A8 head (``lm_head=True`` recipes) the add and norm are fused into the head's
        activation quantization (a float head: eager add and norm, once per step)."""
        with self._sec("norm+lm_head"):
            if self.head_q:
                xq, sx = _quant_rows(h, self.head_q, norm=self.a.norm, pdl=self.head.pdl(h.shape[0]), add=pend)[:2]
                return self.head.gemm(xq, sx, h.shape[:-1], h.dtype).float()
            return self.head(self.a.norm(h if pend is None else h + pend)).float()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """ids ``[B, S]`` right-padded, lengths ``[B]``; fills the cache; logits ``[B, V]`` (fp32)
        of each request's last real token."""
        import lowbit

        B, S = ids.shape
        if B > self.max_batch or S > self.max_seq:
            raise ValueError(f"prefill of [{B}, {S}] exceeds max_batch={self.max_batch} / max_seq={self.max_seq}")
        ids = ids.to(self.device)
        lengths = lengths.to(self.device)
        pos_ids = torch.arange(S, device=self.device).expand(B, S)
        # padding rows are zeroed before attention: schemes with per-block scales (INT8 V, block
        # FP8) must not see them, and zeros never raise an absmax
        pad = None
        if int(lengths.min()) < S:
            pad = (pos_ids < lengths[:, None]).to(self.dtype)[:, None, :, None]
        with self._sec("embed+rope tables"):
            x = self.a.embed(ids)
            rope = self._rope_tables(x, pos_ids)
        pend = None  # a residual update not yet added (``FUSED_ADD``)
        for i, layer in enumerate(self.a.layers):
            q, k, v, cos, sin, x = self._qkv(i, layer, x, rope, pend)
            with self._sec("kv write"):
                self.cache.write_prefill(i, k, v, lengths, cos, sin)
            with self._sec("attention"):
                if self.prefill_from_cache:
                    q, k, v = self.cache.read_prefill(i, q, S)
                elif self.cache.rope_in_append:
                    k = self._rope_k(k, rope)
                if pad is not None:
                    q, k, v = q * pad, k * pad, v * pad
                o = lowbit.attention(q, k, v, scheme=self.prefill_scheme, causal=True, sm_scale=self.sm_scale)
            x, pend = self._finish(i, layer, x, o)
        last = (self.rows[:B], lengths - 1)
        return self._logits(x[last], None if pend is None else pend[last])

    def _step(self, tokens, pos):
        B = tokens.shape[0]
        rows = self.rows[:B]
        with self._sec("embed+rope tables"):
            x = self.a.embed(tokens.view(B, 1))
            rope = self._rope_tables(x, pos.view(B, 1))
            st = self.cache.step_state(pos, rows)
        pend = None  # a residual update not yet added (``FUSED_ADD``)
        for i, layer in enumerate(self.a.layers):
            qa = self._q_in_append(layer)
            q, k, v, cos, sin, x = self._qkv(i, layer, x, rope, pend, q_in_append=qa)
            with self._sec("kv write+attention"):
                o = self.cache.decode(i, q, k, v, st, cos, sin, q_rope=True,
                                      qk_norm=_qk_norm_args(layer.self_attn, self.dtype)) \
                    if qa else self.cache.decode(i, q, k, v, st, cos, sin)
            x, pend = self._finish(i, layer, x, o)
        return self._logits(x[:, 0], None if pend is None else pend[:, 0])

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One token per request: tokens ``[B]`` at positions ``pos [B]`` -> logits ``[B, V]``."""
        B = tokens.shape[0]
        if not self.cuda_graphs:
            return self._step(tokens.to(self.device), pos.to(self.device))
        g = self._graphs.get(B) or self._capture(B)
        graph, t_buf, p_buf, out = g
        t_buf.copy_(tokens)
        p_buf.copy_(pos)
        graph.replay()
        return out

    def _capture(self, B: int):
        t_buf = torch.zeros(B, dtype=torch.long, device=self.device)
        # warm-up steps really run: point them at the last cache slot, which holds no prompt token
        # yet (a later step at that position overwrites it before attending to it)
        p_buf = torch.full((B,), self.max_seq - 1, dtype=torch.long, device=self.device)
        from lowbit.nn.moe import dense_schedule  # MoE experts: the graph-capturable schedule, warm-up included

        with dense_schedule():
            graph, out = capture_cuda_graph(lambda: self._step(t_buf, p_buf), warmup=2)
        self._graphs[B] = (graph, t_buf, p_buf, out)
        return self._graphs[B]

    # ------------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 32, *, eos_token_id: int | None = None):
        """Greedy decoding of a batch of 1-D token tensors (any lengths); returns the new tokens of
        each request (cut after ``eos_token_id`` when given)."""
        prompts, lens = _check_prompts(prompts, max_new_tokens, getattr(self.a.embed, "num_embeddings", None))
        if max(lens) + max_new_tokens > self.max_seq:
            raise ValueError(f"prompt length {max(lens)} + max_new_tokens {max_new_tokens} exceeds max_seq "
                             f"{self.max_seq}")
        B = len(prompts)
        ids = torch.zeros(B, max(lens), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : lens[b]] = p.reshape(-1).cpu()
        lengths = torch.tensor(lens, device=self.device)
        logits = self.prefill(ids, lengths)
        tok = logits.argmax(-1)
        out = [tok]
        pos = lengths.clone()
        for _ in range(max_new_tokens - 1):
            logits = self.decode(tok, pos)
            tok = logits.argmax(-1)
            out.append(tok)
            pos = pos + 1
        new = torch.stack(out, 1).cpu()
        res = []
        for b in range(B):
            t = new[b]
            if eos_token_id is not None:
                hit = (t == eos_token_id).nonzero()
                if hit.numel():
                    t = t[: int(hit[0]) + 1]
            res.append(t)
        return res


def _check_prompts(prompts, max_new_tokens, vocab: int | None = None) -> tuple[list, list[int]]:
    """``prompts`` (1-D token tensors, or one 1-D / 2-D tensor) as a list, and their lengths: at least one prompt of
    at least one integer token id in ``[0, vocab)``, and ``max_new_tokens`` an int >= 1; ValueError / TypeError
    naming them (an id outside the vocabulary failed inside the embedding, ``max_new_tokens=0`` still gave a token)."""
    check_int(max_new_tokens, "max_new_tokens", 1)
    if isinstance(prompts, torch.Tensor):
        prompts = list(prompts) if prompts.ndim == 2 else [prompts]
    if not prompts:
        raise ValueError("prompts must hold at least one sequence")
    for b, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
            raise TypeError(f"prompts[{b}] must be a tensor of integer token ids, got "
                            f"{p.dtype if isinstance(p, torch.Tensor) else type(p).__name__}")
        if vocab is not None and p.numel() and (int(p.min()) < 0 or int(p.max()) >= vocab):
            raise ValueError(f"prompts[{b}] has token ids outside [0, {vocab})")
    lens = [int(p.numel()) for p in prompts]
    if min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    return prompts, lens


def generate(model, prompts, max_new_tokens: int = 32, *, eos_token_id: int | None = None, **options):
    """One-shot helper: build a ``Generator`` sized for ``prompts`` and decode greedily."""
    prompts, lens = _check_prompts(prompts, max_new_tokens)
    smax = max(lens) + max_new_tokens
    g = Generator(model, max_batch=len(prompts), max_seq=smax, **options)
    return g.generate(prompts, max_new_tokens, eos_token_id=eos_token_id)
