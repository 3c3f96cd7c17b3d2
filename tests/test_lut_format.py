"""lowbit.formats.lut: tables, reference quantizer, planar packing (FLUTE §3.1, §4.1-4.2)."""
import pytest
import torch
from hypothesis import given, strategies as st

from lowbit.formats.lut import (bits_per_weight, dequantize_lut, int_table, make_table, nf_table, pack_block,
                                pack_codes, pack_lut, packed_k, packed_shapes, quantize_lut, table_is_uniform,
                                unpack_codes)

# QLoRA's NF4 (Dettmers et al. 2023, bitsandbytes `get_4bit_type("nf4")`), the reference NF4 must equal.
QLORA_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]


def test_nf4_equals_qlora():
    assert torch.allclose(nf_table(4), torch.tensor(QLORA_NF4), atol=2e-7, rtol=0)


def test_nf3_nf2_match_notes():  # notes §1.3, values computed from the construction
    assert torch.allclose(nf_table(3), torch.tensor([-1, -0.4786, -0.2171, 0, 0.1609, 0.3379, 0.5626, 1.0]), atol=6e-5)
    assert torch.allclose(nf_table(2), torch.tensor([-1, 0, 0.3379, 1.0]), atol=6e-5)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_nf_asymmetric_with_exact_zero(bits):
    t = nf_table(bits)
    assert (t < 0).sum() == 2 ** (bits - 1) - 1 and (t == 0).sum() == 1 and (t > 0).sum() == 2 ** (bits - 1)
    assert t.max() == 1.0 and t.min() == -1.0 and torch.all(t[1:] > t[:-1])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_int_table_is_minmax_rtn(bits):
    """table='int' + absmax scale == clamp(round(w / s'), -2^(b-1), 2^(b-1)-1) * s' (notes §2.3)."""
    torch.manual_seed(bits)
    w = torch.randn(16, 256)
    q = quantize_lut(w, bits=bits, group_size=64, table="int", scale_dtype=torch.float16)
    qmax = 2 ** (bits - 1) - 1
    s = q.scales.float().repeat_interleave(64, 1) / qmax  # s' from the stored (rounded) scale
    ref = torch.clamp(torch.round(w / s), -qmax - 1, qmax) * s
    assert torch.allclose(dequantize_lut(q), ref, atol=1e-6)
    assert table_is_uniform(int_table(bits)) and not table_is_uniform(nf_table(bits))


def test_groups_run_along_k():
    """Scale of element (n, k) is s[n, k // G] (the paper's s_{(i*j) mod B} is a typo, notes §5.1)."""
    w = torch.ones(4, 256) * 0.1
    w[2, 130] = 5.0
    q = quantize_lut(w, bits=4, group_size=128)
    s = q.scales.float()
    assert s[2, 1] > 10 * s[2, 0] and torch.allclose(s[[0, 1, 3]], s[0, 0].expand(3, 2))
    assert abs(dequantize_lut(q)[2, 130].item() - 5.0) < 0.05


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zero_groups_and_tiny_amax(dtype):
    w = torch.zeros(3, 128)
    w[1, :64] = 1e-30  # tiny amax: fp16 scale must not underflow to 0
    w[2] = torch.randn(128)
    q = quantize_lut(w, bits=4, group_size=64, scale_dtype=dtype)
    assert torch.isfinite(q.scales.float()).all() and (q.scales.float() > 0).all()
    d = dequantize_lut(q)
    assert torch.isfinite(d).all()
    assert torch.equal(d[0], torch.zeros(128)) and d[1].abs().max() < 1e-20


def test_nearest_code_error_bound():
    torch.manual_seed(0)
    w = torch.randn(8, 128)
    for bits in (2, 3, 4):
        q = quantize_lut(w, bits=bits, group_size=32)
        t = q.table.sort().values
        half_gap = ((t[1:] - t[:-1]).max() / 2) * q.scales.float().repeat_interleave(32, 1)
        assert ((dequantize_lut(q) - w).abs() <= half_gap * 1.0001 + 1e-6).all()


def test_user_table_unsorted_and_checks():
    t = torch.tensor([0.5, -1.0, 1.0, 0.0])  # unsorted user table, codes index it as given
    w = torch.tensor([[1.0, -1.0, 0.49, 0.0] * 8])
    q = quantize_lut(w, bits=2, group_size=32, table=t)
    assert q.codes[0, :4].tolist() == [2, 1, 0, 3]
    with pytest.raises(ValueError, match="2\\*\\*bits"):
        make_table([0.0, 1.0, 2.0], 2)
    with pytest.raises(ValueError, match="bits"):
        make_table("nf", 5)
    with pytest.raises(ValueError, match="group_size"):
        quantize_lut(w, bits=2, group_size=48)
    with pytest.raises(ValueError, match="finite"):
        make_table([0.0, float("nan"), 1.0, 2.0], 2)


def test_bits_per_weight_table1():
    assert bits_per_weight(4, 128) == 4.125 and bits_per_weight(3, 64) == 3.25


@given(st.sampled_from([2, 3, 4]), st.integers(1, 5), st.integers(1, 700))
def test_pack_roundtrip(bits, n, k):
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8)
    qw, qh = pack_codes(codes, bits)
    shape, dtype, hshape = packed_shapes(n, k, bits)
    assert qw.shape == shape and qw.dtype == dtype and (qh is None) == (hshape is None)
    assert torch.equal(unpack_codes(qw, qh, bits, k), codes)
    assert packed_k(k, bits) % pack_block(bits) == 0


def test_planar_layout():
    """Slot j of word w in a block holds the code of k = j*16 + w (the kernel's contract)."""
    for bits in (2, 3, 4):
        pb = pack_block(bits)
        codes = torch.randint(0, 2 ** bits, (1, 2 * pb), dtype=torch.uint8)
        qw, qh = pack_codes(codes, bits)
        for blk, j, w in ((0, 3, 5), (1, 1, 15), (1, pb // 16 - 1, 0)):
            k = blk * pb + j * 16 + w
            word = int(qw[0, blk * 16 + w]) & (2 ** 64 - 1)
            if bits == 3:
                got = ((word >> (2 * j)) & 3) | (((int(qh[0, blk * 16 + w]) >> j) & 1) << 2)
            else:
                got = (word >> (bits * j)) & (2 ** bits - 1)
            assert got == codes[0, k].item(), (bits, blk, j, w)


def test_pack_lut_pads_k():
    w = torch.randn(5, 100)
    q = quantize_lut(w, bits=3, group_size=256)
    qw, qh, st = pack_lut(q)
    assert qw.shape == (5, 16) and qh.shape == (5, 16) and st.shape == (1, 5)
