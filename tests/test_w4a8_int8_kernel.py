"""The W4A8 INT8 GEMM kernel (lowbit.kernels.w4a8_int8_gemm) under the interpreter (CPU) or on the
GPU, against the reference of the same numerics (lowbit.formats.w4a8_int8.gemm_ref)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.formats import w4a8_int8 as fmt
from lowbit.formats.common import quantize_per_token
from lowbit.kernels.w4a8_int8_gemm import dequantize_w8, launch, pick_config, w4a8_int8_gemm_triton
from tolerances import KERNEL_VS_REF, rel_l2
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)


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
    dev = "cuda" if GPU else "cpu"
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


@pytest.mark.parametrize("M,N,K,g", [(5, 24, 392, 128), (3, 20, 130, -1), (4, 16, 200, 64), (2, 8, 192, 96)])
def test_dequantize_w8_and_w8_gemm(M, N, K, g, dev):
    """Large-M path: dequantize_w8 == the format's dequantize_int8 (padded columns too), and the W8A8
    GEMM on it is bit-equal to the in-register path (both exact INT32 sums, same epilogue); split-K
    (3 splits, the last past Kp) and swap-AB on/off."""
    from lowbit.kernels.w4a8_int8_gemm import dequantize_w8

    qw, xq, xs, b = _case(M, N, K, g, torch.float16, dev, bias=True)
    w8 = dequantize_w8(qw.qweight, qw.gscale, qw.gzs, block_n=16, chunks=3)
    assert torch.equal(w8, fmt.dequantize_int8(qw.qweight, qw.gscale, qw.gzs))
    y0, r = _run(qw, xq, xs, b, torch.float16)
    for swap, split in ((False, 1), (True, 3)):
        cfg = dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=split, num_warps=4, num_stages=2, SWAP_AB=swap)
        y, _ = launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b, K, qw.effective_group_size,
                      torch.float16, config=cfg, w8=w8)
        assert torch.equal(y, y0), (swap, split)
    assert rel_l2(y0, r) <= KERNEL_VS_REF[torch.float16]


@pytest.mark.parametrize("M,N,K,g,bm,split,swap,w8", [
    (130, 72, 400, 128, 128, 1, True, False),   # two row tiles (the second mostly past M), K % 128 != 0
    (70, 40, 1024, 64, 64, 3, True, False),     # split-K, groups gathered per column
    (20, 48, 256, -1, 16, 1, False, False),     # per-channel, no swap
    (130, 64, 384, 128, 64, 2, False, True),    # the W8 path ([BLOCK_M, 128] boxes)
])
def test_xtma_activation_boxes_bit_equal(M, N, K, g, bm, split, swap, w8, dev):
    """``XTMA`` (session 29): x tiles by TMA boxes (rows >= M and columns >= K read as 0; those rows are never
    stored) give the pointer-load launch's output bit for bit, in-register and W8 paths."""
    qw, xq, xs, b = _case(M, N, K, g, torch.bfloat16, dev, bias=True, seed=M + K)
    cfg = dict(BLOCK_M=bm, BLOCK_N=64, SPLIT_K=split, num_warps=4, num_stages=3, SWAP_AB=swap)
    kw = {"w8": dequantize_w8(qw.qweight, qw.gscale, qw.gzs)} if w8 else {}
    outs = [launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b, K, qw.effective_group_size, torch.bfloat16,
                   config=dict(cfg, XTMA=t), **kw)[0] for t in (False, True)]
    assert torch.equal(outs[0], outs[1])


@settings(max_examples=6, deadline=None)
@given(st.integers(1, 200), st.integers(1, 130), st.integers(2, 600), st.sampled_from([16, 64, 128]))
def test_xtma_fuzz(M, N, K, bm):
    """Random shapes (K % 16 != 0 falls back to pointer loads): ``XTMA`` equals the pointer loads bit for bit."""
    dev = "cuda" if GPU else "cpu"
    qw, xq, xs, b = _case(M, N, K, 128, torch.bfloat16, dev, seed=M * 7 + N + K)
    cfg = dict(BLOCK_M=bm, BLOCK_N=64, SPLIT_K=1, num_warps=4, num_stages=2, SWAP_AB=True)
    outs = [launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b, K, qw.effective_group_size, torch.bfloat16,
                   config=dict(cfg, XTMA=t))[0] for t in (False, True)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kstep,split", [(2, 1), (2, 3), (4, 2)])
def test_kstep_and_l2_prefetch(kstep, split, dev):
    """KSTEP chunks per loop iteration (splits rounded to a multiple of it; the last one runs past Kp,
    masked) and the per-iteration L2 prefetch give the same integers (g128, g64 gather, per-channel)."""
    for g, K in ((128, 700), (64, 392), (-1, 300)):
        qw, xq, xs, b = _case(3, 24, K, g, torch.bfloat16, dev, seed=K)
        y0, r = _run(qw, xq, xs, b, torch.bfloat16)
        cfg = dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=split, num_warps=4, num_stages=2, KSTEP=kstep, PF_DIST=2)
        y, _ = _run(qw, xq, xs, b, torch.bfloat16, config=cfg)
        assert torch.equal(y, y0), g


def test_w8_dispatch(monkeypatch, dev):
    """w4a8_int8_gemm_triton switches to dequantize_w8 + the W8A8 GEMM at M >= W8_MIN_M (same output)."""
    from lowbit.kernels import w4a8_int8_gemm as kmod

    qw, xq, xs, b = _case(20, 16, 256, 128, torch.bfloat16, dev)
    y0, _ = _run(qw, xq, xs, b, torch.bfloat16)
    calls = []
    real = kmod.dequantize_w8
    monkeypatch.setattr(kmod, "W8_MIN_M", 16)
    monkeypatch.setattr(kmod, "W8_MIN_K", 0)
    monkeypatch.setattr(kmod, "W8_CONFIG", (16, 16, 4, 2, {}))
    monkeypatch.setattr(kmod, "dequantize_w8", lambda *a, **k: calls.append(1) or real(*a, **k))
    y, _ = _run(qw, xq, xs, b, torch.bfloat16)
    assert calls and torch.equal(y, y0)


def test_row_tiled_codes(dev):
    """tile_codes / untile_codes are inverse; the kernel on tiled codes (W_TILED) gives the
    reference's integers exactly (N not a multiple of 64: tail rows row-major; BLOCK_N 32/64/128,
    split-K). float32 output: the interpreter truncates fp32 -> bf16."""
    for N, K, g in ((130, 392, 128), (64, 256, -1), (20, 130, 64)):
        qw, xq, xs, b = _case(2, N, K, g, torch.float32, dev, seed=N)
        t = fmt.tile_codes(qw.qweight)
        assert torch.equal(fmt.untile_codes(t), qw.qweight)
        r = fmt.gemm_ref(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, torch.float32)
        for bn, split in ((64, 1), (128, 2), (32, 1)):
            cfg = dict(BLOCK_M=16, BLOCK_N=bn, SPLIT_K=split, num_warps=4, num_stages=2)
            y, _ = launch(xq, xs, t, qw.wscale, qw.gscale, qw.gzs, None, K, qw.effective_group_size,
                          torch.float32, config=cfg, tiled=True)
            assert torch.equal(y, r), (N, bn, split)
        assert torch.equal(fmt.gemm_ref(xq, xs, t, qw.wscale, qw.gscale, qw.gzs, None, torch.float32, tiled=True), r)
        # the large-M path: dequantize_w8 reads tiled codes into the same row-major int8 weight
        w8 = dequantize_w8(t, qw.gscale, qw.gzs, tiled=True)
        assert torch.equal(w8, dequantize_w8(qw.qweight, qw.gscale, qw.gzs))
        assert torch.equal(w8[:, :K], fmt.dequantize_int8(t, qw.gscale, qw.gzs, K, tiled=True))
    with pytest.raises(ValueError, match="tiled="):
        launch(xq, xs, t, qw.wscale, qw.gscale, qw.gzs, None, K, qw.effective_group_size, torch.float32,
               config=dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=1, num_warps=4, num_stages=2, W_TILED=True))


@pytest.mark.parametrize("bn,split,kstep,tiled", [(64, 1, 1, False), (128, 2, 2, False), (32, 3, 1, True), (64, 2, 4, True)])
def test_dp4a_decode_path(bn, split, kstep, tiled, dev):
    """M = 1 on CUDA cores (DP4A: dp4a on the GPU, plain products here): the reference's integers
    exactly (float32 output), with split-K, KSTEP, row-tiled codes, g128 / g64 / per-channel."""
    for N, K, g in ((130, 392, 128), (20, 130, 64), (64, 256, -1)):
        qw, xq, xs, _ = _case(1, N, K, g, torch.float32, dev, seed=N + bn)
        r = fmt.gemm_ref(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, torch.float32)
        q = fmt.tile_codes(qw.qweight) if tiled else qw.qweight
        cfg = dict(BLOCK_M=16, BLOCK_N=bn, SPLIT_K=split, num_warps=4, num_stages=1, DP4A=True, KSTEP=kstep)
        y, _ = launch(xq, xs, q, qw.wscale, qw.gscale, qw.gzs, None, K, qw.effective_group_size, torch.float32,
                      config=cfg, tiled=tiled)
        assert torch.equal(y, r), (N, g)
    with pytest.raises(ValueError, match="DP4A"):
        qw, xq, xs, _ = _case(2, 16, 128, 128, torch.float32, dev)
        launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, 128, 128, torch.float32,
               config=dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=1, num_warps=4, num_stages=1, DP4A=True))


@pytest.mark.parametrize("N,K", [(130, 392), (70, 8320)])
def test_tiled_m1_default_config(N, K, dev):
    """M = 1 on row-tiled codes with the default config (dp4a, KSTEP 8 up to K = 8192, else KSTEP 4 with
    8 warps): the reference's integers exactly; row-major codes keep their own M = 1 rule."""
    from lowbit.kernels import w4a8_int8_gemm as km

    cfg = km.pick_config(1, N, K, 128, tiled=True)
    assert cfg["DP4A"] and cfg["KSTEP"] == (8 if K <= km.DP4A_TILED_K8_MAX_K else 4)
    assert "DP4A" not in km.pick_config(1, 28672, 4096, 128)  # row-major gate_up: wgmma
    old = km.DP4A_M1_MAX_N
    try:
        km.DP4A_M1_MAX_N = {"rows": 0, "tiled": 0}  # dp4a off (the model bench's +dp4a0)
        assert "DP4A" not in km.pick_config(1, N, K, 128, tiled=True)
    finally:
        km.DP4A_M1_MAX_N = old
    qw, xq, xs, _ = _case(1, N, K, 128, torch.float32, dev, seed=K)
    r = fmt.gemm_ref(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, torch.float32)
    y = w4a8_int8_gemm_triton(xq, xs, fmt.tile_codes(qw.qweight), qw.wscale, qw.gscale, qw.gzs, None, K, 128,
                              torch.float32, tiled=True)
    assert torch.equal(y, r)


@given(st.integers(1, 3), st.integers(1, 200), st.integers(2, 400), st.sampled_from([128, 64, -1]))
def test_tiled_default_path_hypothesis(M, N, K, g):
    """Row-tiled codes through the default dispatch (M = 1: the tiled dp4a config; M > 1: wgmma tiles):
    the reference's integers exactly (float32 out), any N (tail rows below a 64-row block stay row-major)."""
    dev = "cuda" if GPU else "cpu"
    qw, xq, xs, _ = _case(M, N, K, g, torch.float32, dev, seed=M * 1000 + N + K)
    r = fmt.gemm_ref(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, torch.float32)
    y = w4a8_int8_gemm_triton(xq, xs, fmt.tile_codes(qw.qweight), qw.wscale, qw.gscale, qw.gzs, None, K,
                              qw.effective_group_size, torch.float32, tiled=True)
    assert torch.equal(y, r)


def test_mid_bucket_split_rule():
    """65..128 tokens (session 30): split-K aimed at one program per SM, one more split where that leaves fewer than
    0.8 programs per SM; the FILL knob never reaches the kernel's launch config."""
    from lowbit.kernels.w4a8_int8_gemm import CONFIGS, pick_config

    def split(M, N, K):
        cfg = pick_config(M, N, K, 128, tiled=True)
        assert "FILL" not in cfg
        return cfg["SPLIT_K"]

    assert split(128, 4096, 4096) == 2  # 64 tiles -> 128 programs
    assert split(128, 6144, 4096) == 2  # 96 tiles -> 96 programs < 0.8 x 132 -> one more split
    assert split(96, 1536, 4096) == 5  # tensor-parallel qkv shard: 24 tiles -> 120 programs
    assert split(128, 28672, 4096) == 1
    assert split(64, 4096, 4096) == 4  # the 64-token bucket keeps 2 programs per SM
    assert "FILL" in CONFIGS[128][6]  # the table itself is not mutated by pick_config
    for M, N, K in [(100, 1000, 10944), (77, 64, 640), (128, 333, 256)]:
        s = split(M, N, K)
        assert s == 1 or -(-K // 128) // s >= 4
