"""Runner fusions (RMSNorm / SiLU*mul fused into the activation quantization, residual epilogues),
``lm_head=True`` recipes, and ``install_quantized_attention`` on already-quantized projections."""
import pytest
import torch

import lowbit
from lowbit.models.generate import Generator, _quant_rows
from tests._tiny_models import greedy, tiny_llama


def _calib(n=2, seq=16, vocab=128):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, seq), generator=g) for _ in range(n)]


@pytest.fixture
def reference_kernels(monkeypatch):
    """The GEMM / cache kernels are checked in their areas' tests; here the references run
    (the interpreter would take minutes per generate)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # kernel modules were imported by conftest


@pytest.mark.interpreter  # CPU tensors to the act-quant kernel (setting TRITON_INTERPRET here is too late)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("fuse", ["rmsnorm", "silu_mul", None])
def test_quant_rows_kernel_matches_eager_modules(fmt, fuse, monkeypatch):
    """The fused act-quant launch (Triton, interpreter on CPU) == eager module + reference quant."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = (torch.randn(5, 48) * 3).half()  # fp16: the interpreter truncates fp32->bf16 (its known bug)
    up = torch.randn(5, 96).half()[:, 48:]  # a strided view, as the runner passes
    norm = LlamaRMSNorm(48, eps=1e-5).half()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    kw = {"norm": norm} if fuse == "rmsnorm" else {"up": up} if fuse == "silu_mul" else {}
    q, s = _quant_rows(x, fmt, **kw)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q_ref, s_ref = _quant_rows(x, fmt, **kw)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("recipe", ["fireq", "qserve"])
def test_fused_plan_and_tokens(recipe, reference_kernels):
    model = tiny_llama(head_dim=16)
    lowbit.quantize_model(model, recipe, calibration=_calib(), progress=False)
    gen = Generator(model, max_batch=2, max_seq=16, prefill_from_cache=True)
    fmt = "fp8" if recipe == "fireq" else "int8"
    for f in gen.fused:  # norm -> quant shared by q/k/v and gate/up; SiLU*mul -> quant of down's input
        assert (f.norm_q, f.post_q, f.down_q) == (fmt, fmt, fmt)
    assert gen.head_q is None  # lm_head float by default
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2])]
    fused = gen.generate(prompts, 4)
    plain = Generator(model, max_batch=2, max_seq=16, prefill_from_cache=True, fuse=False).generate(prompts, 4)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert torch.equal(fused[0], greedy(model, prompts[0].unsqueeze(0), 4)[0])


def test_fuse_mlp_epilogue_path(reference_kernels):
    """fireq(fuse_mlp=True): gate_up with the SiLU*mul epilogue is used as is (no split)."""
    model = tiny_llama(head_dim=16)
    lowbit.quantize_model(model, "fireq", calibration=_calib(), progress=False, fuse_mlp=True, kv=None,
                          attention=None)
    gen = Generator(model, max_batch=1, max_seq=16)
    assert all(f.gate_up_p is not None and f.gate_up_p.silu_mul and f.post_q == "fp8" for f in gen.fused)
    p = torch.tensor([7, 3, 9])
    assert torch.equal(gen.generate([p], 4)[0], greedy(model, p.unsqueeze(0), 4)[0])


@pytest.mark.parametrize("tie", [True, False])
def test_lm_head_option_roundtrip(tie, tmp_path, reference_kernels):
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    model = tiny_llama(head_dim=16, tie=tie)
    emb = model.get_input_embeddings().weight.detach().clone()
    lowbit.quantize_model(model, "fireq", calibration=_calib(), progress=False, lm_head=True, kv=None,
                          attention=None)
    assert isinstance(model.lm_head, W4A8FP8Linear)
    assert torch.equal(model.get_input_embeddings().weight, emb)  # the embedding stays float
    assert model.config.tie_word_embeddings is False
    assert model.lowbit_recipe["options"]["lm_head"] is True
    p = torch.tensor([5, 6, 7, 8])
    ref = greedy(model, p.unsqueeze(0), 5)[0]
    gen = Generator(model, max_batch=1, max_seq=16)
    assert gen.head_q == "fp8"
    assert torch.equal(gen.generate([p], 5)[0], ref)
    lowbit.save_quantized(model, tmp_path / "q")
    m2 = lowbit.load_quantized(tmp_path / "q")
    assert isinstance(m2.lm_head, W4A8FP8Linear)
    assert torch.equal(greedy(m2, p.unsqueeze(0), 5)[0], ref)


def test_lm_head_qserve(reference_kernels):
    from lowbit.nn.w4a8_int8 import W4A8INT8Linear

    model = tiny_llama(head_dim=16)
    lowbit.quantize_model(model, "qserve", calibration=_calib(), progress=False, lm_head=True, kv=None,
                          smooth=False)
    assert isinstance(model.lm_head, W4A8INT8Linear)
    assert Generator(model, max_batch=1, max_seq=8).head_q == "int8"


@pytest.mark.parametrize("recipe", ["flute-nf4", "flute-nf3"])
def test_lm_head_flute(recipe, tmp_path):
    """``lm_head=True`` in the lut recipes: the head is a LUTLinear (kernel under the interpreter),
    the runner and the saved -> loaded model give the in-memory model's greedy tokens."""
    from lowbit.nn.lut import LUTLinear

    model = tiny_llama(head_dim=16, tie=True)
    lowbit.quantize_model(model, recipe, progress=False, lm_head=True)
    assert isinstance(model.lm_head, LUTLinear) and model.config.tie_word_embeddings is False
    assert model.lowbit_recipe["options"]["lm_head"] is True
    p = torch.tensor([5, 6, 7, 8])
    ref = greedy(model, p.unsqueeze(0), 4)[0]
    assert torch.equal(Generator(model, max_batch=1, max_seq=12).generate([p], 4)[0], ref)
    lowbit.save_quantized(model, tmp_path / "q")
    m2 = lowbit.load_quantized(tmp_path / "q")
    assert isinstance(m2.lm_head, LUTLinear)
    assert torch.equal(greedy(m2, p.unsqueeze(0), 4)[0], ref)


def test_install_attention_after_linears_quantized(reference_kernels):
    """install_quantized_attention reads no float weight: it works once q/k/v are QuantLinears
    (CRS only), and RPN (which must fold into float weights) fails with a clear error."""
    from lowbit.models.hf_attention import install_quantized_attention
    from lowbit.ptq.rope_kv import RopeKVParams

    model = tiny_llama(head_dim=16)
    lowbit.quantize_model(model, "fireq", calibration=_calib(), progress=False, kv=None, attention=None,
                          cas=False)
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    crs = torch.ones(hkv, d)
    crs[:, 0] = crs[:, d // 2] = 0.5
    params = [RopeKVParams(i, cfg.num_attention_heads, hkv, d, "half", crs_k=crs) for i in range(cfg.num_hidden_layers)]
    install_quantized_attention(model, kv="kv4", prefill="sdpa", rope_kv=params)
    assert torch.equal(model.model.layers[0].self_attn._lowbit.crs_k, crs)
    p = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        out = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)
    rpn = [RopeKVParams(i, cfg.num_attention_heads, hkv, d, "half", rpn=torch.ones(hkv, d))
           for i in range(cfg.num_hidden_layers)]
    m2 = tiny_llama(head_dim=16)
    lowbit.quantize_model(m2, "fireq", calibration=_calib(), progress=False, kv=None, attention=None, cas=False)
    with pytest.raises(TypeError, match="apply RPN before quantizing"):
        install_quantized_attention(m2, kv="kv4", rope_kv=rpn)


def test_lm_head_options_dict_and_errors(reference_kernels):
    model = tiny_llama(head_dim=16)
    lowbit.quantize_model(model, "fireq", calibration=_calib(), progress=False, kv=None, attention=None,
                          lm_head={"group_size": 32})
    assert model.lm_head.group_size == 32 and model.model.layers[0].mlp.down_proj.group_size == 128
    with pytest.raises(ValueError, match="lm_head must be"):  # a string names a linear scheme ("w8")
        lowbit.quantize_model(tiny_llama(head_dim=16), "fireq", calibration=_calib(), progress=False, kv=None,
                              attention=None, lm_head="yes")
    with pytest.raises(TypeError, match="lm_head must be"):
        lowbit.quantize_model(tiny_llama(head_dim=16), "fireq", calibration=_calib(), progress=False, kv=None,
                              attention=None, lm_head=3)
