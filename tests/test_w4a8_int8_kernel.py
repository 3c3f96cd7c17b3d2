"""The W4A8 INT8 GEMM kernel (lowbit.kernels.w4a8_int8_gemm) under the interpreter (CPU) or on the
GPU, against the reference of the same numerics (lowbit.formats.w4a8_int8.gemm_ref)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowbit.formats import w4a8_int8 as fmt
from lowbit.formats.common import quantize_per_token
from lowbit.kernels.w4a8_int8_gemm import launch, pick_config, w4a8_int8_gemm_triton
from tolerances import KERNEL_VS_REF, rel_l2


def _case(M, N, K, g, dtype, dev, bias=False, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(N, K, device=dev)
    qw = fmt.quantize(w, g)
    x = torch.randn(M, K, device=dev, dtype=dtype)
    xq, xs = quantize_per_token(x, torch.int8)
    b = torch.randn(N, device=dev, dtype=dtype) if bias else None
    return qw, xq, xs, b


def _run(qw, xq, xs, b, dtype, config=None):
    y = w4a8_int8_gemm_triton(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b, xq.shape[1],
                              qw.effective_group_size, dtype, config=config)
    r = fmt.gemm_ref(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b, dtype)
    return y, r


@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference(M, dtype, dev):
    # N, K not multiples of the block sizes; K = 200 not a multiple of the group (padded to 256)
    qw, xq, xs, b = _case(M, 40, 200, 128, dtype, dev, bias=M % 2 == 1)
    y, r = _run(qw, xq, xs, b, dtype)
    assert y.dtype == dtype and y.shape == (M, 40)
    assert rel_l2(y, r) <= KERNEL_VS_REF[dtype]


@pytest.mark.parametrize("g,split,swap", [(128, 3, True), (256, 2, True), (64, 1, False), (128, 1, False)])
def test_kernel_groups_and_split_k(g, split, swap, dev):
    """split-K (3 splits over 4 tiles: the last split runs past Kp, masked), g256 (2 tiles per
    group), g64 (2 groups per tile: gathered); swap-AB on/off."""
    qw, xq, xs, b = _case(5, 24, 392, g, torch.float16, dev, bias=True)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=split, num_warps=4, num_stages=2, SWAP_AB=swap)
    y, r = _run(qw, xq, xs, b, torch.float16, config=cfg)
    assert rel_l2(y, r) <= KERNEL_VS_REF[torch.float16]
    y2, _ = _run(qw, xq, xs, b, torch.float16, config=cfg)  # split-K counters were re-armed
    assert torch.equal(y, y2)


def test_kernel_per_channel_and_small_groups(dev):
    for g, K in ((-1, 130), (32, 96), (96, 192), (48, 100)):
        qw, xq, xs, b = _case(3, 20, K, g, torch.bfloat16, dev)
        y, r = _run(qw, xq, xs, b, torch.bfloat16)
        assert rel_l2(y, r) <= KERNEL_VS_REF[torch.bfloat16], g


def test_all_zero_weight_groups_and_rows_give_zero(dev):
    w = torch.zeros(16, 256, device=dev)
    w[3, 128:] = torch.randn(128, device=dev)
    qw = fmt.quantize(w, 128)
    x = torch.randn(2, 256, device=dev, dtype=torch.float16)
    x[1] = 0  # an all-zero activation row too
    xq, xs = quantize_per_token(x, torch.int8)
    y = w4a8_int8_gemm_triton(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, 256, 128, torch.float16)
    assert torch.isfinite(y).all()
    assert (y[:, [i for i in range(16) if i != 3]] == 0).all() and (y[1] == 0).all()


@given(st.integers(1, 20), st.integers(1, 40), st.integers(2, 300))
def test_kernel_shapes_hypothesis(M, N, K):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    qw, xq, xs, b = _case(M, N, K, 64, torch.float16, dev, seed=M + N + K)
    y, r = _run(qw, xq, xs, b, torch.float16,
                config=dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=1, num_warps=4, num_stages=2))
    assert rel_l2(y, r) <= KERNEL_VS_REF[torch.float16]


def test_config_picker():
    c = pick_config(1, 4096, 4096, 128)
    assert 1 <= c["SPLIT_K"] <= 8
    assert pick_config(4096, 4096, 4096, 128)["SPLIT_K"] == 1


def test_launch_returns_compiled_kernel(dev):
    qw, xq, xs, b = _case(2, 16, 128, 128, torch.float16, dev)
    out, kern = launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, 128, 128, torch.float16)
    assert out.shape == (2, 16)
