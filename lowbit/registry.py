"""The one table of lowbit's schemes and recipes.

Each entry names where its implementation lives ("module:attr") so that ``import lowbit`` stays
light and a scheme's module is imported only when used. Implementations:

- linear scheme: a ``QuantLinear`` subclass (``lowbit.nn.base``) whose
  ``from_linear(linear, **options)`` builds the quantized module;
- attention scheme: ``fn(q, k, v, *, causal, sm_scale, **options) -> Tensor`` with
  q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Skv, D]``, output like q;
- recipe: ``fn(model, calibration=None, **options) -> model`` (see ``lowbit.models.recipes``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # "linear" | "attention" | "recipe"
    target: str  # "package.module:attr"
    description: str
    paper: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    options: dict = field(default_factory=dict)

    def load(self):
        mod, _, attr = self.target.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


_ENTRIES = [
    # ---- linear schemes -------------------------------------------------------------------
    Entry("w4a8-fp8", "linear", "lowbit.nn.w4a8_fp8:W4A8FP8Linear",
          "INT4 weights, FP8 E4M3 group scales, FP8 per-token activations, FP8 tensor cores",
          "FireQ §3.1", options={"group_size": 128, "pts": True}),
    Entry("lut", "linear", "lowbit.nn.lut:LUTLinear",
          "2/3/4-bit lookup-table weights (NormalFloat or user table), bf16/fp16 activations",
          "FLUTE §3", options={"bits": 4, "group_size": 128, "table": "nf"}),
    Entry("w4a8-int8", "linear", "lowbit.nn.w4a8_int8:W4A8INT8Linear",
          "QoQ progressive INT4->INT8 weights, INT8 per-token activations, INT8 tensor cores",
          "QServe §4", options={"group_size": 128}),
    Entry("w8", "linear", "lowbit.nn.w8:W8Linear",
          "INT8 weight-only (per-channel fp32 scale), bf16/fp16 activations: wide layers such as the lm_head",
          ""),
    # ---- attention schemes ----------------------------------------------------------------
    Entry("sdpa", "attention", "lowbit.ops.attention:sdpa_attention",
          "unquantized reference: torch scaled_dot_product_attention in the input dtype", ""),
    Entry("fp8", "attention", "lowbit.ops.attention_prefill:fp8_attention",
          "FP8 E4M3 Q/K/V (per-token scales), FP8 P, FP32 O accumulation", "FireQ App. D"),
    Entry("fp8-kv4", "attention", "lowbit.ops.attention_prefill:fp8_kv4_attention",
          "FP8 Q, INT4 K/V (per-token FP8 scales) dequantized in the kernel", "FireQ §3.2"),
    Entry("int8", "attention", "lowbit.ops.attention_prefill:int8_attention",
          "INT8 Q/K (per-token), INT8 V (per-block channel scales), INT8 P, INT32 dots",
          "INT-FlashAttention Alg. 1"),
    Entry("int8-qk", "attention", "lowbit.ops.attention_prefill:int8_qk_attention",
          "half-INT8: INT8 QK^T, bf16/fp16 PV", "INT-FlashAttention §3"),
    # ---- recipes (model level) ------------------------------------------------------------
    Entry("fireq", "recipe", "lowbit.models.recipes:fireq",
          "w4a8-fp8 linears + CAS + PTS, RPN+CRS INT4 KV cache, fp8 prefill attention", "FireQ"),
    Entry("qserve", "recipe", "lowbit.models.recipes:qserve",
          "w4a8-int8 linears + SmoothAttention, INT4 KV cache with zero points", "QServe"),
    Entry("flute-nf4", "recipe", "lowbit.models.recipes:flute_nf4",
          "4-bit NormalFloat lookup-table weights, g128", "FLUTE"),
    Entry("flute-nf3", "recipe", "lowbit.models.recipes:flute_nf3",
          "3-bit NormalFloat lookup-table weights, g128", "FLUTE"),
    Entry("int8-attention", "recipe", "lowbit.models.recipes:int8_attention",
          "INT8 FlashAttention for prefill, weights unquantized", "INT-FlashAttention"),
    Entry("fp8-mla", "recipe", "lowbit.models.recipes:fp8_mla",
          "DeepSeek MLA models: per-token FP8 latent cache with bf16 RoPE part", "SnapMLA"),
]

_BY_KIND: dict[str, dict[str, Entry]] = {}
for _e in _ENTRIES:
    _BY_KIND.setdefault(_e.kind, {})[_e.name] = _e


def get(kind: str, name: str) -> Entry:
    """Look up an entry; unknown names raise ValueError listing the known ones."""
    table = _BY_KIND.get(kind, {})
    if not isinstance(name, str) or name not in table:
        known = ", ".join(sorted(table))
        what = f"{kind} scheme" if kind != "recipe" else "recipe"
        raise ValueError(f"unknown {what} {name!r}; known: {known}")
    return table[name]


def entries(kind: str | None = None) -> list[Entry]:
    return [e for e in _ENTRIES if kind is None or e.kind == kind]
