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
- **mixture-of-experts MLPs** (Mixtral, Qwen3-MoE; session 38): a sparse block ``mlp`` = float router ``gate``
  (weight ``[E, H]``) + ``experts`` (3-D ``gate_up_proj`` / ``down_proj``, or lowbit's ``QuantExperts``) and, since
  session 39, optionally Qwen2-MoE's shared expert: a SiLU MLP ``shared_expert`` (gate/up/down projections) whose
  output the block adds scaled by ``sigmoid(shared_expert_gate(x))`` (a ``[1, H]`` linear), nothing else. Its view
  has ``router`` / ``experts`` (``shared_expert`` / ``shared_gate``) and no gate/up/down linears of its own
  (``moe_block``); ``lowbit.nn.moe`` quantizes the experts, the recipes the shared expert's three linears.
- **sliding-window attention** (Mistral's ``sliding_window``, Qwen2/3 layers of type
  ``sliding_attention``): lowbit's attention is full causal, equal to a window of W keys only while a
  sequence holds at most W tokens; the attention paths raise past that (``sliding_window``).

Everything else a Llama-family layer must be is **checked**, once per model, before any PTQ or runner
touches it (``check_llama_family``; session 37): other transformers decoders loaded fine and then
quantized to wrong numbers without a word (Gemma 2/3's sandwich norms took CAS into the norm of the
attention output; Gemma's ``(1 + w)`` RMSNorm; Granite's multipliers; partial RoPE) or failed with an
``AttributeError`` (OLMo 2, Cohere). A model passes when each decoder layer has exactly the
two RMSNorms ``input_layernorm`` (before q/k/v) and ``post_attention_layernorm`` (before gate/up), each
computing ``weight * x / rms(x)`` (tried on a random input), q/k/v/o and gate/up/down projections (or a
sparse MoE block of that form, above), a SiLU-gated MLP, and the config has none of: logit soft-capping, partial rotary, NoPE layers, Granite's
multipliers. Model types outside ``TESTED_TYPES`` that pass run with a one-time warning.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowbit._utils import warn_once

# model types whose forward lowbit's tests run (tests/test_arch_variants.py, the embedded SmolLM2 = llama)
TESTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe")
# a layer's linears by shared input (LayerView roles): q/k/v read one input, gate/up another (the fused matrices of
# FireQ's PTS scope and one GPTQ Hessian each); a Qwen2-MoE shared expert's likewise
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",),
                ("shared.gate_proj", "shared.up_proj"), ("shared.down_proj",))


@dataclass
class LayerView:
    index: int
    layer: nn.Module
    input_norm: nn.Module  # RMSNorm before q/k/v; its .weight absorbs CAS / smoothing inverses
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    post_norm: nn.Module  # RMSNorm before gate/up (or before the MoE router and experts)
    gate_proj: nn.Module | None  # None on a mixture-of-experts layer (``experts``)
    up_proj: nn.Module | None
    down_proj: nn.Module | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_pairing: str  # "half": (i, i + head_dim/2); "interleaved": (2i, 2i+1)
    qk_norm: bool = False  # q_norm / k_norm on each head between the projections and RoPE (Qwen3)
    sliding_window: int | None = None  # keys a query may see (None: all)
    router: nn.Module | None = None  # MoE layers: the float router (weight [E, H]) ...
    experts: nn.Module | None = None  # ... and the experts (transformers' 3-D module or lowbit's QuantExperts)
    shared_expert: nn.Module | None = None  # Qwen2-MoE: the shared expert (a gate/up/down SiLU MLP) ...
    shared_gate: nn.Module | None = None  # ... and its gate ([1, H] linear; the block adds sigmoid(gate) * expert)

    def linears(self) -> dict[str, nn.Module]:
        """The layer's projections by role (an MoE layer has no gate/up/down: see ``experts``)."""
        lins = {"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj, "o_proj": self.o_proj,
                "gate_proj": self.gate_proj, "up_proj": self.up_proj, "down_proj": self.down_proj}
        return {r: m for r, m in lins.items() if m is not None}

    @property
    def key_module(self) -> nn.Module:
        """The module whose output is the keys RoPE rotates: ``k_proj``, or ``k_norm`` after it on q/k-norm models
        (where RPN / SmoothAttention statistics are read)."""
        return self.layer.self_attn.k_norm if self.qk_norm else self.k_proj

    def set_experts(self, module: nn.Module) -> None:
        self.layer.mlp.experts = module
        self.experts = module

    def shared_linears(self) -> dict[str, nn.Module]:
        """The shared expert's projections (Qwen2-MoE) by role ``shared.gate_proj`` / ``.up_proj`` / ``.down_proj``
        (``set_linear`` takes these roles too); empty without one."""
        if self.shared_expert is None:
            return {}
        return {f"shared.{r}": getattr(self.shared_expert, r) for r in ("gate_proj", "up_proj", "down_proj")}

    def set_linear(self, role: str, module: nn.Module) -> None:
        if role.startswith("shared."):
            setattr(self.shared_expert, role[len("shared."):], module)
            return
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
    ``config.sliding_window`` (4096 by default); Llama has neither; Qwen2-MoE sets it only on its sliding layers (the
    others are full) and keeps ``config.sliding_window = 0`` (session 39: read as a window of 0 keys before, which
    refused every sequence; a first fix that read ``use_sliding_window`` / ``layer_types`` for every model missed
    Mistral's windows, which ignore both: a review finding)."""
    if hasattr(attn, "sliding_window"):
        w = attn.sliding_window
    else:
        cfg = getattr(attn, "config", None)
        if getattr(cfg, "model_type", None) == "qwen2_moe":  # sets the attribute on its sliding layers only
            return None
        w = getattr(cfg, "sliding_window", None)  # Mistral / Mixtral: every layer, whatever else the config says
    return None if not w else int(w)  # (a window of 0 keys means none)


def check_window(attn: nn.Module, length: int, where: str) -> None:
    """ValueError when a sequence of ``length`` tokens would reach past ``attn``'s sliding window."""
    w = sliding_window(attn)
    if w is not None and length > w:
        raise ValueError(f"{where}: layer {getattr(attn, 'layer_idx', '?')} uses sliding-window attention "
                         f"(window {w}) and lowbit's attention is full causal, equal to it only up to {w} "
                         f"tokens; got a sequence of {length}")


def _rms_norm_like(norm: nn.Module) -> bool:
    """Does ``norm`` compute ``weight * x * rsqrt(mean(x^2) + eps)`` (Llama's RMSNorm)? Tried on a random input:
    Gemma's ``(1 + weight)``, a LayerNorm (mean subtracted, bias) or a missing weight fail."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if w is None or eps is None or w.ndim != 1 or getattr(norm, "bias", None) is not None:
        return False
    if w.device.type == "meta":
        return True  # nothing to try; the projections' checks still hold
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(4, w.numel(), generator=g) + 0.5).to(w.device, w.dtype)
    with torch.no_grad():
        y = norm(x).float()
        xf = x.float()
        ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + float(eps)) * w.float()
    return bool(((y - ref).norm() <= 1e-2 * ref.norm() + 1e-6).item())


def rope_function(attn: nn.Module):
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` an attention block's forward calls: the one of its class's
    transformers module (the model's own class also after ``install_quantized_attention`` swapped it), or None."""
    import sys

    cls = getattr(type(attn), "_lowbit_base", type(attn))
    return getattr(sys.modules.get(cls.__module__), "apply_rotary_pos_emb", None)


def _rope_matches(model, attn: nn.Module, pairing: str) -> bool:
    """Does the attention module's ``apply_rotary_pos_emb`` (the function its forward calls) rotate channel pairs
    as lowbit's kernels do for ``pairing``, with the model's own cos / sin tables? Tried on a random input: ERNIE
    4.5 and Helium rotate interleaved pairs with cos / sin laid out for that, which lowbit would get wrong."""
    from lowbit.ops.kv4 import rotate

    apply = rope_function(attn)
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    d = getattr(attn, "head_dim", None)
    if apply is None or rotary is None or d is None:
        return False
    p = next(iter(model.parameters()), None)
    if p is None or p.device.type == "meta":
        return True
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 2, 5, d, generator=g).to(p.device, torch.float32)
    try:
        with torch.no_grad():
            cos, sin = rotary(x, torch.arange(3, 8, device=p.device)[None])
            got, _ = apply(x, x, cos.float(), sin.float())
            c, sn = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
            ref = x * c + rotate(x, pairing == "interleaved") * sn
            return bool(((got - ref).norm() <= 1e-4 * ref.norm()).item())
    except Exception:  # another signature or table shape (e.g. partial RoPE): not the Llama form
        return False


_UNSUPPORTED_CONFIG = (  # (config attribute, value that is fine, what it would change)
    ("attn_logit_softcapping", None, "attention logit soft-capping"),
    ("final_logit_softcapping", None, "final logit soft-capping"),
    ("partial_rotary_factor", 1.0, "RoPE on part of each head"),
    ("rotary_pct", 1.0, "RoPE on part of each head"),
    ("embedding_multiplier", 1.0, "Granite's embedding multiplier"),
    ("residual_multiplier", 1.0, "Granite's residual multiplier"),
    ("logits_scaling", 1.0, "Granite's logit scaling"),
)


# the parts of a Llama-family attention block (anything else, e.g. differential attention's lambdas or
# differently named q/k norms applied after RoPE, changes what its forward computes)
_ATTN_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rotary_emb"}


def moe_block(mlp: nn.Module | None) -> tuple[nn.Module, nn.Module, tuple[nn.Module, nn.Module] | None] | None:
    """(router, experts, shared) of a sparse MoE MLP of the supported form (module docstring; ``shared`` =
    (shared_expert, shared_expert_gate) or None), None for any other MLP. ValueError for an MoE block lowbit cannot
    run (another experts layout, other parts)."""
    if mlp is None or not hasattr(mlp, "experts"):
        return None
    from lowbit.nn.moe import QuantExperts, experts_weights

    where = type(mlp).__name__
    children = sorted(n for n, _ in mlp.named_children())
    if children not in (["experts", "gate"], ["experts", "gate", "shared_expert", "shared_expert_gate"]) or any(
            True for _ in mlp.named_parameters(recurse=False)):
        raise ValueError(f"{where}: a mixture-of-experts block with parts {children}; lowbit runs blocks of a router "
                         "'gate' and 'experts' (Mixtral, Qwen3-MoE), with or without Qwen2-MoE's 'shared_expert' "
                         "and 'shared_expert_gate'")
    shared = None
    if "shared_expert" in children:
        shared = (mlp.shared_expert, mlp.shared_expert_gate)
        _check_shared_expert(where, *shared)
    router, experts = mlp.gate, mlp.experts
    w = getattr(router, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or getattr(router, "bias", None) is not None:
        raise ValueError(f"{where}: its router {type(router).__name__} has no 2-D weight [experts, hidden] "
                         "(or has a bias)")
    if not isinstance(experts, QuantExperts):
        gu, _ = experts_weights(experts)  # ValueError for another layout
        if gu.shape[0] != w.shape[0] or gu.shape[2] != w.shape[1]:
            raise ValueError(f"{where}: router weight {list(w.shape)} does not fit experts {list(gu.shape)}")
    return router, experts, shared


def _check_shared_expert(where: str, mlp: nn.Module, gate: nn.Module) -> None:
    """Qwen2-MoE's shared expert: exactly a SiLU MLP of gate/up/down projections, and a bias-free ``[1, H]`` gate
    linear (the block adds ``sigmoid(gate(x)) * mlp(x)``); ValueError naming what differs."""
    parts = sorted(n for n, _ in mlp.named_children())
    act = getattr(mlp, "act_fn", None)
    if parts != ["act_fn", "down_proj", "gate_proj", "up_proj"] or (
            not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLU", "SiLUActivation")):
        raise ValueError(f"{where}: its shared expert {type(mlp).__name__} has parts {parts} and activation "
                         f"{type(act).__name__}; lowbit runs a SiLU MLP of gate_proj, up_proj, down_proj")
    w = getattr(gate, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] != 1 or getattr(gate, "bias", None) is not None:
        raise ValueError(f"{where}: its shared_expert_gate is not a bias-free linear with one output")

def _check_layer(layer: nn.Module, where: str, fused_mlp: type, *, try_norms: bool) -> None:
    """The structural checks of ``check_llama_family`` on one decoder layer (``try_norms``: also run its norms)."""
    mlp, attn = getattr(layer, "mlp", None), getattr(layer, "self_attn", None)
    # a quantized model's MLP may already be lowbit's FusedMLP (gate and up as one linear: the flute recipes'
    # default, or fireq with fuse_mlp=True), e.g. loaded from a checkpoint
    mlp_names = ("gate_up", "down_proj") if isinstance(mlp, fused_mlp) else ("gate_proj", "up_proj", "down_proj")
    try:
        moe = moe_block(mlp)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if moe is not None:
        mlp_names = ()
    for part, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, mlp_names)):
        missing = [n for n in names if part is None or not hasattr(part, n)]
        if missing:
            kind = type(part).__name__ if part is not None else "the layer"
            hint = " (a mixture-of-experts block of a form lowbit does not run)" if "moe" in kind.lower() or \
                "expert" in kind.lower() else ""
            raise ValueError(f"{where}: {kind} has no {', '.join(missing)}{hint}")
    extra = sorted({n for n, _ in attn.named_children()} - _ATTN_PARTS) + sorted(n for n, _ in
                                                                                 attn.named_parameters(recurse=False))
    if extra:
        raise ValueError(f"{where}: its attention block {type(attn).__name__} has parts lowbit's attention does not "
                         f"implement: {extra}")
    norms = [n for n, m in layer.named_children() if "norm" in n.lower() or "norm" in type(m).__name__.lower()]
    if sorted(norms) != ["input_layernorm", "post_attention_layernorm"]:
        raise ValueError(f"{where}: its decoder layer's norms are {norms}; lowbit needs exactly input_layernorm (before "
                         "q/k/v) and post_attention_layernorm (before gate/up), where CAS and the fused RMSNorm + "
                         "quantization launches act")
    for n in norms if try_norms else ():
        if not _rms_norm_like(getattr(layer, n)):
            raise ValueError(f"{where}: {n} ({type(getattr(layer, n)).__name__}) does not compute "
                             "weight * x / rms(x) (Llama's RMSNorm), which CAS folds into and the kernels compute")


def check_llama_family(model) -> None:
    """ValueError naming the first part of ``model`` that is not a Llama-family decoder (module docstring);
    a one-time warning for a model type outside ``TESTED_TYPES`` that passes. Checked once per model."""
    if getattr(model, "_lowbit_arch_checked", False):
        return
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", type(model).__name__)
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    where = f"lowbit supports Llama-family decoders ({', '.join(TESTED_TYPES)} and alike); model_type {mt!r}"
    if layers is None or len(layers) == 0:
        raise ValueError(f"{where}: no .model.layers")
    rope_params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    for name, fine, what in _UNSUPPORTED_CONFIG:
        for v in (getattr(cfg, name, fine), rope_params.get(name, fine) if isinstance(rope_params, dict) else fine):
            if v is not None and v != fine and not (name.endswith("softcapping") and v == 0):
                raise ValueError(f"{where} uses {what} ({name}={v}), which lowbit's layers do not implement")
    if any(not r for r in (getattr(cfg, "no_rope_layers", None) or [])):
        raise ValueError(f"{where} has layers without RoPE (no_rope_layers), which lowbit's attention does not skip")
    act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None)
    if act not in ("silu", "swish"):
        raise ValueError(f"{where}: the MLP activation is {act!r}; lowbit's fused MLP kernels compute SiLU(gate) * up")
    from lowbit.nn.base import FusedMLP

    for i, layer in enumerate(layers):  # every layer: some models change block types part-way (dense, then MoE)
        _check_layer(layer, f"{where}, layer {i}", FusedMLP, try_norms=i == 0)
    attn = layers[0].self_attn
    pairing = rope_pairing(model)
    if not _rope_matches(model, attn, pairing):
        raise ValueError(f"{where}: its RoPE (apply_rotary_pos_emb of {type(attn).__module__}) does not rotate "
                         f"{'(2i, 2i+1)' if pairing == 'interleaved' else '(i, i + head_dim/2)'} channel pairs with "
                         "the model's cos / sin tables as lowbit's kernels do")
    if mt not in TESTED_TYPES:
        warn_once(f"lowbit: model_type {mt!r} is not among the tested Llama-family types {TESTED_TYPES}; its layers "
                  "passed lowbit's structure checks (lowbit.models.arch.check_llama_family)")
    try:
        model._lowbit_arch_checked = True
    except AttributeError:  # a module that refuses attributes: check again next time
        pass


def decoder_layers(model) -> list[LayerView]:
    """LayerViews of a Llama-family ``*ForCausalLM``; ValueError for other architectures (``check_llama_family``)."""
    check_llama_family(model)
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
        moe = moe_block(mlp)
        if moe is not None:
            views.append(LayerView(i, layer, layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj,
                                   attn.o_proj, layer.post_attention_layernorm, None, None, None, nh, nkv, hd,
                                   pairing, has_qk_norm(attn), sliding_window(attn), router=moe[0],
                                   experts=moe[1], shared_expert=moe[2][0] if moe[2] else None,
                                   shared_gate=moe[2][1] if moe[2] else None))
            continue
        # a FusedMLP (gate and up as one quantized linear: the flute recipes' default) has no gate / up of its own
        views.append(LayerView(i, layer, layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj,
                               attn.o_proj, layer.post_attention_layernorm, getattr(mlp, "gate_proj", None),
                               getattr(mlp, "up_proj", None), mlp.down_proj, nh, nkv, hd, pairing, has_qk_norm(attn),
                               sliding_window(attn)))
    return views


def select_layers(model, layers=None) -> tuple[list[LayerView], list[int]]:
    """(all LayerViews, the chosen indices): ``layers`` = None for all, else indices checked in range."""
    views = decoder_layers(model)
    idx = list(range(len(views))) if layers is None else list(layers)
    for i in idx:
        if not 0 <= i < len(views):
            raise ValueError(f"layer index {i} out of range (model has {len(views)} layers)")
    return views, idx
