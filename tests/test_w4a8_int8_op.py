"""lowbit::w4a8_int8_gemm op (opcheck, fake, compile), argument errors, and W4A8INT8Linear."""
import pytest
import torch

import lowbit
from lowbit.formats import w4a8_int8 as fmt
from lowbit.formats.common import quantize_per_token
from lowbit.nn.w4a8_int8 import W4A8INT8Linear
from lowbit.ops.w4a8_int8 import _w4a8_int8_gemm, w4a8_int8_gemm, w4a8_int8_linear
from tolerances import KERNEL_VS_REF, rel_l2


def _args(M=3, N=24, K=136, g=128, dev="cpu", dtype=torch.float16, bias=True):
    torch.manual_seed(0)
    qw = fmt.quantize(torch.randn(N, K, device=dev), g)
    xq, xs = quantize_per_token(torch.randn(M, K, device=dev, dtype=dtype), torch.int8)
    b = torch.randn(N, device=dev, dtype=dtype) if bias else None
    return xq, xs, qw.qweight, qw.wscale, qw.gscale, qw.gzs, b


def test_opcheck(dev):
    a = _args(dev=dev)
    torch.library.opcheck(_w4a8_int8_gemm, (*a, torch.float16),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    a = _args(dev=dev, bias=False, dtype=torch.bfloat16)
    torch.library.opcheck(_w4a8_int8_gemm, (*a, torch.bfloat16), test_utils=("test_schema", "test_faketensor"))


def test_op_matches_reference(dev):
    a = _args(dev=dev)
    y = w4a8_int8_gemm(*a, out_dtype=torch.float16)
    r = fmt.gemm_ref(*a, torch.float16)
    assert rel_l2(y, r) <= KERNEL_VS_REF[torch.float16]


def test_bad_arguments_named():
    xq, xs, qw, ws, gs, gz, b = _args()
    with pytest.raises(TypeError, match="xq"):
        w4a8_int8_gemm(xq.float(), xs, qw, ws, gs, gz, b)
    with pytest.raises(ValueError, match="xscale"):
        w4a8_int8_gemm(xq, xs[:1], qw, ws, gs, gz, b)
    with pytest.raises(ValueError, match="K=100"):
        w4a8_int8_gemm(xq[:, :100], xs, qw, ws, gs, gz, b)
    with pytest.raises(ValueError, match="gzs"):
        w4a8_int8_gemm(xq, xs, qw, ws, gs, gz[:, :1], b)
    with pytest.raises(ValueError, match="bias"):
        w4a8_int8_gemm(xq, xs, qw, ws, gs, gz, b[:3])
    with pytest.raises(TypeError, match="out_dtype"):
        w4a8_int8_gemm(xq, xs, qw, ws, gs, gz, b, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="x must"):
        w4a8_int8_linear(xq, qw, ws, gs, gz, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_module_from_linear(dtype, dev):
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 48, bias=True).to(dev, dtype)
    q = lowbit.quantize_linear(lin, "w4a8-int8", group_size=128)
    assert isinstance(q, W4A8INT8Linear) and q.scheme == "w4a8-int8"
    x = torch.randn(2, 5, 200, device=dev, dtype=dtype)
    y = q(x)
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    assert rel_l2(y.float(), lin(x).float()) < 0.15
    # the dequantized weight reproduces the GEMM up to activation quantization
    assert rel_l2(q.dequantize(), lin.weight.float()) < 0.15
    with pytest.raises(ValueError, match="features"):
        q(torch.randn(3, 199, device=dev, dtype=dtype))


def test_empty_config_state_dict_roundtrip():
    lin = torch.nn.Linear(136, 24, bias=False)
    q = W4A8INT8Linear.from_linear(lin, group_size=-1)
    e = W4A8INT8Linear.empty(136, 24, False, q.dtype, **q.config())
    e.load_state_dict(q.state_dict())
    x = torch.randn(3, 136)
    assert torch.equal(e(x), q(x))
    assert set(dict(q.named_buffers())) == {"qweight", "wscale", "gscale", "gzs"}
    assert q.weight_bytes() < 136 * 24


def test_torch_compile_fullgraph():
    lin = torch.nn.Linear(128, 16)
    q = W4A8INT8Linear.from_linear(lin)
    f = torch.compile(q, fullgraph=True, backend="eager")
    x = torch.randn(2, 128)
    assert torch.equal(f(x), q(x))


def test_module_tiled_layout(dev):
    """The codes sit row-tiled in memory when out_features is a multiple of 64 (else row-major, or as
    asked); both layouts give bit-identical outputs (M = 1 / 3 / 17) and weights. The state_dict always
    holds the row-major codes, so it loads into a module of either layout (older checkpoints too), and
    config() carries the layout through ``empty``."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(300, 128, bias=True)
    t = W4A8INT8Linear.from_linear(lin)
    r = W4A8INT8Linear.from_linear(lin, tiled=False)
    assert t.tiled and not r.tiled and t.config() == {"group_size": 128, "tiled": True}
    assert torch.equal(t.qweight, fmt.tile_codes(r.qweight)) and not torch.equal(t.qweight, r.qweight)
    assert not W4A8INT8Linear.from_linear(torch.nn.Linear(64, 40)).tiled
    assert W4A8INT8Linear(64, 128).tiled and not W4A8INT8Linear(64, 40).tiled  # the constructor's default agrees
    t, r = t.to(dev), r.to(dev)
    for M in (1, 3, 17):
        x = torch.randn(M, 300, device=dev)
        assert torch.equal(t(x), r(x)), M
    assert torch.equal(t.dequantize(), r.dequantize())
    st, sr = t.state_dict(), r.state_dict()
    assert all(torch.equal(st[k], sr[k]) for k in sr) and torch.equal(st["qweight"], r.qweight)  # row-major codes
    assert torch.equal(t.qweight, fmt.tile_codes(r.qweight))  # saving left the module's codes alone
    for cfg in (t.config(), {"group_size": 128}, {"group_size": 128, "tiled": False}):  # {group_size}: an old config
        e = W4A8INT8Linear.empty(300, 128, True, t.dtype, **cfg).to(dev)
        e.load_state_dict(st)
        assert e.tiled == cfg.get("tiled", True) and torch.equal(e(x), t(x)), cfg
    a = W4A8INT8Linear.empty(300, 128, True, t.dtype, **t.config()).to(dev)
    before = sr["qweight"].clone()
    a.load_state_dict(sr, assign=True)
    assert torch.equal(sr["qweight"], before) and torch.equal(a(x), t(x))  # the caller's tensor untouched
    with pytest.raises(TypeError, match="tiled"):
        W4A8INT8Linear(64, 64, tiled=1)
    n, b = t.qweight.shape
    wide = torch.zeros(n, 2 * b, dtype=torch.uint8, device=dev)[:, :b]  # rows at a 2b-byte stride
    with pytest.raises(ValueError, match="contiguous"):
        w4a8_int8_linear(x, wide, t.wscale, t.gscale, t.gzs, t.bias, tiled=True)
    with pytest.raises(ValueError, match="unit stride"):
        w4a8_int8_linear(x, t.qweight.t().contiguous().t(), t.wscale, t.gscale, t.gzs, t.bias)


def test_tiled_modules_fuse_only_when_aligned():
    """Tiled codes stack into one fused projection when every module but the last has a multiple of
    64 rows (the concatenation is then the tiled stack); otherwise (or with mixed layouts) the codes
    go back to row-major in place first (``prepare_fusion``)."""
    from lowbit.models.generate import _fuse_rows

    torch.manual_seed(0)
    a, b, c = (W4A8INT8Linear.from_linear(torch.nn.Linear(192, n), tiled=True) for n in (128, 64, 40))
    x = torch.randn(2, 192)
    want = torch.cat([a(x), b(x), c(x)], -1)
    rows = torch.cat([fmt.untile_codes(m.qweight) for m in (a, b, c)])
    f = _fuse_rows([a, b, c])
    assert f is not None and f.tiled and torch.equal(f(x), want)
    assert torch.equal(f.qweight, fmt.tile_codes(rows))
    assert torch.equal(torch.cat([a(x), b(x), c(x)], -1), want)  # the originals, now views of f's buffers
    # 40 rows before the last, or mixed layouts: both go back to row-major in place, then stack
    d, e = (W4A8INT8Linear.from_linear(torch.nn.Linear(192, n), tiled=True) for n in (40, 64))
    h = W4A8INT8Linear.from_linear(torch.nn.Linear(192, 64), tiled=False)
    for mods in ([d, e], [e, h]):
        want = torch.cat([m(x) for m in mods], -1)
        f = _fuse_rows(mods)
        assert f is not None and not f.tiled and not any(m.tiled for m in mods) and torch.equal(f(x), want)
    with pytest.raises(RuntimeError, match="view"):
        a._set_tiled(False)  # a's codes are now a view of the fused buffer
