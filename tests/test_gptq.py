"""GPTQ (``lowbit.ptq.gptq``): its grids equal each format's reference round to nearest, the error feedback
lowers the calibration loss, the modules store exactly the weight GPTQ chose, and the recipes wire it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.formats import lut as lut_fmt
from lowbit.formats import w4a8_fp8 as fp8_fmt
from lowbit.formats import w4a8_int8 as int8_fmt
from lowbit.nn.base import GPTQ_ATTR, GPTQResult
import lowbit.ptq.gptq
from lowbit.ptq.gptq import gptq_weight, hessian_update, make_grid, proxy_loss, round_to_nearest
from tests._tiny_models import greedy, tiny_llama

SCHEMES = [("w4a8-fp8", {"pts_exp": 0}), ("w4a8-fp8", {"pts_exp": 3}), ("w4a8-int8", {}),
           ("lut", {"bits": 4, "table": "nf"}), ("lut", {"bits": 3, "table": "nf"}), ("lut", {"bits": 2, "table": "int"})]


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _format_rtn(scheme, w, gs, opts):
    """The format reference's own quantize -> dequantize (float32 [N, K])."""
    k = w.shape[1]
    if scheme == "w4a8-fp8":
        c, s, inv = fp8_fmt.quantize_weight(w, gs, opts["pts_exp"])
        return fp8_fmt.dequantize_weight(c, s, k, gs) * inv
    if scheme == "w4a8-int8":
        return int8_fmt.dequantize(int8_fmt.quantize(w, gs))
    q = lut_fmt.quantize_lut(w, bits=opts["bits"], group_size=gs, table=opts["table"])
    return lut_fmt.dequantize_lut(q)[:, :k]


def _correlated(t, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(t, k // 4 + 1, generator=g)
    mix = torch.randn(k // 4 + 1, k, generator=g)
    return base @ mix + 0.1 * torch.randn(t, k, generator=g)


@pytest.mark.parametrize("scheme,opts", SCHEMES)
@pytest.mark.parametrize("k,gs", [(96, 32), (200, 64), (320, 128)])
def test_round_to_nearest_is_the_format_reference(scheme, opts, k, gs):
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(k)) * 0.05
    w[3, :gs] = 0.0  # an all-zero group
    grid = make_grid(scheme, w, opts)
    got = round_to_nearest(w, grid, gs)
    assert torch.equal(got, _format_rtn(scheme, w, gs, opts).float())
    assert torch.isfinite(got).all() and (got[3, :gs] == 0).all()


@pytest.mark.parametrize("scheme,opts", SCHEMES)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_calibration_loss(scheme, opts, act_order):
    k, gs = 256, 64
    x = _correlated(512, k)
    w = torch.randn(32, k, generator=torch.Generator().manual_seed(1)) * 0.05
    h, _ = hessian_update(None, 0, x)
    grid = make_grid(scheme, w, opts)
    q, _ = gptq_weight(w, h, grid, gs, act_order=act_order)
    rtn = round_to_nearest(w, grid, gs)
    assert proxy_loss(w, q, h) < 0.9 * proxy_loss(w, rtn, h)
    # every column is on the grid of its group: round to nearest under GPTQ's scales gives q back
    assert torch.isfinite(q).all()


@pytest.mark.parametrize("scheme,opts", SCHEMES[:4])
def test_identity_hessian_is_round_to_nearest(scheme, opts):
    w = torch.randn(16, 192, generator=torch.Generator().manual_seed(2)) * 0.05
    grid = make_grid(scheme, w, opts)
    q, _ = gptq_weight(w, torch.eye(192, dtype=torch.float64), grid, 64, damp=0.0)
    assert torch.equal(q, round_to_nearest(w, grid, 64))


def test_dead_inputs_and_zero_weight():
    k = 128
    x = _correlated(256, k)
    x[:, 5] = 0.0  # an input channel that never fires: its weights become 0 (GPTQ's rule)
    h, _ = hessian_update(None, 0, x)
    w = torch.randn(8, k) * 0.05
    for scheme, opts in SCHEMES[:4]:
        q, _ = gptq_weight(w, h, make_grid(scheme, w, opts), 64)
        assert (q[:, 5] == 0).all()
        z, _ = gptq_weight(torch.zeros(8, k), h, make_grid(scheme, torch.zeros(8, k), opts), 64)
        assert torch.equal(z, torch.zeros(8, k))


def test_hessian_is_a_running_mean():
    x = torch.randn(3, 50, 16)
    h, n = None, 0
    for b in x:
        h, n = hessian_update(h, n, b)
    full = 2 * x.reshape(-1, 16).double().T @ x.reshape(-1, 16).double() / 150
    assert n == 150 and torch.allclose(h, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme,opts,gs", [("w4a8-fp8", {"pts_exp": 2}, 64), ("w4a8-int8", {}, 64),
                                            ("w4a8-int8", {}, -1), ("lut", {"bits": 4, "table": "nf"}, 128),
                                            ("lut", {"bits": 3, "table": "nf"}, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=4, deadline=None)
@given(k=st.integers(33, 300), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_modules_store_gptq_weight_exactly(scheme, opts, gs, dtype, k, n, seed):
    """A linear GPTQ moved onto the grid, with its record, becomes a module whose dequantized weight is GPTQ's
    (any K, incl. K not a multiple of the group or of the 128-column blocks; fp32 and bf16 weights)."""
    if scheme == "w4a8-fp8" or scheme == "lut":
        k = max(k, 8) // 8 * 8  # lut: K % 8 (kernel layout); w4a8-fp8: any K, kept aligned for speed of the test
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    w = lin.weight.detach().to(dtype).float()
    x = _correlated(64, k, seed)
    h, _ = hessian_update(None, 0, x)
    o = dict(opts)
    if scheme == "lut":
        o["scale_dtype"] = dtype if dtype != torch.float32 else torch.bfloat16
    grid = make_grid(scheme, w, o)
    q, scales = gptq_weight(w, h, grid, k if gs == -1 else gs)
    lin = lin.to(dtype)
    with torch.no_grad():
        lin.weight.copy_(q.to(dtype))
    setattr(lin, GPTQ_ATTR, GPTQResult(scheme, gs, scales, o))
    kw = {"group_size": gs}
    if scheme == "w4a8-fp8":
        kw["pts"] = True
    if scheme == "lut":
        kw.update(bits=o["bits"], table=o["table"])
    mod = lowbit.quantize_linear(lin, scheme, **kw)
    assert torch.equal(mod.dequantize(), q)  # exactly GPTQ's weight (float32), whatever the stored dtype


def test_saturated_fp8_values_come_back_exactly():
    """A forced PTS exponent can make sigma > 64, where FP8(q * sigma) saturates at 448 for |q| >= 2: the codes under
    given scales are the nearest dequantized values, so GPTQ's saturated values are stored as they were chosen
    (``grid_codes`` alone would give code round(448 / sigma) = 1 back; found by a 300-case fuzz of this session)."""
    w = torch.zeros(2, 125)
    w[0, 3], w[1, 7], w[1, 9] = -448 / 32, 448 / 32, 320 / 32  # FP8(-2 * 320) = -448 (saturated), 448, FP8(1 * 320)
    sigma = torch.tensor([[320.0], [320.0]])
    c, s, inv = fp8_fmt.quantize_weight(w, 128, 5, sigma)
    assert torch.equal(fp8_fmt.dequantize_weight(c, s, 125, 128) * inv, w)
    # and through GPTQ with that exponent forced on weights it saturates
    w = torch.randn(7, 125, generator=torch.Generator().manual_seed(104)) * 3.0
    w[:, 113] *= 50
    h, _ = hessian_update(None, 0, _correlated(256, 125))
    for act_order in (False, True):
        q, sc = gptq_weight(w, h, make_grid("w4a8-fp8", w, {"pts_exp": 5}), 128, act_order=act_order)
        assert (sc["sigma"] > 64).any() and (q.abs() == 448 / 32).any()
        c, s, inv = fp8_fmt.quantize_weight(q, 128, 5, sc["sigma"])
        assert torch.equal(fp8_fmt.dequantize_weight(c, s, 125, 128) * inv, q)


def test_record_mismatch_is_a_clear_error():
    lin = torch.nn.Linear(64, 8, bias=False)
    setattr(lin, GPTQ_ATTR, GPTQResult("lut", 64, {"scales": torch.ones(8, 1, dtype=torch.bfloat16)},
                                       {"bits": 4, "table": "nf", "scale_dtype": torch.bfloat16}))
    with pytest.raises(ValueError, match="GPTQ-quantized for 'lut'"):
        lowbit.quantize_linear(lin, "w4a8-int8", group_size=64)
    with pytest.raises(ValueError, match="group_size=64"):
        lowbit.quantize_linear(lin, "lut", group_size=128)
    with pytest.raises(ValueError, match="bits=4"):
        lowbit.quantize_linear(lin, "lut", group_size=64, bits=3)


def _calib(n=3, s=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, s), generator=g) for _ in range(n)]


@pytest.mark.parametrize("name,opts", [("fireq", {}), ("fireq", {"fuse_mlp": True}), ("fireq", {"pts_scope": "tensor"}),
                                       ("qserve", {}), ("flute-nf4", {}), ("flute-nf3", {"gptq": {"act_order": False}})])
def test_recipes_with_gptq(name, opts):
    from lowbit.nn.base import QuantLinear

    torch.manual_seed(0)
    ref = tiny_llama(head_dim=16)
    m = tiny_llama(head_dim=16)
    m.load_state_dict(ref.state_dict())
    opts = {"gptq": True, **opts}
    m = lowbit.quantize_model(m, name, calibration=_calib(), progress=False, **opts)
    rep = m.lowbit_recipe["reports"]["gptq"]
    assert rep["linears"] == 14 and rep["gptq_loss"] < rep["rtn_loss"]
    assert m.lowbit_recipe["options"]["gptq"] == opts["gptq"]
    assert not any(hasattr(x, GPTQ_ATTR) and not isinstance(x, torch.nn.Linear) for x in m.modules())
    assert sum(isinstance(x, QuantLinear) for x in m.modules()) >= 12
    prompt = torch.tensor([[1, 5, 9, 17, 33, 2]])
    assert greedy(m, prompt, 4).shape == (1, 4)


@pytest.mark.parametrize("arch,per_layer,name", [("mixtral", 4, "fireq"), ("qwen2_moe", 7, "qserve"),
                                                   ("mixtral", 4, "flute-nf4")])
def test_gptq_on_moe_models(arch, per_layer, name):
    """q/k/v/o, a shared expert's gate / up / down and every routed expert a calibration token reached, by GPTQ;
    the quantized experts store exactly the weights GPTQ wrote into the float experts."""
    from lowbit.nn.moe import QuantExperts, experts_weights
    from lowbit.ptq.gptq import apply_gptq
    from tests._tiny_models import tiny_variant

    cfg = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
           "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                             shared_expert_intermediate_size=96)}[arch]
    m = tiny_variant(arch, **cfg)
    calib = _calib(4, 128)
    rep = apply_gptq(m, {"fireq": "w4a8-fp8", "qserve": "w4a8-int8", "flute-nf4": "lut"}[name], calib,
                     progress=False, group_size=32, expert_min_tokens=16)
    assert rep["linears"] == 2 * per_layer and rep["experts"] > 0 and rep["gptq_loss"] < rep["rtn_loss"]
    m2 = tiny_variant(arch, **cfg)
    m2 = lowbit.quantize_model(m2, name, calibration=calib, progress=False, gptq=True, kv=None, attention=None,
                               group_size=32)
    r2 = m2.lowbit_recipe["reports"]["gptq"]
    assert r2["experts"] + r2["experts_rtn"] == rep["experts"] + rep["experts_rtn"]
    if name == "flute-nf4":  # (the recipe's CAS changes the weights of the others: their counts may differ)
        assert r2["experts"] <= rep["experts"]
    qe = [x for x in m2.modules() if isinstance(x, QuantExperts)]
    assert len(qe) == 2 and torch.isfinite(m2(input_ids=torch.tensor([[1, 2, 3, 4]])).logits).all()
    # the quantized experts store exactly the weights GPTQ wrote into the float experts, matrix by matrix
    from lowbit.models.arch import decoder_layers

    scheme = {"fireq": "w4a8-fp8", "qserve": "w4a8-int8", "flute-nf4": "lut"}[name]
    for v in decoder_layers(m):
        q = QuantExperts.from_experts(v.experts, scheme, group_size=32)
        gu, dn = experts_weights(v.experts)
        recs = getattr(v.experts, "lowbit_gptq")
        assert recs
        for (key, e) in recs:
            mods, w = (q.gate_up, gu[e]) if key == "gate_up" else (q.down, dn[e])
            assert torch.equal(mods[e].dequantize(), w.float())


def _moved(m, ref) -> int:
    return sum(not torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("kw,match", [({"gptq": {"blocks": 3}}, "gptq must be"), ({"gptq": "yes"}, "gptq must be"),
                                      ({"gptq": True, "linear": "w8"}, "gptq needs linear"),
                                      ({"gptq": {"damp": 1.5}}, "damp"), ({"gptq": True, "skip": ["q_porj"]}, "q_porj"),
                                      ({"gptq": True, "group_size": 96}, "group_size")])
def test_gptq_errors_come_before_the_model_is_touched(kw, match):
    ref = tiny_llama()
    m = tiny_llama()
    with pytest.raises(ValueError, match=match):
        lowbit.quantize_model(m, "fireq", calibration=_calib(), progress=False, **kw)
    assert _moved(m, ref) == 0 and type(m.model.layers[0].self_attn) is type(ref.model.layers[0].self_attn)


def _pts_exps(m):
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    return [int(x.pts_exp) for x in m.modules() if isinstance(x, W4A8FP8Linear)]


@pytest.mark.parametrize("recipe,kw", [("qserve", dict(linear="w4a8-fp8", smooth=False)),
                                       ("fireq", dict(pts_scope="tensor", fuse_mlp=True)),
                                       ("fireq", dict(linear_options={"pts": False})),
                                       ("fireq", dict(pts=False, linear_options={"pts_exp": 3})),
                                       ("fireq", dict(pts=False)), ("fireq", {}),
                                       ("fireq", dict(fuse_mlp=True, linear_options={"pts_exp": 3})),
                                       ("fireq", dict(fuse_mlp=True, pts_scope="tensor", linear_options={"pts": False})),
                                       ("fireq", dict(fuse_mlp=True, pts=False, linear_options={"pts_exp": 3})),
                                       ("fireq", dict(fuse_mlp=True, pts=False, linear_options={"pts": True}))])
def test_gptq_keeps_the_recipes_pts_exponents(recipe, kw):
    """GPTQ quantizes under the exponents round to nearest would use, whatever the PTS options."""
    def run(gptq):
        m = tiny_llama()
        with torch.no_grad():  # a k_proj of small weights: its own exponent differs from q/v's
            m.model.layers[0].self_attn.k_proj.weight.mul_(1 / 64)
        return lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False, kv=None, attention=None,
                                     cas=False, gptq=gptq, **kw) if recipe == "fireq" else lowbit.quantize_model(
            m, recipe, calibration=_calib(), progress=False, kv=None, attention=None, gptq=gptq, **kw)

    assert _pts_exps(run(True)) == _pts_exps(run(False))


def test_experts_with_few_tokens_keep_round_to_nearest():
    from tests._tiny_models import tiny_variant

    m = tiny_variant("mixtral", num_local_experts=4, num_experts_per_tok=2)
    rep = lowbit.ptq.gptq.apply_gptq(m, "w4a8-int8", _calib(), progress=False)  # 96 tokens: < 128 per expert
    assert rep["experts"] == 0 and rep["experts_rtn"] > 0 and rep["linears"] == 8
    from lowbit.models.arch import decoder_layers

    assert all(getattr(v.experts, "lowbit_gptq") == {} for v in decoder_layers(m))


@pytest.mark.parametrize("recipe", ["fireq", "qserve", "flute-nf4"])
def test_group_size_none_means_the_default(recipe):
    m = lowbit.quantize_model(tiny_llama(), recipe, calibration=_calib(), progress=False, gptq=True,
                              group_size=None, kv=None, attention=None)
    assert m.lowbit_recipe["reports"]["gptq"]["linears"] == 14


@pytest.mark.parametrize("recipe,lm_head,tie", [("fireq", True, True), ("qserve", True, False),
                                                 ("flute-nf4", {"group_size": 64}, True), ("fireq", "w8", True)])
def test_gptq_lm_head(recipe, lm_head, tie):
    """``lm_head`` quantized by a GPTQ scheme: the head by GPTQ too, on the final norm's output (a tied head untied
    first: the embedding keeps its float weight); ``"w8"`` keeps round to nearest."""
    from lowbit.nn.base import QuantLinear

    m = tiny_llama(tie=tie)
    emb = m.model.embed_tokens.weight.detach().clone()
    m = lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False, gptq=True, lm_head=lm_head,
                              kv=None, attention=None)
    rep = m.lowbit_recipe["reports"]["gptq"]
    assert rep["lm_head"] == (0 if lm_head == "w8" else 1)
    assert isinstance(m.lm_head, QuantLinear) and torch.equal(m.model.embed_tokens.weight, emb)
    assert torch.isfinite(m(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_empty_gptq_dict_is_on():
    m = lowbit.quantize_model(tiny_llama(), "flute-nf4", calibration=_calib(), progress=False, gptq={})
    assert m.lowbit_recipe["reports"]["gptq"]["linears"] == 14


def test_sliding_window_layers_keep_their_own_masks():
    """Each layer is replayed with its own call arguments: a model with a full and a sliding layer gets, from GPTQ's
    layer-by-layer pass, the same layer inputs as the real forward (weights kept: damp=0 on an identity update is not
    needed; compare the captured calls instead)."""
    from lowbit.models.arch import decoder_layers
    from lowbit.ptq.gptq import _call_layer, _layer_calls
    from tests._tiny_models import tiny_variant

    m = tiny_variant("qwen2", layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                     use_sliding_window=True, max_window_layers=1)
    ids = [torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(3))]
    layers = [v.layer for v in decoder_layers(m)]
    calls = _layer_calls(m, layers, ids)
    seen = []
    hk = layers[1].register_forward_pre_hook(lambda mod, a, k: seen.append(a[0] if a else k["hidden_states"]),
                                             with_kwargs=True)
    with torch.no_grad():
        ref_out = m.model(input_ids=ids[0]).last_hidden_state
        hk.remove()
        h0 = _call_layer(layers[0], calls[0][0][0], calls[0][0])
        assert torch.allclose(h0, seen[0], atol=1e-5)
        h1 = _call_layer(layers[1], h0, calls[1][0])
    assert torch.allclose(m.model.norm(h1), ref_out, atol=1e-4)


def test_gptq_recipe_errors():
    with pytest.raises(ValueError, match="learn_scales"):
        lowbit.quantize_model(tiny_llama(), "flute-nf4", calibration=_calib(), progress=False, gptq=True,
                              learn_scales=True)
    with pytest.raises(ValueError, match="gptq must be"):
        lowbit.quantize_model(tiny_llama(), "fireq", calibration=_calib(), progress=False, gptq={"blocks": 3})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["fireq", "qserve", "flute-nf4"])
def test_recipes_with_gptq_on_gpu(name):
    """GPTQ on CUDA (float32 Hessians) on a bf16 model; the compiled kernels then run the GPTQ weights."""
    m = tiny_llama(head_dim=64, hidden=128, dtype=torch.bfloat16).cuda()
    calib = [c.cuda() for c in _calib(4, 64)]
    m = lowbit.quantize_model(m, name, calibration=calib, progress=False, gptq=True)
    rep = m.lowbit_recipe["reports"]["gptq"]
    assert rep["linears"] == 14 and rep["gptq_loss"] < rep["rtn_loss"]
    ids = torch.tensor([[1, 5, 9, 17, 33, 2, 7, 11]], device="cuda")
    with torch.no_grad():
        out = m(input_ids=ids).logits.float()
    assert torch.isfinite(out).all()
    assert greedy(m, ids, 4).shape == (1, 4)
