"""Runner fusion of ``LUTLinear`` projections (``generate._fuse_rows`` + ``QuantLinear.fuse_layout``):
q/k/v and gate/up stack into one module exactly, in both packed layouts, at 3 and 4 bits."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
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


# ---------------------------------------------------------------- fused MLP (gate_up with the SiLU*mul epilogue)
def _lut_model(**opts):
    import lowbit
    from tests._tiny_models import tiny_llama

    m = tiny_llama(head_dim=16)
    return lowbit.quantize_model(m, "flute-nf4", progress=False, **opts)


def test_fuse_mlp_same_function(monkeypatch):
    """``nn.lut.fuse_mlp`` restacks the quantized gate / up (rows interleaved by 8): the MLP computes the same
    function (float32 reference path: the same products; no rounding of the SiLU*mul at float32)."""
    from lowbit.models.arch import decoder_layers
    from lowbit.nn.base import FusedMLP
    from lowbit.nn.lut import fuse_mlp

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = _lut_model(fuse_mlp=False)
    x = torch.randn(2, 5, 64)
    views = decoder_layers(m)
    before = [v.layer.mlp(x) for v in views]
    gate_w = views[0].gate_proj.dequantize()
    for v, y in zip(views, before):
        new = fuse_mlp(v)
        assert isinstance(v.layer.mlp, FusedMLP) and new.gate_up.activation == "silu_mul"
        assert new.gate_up.out_features == 128 and new.gate_up.scales.shape[1] == 256
        torch.testing.assert_close(v.layer.mlp(x), y, rtol=1e-6, atol=1e-6)
    from lowbit.formats.common import split_interleaved

    assert torch.equal(split_interleaved(views[0].layer.mlp.gate_up.dequantize(), 8, dim=0)[0], gate_w)
    with pytest.raises(ValueError, match="SiLU MLP"):
        fuse_mlp(views[0])  # already fused
    with pytest.raises(TypeError, match="LUTLinear"):
        from tests._tiny_models import tiny_llama

        fuse_mlp(decoder_layers(tiny_llama(head_dim=16))[0])  # float gate / up
    with pytest.raises(ValueError, match="bias"):
        LUTLinear(64, 32, activation="silu_mul", bias=True)


@pytest.mark.parametrize("m", [1, 12, 40, 130])
def test_silu_mul_op_paths(m):
    """``lut_gemm(silu_mul=True)`` on every path (fragment kernel + pass at 1 token, the register-table kernel's
    epilogue at 12 / 40, dequantize + matmul + pass above 128; the interpreter on the CPU) against
    ``silu_mul_ref`` of the float64 product."""
    from lowbit.formats.common import interleave_rows, silu_mul_ref
    from lowbit.formats.lut import dequantize_lut, pack_codes_mma, pair_table, quantize_lut
    from lowbit.ops.lut import lut_gemm
    from tests.tolerances import KERNEL_VS_REF, rel_l2

    dev = "cuda" if GPU else "cpu"
    dt = torch.float16
    torch.manual_seed(m)
    k, n = 200, 48
    w = interleave_rows(torch.randn(n, k), torch.randn(n, k), 8)
    q = quantize_lut(w, bits=4, group_size=64, table="nf", scale_dtype=dt)
    qm, _ = pack_codes_mma(q.codes, 4, 64, k)
    x = torch.randn(m, k, dtype=dt)
    s = q.scales.t().contiguous()
    ref = silu_mul_ref((x.double() @ dequantize_lut(q).double().t()).to(dt), 8)
    if not GPU:
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the interpreter or a GPU")
    y = lut_gemm(x.to(dev), qm.to(dev), None, s.to(dev), q.table.to(dev), bits=4, group_size=64, layout="mma",
                 pairs=pair_table(q.table, 4, dt).to(dev), silu_mul=True)
    assert y.shape == (m, n) and y.dtype == dt
    assert rel_l2(y.cpu(), ref) < 2 * KERNEL_VS_REF[dt]
    with pytest.raises(ValueError, match="silu_mul needs N"):
        lut_gemm(x.to(dev), *_odd_n(k, dev), bits=4, group_size=64, layout="mma", silu_mul=True)


def _odd_n(k, dev):
    """A 24-row packed weight (not a multiple of 16): (qweight, None, scales, table)."""
    from lowbit.formats.lut import pack_codes_mma, quantize_lut

    q = quantize_lut(torch.randn(24, k), bits=4, group_size=64, table="nf", scale_dtype=torch.float16)
    return pack_codes_mma(q.codes, 4, 64, k)[0].to(dev), None, q.scales.t().contiguous().to(dev), q.table.to(dev)


def test_fused_mlp_recipe_runner_and_checkpoint(tmp_path, monkeypatch):
    """flute-nf4(fuse_mlp=True): the runner calls the fused gate_up as is (SiLU*mul from the GEMM), greedy tokens
    equal the HF path's and the unfused model's; a saved model loads back to the same tokens."""
    import lowbit
    from lowbit.models.generate import Generator
    from tests._tiny_models import greedy, tiny_llama

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = _lut_model(fuse_mlp=True)
    plain = _lut_model(fuse_mlp=False)
    assert m.lowbit_recipe["options"]["fuse_mlp"] is True and plain.lowbit_recipe["options"]["fuse_mlp"] is False
    assert type(_lut_model().model.layers[0].mlp).__name__ == "FusedMLP"  # the default: wherever it fits
    gen = Generator(m, max_batch=1, max_seq=16)
    assert all(f.gate_up_p is not None and f.gate_up_p.silu_mul for f in gen.fused)
    p = torch.tensor([7, 3, 9])
    toks = gen.generate([p], 4)[0]
    assert torch.equal(toks, greedy(m, p.unsqueeze(0), 4)[0])
    assert torch.equal(toks, greedy(plain, p.unsqueeze(0), 4)[0])
    lowbit.save_quantized(m, tmp_path / "q")
    m2 = lowbit.load_quantized(tmp_path / "q")
    assert type(m2.model.layers[0].mlp).__name__ == "FusedMLP"
    assert torch.equal(greedy(m2, p.unsqueeze(0), 4)[0], toks)
    with pytest.raises(ValueError, match="fuse_mlp"):
        lowbit.quantize_model(tiny_llama(head_dim=16), "flute-nf4", progress=False, fuse_mlp=True, skip=("up_proj",))


@pytest.mark.parametrize("bits,group", [(4, 32), (2, 32)])
def test_fuse_mlp_planar_layout(bits, group):
    """'planar' codes (group 32, 2-bit): the fused module repacks them in that layout; float32 (the reference) and
    bf16 (the planar kernel + one SiLU*mul pass: the interpreter on the CPU, CUDA on a GPU) equal the unfused MLP's
    SiLU*mul."""
    import os

    import lowbit
    from lowbit.models.arch import decoder_layers
    from lowbit.nn.lut import fuse_mlp
    from tests._tiny_models import tiny_llama
    from tests.tolerances import KERNEL_VS_REF, rel_l2

    m = lowbit.quantize_model(tiny_llama(head_dim=16), "flute-nf4", progress=False, fuse_mlp=False,
                              linear_options={"bits": bits, "group_size": group})
    v = decoder_layers(m)[0]
    gate, up = v.gate_proj, v.up_proj
    assert gate.layout == "planar"
    x = torch.randn(3, 64)
    ref = torch.nn.functional.silu(gate(x)) * up(x)  # float32 on the CPU: the reference path
    new = fuse_mlp(v)
    assert new.gate_up.layout == "planar" and new.gate_up.bits == bits
    torch.testing.assert_close(new.gate_up(x), ref, rtol=1e-5, atol=1e-5)
    if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
        return
    dev = "cuda" if GPU else "cpu"
    xb = x.to(dev, torch.bfloat16)
    g, u = gate.to(dev)(xb), up.to(dev)(xb)
    want = (torch.nn.functional.silu(g.float()).to(torch.bfloat16).float() * u.float()).to(torch.bfloat16)
    assert rel_l2(new.gate_up.to(dev)(xb).cpu(), want.cpu()) < 2 * KERNEL_VS_REF[torch.bfloat16]


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 70), n16=st.integers(1, 5), k=st.integers(1, 300), bits=st.sampled_from([3, 4]),
       g=st.sampled_from([64, 128]))
def test_silu_mul_op_fuzz(m, n16, k, bits, g):
    """``lut_gemm(silu_mul=True)`` over random legal shapes (N a multiple of 16, any K, 1..70 tokens: the fragment
    kernel, the register-table kernel with either launch, 3 and 4 bits; the interpreter on the CPU) against
    ``silu_mul_ref`` of the float64 product."""
    import os

    from lowbit.formats.common import interleave_rows, silu_mul_ref
    from lowbit.formats.lut import dequantize_lut, mma_layout_ok, pack_codes_mma, pair_table, quantize_lut
    from lowbit.ops.lut import lut_gemm
    from tests.tolerances import KERNEL_VS_REF, rel_l2

    if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter or a GPU")
    if not mma_layout_ok(bits, g):
        g = 128
    dev = "cuda" if GPU else "cpu"
    torch.manual_seed(m * 31 + n16 + k)
    n = 16 * n16
    w = interleave_rows(torch.randn(n // 2, k), torch.randn(n // 2, k), 8)
    q = quantize_lut(w, bits=bits, group_size=g, table="nf", scale_dtype=torch.bfloat16)
    qm, qh = pack_codes_mma(q.codes, bits, g, k)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    y = lut_gemm(x.to(dev), qm.to(dev), None if qh is None else qh.to(dev), q.scales.t().contiguous().to(dev),
                 q.table.to(dev), bits=bits, group_size=g, layout="mma",
                 pairs=pair_table(q.table, bits, torch.bfloat16).to(dev), silu_mul=True)
    ref = silu_mul_ref((x.double() @ dequantize_lut(q).double().t()).to(torch.bfloat16), 8)
    assert y.shape == (m, n // 2)
    assert rel_l2(y.cpu(), ref) < 2 * KERNEL_VS_REF[torch.bfloat16]
