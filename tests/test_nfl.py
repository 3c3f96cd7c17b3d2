"""lowbit.ptq.nfl.learn_nf_scales (FLUTE §4.2 learned NF scales) on a tiny random Llama."""
import torch

from lowbit.models.arch import decoder_layers
from lowbit.nn.lut import LUTLinear
from lowbit.ptq.nfl import learn_nf_scales


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def _batches(n=6, s=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (1, s), generator=g) for _ in range(n)]


def _loss(model, batches):
    with torch.no_grad():
        return sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)


def test_learn_scales_quantizes_in_place_and_is_seeded():
    a, b = _tiny_llama(), _tiny_llama()
    ia = learn_nf_scales(a, _batches(), lr=1e-3, bits=3, group_size=32, progress=False, seed=3)
    ib = learn_nf_scales(b, _batches(), lr=1e-3, bits=3, group_size=32, progress=False, seed=3)
    assert ia["steps"] == 6 and ia["linears"] == 14 and ia["mode"] == "ste"
    assert ia["scale_rel_change"] > 0
    for v in decoder_layers(a):
        assert all(isinstance(m, LUTLinear) and m.bits == 3 for m in v.linears().values())
    assert all(not p.requires_grad or p.dtype.is_floating_point for p in a.parameters())
    la, lb = a.model.layers[0].mlp.down_proj, b.model.layers[0].mlp.down_proj
    assert torch.equal(la.scales, lb.scales) and torch.equal(la.qweight, lb.qweight)


def test_learned_scales_lower_calibration_loss_than_absmax():
    """Training the scales on the loss beats the absmax NF scales on that same text."""
    batches = _batches(n=8)
    base = _tiny_llama()
    rtn = _tiny_llama()
    for v in decoder_layers(rtn):
        for role, lin in v.linears().items():
            v.set_linear(role, LUTLinear.from_linear(lin, bits=2, group_size=32))
    learned = _tiny_llama()
    learn_nf_scales(learned, batches, lr=2e-3, epochs=3, bits=2, group_size=32, progress=False)
    l_rtn, l_learn = _loss(rtn, batches), _loss(learned, batches)
    assert l_learn < l_rtn, (l_learn, l_rtn, _loss(base, batches))


def test_frozen_codes_mode_on_lut_model():
    model = _tiny_llama()
    for v in decoder_layers(model):
        for role, lin in v.linears().items():
            v.set_linear(role, LUTLinear.from_linear(lin, bits=4, group_size=32))
    before = model.model.layers[1].self_attn.q_proj.scales.clone()
    codes = model.model.layers[1].self_attn.q_proj.qweight.clone()
    info = learn_nf_scales(model, _batches(n=3), lr=1e-3, progress=False)
    q = model.model.layers[1].self_attn.q_proj
    assert info["mode"] == "frozen-codes" and isinstance(q, LUTLinear)
    assert torch.equal(q.qweight, codes) and not torch.equal(q.scales, before)


def test_flute_recipe_learned_scales_runs_ste():
    """The learned-NF recipe trains through the STE on the float weights (not frozen codes),
    seeded, with the recipe's bits/group/skip; same seed -> same scales."""
    from lowbit.models.recipes import flute_nf3

    models = []
    for _ in range(2):
        m = _tiny_llama()
        flute_nf3(m, _batches(n=3), learn_scales=True, lr=1e-3, group_size=32, seed=5, progress=False,
                  skip=("down_proj",))
        models.append(m)
    rep = models[0].lowbit_recipe["reports"]["nfl"]
    assert rep["mode"] == "ste" and rep["bits"] == 3 and rep["group_size"] == 32 and rep["linears"] == 12
    a, b = (m.model.layers[1].self_attn.q_proj for m in models)
    assert isinstance(a, LUTLinear) and a.bits == 3 and torch.equal(a.scales, b.scales)
    assert isinstance(models[0].model.layers[0].mlp.down_proj, torch.nn.Linear)
