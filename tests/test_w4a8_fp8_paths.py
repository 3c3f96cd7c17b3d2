"""w4a8-fp8 session-2 paths under the interpreter: activation quantization fused into the GEMM
(decode), single-launch split-K, dequantize-once + FP8 GEMM (large M), and the op/module dispatch."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowbit.formats.common import FP8_E4M3, quantize_per_token
from lowbit.formats.common import interleave_rows
from lowbit.formats.w4a8_fp8 import quantize_weight, reference_gemm, reference_linear
from tests.tolerances import KERNEL_VS_REF, rel_l2
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)

DEV = "cuda" if GPU else "cpu"
# kernel vs reference_gemm (float64): the interpreter sums in fp32; Hopper's FP8 MMA sums its products with ~14 bits
# before the fp32 promotion (4.9e-5 .. 1.03e-4 measured by these tests on the H200, session 16)
SAME_REF = 1e-5 if DEV == "cpu" else 2e-4


def _weights(N, K, g, seed=0, silu=False, zero_group=True):
    torch.manual_seed(seed)
    w = torch.randn(N, K) * 0.05
    if zero_group and N > 1 and K >= g:
        w[1, :g] = 0
    if silu:
        w = interleave_rows(w[: N // 2], w[N // 2:])
    codes, sc, inv = quantize_weight(w.to(DEV), g, 3)  # on the GPU when there is one (large N x K tests)
    return codes, sc, inv.item()


@pytest.mark.parametrize("M,N,K,g,split,kw", [
    (1, 72, 200, 128, 1, {}),                      # N, K not multiples of the blocks
    (3, 64, 576, 64, 1, {"bias": True}),           # 3 rows packed into a 16-row tile (stride 4)
    (17, 40, 160, 32, 1, {"res": True}),           # K not a multiple of the group... of 128
    (2, 96, 520, 128, 3, {"bias": True, "res": True}),  # split-K, single launch
    (5, 128, 300, 64, 2, {"silu": True, "dtype": torch.float16}),
])
def test_fused_quant_equals_separate_quant(M, N, K, g, split, kw):
    """The fused kernel gives the same output as act_quant + GEMM (bit for bit: same codes, same
    scales, same dot order) and matches the float64 reference."""
    from lowbit.kernels.act_quant import per_token_quant_triton
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm, w4a8_fp8_linear_fused

    dt = kw.get("dtype", torch.bfloat16)
    silu = kw.get("silu", False)
    codes, sc, inv = _weights(N, K, g, silu=silu)
    torch.manual_seed(M)
    x = (torch.randn(M, K) * 3).to(dt).to(DEV)
    x[M // 2] = 0  # all-zero row
    nout = N // 2 if silu else N
    b = torch.randn(N).to(dt).to(DEV) if kw.get("bias") else None
    r = torch.randn(M, nout).to(dt).to(DEV) if kw.get("res") else None
    cfg = dict(pick_config(M, N, K), BLOCK_N=64, num_stages=2, SPLIT_K=split)
    y = w4a8_fp8_linear_fused(x, codes, sc, inv, K, g, bias=b, residual=r, silu_mul=silu, config=cfg)
    xq, sx = per_token_quant_triton(x, FP8_E4M3)
    y2 = w4a8_fp8_gemm(xq, sx, codes, sc, inv, K, g, bias=b, residual=r, silu_mul=silu, out_dtype=dt, config=cfg)
    assert y.shape == (M, nout) and y.dtype == dt
    assert torch.equal(y, y2)
    ref = reference_linear(x.cpu(), codes.cpu(), sc.cpu(), inv, K, g, None if b is None else b.cpu(),
                           residual=None if r is None else r.cpu(), silu_mul=silu)
    assert rel_l2(y.cpu(), ref) < KERNEL_VS_REF[dt]
    if b is None and r is None:
        assert y[M // 2].eq(0).all()


def test_fused_quant_nan_row_and_tiny_rows():
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_linear_fused

    codes, sc, inv = _weights(64, 256, 128)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    x[2] = 1e-30  # tiny amax: scale floored at AMAX_EPS / 448, no overflow
    y = w4a8_fp8_linear_fused(x.to(DEV), codes, sc, inv, 256, 128).cpu()
    assert torch.isnan(y[1]).all()
    assert torch.isfinite(y[[0, 2, 3]]).all()
    ref = reference_linear(x[[0, 2, 3]], codes.cpu(), sc.cpu(), inv, 256, 128)
    assert rel_l2(y[[0, 2, 3]], ref) < KERNEL_VS_REF[torch.bfloat16]


@pytest.mark.parametrize("sem", [True, False])
def test_split_k_single_launch_and_reduce_kernel_agree(sem):
    from lowbit._utils import ARRIVAL_COUNTERS
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    codes, sc, inv = _weights(64, 640, 128, seed=2)
    xq, sx = quantize_per_token(torch.randn(3, 640), FP8_E4M3)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=5, SWAP_AB=True, num_warps=4, num_stages=2, GROUP_M=1, SK_SEM=sem)
    y = w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, 640, 128, out_dtype=torch.float32, config=cfg)
    ref = reference_gemm(xq, sx, codes.cpu(), sc.cpu(), inv, 640, 128, out_dtype=torch.float32)
    # no ACC_TILE here: on Hopper the FP8 MMA sums each 64 products with ~14 bits before the FP32 promotion
    assert rel_l2(y.cpu(), ref) < (1e-5 if DEV == "cpu" else 2e-4)
    if sem:  # the counters are left at zero for the next call
        assert all(int(b.abs().sum()) == 0 for b in ARRIVAL_COUNTERS.values())


@pytest.mark.parametrize("mode", ["dequant", "scaled_mm"])
def test_dequantize_once_paths(mode):
    """Large-M path: FP8(q*sigma) written once, then a plain FP8 GEMM (Triton ``W_FP8``, or
    ``torch._scaled_mm`` on the GPU -- on the CPU/interpreter it falls back to the Triton one)."""
    from lowbit.formats.w4a8_fp8 import dequantize_weight
    from lowbit.kernels.w4a8_fp8_gemm import dequantize_to_fp8, w4a8_fp8_gemm

    M, N, K, g = 20, 96, 200, 64  # K not a multiple of 128 nor of the group
    codes, sc, inv = _weights(N, K, g, seed=3, silu=True)
    wf = dequantize_to_fp8(codes, sc, K, g)
    assert wf.shape == (N, 256) and wf.dtype == FP8_E4M3
    assert torch.equal(wf[:, :K].float().cpu(), dequantize_weight(codes.cpu(), sc.cpu(), K, g))
    assert wf[:, K:].float().eq(0).all()
    # fp16 on the CPU: the interpreter truncates fp32->bf16 in the SiLU*mul epilogue (see
    # test_w4a8_fp8.py); on the GPU bf16, which _scaled_mm's row-wise mode needs
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    torch.manual_seed(4)
    x = torch.randn(M, K, dtype=dt)
    x[3] = 0
    xq, sx = quantize_per_token(x, FP8_E4M3)
    b = torch.randn(N, dtype=dt)
    r = torch.randn(M, N // 2, dtype=dt)
    cfg = dict(MODE=mode, BLOCK_M=16, BLOCK_N=32, SPLIT_K=1, SWAP_AB=False, num_warps=4, num_stages=2, GROUP_M=2,
               ACC_TILE=True)
    y = w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, bias=b.to(DEV), residual=r.to(DEV),
                      silu_mul=True, out_dtype=dt, config=cfg)
    ref = reference_gemm(xq, sx, codes.cpu(), sc.cpu(), inv, K, g, b, residual=r, silu_mul=True, out_dtype=dt)
    assert rel_l2(y.cpu(), ref) < KERNEL_VS_REF[dt]
    # plain (no epilogue extras): the zero row stays exactly zero
    y = w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, config=cfg)
    assert y[3].eq(0).all()


def test_dequantize_to_fp8_into_a_given_buffer():
    """``out=``: rows of a wider reused buffer (a row-slice view, row stride > Kp) get exactly the values of the
    allocating call, the rows around them are untouched; a wrong dtype / shape / column stride is refused by name."""
    from lowbit.kernels.w4a8_fp8_gemm import dequantize_to_fp8

    N, K, g = 70, 200, 64  # N not a multiple of the 64-row block, K not of 128
    codes, sc, _ = _weights(N, K, g, seed=5)
    want = dequantize_to_fp8(codes, sc, K, g)
    buf = torch.full((N + 8, 384), 7, dtype=torch.uint8, device=DEV).view(FP8_E4M3)
    got = dequantize_to_fp8(codes[10:60], sc[10:60], K, g, out=buf[4:54, :256])
    assert got.data_ptr() == buf[4:54].data_ptr()
    assert torch.equal(buf[4:54, :256].view(torch.uint8), want[10:60].view(torch.uint8))
    assert buf[:4].view(torch.uint8).eq(7).all() and buf[54:].view(torch.uint8).eq(7).all()
    assert buf[:, 256:].view(torch.uint8).eq(7).all()
    with pytest.raises(TypeError, match="out"):
        dequantize_to_fp8(codes, sc, K, g, out=torch.empty(N, 256, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="out"):
        dequantize_to_fp8(codes, sc, K, g, out=torch.empty(N, 128, dtype=FP8_E4M3, device=DEV))
    with pytest.raises(ValueError, match="out"):
        dequantize_to_fp8(codes, sc, K, g, out=torch.empty(256, N, dtype=FP8_E4M3, device=DEV).t())


def test_module_forward_dispatch_small_and_large_m(monkeypatch):
    """W4A8FP8Linear.forward: M <= FUSED_QUANT_MAX_M goes through lowbit::w4a8_fp8_linear_fused,
    larger M through per_token_quant + lowbit::w4a8_fp8_gemm; both equal the reference."""
    import lowbit.ops.w4a8_fp8 as ops
    from lowbit.kernels import w4a8_fp8_gemm as kmod
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    torch.manual_seed(5)
    lin = torch.nn.Linear(160, 40, bias=True).to(torch.bfloat16)
    m = W4A8FP8Linear.from_linear(lin, group_size=32)
    calls = []
    real = ops._w4a8_fp8_linear_fused
    monkeypatch.setattr(ops, "_w4a8_fp8_linear_fused", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(kmod, "FUSED_QUANT_MAX_M", 4)
    for shape in [(1, 160), (2, 2, 160), (3, 3, 160)]:
        x = torch.randn(*shape, dtype=torch.bfloat16)
        y = m(x)
        ref = reference_linear(x, m.codes, m.scales, m.inv_delta, 160, 32, m.bias)
        assert y.shape == ref.shape and rel_l2(y, ref) < KERNEL_VS_REF[torch.bfloat16]
    assert calls == [1, 4]


def test_pdl_linear_dispatch_and_opcheck(monkeypatch):
    """use_pdl_linear (M <= PDL_LINEAR_MAX_M, or <= PDL_NOSPLIT_MAX_M without split-K) runs lowbit::w4a8_fp8_linear_pdl (act_quant + GEMM, both PDL-launched on a
    Hopper GPU): the same output as the separate ops; the op passes opcheck."""
    import lowbit.ops.w4a8_fp8 as ops
    from lowbit.kernels import w4a8_fp8_gemm as kmod
    from lowbit.nn.w4a8_fp8 import W4A8FP8Linear

    torch.manual_seed(6)
    lin = torch.nn.Linear(160, 40, bias=True).to(torch.bfloat16)
    m = W4A8FP8Linear.from_linear(lin, group_size=32).to(DEV)
    calls = []
    real = ops._w4a8_fp8_linear_pdl
    monkeypatch.setattr(ops, "_w4a8_fp8_linear_pdl", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    ys = {}
    for lim in (0, 4):
        monkeypatch.setattr(kmod, "PDL_LINEAR_MAX_M", lim)
        monkeypatch.setattr(kmod, "PDL_NOSPLIT_MAX_M", lim)
        ys[lim] = [m(x) for x in (torch.randn(3, 160, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)).to(DEV),
                                  torch.randn(9, 160, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2)).to(DEV))]
    assert calls == [3]
    assert all(torch.equal(a, b) for a, b in zip(ys[0], ys[4]))
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    codes, sc, inv = _weights(16, 64, 32)
    x = torch.randn(2, 64, dtype=torch.bfloat16, device=DEV)
    torch.library.opcheck(real, (x, codes, sc, inv, 64, 32, None, None, False), test_utils=utils)


def test_fused_op_opcheck():
    from lowbit.ops.w4a8_fp8 import _w4a8_fp8_linear_fused

    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    codes, sc, inv = _weights(16, 64, 32)
    x = torch.randn(2, 64, dtype=torch.bfloat16, device=DEV)  # the weights' device
    torch.library.opcheck(_w4a8_fp8_linear_fused, (x, codes, sc, inv, 64, 32, None, None, False), test_utils=utils)


def _rnd32(x):
    """Exact rational -> nearest float32 (ties to even), as a Fraction."""
    from fractions import Fraction as F

    if x == 0:
        return F(0)
    sgn, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if F(2) ** e > a:
        e -= 1
    ulp = F(2) ** (max(e, -126) - 23)
    q = a / ulp
    n = q.numerator // q.denominator
    r = q - n
    if r > F(1, 2) or (r == F(1, 2) and n % 2):
        n += 1
    return sgn * n * ulp


def test_fused_quant_division_is_ieee_quotient():
    """The fused kernel's division-free quotient (y = v r, two fma corrections with r = 1/s correctly
    rounded; ``_quant_rows``) equals the IEEE fp32 quotient v / s that act_quant and the reference
    compute -- checked in exact rational arithmetic with every fma rounded once."""
    import numpy as np
    from fractions import Fraction as F

    rng = np.random.default_rng(0)
    for i in range(1500):
        amax = float(np.float32(abs(rng.standard_normal()) * 10 ** rng.uniform(-6, 4)))
        v = amax if i % 5 == 0 else float(np.float32(amax * rng.uniform(-1, 1)))
        s = _rnd32(F(amax) / 448)
        r = _rnd32(1 / s)
        y = _rnd32(F(v) * r)
        for _ in range(2):
            y = _rnd32(_rnd32(F(v) - s * y) * r + y)
        assert y == _rnd32(F(v) / s), (v, amax)


@pytest.mark.parametrize("res,block,dt", [(False, 1, torch.float16), (True, 1, torch.float16),
                                          (False, 8, torch.bfloat16), (True, 8, torch.float16)])
def test_silu_mul_pass(res, block, dt):
    """The one-pass SiLU*mul (+ residual) after a GEMM without the epilogue (w4a8-fp8's torch._scaled_mm path:
    block 1; the LUT kernels: block 8): ``silu_mul_ref``'s roundings, n not a multiple of the kernel's BLOCK."""
    from lowbit.formats.common import silu_mul_ref
    from lowbit.kernels.silu_mul import silu_mul_triton

    torch.manual_seed(7)
    M, n = 3, 1104
    y = torch.randn(M, 2 * n).to(dt).to(DEV)
    r = torch.randn(M, n).to(dt).to(DEV)
    out = silu_mul_triton(y, block=block, residual=r if res else None)
    ref = silu_mul_ref(y.cpu(), block)
    if res:
        ref = (ref.float() + r.cpu().float()).to(dt)
    assert rel_l2(out.cpu(), ref) < 1e-3
    with pytest.raises(ValueError, match="block"):
        silu_mul_triton(y[:, : 2 * n - block], block=block)


@pytest.mark.parametrize("kstep,split,mode,g", [(2, 1, "fused", 128), (2, 2, "fused", 32), (3, 1, "dequant", 64)])
def test_kstep_several_k_tiles_per_iteration(kstep, split, mode, g):
    """KSTEP K tiles per loop iteration (the last step masked when the tile count is not a multiple):
    the same result as the reference, with and without split-K, fused dequant and W_FP8."""
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    K = 5 * 128 - 40  # 5 K tiles, the last partial
    codes, sc, inv = _weights(72, K, g, seed=4)
    xq, sx = quantize_per_token(torch.randn(2, K), FP8_E4M3)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=split, SWAP_AB=True, num_warps=4, num_stages=2, GROUP_M=1,
               KSTEP=kstep, MODE=mode)
    y = w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, out_dtype=torch.float32, config=cfg)
    ref = reference_gemm(xq, sx, codes.cpu(), sc.cpu(), inv, K, g, out_dtype=torch.float32)
    assert rel_l2(y.cpu(), ref) < SAME_REF


@pytest.mark.parametrize("M,N,K,g,cfg", [
    (1, 200, 600, 128, {}),                                   # rows beyond N: the TMA box reads zeros
    (3, 128, 1000, 32, {"SPLIT_K": 2}),
    (2, 72, 520, 64, {"SPLIT_K": 3, "KSTEP": 2}),
])
def test_tma_code_loads(M, N, K, g, cfg):
    """Codes loaded through a host TMA descriptor (``TMA=True``) give the reference result."""
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    codes, sc, inv = _weights(N, K, g, seed=6)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    c = dict(dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=1, SWAP_AB=True, num_warps=4, num_stages=2, GROUP_M=1, TMA=True),
             **cfg)
    y = w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, out_dtype=torch.float32, config=c)
    ref = reference_gemm(xq, sx, codes.cpu(), sc.cpu(), inv, K, g, out_dtype=torch.float32)
    assert rel_l2(y.cpu(), ref) < SAME_REF


@pytest.mark.parametrize("M,N,K,g,cfg", [
    (1, 72, 600, 128, {}),                                   # N, K not multiples of the blocks
    (3, 64, 520, 32, {"SPLIT_K": 3, "KSTEP": 2, "TMA": True}),  # last step masked, TMA codes
    (20, 40, 300, 64, {"QUANT": True}),                      # activation quantization in the GEMM
    (130, 64, 576, 128, {"BLOCK_M": 64, "SWAP_AB": False}),  # no swap
])
def test_cat_one_dot_per_k_tile(M, N, K, g, cfg):
    """``CAT``: [w_lo | w_hi] joined along K into one K=128 dot per tile against the whole x tile
    gives the two-dot result: bit for bit on the GPU (the same k32 wgmma steps in the same order);
    the interpreter's numpy dot may sum 128 products in another order (float32 rounding only)."""
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm, w4a8_fp8_linear_fused

    codes, sc, inv = _weights(N, K, g, seed=12)
    x = torch.randn(M, K)
    xq, sx = quantize_per_token(x, FP8_E4M3)
    cfg = dict(cfg)
    quant = cfg.pop("QUANT", False)
    base = dict(dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=1, SWAP_AB=True, num_warps=4, num_stages=2, GROUP_M=1,
                     ACC_TILE=True), **cfg)
    outs = []
    for cat in (False, True):
        c = dict(base, CAT=cat)
        if quant:
            outs.append(w4a8_fp8_linear_fused(x.to(DEV), codes, sc, inv, K, g, out_dtype=torch.float32, config=c))
        else:
            outs.append(w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, out_dtype=torch.float32, config=c))
    if DEV == "cuda":
        assert torch.equal(outs[0], outs[1])
    else:
        assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    ref = reference_gemm(xq, sx, codes.cpu(), sc.cpu(), inv, K, g, out_dtype=torch.float32)
    assert rel_l2(outs[1].cpu(), ref) < SAME_REF


@pytest.mark.parametrize("M,N,K,g,split", [(130, 72, 600, 128, 1), (70, 64, 900, 32, 3), (200, 40, 128, 64, 1)])
def test_defer_promotion_is_bit_equal(M, N, K, g, split):
    """``DEFER`` (the mid-M default): each K tile's product is added one iteration later; the same
    sums in the same order, so the output equals the undeferred one bit for bit (one K tile included)."""
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    codes, sc, inv = _weights(N, K, g, seed=13)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    base = dict(pick_config(M, N, K), SPLIT_K=split)
    assert base.get("DEFER") and base["CAT"] and base["SWAP_AB"]
    outs = [w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, out_dtype=torch.float32,
                          config=dict(base, DEFER=d)) for d in (False, True)]
    assert torch.equal(outs[0], outs[1])
    ref = reference_gemm(xq, sx, codes.cpu(), sc.cpu(), inv, K, g, out_dtype=torch.float32)
    assert rel_l2(outs[1].cpu(), ref) < (1e-5 if DEV == "cpu" else 3e-4)  # GPU: FP8 MMA sums within a K tile


@pytest.mark.parametrize("M,N,K,g,full,split,kw", [
    (130, 320, 600, 128, 2, 2, {}),                  # 2 m-tiles, 5 n-tiles: 2 whole, 3 split in 2
    (70, 200, 900, 32, 1, 3, {"bias": True}),       # ragged N (4 n-tiles, the last one partial), K % 128 != 0
    (90, 256, 1100, 64, 3, 4, {"silu": True}),      # SiLU*mul epilogue, one split tile
])
def test_hybrid_split_whole_tiles_then_split_tail(M, N, K, g, full, split, kw):
    """``HYB_FULL`` (session 29): the first ``full`` n-tiles run whole, the rest split-K in the same launch. Each output
    column equals bit for bit the launch that runs its tile the same way (SPLIT_K 1 for the whole tiles, ``split``
    for the rest)."""
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    silu = kw.get("silu", False)
    codes, sc, inv = _weights(N, K, g, seed=29, silu=silu)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    bias = torch.randn(N // 2 if silu else N).to(DEV) if kw.get("bias") else None
    base = dict(pick_config(M, N, K))
    assert base["BLOCK_N"] == 64 and base["SWAP_AB"]
    run = lambda **c: w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, out_dtype=torch.float32, bias=bias,
                                    silu_mul=silu, config=dict(base, **c))
    whole, splitk, hyb = run(SPLIT_K=1), run(SPLIT_K=split), run(SPLIT_K=split, HYB_FULL=full)
    cut = full * 64 // (2 if silu else 1)
    assert torch.equal(hyb[:, :cut], whole[:, :cut])
    assert torch.equal(hyb[:, cut:], splitk[:, cut:])
    again = run(SPLIT_K=split, HYB_FULL=full)  # the arrival counters were reset by the last arrivers
    assert torch.equal(again, hyb)


@pytest.mark.parametrize("M,N,K,g,split", [(130, 200, 576, 64, 1), (70, 64, 1088, 128, 2), (200, 128, 128, 32, 1)])
def test_xtma_activation_boxes_bit_equal(M, N, K, g, split):
    """``XTMA`` (session 29): the mid-M path reads each ``[128, 128]`` x tile by TMA (rows >= M and columns >= K
    read as 0, as the masked loads give): the output equals the pointer-load launch bit for bit."""
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    codes, sc, inv = _weights(N, K, g, seed=41)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    base = dict(pick_config(M, N, K), SPLIT_K=split)
    assert base["CAT"] and base.get("KSTEP", 1) == 1
    outs = [w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, out_dtype=torch.float32,
                          config=dict(base, XTMA=t)) for t in (False, True)]
    assert torch.equal(outs[0], outs[1])


@settings(max_examples=6, deadline=None)
@given(M=st.integers(1, 300), N=st.integers(1, 400), K=st.integers(1, 700), g=st.sampled_from((32, 64, 128)),
       full=st.integers(0, 6))
def test_xtma_and_hybrid_fuzz(M, N, K, g, full):
    """Random shapes (K % 16 != 0 falls back to pointer loads): ``XTMA`` equals the pointer loads bit for bit, and a
    hybrid split over the same launch stays within the kernel tolerance of the reference."""
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    codes, sc, inv = _weights(N, K, g, seed=M + N + K)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    base = dict(pick_config(M, N, K), BLOCK_N=64)
    run = lambda **c: w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g, out_dtype=torch.float32,
                                    config=dict(base, **c))
    if base.get("CAT") and base.get("KSTEP", 1) == 1:
        assert torch.equal(run(XTMA=False), run(XTMA=True))
    ref = reference_gemm(xq, sx, codes.cpu(), sc.cpu(), inv, K, g, out_dtype=torch.float32)
    hyb = run(SPLIT_K=2, HYB_FULL=full)
    assert rel_l2(hyb.cpu(), ref) < SAME_REF


def test_hybrid_split_rule():
    """``hybrid_split``: only when the tiles overflow whole waves by at most half a wave; ``pick_config`` applies it
    to the mid-M configs at 2 programs per SM (session 29's measured cases) and switches to dequantize-once at 384."""
    from lowbit.kernels.w4a8_fp8_gemm import DEQUANT_MIN_M, MID_CTAS_PER_SM, hybrid_split, pick_config

    assert hybrid_split(448, 1, 32, 264) == {}  # 264 + 184: more than half a wave left
    assert hybrid_split(448, 2, 32, 264) == {"SPLIT_K": 2, "HYB_FULL": 396}  # 3 waves + 104 tiles
    assert hybrid_split(96, 3, 32, 264) == {"SPLIT_K": 2, "HYB_FULL": 88}  # 264 + 24
    assert hybrid_split(200, 1, 32, 264) == {}  # one wave
    assert hybrid_split(448, 2, 4, 264) == {}  # too few K tiles to split
    assert MID_CTAS_PER_SM == 2 and DEQUANT_MIN_M == 384
    assert pick_config(256, 28672, 4096).get("HYB_FULL") == 396
    assert "HYB_FULL" not in pick_config(128, 28672, 4096)
    assert pick_config(320, 6144, 4096).get("HYB_FULL") == 88
    assert pick_config(384, 6144, 4096)["MODE"] == "scaled_mm"
    assert pick_config(128, 28672, 4096)["XTMA"] and pick_config(64, 4096, 4096)["XTMA"]
    assert not pick_config(16, 4096, 4096)["XTMA"]


def test_mid_split_rule():
    """Mid-M split-K (session 30, ``MID_SPLIT = "auto"``): within one program per SM below 64 K tiles, at least one
    program per SM from 64 K tiles (long-K down), and never fewer than 4 K tiles per split."""
    from lowbit.kernels.w4a8_fp8_gemm import pick_config

    assert pick_config(128, 6144, 4096)["SPLIT_K"] == 1  # 96 tiles
    assert pick_config(128, 4096, 4096)["SPLIT_K"] == 2  # 64 tiles -> 128 programs
    assert pick_config(256, 4096, 4096)["SPLIT_K"] == 1  # 128 tiles
    assert pick_config(128, 1536, 4096)["SPLIT_K"] == 4  # tensor-parallel qkv shard: 24 tiles -> 96 programs
    assert pick_config(128, 4096, 14336)["SPLIT_K"] == 4  # long K: 64 tiles -> 256 programs
    assert pick_config(256, 4096, 11008)["SPLIT_K"] == 2
    assert pick_config(128, 256, 512)["SPLIT_K"] == 1  # 4 K tiles: one split
    for M, N, K in [(96, 1000, 10944), (200, 4096, 1024), (300, 333, 4096), (100, 64, 640)]:
        split = pick_config(M, N, K)["SPLIT_K"]
        assert split == 1 or -(-K // 128) // split >= 4


def test_decode_split_rule():
    """Decode split-K (session 31): 2 programs per SM at 16 tokens, 1.5 at 32 / 64 (``DECODE_SPLIT_PER_SM``; fewer
    fp32 partials where each weighs more), each split keeping >= 8 K tiles at 64 tokens and on the long-K tiles,
    >= 4 otherwise."""
    from lowbit.kernels.w4a8_fp8_gemm import pick_config

    assert pick_config(16, 4096, 4096)["SPLIT_K"] == 8  # 64 tiles -> 512 programs (>= 264)
    assert pick_config(64, 4096, 4096)["SPLIT_K"] == 4  # 256 programs (>= 198)
    assert pick_config(32, 14336, 4096)["SPLIT_K"] == 1  # 224 tiles
    assert pick_config(16, 14336, 4096)["SPLIT_K"] == 2
    assert pick_config(64, 6144, 4096)["SPLIT_K"] == 4  # 96 tiles: 192 < 198 programs at split 2
    assert pick_config(64, 1536, 4096)["SPLIT_K"] == 4  # 24 tiles; >= 8 K tiles per split at 64 tokens
    assert pick_config(16, 1536, 4096)["SPLIT_K"] == 8  # >= 4 at 16
    assert pick_config(16, 2048, 10944)["SPLIT_K"] == 8  # long K: 86 K tiles, >= 8 per split
    assert pick_config(16, 4096, 14336)["SPLIT_K"] == 8
    for M, N, K in [(1, 1000, 10944), (33, 4096, 1024), (64, 333, 4096), (17, 64, 640)]:
        split = pick_config(M, N, K)["SPLIT_K"]
        assert split == 1 or -(-K // 128) // split >= 4


@settings(max_examples=300, deadline=None)
@given(M=st.integers(1, 2048), N=st.integers(1, 140000), K=st.integers(1, 30000))
def test_pick_config_is_legal(M, N, K):
    """Every shape gets a launchable plan: split-K >= 1 and never more splits than K tiles allow (the rule's
    minimum K tiles per split, 4 below the decode paths' own minimum), tile sizes from the swept set, the
    dequantize-once path from ``DEQUANT_MIN_M`` tokens."""
    from lowbit.kernels import w4a8_fp8_gemm as W

    cfg = W.pick_config(M, N, K)
    k_tiles = -(-K // 128)
    split = cfg["SPLIT_K"]
    assert split >= 1 and (split == 1 or k_tiles // split >= 4)
    if M >= W.DEQUANT_MIN_M:
        assert cfg["MODE"] == W.DEQUANT_GEMM
        return
    assert cfg["BLOCK_M"] in (16, 32, 64, 128) and cfg["BLOCK_N"] in (64, 128) and cfg["SWAP_AB"]
    if M <= 64 and cfg["BLOCK_N"] == 64:
        assert split == 1 or k_tiles // split >= W.DECODE_MIN_K_TILES[cfg["BLOCK_M"]]
    if M <= 64 and cfg["BLOCK_N"] == 128 and k_tiles >= 64:
        assert split == 1 or k_tiles // split >= W.LONG_K_MIN_K_TILES
    if "HYB_FULL" in cfg:
        assert cfg["SPLIT_K"] == 2 and 0 < cfg["HYB_FULL"] < -(-N // 64)


def test_hybrid_split_config_errors():
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    M, N, K, g = 100, 256, 512, 128
    codes, sc, inv = _weights(N, K, g, seed=3)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    with pytest.raises(ValueError, match="HYB_FULL"):
        w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, g,
                      config=dict(pick_config(M, N, K), SPLIT_K=2, HYB_FULL=1, SK_SEM=False))


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 17000, 1000), (5, 2 * 8448, 4096), (3, 4096, 10944)])
def test_decode_defaults_on_gpu(M, N, K):
    """The decode defaults with TMA code loads, word scale loads and KSTEP (N >= 128 x #SMs, or long
    K) against the reference on the GPU."""
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    assert pick_config(M, N, K).get("TMA")
    codes, sc, inv = _weights(N, K, 128, seed=8)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    y = w4a8_fp8_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, 128, out_dtype=torch.float32)
    ref = reference_gemm(xq.to(DEV), sx.to(DEV), codes, sc, inv, K, 128, out_dtype=torch.float32)  # float64 on the GPU
    assert rel_l2(y, ref) < 1e-3


# ---------------------------------------------------------------- tile-major codes (session 4)
def test_tile_codes_layout():
    """tile_codes puts each (128 rows x 128 columns) tile in one contiguous 8 KB block, block
    (nb, kt) at rows (nb * Kp/128 + kt) * 128; untile_codes inverts it; the reference dequantizes
    tiled codes to the same weight; a wrong shape is a clear error."""
    from lowbit.formats.w4a8_fp8 import dequantize_weight, tile_codes, tiled_shape, untile_codes

    codes, sc, _ = _weights(200, 576, 64)
    codes, sc = codes.cpu(), sc.cpu()
    t = tile_codes(codes)
    assert tuple(t.shape) == tiled_shape(200, 576) == (2 * 5 * 128, 64)
    assert torch.equal(t[3 * 128:4 * 128], codes[:128, 3 * 64:4 * 64])  # block (0, 3)
    assert torch.equal(t[(5 + 1) * 128:(5 + 1) * 128 + 72], codes[128:, 64:128])  # block (1, 1)
    assert t[(5 + 1) * 128 + 72:(5 + 2) * 128].eq(0).all()  # rows beyond N are zero
    assert torch.equal(untile_codes(t, 200, 576), codes)
    assert torch.equal(dequantize_weight(t, sc, 576, 64, tiled=True), dequantize_weight(codes, sc, 576, 64))
    with pytest.raises(ValueError, match="tiled codes"):
        untile_codes(t[:-128], 200, 576)


@pytest.mark.parametrize("M,N,K,g,cfg", [
    (3, 200, 576, 128, {}),                                                     # K = 576, N % 128 != 0
    (2, 72, 10944, 64, {"SPLIT_K": 4}),                                         # K = 10944 (Llama-2 down-like)
    (1, 136, 600, 32, {"BLOCK_N": 128, "TMA": True, "KSTEP": 2}),                # TMA box of the 8 KB block
    (5, 200, 1000, 64, {"TMA": True, "KSTEP": 2, "SPLIT_K": 3}),               # 64-row half blocks, last step masked
    (2, 130, 300, 128, {"BLOCK_N": 128, "LUT": False, "SWORD": False}),        # arithmetic dequant, word loads
    (20, 72, 200, 64, {"MODE": "dequant", "BLOCK_M": 32, "SWAP_AB": False}),   # dequantize-once path
])
def test_tiled_codes_kernel_equals_row_major(M, N, K, g, cfg):
    """The kernel on tile-major codes (``tiled=True``) gives bit for bit the row-major result
    (same bytes, same arithmetic) and the reference of the tiled codes."""
    from lowbit.formats.w4a8_fp8 import tile_codes
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    codes, sc, inv = _weights(N, K, g, seed=9)
    torch.manual_seed(M + K)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    c = dict(dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=1, SWAP_AB=True, num_warps=4, num_stages=2, GROUP_M=1), **cfg)
    xq, sx = xq.to(DEV), sx.to(DEV)
    tc = tile_codes(codes)
    y0 = w4a8_fp8_gemm(xq, sx, codes, sc, inv, K, g, out_dtype=torch.float32, config=c)
    y1 = w4a8_fp8_gemm(xq, sx, tc, sc, inv, K, g, out_dtype=torch.float32, config=c, tiled=True)
    assert torch.equal(y0, y1)
    ref = reference_gemm(xq.cpu(), sx.cpu(), tc.cpu(), sc.cpu(), inv, K, g, out_dtype=torch.float32, tiled=True)
    assert rel_l2(y1.cpu(), ref) < SAME_REF


def test_tiled_codes_errors():
    """Row-major codes passed as tiled (or a BLOCK_N that does not divide 128) -> clear errors."""
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm
    from lowbit.formats.w4a8_fp8 import tile_codes

    codes, sc, inv = _weights(200, 576, 128)
    xq, sx = quantize_per_token(torch.randn(2, 576), FP8_E4M3)
    xq, sx = xq.to(DEV), sx.to(DEV)
    with pytest.raises(ValueError, match="tile-major codes must have shape"):
        w4a8_fp8_gemm(xq, sx, codes, sc, inv, 576, 128, tiled=True)
    cfg = dict(BLOCK_M=16, BLOCK_N=256, SPLIT_K=1, SWAP_AB=True, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="BLOCK_N dividing 128"):
        w4a8_fp8_gemm(xq, sx, tile_codes(codes), sc, inv, 576, 128, tiled=True, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 17000, 1000), (3, 4096, 10944), (128, 1000, 4096)])
def test_tiled_defaults_on_gpu(M, N, K):
    """Tile-major codes with the default configs (TMA 8 KB boxes at decode) on the GPU: bit-equal
    to the row-major layout and the reference."""
    from lowbit.formats.w4a8_fp8 import tile_codes
    from lowbit.kernels.w4a8_fp8_gemm import w4a8_fp8_gemm

    codes, sc, inv = _weights(N, K, 128, seed=10)
    xq, sx = quantize_per_token(torch.randn(M, K), FP8_E4M3)
    xq, sx = xq.to(DEV), sx.to(DEV)
    y0 = w4a8_fp8_gemm(xq, sx, codes, sc, inv, K, 128, out_dtype=torch.float32)
    y1 = w4a8_fp8_gemm(xq, sx, tile_codes(codes), sc, inv, K, 128, out_dtype=torch.float32, tiled=True)
    assert torch.equal(y0, y1)
    ref = reference_gemm(xq, sx, codes, sc, inv, K, 128, out_dtype=torch.float32)  # float64 on the GPU
    assert rel_l2(y1, ref) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 28672, 4096), (16, 4096, 14336), (128, 1000, 576)])
def test_pdl_launch_on_gpu(M, N, K):
    """Programmatic dependent launch of act_quant -> GEMM (and LUT2 dequant) gives bit for bit the
    plain launch's codes, scales and output."""
    from lowbit.kernels.act_quant import per_token_quant_triton
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    codes, sc, inv = _weights(N, K, 128, seed=11)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    xq0, sx0 = per_token_quant_triton(x, FP8_E4M3, pdl=False)
    y0 = w4a8_fp8_gemm(xq0, sx0, codes, sc, inv, K, 128, config=dict(pick_config(M, N, K), PDL=False))
    for it in range(3):
        xq1, sx1 = per_token_quant_triton(x, FP8_E4M3, pdl=True)
        y1 = w4a8_fp8_gemm(xq1, sx1, codes, sc, inv, K, 128, config=dict(pick_config(M, N, K), PDL=True, LUT2=True,
                                                                          CAT=it > 0, PDL_TRIGGER=it != 2))
        assert torch.equal(xq1.view(torch.int8), xq0.view(torch.int8)) and torch.equal(sx1, sx0)
        assert torch.equal(y1, y0)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 28672, 4096), (16, 4096, 14336)])
def test_pdl_linear_in_cuda_graph(M, N, K):
    """The PDL act_quant -> GEMM pair (op lowbit::w4a8_fp8_linear_pdl) captured in a CUDA graph
    replays to the eager output of the plain (non-PDL) path, with the decode candidate flags."""
    from lowbit._utils import capture_cuda_graph
    from lowbit.kernels import w4a8_fp8_gemm as kmod
    from lowbit.ops.w4a8_fp8 import _w4a8_fp8_linear_pdl, w4a8_fp8_gemm
    from lowbit.ops.quant import per_token_quant

    codes, sc, inv = _weights(N, K, 128, seed=13)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    y0 = w4a8_fp8_gemm(*per_token_quant(x, "fp8"), codes, sc, inv, K, 128, out_dtype=torch.bfloat16)
    old = dict(kmod.DECODE_FLAGS)
    try:
        kmod.DECODE_FLAGS.update(LUT2=True, CAT=True)
        graph, out = capture_cuda_graph(lambda: _w4a8_fp8_linear_pdl(x, codes, sc, inv, K, 128, None, None, False))
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, y0)
    finally:
        kmod.DECODE_FLAGS.clear()
        kmod.DECODE_FLAGS.update(old)


@pytest.mark.gpu
def test_split_k_on_two_streams_at_once():
    """Single-launch split-K GEMMs of one family on two CUDA streams at once (session 29: the arrival counters are per
    stream): every output equals the same launch run alone, bit for bit, over many interleaved launches."""
    from lowbit.kernels.w4a8_fp8_gemm import pick_config, w4a8_fp8_gemm

    M, N, K, g = 4, 4096, 14336, 128  # the long-K decode config: split-K over many programs
    codes, sc, inv = _weights(N, K, g, seed=5)
    xs = [quantize_per_token(torch.randn(M, K, generator=torch.Generator().manual_seed(i)), FP8_E4M3) for i in (0, 1)]
    xs = [(a.to(DEV), b.to(DEV)) for a, b in xs]
    cfg = pick_config(M, N, K)
    assert cfg["SPLIT_K"] > 1
    ref = [w4a8_fp8_gemm(a, b, codes, sc, inv, K, g, out_dtype=torch.float32, config=cfg) for a, b in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[], []]
    torch.cuda.synchronize()
    for _ in range(50):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(w4a8_fp8_gemm(*xs[i], codes, sc, inv, K, g, out_dtype=torch.float32, config=cfg))
    torch.cuda.synchronize()
    for i in (0, 1):
        assert all(torch.equal(y, ref[i]) for y in outs[i]), i
