"""w4a8-fp8 (FireQ linear): format reference, Triton GEMM under the interpreter vs the float64
reference, the ``lowbit::w4a8_fp8_gemm`` op, and ``W4A8FP8Linear``."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowbit.formats.common import FP8_E4M3, interleave_rows, quantize_per_token
from lowbit.formats.w4a8_fp8 import (dequantize_weight, fp8_round, padded_k, quantize_weight,
                                     reference_gemm, reference_linear, unpack_codes)
from tests.tolerances import KERNEL_VS_REF, rel_l2
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)

DEV = "cuda" if GPU else "cpu"
CFG_SWAP = dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=1, SWAP_AB=True, num_warps=4, num_stages=2, GROUP_M=1)
CFG_MN = dict(BLOCK_M=64, BLOCK_N=64, SPLIT_K=1, SWAP_AB=False, num_warps=4, num_stages=2, GROUP_M=2)


# ----------------------------------------------------------------------------- format
def test_layout_and_codes():
    from lowbit.formats.w4a8_fp8 import decode_codes, encode_codes

    torch.manual_seed(0)
    w = torch.randn(3, 300) * 0.05
    codes, scales, inv = quantize_weight(w, 128, 0)
    assert codes.shape == (3, padded_k(300) // 2) == (3, 192) and codes.dtype == torch.uint8
    assert scales.shape == (3, 16) and scales.dtype == FP8_E4M3 and inv.item() == 1.0
    assert scales.float()[:, 3:].eq(0).all()  # groups padded to 16
    q = unpack_codes(codes, 300)
    assert q.min() >= -7 and q.max() <= 7
    # word w of block b (bytes b*64 + 4w .. +3, little-endian) holds columns b*128 + 4w + i (lo)
    # and b*128 + 64 + 4w + i (hi): |q| in bits 4i.. / 16+4i.., signs in bits 8i+7 / 8i+3
    for row, b, wd in [(1, 0, 0), (2, 1, 5)]:
        word = int.from_bytes(bytes(codes[row, b * 64 + 4 * wd: b * 64 + 4 * wd + 4].tolist()), "little")
        for i in range(4):
            lo, hi = q[row, b * 128 + 4 * wd + i].item(), q[row, b * 128 + 64 + 4 * wd + i].item()
            assert (word >> 4 * i) & 7 == abs(lo) and (word >> (8 * i + 7)) & 1 == (lo < 0)
            assert (word >> (16 + 4 * i)) & 7 == abs(hi) and (word >> (8 * i + 3)) & 1 == (hi < 0)
    assert torch.equal(decode_codes(codes)[:, 300:], torch.zeros(3, 84, dtype=torch.int8))  # padding
    r = torch.randint(-7, 8, (2, 256))
    assert torch.equal(decode_codes(encode_codes(r)).long(), r)


def test_dequant_is_fp8_of_q_sigma_and_rounding():
    torch.manual_seed(1)
    w = torch.randn(4, 256) * 0.1
    codes, scales, _ = quantize_weight(w, 64, 4)
    weff = dequantize_weight(codes, scales, 256, 64)
    q = unpack_codes(codes, 256).float()
    sig = scales.float().repeat_interleave(64, 1)[:, :256]
    assert torch.equal(weff, fp8_round(q * sig))
    assert torch.equal(weff, fp8_round(weff))  # on the E4M3 grid
    err = rel_l2(weff / 16, w)
    assert err < 0.2  # INT4 g64 on Gaussian weights, plus the FP8 rounding of q*sigma


def test_all_zero_group_and_underflow_give_zero_not_nan():
    w = torch.zeros(2, 256)
    w[0, 128:] = 1e-5  # sigma = 1e-5/7 < 2^-10: underflows to 0 -> group zeroed (Lemma B.1)
    w[1, :128] = torch.linspace(-1, 1, 128)
    codes, scales, inv = quantize_weight(w, 128, 0)
    assert scales.float()[0].eq(0).all()
    weff = dequantize_weight(codes, scales, 256, 128)
    assert torch.isfinite(weff).all() and weff[0].eq(0).all()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = reference_linear(x, codes, scales, inv, 256, 128)
    assert torch.isfinite(y).all() and y[:, 0].eq(0).all()


def test_weight_nan_raises():
    with pytest.raises(ValueError, match="NaN"):
        quantize_weight(torch.tensor([[1.0, float("nan")]]), 32)


# ----------------------------------------------------------------------------- kernel (interpreter)
def _case(M, N, K, g, seed=0, silu=False, bias=False, res=False, pts=3, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    w = torch.randn(N, K) * 0.05
    if N > 1 and K >= g:
        w[1, :g] = 0  # all-zero group
    if silu:
        w = interleave_rows(w[: N // 2], w[N // 2:])
    codes, sc, inv = quantize_weight(w, g, pts)
    x = (torch.randn(M, K) * 2).to(dtype)
    xq, sx = quantize_per_token(x, FP8_E4M3)
    b = torch.randn(N).to(dtype) if bias else None
    r = torch.randn(M, N // 2 if silu else N).to(dtype) if res else None
    ref = reference_gemm(xq, sx, codes, sc, inv.item(), K, g, b, residual=r, silu_mul=silu, out_dtype=dtype)
    mv = lambda t: None if t is None else t.to(DEV)
    return (xq.to(DEV), sx.to(DEV), codes.to(DEV), sc.to(DEV), inv.item(), K, g), dict(bias=mv(b), residual=mv(r), silu_mul=silu, out_dtype=dtype), ref


@pytest.mark.parametrize("M,N,K,g,cfg,kw", [
    (1, 72, 200, 128, CFG_SWAP, {}),
    (3, 64, 576, 64, CFG_SWAP, {"bias": True}),
    (17, 40, 160, 32, CFG_SWAP, {"res": True}),
    (64, 100, 300, 128, CFG_MN, {}),
    (70, 64, 300, 64, dict(CFG_MN, ACC_TILE=True), {"bias": True}),
    (5, 96, 520, 128, dict(CFG_SWAP, SPLIT_K=3), {"bias": True, "res": True}),
    # fp16 for the SiLU*mul epilogue: Triton 3.6's interpreter casts fp32->bf16 by truncation (the
    # GPU rounds to nearest), and the epilogue's five roundings then drift past the bf16 tolerance
    (33, 64, 256, 64, CFG_MN, {"silu": True, "res": True, "dtype": torch.float16}),
    (2, 128, 200, 32, dict(CFG_SWAP, SPLIT_K=2), {"silu": True, "dtype": torch.float16}),
])
def test_kernel_vs_reference(M, N, K, g, cfg, kw):
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    args, kwargs, ref = _case(M, N, K, g, **kw)
    y = w4a8_fp8_gemm(*args, **kwargs, config=cfg)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel_l2(y.cpu(), ref) < KERNEL_VS_REF[ref.dtype]


@settings(max_examples=6, deadline=None)
@given(M=st.integers(1, 70), N=st.integers(1, 90), K=st.integers(1, 300), g=st.sampled_from((32, 64, 128)),
       fp16=st.booleans())
def test_kernel_shapes_hypothesis(M, N, K, g, fp16):
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    dt = torch.float16 if fp16 else torch.bfloat16
    args, kwargs, ref = _case(M, N, K, g, seed=M * N + K, dtype=dt)
    cfg = dict(pick_config(M, N, K), BLOCK_N=64, num_stages=2)
    if not cfg["SWAP_AB"]:
        cfg["BLOCK_M"] = 64
    y = w4a8_fp8_gemm(*args, **kwargs, config=cfg)
    assert rel_l2(y.cpu(), ref) < KERNEL_VS_REF[dt]


def test_kernel_fp32_output_long_k_accumulation():
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    torch.manual_seed(3)
    K = 2048
    w = torch.rand(16, K) * 0.02  # all-positive products: the case where a short accumulator drifts
    codes, sc, inv = quantize_weight(w, 128, 8)
    xq, sx = quantize_per_token(torch.rand(2, K), FP8_E4M3)
    ref = reference_gemm(xq, sx, codes, sc, inv.item(), K, 128, out_dtype=torch.float32)
    y = w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes.to(DEV), sc.to(DEV), inv.item(), K, 128,
                      out_dtype=torch.float32, config=CFG_SWAP)
    # GPU: Hopper's FP8 MMA sums within a K tile with ~14 bits before the fp32 promotion (9.4e-5 measured, H200, s16);
    # a drifting low-precision accumulator over K = 2048 would be far above that
    assert rel_l2(y.cpu(), ref) < (1e-5 if DEV == "cpu" else 2e-4)


def test_kernel_bad_args():
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    args, kwargs, _ = _case(2, 8, 64, 32)
    xq, sx, codes, sc, inv, K, g = args
    with pytest.raises(ValueError, match="in_features"):
        w4a8_fp8_gemm(xq, sx, codes, sc, inv, K + 1, g)
    with pytest.raises(TypeError, match="xq"):
        w4a8_fp8_gemm(xq.float(), sx, codes, sc, inv, K, g)
    with pytest.raises(ValueError, match="scales"):
        w4a8_fp8_gemm(xq, sx, codes, sc[:, :1], inv, K, 32)
    with pytest.raises(ValueError, match="silu_mul"):
        w4a8_fp8_gemm(xq, sx, codes[:7], sc[:7], inv, K, g, silu_mul=True)


# ----------------------------------------------------------------------------- op + module
def test_opcheck():
    from lowbit.ops.w4a8_fp8 import _w4a8_fp8_gemm

    # test_schema is left out: its SchemaCheckMode multiplies every input on the CPU, which torch
    # does not implement for float8_e4m3fn ("mul_cpu_reduced_float")
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    args, kwargs, _ = _case(3, 16, 64, 32)
    torch.library.opcheck(_w4a8_fp8_gemm, (*args, None, None, False, torch.bfloat16), test_utils=utils)
    args, kwargs, _ = _case(2, 16, 64, 32, silu=True, res=True)
    torch.library.opcheck(_w4a8_fp8_gemm, (*args, None, kwargs["residual"], True, torch.bfloat16), test_utils=utils)


def test_module_roundtrip_and_accuracy():
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    torch.manual_seed(4)
    lin = torch.nn.Linear(200, 48, bias=True).to(torch.bfloat16)
    m = W4A8FP8Linear.from_linear(lin, group_size=64)
    assert m.scheme == "w4a8-fp8" and m.pts_exp > 0
    assert set(dict(m.named_buffers())) == {"codes", "scales", "bias"}
    x = torch.randn(2, 5, 200, dtype=torch.bfloat16)
    y = m(x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    assert rel_l2(y, lin(x)) < 0.15
    # dequantize() is the effective weight of the forward pass
    ref = reference_linear(x, m.codes, m.scales, m.inv_delta, 200, 64, m.bias)
    assert rel_l2(y, ref) < KERNEL_VS_REF[torch.bfloat16]
    assert torch.allclose(m.dequantize(), dequantize_weight(m.codes, m.scales, 200, 64) * m.inv_delta)
    # checkpoint contract: empty(**config) + load_state_dict reproduces the module
    m2 = W4A8FP8Linear.empty(200, 48, True, torch.bfloat16, **m.config())
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2(x), y)


def test_module_pts_keeps_function():
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    torch.manual_seed(5)
    lin = torch.nn.Linear(256, 32, bias=False)
    x = torch.randn(4, 256)
    y0 = W4A8FP8Linear.from_linear(lin, pts=False)(x)
    y1 = W4A8FP8Linear.from_linear(lin, pts=True)(x)
    assert rel_l2(y1, lin(x)) < 0.12 and rel_l2(y0, lin(x)) < 0.15


def test_module_nan_activation_row_documented():
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    m = W4A8FP8Linear.from_linear(torch.nn.Linear(64, 8))
    x = torch.randn(3, 64)
    x[1, 2] = float("nan")
    y = m(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


def test_quantize_linear_api_and_errors():
    import lowbit

    m = lowbit.quantize_linear(torch.nn.Linear(96, 16), "w4a8-fp8", group_size=32, pts=False)
    assert m.config() == {"group_size": 32, "pts_exp": 0, "activation": None}
    with pytest.raises(ValueError, match="group_size"):
        lowbit.quantize_linear(torch.nn.Linear(96, 16), "w4a8-fp8", group_size=48)
    with pytest.raises(ValueError, match="in_features"):
        m(torch.randn(2, 95))


def test_fuse_mlp_matches_float_mlp():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowbit.models.arch import decoder_layers
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear, W4A8FP8MLP, fuse_mlp

    torch.manual_seed(6)
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = LlamaForCausalLM(cfg).eval()
    view = decoder_layers(model)[0]
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = view.layer.mlp(x)
        g, u, d = (W4A8FP8Linear.from_linear(lin, pts=False) for lin in (view.gate_proj, view.up_proj, view.down_proj))
        unfused = d(torch.nn.functional.silu(g(x)) * u(x))
        new = fuse_mlp(view, pts=False)
        assert isinstance(view.layer.mlp, W4A8FP8MLP) and new.gate_up.out_features == 96
        y = view.layer.mlp(x)
    assert rel_l2(y, unfused) < 1e-4  # same numerics, SiLU*mul moved into the GEMM epilogue
    assert rel_l2(y, ref) < 0.35  # 4-bit error of a tiny random MLP


@pytest.mark.slow
def test_torch_compile_fullgraph():
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    m = W4A8FP8Linear.from_linear(torch.nn.Linear(64, 32))
    x = torch.randn(3, 64)
    ref = m(x)
    out = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(out, ref)
