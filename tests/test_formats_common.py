import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowbit.formats.common import FP8_E4M3, dequantize_per_token, quantize_per_token
from lowbit.formats.int4 import pack_int4, unpack_int4


@given(st.integers(1, 40), st.booleans())
def test_int4_pack_roundtrip(k, signed):
    lo, hi = (-8, 8) if signed else (0, 16)
    codes = torch.randint(lo, hi, (3, k), dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.shape == (3, (k + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, signed=signed, k=k), codes)


def test_per_token_zero_rows_and_tiny_amax():
    x = torch.zeros(4, 16)
    x[1] = 1e-30
    x[2, 3] = 5.0
    for dtype in (FP8_E4M3, torch.int8):
        q, s = quantize_per_token(x, dtype)
        assert torch.isfinite(s).all() and (s > 0).all()
        y = dequantize_per_token(q, s)
        assert torch.isfinite(y).all()
        assert torch.equal(y[0], torch.zeros(16))
        assert abs(y[2, 3].item() - 5.0) < 1e-5


def test_per_token_fp8_error_small():
    x = torch.randn(8, 256)
    q, s = quantize_per_token(x, FP8_E4M3)
    err = (dequantize_per_token(q, s) - x).norm() / x.norm()
    assert err < 0.04


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), block=st.sampled_from([1, 2, 8]), cols=st.integers(1, 5), rows=st.integers(1, 3))
def test_interleave_rows_roundtrip(n, block, cols, rows):
    """``interleave_rows`` (a fused gate_up weight) and ``split_interleaved`` (its output or weight) are inverse;
    ``silu_mul_ref`` is silu(gate) * up of the halves, float32 unrounded."""
    from lowbit.formats.common import interleave_rows, silu_mul_ref, split_interleaved

    a, b = torch.randn(n * block, cols), torch.randn(n * block, cols)
    w = interleave_rows(a, b, block)
    assert w.shape == (2 * n * block, cols)
    assert torch.equal(w[:block], a[:block]) and torch.equal(w[block: 2 * block], b[:block])
    g, u = split_interleaved(w, block, dim=0)
    assert torch.equal(g, a) and torch.equal(u, b)
    y = torch.randn(rows, 2 * n * block)
    g, u = split_interleaved(y, block)
    assert torch.equal(interleave_rows(g.t(), u.t(), block).t(), y)
    torch.testing.assert_close(silu_mul_ref(y, block), torch.nn.functional.silu(g) * u)
    with pytest.raises(ValueError, match="multiple"):
        split_interleaved(torch.randn(1, 2 * n * block + 1), block)
    if block > 1:
        with pytest.raises(ValueError, match="multiple"):
            interleave_rows(a[:-1], b[:-1], block)
