"""The W4A8 INT8 GEMM's newer paths under the interpreter (CPU) or on the GPU: per-token INT8
quantization fused into the GEMM (FUSE_QUANT), group parameters loaded as 32-bit words
(GS_WORDS), one-step-ahead prefetch, unrolled split-K reduction; the op ``lowbit::w4a8_int8_linear``."""
import pytest
import torch

from lowbit.formats import w4a8_int8 as fmt
from lowbit.formats.common import quantize_per_token
from lowbit.kernels import w4a8_int8_gemm as kmod
from lowbit.kernels.w4a8_int8_gemm import launch, use_fused_quant
from lowbit.ops.w4a8_int8 import _w4a8_int8_linear, w4a8_int8_linear
from tolerances import KERNEL_VS_REF, rel_l2


def _weights(N, K, g, dev, seed=0):
    torch.manual_seed(seed)
    return fmt.quantize(torch.randn(N, K, device=dev), g)


def _two_step(x, qw, b, cfg=None):
    xq, xs = quantize_per_token(x, torch.int8)
    y, _ = launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b, x.shape[1], qw.effective_group_size,
                  x.dtype, config=cfg)
    return y, fmt.gemm_ref(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b, x.dtype)


def _fused(x, qw, b, cfg):
    y, _ = launch(x, None, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b, x.shape[1], qw.effective_group_size,
                  x.dtype, config=cfg)
    return y


@pytest.mark.parametrize("M,N,K,g,split", [(1, 40, 200, 128, 2), (3, 24, 520, 128, 3), (17, 20, 392, 64, 1),
                                           (2, 16, 130, -1, 1)])
def test_fused_quant_equals_two_step(M, N, K, g, split, dev):
    """Bit-identical to quantize_per_token + the GEMM (same INT8 codes, same INT32 sums): N, K not
    multiples of the blocks, split-K running past Kp, g64 gather, per-channel, M = 17 (BLOCK_M 32)."""
    qw = _weights(N, K, g, dev)
    torch.manual_seed(1)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16) * 3
    b = torch.randn(N, device=dev, dtype=torch.bfloat16) if M % 2 else None
    bm = 16 if M <= 16 else 32
    cfg = dict(BLOCK_M=bm, BLOCK_N=16, SPLIT_K=split, num_warps=4, num_stages=2)
    y = _fused(x, qw, b, cfg)
    y2, r = _two_step(x, qw, b, cfg)
    assert torch.equal(y, y2)
    assert rel_l2(y, r) <= KERNEL_VS_REF[torch.bfloat16]  # the interpreter truncates fp32 -> bf16


def test_fused_quant_zero_and_nan_rows(dev):
    qw = _weights(16, 256, 128, dev)
    x = torch.randn(3, 256, device=dev, dtype=torch.float16)
    x[1] = 0  # all-zero row: scale AMAX_EPS/127, codes 0, output exactly 0 (no 0/0)
    x[2, 5] = float("nan")
    cfg = dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=2, num_warps=4, num_stages=2)
    y = _fused(x, qw, None, cfg)
    assert (y[1] == 0).all() and torch.isfinite(y[0]).all() and torch.isnan(y[2]).all()
    y2, _ = _two_step(x[:2], qw, None, cfg)
    assert torch.equal(y[:2], y2)


def test_fused_quant_tiny_rows_fp32(dev):
    """Tiny amax (1e-30: scale clamps at AMAX_EPS/127, no overflow) and fp32 activations."""
    qw = _weights(8, 128, 128, dev)
    x = torch.full((2, 128), 1e-30, device=dev)
    x[1] = torch.linspace(-1, 1, 128, device=dev)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=1, num_warps=4, num_stages=2)
    y = _fused(x, qw, None, cfg)
    y2, r = _two_step(x, qw, None, cfg)
    assert torch.isfinite(y).all() and torch.equal(y, y2) and rel_l2(y, r) < 1e-6


@pytest.mark.parametrize("words,prefetch,unroll,join", [(True, False, True, False), (True, True, False, True),
                                                        (False, True, True, False), (False, False, False, True)])
def test_group_words_prefetch_reduce_variants(words, prefetch, unroll, join, dev):
    """G = 4 and G = 5 groups (words read from the flat bytes), and N * G = 115 (not a multiple of
    4: no word view, byte loads); JOIN_K (one K = 128 dot per tile); all variants bit-identical."""
    for N, K in ((24, 512), (24, 600), (23, 600)):
        qw = _weights(N, K, 128, dev)
        torch.manual_seed(2)
        x = torch.randn(5, K, device=dev, dtype=torch.float16)
        cfg = dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=3, num_warps=4, num_stages=2, GS_WORDS=words,
                   PREFETCH=prefetch, UNROLL_REDUCE=unroll, JOIN_K=join)
        y, r = _two_step(x, qw, None, cfg)
        assert torch.equal(y, r), (K, words, prefetch, unroll)


def test_fused_quant_rule(monkeypatch):
    assert not use_fused_quant(1, 4096, 4096, 128)  # off by default since session 11 (FUSE_QUANT_MAX_M = 0)
    monkeypatch.setattr(kmod, "FUSE_QUANT_MAX_M", 1)
    assert use_fused_quant(1, 4096, 4096, 128) and use_fused_quant(1, 6144, 4096, 128)
    assert not use_fused_quant(1, 28672, 4096, 128)  # no split: 32 k-tiles per program
    assert not use_fused_quant(4, 4096, 4096, 128) and not use_fused_quant(0, 4096, 4096, 128)


def test_linear_op_fused_and_unfused_paths(dev, monkeypatch):
    qw = _weights(24, 200, 128, dev)
    monkeypatch.setattr(kmod, "FUSE_QUANT_MAX_TILES", 1 << 20)
    monkeypatch.setattr(kmod, "FUSE_QUANT_MAX_M", 2)
    assert use_fused_quant(2, 24, 256, 128) and not use_fused_quant(5, 24, 256, 128)
    for M in (1, 2, 5):
        torch.manual_seed(M)
        x = torch.randn(M, 200, device=dev, dtype=torch.float16)
        y = w4a8_int8_linear(x, qw.qweight, qw.wscale, qw.gscale, qw.gzs)
        xq, xs = quantize_per_token(x, torch.int8)
        r = fmt.gemm_ref(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, x.dtype)
        assert torch.equal(y, r), M


def test_linear_opcheck(dev):
    qw = _weights(16, 136, 128, dev)
    x = torch.randn(2, 136, device=dev, dtype=torch.float16)
    b = torch.randn(16, device=dev, dtype=torch.float16)
    torch.library.opcheck(_w4a8_int8_linear, (x, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_fused_rejects_too_many_rows(dev):
    qw = _weights(16, 128, 128, dev)
    x = torch.randn(20, 128, device=dev, dtype=torch.float16)
    with pytest.raises(ValueError, match="M <= BLOCK_M"):
        _fused(x, qw, None, dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=1, num_warps=4, num_stages=2))


@pytest.mark.parametrize("M", [1, 3, 5])
def test_silu_mul_linear(M, dev, monkeypatch):
    """down(silu(gate) * up) from the gate_up output: fused (small M) and act_quant + GEMM paths give
    the same codes as act_quant's silu_mul quantization; vs the eager reference within tolerance."""
    from lowbit.ops.w4a8_int8 import w4a8_int8_gemm, w4a8_int8_silu_mul_linear
    from lowbit.ops.quant import per_token_quant

    monkeypatch.setattr(kmod, "FUSE_SILU_MAX_M", 4)  # M <= 4 in the GEMM (off by default), M = 5 act_quant
    inter = 200  # K = 200: not a multiple of the block
    qw = _weights(24, inter, 128, dev)
    torch.manual_seed(M)
    h = torch.randn(M, 2 * inter, device=dev, dtype=torch.float16) * 2
    h[0, :inter] = 0  # an all-zero gate row: output row 0
    y = w4a8_int8_silu_mul_linear(h, qw.qweight, qw.wscale, qw.gscale, qw.gzs)
    assert (y[0] == 0).all()
    g, u = h[:, :inter], h[:, inter:]
    from lowbit._utils import use_triton

    if use_triton(h):
        from lowbit.kernels.act_quant import per_token_quant_triton

        q, s = per_token_quant_triton(g, torch.int8, fuse="silu_mul", up=u)
    else:
        q, s = per_token_quant((torch.nn.functional.silu(g) * u).to(h.dtype), "int8")
    y2 = w4a8_int8_gemm(q, s, qw.qweight, qw.wscale, qw.gscale, qw.gzs, out_dtype=h.dtype)
    assert torch.equal(y, y2)
    v = (torch.nn.functional.silu(g.float()).half() * u).half()
    xq, xs = quantize_per_token(v, torch.int8)
    r = fmt.gemm_ref(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, h.dtype)
    assert rel_l2(y, r) <= KERNEL_VS_REF[torch.float16]


@pytest.mark.parametrize("l2_tiles", [0, 4])
def test_linear_pdl_path_same_output(dev, monkeypatch, l2_tiles):
    """act-quant -> GEMM as a programmatic dependent pair (``PDL_MAX_M``; a real PDL launch on Hopper,
    the plain launch under the interpreter) with and without the L2 prefetch of the first k-tiles: the
    same output as the default path, bit for bit (split-K 2, N and K not multiples of the blocks)."""
    qw = _weights(40, 300, 128, dev)
    monkeypatch.setattr(kmod, "FUSE_QUANT_MAX_M", 0)
    for M in (1, 5):
        torch.manual_seed(M)
        x = torch.randn(M, 300, device=dev, dtype=torch.bfloat16)
        monkeypatch.setattr(kmod, "PDL_MAX_M", 0)
        y0 = w4a8_int8_linear(x, qw.qweight, qw.wscale, qw.gscale, qw.gzs)
        monkeypatch.setattr(kmod, "PDL_MAX_M", 16)
        monkeypatch.setattr(kmod, "PDL_L2_TILES", l2_tiles)
        assert kmod.use_pdl(M)
        y = w4a8_int8_linear(x, qw.qweight, qw.wscale, qw.gscale, qw.gzs)
        assert torch.equal(y, y0), M
        xq, xs = quantize_per_token(x, torch.int8)
        cfg = dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=2, num_warps=4, num_stages=2)
        y1, _ = launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, 300, 128, x.dtype, config=cfg, pdl=True)
        y2, _ = launch(xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, None, 300, 128, x.dtype, config=cfg)
        assert torch.equal(y1, y2), M
