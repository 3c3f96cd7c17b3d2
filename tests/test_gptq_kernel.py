"""GPTQ's column-loop kernel (``lowbit.kernels.gptq_block``, ``gptq_weight(kernel=True)``) against the PyTorch loop
(``kernel=False``) in float32 on the same input: the same Q and group parameters bit for bit (signed zeros too), for
every grid (w4a8-fp8 with and without a PTS exponent, w4a8-int8 incl. per channel, LUT NF4 / NF3 / uniform), group
sizes 32 / 64 / 128, act-order on and off, K not a multiple of the group or of the 128-column block, N not a multiple
of the row tile; Q on the format's grid under the returned parameters; all-zero rows and groups, a dead input.
The interpreter runs numpy (no FMA); on CUDA the kernel is compiled without FP contraction: ``test_kernel_on_gpu``."""
import pytest
import torch

from lowbit.formats import lut as lut_fmt
from lowbit.formats import w4a8_fp8 as fp8_fmt
from lowbit.formats import w4a8_int8 as int8_fmt
from lowbit.kernels import gptq_block
from lowbit.ptq.gptq import gptq_weight, hessian_update, make_grid, proxy_loss, round_to_nearest

FP8_0, FP8_3 = ("w4a8-fp8", {"pts_exp": 0}), ("w4a8-fp8", {"pts_exp": 3})
INT8 = ("w4a8-int8", {})
NF4, NF3 = ("lut", {"bits": 4, "table": "nf"}), ("lut", {"bits": 3, "table": "nf"})
UNIFORM = ("lut", {"bits": 4, "table": "int"})


def _hessian(k, seed=0, t=256, dev="cpu"):
    """float32 H of correlated inputs (a rank-k/4 mix plus noise), with a dead input channel 5 (diag H = 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k // 4 + 1, generator=g) @ torch.randn(k // 4 + 1, k, generator=g)
    x = x + 0.1 * torch.randn(t, k, generator=g)
    x[:, 5] = 0.0
    return hessian_update(None, 0, x.to(dev))[0].float()


def _weight(n, k, seed=1, dev="cpu"):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[2] = 0.0  # an all-zero row
    w[4, 32:64] = 0.0  # an all-zero group in the original weight (GPTQ's updates then fill it)
    w[6, 7] = -0.0
    return w.to(dev)


def _bits(t):
    return t.contiguous().view(torch.int32)


def _on_grid(scheme, opts, q, scales, gs):
    """The format reference quantizes ``q`` under GPTQ's parameters to itself (round to nearest gives q back)."""
    k = q.shape[1]
    if scheme == "w4a8-fp8":
        c, s, inv = fp8_fmt.quantize_weight(q, gs, opts["pts_exp"], scales["sigma"])
        back = fp8_fmt.dequantize_weight(c, s, k, gs) * inv
    elif scheme == "w4a8-int8":
        back = int8_fmt.dequantize(int8_fmt.quantize(q, gs, s1=scales["s1"], s2=scales["s2"], z=scales["z"]))
    else:
        back = lut_fmt.dequantize_lut(lut_fmt.quantize_lut(q, bits=opts["bits"], group_size=gs, table=opts["table"],
                                                           scales=scales["scales"]))[:, :k]
    return torch.equal(back.float(), q)


def _compare(scheme, opts, n, k, gs, act_order, dev="cpu", seed=0):
    """GPTQ by the kernel and by the PyTorch loop on the same float32 input: identical; returns both results."""
    w, h = _weight(n, k, seed + 1, dev), _hessian(k, seed, dev=dev)
    grid = make_grid(scheme, w, opts)
    q0, s0 = gptq_weight(w, h, grid, gs, act_order=act_order, kernel=False)
    q1, s1 = gptq_weight(w, h, grid, gs, act_order=act_order, kernel=True)
    assert torch.isfinite(q1).all()
    diff = (q0 != q1).float().mean().item()
    assert torch.equal(_bits(q0), _bits(q1)), f"{diff:.2e} of Q differ"
    assert s0.keys() == s1.keys() and all(torch.equal(s0[f], s1[f]) for f in s0)
    return w, h, q1, s1


CASES = [  # (scheme, opts, N, K, group size, act_order)
    (*FP8_0, 37, 150, 32, False), (*FP8_0, 20, 200, 128, True), (*FP8_3, 37, 136, 64, False),
    (*FP8_3, 20, 100, 32, True), (*INT8, 37, 150, 32, True), (*INT8, 20, 200, 128, False),
    (*INT8, 20, 200, 200, False), (*NF4, 37, 136, 64, True), (*NF4, 20, 200, 128, False),
    (*NF3, 37, 100, 32, False), (*NF3, 20, 150, 64, True), (*UNIFORM, 20, 136, 128, True),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("scheme,opts,n,k,gs,act_order", CASES)
def test_kernel_is_the_torch_loop(scheme, opts, n, k, gs, act_order, monkeypatch):
    """Bit for bit the PyTorch loop (one program of 64 rows: the interpreter's cost is per op, not per row); the
    group size K (200) is w4a8-int8's per-channel group: lazy blocks of 128 inside it."""
    monkeypatch.setattr(gptq_block, "BLOCK_R", 64)
    w, h, q, scales = _compare(scheme, opts, n, k, gs, act_order)
    assert _on_grid(scheme, opts, q, scales, -1 if gs == k else gs)
    assert (q[2] == 0).all() and (q[:, 5] == 0).all()  # the zero row, the dead input
    assert proxy_loss(w, q, h) < proxy_loss(w, round_to_nearest(w, make_grid(scheme, w, opts), gs), h)


@pytest.mark.interpreter
@pytest.mark.parametrize("scheme,opts", [FP8_0, INT8, NF4])
def test_row_tiles(scheme, opts):
    """Several programs (the default 16-row tile) with a partial last tile: N = 37."""
    _compare(scheme, opts, 37, 72, 32, False, seed=3)


@pytest.mark.interpreter
@pytest.mark.parametrize("scheme,opts", [FP8_0, INT8, NF3])
def test_zero_weight(scheme, opts, monkeypatch):
    monkeypatch.setattr(gptq_block, "BLOCK_R", 64)
    h = _hessian(64)
    q, _ = gptq_weight(torch.zeros(9, 64), h, make_grid(scheme, torch.zeros(9, 64), opts), 32, kernel=True)
    assert torch.equal(q, torch.zeros(9, 64))


def test_kernel_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w, h = torch.randn(4, 32), torch.eye(32)
    with pytest.raises(ValueError, match="kernel=True"):
        gptq_weight(w, h, make_grid(*FP8_0[:1], w, FP8_0[1]), 32, kernel=True)


def test_launcher_checks():
    w, u = torch.zeros(4, 64), torch.eye(64)
    p = torch.ones(4, 1)
    with pytest.raises(ValueError, match="segment"):
        gptq_block.gptq_block_triton(w, u, w.clone(), torch.zeros(4, 32), 0, 8, 40, "w4a8-fp8", p)
    with pytest.raises(ValueError, match="block width"):
        gptq_block.gptq_block_triton(w, u, w.clone(), torch.zeros(4, 256), 0, 0, 8, "w4a8-fp8", p)
    with pytest.raises(ValueError, match="tables for lut"):
        gptq_block.gptq_block_triton(w, u, w.clone(), torch.zeros(4, 32), 0, 0, 8, "lut", p)
    with pytest.raises(TypeError, match="dtype"):
        gptq_block.gptq_block_triton(w.double(), u, w.clone(), torch.zeros(4, 32), 0, 0, 8, "w4a8-fp8", p)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme,opts", [FP8_0, FP8_3, INT8, NF4, NF3, UNIFORM])
@pytest.mark.parametrize("gs,act_order", [(32, False), (64, True), (128, False), (128, True)])
def test_kernel_on_gpu(scheme, opts, gs, act_order):
    """Compiled on CUDA (no FP contraction): bit for bit the PyTorch loop on CUDA, float32, N and K off the tiles."""
    w, h, q, scales = _compare(scheme, opts, 300, 520, gs, act_order, dev="cuda")
    assert _on_grid(scheme, opts, q, scales, gs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hessian_keeps_tf32_off():
    """The Hessian is the float32 GEMM even where the user turned TF32 on globally (TF32 Hessians cost the embedded
    model 0.06-0.33 perplexity under GPTQ, session 43), and the switch is left as it was."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2048, 1024, device="cuda", generator=g) * 4).to(torch.bfloat16)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        h, _ = hessian_update(None, 0, x)
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    ref = (x.double().T @ x.double()) * (2.0 / 2048)
    assert ((h.double() - ref).abs().max() / ref.abs().max()).item() < 4e-6
