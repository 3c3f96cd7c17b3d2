"""lowbit.formats.kv4: the KV4 reference (symmetric FP8-scaled INT4 and QServe zero-point INT4)."""
import pytest
import torch
from hypothesis import given, strategies as st

from lowbit.formats.int4 import unpack_int4
from lowbit.formats.kv4 import (FP8_NORMAL_MIN, FP8_SCALE_MIN, SCALE_DTYPES, dequantize_kv4, kv4_bytes_per_row,
                                quantize_kv4, round_scale)
from tests.tolerances import rel_l2

FP8 = torch.float8_e4m3fn


@given(rows=st.integers(1, 6), half=st.integers(1, 70), zp=st.booleans(), sd=st.sampled_from(SCALE_DTYPES),
       xdt=st.sampled_from((torch.float16, torch.bfloat16, torch.float32)), mag=st.sampled_from((1e-3, 0.05, 1.0, 30.0)))
def test_roundtrip_error_and_codes(rows, half, zp, sd, xdt, mag):
    torch.manual_seed(half)
    x = (torch.randn(rows, 2 * half) * mag).to(xdt)
    c, s, z = quantize_kv4(x, zero_point=zp, scale_dtype=sd)
    assert c.dtype == torch.uint8 and c.shape == (rows, half) and s.shape == (rows,) and s.dtype == sd
    assert (z is None) == (not zp)
    codes = unpack_int4(c, signed=not zp)
    if zp:
        assert codes.min() >= 0 and codes.max() <= 15 and z.max() <= 15
    else:
        assert codes.abs().max() <= 7
    y = dequantize_kv4(c, s, z, dtype=torch.float32)
    assert torch.isfinite(y).all()
    # each element within half a step (plus the scale's rounding) of x
    step = s.float()[:, None]
    assert ((y - x.float()).abs() <= 0.5 * step * 1.0001 + 1e-30).all() or mag < 0.01


@pytest.mark.parametrize("sd", (torch.float8_e4m3fn, torch.bfloat16))
def test_zero_point_scale_never_clips(sd):
    """``kv4-zp`` scales (session 33): the nearest value of the scale dtype unless it would clip the top code, then
    the next value up. Over rows of random spans (and a random fuzz's falsifying example, which clipped 0.79 steps
    before) every element is within half a step, the nearest scale is kept wherever it does not clip, and some rows
    need the rounded-up one."""
    from lowbit.formats.kv4 import round_scale

    torch.manual_seed(28)
    x = (torch.randn(2, 56) * 0.05).to(torch.float16).float()  # the fuzz's example (rows=2, half=28, mag 0.05)
    g = torch.Generator().manual_seed(0)
    spans = torch.exp(torch.empty(2048).uniform_(-3, 3, generator=g))
    lo = -torch.rand(2048, generator=g) * spans
    rows = lo[:, None] + torch.rand(2048, 64, generator=g) * spans[:, None]
    rows[:, 0], rows[:, 1] = lo, lo + spans  # both ends present
    for xx in (x, rows):
        c, s, z = quantize_kv4(xx, zero_point=True, scale_dtype=sd)
        y = dequantize_kv4(c, s, z)
        assert ((y - xx).abs() <= 0.5 * s.float()[:, None] * (1 + 1e-6)).all()
    hi, lo = rows.amax(-1), rows.amin(-1).clamp_max(0)
    st = (hi - lo) / 15.0
    near, up = round_scale(st, sd).float(), round_scale(st, sd, up=True).float()
    clips = torch.round(hi / near) + torch.round(-lo / near) > 15
    assert torch.equal(s.float(), torch.where(clips, up, near))
    assert 0 < int(clips.sum()) < len(clips)


def test_error_bound_vs_bits():
    x = torch.randn(256, 128)
    for zp in (False, True):
        e = rel_l2(dequantize_kv4(*quantize_kv4(x, zero_point=zp)), x)
        assert 0.05 < e < 0.14, (zp, e)  # ~4-bit SQNR on Gaussian rows


def test_all_zero_and_tiny_rows_fp8_floor():
    """Lemma B.1: amax < 7*2^-9 would give an FP8 scale of 0 (whole token lost, x/0 = NaN codes).
    The floor keeps the scale at >= 2^-9; an all-zero row gives codes 0 and dequantizes to 0."""
    x = torch.zeros(4, 64)
    x[1] = 1e-4 * torch.randn(64)
    x[2, 3] = 0.01  # amax 0.01 < 7 * 2^-9 = 0.0137: scale 0.00143 would underflow to 0 in E4M3
    x[3] = 0.05 * torch.randn(64)
    for zp in (False, True):
        c, s, z = quantize_kv4(x, zero_point=zp)
        assert (s.float() >= FP8_SCALE_MIN).all()
        y = dequantize_kv4(c, s, z)
        assert torch.isfinite(y).all()
        assert torch.equal(y[0], torch.zeros(64))
        assert (y[2, 3] - 0.01).abs() <= s[2].float() / 2  # the value survives
        assert rel_l2(y[3], x[3]) < 0.2


def test_subnormal_scales_round_up_no_clipping():
    """Below 2^-6 the FP8 grid step is 2^-9: scales round *up* so |x|/scale never exceeds 7."""
    amax = torch.linspace(7 * FP8_SCALE_MIN, 7 * FP8_NORMAL_MIN * 1.5, 200)
    s = round_scale(amax / 7).float()
    sub = amax / 7 < FP8_NORMAL_MIN
    assert sub.any() and (~sub).any()
    assert (s[sub] * 7 >= amax[sub] * 0.9999).all()
    assert (s[sub] * 512 == torch.round(s[sub] * 512)).all()
    assert (amax / s < 7.5).all()  # never clipped past half a step anywhere
    # normal range: round to nearest (<= 1/16 relative), |x|/s <= 7.44 still rounds to 7
    big = torch.linspace(1.0, 400.0, 500)
    sb = round_scale(big / 7).float()
    assert ((sb - big / 7).abs() <= big / 7 / 16 + 1e-6).all()


def test_zero_point_range_contains_zero_and_positive_rows():
    x = torch.rand(8, 32) + 5.0  # all positive: the range [0, max] is quantized, nothing clips
    c, s, z = quantize_kv4(x, zero_point=True)
    assert (z == 0).all()
    y = dequantize_kv4(c, s, z)
    assert ((y - x).abs() <= s.float()[:, None] * 0.5001).all()


def test_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        quantize_kv4(torch.randn(3, 5))
    with pytest.raises(TypeError):
        quantize_kv4(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_kv4(torch.randn(3, 4), scale_dtype=torch.float16)
    c, s, _ = quantize_kv4(torch.randn(3, 4))
    with pytest.raises(ValueError, match="scale"):
        dequantize_kv4(c, s[:2])


def test_bytes_per_row():
    assert kv4_bytes_per_row(128) == 65
    assert kv4_bytes_per_row(128, zero_point=True) == 66
    assert kv4_bytes_per_row(64, scale_dtype=torch.bfloat16) == 34


def test_scale_ties_are_ieee_on_every_device():
    """Decision test (``formats.common.div_ieee``): the scale is ``RN_E4M3(amax / 7)`` with the quotient correctly
    rounded. bf16 rows with amax = k * 7 / 16 have amax / 7 = k / 16 exactly; for k = 25, 29, 50, 58 that is a tie
    between two E4M3 values (1.5625 between 1.5 and 1.625, ...), which goes to the even one. On the H200 the old
    quotients (PyTorch's CUDA division by a Python scalar, Triton's ``/``) broke some of these ties upward (found in
    session 35). The same tie in ``w4a8-fp8``'s group scales. With a GPU, CUDA and CPU references agree bit for bit,
    on these rows and on random rows whose amax are such ties."""
    from lowbit.formats.w4a8_fp8 import quantize_weight

    ks = torch.tensor([25, 29, 50, 58])
    want = [1.5, 1.75, 3.0, 3.5]
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    x[:, 0] = ks * 7 / 16
    devs = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devs:
        assert quantize_kv4(x.to(dev))[1].float().tolist() == want, dev
        assert quantize_weight(x.float().to(dev), 64)[1].float()[:, 0].tolist() == want, dev
    if "cuda" in devs:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(256, 64, generator=g)
        amax = torch.tensor([25, 29, 50, 58, 41, 45, 21, 19])[torch.randint(0, 8, (256,), generator=g)] * 7 / 16
        w = (w / w.abs().amax(-1, keepdim=True) * amax[:, None]).to(torch.bfloat16)
        w[:, 0] = amax.to(torch.bfloat16)  # the row's amax exactly
        same = lambda a, b: torch.equal(*(t.cpu().view(torch.uint8) if t.dtype == FP8 else t.cpu() for t in (a, b)))
        for zp in (False, True):
            cpu, cuda = quantize_kv4(w, zero_point=zp), quantize_kv4(w.cuda(), zero_point=zp)
            assert all(same(a, b) for a, b in zip(cpu, cuda) if a is not None), zp
        assert all(same(a, b) for a, b in zip(quantize_weight(w.float(), 64), quantize_weight(w.float().cuda(), 64)))
