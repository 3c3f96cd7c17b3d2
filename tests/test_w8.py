"""W8 (INT8 weight-only, per-channel scale): format, Triton kernel under the interpreter vs the reference, the
``lowbit::w8_linear`` op (opcheck, errors), ``W8Linear``, the recipes' ``lm_head="w8"`` (tokens, save / load), and
the compiled kernel on the GPU."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowbit
from lowbit.formats.w8 import dequantize_w8, gemm_ref, quantize_w8
from lowbit.nn.w8 import W8Linear
from lowbit.ops.w8 import _w8_linear, w8_linear
from tolerances import KERNEL_VS_REF, rel_l2

_DT = {torch.float16: 2e-3, torch.bfloat16: 6e-3, torch.float32: 1e-5}  # bf16: the interpreter's final cast


def test_x_planes_reference():
    """Two INT8 planes of a row: |x - sx (hi + lo / 254)| <= amax / 64516 (half a low-plane step); zero rows -> 0."""
    from lowbit.formats.w8 import x_planes

    torch.manual_seed(0)
    x = torch.randn(5, 333) * torch.tensor([1e-3, 1.0, 50.0, 1e4, 0.0])[:, None]
    hi, lo, sx = x_planes(x)
    assert hi.dtype == lo.dtype == torch.int8 and hi.abs().max() <= 127 and lo.abs().max() <= 127
    back = sx[:, None] * (hi.float() + lo.float() / 254)
    amax = x.abs().amax(1, keepdim=True)
    assert ((back - x).abs() <= amax / 64516 * 1.001 + 1e-30).all()
    assert torch.equal(back[4], torch.zeros(333)) and torch.isfinite(sx).all()


@pytest.mark.interpreter
def test_x_planes_kernel_matches_reference():
    from lowbit.formats.w8 import x_planes
    from lowbit.kernels.w8_gemm import x_planes_triton

    x = torch.randn(3, 3001).bfloat16()  # more than one 2048-column block, K not a multiple of 4
    hi, lo, sx = x_planes_triton(x, 3004)
    r = x_planes(x)
    assert torch.equal(hi[:, :3001], r[0]) and torch.equal(lo[:, :3001], r[1]) and torch.equal(sx, r[2])
    assert not hi[:, 3001:].any() and not lo[:, 3001:].any()


@pytest.mark.interpreter
def test_gemv_and_gemm_paths_agree():
    """The dp4a GEMV (M = 1 by default; its grid takes more rows) and the tensor-core GEMM give the same sums."""
    from lowbit.kernels.w8_gemm import w8_gemm_triton

    c, s = quantize_w8(torch.randn(70, 256))
    x = torch.randn(3, 256).half()
    gemv = w8_gemm_triton(x, c, s, None, torch.float32, config=dict(GEMV=True, BLOCK_N=32, BLOCK_W=32, STAGES=1,
                                                                    num_warps=4))
    gemm = w8_gemm_triton(x, c, s, None, torch.float32, config=dict(GEMV=False, BLOCK_N=32, BLOCK_M=16,
                                                                    BLOCK_K=128, STAGES=1, num_warps=4))
    assert rel_l2(gemv, gemm) <= 1e-5


def test_format_roundtrip_and_edges():
    torch.manual_seed(0)
    w = torch.randn(64, 300)
    w[3] = 0.0  # all-zero row: codes 0, finite scale, dequantizes to 0 (no 0/0)
    w[5] = 1e-30  # amax below AMAX_EPS: the scale is floored (never 0), the row's codes are 0
    c, s = quantize_w8(w)
    assert c.dtype == torch.int8 and s.dtype == torch.float32 and c.abs().max() <= 127
    assert torch.isfinite(s).all() and (s > 0).all()
    d = dequantize_w8(c, s)
    assert torch.equal(d[3], torch.zeros(300)) and torch.isfinite(d).all()
    err = (d - w).abs() / s[:, None]
    assert err.max() <= 0.5 + 1e-6  # round to nearest on the stored scale
    normal = (torch.arange(64) != 3) & (torch.arange(64) != 5)
    assert c[normal].abs().amax(1).min() == 127 and c[5].abs().max() == 0  # largest |w| of a row -> 127
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_w8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_w8(torch.ones(3))


@pytest.mark.interpreter
@pytest.mark.parametrize("M,N,K", [(1, 50, 200), (3, 70, 129), (17, 33, 300), (40, 130, 64), (2, 1, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_vs_reference(M, N, K, dtype):
    """Shapes that are not multiples of the blocks (N, K, M masked), bias on half the cases."""
    from lowbit.kernels.w8_gemm import w8_gemm_triton

    torch.manual_seed(M * 7 + N)
    c, s = quantize_w8(torch.randn(N, K))
    x = torch.randn(M, K).to(dtype)
    b = torch.randn(N).to(dtype) if (M + N) % 2 else None
    y = w8_gemm_triton(x, c, s, b, dtype)
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_l2(y, gemm_ref(x, c, s, b, dtype)) <= _DT[dtype]
    y32 = w8_gemm_triton(x, c, s, b, torch.float32)  # the integer sums themselves (fp32 epilogue)
    assert rel_l2(y32, gemm_ref(x, c, s, b, torch.float32)) <= 1e-5


@pytest.mark.interpreter
@given(M=st.integers(1, 20), N=st.integers(1, 80), K=st.integers(1, 160))
def test_kernel_fuzz_shapes(M, N, K):
    from lowbit.kernels.w8_gemm import w8_gemm_triton

    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    c, s = quantize_w8(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g).half()
    assert rel_l2(w8_gemm_triton(x, c, s, None, torch.float32), gemm_ref(x, c, s, None, torch.float32)) <= 1e-5


def _args(dev="cpu", M=3, N=24, K=136, dtype=torch.bfloat16, bias=True):
    torch.manual_seed(0)
    c, s = quantize_w8(torch.randn(N, K, device=dev))
    x = torch.randn(M, K, device=dev, dtype=dtype)
    b = torch.randn(N, device=dev, dtype=dtype) if bias else None
    return x, c, s, b


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_x_row_gives_nonfinite_output_row(M, bad, dev):
    """A NaN or Inf in a row of x makes that row's output non-finite and leaves the other rows alone, on every path
    (the GEMV at M = 1, the GEMM, the reference). Session 33: the planes kernel's max skipped the NaN, so the row
    came out finite with its NaN element silently replaced."""
    torch.manual_seed(M)
    lin = torch.nn.Linear(200, 40).to(dev)
    m = lowbit.quantize_linear(lin, "w8")
    x = torch.randn(M, 200, device=dev)
    x[M // 2, 7] = bad
    y = m(x)
    fin = torch.isfinite(y).all(-1).tolist()
    assert fin == [i != M // 2 for i in range(M)]


def test_opcheck(dev):
    torch.library.opcheck(_w8_linear, _args(dev), test_utils=("test_schema", "test_faketensor",
                                                              "test_autograd_registration"))
    torch.library.opcheck(_w8_linear, _args(dev, bias=False, dtype=torch.float16),
                          test_utils=("test_schema", "test_faketensor"))


def test_op_matches_reference(dev):
    x, c, s, b = _args(dev)
    y = w8_linear(x.reshape(3, 1, -1), c, s, b)
    assert y.shape == (3, 1, 24)
    assert rel_l2(y.reshape(3, -1), gemm_ref(x, c, s, b, x.dtype)) <= KERNEL_VS_REF[torch.bfloat16]


def test_empty_shapes(dev):
    """No tokens, or K = 0 (the output is the bias, or 0): no crash, the right shapes."""
    s = torch.ones(5, device=dev)
    b = torch.arange(5, device=dev).to(torch.bfloat16)
    y = w8_linear(torch.randn(1, 0, device=dev, dtype=torch.bfloat16), torch.zeros(5, 0, dtype=torch.int8, device=dev),
                  s, b)
    assert torch.equal(y, b[None, :])
    assert w8_linear(torch.randn(2, 0, 8, device=dev, dtype=torch.bfloat16),
                     torch.zeros(5, 8, dtype=torch.int8, device=dev), s).shape == (2, 0, 5)


def test_bad_arguments_named():
    x, c, s, b = _args()
    with pytest.raises(TypeError, match="codes"):
        w8_linear(x, c.to(torch.int16), s, b)
    with pytest.raises(ValueError, match="K=136"):
        w8_linear(x[:, :100], c, s, b)
    with pytest.raises(ValueError, match="scale"):
        w8_linear(x, c, s[:3], b)
    with pytest.raises(TypeError, match="scale"):
        w8_linear(x, c, s.half(), b)
    with pytest.raises(ValueError, match="bias"):
        w8_linear(x, c, s, b[:3])
    with pytest.raises(TypeError, match="x"):
        w8_linear(x.to(torch.int8), c, s, b)
    with pytest.raises(ValueError, match="unit stride"):
        w8_linear(x[:, :68], c.t().contiguous().t()[:, :68], s, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_module_from_linear(dtype, dev, tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 48, bias=True).to(dev, dtype)
    q = lowbit.quantize_linear(lin, "w8")
    assert isinstance(q, W8Linear) and q.scheme == "w8" and q.codes.device.type == dev
    x = torch.randn(2, 5, 200, device=dev, dtype=dtype)
    assert rel_l2(q(x), lin(x)) < 2e-2  # ~1% weight error plus the output rounding
    w = lin.weight.detach().float()
    assert rel_l2(q.dequantize(), w) < 1e-2
    from safetensors.torch import load_file, save_file

    save_file(q.state_dict(), tmp_path / "w8.safetensors")
    q2 = W8Linear.empty(200, 48, True, dtype, **q.config()).to(dev)
    q2.load_state_dict(load_file(tmp_path / "w8.safetensors", device=dev))
    assert torch.equal(q2(x), q(x))
    with pytest.raises(ValueError, match="200 features"):
        q(torch.randn(2, 100, device=dev, dtype=dtype))


def test_compile_fullgraph(dev):
    q = lowbit.quantize_linear(torch.nn.Linear(64, 40).to(dev, torch.float16), "w8")
    x = torch.randn(3, 64, device=dev, dtype=torch.float16)
    f = torch.compile(q, fullgraph=True, backend="eager")
    assert torch.equal(f(x), q(x))


@pytest.mark.parametrize("recipe", ["fireq", "flute-nf4"])
def test_recipe_lm_head_w8(recipe, tmp_path):
    """``lm_head="w8"``: the head becomes a W8Linear (tied embedding kept float), greedy tokens survive a save /
    load, and an unknown scheme name is a clear error."""
    from tests._tiny_models import greedy, tiny_llama

    model = tiny_llama(head_dim=16, tie=True)
    emb = model.get_input_embeddings().weight.detach().clone()
    calib = [torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    opts = {"kv": None, "attention": None} if recipe == "fireq" else {}
    lowbit.quantize_model(model, recipe, calibration=calib, progress=False, lm_head="w8", **opts)
    assert isinstance(model.lm_head, W8Linear)
    assert torch.equal(model.get_input_embeddings().weight, emb) and model.config.tie_word_embeddings is False
    p = torch.tensor([5, 6, 7, 8])
    ref = greedy(model, p.unsqueeze(0), 5)[0]
    lowbit.save_quantized(model, tmp_path / "q")
    m2 = lowbit.load_quantized(tmp_path / "q")
    assert isinstance(m2.lm_head, W8Linear) and m2.lowbit_recipe["options"]["lm_head"] == "w8"
    assert torch.equal(greedy(m2, p.unsqueeze(0), 5)[0], ref)
    with pytest.raises(ValueError, match="lm_head must be"):
        lowbit.quantize_model(tiny_llama(head_dim=16), recipe, calibration=calib, progress=False, lm_head="w9",
                              **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 128256 // 8, 4096), (4, 1000, 4096), (3, 500, 1001), (16, 777, 1000),
                                   (100, 300, 10944)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernel(M, N, K, dtype):
    """Compiled kernels (dp4a GEMV at M <= 4 with K % 4 == 0, INT8 tensor cores otherwise) vs the reference, incl. a
    TP-shard K (10944) and K = 1001 (GEMM path at M = 3)."""
    torch.manual_seed(0)
    c, s = quantize_w8(torch.randn(N, K, device="cuda"))
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, device="cuda", dtype=dtype)
    y = w8_linear(x, c, s, b)
    assert rel_l2(y, gemm_ref(x, c, s, b, dtype)) <= KERNEL_VS_REF[dtype]
    from lowbit.kernels.w8_gemm import w8_gemm_triton

    assert rel_l2(w8_gemm_triton(x, c, s, None, torch.float32), gemm_ref(x, c, s, None, torch.float32)) <= 1e-5
