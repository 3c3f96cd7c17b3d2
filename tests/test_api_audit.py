"""An adversarial audit of what users take for granted (session 43): bad input gets a Python error that names the
argument, never an IndexError / RuntimeError / ZeroDivisionError from deep inside, a silently wrong result or a NaN
where 0 is right; zero-size and strided inputs work. Each test here failed before its fix (the fixes name the test)
unless its docstring says it pins behaviour that was already right. Small shapes: the kernels run under the
interpreter on the CPU."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lowbit
from lowbit import cli
from lowbit.kernels.act_quant import fused_rows_triton
from lowbit.nn.kv_cache import PagedKVCache
from lowbit.nn.mla_cache import PagedMLACache
from lowbit.ops import attention_prefill as ap
from lowbit.ops import kv4 as kv4_ops
from lowbit.ops import mla
from lowbit.ops.quant import per_token_quant
from tests._tiny_models import tiny_hf_folder, tiny_llama, tiny_text

LINEAR = ("w4a8-fp8", "lut", "w4a8-int8", "w8")
PREFILL = ("fp8", "fp8-kv4", "int8", "int8-qk")


def _qlinear(scheme, K=128, N=32, dtype=torch.bfloat16, bias=True, seed=0, scale=1.0):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.mul_(scale)
    return lin, lowbit.quantize_linear(lin, scheme)


# ---- quantized linears -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", LINEAR)
def test_linear_forward_names_x_for_a_0d_or_non_tensor_input(scheme):
    """0-d x: IndexError (tuple index out of range) in lut / w4a8-int8 / w8; a list: AttributeError."""
    _, m = _qlinear(scheme)
    with pytest.raises(ValueError, match="x must have"):
        m(torch.tensor(1.0, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        m([1.0] * 128)


@pytest.mark.parametrize("scheme", LINEAR)
def test_quantize_linear_refuses_zero_in_features(scheme):
    """nn.Linear(0, N): IndexError (amax over an empty dim) in w4a8-int8 / w8, an ambiguous reshape in the others'
    forward."""
    with pytest.raises(ValueError, match="in_features >= 1"):
        lowbit.quantize_linear(nn.Linear(0, 16), scheme)


@pytest.mark.parametrize("scheme", ("w4a8-fp8", "w4a8-int8", "w8"))
@pytest.mark.parametrize("dtype", (torch.float64, torch.int8, "bfloat16"))
def test_quantize_linear_names_a_bad_dtype_option(scheme, dtype):
    """dtype=float64 / int8 was accepted and failed at the first forward naming ``bias``; a string failed in
    torch.zeros."""
    with pytest.raises(TypeError, match=r"dtype \(the activation / output dtype\) must be"):
        lowbit.quantize_linear(nn.Linear(64, 16), scheme, dtype=dtype)


@pytest.mark.parametrize("scheme,opt", [("w4a8-fp8", {"group_size": 128.0}), ("lut", {"group_size": 128.0}),
                                        ("lut", {"bits": 4.0}), ("w4a8-fp8", {"group_size": True})])
def test_group_size_and_bits_must_be_ints(scheme, opt):
    """``128.0 in (32, 64, 128)`` holds: the float failed later as a tensor size ("type must be tuple of ints")."""
    (name,) = opt
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        lowbit.quantize_linear(nn.Linear(256, 16), scheme, **opt)


def test_lut_table_none_names_table():
    """table=None: RuntimeError "Could not infer dtype of NoneType"."""
    with pytest.raises(TypeError, match="table must be 'nf', 'int' or a tensor"):
        lowbit.quantize_linear(nn.Linear(128, 16), "lut", table=None)


@pytest.mark.parametrize("scheme", LINEAR)
@pytest.mark.parametrize("val", (float("nan"), float("inf")))
def test_non_finite_weight_raises_in_every_scheme(scheme, val):
    """w4a8-int8 quantized a NaN / Inf weight silently (a NaN output feature); the other schemes raised."""
    lin = nn.Linear(128, 16)
    with torch.no_grad():
        lin.weight[3, 5] = val
    with pytest.raises(ValueError, match="NaN or Inf|non-finite"):
        lowbit.quantize_linear(lin, scheme)


@pytest.mark.parametrize("scheme", LINEAR)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_zero_weight_and_zero_rows_give_the_bias(scheme, dtype):
    """Already right (pinned): an all-zero weight and all-zero activation rows give exactly the bias, no 0/0 NaN;
    tiny weights (a whole group below FP8's smallest scale) stay finite."""
    lin, m = _qlinear(scheme, dtype=dtype, scale=0.0)
    x = torch.randn(3, 128, dtype=dtype)
    assert torch.equal(m(x).float(), lin.bias.float().expand(3, -1))
    lin, m = _qlinear(scheme, dtype=dtype)
    y = m(torch.zeros(2, 128, dtype=dtype))
    assert torch.equal(y.float(), lin.bias.float().expand(2, -1))
    _, m = _qlinear(scheme, dtype=dtype, scale=1e-4)
    assert torch.isfinite(m(x).float()).all()


def test_w4a8_fp8_residual_with_zero_rows():
    """``residual.reshape(M, -1)`` is ambiguous at M = 0: RuntimeError."""
    _, m = _qlinear("w4a8-fp8")
    y = m(torch.randn(1, 0, 128, dtype=torch.bfloat16), residual=torch.randn(1, 0, 32, dtype=torch.bfloat16))
    assert y.shape == (1, 0, 32)
    with pytest.raises(ValueError, match="residual must have shape"):
        m(torch.randn(2, 3, 128, dtype=torch.bfloat16), residual=torch.randn(3, 2, 32, dtype=torch.bfloat16))


@settings(max_examples=10, deadline=None)
@given(scheme=st.sampled_from(LINEAR), lead=st.sampled_from(((0,), (0, 3), (2, 0), (3,), (2, 2))),
       view=st.sampled_from(("contiguous", "transposed", "strided", "expanded")),
       dtype=st.sampled_from((torch.float16, torch.bfloat16)))
def test_linear_zero_size_and_strided_views_match_contiguous(scheme, lead, view, dtype):
    """Already right (pinned): M = 0 and batch 0, and transposed / strided / expanded views of x give the output of
    the contiguous x, bit for bit."""
    _, m = _qlinear(scheme, K=96, N=24, dtype=dtype)
    x = torch.randn(*lead, 96, dtype=dtype)
    if view == "transposed":
        x = x.transpose(-1, 0).contiguous().transpose(-1, 0) if x.ndim > 1 else x
    elif view == "strided":
        x = torch.randn(*lead, 192, dtype=dtype)[..., ::2]
    elif view == "expanded" and x.numel():
        x = x[..., :1, :].expand_as(x)
    y = m(x)
    assert y.shape == (*x.shape[:-1], 24) and y.dtype == dtype
    assert torch.equal(y, m(x.contiguous()))


# ---- lowbit.attention ----------------------------------------------------------------------------------------------

def _qkv(B=1, hq=2, hkv=1, sq=5, skv=7, D=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(B * 100 + sq * 10 + skv)
    return tuple(torch.randn(B, h, s, D, generator=g).to(dtype) for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))


@pytest.mark.parametrize("scheme", ("sdpa",) + PREFILL)
def test_attention_zero_heads_or_head_dim_name_the_argument(scheme):
    """Hkv = 0: ZeroDivisionError (integer modulo by zero); D = 0: ZeroDivisionError (0.0 ** -0.5)."""
    with pytest.raises(ValueError, match="heads"):
        lowbit.attention(*_qkv(hq=0, hkv=0), scheme=scheme)
    with pytest.raises(ValueError, match="head_dim"):
        lowbit.attention(*_qkv(D=0), scheme=scheme)


@pytest.mark.parametrize("scheme", ("sdpa",) + PREFILL)
@pytest.mark.parametrize("sm_scale,exc", [("0.1", TypeError), (float("nan"), ValueError), (float("inf"), ValueError),
                                          (0.0, ValueError), (-1.0, ValueError), (True, TypeError)])
def test_attention_sm_scale_is_a_positive_finite_number(scheme, sm_scale, exc):
    """A string: TypeError "only integer tensors of a single element can be converted to an index"; sdpa took NaN
    (all-zero output), inf, 0 and negative scales."""
    with pytest.raises(exc, match="sm_scale"):
        lowbit.attention(*_qkv(), scheme=scheme, sm_scale=sm_scale)


def test_attention_causal_must_be_a_bool():
    """causal="no" was truthy: a causal mask."""
    with pytest.raises(TypeError, match="causal must be a bool"):
        lowbit.attention(*_qkv(), scheme="fp8", causal="no")
    a = lowbit.attention(*_qkv(), scheme="sdpa", sm_scale=torch.tensor(0.125))  # a 0-d tensor scale is fine
    assert torch.equal(a, lowbit.attention(*_qkv(), scheme="sdpa", sm_scale=0.125))


def test_attention_causal_from_a_traced_size():
    """``causal=T > 1`` (as ``lowbit.models.hf_attention._attend`` passes it) is a SymBool when torch.compile traces
    T dynamically: the bool check's ``causal not in (True, False)`` failed the trace ("BooleanAtom not allowed in
    this context"), where the call compiled before the audit."""

    def f(q, k, v):
        return lowbit.attention(q, k, v, scheme="sdpa", causal=q.shape[2] > 1, sm_scale=0.125)

    g = torch.compile(f, backend="eager", dynamic=True)  # (not fullgraph: the registry's import breaks the graph)
    for sq in (5, 7):
        q, k, v = _qkv(sq=sq, skv=sq, dtype=torch.float32)
        assert torch.equal(g(q, k, v), f(q, k, v))


@settings(max_examples=10, deadline=None)
@given(scheme=st.sampled_from(("sdpa",) + PREFILL), B=st.sampled_from((0, 1, 2)), sq=st.sampled_from((0, 1, 5)),
       skv=st.sampled_from((0, 3, 9)), causal=st.booleans(), D=st.sampled_from((64, 48, 128)),
       transposed=st.booleans())
def test_attention_zero_sizes_and_views(scheme, B, sq, skv, causal, D, transposed):
    """Already right (pinned): batch 0, no queries, no keys (zeros out, not NaN) and non-contiguous q / k / v."""
    q, k, v = _qkv(B=B, hq=4, hkv=2, sq=sq, skv=skv, D=D)
    if transposed:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if causal and sq > skv:
        with pytest.raises(ValueError, match="Sq <= Skv"):
            lowbit.attention(q, k, v, scheme=scheme, causal=causal)
        return
    o = lowbit.attention(q, k, v, scheme=scheme, causal=causal)
    assert o.shape == q.shape and o.dtype == q.dtype and torch.isfinite(o.float()).all()
    if skv == 0:
        assert (o == 0).all()


def test_prefill_op_output_strides_match_its_fake(dev):
    """At a head dim the kernel pads (48 -> 64) the op returned a strided view ``o[..., :D]`` while its fake
    implementation says contiguous (``empty_like(q)``): torch.compile's graph assumed other strides."""
    q, k, v = (t.to(dev) for t in _qkv(D=48))
    for mode, vg, kg in (("fp8", "block", "block"), ("int8", "channel", "token")):
        args = (q, k, v, mode, False, 48 ** -0.5, vg, ap.V_BLOCK, kg, False)
        torch.library.opcheck(ap._quant_attention, args, test_utils=("test_faketensor",))
        assert ap._quant_attention(*args).is_contiguous()


# ---- paged KV caches and the decode ops ----------------------------------------------------------------------------

def _cache(numerics="kv4", B=2, T=20, layers=2, H=2, D=64):
    c = PagedKVCache(layers, H, D, numerics=numerics, batch_size=B, page_size=16)
    c.begin_step(T)
    g = torch.Generator().manual_seed(T)
    c.append(0, torch.randn(B, H, T, D, generator=g).bfloat16(), torch.randn(B, H, T, D, generator=g).bfloat16())
    return c


def _decode_args(c):
    pool = c.pools[0]
    if c.numerics == "bf16":
        return kv4_ops.decode_float, (pool["k"], pool["v"])
    return kv4_ops.decode_kv4, (pool["k_codes"], pool["k_scale"], pool["v_codes"], pool["v_scale"])


@pytest.mark.parametrize("numerics", ("kv4", "bf16"))
def test_decode_max_len_must_bound_lengths(numerics):
    """``max_len`` below the lengths cut the keys read (a silently wrong output, 0.75 off); -1 did the same;
    ``num_splits=-2``: ZeroDivisionError."""
    c = _cache(numerics)
    f, cache = _decode_args(c)
    q = torch.randn(2, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_len"):
        f(q, *cache, c.page_table, c.lengths, max_len=5)
    with pytest.raises(ValueError, match="max_len must be >= 0"):
        f(q, *cache, c.page_table, c.lengths, max_len=-1)
    with pytest.raises(ValueError, match="num_splits must be >= 0"):
        f(q, *cache, c.page_table, c.lengths, num_splits=-2)
    with pytest.raises(TypeError, match="max_len must be an int"):
        f(q, *cache, c.page_table, c.lengths, max_len=20.5)
    assert torch.equal(f(q, *cache, c.page_table, c.lengths, max_len=20), f(q, *cache, c.page_table, c.lengths))


@pytest.mark.parametrize("numerics", ("kv4", "bf16"))
def test_decode_sm_scale_and_devices_are_checked(numerics):
    """sm_scale=inf gave NaN; a q (or page table) on another device than the cache: RuntimeError / NotImplementedError
    ("Cannot copy out of meta tensor") from inside."""
    c = _cache(numerics)
    f, cache = _decode_args(c)
    q = torch.randn(2, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sm_scale"):
        f(q, *cache, c.page_table, c.lengths, sm_scale=float("inf"))
    with pytest.raises(ValueError, match="one device"):
        f(q.to("meta"), *cache, c.page_table, c.lengths)
    with pytest.raises(ValueError, match="one device"):
        f(q, *cache, c.page_table.to("meta"), c.lengths.to("meta"))
    if numerics == "kv4":
        with pytest.raises(ValueError, match="q_int8"):
            f(q, *cache, c.page_table, c.lengths, q_int8="x")


def test_kv4_ops_zero_head_dim_and_device_mix():
    """kv4_quantize with D = 0: IndexError (amax over an empty dim); kv4_append with k on another device than the
    cache returned without writing anything."""
    z = torch.randn(1, 2, 5, 0)
    with pytest.raises(ValueError, match="head_dim"):
        kv4_ops.kv4_quantize(z, z)
    c = PagedKVCache(1, 2, 64, batch_size=2, page_size=16)
    start = c.begin_step(3)
    pool = c.pools[0]
    k = torch.randn(2, 2, 3, 64, device="meta")
    with pytest.raises(ValueError, match="one device"):
        kv4_ops.kv4_append(k, k, pool["k_codes"], pool["k_scale"], pool["v_codes"], pool["v_scale"], c.page_table,
                           start)


@pytest.mark.parametrize("kw,exc,match", [
    ({"num_layers": 0}, ValueError, "num_layers"), ({"num_kv_heads": 0}, ValueError, "num_kv_heads"),
    ({"head_dim": 0}, ValueError, "head_dim"), ({"head_dim": -2}, ValueError, "head_dim"),
    ({"batch_size": -1}, ValueError, "batch_size"), ({"num_pages": -3}, ValueError, "num_pages"),
    ({"dtype": torch.float64}, TypeError, "dtype"), ({"num_layers": 2.0}, TypeError, "num_layers"),
])
def test_paged_kv_cache_constructor_arguments(kw, exc, match):
    """Negative sizes: RuntimeError from torch.zeros; zero layers / heads / head_dim and float64 pages were
    accepted."""
    args = dict(num_layers=1, num_kv_heads=2, head_dim=64, batch_size=2, page_size=16)
    with pytest.raises(exc, match=match):
        PagedKVCache(**{**args, **kw})


@pytest.mark.parametrize("numerics", ("kv4", "kv4-zp", "bf16"))
def test_paged_kv_cache_indices_and_steps(numerics):
    """layer 5 of 2: IndexError; layer -1 silently used the last layer; release(5): IndexError;
    begin_step(-3) made every length -3."""
    c = _cache(numerics, T=3)
    k = torch.randn(2, 2, 3, 64, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 1, 64, dtype=torch.bfloat16)
    for bad in (2, -1):
        with pytest.raises(ValueError, match=r"layer must lie in \[0, 2\)"):
            c.append(bad, k, k)
        with pytest.raises(ValueError, match="layer must lie"):
            c.decode(bad, q)
        with pytest.raises(ValueError, match="layer must lie"):
            c.dequantize(bad)
    with pytest.raises(ValueError, match="b must lie"):
        c.release(5)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        c.begin_step(-3)
    assert c.host_lengths == [3, 3]


def test_bf16_cache_append_checks_k_and_v():
    """The float cache wrote through advanced indexing unchecked: wrong heads -> IndexError, wrong head_dim or v
    shape -> RuntimeError (shape mismatch), float64 / int32 k silently cast."""
    c = PagedKVCache(1, 2, 64, numerics="bf16", batch_size=2, page_size=16)
    c.begin_step(3)
    k = torch.randn(2, 2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k must have shape"):
        c.append(0, torch.randn(2, 3, 3, 64), torch.randn(2, 3, 3, 64))
    with pytest.raises(ValueError, match="k must have shape"):
        c.append(0, k[..., :32], k[..., :32])
    with pytest.raises(ValueError, match="v must have shape"):
        c.append(0, k, k[..., :32])
    with pytest.raises(TypeError, match="k must have dtype"):
        c.append(0, k.int(), k.int())
    with pytest.raises(ValueError, match="k must have 4 dims"):
        c.append(0, k[0], k[0])


@pytest.mark.parametrize("numerics", ("kv4", "kv4-zp", "bf16"))
def test_paged_kv_cache_batch_zero(numerics):
    """batch_size=0: no pages, so begin_step hit max() of an empty sequence and decode a KeyError."""
    c = PagedKVCache(1, 2, 64, numerics=numerics, batch_size=0, page_size=16)
    c.begin_step(1)
    k = torch.randn(0, 2, 1, 64, dtype=torch.bfloat16)
    c.append(0, k, k)
    o = c.decode(0, torch.randn(0, 4, 1, 64, dtype=torch.bfloat16))
    assert o.shape == (0, 4, 1, 64)


# ---- MLA -------------------------------------------------------------------------------------------------------------

def _mla(fp8):
    c = PagedMLACache(2, 2, 40, kv_lora_rank=64, rope_dim=16, fp8=fp8, page_size=16)
    c.append(0, torch.randn(2, 20, 80, generator=torch.Generator().manual_seed(1)).bfloat16())
    return c


@pytest.mark.parametrize("fp8", (True, False))
def test_mla_decode_bounds_and_empty_batches(fp8):
    """max_seq_len below seq_lens cut the keys (0.67 off); B = 0 and H = 0: ZeroDivisionError; mla_prefill at B = 0:
    "q has 1 tokens but the cache holds only 0"; a string sm_scale: "could not convert string to float"."""
    c = _mla(fp8)
    q = torch.randn(2, 1, 4, 80, dtype=torch.bfloat16)
    args = (c.layers[0], c.page_table, c.seq_lens(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        mla.mla_decode(q, *args, max_seq_len=5)
    with pytest.raises(ValueError, match="max_seq_len must be >= 0"):
        mla.mla_decode(q, *args, max_seq_len=-1)
    with pytest.raises(TypeError, match="sm_scale"):
        mla.mla_decode(q, *args, sm_scale="x")
    assert mla.mla_decode(q[:0], c.layers[0], c.page_table[:0], c.seq_lens(0)[:0]).shape == (0, 1, 4, 64)
    assert mla.mla_decode(q[:, :, :0], *args).shape == (2, 1, 0, 64)
    assert mla.mla_prefill(q[:0], c.layers[0], c.page_table[:0], c.seq_lens(0)[:0]).shape == (0, 1, 4, 64)
    with pytest.raises(ValueError, match="sm_scale"):
        mla.mla_prefill(q, *args, sm_scale=float("nan"))


def test_mla_cache_arguments():
    """layer 5 of 2: IndexError; a 2-D kv: "not enough values to unpack"; kv_lora_rank 0 was accepted, -4 failed in
    torch.zeros; mla_quantize_q of a 0-d q: IndexError."""
    c = _mla(True)
    with pytest.raises(ValueError, match="layer must lie"):
        c.append(5, torch.randn(2, 1, 80))
    with pytest.raises(ValueError, match="layer must lie"):
        c.attend(-1, torch.randn(2, 1, 4, 80, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kv must have 3 dims"):
        c.append(0, torch.randn(2, 80))
    with pytest.raises(ValueError, match="q must have 4 dims"):
        c.attend(0, torch.randn(1, 4, 80))
    for rank in (0, -4):
        with pytest.raises(ValueError, match="kv_lora_rank"):
            PagedMLACache(1, 2, 40, kv_lora_rank=rank, rope_dim=16)
    with pytest.raises(ValueError, match="q must have at least 1 dim"):
        mla.mla_quantize_q(torch.tensor(1.0), 1)


# ---- activation quantization -------------------------------------------------------------------------------------

def test_act_quant_empty_rows_and_device_mix():
    """K = 0: "cannot reshape tensor of 0 elements into shape [-1, 0]"; a norm weight / up on another device:
    "Cannot copy out of meta tensor". Zero rows (M = 0) and all-zero rows were already right (pinned)."""
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for fmt in ("fp8", "int8"):
        with pytest.raises(ValueError, match="nonzero last dim"):
            per_token_quant(x[:, :0], fmt)
        q, s = per_token_quant(torch.zeros_like(x), fmt)
        assert (q.float() == 0).all() and torch.isfinite(s).all() and (s > 0).all()
        assert per_token_quant(x[:0], fmt)[0].shape == (0, 64)
    with pytest.raises(ValueError, match="one device"):
        fused_rows_triton(x, fuse="rmsnorm", weight=torch.ones(64, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        fused_rows_triton(x, fuse="silu_mul", up=x.to("meta"))


# ---- models, checkpoints, generation, CLI ----------------------------------------------------------------------------

def test_quantize_model_needs_a_transformers_model():
    """fireq on an nn.Linear: AttributeError ('Linear' object has no attribute 'config')."""
    with pytest.raises(TypeError, match="config"):
        lowbit.quantize_model(nn.Linear(4, 4), "fireq", calibration=[torch.tensor([1, 2, 3])])


def test_load_quantized_device_and_path(tmp_path):
    """device='bogus': RuntimeError listing torch's device types, after hashing the weights; 'cuda' without CUDA:
    AssertionError; a file passed as the folder: "does not exist"."""
    with pytest.raises(ValueError, match="device must be a torch device"):
        lowbit.load_quantized(tmp_path, device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            lowbit.load_quantized(tmp_path, device="cuda")
    f = tmp_path / "x"
    f.write_text("hi")
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        lowbit.load_quantized(f)


def test_load_model_directory_without_config(tmp_path):
    """A folder that is no HF model: transformers' "You need to have sentencepiece or tiktoken installed"."""
    from lowbit.models.loading import load_model

    with pytest.raises(FileNotFoundError, match="without config.json"):
        load_model(tmp_path)


def test_calibration_sizes_are_checked():
    """n_samples=-1: RuntimeError (negative dimension) out of the CLI; seq_len=0 windows were empty."""
    from lowbit.eval.corpus import calibration_batches

    with pytest.raises(ValueError, match="n_samples"):
        calibration_batches(None, n_samples=-1)
    with pytest.raises(ValueError, match="seq_len"):
        calibration_batches(None, n_samples=2, seq_len=0)


def test_generate_arguments():
    """max_new_tokens=0 still generated one token per prompt; -2: "max_batch must be >= 1 and max_seq >= 2"; no
    prompts: "max() arg is an empty sequence"; ids outside the vocabulary: IndexError in the embedding; float ids were
    truncated."""
    from lowbit.models.generate import Generator, generate

    m = tiny_llama(layers=1, hidden=32, heads=2, kv_heads=1)
    p = [torch.tensor([1, 2, 3])]
    for n in (0, -2):
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
            generate(m, p, n)
    with pytest.raises(ValueError, match="at least one sequence"):
        generate(m, [], 3)
    g = Generator(m, max_batch=1, max_seq=8)
    for bad in (torch.tensor([1, 999]), torch.tensor([-1, 2])):
        with pytest.raises(ValueError, match=r"prompts\[0\] has token ids outside \[0, 128\)"):
            g.generate([bad], 2)
    with pytest.raises(TypeError, match="integer token ids"):
        g.generate([torch.tensor([1.5, 2.0])], 2)
    assert [t.numel() for t in g.generate(p, 2)] == [2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("audit") / "model")


def test_cli_option_without_recipe_and_bad_calibration(tiny_dir, tmp_path, capsys):
    """--option without --recipe was ignored (exit 0); --calib-samples -1 escaped as a RuntimeError traceback."""
    text = tmp_path / "t.txt"
    text.write_text(tiny_text(300))
    assert cli.main(["eval", str(tiny_dir), "--text-file", str(text), "--option", "group_size=64"]) == 2
    assert "--option sets a recipe option: it needs --recipe" in capsys.readouterr().err
    rc = cli.main(["eval", str(tiny_dir), "--text-file", str(text), "--recipe", "flute-nf4", "--calib-file", str(text),
                   "--calib-samples", "-1", "--max-tokens", "64"])
    assert rc == 2 and "n_samples" in capsys.readouterr().err
