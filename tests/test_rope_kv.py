"""lowbit.ptq.rope_kv: RPN (folded, exact) and CRS (post-RoPE) on a tiny random Llama."""
import pytest
import torch

from lowbit.ptq.rope_kv import apply_rpn, calibrate_rpn_crs, default_top_k, pair_channels


def tiny_llama(seed=0, heads=4, kv_heads=2, head_dim=32, layers=2, outlier=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).eval()
    if outlier:  # a key outlier pair (channels 3 and 3 + D/2 of KV head 1), as real models have
        with torch.no_grad():
            for layer in m.model.layers:
                w = layer.self_attn.k_proj.weight
                w[head_dim + 3] *= 25.0
                w[head_dim + 3 + head_dim // 2] *= 25.0
    return m


def batches(n=2, S=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (1, S), generator=g) for _ in range(n)]


def test_pairing_and_default_top_k():
    a, b = pair_channels(8, "half")
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5, 6, 7]
    a, b = pair_channels(8, "interleaved")
    assert a.tolist() == [0, 2, 4, 6] and b.tolist() == [1, 3, 5, 7]
    assert default_top_k(128) == 8 and default_top_k(64) == 4
    with pytest.raises(ValueError):
        pair_channels(8, "other")


@torch.no_grad()
def test_rpn_leaves_float_model_unchanged():
    m = tiny_llama()
    ids = torch.randint(0, 96, (2, 16))
    ref = m(ids).logits
    p = calibrate_rpn_crs(m, batches(), crs=True)
    apply_rpn(m, p)
    apply_rpn(m, p)  # idempotent
    assert all(x.rpn_applied for x in p)
    out = m(ids).logits
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()
    # and the weights did change
    assert not torch.allclose(m.model.layers[0].self_attn.k_proj.weight, tiny_llama().model.layers[0].self_attn.k_proj.weight)


@torch.no_grad()
def test_rpn_bounds_pair_norms_gqa():
    """After folding, every non-CRS pair's max norm over the calibration tokens is alpha (code
    convention) or 1/alpha (paper); q heads of a group carry their KV head's inverse."""
    m = tiny_llama()
    cal = batches()
    for conv, bound in (("code", 8.0), ("paper", 1 / 8.0)):
        mm = tiny_llama()
        p = calibrate_rpn_crs(mm, cal, crs=False, convention=conv)
        apply_rpn(mm, p)
        ks = []
        h = mm.model.layers[1].self_attn.k_proj.register_forward_hook(lambda mod, i, o: ks.append(o))
        for ids in cal:
            mm(ids, use_cache=False)
        h.remove()
        k = torch.cat(ks, 1).view(-1, 2, 32)
        a, b = pair_channels(32, "half")
        pn = (k[..., a] ** 2 + k[..., b] ** 2).sqrt().amax(0)
        assert torch.allclose(pn, torch.full_like(pn, bound), rtol=1e-4)
    qw = m.model.layers[0].self_attn.q_proj.weight.clone()
    p = calibrate_rpn_crs(m, cal, crs=False)
    apply_rpn(m, p)
    ratio = (m.model.layers[0].self_attn.q_proj.weight / qw)[:, 0].view(4, 32)
    assert torch.allclose(ratio[0], ratio[1]) and torch.allclose(ratio[2], ratio[3])  # GQA groups
    assert torch.allclose(ratio[0], 1 / p[0].rpn[0])


@torch.no_grad()
def test_crs_selects_outlier_pairs_and_scales_post_rope():
    m = tiny_llama()
    p = calibrate_rpn_crs(m, batches(), top_k=1, beta=8.0)
    for x in p:
        assert x.pairs.shape == (2, 1)
        assert x.pairs[1, 0].item() == 3  # the injected outlier pair
        assert x.crs_k[1, 3] != 1 and x.crs_k[1, 3 + 16] != 1  # both channels of the pair, own factors
        assert (x.crs_k[1, :3] == 1).all()
        assert x.rpn[1, 3] == 1 and x.rpn[1, 19] == 1  # RPN is 1 on CRS pairs
        assert torch.allclose(x.crs_q, 1 / x.crs_k)


@torch.no_grad()
def test_crs_and_rpn_reduce_kv4_score_error():
    """On keys with an outlier pair, per-token INT4 keys lose the small channels (the outlier sets
    the scale); CRS / RPN equalise the channels, and the attention scores q.k get more accurate."""
    from lowbit.bench.suites.kv4 import _capture_qkv
    from lowbit.formats.kv4 import dequantize_kv4, quantize_kv4

    m = tiny_llama()
    cal = batches(S=64)
    qkv = _capture_qkv(m, cal[0])
    # CRS alone bounds the outlier channels by beta while the other channels keep their raw size:
    # it helps when beta is near their magnitude (here ~1; real models' keys are larger, beta = 8)
    cfgs = {"none": None, "crs": calibrate_rpn_crs(m, cal, rpn=False, top_k=2, beta=1.0),
            "rpn": calibrate_rpn_crs(m, cal, crs=False), "rpn+crs": calibrate_rpn_crs(m, cal, top_k=2)}
    err = {}
    for name, params in cfgs.items():
        e = []
        for i, (q, k, _) in enumerate(qkv):
            qg = q.view(2, 2, *q.shape[1:])  # [Hkv, G, S, D]
            ref = qg @ k[:, None].transpose(-1, -2)
            qs, ks = qg, k
            if params is not None:
                for t in (params[i].rpn, params[i].crs_k):
                    if t is not None:
                        ks, qs = ks * t[:, None, :], qs / t[:, None, None, :]
            kq = dequantize_kv4(*quantize_kv4(ks))
            e.append(((qs @ kq[:, None].transpose(-1, -2) - ref).norm() / ref.norm()).item())
        err[name] = sum(e) / len(e)
    assert err["crs"] < 0.7 * err["none"], err
    assert err["rpn"] < 0.7 * err["none"], err
    assert err["rpn+crs"] < 0.7 * err["none"], err


def test_errors():
    m = tiny_llama(outlier=False)
    with pytest.raises(ValueError, match="convention"):
        calibrate_rpn_crs(m, batches(), convention="other")
    with pytest.raises(ValueError, match="alpha"):
        calibrate_rpn_crs(m, batches(), alpha=0)
