"""lowbit.models.hf_attention: transformers' model(...) / generate(...) on the paged KV4 cache."""
import pytest
import torch

from lowbit.models.hf_attention import install_quantized_attention, lowbit_cache_class, uninstall_quantized_attention
from tests.test_rope_kv import batches, tiny_llama
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)


@pytest.fixture
def reference_ops(monkeypatch):
    """Kernels are checked in test_kv4_kernels; the integration tests use the references on CPU
    (the interpreter would take minutes per generate)."""
    if not GPU:
        import lowbit.ops.kv4 as ops

        monkeypatch.setattr(ops, "use_triton", lambda *t: False)


def _gen(m, ids, n=6, **kw):
    with torch.no_grad():
        return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, **kw)


def test_kv_none_matches_unquantized_exactly(reference_ops):
    m = tiny_llama(outlier=False)
    ids = torch.randint(0, 96, (2, 10))
    ref = _gen(m, ids)
    with torch.no_grad():
        lref = m(ids).logits
    install_quantized_attention(m, kv=None, prefill="sdpa")
    assert torch.equal(_gen(m, ids), ref)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, lref)
    install_quantized_attention(m, kv="bf16")  # unquantized paged cache: same greedy tokens
    assert torch.equal(_gen(m, ids), ref)
    uninstall_quantized_attention(m)
    assert torch.equal(_gen(m, ids), ref)


@pytest.mark.parametrize("kv", ("kv4", "kv4-zp"))
def test_generate_uses_paged_cache_and_matches_fake_quant_forward(reference_ops, kv):
    """generate() builds a LowbitKVCache; each decode step's logits equal those of one full forward
    over the same tokens with the same KV4 numerics (fake quantization)."""
    m = tiny_llama()
    p = None
    if kv == "kv4":
        from lowbit.ptq.rope_kv import calibrate_rpn_crs

        p = calibrate_rpn_crs(m, batches(), top_k=2)
    install_quantized_attention(m, kv=kv, rope_kv=p)
    ids = torch.randint(0, 96, (2, 9))
    seen = []
    orig = m._prepare_cache_for_generation

    def spy(*a, **k):
        r = orig(*a, **k)
        seen.append(a[1].get("cache", a[1].get("past_key_values")))  # 'cache' on transformers 5.24
        return r

    m._prepare_cache_for_generation = spy
    out = _gen(m, ids, n=5, output_logits=True, return_dict_in_generate=True)
    assert isinstance(seen[0], lowbit_cache_class())
    cache = seen[0]
    assert cache.paged.numerics == kv and cache.paged.host_lengths == [13, 13] and cache.bytes() > 0
    with torch.no_grad():
        full = m(out.sequences[:, :-1]).logits
    for step, lg in enumerate(out.logits):
        pos = 9 + step - 1
        err = (lg - full[:, pos]).norm() / full[:, pos].norm()
        assert err < 1e-3, (step, err.item())


def test_padded_batch_and_decode_steps_of_4(reference_ops):
    m = tiny_llama()
    install_quantized_attention(m, kv="kv4")
    ids = torch.randint(1, 96, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 12)
    # a 4-token step through the decode path (causal among the 4 new tokens)
    cache = lowbit_cache_class()(m.config)
    with torch.no_grad():
        a = m(ids[:, :4], past_key_values=cache).logits
        b = m(ids[:, 4:], past_key_values=cache).logits
        full = m(ids).logits
    assert (torch.cat([a, b], 1) - full).norm() / full.norm() < 1e-3


def test_install_errors():
    m = tiny_llama(outlier=False)
    with pytest.raises(ValueError, match="kv must be"):
        install_quantized_attention(m, kv="int8")
    with pytest.raises(ValueError, match="unknown attention"):
        install_quantized_attention(m, kv="kv4", prefill="nope")
    with pytest.raises(ValueError, match="rope_kv needs"):
        install_quantized_attention(m, kv=None, rope_kv=[])


@pytest.mark.slow
def test_generate_with_kernels_interpreter():
    """The same generate through the Triton kernels (interpreter on CPU, GPU otherwise)."""
    m = tiny_llama(layers=1)
    install_quantized_attention(m, kv="kv4")
    ids = torch.randint(0, 96, (1, 5))
    out = _gen(m, ids, n=2)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("prompt_len", [3, 8])
def test_static_cache_with_kv4_matches_the_default_cache(prompt_len, monkeypatch):
    """With ``kv='kv4'`` and a StaticCache passed in (not lowbit's cache), each step's K/V are quantized through the
    append (fake quantization) and stored there: the tokens equal lowbit's own cache's, whose attention reads the
    same quantized values (the static cache's empty slots are not attended)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from lowbit.models.hf_attention import install_quantized_attention
    from tests._tiny_models import tiny_llama

    m = tiny_llama(layers=2)
    install_quantized_attention(m, kv="kv4")
    ids = torch.randint(0, 128, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        own = m.generate(ids, max_new_tokens=4, do_sample=False)
        static = m.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(own[:, : prompt_len + 1], static[:, : prompt_len + 1])


@pytest.mark.parametrize("prompt_len", [3, 8])
def test_static_cache_keeps_the_float_function(prompt_len):
    """``kv=None`` with ``prefill='sdpa'`` leaves the model unchanged also over transformers' StaticCache, whose
    ``update`` returns every preallocated slot: lowbit attends the filled ones only (before session 38 the empty
    slots were attended, and generate(cache_implementation="static") gave other tokens)."""
    from lowbit.models.hf_attention import install_quantized_attention
    from tests._tiny_models import tiny_llama

    m = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
        install_quantized_attention(m, kv=None, prefill="sdpa")
        got = m.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(got, ref)



@pytest.mark.parametrize("kv", ["kv4", "kv4-zp"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fake_quant_round_trip_is_the_paged_cache(reference_ops, kv, interleaved):
    """The prefill fake-quant path (pages laid out directly on k's device, no host copy) gives the values of a
    ``PagedKVCache`` filled by the same append and read back by its ``dequantize``, bit for bit (T not a multiple of
    the page, CRS on K; the append's reference on the CPU: the layouts are what is checked)."""
    from lowbit.models.hf_attention import _kv4_round_trip
    from lowbit.nn.kv_cache import PagedKVCache
    from lowbit.formats.common import FP8_E4M3

    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 3, 70, 32
    k, v = (torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(2))
    ang = torch.randn(B, T, D // 2, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16)
    crs = (torch.rand(H, D, generator=g) + 0.5)
    got = _kv4_round_trip(k, v, cos, sin, crs, FP8_E4M3, kv == "kv4-zp", interleaved)
    pc = PagedKVCache(1, H, D, numerics=kv, batch_size=B, page_size=64, dtype=k.dtype, scale_dtype=FP8_E4M3,
                      interleaved=interleaved, num_pages=B * 2)
    pc.begin_step(T)
    pc.append(0, k, v, cos=cos, sin=sin, crs_k=crs)
    want = pc.dequantize(0, k.dtype)
    for a, b in zip(got, want):
        assert a.shape == (B, H, T, D) and torch.equal(a, b)


@pytest.mark.slow
def test_compiled_model_with_changing_prompt_lengths():
    """torch.compile of a model with lowbit attention (kv=None): the second prompt length makes T dynamic, so
    ``_attend``'s ``causal=T > 1`` reaches ``lowbit.attention`` as a SymBool; its bool check (API audit, session 43)
    failed the trace ("BooleanAtom not allowed in this context") where the model compiled before."""
    m = tiny_llama(outlier=False)
    install_quantized_attention(m, kv=None, prefill="sdpa")
    f = torch.compile(m, backend="eager")
    with torch.no_grad():
        for T in (10, 13):  # (the second length recompiles with T dynamic)
            ids = torch.randint(0, 96, (2, T))
            assert torch.equal(f(ids).logits, m(ids).logits)
