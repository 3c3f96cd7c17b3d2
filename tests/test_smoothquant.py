"""SmoothQuant folded into the RMSNorms (lowbit.ptq.smoothquant): function unchanged in float,
activation outlier channels reduced, quantized error not worse on a model with outliers."""
import pytest
import torch

from lowbit.ptq.smoothquant import apply_smoothquant
from test_smooth_attention import batches, tiny_llama


def test_function_unchanged_and_outliers_reduced():
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[0].input_layernorm.weight[5] = 30.0  # an activation outlier channel
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = m(x).logits.double()
    info = apply_smoothquant(m, batches(), alpha=0.5)
    with torch.no_grad():
        out = m(x).logits.double()
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()
    s = info["layers"][0]["attn"]
    assert s.shape == (64,) and s[5] == s.max()
    assert m.model.layers[0].input_layernorm.weight[5] < 30.0


def test_requires_float_linears():
    from lowbit.models.arch import decoder_layers
    from lowbit.nn.w4a8_int8 import W4A8INT8Linear

    m = tiny_llama()
    v = decoder_layers(m)[0]
    v.set_linear("q_proj", W4A8INT8Linear.from_linear(v.q_proj))
    with pytest.raises(ValueError, match="q_proj"):
        apply_smoothquant(m, batches(), layers=[0])
    with pytest.raises(ValueError, match="alpha"):
        apply_smoothquant(m, batches(), alpha=-1)
