"""transformers integration of the INT4 KV cache: ``install_quantized_attention``.

After ``install_quantized_attention(model, kv='kv4')``, ``model(...)`` and ``model.generate(...)``
run every attention layer on lowbit:

- each ``self_attn`` module's class is swapped for a subclass whose ``forward`` projects q/k/v,
  then (``kv`` set) hands the **pre-RoPE** keys to the paged cache's fused append (RoPE + CRS +
  INT4 quantization + page write: ``lowbit.ops.kv4.kv4_append``), rotates q (and applies the CRS
  inverse), and attends:
  * decode steps (1-4 new tokens, no padding mask): ``PagedKVCache.decode`` = the split-KV INT4
    kernel (``lowbit.ops.kv4.decode_kv4``) on GPU, the float64 reference on CPU;
  * prefill: the cached K/V are dequantized and ``lowbit.api.attention(scheme=prefill)`` runs
    (``'sdpa'`` by default; quantized prefill schemes from ``lowbit.ops.attention_prefill``).
  So every attention, prefill included, sees the KV4 keys and values, which is also what
  perplexity with a quantized KV cache measures.
- ``generate`` gets a ``LowbitKVCache`` (a ``transformers.Cache`` subclass wrapping
  ``lowbit.nn.kv_cache.PagedKVCache``) instead of its ``DynamicCache``;
- a plain ``model(...)`` call (no cache, or any other ``Cache``) quantizes and dequantizes each
  step's K/V through the same append (fake quantization) and stores the result in that cache.

``kv=None`` keeps transformers' cache and RoPE and only routes attention through
``lowbit.api.attention(scheme=prefill)``: with ``prefill='sdpa'`` the model is unchanged. Decode steps (at most
``decode_max_tokens`` new tokens after cached ones) then attend in float SDPA, as the fast runner's float cache does.
``rope_kv`` = the list from ``lowbit.ptq.rope_kv.calibrate_rpn_crs``: RPN is folded into the
weights here (``apply_rpn``) if not already, CRS is applied online.

Supported: Llama-family models of transformers 5.x (``q_proj/k_proj/v_proj/o_proj``,
``head_dim``, ``layer_idx``; RoPE from ``position_embeddings``), with Qwen3's per-head ``q_norm`` /
``k_norm`` applied as the model does (before RoPE). A sliding-window layer (Mistral, Qwen2/3 with
``use_sliding_window``) runs as full causal attention, which equals it up to the window: longer
sequences raise ``ValueError``. Padding masks are honoured
through the dequantized path. Beam search (cache reordering) is not supported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowbit._utils import warn_once
from lowbit.formats.common import FP8_E4M3

__all__ = ["install_quantized_attention", "uninstall_quantized_attention", "LowbitKVCache"]

KV_NUMERICS = (None, "kv4", "kv4-zp", "bf16")


@dataclass
class _AttnConfig:
    kv: str | None
    prefill: str
    interleaved: bool
    crs_k: torch.Tensor | None
    crs_q: torch.Tensor | None
    scale_dtype: torch.dtype
    decode_max_tokens: int
    qk_norm: bool = False  # apply the block's q_norm / k_norm (Qwen3)
    window: int | None = None  # sliding window of the block (checked, not implemented)


def _rope_q(q, cos, sin, interleaved):
    from lowbit.ops.kv4 import rotate

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate(q, interleaved) * s


def _attend(q, k, v, mask, scheme, scaling):
    """q [B, Hq, T, D], k/v [B, Hkv, L, D] -> [B, Hq, T, D]; causal bottom-right, or ``mask``."""
    T = q.shape[2]
    if mask is None:
        from lowbit.api import attention

        return attention(q, k, v, scheme=scheme, causal=T > 1, sm_scale=scaling)
    if scheme != "sdpa":
        warn_once(f"lowbit attention: a padding mask is present, prefill scheme {scheme!r} falls back to SDPA")
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., : k.shape[2]], scale=scaling)


# ---- transformers Cache ---------------------------------------------------------------------------

def _cache_classes():
    from transformers.cache_utils import Cache, CacheLayerMixin

    class _PagedLayer(CacheLayerMixin):
        """One layer's view of the shared PagedKVCache (lengths only; storage is paged)."""

        is_sliding = False
        is_compileable = False
        is_croppable = False

        def __init__(self, owner, index):
            super().__init__()
            self.owner, self.index = owner, index

        def lazy_initialization(self, key_states, value_states):
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            raise NotImplementedError("LowbitKVCache is written by lowbit's attention modules; "
                                      "call install_quantized_attention(model, kv=...) first")

        def get_seq_length(self):
            p = self.owner.paged
            return 0 if p is None else p.max_length

        def get_mask_sizes(self, query_length, *args, **kwargs):
            if isinstance(query_length, torch.Tensor):  # older signature: cache_position
                query_length = query_length.shape[0]
            return self.get_seq_length() + int(query_length), 0

        def get_max_length(self):
            return -1

        def reset(self):
            self.owner.paged = None

        def reorder_cache(self, beam_idx):
            raise NotImplementedError("LowbitKVCache does not support beam search (cache reordering)")

        def crop(self, tokens_to_remove):
            raise NotImplementedError("LowbitKVCache does not support cropping")

        def batch_repeat_interleave(self, repeats):
            raise NotImplementedError("LowbitKVCache does not support batch expansion (num_return_sequences > 1)")

        def batch_select_indices(self, indices):
            raise NotImplementedError("LowbitKVCache does not support batch selection")

    class LowbitKVCache(Cache):
        """transformers ``Cache`` over one ``lowbit.nn.kv_cache.PagedKVCache`` (created at the
        first forward, when batch size, device and dtype are known)."""

        def __init__(self, config, *, numerics="kv4", page_size=64, scale_dtype=FP8_E4M3, num_pages=None,
                     interleaved=False):
            cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            n = cfg.num_hidden_layers
            super().__init__(layers=[_PagedLayer(self, i) for i in range(n)])
            self.num_layers = n
            self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self.numerics, self.page_size, self.scale_dtype = numerics, page_size, scale_dtype
            self.num_pages, self.interleaved = num_pages, interleaved
            self.paged = None

        def lowbit_step(self, layer_idx: int, k: torch.Tensor):
            """Called by each attention layer before its append: layer 0 opens the step."""
            from lowbit.nn.kv_cache import PagedKVCache

            B, _, T, _ = k.shape
            if self.paged is None:
                self.paged = PagedKVCache(self.num_layers, self.num_kv_heads, self.head_dim, numerics=self.numerics,
                                          batch_size=B, page_size=self.page_size, device=k.device, dtype=k.dtype,
                                          scale_dtype=self.scale_dtype, interleaved=self.interleaved,
                                          num_pages=self.num_pages or B * 4)
            if layer_idx == 0:
                if B != self.paged.batch_size:
                    raise ValueError(f"LowbitKVCache holds {self.paged.batch_size} sequences, got a batch of {B}")
                self.paged.begin_step(T)
            for layer in self.layers:
                layer.is_initialized = True
            return self.paged

        def bytes(self) -> int:
            return 0 if self.paged is None else self.paged.bytes()

    return LowbitKVCache


_LOWBIT_CACHE_CLS = None


def lowbit_cache_class():
    global _LOWBIT_CACHE_CLS
    if _LOWBIT_CACHE_CLS is None:
        _LOWBIT_CACHE_CLS = _cache_classes()
    return _LOWBIT_CACHE_CLS


def LowbitKVCache(config, **kwargs):  # noqa: N802 - factory named like the class it builds
    """Build a ``LowbitKVCache`` (``transformers.Cache`` subclass); see ``lowbit_cache_class``."""
    return lowbit_cache_class()(config, **kwargs)


# ---- attention forward ----------------------------------------------------------------------------

def _fake_quant(cfg: _AttnConfig, k, v, cos, sin):
    """KV4 round trip of one step's K/V (post-RoPE K with CRS) through the same append. For ``kv4`` / ``kv4-zp`` the
    pages are laid out directly (each sequence's pages contiguous, the page table built on k's device): no host
    copy, so no stream sync per call (session 43: the ``PagedKVCache`` it replaces copied three host tensors per
    layer call); the values equal the cache's ``dequantize`` (test)."""
    B, H, T, D = k.shape
    if cfg.kv in ("kv4", "kv4-zp") and T:
        return _kv4_round_trip(k, v, cos, sin, cfg.crs_k, cfg.scale_dtype, cfg.kv == "kv4-zp", cfg.interleaved)
    from lowbit.nn.kv_cache import PagedKVCache

    pc = PagedKVCache(1, H, D, numerics=cfg.kv, batch_size=B, page_size=64, device=k.device, dtype=k.dtype,
                      scale_dtype=cfg.scale_dtype, interleaved=cfg.interleaved, num_pages=B * -(-T // 64))
    pc.begin_step(T)
    pc.append(0, k, v, cos=cos, sin=sin, crs_k=cfg.crs_k)
    return pc.dequantize(0, k.dtype)


def _kv4_round_trip(k, v, cos, sin, crs_k, scale_dtype, zero_point: bool, interleaved: bool, page: int = 64):
    """K, V ``[B, Hkv, T, D]`` -> their KV4 values (``kv4_append``'s RoPE + CRS + quantize, then
    ``dequantize_kv4``) in k's dtype, through pages ``b * n .. b * n + n - 1`` of sequence b."""
    from lowbit.formats.kv4 import dequantize_kv4
    from lowbit.ops.kv4 import kv4_append

    B, H, T, D = k.shape
    n = -(-T // page)
    dev = k.device

    def pool(*tail, dt):
        return torch.zeros(B * n, H, page, *tail, dtype=dt, device=dev)

    codes = [pool(D // 2, dt=torch.uint8) for _ in range(2)]
    scales = [pool(dt=scale_dtype) for _ in range(2)]
    zeros = [pool(dt=torch.uint8) for _ in range(2)] if zero_point else [None, None]
    table = torch.arange(B * n, dtype=torch.int32, device=dev).view(B, n)
    kv4_append(k, v, codes[0], scales[0], codes[1], scales[1], table, torch.zeros(B, dtype=torch.int32, device=dev),
               cos=cos, sin=sin, crs_k=crs_k, k_zero=zeros[0], v_zero=zeros[1], interleaved=interleaved)

    def seq(t):  # [B * n, H, page, ...] -> [B, H, T, ...]
        t = t.view(B, n, H, page, *t.shape[3:]).transpose(1, 2)
        return t.reshape(B, H, n * page, *t.shape[4:])[:, :, :T]

    return tuple(dequantize_kv4(seq(c), seq(s), None if z is None else seq(z), dtype=k.dtype)
                 for c, s, z in zip(codes, scales, zeros))


def _lowbit_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                    past_key_values=None, **kwargs):
    # transformers 5.24 (seen) passes the cache as ``cache``, earlier 5.x as ``past_key_values``
    past_key_values = cache if cache is not None else past_key_values
    cfg: _AttnConfig = self._lowbit
    B, T, _ = hidden_states.shape
    D = self.head_dim
    q = self.q_proj(hidden_states).view(B, T, -1, D)
    k = self.k_proj(hidden_states).view(B, T, -1, D)
    if cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE, as the model's own forward
        q, k = self.q_norm(q), self.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = self.v_proj(hidden_states).view(B, T, -1, D).transpose(1, 2)
    cos, sin = position_embeddings
    if cfg.window is not None:
        from lowbit.models.arch import check_window

        seen = past_key_values.get_seq_length(self.layer_idx) if past_key_values is not None else 0
        if isinstance(past_key_values, lowbit_cache_class()) and self.layer_idx != 0:
            seen -= T  # layer 0 already opened this step (its lengths include the new tokens)
        check_window(self, seen + T, "lowbit attention")
    if cfg.kv is None:
        q, k = self._lowbit_rope(q, k, cos, sin)
        k, v, past = _update_filled(past_key_values, k, v, self.layer_idx)
        # a decode step (a few new tokens after cached ones) attends in float, as the runner's float cache does: the
        # quantized schemes are prefill kernels (session 38; before, int8-attention decoded through INT8 attention
        # here and in float in the runner)
        step = T <= cfg.decode_max_tokens and past > 0
        out = _attend(q, k, v, attention_mask, "sdpa" if step else cfg.prefill, self.scaling)
    else:
        q = _rope_q(q, cos, sin, cfg.interleaved)
        crs_q = cfg.crs_q
        if crs_q is not None and crs_q.device != q.device:
            cfg.crs_k, cfg.crs_q = cfg.crs_k.to(q.device), crs_q.to(q.device)
            crs_q = cfg.crs_q
        cache_cls = lowbit_cache_class()
        if isinstance(past_key_values, cache_cls):
            pc = past_key_values.lowbit_step(self.layer_idx, k)
            pc.append(self.layer_idx, k, v, cos=cos, sin=sin, crs_k=cfg.crs_k)
            if T <= cfg.decode_max_tokens and attention_mask is None:
                out = pc.decode(self.layer_idx, q, crs_q=crs_q, sm_scale=self.scaling)
            else:
                kd, vd = pc.dequantize(self.layer_idx, q.dtype)
                out = _attend(_scale_q(q, crs_q), kd, vd, attention_mask, cfg.prefill, self.scaling)
        else:
            kq, vq = _fake_quant(cfg, k, v, cos, sin)
            kq, vq, _ = _update_filled(past_key_values, kq, vq, self.layer_idx)
            out = _attend(_scale_q(q, crs_q), kq, vq, attention_mask, cfg.prefill, self.scaling)
    out = out.transpose(1, 2).reshape(B, T, -1).contiguous()
    return self.o_proj(out), None


def _update_filled(cache, k, v, layer_idx):
    """``cache.update(k, v, layer_idx)`` (a transformers ``Cache``, or None: k, v as they are) cut to the filled
    positions, and the number of positions cached before: a static (preallocated) cache returns every slot, and
    attending its empty ones was wrong (before session 38, with ``kv=None`` and with another cache than lowbit's)."""
    if cache is None:
        return k, v, 0
    past, new = int(cache.get_seq_length(layer_idx)), k.shape[2]
    k, v = cache.update(k, v, layer_idx)
    if k.shape[2] > past + new:
        k, v = k[:, :, : past + new], v[:, :, : past + new]
    return k, v, past


def _scale_q(q, crs_q):
    if crs_q is None:
        return q
    rep = q.shape[1] // crs_q.shape[0]
    return (q.float() * crs_q.repeat_interleave(rep, 0)[:, None, :]).to(q.dtype)


_SWAPPED: dict[type, type] = {}


def _swap_class(attn):
    base = attn.__class__
    if getattr(base, "_lowbit_swapped", False):
        return
    if base not in _SWAPPED:
        from lowbit.models.arch import rope_function

        apply_rope = rope_function(attn)
        if apply_rope is None:
            raise ValueError(f"{base.__name__}: no apply_rotary_pos_emb in {base.__module__}")

        def _rope(self, q, k, cos, sin):
            return apply_rope(q, k, cos, sin)

        _SWAPPED[base] = type(f"Lowbit{base.__name__}", (base,), {
            "forward": _lowbit_forward, "_lowbit_rope": _rope, "_lowbit_swapped": True, "_lowbit_base": base})
    attn.__class__ = _SWAPPED[base]


def _device_of(module: nn.Module) -> torch.device:
    """Device of a module's first parameter or buffer (float ``weight`` or a QuantLinear's codes:
    the projections may already be quantized when the attention is installed)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def install_quantized_attention(model, *, kv: str | None = "kv4", prefill: str = "sdpa", rope_kv=None,
                                page_size: int = 64, scale_dtype: torch.dtype = FP8_E4M3,
                                decode_max_tokens: int = 4):
    """Run ``model``'s attention on lowbit (see the module docstring). Returns ``model``.

    kv: ``'kv4'`` (FireQ INT4, FP8 scales), ``'kv4-zp'`` (QServe INT4 with zero points),
    ``'bf16'`` (unquantized paged cache) or ``None`` (transformers' cache).
    prefill: an attention scheme of ``lowbit.api.attention`` (``lowbit.api.schemes()``).
    rope_kv: ``calibrate_rpn_crs`` output (RPN folded now if needed; CRS online) or None.
    """
    from lowbit import registry
    from lowbit.models.arch import decoder_layers

    if kv not in KV_NUMERICS:
        raise ValueError(f"kv must be one of {KV_NUMERICS}, got {kv!r}")
    registry.get("attention", prefill)  # unknown scheme -> ValueError listing the known ones
    if not 1 <= decode_max_tokens <= 16:
        raise ValueError(f"decode_max_tokens must be in 1..16, got {decode_max_tokens}")
    views = decoder_layers(model)
    if rope_kv is not None:
        if kv is None:
            raise ValueError("rope_kv needs a quantized KV cache (kv='kv4', 'kv4-zp' or 'bf16')")
        if len(rope_kv) != len(views):
            raise ValueError(f"rope_kv has {len(rope_kv)} layers, the model has {len(views)}")
        from lowbit.ptq.rope_kv import apply_rpn

        apply_rpn(model, rope_kv)
    for v in views:
        attn = v.layer.self_attn
        if v.sliding_window is not None:
            warn_once(f"lowbit attention: {type(attn).__name__} has a sliding window of {v.sliding_window} keys; "
                      "lowbit attends to every key, so sequences longer than the window raise")
        p = rope_kv[v.index] if rope_kv is not None else None
        crs_k = p.crs_k.float().to(_device_of(attn)) if p is not None and p.crs_k is not None else None
        _swap_class(attn)
        attn._lowbit = _AttnConfig(kv, prefill, v.rope_pairing == "interleaved", crs_k,
                                   None if crs_k is None else 1.0 / crs_k, scale_dtype, decode_max_tokens,
                                   v.qk_norm, v.sliding_window)
    model._lowbit_attention = {"kv": kv, "prefill": prefill, "page_size": page_size, "scale_dtype": scale_dtype,
                               "rope_kv": rope_kv is not None}
    _patch_generate_cache(model, kv, page_size, scale_dtype, views[0].rope_pairing == "interleaved")
    return model


def _cache_key(model_kwargs: dict) -> str:
    """Where ``generate`` keeps its cache: ``'cache'`` (transformers 5.24, seen) or ``'past_key_values'``."""
    return "cache" if "cache" in model_kwargs or "past_key_values" not in model_kwargs else "past_key_values"


def _patch_generate_cache(model, kv, page_size, scale_dtype, interleaved):
    """Make ``generate`` build a LowbitKVCache where it would build its default DynamicCache."""
    orig = getattr(model, "_lowbit_orig_prepare_cache", None) or model._prepare_cache_for_generation
    model._lowbit_orig_prepare_cache = orig
    if kv is None:
        model._prepare_cache_for_generation = orig
        return

    def prepare(generation_config, model_kwargs, *args, **kwargs):
        from transformers.cache_utils import DynamicCache

        r = orig(generation_config, model_kwargs, *args, **kwargs)
        key = _cache_key(model_kwargs)
        cache = model_kwargs.get(key)
        if type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False):
            named = dict(zip(("generation_mode", "batch_size", "max_cache_length"), args), **kwargs)
            bs, max_len = named.get("batch_size"), named.get("max_cache_length")
            pages = bs * math.ceil(max_len / page_size) if isinstance(bs, int) and isinstance(max_len, int) else None
            model_kwargs[key] = LowbitKVCache(model.config, numerics=kv, page_size=page_size,
                                                            scale_dtype=scale_dtype, num_pages=pages,
                                                            interleaved=interleaved)
        return r

    model._prepare_cache_for_generation = prepare


def uninstall_quantized_attention(model):
    """Undo the class swap and the generate hook (RPN stays folded: it is exact)."""
    from lowbit.models.arch import decoder_layers

    for v in decoder_layers(model):
        attn = v.layer.self_attn
        if getattr(type(attn), "_lowbit_swapped", False):
            attn.__class__ = type(attn)._lowbit_base
            del attn._lowbit
    orig = getattr(model, "_lowbit_orig_prepare_cache", None)
    if orig is not None:
        model._prepare_cache_for_generation = orig
    return model
