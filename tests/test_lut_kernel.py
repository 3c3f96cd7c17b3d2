"""lowbit::lut_gemm: the Triton kernel (interpreter on CPU) against the float reference."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowbit.formats.lut import dequantize_lut, nf_table, pack_lut, pair_table, quantize_lut
from lowbit.kernels.lut_gemm import lut_dequant_triton, lut_gemm_triton
from lowbit.ops import lut as lut_ops
from lowbit.ops.lut import lut_gemm, lut_gemm_ref
from tests.tolerances import KERNEL_VS_REF, rel_l2
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)


def _packed(n, k, bits, g, table="nf", dtype=torch.bfloat16, dev="cpu", seed=0):
    torch.manual_seed(seed)
    w = torch.randn(n, k, device=dev)
    q = quantize_lut(w, bits=bits, group_size=g, table=table, scale_dtype=dtype)
    qw, qh, s = pack_lut(q)
    return q, qw, qh, s, q.table.to(dev)


def _ref(x, q):
    return x.double() @ dequantize_lut(q).double().t()


@settings(max_examples=10)
@given(bits=st.sampled_from([2, 3, 4]), m=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 300),
       g=st.sampled_from([32, 64, 128, 256]), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_kernel_matches_reference_odd_shapes(bits, m, n, k, g, dtype):
    dev = "cuda" if GPU else "cpu"
    q, qw, qh, s, t = _packed(n, k, bits, g, dtype=dtype, dev=dev)
    x = torch.randn(m, k, device=dev, dtype=dtype)
    y = lut_gemm(x, qw, qh, s, t, bits=bits, group_size=g)
    assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
    assert rel_l2(y, _ref(x, q)) < KERNEL_VS_REF[dtype]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("lookup,table", [("select", "nf"), ("affine", "int"), ("pair", "nf")])
def test_lookup_variants(bits, lookup, table, dev):
    q, qw, qh, s, t = _packed(48, 160, bits, 32, table=table, dev=dev)
    x = torch.randn(3, 160, device=dev, dtype=torch.bfloat16)
    pairs = pair_table(q.table, bits, torch.bfloat16).to(dev) if lookup == "pair" else None
    y = lut_gemm_triton(x, qw, qh, s, t, bits=bits, group_size=32, out_features=48, lookup=lookup, pairs=pairs)
    assert rel_l2(y, _ref(x, q)) < KERNEL_VS_REF[torch.bfloat16]


def test_pair_table_layout():
    """Entry i holds (T[c_j], T[c_j+1]) for the pair index the kernel extracts (FLUTE §3.2)."""
    t = nf_table(3)
    p = pair_table(t, 3, torch.bfloat16)
    i = 0b101110  # lo_j = 2, lo_j+1 = 3, hi_j = 0, hi_j+1 = 1 -> codes 2 and 7
    assert p.shape == (64, 2) and p.dtype == torch.bfloat16
    assert torch.equal(p[i].float(), t[[2, 7]].bfloat16().float())
    word = int(p.view(torch.int32)[i])  # the kernel's 32-bit read: low half = first code
    assert (word & 0xFFFF) == int(p[i, :1].view(torch.int16)) & 0xFFFF


@pytest.mark.parametrize("use_dot", [False, True])
def test_m1_fma_and_dot_paths(use_dot, dev):
    q, qw, qh, s, t = _packed(40, 256, 4, 128, dev=dev)
    x = torch.randn(1, 256, device=dev, dtype=torch.float16)
    y = lut_gemm_triton(x, qw, qh, s, t, bits=4, group_size=128, out_features=40, use_dot=use_dot,
                        block_m=16 if use_dot else 1)
    assert rel_l2(y, _ref(x, q)) < KERNEL_VS_REF[torch.float16]


def test_split_k_deterministic_and_equal(dev):
    """Split-K partials are reduced in fixed order in float32: identical runs, ~equal to no split."""
    q, qw, qh, s, t = _packed(24, 1024, 4, 64, dev=dev)
    x = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    kw = dict(bits=4, group_size=64, out_features=24)
    a = lut_gemm_triton(x, qw, qh, s, t, split_k=8, **kw)
    b = lut_gemm_triton(x, qw, qh, s, t, split_k=8, **kw)
    c = lut_gemm_triton(x, qw, qh, s, t, split_k=1, **kw)
    assert torch.equal(a, b)
    assert rel_l2(a, c) < 1e-2
    # counters are reset by the last program: a different split right after still works
    d = lut_gemm_triton(x, qw, qh, s, t, split_k=3, **kw)
    assert rel_l2(d, _ref(x, q)) < KERNEL_VS_REF[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_zero_groups_give_zero_not_nan(dtype, dev):
    torch.manual_seed(0)
    w = torch.randn(16, 256, device=dev)
    w[:, :128] = 0
    w[5] = 0
    q = quantize_lut(w, bits=3, group_size=128, scale_dtype=dtype)
    qw, qh, s = pack_lut(q)
    x = torch.randn(2, 256, device=dev, dtype=dtype)
    x[:, 128:] = 0
    y = lut_gemm(x, qw, qh, s, q.table.to(dev), bits=3, group_size=128)
    assert torch.isfinite(y).all() and (y == 0).all()


def test_large_m_dequant_path(monkeypatch, dev):
    monkeypatch.setattr(lut_ops, "MAX_KERNEL_M", 4)
    q, qw, qh, s, t = _packed(20, 96, 3, 32, dev=dev)
    x = torch.randn(9, 96, device=dev, dtype=torch.bfloat16)
    y = lut_gemm(x, qw, qh, s, t, bits=3, group_size=32)
    assert rel_l2(y, _ref(x, q)) < KERNEL_VS_REF[torch.bfloat16]
    w = lut_dequant_triton(qw, qh, s, t, bits=3, group_size=32, out_features=20, in_features=96, dtype=torch.float16)
    assert rel_l2(w, dequantize_lut(q)) < 1e-3


def test_float32_and_leading_dims_use_reference():
    q, qw, qh, s, t = _packed(8, 64, 4, 32)
    x = torch.randn(2, 3, 64)
    y = lut_gemm(x, qw, qh, s, t, bits=4, group_size=32)
    assert y.shape == (2, 3, 8) and y.dtype == torch.float32
    assert rel_l2(y.reshape(6, 8), _ref(x.reshape(6, 64), q)) < 1e-6


def test_bad_inputs_name_the_argument():
    q, qw, qh, s, t = _packed(8, 64, 4, 32)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x"):
        lut_gemm(x.int(), qw, qh, s, t, bits=4, group_size=32)
    with pytest.raises(ValueError, match="qweight"):
        lut_gemm(x, qw[:, :2], qh, s, t, bits=4, group_size=32)
    with pytest.raises(ValueError, match="table"):
        lut_gemm(x, qw, qh, s, t[:4], bits=4, group_size=32)
    with pytest.raises(ValueError, match="K=65"):
        lut_gemm(torch.randn(2, 65, dtype=torch.bfloat16), qw, qh, s, t, bits=4, group_size=32)
    with pytest.raises(ValueError, match="bits"):
        lut_gemm(x, qw, qh, s, t, bits=5, group_size=32)
    with pytest.raises(ValueError, match="lookup"):
        lut_gemm(x, qw, qh, s, t, bits=4, group_size=32, lookup="gather")


def test_opcheck_and_compile():
    q, qw, qh, s, t = _packed(16, 64, 3, 32)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.lowbit.lut_gemm.default, (x, qw, qh, s, t, None, 3, 32, "load"),
                          test_utils=("test_schema", "test_faketensor"))
    xf = x.float()
    torch.library.opcheck(torch.ops.lowbit.lut_gemm.default, (xf, qw, qh, s, t, None, 3, 32, "load"))
    f = torch.compile(lambda a: lut_gemm(a, qw, qh, s, t, bits=3, group_size=32, lookup="load"),
                      fullgraph=True, backend="eager")
    assert rel_l2(f(xf), lut_gemm_ref(xf, qw, qh, s, t, 3, 32, 64)) < 1e-6


@pytest.mark.parametrize("bits,g", [(4, 32), (3, 128), (2, 64)])
def test_joined_group_dot_matches(bits, g, dev):
    """join=True: one dot per scale group over the joined slot tiles, X rows bit-reverse permuted."""
    q, qw, qh, s, t = _packed(24, 300, bits, g, dev=dev)
    x = torch.randn(5, 300, device=dev, dtype=torch.bfloat16)
    y = lut_gemm_triton(x, qw, qh, s, t, bits=bits, group_size=g, out_features=24, join=True)
    assert rel_l2(y, _ref(x, q)) < KERNEL_VS_REF[torch.bfloat16]
