"""Tiny random Llama models and a toy QuantLinear for the models-area tests (no download)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.nn.base import QuantLinear


def tiny_llama(*, head_dim: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               vocab: int = 128, seed: int = 0, dtype=torch.float32, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=256, tie_word_embeddings=tie, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).to(dtype).eval()
    m.generation_config.eos_token_id = None  # greedy runs the full length
    m.generation_config.bos_token_id = None
    with torch.no_grad():  # larger weights than the 0.02 init so greedy tokens vary
        for p in m.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return m


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
