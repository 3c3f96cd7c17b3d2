"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE): the experts quantized as ``lowbit.nn.moe.QuantExperts`` by
every recipe, CAS over the router and all experts, checkpoints, transformers' generate and the runner."""
import copy

import pytest
import torch

import lowbit
from lowbit.models.arch import decoder_layers
from lowbit.models.generate import Generator
from lowbit.nn.moe import QuantExperts
from tests._tiny_models import greedy, tiny_variant
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)

ARCHS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,  # + a shared expert
                      shared_expert_intermediate_size=96),
}


def _moe(arch, **kw):
    return tiny_variant(arch, **ARCHS[arch], **kw)


def _calib(n=2, S=24):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (1, S), generator=g) for _ in range(n)]


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits.double()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def reference_ops(monkeypatch):
    """The plain-PyTorch numerics on the CPU (the kernels have their own tests)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_views_name_router_and_experts(arch):
    views = decoder_layers(_moe(arch))
    for v in views:
        assert v.experts is not None and v.router is not None and v.gate_proj is None
        assert list(v.linears()) == ["q_proj", "k_proj", "v_proj", "o_proj"]
        assert (v.shared_expert is not None) == (v.shared_gate is not None) == (arch == "qwen2_moe")
        assert list(v.shared_linears()) == (["shared.gate_proj", "shared.up_proj", "shared.down_proj"]
                                            if arch == "qwen2_moe" else [])
        assert v.sliding_window is None  # (Qwen2-MoE's disabled window of 0 keys is no window)


def test_other_moe_forms_are_refused_by_name():
    """A block with other parts than router, experts and Qwen2-MoE's shared expert + gate, or a shared expert of
    another form, raises naming it (quantize_model and the runner)."""
    m = _moe("qwen2_moe")
    m.model.layers[0].mlp.extra = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match="mixture-of-experts block with parts"):
        lowbit.quantize_model(m, "flute-nf4", progress=False)
    m = _moe("qwen2_moe")
    m.model.layers[1].mlp.shared_expert.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="shared expert"):
        Generator(m, max_batch=1, max_seq=8)
    m = _moe("qwen2_moe")
    m.model.layers[0].mlp.shared_expert_gate = torch.nn.Linear(64, 2, bias=False)
    with pytest.raises(ValueError, match="shared_expert_gate"):
        lowbit.quantize_model(m, "fireq", progress=False, calibration=_calib())


def test_sliding_window_reads_each_model_its_way():
    """Mistral / Mixtral window every layer from the config, whatever ``layer_types`` or ``use_sliding_window``
    say (a review found a first version missing them); Qwen2-MoE's layers without the attribute are full."""
    from lowbit.models.arch import sliding_window
    from tests._tiny_models import tiny_variant

    m = tiny_variant("mistral", sliding_window=4, layer_types=["full_attention", "full_attention"])
    assert [sliding_window(layer.self_attn) for layer in m.model.layers] == [4, 4]
    m = _moe("mixtral", sliding_window=8)
    assert [sliding_window(layer.self_attn) for layer in m.model.layers] == [8, 8]
    assert [sliding_window(layer.self_attn) for layer in _moe("qwen2_moe").model.layers] == [None, None]


def test_shared_expert_pts_and_learned_scales(reference_ops):
    """fireq: the shared expert's gate and up share one PTS exponent (one fused matrix's rule); learned NF scales
    train the shared expert's linears too (its scales move)."""
    from lowbit.ptq.pts import pts_exponent

    m = _moe("qwen2_moe")
    sh = m.model.layers[0].mlp.shared_expert
    want = pts_exponent(torch.cat([sh.gate_proj.weight, sh.up_proj.weight], 0).detach(), 128)
    lowbit.quantize_model(m, "fireq", calibration=_calib(), progress=False, cas=False)
    sh = m.model.layers[0].mlp.shared_expert
    assert sh.gate_proj.pts_exp == sh.up_proj.pts_exp == want
    m = _moe("qwen2_moe", layers=1)
    from lowbit.ptq.nfl import learn_nf_scales

    rep = learn_nf_scales(m, _calib(1, 16), group_size=32, progress=False, lr=1e-2)
    assert rep["linears"] == 4 + 3  # q/k/v/o and the shared expert's three
    assert type(m.model.layers[0].mlp.shared_expert.down_proj).__name__ == "LUTLinear"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_cas_over_router_and_experts_keeps_the_function(arch):
    m = _moe(arch)
    ids = torch.randint(0, 128, (2, 10))
    ref = _logits(m, ids)
    from lowbit.ptq.cas import apply_cas

    rep = apply_cas(m)
    assert (0, "gate_up") in rep["lambdas"] and (0, "down.3") in rep["lambdas"]
    assert ((0, "down.shared") in rep["lambdas"]) == (arch == "qwen2_moe")
    assert rep["max_ratio"] > 1.01  # it did rescale
    assert _rel(_logits(m, ids), ref) < 1e-5


@pytest.mark.parametrize("scheme,opts", [("lut", dict(bits=4, group_size=32)), ("w4a8-fp8", dict(group_size=32)),
                                         ("w4a8-int8", dict(group_size=32))])
def test_quant_experts_follow_transformers_experts(scheme, opts, reference_ops):
    """The routed sum equals transformers' own experts loop on the same (dequantized) weights for the weight-only
    format, and, for every format, the token-by-token sum of its own expert modules (routing, gather, weights and
    the expert order are right; rows do not interact)."""
    m = _moe("mixtral")
    block = m.model.layers[0].mlp
    qe = QuantExperts.from_experts(block.experts, scheme, **opts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 64, generator=g)
    _, w, idx = block.gate(x)
    with torch.no_grad():
        got = qe(x, idx, w)
        if scheme == "lut":
            ref_experts = copy.deepcopy(block.experts)
            for e in range(4):
                ref_experts.gate_up_proj[e] = qe.gate_up[e].dequantize()
                ref_experts.down_proj[e] = qe.down[e].dequantize()
            assert _rel(got.double(), ref_experts(x, idx, w).double()) < 1e-5
        rows = []
        for t in range(x.shape[0]):
            acc = torch.zeros(64)
            for j in sorted(range(idx.shape[1]), key=lambda j: int(idx[t, j])):
                e = int(idx[t, j])
                gate, up = qe.gate_up[e](x[t:t + 1]).chunk(2, dim=-1)
                acc = acc + (qe.down[e](torch.nn.functional.silu(gate) * up) * w[t, j])[0]
            rows.append(acc)
    assert _rel(got.double(), torch.stack(rows).double()) < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("scheme", ["w4a8-fp8", "lut"])
def test_quant_experts_kernels_match_reference(scheme, monkeypatch):
    """The experts through the Triton kernels (the interpreter on the CPU) == the reference path, within the
    kernel-vs-reference tolerance of two chained GEMMs (w4a8-fp8 in float32, so that the FP8 re-quantization of
    the down input sees the same values; the LUT kernel takes bf16)."""
    pytest.importorskip("triton")
    from tests.tolerances import KERNEL_VS_REF

    dtype = torch.float32 if scheme == "w4a8-fp8" else torch.bfloat16
    block = _moe("qwen3_moe").to(dtype).model.layers[0].mlp
    qe = QuantExperts.from_experts(block.experts, scheme, group_size=32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    _, w, idx = block.gate(x)
    kernels, references = _kernels_and_references(qe, x, idx, w, monkeypatch)
    assert _rel(kernels.double(), references.double()) < 2 * KERNEL_VS_REF[dtype]


def _kernels_and_references(qe, x, idx, w, monkeypatch):
    """``qe(x, idx, w)`` with the kernels under the interpreter, then with the plain-PyTorch references."""
    out = {}
    for interp in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        with torch.no_grad():
            out[interp] = qe(x, idx, w)
    return out["1"], out["0"]


@pytest.mark.parametrize("scheme", ["w4a8-fp8", "lut"])
def test_dense_and_sparse_schedules_agree_bit_for_bit(scheme, monkeypatch, reference_ops):
    """Decode-sized calls (dense: every expert over every token, kept where routed; no host read) give the sparse
    schedule's output: exactly with the W4A8 reference (float64, rows independent), to float rounding with the LUT
    reference (a float32 matmul whose blocking follows the row count); an unrouted expert's Inf never leaks in."""
    import lowbit.nn.moe as M

    block = _moe("mixtral").model.layers[0].mlp
    qe = QuantExperts.from_experts(block.experts, scheme, group_size=32)
    qe.grouped = False  # the per-expert schedules (the grouped one: tests/test_moe_grouped.py)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
    _, w, idx = block.gate(x)
    with torch.no_grad():
        with M.dense_schedule():
            dense = qe(x, idx, w)
        sparse = qe(x, idx, w)  # eager: sparse
    same = torch.equal if scheme == "w4a8-fp8" else (lambda a, b: _rel(a.double(), b.double()) < 1e-6)
    assert same(dense, sparse)
    # expert 3 chosen by no token, its output made infinite: it must not leak into the dense sum
    g = torch.Generator().manual_seed(6)
    idx3 = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(9)])
    with torch.no_grad(), M.dense_schedule():
        ref = qe(x, idx3, w)
        qe.down[3].forward = lambda h, *a, **k: torch.full((h.shape[0], 64), float("inf"))
        assert torch.isfinite(ref).all() and torch.equal(qe(x, idx3, w), ref)


def test_dense_schedule_is_per_thread():
    import threading

    import lowbit.nn.moe as M

    x = torch.zeros(2, 4)
    seen = []
    with M.dense_schedule():
        t = threading.Thread(target=lambda: seen.append(M._dense_wanted(x)))
        t.start()
        t.join()
        assert M._dense_wanted(x)
    assert seen == [False] and not M._dense_wanted(x)


def test_quant_experts_bad_input():
    qe = QuantExperts.from_experts(_moe("mixtral").model.layers[0].mlp.experts, "lut", bits=4, group_size=32)
    x = torch.randn(3, 64)
    w = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="hidden_states"):
        qe(x[None], torch.zeros(3, 2, dtype=torch.long), w)
    with pytest.raises(ValueError, match="top_k_index"):
        qe(x, torch.zeros(2, 2, dtype=torch.long), w)
    with pytest.raises(ValueError, match="num_experts"):
        qe(x, torch.full((3, 2), 7, dtype=torch.long), w)  # sparse (eager)
    sentinel = torch.tensor([[0, 4], [4, 4], [1, 2]])  # 4 = num_experts: transformers' "no expert", skipped
    kept = torch.tensor([[0, 0], [0, 0], [1, 2]])
    w2 = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    with torch.no_grad():
        ref = qe(x, kept, w2 * torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]))
        assert _rel(qe(x, sentinel, w2).double(), ref.double()) < 1e-6  # (the LUT reference's matmul blocking)
        with __import__("lowbit.nn.moe").nn.moe.dense_schedule():
            assert _rel(qe(x, sentinel, w2).double(), ref.double()) < 1e-6
    from lowbit.nn.moe import dense_schedule

    with pytest.raises(ValueError, match="num_experts"), dense_schedule():
        qe(x, torch.full((3, 2), 7, dtype=torch.long), w)  # dense: range-checked on the CPU
    with pytest.raises(ValueError, match="num_experts"):
        qe(torch.randn(70, 64), torch.full((70, 2), -1, dtype=torch.long), torch.full((70, 2), 0.5))  # sparse
    assert torch.equal(qe(x[:0], torch.zeros(0, 2, dtype=torch.long), w[:0]), x[:0])
    with pytest.raises(ValueError, match="num_experts"):
        QuantExperts(0)
    with pytest.raises(ValueError, match="3-D gate_up_proj"):
        QuantExperts.from_experts(torch.nn.Linear(4, 4), "lut")


@pytest.mark.parametrize("arch,recipe", [("mixtral", "fireq"), ("mixtral", "qserve"), ("mixtral", "flute-nf4"),
                                         ("qwen3_moe", "fireq"), ("qwen3_moe", "flute-nf3"), ("qwen2_moe", "fireq"),
                                         ("qwen2_moe", "qserve"), ("qwen2_moe", "flute-nf4")])
def test_recipes_quantize_experts_and_generate(arch, recipe, reference_ops):
    """Every recipe quantizes each expert (router float); transformers' generate runs, the runner (no CUDA graphs
    for MoE) gives its greedy tokens, and the quantized logits stay near the float model's."""
    m = _moe(arch)
    h = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))

    def block(layer):  # the MoE block with its norm (where CAS folds Lambda^-1), on the same residual stream
        with torch.no_grad():
            return layer.mlp(layer.post_attention_layernorm(h)).double()

    ref = block(m.model.layers[0])
    lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False)
    for layer in m.model.layers:
        assert isinstance(layer.mlp.experts, QuantExperts) and isinstance(layer.mlp.gate.weight, torch.nn.Parameter)
        if arch == "qwen2_moe":  # the shared expert's linears quantized, its gate float
            assert all(type(getattr(layer.mlp.shared_expert, r)).__name__ != "Linear"
                       for r in ("gate_proj", "up_proj", "down_proj"))
            assert type(layer.mlp.shared_expert_gate) is torch.nn.Linear
    # 4-bit formats on random N(0, 0.2) weights (a token whose top-2 flips adds more): measured 0.16-0.20 (NF3 0.36)
    assert _rel(block(m.model.layers[0]), ref) < (0.45 if recipe == "flute-nf3" else 0.3)
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 8, 8, 6, 1])]
    gen = Generator(m, max_batch=2, max_seq=16, prefill_from_cache=True)
    assert not gen.cuda_graphs  # on the CPU
    got = gen.generate(prompts, 4)
    for p, t in zip(prompts, got):
        assert torch.equal(t, greedy(m, p.unsqueeze(0), 4)[0])


def test_learned_nf_leaves_no_float_expert(reference_ops):
    m = _moe("mixtral", layers=1)
    lowbit.quantize_model(m, "flute-nf4", calibration=_calib(1, 16), learn_scales=True, progress=False)
    assert isinstance(m.model.layers[0].mlp.experts, QuantExperts)


@pytest.mark.parametrize("arch,recipe", [("mixtral", "fireq"), ("qwen3_moe", "flute-nf4"), ("qwen2_moe", "qserve")])
def test_moe_checkpoint_round_trip(arch, recipe, tmp_path, reference_ops):
    from lowbit.models.checkpoint import load_quantized, read_metadata, save_quantized

    m = _moe(arch)
    lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False)
    ids = torch.randint(0, 128, (1, 9))
    ref = _logits(m, ids)
    save_quantized(m, tmp_path / "moe")
    meta = read_metadata(tmp_path / "moe")
    assert meta["containers"]["model.layers.0.mlp.experts"]["config"] == {"num_experts": 4, "act": "silu"}
    m2 = load_quantized(tmp_path / "moe")
    assert isinstance(m2.model.layers[1].mlp.experts, QuantExperts)
    assert torch.equal(_logits(m2, ids), ref)


def test_moe_refusals(tmp_path):
    m = _moe("mixtral")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        lowbit.quantize_model(copy.deepcopy(m), "fireq", fuse_mlp=True, progress=False, calibration=_calib())
    with pytest.raises(ValueError, match="cuda_graphs=True"):  # float experts, transformers' eager loop: host routing
        Generator(m, max_batch=1, max_seq=8, cuda_graphs=True)
    for layer in m.model.layers:  # transformers' grouped_mm experts (bf16) read no routing on the host: capturable
        layer.mlp.experts.config._experts_implementation = "grouped_mm"
    with pytest.raises(ValueError, match="cuda_graphs=True"):  # float32: PyTorch's fallback reads offsets on the host
        Generator(m, max_batch=1, max_seq=8, cuda_graphs=True)
    Generator(copy.deepcopy(m).to(torch.bfloat16), max_batch=1, max_seq=8, cuda_graphs=True)
    for layer in m.model.layers:
        layer.mlp.experts.config._experts_implementation = "eager"
    lowbit.quantize_model(m, "flute-nf4", progress=False)
    Generator(m, max_batch=64, max_seq=8, cuda_graphs=True)  # lowbit's experts, dense decode: capturable
    import lowbit.nn.moe as M

    assert Generator(m, max_batch=4, max_seq=8).cuda_graphs is False  # (on the CPU: never by default)
    with pytest.MonkeyPatch.context() as mp:  # more experts than the default-capture bound: only when asked
        mp.setattr(M, "DENSE_GRAPH_MAX_EXPERTS", 2)
        Generator(m, max_batch=4, max_seq=8, cuda_graphs=True)
    with pytest.raises(ValueError, match="DENSE_MAX_TOKENS"):
        Generator(m, max_batch=65, max_seq=8, cuda_graphs=True)
    from lowbit.models.export import export_compressed_tensors

    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        export_compressed_tensors(m, tmp_path / "ct")


def test_experts_stay_float_when_an_mlp_role_is_skipped(reference_ops):
    m = _moe("qwen3_moe")
    lowbit.quantize_model(m, "qserve", skip=("down_proj",), progress=False, calibration=_calib())
    assert not isinstance(m.model.layers[0].mlp.experts, QuantExperts)
    assert type(m.model.layers[0].self_attn.q_proj).__name__ != "Linear"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch,recipe", [("mixtral", "fireq"), ("mixtral", "flute-nf4"), ("qwen3_moe", "qserve")])
def test_moe_recipes_on_gpu(arch, recipe):
    """The experts through the GPU kernels: transformers' greedy tokens and the runner's agree on the first token
    (the prefill's), the block stays near its float self, and a drop of the model frees its memory."""
    m = _moe(arch, head_dim=64, hidden=256, heads=4, kv_heads=2, init_std=0.05).to("cuda", torch.bfloat16)
    h = torch.randn(2, 12, 256, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)

    def block(layer):
        with torch.no_grad():
            return layer.mlp(layer.post_attention_layernorm(h)).double()

    ref = block(m.model.layers[0])
    lowbit.quantize_model(m, recipe, calibration=[c.cuda() for c in _calib(2, 32)], progress=False)
    assert isinstance(m.model.layers[0].mlp.experts, QuantExperts)
    assert _rel(block(m.model.layers[0]), ref) < 0.3
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).cuda() for n in (7, 12)]
    from lowbit.nn.moe import dense_schedule

    graphed = Generator(m, max_batch=2, max_seq=32, prefill_from_cache=True)
    assert graphed.cuda_graphs  # lowbit's experts decode in their dense schedule: captured
    with dense_schedule():  # the prefill too (eager), so that the eager run below has the same schedule throughout
        got = graphed.generate(prompts, 4)
        eager = Generator(m, max_batch=2, max_seq=32, prefill_from_cache=True, cuda_graphs=False).generate(prompts, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, eager))
    for p, t in zip(prompts, got):
        assert t[0] == greedy(m, p.unsqueeze(0), 1)[0, 0]
