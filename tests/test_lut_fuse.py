"""Runner fusion of ``LUTLinear`` projections (``generate._fuse_rows`` + ``QuantLinear.fuse_layout``):
q/k/v and gate/up stack into one module exactly, in both packed layouts, at 3 and 4 bits."""
import pytest
import torch
from torch import nn

from lowbit.models.generate import _fuse_rows
from lowbit.nn.lut import LUTLinear
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)

K = 256


def _mods(ns, bits, group, layout, bias=False, seed=0, k=K):
    torch.manual_seed(seed)
    return [LUTLinear.from_linear(nn.Linear(k, n, bias=bias), bits=bits, group_size=group, layout=layout,
                                  dtype=torch.bfloat16) for n in ns]


CASES = [  # (out_features of the modules, bits, group, layout, bias)
    ((64, 32, 32), 4, 128, "mma", False),
    ((32, 48), 4, 64, "mma", True),
    ((48, 16, 32), 3, 128, "mma", False),
    ((48, 16, 16), 4, 32, "planar", True),
    ((40, 24, 8), 3, 32, "planar", False),  # planar: any N
    ((24, 40), 2, 32, "planar", False),
]


@pytest.mark.parametrize("ns,bits,group,layout,bias", CASES)
def test_fused_lut_equals_concat(ns, bits, group, layout, bias):
    mods = _mods(ns, bits, group, layout, bias)
    assert all(m.layout == layout for m in mods)
    x = torch.randn(3, K)
    before = [m(x) for m in mods]
    deq = torch.cat([m.dequantize() for m in mods], 0)
    f = _fuse_rows(mods)
    assert isinstance(f, LUTLinear) and f.config() == mods[0].config() and f.out_features == sum(ns)
    # the fused module has exactly the buffers LUTLinear.empty builds for it
    e = LUTLinear.empty(K, sum(ns), bias, torch.bfloat16, **mods[0].config())
    assert {n: (b.shape, b.dtype) for n, b in e.named_buffers()} == \
        {n: (b.shape, b.dtype) for n, b in f.named_buffers()}
    assert torch.equal(f.dequantize(), deq)  # the same effective weight, bit for bit
    assert torch.equal(f.codes(), torch.cat([m.codes() for m in mods], 0))
    # CPU path (float32 reference): one matmul over the stacked weight == the separate ones
    assert torch.equal(f(x), torch.cat(before, -1))
    # the originals now read views of the fused storage and still give their old outputs
    for m, y in zip(mods, before):
        for n, b in m.named_buffers():
            if n not in ("table", "pairs"):
                assert b.untyped_storage().data_ptr() == getattr(f, n).untyped_storage().data_ptr()
        assert torch.equal(m(x), y)
    assert mods[0].table is f.table and mods[0].pairs is f.pairs


@pytest.mark.parametrize("bits", [4, 3])
def test_fused_lut_kernel_path(bits):
    """bf16 activations: the Triton kernels (interpreter on the CPU, CUDA on a GPU) on the fused buffers and on
    the originals' views (``scales`` is then a column slice: row stride of the fused N)."""
    dev = "cuda" if GPU else "cpu"
    mods = [m.to(dev) for m in _mods((32, 16), bits, 128, "mma")]
    x = torch.randn(2, K, device=dev, dtype=torch.bfloat16)
    before = [m(x) for m in mods]
    f = _fuse_rows(mods)
    assert f is not None
    y = f(x)
    ref = torch.cat([m(x.float()) for m in mods], -1)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    assert not mods[1].scales.is_contiguous()
    tol = dict(rtol=0, atol=0) if dev == "cpu" else {}  # the interpreter: bit-equal (seen)
    for m, b in zip(mods, before):
        torch.testing.assert_close(m(x), b, **tol)


def test_lut_not_fused_when_inexact():
    # mma layout: N not a multiple of 16 -> the 16-row tiles would interleave modules: not fused
    mods = _mods((40, 24), 4, 128, "mma")
    qw = [m.qweight.clone() for m in mods]
    assert _fuse_rows(mods) is None
    assert all(torch.equal(m.qweight, q) and m.qweight.is_contiguous() for m, q in zip(mods, qw))
    mods = _mods((32, 24), 3, 128, "mma")
    assert _fuse_rows(mods) is None
    # different configs / tables / layouts: not fused
    a, b = _mods((32, 32), 4, 128, "mma")
    assert _fuse_rows([a, _mods((32,), 4, 128, "planar")[0]]) is None
    assert _fuse_rows([a, _mods((32,), 4, 64, "mma")[0]]) is None
    c = LUTLinear.from_linear(nn.Linear(K, 32), bits=4, group_size=128, table="int", layout="mma")
    assert _fuse_rows([a, c]) is None
    assert _fuse_rows([a, b]) is not None


def test_default_fuse_layout_is_row_major():
    from lowbit.nn.w4a8_int8 import W4A8INT8Linear

    m = W4A8INT8Linear.empty(64, 32, True, torch.bfloat16)
    assert m.fuse_layout() == {n: (0, 1) for n, _ in m.named_buffers()}
