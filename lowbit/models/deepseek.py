"""DeepSeek-V2/V3 (transformers ``DeepseekV3ForCausalLM``) on lowbit's paged MLA latent cache.

``install_fp8_mla(model)`` replaces the forward of every MLA attention module (``self_attn`` of each
decoder layer; hooked at the attention level, the rest of the model is untouched) by the absorbed
form that runs on ``lowbit.nn.mla_cache.PagedMLACache``:

1. q = q_proj(h) (or q_b_proj(norm(q_a_proj(h)))), split into q_nope [H, nope] and q_rope [H, Dr];
   latent = kv_a_layernorm(c) and k_rope from kv_a_proj_with_mqa(h); RoPE applied to q_rope and
   k_rope with the model's own rotary helpers (interleaved or half-rotation, per config);
2. absorption (DeepSeek-V2 §2.1.2): with kv_b_proj's weight viewed as [H, nope + v, Dc],
   ``q_C = q_nope W_UK`` (W_UK = first ``nope`` rows per head) so ``q = [q_C | q_rope]`` has width
   Dc + Dr, and the latent ``[c | k_rope]`` is appended to the cache (Fused-K-Append; FP8 with
   bf16 pre-divided RoPE when ``fp8=True``);
3. attention in latent space: ``mla_decode`` for 1-4 new tokens (the FP8 SnapMLA kernel), the
   fetch-dequant prefill path for longer chunks; output ``o_C W_UV^T`` per head, then o_proj.
Softmax scale: the module's own ``scaling`` (YaRN mscale included).

The cache lives on the transformers ``Cache`` object that ``generate`` passes down (attribute
``lowbit_mla``), so each ``generate`` call starts a fresh paged cache; transformers' own cache is
still updated, with one-element stubs per token (2 x 4 bytes per token per layer), so that its
length bookkeeping (positions, masks) stays right.
A forward without a cache (``use_cache=False``) uses a throw-away cache per call.
Limits: no padding masks (a batch of equal-length prompts, or batch 1); beam search (cache
reordering) is not supported.
"""
from __future__ import annotations

import sys
import types

import torch

from lowbit._utils import warn_once

__all__ = ["install_fp8_mla", "uninstall_fp8_mla", "is_mla_attention"]


def is_mla_attention(m: torch.nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "kv_lora_rank"))


def _rotary(attn):
    mod = sys.modules[type(attn).__module__]
    if getattr(attn.config, "rope_interleave", False) and hasattr(mod, "apply_rotary_pos_emb_interleave"):
        return mod.apply_rotary_pos_emb_interleave
    return mod.apply_rotary_pos_emb


def _get_cache(attn, past_key_values, B: int, S: int, device):
    opts = attn._lowbit_mla_opts
    if past_key_values is None:
        from lowbit.nn.mla_cache import PagedMLACache

        return PagedMLACache(1, B, S, attn.kv_lora_rank, attn.qk_rope_head_dim, fp8=opts["fp8"],
                             page_size=opts["page_size"], device=device), 0
    cache = getattr(past_key_values, "lowbit_mla", None)
    if cache is not None and cache.batch != B:
        raise ValueError(f"batch changed from {cache.batch} to {B} inside one generation (beam search is not supported)")
    if cache is None or (attn.layer_idx == 0 and past_key_values.get_seq_length(0) == 0 and max(cache.lengths[0]) > 0):
        from lowbit.nn.mla_cache import PagedMLACache

        cache = PagedMLACache(opts["num_layers"], B, opts["max_len"], attn.kv_lora_rank, attn.qk_rope_head_dim,
                              fp8=opts["fp8"], page_size=opts["page_size"], device=device)
        past_key_values.lowbit_mla = cache
    return cache, attn.layer_idx


def _mla_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, past_key_values=None,
                 **kwargs):
    past_key_values = cache if cache is not None else past_key_values  # ``cache`` on transformers 5.24 (seen)
    B, S = hidden_states.shape[:2]
    H, nope, dr, dc, v = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank, self.v_head_dim
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(B, S, H, nope + dr)
    q_pass, q_rot = q[..., :nope], q[..., nope:]
    ckv = self.kv_a_proj_with_mqa(hidden_states)
    c, k_rot = ckv[..., :dc], ckv[..., dc:]
    c = self.kv_a_layernorm(c)
    cos, sin = position_embeddings
    q_rot, k_rot = _rotary(self)(q_rot, k_rot.view(B, S, 1, dr), cos, sin, unsqueeze_dim=2)
    w = self.kv_b_proj.weight.view(H, nope + v, dc)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_lat = torch.einsum("bshn,hnc->bshc", q_pass, w_uk)  # W_UK absorbed into the query
    q_full = torch.cat([q_lat, q_rot.to(q_lat.dtype)], dim=-1)
    kv = torch.cat([c, k_rot.view(B, S, dr).to(c.dtype)], dim=-1)

    cache, layer = _get_cache(self, past_key_values, B, S, hidden_states.device)
    if past_key_values is not None:  # keep transformers' length bookkeeping (positions, masks)
        stub = hidden_states.new_zeros(B, 1, S, 1)  # one element per token: transformers skips empty tensors
        past_key_values.update(stub, stub, self.layer_idx)
    cache.append(layer, kv)
    o_lat = cache.attend(layer, q_full, sm_scale=self.scaling)  # [B, S, H, Dc]
    out = torch.einsum("bshc,hvc->bshv", o_lat.to(w_uv.dtype), w_uv)  # W_UV absorbed into the output
    return self.o_proj(out.reshape(B, S, H * v)), None


def install_fp8_mla(model: torch.nn.Module, *, fp8: bool = True, page_size: int = 64, max_len: int | None = None,
                    **options) -> torch.nn.Module:
    """Run every MLA attention of ``model`` on lowbit's paged latent cache (FP8 SnapMLA format with
    ``fp8=True``, bf16 otherwise). ``max_len`` bounds prompt + generated tokens (default: the
    config's ``max_position_embeddings``, capped at 8192). Returns ``model`` (modified in place)."""
    if options:
        raise TypeError(f"install_fp8_mla got unknown options {sorted(options)}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    attns = [m for m in model.modules() if is_mla_attention(m)]
    if not attns:
        raise ValueError("install_fp8_mla: no MLA attention module (kv_a_proj_with_mqa / kv_b_proj) found in the model")
    cfg = getattr(model, "config", None)
    if max_len is None:
        max_len = min(int(getattr(cfg, "max_position_embeddings", 4096) or 4096), 8192)
    if getattr(cfg, "_attn_implementation", None) not in (None, "eager", "sdpa"):
        warn_once("install_fp8_mla replaces the attention computation; the configured attention backend is unused")
    for m in attns:
        if getattr(m, "layer_idx", None) is None:
            raise ValueError("MLA attention modules need a layer_idx")
        m._lowbit_mla_opts = {"fp8": fp8, "page_size": page_size, "max_len": max_len, "num_layers": len(attns)}
        if not hasattr(m, "_lowbit_orig_forward"):
            m._lowbit_orig_forward = m.forward
        m.forward = types.MethodType(_mla_forward, m)
    return model


def uninstall_fp8_mla(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the original attention forwards."""
    for m in model.modules():
        if hasattr(m, "_lowbit_orig_forward"):
            m.forward = m._lowbit_orig_forward
            del m._lowbit_orig_forward, m._lowbit_mla_opts
    return model
