"""PTS rule (lowbit.ptq.pts) on crafted weights and CAS (lowbit.ptq.cas) invariance."""
import pytest
import torch

from lowbit.ptq.pts import pts_exponent, underflow_groups, underflow_score


def _w(vals, k=256):
    w = torch.zeros(2, k)
    w.view(-1)[: len(vals)] = torch.tensor(vals)
    return w


@pytest.mark.parametrize("vals,n", [
    ([1.0, 1e-9], 8),          # tiny weight: S never saturates before n2; 2^8 * 1 = 256 in [224, 448)
    ([0.3, -1e-9], 10),        # 0.3 * 2^10 = 307.2
    ([300.0, 1e-6], 0),        # already in [224, 448)
    ([500.0, 1e-6], 0),        # above 448: no scaling down (documented)
    ([1.0, 0.5, -0.25], 0),    # every nonzero |w| >= 7*2^-9: S saturated at n = 0 (condition 1)
    ([1.0, 0.004], 2),         # 0.004 * 2^2 = 0.016 >= 7*2^-9 = 0.01367; 0.008 < it -> n1 = 2 < n2 = 8
    ([0.875, 0.0], 0),         # only |w| = 0.875 >= 7*2^-9 nonzero: S saturated at 0 (n2 would be 8)
])
def test_pts_rule(vals, n):
    w = _w(vals)
    got = pts_exponent(w)
    # the definition, checked directly: smallest n >= 0 meeting (1) or (2)
    def meets(m):
        s = underflow_score(w * 2.0 ** m)
        sat = all(abs(underflow_score(w * 2.0 ** (m + i)) - s) < 1e-12 for i in range(1, 40))
        mx = w.abs().max().item() * 2.0 ** m
        return sat or (224 <= mx < 448)
    want = next((m for m in range(0, 40) if meets(m)), 0)
    if w.abs().max() >= 448:
        want = 0  # documented exception: the paper leaves max|w| >= 448 open; we never scale up then
    assert got == want
    assert got == n


def test_pts_zero_and_nan():
    assert pts_exponent(torch.zeros(3, 128)) == 0
    with pytest.raises(ValueError, match="NaN"):
        pts_exponent(torch.tensor([[float("nan"), 1.0]]))


def test_pts_reduces_underflowing_groups():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 1e-3  # group maxima ~3e-3 < 7*2^-9: every group underflows
    n = pts_exponent(w)
    assert underflow_groups(w) == 128
    assert underflow_groups(w * 2.0 ** n) == 0 and n > 0


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and uneven channels, so CAS actually rescales
        for p in m.parameters():
            p.mul_(1 + torch.rand_like(p))
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight[:, 3] *= 20
            layer.mlp.down_proj.weight[:, 5] *= 30
    return m


@pytest.mark.parametrize("projections", [("gate_up", "down"), ("qkv", "o", "gate_up", "down")])
def test_cas_keeps_float_function(projections):
    from lowbit.ptq.cas import apply_cas

    m = _tiny_llama()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = m(ids).logits
    info = apply_cas(m, projections=projections)
    with torch.no_grad():
        out = m(ids).logits
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert info["max_ratio"] > 2  # it did rescale
    lam = info["lambdas"][(0, projections[-1])]
    assert abs(lam.log().mean().item()) < 1e-4  # geometric-mean target: prod(lambda) = 1


def test_cas_equalizes_absmean():
    from lowbit.models.arch import decoder_layers
    from lowbit.ptq.cas import apply_cas

    m = _tiny_llama(1)
    apply_cas(m, projections=("gate_up", "down"))
    v = decoder_layers(m)[0]
    a = torch.cat([v.gate_proj.weight, v.up_proj.weight]).abs().mean(0)
    assert (a.max() / a.min()).item() < 1.01  # alpha = 1: equal column absmeans
    a = v.down_proj.weight.abs().mean(0)
    assert (a.max() / a.min()).item() < 1.01


def test_cas_bad_args():
    from lowbit.ptq.cas import apply_cas

    with pytest.raises(ValueError, match="projections"):
        apply_cas(_tiny_llama(), projections=("mlp",))
