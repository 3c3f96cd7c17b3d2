"""Architecture views: the seam between PTQ algorithms and transformers models.

PTQ code never walks ``model.model.layers[i].self_attn...`` itself; it asks for ``decoder_layers``
and gets ``LayerView``s naming the pieces by role. Supported: Llama-family models of transformers
(Llama, Mistral, Qwen2, Qwen3, SmolLM...), whose RoPE pairs channel i with i + head_dim/2 ("half").

Two variations are read here, not assumed:

- **q/k norms** (Qwen3): an RMSNorm over each head's ``head_dim`` channels between ``q_proj`` /
  ``k_proj`` and RoPE (``LayerView.qk_norm``). Scales cannot be folded into those projections (the
  norm divides them out again), and the norms' weights are shared by all heads; the key-smoothing
  PTQ (RPN, SmoothAttention) therefore applies its per-head factors after RoPE on those models
  (``lowbit.ptq.rope_kv``).
- **sliding-window attention** (Mistral's ``sliding_window``, Qwen2/3 layers of type
  ``sliding_attention``): lowbit's attention is full causal, equal to a window of W keys only while a
  sequence holds at most W tokens; the attention paths raise past that (``sliding_window``).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class LayerView:
    index: int
    layer: nn.Module
    input_norm: nn.Module  # RMSNorm before q/k/v; its .weight absorbs CAS / smoothing inverses
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    post_norm: nn.Module  # RMSNorm before gate/up
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_pairing: str  # "half": (i, i + head_dim/2); "interleaved": (2i, 2i+1)
    qk_norm: bool = False  # q_norm / k_norm on each head between the projections and RoPE (Qwen3)
    sliding_window: int | None = None  # keys a query may see (None: all)

    def linears(self) -> dict[str, nn.Module]:
        return {"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj, "o_proj": self.o_proj,
                "gate_proj": self.gate_proj, "up_proj": self.up_proj, "down_proj": self.down_proj}

    def set_linear(self, role: str, module: nn.Module) -> None:
        parent = self.layer.self_attn if role in ("q_proj", "k_proj", "v_proj", "o_proj") else self.layer.mlp
        setattr(parent, role, module)
        setattr(self, role, module)


def rope_pairing(model) -> str:
    """Read the RoPE channel pairing from the model (not assumed): HF Llama-family models use
    ``rotate_half`` (half split); configs with ``rope_interleave=True`` (DeepSeek) interleave."""
    cfg = model.config
    if getattr(cfg, "rope_interleave", False):
        return "interleaved"
    return "half"


def has_qk_norm(attn: nn.Module) -> bool:
    """Does this attention block normalise q and k per head after the projections (Qwen3)?"""
    return getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None


def sliding_window(attn: nn.Module) -> int | None:
    """The attention block's window in keys, or None for full attention. Qwen2/3 set
    ``self.sliding_window`` per layer (None on full-attention layers); Mistral's attention reads
    ``config.sliding_window`` (4096 by default); Llama has neither."""
    if hasattr(attn, "sliding_window"):
        w = attn.sliding_window
    else:
        w = getattr(getattr(attn, "config", None), "sliding_window", None)
    return None if w is None else int(w)


def check_window(attn: nn.Module, length: int, where: str) -> None:
    """ValueError when a sequence of ``length`` tokens would reach past ``attn``'s sliding window."""
    w = sliding_window(attn)
    if w is not None and length > w:
        raise ValueError(f"{where}: layer {getattr(attn, 'layer_idx', '?')} uses sliding-window attention "
                         f"(window {w}) and lowbit's attention is full causal, equal to it only up to {w} "
                         f"tokens; got a sequence of {length}")


def decoder_layers(model) -> list[LayerView]:
    """LayerViews of a Llama-family ``*ForCausalLM``; ValueError for other architectures."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"unsupported model {type(model).__name__}: no .model.layers")
    cfg = model.config
    nh = cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nh
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    pairing = rope_pairing(model)
    views = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        for role in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attn, role):
                raise ValueError(f"unsupported attention block {type(attn).__name__}: no {role}")
        views.append(LayerView(i, layer, layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj,
                               attn.o_proj, layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj,
                               mlp.down_proj, nh, nkv, hd, pairing, has_qk_norm(attn), sliding_window(attn)))
    return views


def select_layers(model, layers=None) -> tuple[list[LayerView], list[int]]:
    """(all LayerViews, the chosen indices): ``layers`` = None for all, else indices checked in range."""
    views = decoder_layers(model)
    idx = list(range(len(views))) if layers is None else list(layers)
    for i in idx:
        if not 0 <= i < len(views):
            raise ValueError(f"layer index {i} out of range (model has {len(views)} layers)")
    return views, idx
