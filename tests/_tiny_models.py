"""Tiny random Llama models, a word-level tokenizer, a toy QuantLinear: the test fixtures of the
foundation and models areas, built in-process (no download)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from lowbit.nn.base import QuantLinear

WORDS = ("the a of and to in is it that for on with as was at by an be this are from or have not "
         "python class def return import module function value list dict string object type name").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def tiny_llama(*, head_dim: int | None = None, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               vocab: int = 128, seed: int = 0, dtype=torch.float32, tie: bool = False, init_std: float | None = 0.2,
               eos_token_id: int | None = None):
    """A random ``LlamaForCausalLM`` (eval mode, SDPA attention). ``init_std`` redraws every matrix from
    N(0, init_std) (larger than HF's 0.02 so greedy tokens vary; ``None`` keeps HF's init).
    ``eos_token_id=None`` makes greedy generation run the full length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim or hidden // heads,
                      max_position_embeddings=512, tie_word_embeddings=tie, attn_implementation="sdpa",
                      bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    m = LlamaForCausalLM(cfg).to(dtype).eval()
    m.generation_config.eos_token_id = eos_token_id
    m.generation_config.bos_token_id = None
    if init_std is not None:
        with torch.no_grad():
            for p in m.parameters():
                if p.ndim == 2:
                    p.normal_(0, init_std)
    return m


def tiny_variant(model_type: str, *, head_dim: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
                 kv_heads: int = 2, vocab: int = 128, seed: int = 0, init_std: float = 0.2,
                 intermediate: int | None = None, **config):
    """A random Llama-family model of another ``model_type`` (``qwen3``: per-head q/k norms; ``qwen2``:
    q/k/v biases; ``mistral``: a sliding window; ``mixtral`` / ``qwen3_moe``: MoE MLPs with experts as 3-D
    parameters, e.g. ``num_local_experts=4`` / ``num_experts=4, moe_intermediate_size=48``), built and initialised
    like ``tiny_llama``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = config.pop("attn_implementation", "sdpa")
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=hidden,
                               intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                               max_position_embeddings=512, attn_implementation=attn,
                               bos_token_id=None, eos_token_id=None, pad_token_id=None, **config)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.eos_token_id = m.generation_config.bos_token_id = None
    eager_experts(m)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim in (2, 3):  # 3-D: the experts of an MoE block (mixtral, qwen3_moe)
                p.normal_(0, init_std)
            elif name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
            elif name.endswith("k_norm.weight"):  # a key outlier pair, shared by all heads (q/k-norm models)
                p[3] = p[3 + head_dim // 2] = 12.0
    return m


def eager_experts(m):
    """Float MoE experts through transformers' eager loop (its default ``grouped_mm`` needs 16-byte-aligned expert
    widths, which the fuzzed tiny shapes are not; real models' are). Returns ``m``."""
    for mod in m.modules():
        if getattr(getattr(mod, "config", None), "_experts_implementation", None) not in (None, "eager"):
            mod.config._experts_implementation = "eager"
    return m


def tiny_tokenizer():
    """Word-level tokenizer over ``WORDS`` with ChatML-like specials and a chat template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", additional_special_tokens=specials[1:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def foundation_llama(vocab: int = 64, *, tie: bool = True):
    """The CLI/eval model: hidden 32 (head_dim 8), HF init, eos = pad = 2 (``<|im_end|>``)."""
    return tiny_llama(vocab=vocab, hidden=32, tie=tie, init_std=None, eos_token_id=2)


def tiny_hf_folder(path: Path) -> Path:
    """Write config + safetensors + tokenizer of the tiny model into ``path``; returns it."""
    path = Path(path)
    tok = tiny_tokenizer()
    foundation_llama(vocab=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_text(n_words: int = 400, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(WORDS), (n_words,), generator=g).tolist()
    return " ".join(WORDS[i] for i in idx)


class ToyInt8Linear(QuantLinear):
    """Per-output-channel INT8 weight-only linear: the smallest QuantLinear that follows the
    contract (buffers only, config(), empty()), so checkpoint tests do not depend on other areas."""

    scheme = "toy-int8"

    def __init__(self, in_features, out_features, bias, dtype, *, scale_dtype: str = "float32"):
        super().__init__(in_features, out_features, dtype)
        self.scale_dtype = scale_dtype
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.zeros(out_features, dtype=getattr(torch, scale_dtype)))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)

    @classmethod
    def from_linear(cls, linear, **options):
        w = linear.weight.detach().float()
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype, **options)
        s = w.abs().amax(1).clamp_min(1e-12) / 127
        m.qweight.copy_(torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8))
        m.scale.copy_(s)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    @classmethod
    def empty(cls, in_features, out_features, bias, dtype, **config):
        return cls(in_features, out_features, bias, dtype, **config)

    def config(self):
        return {"scale_dtype": self.scale_dtype}

    def dequantize(self):
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x):
        return F.linear(x, self.dequantize().to(x.dtype), self.bias)


def toy_quantize(model):
    from lowbit.models.arch import decoder_layers

    for v in decoder_layers(model):
        for role, lin in v.linears().items():
            v.set_linear(role, ToyInt8Linear.from_linear(lin))
    model.lowbit_recipe = {"recipe": "toy", "options": {}, "kv": None, "attention": None, "rope_kv": None}
    return model


def greedy(model, prompt, n: int = 8):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:]


def runner_rope_ab(model, prompts, n: int, max_seq: int = 12):
    """The runner's greedy tokens with the eager RoPE and with ``lowbit.kernels.rope`` (``rope_kernel``), and
    the kernel's calls as ``(heads, qk_norm given, rotate_heads)``: (eager tokens, kernel tokens, calls)."""
    import lowbit.kernels.rope as rope_mod
    from lowbit.models.generate import Generator

    ref = Generator(model, max_batch=len(prompts), max_seq=max_seq, rope_kernel=False).generate(prompts, n)
    calls, orig = [], rope_mod.rope_triton

    def spy(x, *a, **k):
        calls.append((x.shape[2], k.get("qk_norm") is not None, k.get("rotate_heads")))
        return orig(x, *a, **k)

    rope_mod.rope_triton = spy
    try:
        got = Generator(model, max_batch=len(prompts), max_seq=max_seq, rope_kernel=True).generate(prompts, n)
    finally:
        rope_mod.rope_triton = orig
    return ref, got, calls
