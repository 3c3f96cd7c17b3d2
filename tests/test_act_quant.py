"""Per-token activation quantization kernel (lowbit.kernels.act_quant) vs the reference
``lowbit.formats.common.quantize_per_token``: bit-exact codes and scales under the interpreter."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowbit.formats.common import FP8_E4M3, quantize_per_token
from lowbit.kernels.act_quant import per_token_quant_triton
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)

DTYPES = (FP8_E4M3, torch.int8)
DEV = "cuda" if GPU else "cpu"


def _assert_same(q, s, qr, sr):
    assert q.dtype == qr.dtype and q.shape == qr.shape and s.shape == sr.shape
    assert s.dtype == torch.float32
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.int8), qr.view(torch.int8))


@given(m=st.integers(1, 5), k=st.integers(1, 300), out=st.sampled_from(DTYPES),
       xdt=st.sampled_from((torch.float16, torch.bfloat16, torch.float32)))
def test_matches_reference(m, k, out, xdt):
    dev = DEV
    torch.manual_seed(k)
    x = (torch.randn(m, k) * torch.rand(m, 1) * 10).to(xdt).to(dev)
    q, s = per_token_quant_triton(x, out)
    _assert_same(q.cpu(), s.cpu(), *quantize_per_token(x.cpu(), out))


@pytest.mark.parametrize("out", DTYPES)
def test_zero_rows_tiny_amax_and_3d(dev, out):
    x = torch.zeros(2, 3, 37, dtype=torch.bfloat16)
    x[0, 1] = 1e-30  # bf16 keeps the tiny value; scale must stay finite and > 0
    x[1, 2, 5] = -3.0
    q, s = per_token_quant_triton(x.to(dev), out)
    assert q.shape == x.shape and s.shape == (2, 3)
    assert torch.isfinite(s).all() and (s > 0).all()
    _assert_same(q.cpu(), s.cpu(), *quantize_per_token(x, out))


@pytest.mark.parametrize("out", DTYPES)
def test_long_row_chunked_path(dev, out, monkeypatch):
    import lowbit.kernels.act_quant as aq

    monkeypatch.setattr(aq, "_SINGLE_MAX", 64)  # force the multi-chunk walk on a small row
    x = torch.randn(3, 4096 + 77, dtype=torch.float16)
    x[1, 4100] = 80.0  # row max in the last (partial) chunk
    q, s = aq.per_token_quant_triton(x.to(dev), out)
    _assert_same(q.cpu(), s.cpu(), *quantize_per_token(x, out))


def test_fused_rmsnorm(dev):
    torch.manual_seed(0)
    x = torch.randn(4, 96, dtype=torch.bfloat16) * 3
    w = torch.rand(96, dtype=torch.bfloat16) + 0.5
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    qr, sr = quantize_per_token(w * h, FP8_E4M3)
    q, s = per_token_quant_triton(x.to(dev), FP8_E4M3, fuse="rmsnorm", weight=w.to(dev), eps=1e-5)
    # rstd's reduction order may flip a bf16 rounding of the row max (h, then w * h: two roundings),
    # which shifts the scale by up to two bf16 ulps (2^-6; 1.15% measured under the interpreter of the
    # H200 machine's numpy, session 16) and some codes by one FP8 step: judge by the error against the
    # float value, which must be that of FP8 quantization itself (the reference's own error ~2.5%)
    torch.testing.assert_close(s.cpu(), sr, rtol=2.0 ** -6, atol=0)
    v = (w * h).float()
    err = (q.cpu().float() * s.cpu()[:, None] - v).norm() / v.norm()
    err_ref = (qr.float() * sr[:, None] - v).norm() / v.norm()
    assert err < 1.2 * err_ref + 1e-3


def test_fused_silu_mul(dev):
    torch.manual_seed(1)
    g = torch.randn(3, 130, dtype=torch.float16) * 2
    u = torch.randn(3, 130, dtype=torch.float16)
    v = torch.nn.functional.silu(g) * u
    qr, sr = quantize_per_token(v, torch.int8)
    q, s = per_token_quant_triton(g.to(dev), torch.int8, fuse="silu_mul", up=u.to(dev))
    torch.testing.assert_close(s.cpu(), sr, rtol=1e-2, atol=0)
    assert (q.cpu().int() - qr.int()).abs().max() <= 1


def test_bad_args(dev):
    with pytest.raises(TypeError, match="x"):
        per_token_quant_triton(torch.zeros(2, 4, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match="dtype"):
        per_token_quant_triton(torch.zeros(2, 4, device=dev), torch.float16)
    with pytest.raises(ValueError, match="weight"):
        per_token_quant_triton(torch.zeros(2, 4, device=dev), fuse="rmsnorm", weight=torch.ones(3, device=dev))


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float16])
def test_fused_residual_add(dev, xdt, chunked, monkeypatch):
    """``add=``: the residual add fused before the RMSNorm (session 10). The returned sum equals torch's
    ``x + add`` bit for bit (bf16 rounded half-even also under the interpreter), and the codes / scales
    (and the float rows) equal the same kernel run on that sum; ragged K, one- and multi-chunk rows."""
    import lowbit.kernels.act_quant as aq

    if chunked:
        monkeypatch.setattr(aq, "_SINGLE_MAX", 64)
    torch.manual_seed(0)
    x = (torch.randn(4, 203) * 3).to(xdt).to(dev)
    d = torch.randn(4, 203).to(xdt).to(dev)
    w = (torch.rand(203) + 0.5).to(xdt).to(dev)
    r_ref = x + d
    for out in DTYPES:
        q, s, r = aq.per_token_quant_triton(x, out, fuse="rmsnorm", weight=w, eps=1e-5, add=d)
        assert torch.equal(r, r_ref)
        qr, sr = aq.per_token_quant_triton(r_ref, out, fuse="rmsnorm", weight=w, eps=1e-5)
        _assert_same(q.cpu(), s.cpu(), qr.cpu(), sr.cpu())
    y, r = aq.fused_rows_triton(x, fuse="rmsnorm", weight=w, eps=1e-5, add=d)
    assert torch.equal(r, r_ref)
    assert torch.equal(y, aq.fused_rows_triton(r_ref, fuse="rmsnorm", weight=w, eps=1e-5))
    with pytest.raises(ValueError, match="add="):
        aq.per_token_quant_triton(x, FP8_E4M3, add=d)
    with pytest.raises(ValueError, match="add"):
        aq.fused_rows_triton(x, fuse="rmsnorm", weight=w, add=d[:, :7])


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 4), k=st.integers(1, 300), xdt=st.sampled_from((torch.float16, torch.bfloat16, torch.float32)),
       quant=st.booleans(), chunked=st.booleans(), lead3=st.booleans())
def test_fused_residual_add_fuzz(m, k, xdt, quant, chunked, lead3):
    """``add=`` over row counts, ragged K, dtypes (fp32 too), 2-D and 3-D inputs, one- and multi-chunk rows:
    the sum is torch's ``x + add`` bit for bit and the output equals the kernel on that sum."""
    import lowbit.kernels.act_quant as aq

    torch.manual_seed(k * 7 + m)
    shape = (m, 1, k) if lead3 else (m, k)
    x = (torch.randn(shape) * 5).to(xdt).to(DEV)
    d = torch.randn(shape).to(xdt).to(DEV)
    w = (torch.rand(k) + 0.5).to(xdt).to(DEV)
    old = aq._SINGLE_MAX
    aq._SINGLE_MAX = 16 if chunked else old
    try:
        if quant:
            q, s, r = aq.per_token_quant_triton(x, torch.int8, fuse="rmsnorm", weight=w, eps=1e-6, add=d)
            q0, s0 = aq.per_token_quant_triton(x + d, torch.int8, fuse="rmsnorm", weight=w, eps=1e-6)
            assert torch.equal(q, q0) and torch.equal(s, s0) and s.shape == shape[:-1]
        else:
            y, r = aq.fused_rows_triton(x, fuse="rmsnorm", weight=w, eps=1e-6, add=d)
            assert torch.equal(y, aq.fused_rows_triton(x + d, fuse="rmsnorm", weight=w, eps=1e-6))
        assert torch.equal(r, x + d) and r.shape == shape
    finally:
        aq._SINGLE_MAX = old


def test_op_dispatches_to_kernel(dev):
    from lowbit.ops.quant import per_token_quant

    x = torch.randn(5, 33, dtype=torch.bfloat16, device=dev)
    q, s = per_token_quant(x, "fp8")
    _assert_same(q.cpu(), s.cpu(), *quantize_per_token(x.cpu(), FP8_E4M3))


@pytest.mark.parametrize("chunked", [False, True])
def test_nan_inf_rows_give_nan_scale(dev, chunked, monkeypatch):
    import lowbit.kernels.act_quant as aq

    if chunked:
        monkeypatch.setattr(aq, "_SINGLE_MAX", 16)
    x = torch.randn(3, 40)
    x[0, 7] = float("nan")
    x[1, 39] = float("inf")
    q, s = aq.per_token_quant_triton(x.to(dev), FP8_E4M3)
    _, sr = quantize_per_token(x, FP8_E4M3)
    assert torch.isnan(s[0]) and not torch.isfinite(s[1]) and torch.isfinite(s[2])
    assert not torch.isfinite(sr[0]) and not torch.isfinite(sr[1])


def test_markstein_division_is_ieee():
    """The GPU fast path divides by ``div_fast``: q0 = RN(v * RN(1/s)), r = RN(v - q0 * s) (one
    FMA), q = RN(q0 + r * RN(1/s)). Emulated here in float64 (every product of two fp32 values is
    exact in float64, so r's single rounding is exact; q0 + r * rcp is rounded twice, which differs
    from one rounding only on exact fp32 midpoints, probability ~2^-29 per value) against IEEE fp32
    division, on values spanning the activation range incl. tiny ones and the row maxima."""
    torch.manual_seed(0)
    n = 400_000
    v = (torch.randn(n) * torch.exp(torch.randn(n) * 4)).float()
    v[:1000] = torch.randn(1000) * 1e-20
    amax = v.abs().reshape(-1, 100).amax(-1).repeat_interleave(100)
    s = (amax.clamp_min(1e-12) / 448.0).float()
    rcp = (1.0 / s.double()).float()  # RN(1/s)
    assert torch.equal(rcp, torch.ones_like(s) / s)
    q0 = (v.double() * rcp.double()).float()
    assert not torch.equal(q0, v / s)  # the correction step is needed
    r = (v.double() - q0.double() * s.double()).float()
    q = (q0.double() + r.double() * rcp.double()).float()
    assert torch.equal(q, v / s)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("out", DTYPES)
@pytest.mark.parametrize("fuse", [None, "silu_mul", "rmsnorm"])
def test_fast_path_gpu(out, fuse):
    """GPU: the FAST path (Markstein division, hardware FP8 convert) against the reference computed
    on the CPU (plain: bit-exact; PyTorch's CUDA ``tensor / 448`` multiplies by the rounded
    reciprocal, so the GPU reference's scales can differ in the last bit: R8) and against the
    non-FAST kernel (same codes up to the sign of zero codes, which the arithmetic rounding loses)."""
    torch.manual_seed(2)
    for m, k in ((1, 4096), (3, 14336), (5, 4100), (2, 20000)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        x[0, 1] = 1e-30
        x[-1, 2] = -1e-30
        kw = {}
        if fuse == "silu_mul":
            kw = dict(fuse=fuse, up=torch.randn_like(x))
        elif fuse == "rmsnorm":
            kw = dict(fuse=fuse, weight=torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, eps=1e-5)
        q, s = per_token_quant_triton(x, out, fast=True, **kw)
        q2, s2 = per_token_quant_triton(x, out, fast=False, **kw)
        assert torch.equal(s, s2)
        d = q.view(torch.int8) != q2.view(torch.int8)
        assert not (d & ((q.float() != 0) | (q2.float() != 0))).any()  # only +-0 may differ
        if fuse is None:
            _assert_same(q.cpu(), s.cpu(), *quantize_per_token(x.cpu(), out))
