"""SmoothAttention (lowbit.ptq.smooth_attention): λ shared within RoPE pairs, folded into
q_proj/k_proj per KV head (GQA), model function unchanged in float, K outliers reduced."""
import pytest
import torch

from lowbit.ptq.smooth_attention import apply_smooth_attention, pair_max, smooth_attention_scales


def tiny_llama(seed=0, kv_heads=2, bias=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      attention_bias=bias)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # plant fixed outlier channels in K (one per KV head, one RoPE pair member)
        for layer in m.model.layers:
            layer.self_attn.k_proj.weight[3] *= 20
            layer.self_attn.k_proj.weight[-7] *= 12
    return m


def batches(n=3, s=16):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (1, s), generator=g) for _ in range(n)]


def test_pair_max_half_and_interleaved():
    s = torch.tensor([1.0, 5.0, 3.0, 2.0])
    assert torch.equal(pair_max(s, "half"), torch.tensor([3.0, 5.0, 3.0, 5.0]))
    assert torch.equal(pair_max(s, "interleaved"), torch.tensor([5.0, 5.0, 3.0, 3.0]))
    with pytest.raises(ValueError):
        pair_max(s, "other")


@pytest.mark.parametrize("kv_heads,bias", [(2, False), (4, True), (1, False)])
def test_function_unchanged_in_float(kv_heads, bias):
    m = tiny_llama(kv_heads=kv_heads, bias=bias)
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = m(x).logits.double()
    k_before = m.model.layers[0].self_attn.k_proj.weight.abs().amax(1).clone()
    info = apply_smooth_attention(m, batches(), alpha=0.5)
    with torch.no_grad():
        out = m(x).logits.double()
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()
    lam = info["layers"][0]
    assert lam.shape == (kv_heads, 16)
    assert torch.equal(lam[:, :8], lam[:, 8:])  # shared within each (i, i + D/2) pair
    k_after = m.model.layers[0].self_attn.k_proj.weight.abs().amax(1)
    assert k_after[3] < k_before[3]  # the outlier channel shrank


def test_outliers_flatten_and_alpha_zero_is_identity():
    m = tiny_llama()
    w0 = m.model.layers[1].self_attn.q_proj.weight.clone()
    info = apply_smooth_attention(m, batches(), layers=[0], alpha=0.0)
    assert torch.equal(info["layers"][0], torch.ones(2, 16))
    assert torch.equal(m.model.layers[1].self_attn.q_proj.weight, w0)  # layer 1 untouched
    lam = smooth_attention_scales(torch.tensor([4.0, 0.0, 1.0, 0.0]), 1, 4, "half", 0.5)
    assert torch.allclose(lam, torch.tensor([2.0, 1.0, 2.0, 1.0]))  # dead pair keeps λ = 1


def test_bad_arguments():
    m = tiny_llama()
    with pytest.raises(ValueError, match="alpha"):
        apply_smooth_attention(m, batches(), alpha=2.0)
    with pytest.raises(ValueError, match="layer index"):
        apply_smooth_attention(m, batches(), layers=[5])
