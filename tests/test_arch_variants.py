"""Llama-family variants beyond Llama: Qwen3 (per-head q/k norms), Qwen2 (q/k/v biases), Mistral
(sliding window). ``lowbit.models.arch`` reads them; the key smoothing of q/k-norm models runs after
RoPE (``lowbit.ptq.rope_kv`` decision 6, ``lowbit.ptq.smooth_attention``)."""
import pytest
import torch

import lowbit
from lowbit.models.arch import decoder_layers, sliding_window
from lowbit.models.generate import Generator
from lowbit.models.hf_attention import install_quantized_attention
from lowbit.ptq.rope_kv import apply_rpn, calibrate_rpn_crs, pair_channels
from lowbit.ptq.smooth_attention import apply_smooth_attention, online_params
from tests._tiny_models import greedy, runner_rope_ab, tiny_variant
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)


@pytest.fixture
def reference_ops(monkeypatch):
    """The cache's reference numerics on the CPU (its kernels are tested in test_kv4_kernels)."""
    if not GPU:
        import lowbit.ops.kv4 as ops

        monkeypatch.setattr(ops, "use_triton", lambda *t: False)


def _calib(n=2, S=24, vocab=128):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, S), generator=g) for _ in range(n)]


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits.double()


def _close(a, b, tol=1e-4):
    return ((a - b).norm() / b.norm()).item() < tol


def test_views_read_qk_norm_and_window():
    q3 = decoder_layers(tiny_variant("qwen3"))
    assert all(v.qk_norm and v.sliding_window is None for v in q3)
    mi = decoder_layers(tiny_variant("mistral", sliding_window=8))
    assert all(not v.qk_norm and v.sliding_window == 8 for v in mi)
    q2 = tiny_variant("qwen2", sliding_window=8)  # use_sliding_window is off: full attention
    assert sliding_window(q2.model.layers[0].self_attn) is None


def test_qwen3_attention_paths_keep_the_function(reference_ops):
    m = tiny_variant("qwen3")
    ids = torch.randint(0, 128, (2, 10))
    ref, toks = _logits(m, ids), greedy(m, ids[:1], 5)
    install_quantized_attention(m, kv=None, prefill="sdpa")
    assert torch.equal(_logits(m, ids), ref)
    install_quantized_attention(m, kv="bf16")  # unquantized paged cache, q/k norms applied before RoPE
    assert torch.equal(greedy(m, ids[:1], 5), toks)


def test_qwen3_rpn_runs_online_and_keeps_the_function(reference_ops):
    m = tiny_variant("qwen3")
    ids = torch.randint(0, 128, (2, 12))
    ref = _logits(m, ids)
    w = {n: p.clone() for n, p in m.named_parameters()}
    params = calibrate_rpn_crs(m, _calib(), top_k=1)
    # statistics of the keys RoPE sees (k_norm's output): RPN bounds each non-CRS pair's norm by alpha
    att = m.model.layers[0].self_attn
    seen = []
    h = att.k_norm.register_forward_hook(lambda mod, i, o: seen.append(o.detach().reshape(-1, 2, 16)))
    with torch.no_grad():
        for b in _calib():
            m(b)
    h.remove()
    k = torch.cat(seen)
    a, b = pair_channels(16, "half")
    norm = (k[..., a] ** 2 + k[..., b] ** 2).sqrt().amax(0)  # [Hkv, D/2]
    p0 = params[0]
    crs_pair = torch.zeros(2, 8, dtype=torch.bool).scatter_(1, p0.pairs, True)
    assert torch.allclose(p0.rpn[:, a][~crs_pair], (8.0 / norm)[~crs_pair], rtol=1e-5)
    assert (p0.pairs == 3).all()  # the planted outlier pair of k_norm's weight is each head's CRS pair
    crs_only = p0.crs_k.clone()
    apply_rpn(m, params)
    assert all(torch.equal(p, w[n]) for n, p in m.named_parameters())  # nothing folded into the weights
    assert p0.rpn_applied and p0.rpn_online
    assert torch.allclose(p0.crs_k, crs_only * p0.rpn)  # RPN joined the post-RoPE multiplier
    install_quantized_attention(m, kv="bf16", rope_kv=params)
    assert _close(_logits(m, ids), ref)


def test_qwen3_smooth_attention_runs_online(reference_ops):
    m = tiny_variant("qwen3")
    ids = torch.randint(0, 128, (2, 12))
    ref = _logits(m, ids)
    w = {n: p.clone() for n, p in m.named_parameters()}
    rep = apply_smooth_attention(m, _calib())
    assert rep["online"] == [0, 1]
    assert all(torch.equal(p, w[n]) for n, p in m.named_parameters())
    lam = rep["layers"][0]
    assert lam[0, 3] > 3 * lam[0, 5] and torch.equal(lam[:, :8], lam[:, 8:])  # outlier pair, shared in pairs
    params = online_params(m, rep)
    assert torch.allclose(params[1].crs_k, 1.0 / rep["layers"][1]) and params[0].rpn is None
    install_quantized_attention(m, kv="bf16", rope_kv=params)
    assert _close(_logits(m, ids), ref)


@pytest.mark.parametrize("arch,recipe", [("qwen3", "fireq"), ("qwen3", "qserve"), ("qwen3", "flute-nf4"),
                                         ("qwen3", "int8-attention"), ("qwen2", "fireq"), ("qwen2", "qserve")])
def test_recipes_generate_and_runner_agrees(arch, recipe, monkeypatch):
    """Every recipe quantizes the variant; the fast runner's greedy tokens equal transformers' generate
    on the quantized model (CPU, eager). Prompts are longer than 4 tokens: transformers' path runs a
    prompt of <= 4 tokens through the decode kernel's numerics, the runner through the prefill scheme.
    ``int8-attention`` decodes in float on both paths (session 38; before, transformers' path decoded through INT8
    attention and only the first token agreed)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = tiny_variant(arch)
    lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False)
    if recipe == "qserve" and arch == "qwen3":
        assert m.model.layers[0].self_attn._lowbit.crs_k is not None  # SmoothAttention's λ reaches the cache
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 8, 8, 6, 1])]
    got = Generator(m, max_batch=2, max_seq=16, prefill_from_cache=True).generate(prompts, 4)
    for p, t in zip(prompts, got):
        assert torch.equal(t, greedy(m, p.unsqueeze(0), 4)[0])


def test_qwen3_fireq_checkpoint_round_trip(tmp_path, reference_ops):
    from lowbit.models.checkpoint import load_quantized, save_quantized

    m = tiny_variant("qwen3")
    lowbit.quantize_model(m, "fireq", calibration=_calib(), progress=False)
    ids = torch.randint(0, 128, (1, 9))
    ref = _logits(m, ids)
    save_quantized(m, tmp_path / "q3")
    m2 = load_quantized(tmp_path / "q3")
    assert m2.model.layers[0].self_attn._lowbit.crs_k is not None
    assert torch.equal(_logits(m2, ids), ref)


def test_sliding_window_raises_past_the_window(reference_ops):
    m = tiny_variant("mistral", sliding_window=8)
    with pytest.warns(UserWarning, match="sliding window"):
        install_quantized_attention(m, kv="kv4")
    ids = torch.randint(0, 128, (1, 8))
    _logits(m, ids)  # 8 tokens: full causal attention is the window
    with pytest.raises(ValueError, match="sliding-window attention \\(window 8\\)"):
        _logits(m, torch.randint(0, 128, (1, 9)))
    with pytest.raises(ValueError, match="window 8"):  # the 9th token arrives as a decode step
        greedy(m, ids, 2)
    with pytest.raises(ValueError, match="max_seq"):
        Generator(m, max_batch=1, max_seq=16)
    Generator(m, max_batch=1, max_seq=8)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["fireq", "qserve", "flute-nf4"])
def test_qwen3_runner_gpu_kernels(recipe):
    """Qwen3 (head_dim 128, GQA 4) on the GPU kernels: the CUDA-graph runner's greedy tokens equal its
    eager run, and its first token (prefill from the cache, as transformers' path) equals transformers'."""
    m = tiny_variant("qwen3", head_dim=128, hidden=512, heads=8, kv_heads=2, init_std=0.05).to("cuda", torch.bfloat16)
    lowbit.quantize_model(m, recipe, calibration=[c.cuda() for c in _calib(4, 64)], progress=False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).cuda() for n in (7, 12)]
    graph = Generator(m, max_batch=2, max_seq=32, prefill_from_cache=True).generate(prompts, 6)
    eager = Generator(m, max_batch=2, max_seq=32, prefill_from_cache=True, cuda_graphs=False).generate(prompts, 6)
    assert all(torch.equal(a, b) for a, b in zip(graph, eager))
    for p, t in zip(prompts, graph):
        assert t[0] == greedy(m, p.unsqueeze(0), 1)[0, 0]


@pytest.mark.interpreter  # a CPU model through the Triton kernels; on the GPU: test_qwen3_runner_gpu_kernels
@pytest.mark.parametrize("recipe", [None, "fireq"])
def test_qwen3_runner_fuses_qk_norms_into_rope(recipe):
    """The runner applies Qwen3's q / k norms inside the RoPE launch (``lowbit.kernels.rope`` ``NORM``): one
    launch over the q and k heads per layer, the k heads only normalised where the KV4 append rotates them;
    same greedy tokens as the eager modules."""
    pytest.importorskip("triton")
    m = tiny_variant("qwen3").to(torch.bfloat16)
    if not lowbit._utils.use_triton(next(m.parameters())):
        pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1")
    if recipe is not None:
        lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False)
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 8, 8, 6, 1])]
    ref, got, calls = runner_rope_ab(m, prompts, 3)
    qk = [c for c in calls if c[1]]
    assert qk and all(c[0] == 4 + 2 for c in qk)  # q and k heads of a layer in one launch, norms included
    assert all(c[2] == (4 if recipe else None) for c in qk)  # KV4: the append rotates k itself
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("model_type,extra,match", [
    ("gemma2", dict(attn_implementation="eager"), "soft-capping"),                      # also sandwich norms: CAS would fold into the wrong one
    ("gemma", {}, "activation is 'gelu"),
    ("olmo2", {}, "norms are"),                           # norms after attention / MLP
    ("cohere", {}, "norms are"),                          # parallel attention + MLP, one norm
    ("stablelm", {}, "RoPE on part of each head"),        # partial_rotary_factor inside rope_parameters
    ("olmo", {}, "does not compute"),                     # LayerNorm without weight
    ("hunyuan_v1_dense", {}, "does not implement"),       # q / k norms under other names, after RoPE
    ("diffllama", {}, "does not implement"),              # differential attention
    ("helium", {}, "RoPE"),                               # interleaved pairs with its own cos / sin layout
    ("granite", dict(residual_multiplier=0.5), "residual multiplier"),
])
def test_non_llama_decoders_are_refused_by_name(model_type, extra, match):
    """Decoders that are not Llama-shaped raise a ValueError naming what differs, from quantize_model and from
    the runner, instead of quantizing to wrong numbers (Gemma 2: CAS into the attention output's norm) or
    failing on a missing attribute (Mixtral, Qwen3-MoE and Qwen2-MoE run: tests/test_moe.py)."""
    m = tiny_variant(model_type, **extra)
    with pytest.raises(ValueError, match=match):
        lowbit.quantize_model(m, "flute-nf4", progress=False)
    with pytest.raises(ValueError, match=match):
        Generator(m, max_batch=1, max_seq=8)


def test_untested_llama_like_type_warns_and_runs(reference_ops):
    """A model type outside the tested ones that passes every check (Granite with unit multipliers: Llama with
    its own softmax scale, ``attention_multiplier``) runs with a warning; the runner uses the model's scale."""
    m = tiny_variant("granite", attention_multiplier=0.125)
    with pytest.warns(UserWarning, match="'granite' is not among the tested"):
        lowbit.quantize_model(m, "fireq", calibration=_calib(), progress=False)
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 8, 8, 6, 1])]
    gen = Generator(m, max_batch=2, max_seq=16, prefill_from_cache=True)
    assert gen.sm_scale == 0.125
    for p, t in zip(prompts, gen.generate(prompts, 4)):
        assert torch.equal(t, greedy(m, p.unsqueeze(0), 4)[0])


@pytest.mark.parametrize("arch,recipe,opts", [("llama", "flute-nf4", {}), ("qwen3", "flute-nf4", {}),
                                              ("llama", "fireq", dict(fuse_mlp=True, kv=None, attention=None))])
def test_fused_mlp_checkpoint_passes_the_check(arch, recipe, opts, tmp_path, monkeypatch):
    """A flute checkpoint (or fireq with ``fuse_mlp=True``: ``W4A8FP8MLP``, a FusedMLP subclass) holds lowbit's
    FusedMLP (gate and up as one linear) instead of gate_proj / up_proj: the loaded model passes the architecture
    check and the runner gives the tokens it gave before saving."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = tiny_variant(arch)
    lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False, **opts)
    from lowbit.nn.base import FusedMLP

    assert isinstance(m.model.layers[0].mlp, FusedMLP)
    p = [torch.tensor([3, 1, 4, 1, 5])]
    before = Generator(m, max_batch=1, max_seq=12).generate(p, 3)
    lowbit.save_quantized(m, tmp_path / "f")
    m2 = lowbit.load_quantized(tmp_path / "f")
    assert torch.equal(Generator(m2, max_batch=1, max_seq=12).generate(p, 3)[0], before[0])


@pytest.mark.interpreter  # the Triton append / decode kernels on a CPU model; on the GPU: test_qwen3_runner_gpu_kernels
@pytest.mark.parametrize("recipe,dense", [("fireq", "auto"), ("flute-nf4", "kernel")])
def test_qwen3_decode_norms_in_the_append_launch(recipe, dense):
    """Decode steps of a q/k-norm model rotate (and now normalise) q and k inside the cache's append launch, as
    on Llama: the INT4 append (``fireq``) and the float cache's one-launch decode (``flute-nf4``, dense cache with
    lowbit's kernel). Same greedy tokens as with the norms and RoPE in their own launches (``rope_q_append=False``)."""
    pytest.importorskip("triton")
    import lowbit.kernels.kv4_append as ka
    import lowbit.kernels.decode_float as dfl

    m = tiny_variant("qwen3").to(torch.bfloat16)
    if not lowbit._utils.use_triton(next(m.parameters())):
        pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1")
    lowbit.quantize_model(m, recipe, calibration=_calib(), progress=False)
    prompts = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 8, 8, 6, 1])]
    kw = dict(max_batch=2, max_seq=12, dense_decode=dense)
    ref = Generator(m, rope_q_append=False, **kw).generate(prompts, 3)
    seen, orig = [], (ka.kv4_append_triton, dfl.decode_float_append_triton)

    def spy(fn):
        def f(*a, **k):
            if k.get("q") is not None or fn is orig[1]:  # decode steps (the prefill appends normalised keys)
                seen.append(k.get("qk_norm") is not None)
            return fn(*a, **k)
        return f

    ka.kv4_append_triton, dfl.decode_float_append_triton = spy(orig[0]), spy(orig[1])
    try:
        gen = Generator(m, rope_q_append=True, **kw)
        assert gen._q_in_append(m.model.layers[0])
        got = gen.generate(prompts, 3)
    finally:
        ka.kv4_append_triton, dfl.decode_float_append_triton = orig
    assert seen and all(seen)  # every decode step's append launch took the q / k norms
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.interpreter  # CPU tensors through the interpreter
def test_append_launch_norms_match_the_rope_launch():
    """``kv4_append_triton(q=..., qk_norm=...)`` rotates q with the rope launch's normalised rows (within two ulps:
    its sum of squares runs in another order) and stores the keys the unfused path stores (k normalised by the rope
    launch, then appended): every dequantized key within one INT4 step of its scale."""
    pytest.importorskip("triton")
    from lowbit.formats.kv4 import dequantize_kv4
    from lowbit.kernels.kv4_append import kv4_append_triton
    from lowbit.kernels.rope import rope_triton

    if not lowbit._utils.use_triton(torch.empty(1, dtype=torch.bfloat16)):
        pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(3)
    B, Hkv, G, D, P = 2, 2, 2, 32, 16
    q = (torch.randn(B, Hkv * G, 1, D, generator=g) * 3).bfloat16()
    k = (torch.randn(B, Hkv, 1, D, generator=g) * 3).bfloat16()
    v = torch.randn(B, Hkv, 1, D, generator=g).bfloat16()
    wq, wk = (torch.rand(D, generator=g) * 2).bfloat16(), (torch.rand(D, generator=g) * 2).bfloat16()
    ang = torch.rand(B, 1, D // 2, generator=g) * 20
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).bfloat16(), torch.cat((ang.sin(), ang.sin()), -1).bfloat16()
    pt = torch.arange(B, dtype=torch.int32).view(B, 1)
    start = torch.tensor([3, 7], dtype=torch.int32)

    def cache():
        return (torch.zeros(B, Hkv, P, D // 2, dtype=torch.uint8), torch.zeros(B, Hkv, P, dtype=torch.float8_e4m3fn),
                torch.zeros(B, Hkv, P, D // 2, dtype=torch.uint8), torch.zeros(B, Hkv, P, dtype=torch.float8_e4m3fn))

    fused = cache()
    qo = torch.empty(B, 1, Hkv * G, D, dtype=torch.bfloat16).transpose(1, 2)
    kv4_append_triton(k, v, *fused, pt, start, cos=cos, sin=sin, q=q, q_out=qo, qk_norm=(wq, wk, 1e-6))
    qr = rope_triton(q.transpose(1, 2), cos, sin, qk_norm=(wq, wq, 1e-6)).transpose(1, 2)
    diff = (qo.float() - qr.float()).abs()
    assert (diff <= 2 * qr.float().abs() * 2 ** -7 + 1e-30).all()
    kn = rope_triton(k.transpose(1, 2), cos, sin, qk_norm=(wk, wk, 1e-6), rotate_heads=0).transpose(1, 2)
    unfused = cache()
    kv4_append_triton(kn, v, *unfused, pt, start, cos=cos, sin=sin)
    def keys(c):  # the new token's dequantized keys [B, Hkv, D] and their scales [B, Hkv, 1]
        codes = torch.stack([c[0][b, :, start[b]] for b in range(B)])
        scale = torch.stack([c[1][b, :, start[b]] for b in range(B)])
        return dequantize_kv4(codes, scale, None, dtype=torch.float32), scale.float()[..., None]

    (kf, _), (ku, step) = keys(fused), keys(unfused)
    assert ((kf - ku).abs() <= step * 1.001).all()
