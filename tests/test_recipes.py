"""Recipes end to end on a tiny random Llama (CPU): quantize, generate (transformers and the fast
runner), save -> load -> the same greedy tokens; option handling and clear errors.

The kernels run their plain-PyTorch references here (TRITON_INTERPRET=0 for these tests): the
kernels' own tests cover kernel-vs-reference under the interpreter; this file covers the wiring.
"""
import sys

import pytest
import torch

import lowbit
from lowbit.models import recipes
from lowbit.models.generate import generate
from tests._tiny_models import greedy, tiny_llama

ALL = ["fireq", "qserve", "flute-nf4", "flute-nf3", "int8-attention"]


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _calib(n=2, s=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, s), generator=g) for _ in range(n)]


def _quantize(name, head_dim=16, **opts):
    m = tiny_llama(head_dim=head_dim)
    try:
        return lowbit.quantize_model(m, name, calibration=_calib(), progress=False, **opts)
    except NotImplementedError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name,head_dim", [(n, 16) for n in ALL] + [("fireq", 32)])
def test_recipe_generates_and_roundtrips(name, head_dim, tmp_path):
    from lowbit.nn.base import QuantLinear

    m = _quantize(name, head_dim)
    info = m.lowbit_recipe
    assert info["recipe"] == name
    n_q = sum(isinstance(x, QuantLinear) for x in m.modules())
    # 7 linears x 2 layers (the flute recipes: gate / up fused into one by default: 6); lm_head stays float
    assert n_q == (0 if name == "int8-attention" else 12 if name.startswith("flute") else 14)
    if name.startswith("flute"):
        assert info["reports"]["fused_mlp_layers"] == 2
    assert isinstance(m.lm_head, torch.nn.Linear) and isinstance(m.model.embed_tokens, torch.nn.Embedding)
    prompt = torch.tensor([[1, 5, 9, 17, 33, 2]])
    ref = greedy(m, prompt, 5)
    # the fast runner, prefill from the cache = the HF path's semantics, two requests of different lengths
    fast = generate(m, [prompt[0], prompt[0, :3]], 5, prefill_from_cache=True)
    assert fast[0].numel() == 5 and fast[1].numel() == 5
    if name in ("qserve", "flute-nf4", "flute-nf3"):
        assert torch.equal(fast[0], ref[0])
    lowbit.save_quantized(m, tmp_path / "ck")
    loaded = lowbit.load_quantized(tmp_path / "ck")
    assert torch.equal(greedy(loaded, prompt, 5), ref)  # acceptance: same greedy tokens
    assert loaded.lowbit_recipe["recipe"] == name


def test_fireq_is_deterministic_and_ablations_are_one_call():
    a = _quantize("fireq", seed=3)
    b = _quantize("fireq", seed=3)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb), na
    for opts in (dict(cas=False), dict(pts=False), dict(rpn=False), dict(crs=False), dict(kv=None, attention=None),
                 dict(linear=None)):
        m = _quantize("fireq", **opts)
        assert m.lowbit_recipe["options"] | {k: v for k, v in opts.items()} == m.lowbit_recipe["options"]
        greedy(m, torch.tensor([[3, 4, 5]]), 2)


def test_fireq_rope_kv_saved(tmp_path):
    m = _quantize("fireq")
    params = m.lowbit_recipe["rope_kv"]
    assert params is not None and len(params) == 2
    lowbit.save_quantized(m, tmp_path / "f")
    loaded = lowbit.load_quantized(tmp_path / "f")
    p0, q0 = params[0], loaded.lowbit_recipe["rope_kv"][0]
    assert torch.equal(p0.crs_k, q0.crs_k) and q0.rpn_applied


def test_flute_with_kv4_gets_rpn_crs_and_roundtrips(tmp_path):
    """flute-nf4 with kv="kv4": FireQ's RPN + CRS are calibrated for the INT4 cache (on by default, off with
    rpn=False, crs=False), saved with the checkpoint, and the loaded model gives the same greedy tokens."""
    m = _quantize("flute-nf4", kv="kv4")
    params = m.lowbit_recipe["rope_kv"]
    assert params is not None and len(params) == 2 and params[0].rpn_applied
    assert m.lowbit_recipe["kv"] == "kv4" and m.lowbit_recipe["options"]["rpn"] is True
    prompt = torch.tensor([[2, 7, 1, 8, 2, 8]])
    ref = greedy(m, prompt, 4)
    lowbit.save_quantized(m, tmp_path / "fk")
    loaded = lowbit.load_quantized(tmp_path / "fk")
    assert torch.equal(loaded.lowbit_recipe["rope_kv"][0].crs_k, params[0].crs_k)
    assert torch.equal(greedy(loaded, prompt, 4), ref)
    assert _quantize("flute-nf4", kv="kv4", rpn=False, crs=False).lowbit_recipe["rope_kv"] is None
    assert _quantize("flute-nf4").lowbit_recipe["rope_kv"] is None  # weight-only: float cache, nothing calibrated


def test_fireq_fused_mlp_roundtrip(tmp_path):
    m = _quantize("fireq", head_dim=32, fuse_mlp=True)
    assert type(m.model.layers[0].mlp).__name__ == "W4A8FP8MLP"
    prompt = torch.tensor([[7, 8, 9, 10]])
    ref = greedy(m, prompt, 4)
    lowbit.save_quantized(m, tmp_path / "fz")
    assert torch.equal(greedy(lowbit.load_quantized(tmp_path / "fz"), prompt, 4), ref)


def test_linear_override_and_skip():
    from lowbit.nn.base import QuantLinear

    m = _quantize("flute-nf4", skip=("down_proj",), linear_options={"table": "nf"})
    assert not isinstance(m.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(m.model.layers[0].mlp.gate_up, QuantLinear)  # (fused by default)
    m = _quantize("int8-attention", linear="lut")
    assert isinstance(m.model.layers[1].self_attn.o_proj, QuantLinear)


def test_errors():
    m = tiny_llama()
    with pytest.raises(ValueError, match="unknown linear scheme"):
        lowbit.quantize_model(m, "fireq", linear="w3a3", calibration=_calib())
    with pytest.raises(ValueError, match="kv must be"):
        lowbit.quantize_model(m, "qserve", kv="kv2", calibration=_calib())
    with pytest.raises(ValueError, match="unknown attention"):
        lowbit.quantize_model(m, "fireq", attention="fp4", calibration=_calib())
    with pytest.raises(TypeError, match="calibration"):
        lowbit.quantize_model(m, "fireq", calibration=3.5)
    with pytest.raises(ValueError, match="outside"):
        lowbit.quantize_model(m, "fireq", calibration=[torch.tensor([1, 2, 999])])
    with pytest.raises(ValueError, match="tokenizer"):
        lowbit.quantize_model(m, "fireq", calibration=None)  # random model: no tokenizer to find
    with pytest.raises(ValueError, match="DeepSeek"):
        lowbit.quantize_model(m, "fp8-mla")
    with pytest.raises(TypeError):
        lowbit.quantize_model(m, "fireq", no_such_option=1)
    q = _quantize("flute-nf4")
    with pytest.raises(ValueError, match="already quantized"):
        lowbit.quantize_model(q, "fireq", calibration=_calib())


def test_missing_piece_names_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "lowbit.ptq.cas", None)  # as if the file were not written yet
    with pytest.raises(NotImplementedError, match=r"recipe fireq needs lowbit\.ptq\.cas, not available yet"):
        lowbit.quantize_model(tiny_llama(), "fireq", calibration=_calib())
    # the rest works without it
    lowbit.quantize_model(tiny_llama(), "fireq", cas=False, calibration=_calib(), progress=False)


def test_calibration_from_text_file(tmp_path):
    tok_text = tmp_path / "calib.txt"
    tok_text.write_text("hello world " * 200)

    class Tok:  # minimal tokenizer: bytes mod vocab
        def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
            return {"input_ids": torch.tensor([[b % 128 for b in text.encode()]])}

    m = tiny_llama()
    b = recipes.calibration_batches(m, str(tok_text), tokenizer=Tok(), n_samples=3, seq_len=16, seed=1)
    assert len(b) == 3 and all(x.shape == (1, 16) for x in b)
    b2 = recipes.calibration_batches(m, str(tok_text), tokenizer=Tok(), n_samples=3, seq_len=16, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(b, b2))


def test_fp8_mla_deepseek_roundtrip(tmp_path):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                           q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
                           max_position_embeddings=128)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.eos_token_id = None
    try:
        lowbit.quantize_model(m, "fp8-mla")
    except NotImplementedError as exc:
        pytest.skip(str(exc))
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    ref = greedy(m, prompt, 4)
    lowbit.save_quantized(m, tmp_path / "mla")
    assert torch.equal(greedy(lowbit.load_quantized(tmp_path / "mla"), prompt, 4), ref)


def test_w8_linears_in_grouped_recipes_and_views_of_fused_mlps():
    """``linear="w8"`` (no weight groups) with a recipe's default group size quantizes instead of raising a
    TypeError; ``decoder_layers`` reads a model whose MLPs flute fused (no gate / up of their own), so removing the
    quantized attention after ``flute-nf4`` with an INT4 cache works (two review findings of session 39)."""
    from lowbit.models.arch import decoder_layers
    from lowbit.models.hf_attention import uninstall_quantized_attention

    m = _quantize("int8-attention", linear="w8")
    assert type(m.model.layers[0].self_attn.q_proj).__name__ == "W8Linear"
    m = _quantize("flute-nf4", kv="kv4")
    views = decoder_layers(m)
    assert views[0].gate_proj is None and views[0].up_proj is None and views[0].down_proj is not None
    uninstall_quantized_attention(m)
