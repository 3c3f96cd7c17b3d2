"""LUTLinear (scheme 'lut'): construction, state_dict round trip, API entry, generation."""
import pytest
import torch
from torch import nn

import lowbit
from lowbit.nn.lut import LUTLinear
from tests.tolerances import rel_l2


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("bits,table", [(4, "nf"), (3, "nf"), (2, "nf"), (4, "int")])
def test_from_linear_matches_dequantized_weight(bits, table):
    torch.manual_seed(bits)
    lin = nn.Linear(100, 24, bias=True)
    m = lowbit.quantize_linear(lin, "lut", bits=bits, group_size=32, table=table)
    assert isinstance(m, LUTLinear) and m.scheme == "lut" and m.dtype == torch.bfloat16
    x = torch.randn(5, 100)
    y = m(x)
    assert y.dtype == torch.float32 and y.shape == (5, 24)
    ref = nn.functional.linear(x, m.dequantize(), lin.bias)
    assert rel_l2(y, ref) < 1e-3  # bias stored in bf16
    err = rel_l2(m.dequantize(), lin.weight)  # quantization error of the format itself
    assert err < {4: 0.15, 3: 0.3, 2: 0.6}[bits]


def test_fp16_linear_keeps_fp16_and_kernel_path():
    lin = nn.Linear(64, 16).half()
    m = LUTLinear.from_linear(lin, bits=4, group_size=64)
    assert m.dtype == torch.float16 and m.scales.dtype == torch.float16
    x = torch.randn(3, 64, dtype=torch.float16)
    assert rel_l2(m(x), nn.functional.linear(x.float(), m.dequantize(), lin.bias.float())) < 2e-3


@pytest.mark.parametrize("bits", [3, 4])
def test_state_dict_roundtrip_via_empty(bits):
    lin = nn.Linear(130, 20, bias=False)
    m = LUTLinear.from_linear(lin, bits=bits, group_size=64, table=torch.linspace(-1, 1, 2 ** bits))
    assert m.config()["table_kind"] == "int"  # a uniform user table gets the affine lookup
    sd = m.state_dict()
    assert all(v.is_contiguous() for v in sd.values())
    m2 = LUTLinear.empty(130, 20, False, m.dtype, **m.config())
    m2.load_state_dict(sd)
    x = torch.randn(2, 130)
    assert torch.equal(m(x), m2(x))
    assert m.weight_bytes() == sum(v.numel() * v.element_size() for v in sd.values())


def test_bad_options():
    lin = nn.Linear(64, 8)
    with pytest.raises(ValueError, match="group_size"):
        LUTLinear.from_linear(lin, group_size=100)
    with pytest.raises(ValueError, match="bits"):
        LUTLinear.from_linear(lin, bits=8)
    with pytest.raises(TypeError, match="linear"):
        LUTLinear.from_linear(torch.randn(3, 3))


@pytest.mark.parametrize("K", (1, 100, 130))
def test_x_width_must_match_in_features(K):
    """An x narrower or wider than in_features raises, naming x, even when it fits in the padded groups (the op
    sees only the groups; session 33's shape fuzz found a K = 1 module taking x of width 2)."""
    m = lowbit.quantize_linear(nn.Linear(K, 8), "lut")
    for width in (K + 1, K + 3, max(K - 1, 1) if K > 1 else 2):
        with pytest.raises(ValueError, match="x must have"):
            m(torch.randn(2, width))


def test_quantized_model_generates():
    model = _tiny_llama()
    from lowbit.models.arch import decoder_layers

    for v in decoder_layers(model):
        for role, lin in v.linears().items():
            v.set_linear(role, lowbit.quantize_linear(lin, "lut", bits=4, group_size=32, table="nf"))
    ids = torch.randint(0, 96, (1, 6))
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("lookup", ["pair", "load", "select"])
def test_module_lookups_agree_on_kernel_path(lookup):
    lin = nn.Linear(96, 40)
    m = LUTLinear.from_linear(lin, bits=3, group_size=32, lookup=lookup)
    assert m.pairs.shape == (64, 2) and m.pairs.dtype == torch.bfloat16
    x = torch.randn(2, 96, dtype=torch.bfloat16)  # bf16: the Triton kernel (interpreter on CPU)
    ref = nn.functional.linear(x.double(), m.dequantize().double(), lin.bias.double())
    assert rel_l2(m(x), ref) < 1e-2


@pytest.mark.parametrize("bits,g", [(4, 64), (3, 128)])
def test_mma_layout_module(bits, g, monkeypatch):
    """layout='mma' (tensor-core fragment order): same weights as 'planar', kernel path (interpreter)
    and reference agree, config round trip, codes() readable, large-M dequant path."""
    from lowbit.ops import lut as lut_ops

    torch.manual_seed(bits)
    lin = nn.Linear(200, 40)
    a = LUTLinear.from_linear(lin, bits=bits, group_size=g, layout="mma")
    b = LUTLinear.from_linear(lin, bits=bits, group_size=g, layout="planar")
    assert a.layout == "mma" and a.config()["layout"] == "mma"
    assert torch.equal(a.codes(), b.codes()) and torch.equal(a.dequantize(), b.dequantize())
    x = torch.randn(3, 200, dtype=torch.bfloat16)
    ref = nn.functional.linear(x.double(), a.dequantize().double(), lin.bias.double())
    assert rel_l2(a(x), ref) < 1e-2
    monkeypatch.setattr(lut_ops, "MAX_KERNEL_M", 2)  # M = 3 -> dequantize kernel + matmul
    assert rel_l2(a(x), ref) < 1e-2
    m2 = LUTLinear.empty(200, 40, True, a.dtype, **a.config())
    m2.load_state_dict(a.state_dict())
    assert torch.equal(m2.qweight, a.qweight) and m2.layout == "mma"
    with pytest.raises(ValueError, match="layout"):
        LUTLinear.from_linear(lin, bits=3, group_size=64, layout="mma")


def test_old_checkpoint_config_without_layout_is_planar():
    lin = nn.Linear(128, 16)
    m = LUTLinear.from_linear(lin, bits=4, group_size=128, layout="planar")
    cfg = {k: v for k, v in m.config().items() if k != "layout"}  # session-1 config
    m2 = LUTLinear.empty(128, 16, True, m.dtype, **cfg)
    m2.load_state_dict(m.state_dict())
    assert m2.layout == "planar" and torch.equal(m2.qweight, m.qweight)
