"""Recipes over random tiny Llama shapes (head_dim 16-64, MHA / GQA / MQA, FFN widths that are no multiple of any
group or block, 1-2 layers, odd vocabularies): ``quantize_model`` either works (finite logits near the float model's,
the fast runner generates, a saved checkpoint loads to the same logits) or raises ``NotImplementedError`` / ``ValueError`` naming what it cannot do. CPU
reference ops (the kernels have their own tests)."""
import os
import tempfile

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import lowbit
from lowbit.models.generate import generate

ALL = ["fireq", "qserve", "flute-nf4", "flute-nf3", "int8-attention"]


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@settings(max_examples=4, deadline=None)
@given(recipe=st.sampled_from(ALL), head_dim=st.sampled_from((16, 32, 64)), heads=st.sampled_from((1, 2, 4)),
       kv_div=st.sampled_from((1, 2, 4)), inter=st.integers(24, 200), layers=st.integers(1, 2),
       vocab=st.sampled_from((64, 131)), seed=st.integers(0, 9))
def test_recipe_on_random_tiny_llama(recipe, head_dim, heads, kv_div, inter, layers, vocab, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    kv = heads // kv_div if heads % kv_div == 0 else heads
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                      max_position_embeddings=256, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (1, 11), generator=g)
    with torch.no_grad():
        ref = m(prompt).logits.float()
    calib = [torch.randint(0, vocab, (1, 24), generator=g) for _ in range(2)]
    try:
        q = lowbit.quantize_model(m, recipe, calibration=calib, progress=False)
    except (NotImplementedError, ValueError) as exc:
        event(f"{recipe}: {type(exc).__name__}")
        assert any(w in str(exc) for w in ("head_dim", "hidden", "heads", "intermediate", "in_features", "dim",
                                           "group", "rope", "RoPE", "not supported", "must")), str(exc)
        return
    event(f"{recipe}: quantized")
    with torch.no_grad():
        out = q(prompt).logits.float()
    assert out.shape == ref.shape and torch.isfinite(out).all()
    # a smoke bound, not a quality one: on these random models (weights N(0, 0.2), no structure for the PTQ to use)
    # the logits' cosine to the float model's measured 0.83-0.95 for the 4-bit recipes and 0.49-0.75 for 3-bit
    # `flute-nf3` (session 33); a broken layout or scale gives ~0
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert cos > 0.3, float(cos)
    toks = generate(q, [prompt[0], prompt[0, :4]], 3)
    assert [t.numel() for t in toks] == [3, 3]
    with tempfile.TemporaryDirectory() as d:  # the checkpoint gives the same logits, bit for bit
        lowbit.save_quantized(q, os.path.join(d, "ck"))
        loaded = lowbit.load_quantized(os.path.join(d, "ck"))
        with torch.no_grad():
            assert torch.equal(loaded(prompt).logits.float(), out)


@settings(max_examples=4, deadline=None)
@given(recipe=st.sampled_from(ALL), arch=st.sampled_from(("mixtral", "qwen3_moe", "qwen2_moe")), experts=st.integers(2, 6),
       top_k=st.integers(1, 3), inter=st.integers(24, 100), hidden=st.sampled_from((32, 64)), dense_first=st.booleans(),
       tokens=st.integers(1, 12), seed=st.integers(0, 9))
def test_recipe_on_random_tiny_moe(recipe, arch, experts, top_k, inter, hidden, dense_first, tokens, seed):
    """Mixture-of-experts variants (session 38; Qwen2-MoE's shared expert since session 39): random expert counts,
    top-k, expert widths that are no multiple of any group, a dense first layer (``mlp_only_layers``); the quantized model stays finite and near the
    float one, generates, its checkpoint loads to the same logits, and the experts' two schedules agree."""
    import lowbit.nn.moe as M
    from tests._tiny_models import eager_experts, tiny_variant

    top_k = min(top_k, experts)
    kw = (dict(num_local_experts=experts, num_experts_per_tok=top_k) if arch == "mixtral" else
          dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=True,
               mlp_only_layers=[0] if dense_first else []))
    if arch == "qwen2_moe":  # + a shared expert of another width (session 39)
        kw.update(shared_expert_intermediate_size=inter + 8, norm_topk_prob=False)
    # (Mixtral's expert width is the config's intermediate size; Qwen3-MoE's is moe_intermediate_size, its
    # intermediate size the dense layers')
    m = tiny_variant(arch, hidden=hidden, head_dim=16, heads=hidden // 16, kv_heads=1, seed=seed, intermediate=inter,
                     **kw)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 128, (1, tokens), generator=g)
    with torch.no_grad():
        ref = m(prompt).logits.float()
    calib = [torch.randint(0, 128, (1, 24), generator=g) for _ in range(2)]
    q = lowbit.quantize_model(m, recipe, calibration=calib, progress=False)
    event(f"{arch} {recipe}: quantized")
    with torch.no_grad():
        out = q(prompt).logits.float()
        with M.dense_schedule():
            dense = q(prompt).logits.float()
    assert torch.isfinite(out).all()
    assert (dense - out).norm() <= 1e-4 * out.norm()  # the schedules agree (to the LUT matmul's float rounding)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert cos > 0.3, float(cos)
    assert [t.numel() for t in generate(q, [prompt[0]], 2)] == [2]
    with tempfile.TemporaryDirectory() as d:
        lowbit.save_quantized(q, os.path.join(d, "ck"))
        with torch.no_grad():
            assert torch.equal(eager_experts(lowbit.load_quantized(os.path.join(d, "ck")))(prompt).logits.float(), out)


@settings(max_examples=3, deadline=None)
@given(heads=st.sampled_from((1, 2, 4)), rank=st.sampled_from((16, 32, 48, 64)), rope=st.sampled_from((8, 16, 32)),
       nope=st.sampled_from((8, 16, 32)), vdim=st.sampled_from((8, 16, 24)), q_lora=st.sampled_from((None, 24)),
       seed=st.integers(0, 9))
def test_fp8_mla_on_random_tiny_deepseek(heads, rank, rope, nope, vdim, q_lora, seed):
    """``fp8-mla`` over random DeepSeek-V3-shaped tiny configs (latent and RoPE widths that are and are not powers of
    two, with and without a q LoRA): the quantized model's logits stay finite and near the float model's, greedy
    generation runs, and the checkpoint reloads to the same logits."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                           kv_lora_rank=rank, q_lora_rank=q_lora, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
                           v_head_dim=vdim, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
                           max_position_embeddings=128)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.eos_token_id = None
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = m(prompt).logits.float()
    try:
        lowbit.quantize_model(m, "fp8-mla")
    except (NotImplementedError, ValueError) as exc:
        event(f"fp8-mla: {type(exc).__name__}")
        assert any(w in str(exc) for w in ("rank", "rope", "head", "dim", "not supported", "must")), str(exc)
        return
    event("fp8-mla: quantized")
    with torch.no_grad():
        out = m(prompt).logits.float()
    assert torch.isfinite(out).all()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert cos > 0.9, float(cos)  # FP8 latent, bf16 RoPE part: close to the float model
    assert m.generate(prompt, max_new_tokens=3, do_sample=False).shape[1] == 12
    with tempfile.TemporaryDirectory() as d:
        lowbit.save_quantized(m, os.path.join(d, "ck"))
        loaded = lowbit.load_quantized(os.path.join(d, "ck"))
        with torch.no_grad():
            assert torch.equal(loaded(prompt).logits.float(), out)
