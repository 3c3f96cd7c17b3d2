"""The grouped schedule of ``lut`` experts (FLUTE's lookup-table format in the fragment layout): the grouped GEMM
kernel (``lowbit.kernels.moe_grouped._moe_lut_kernel``) against a float64 reference of its numerics, op
``lowbit::moe_lut`` against the per-expert modules (the sparse schedule), the schedule's selection, bad input, the
op's registration, and the GPU (kernels, CUDA graph)."""
import pytest
import torch

from lowbit.formats.lut import pack_codes_mma, pair_table, quantize_lut, unpack_codes_mma
from lowbit.nn.moe import QuantExperts
from lowbit.ops.moe import _moe_lut, moe_lut, route
from tests.test_moe import _moe
from tests.test_moe_grouped import (_fuzz_case, _grouped_is_sparse, _module_sum, _on_references, _routing)
from tests.tolerances import rel_l2


@pytest.fixture
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _lut_experts(E, N, K, bits, group, dtype, seed=0, device="cpu"):
    """``[qweight, qweight_hi (4-bit: qweight), scales, pairs, table]`` lists of E random NF experts."""
    g = torch.Generator().manual_seed(seed)
    fields = [[], [], [], [], []]
    for _ in range(E):
        q = quantize_lut(torch.randn(N, K, generator=g) * 0.1, bits=bits, group_size=group, table="nf",
                         scale_dtype=dtype)
        qw, qh = pack_codes_mma(q.codes, bits, group, K)
        for f, t in zip(fields, (qw, qh if bits == 3 else qw, q.scales.t().contiguous(),
                                 pair_table(q.table, bits, dtype), q.table.float())):
            f.append(t.to(device))
    return fields


def _kernel_numerics(a, row_map, offsets, fields, K, bits, group, rows):
    """float64 reference of the kernel: per scale group the products of ``x`` and the table values rounded to the
    activation dtype summed, then times the group's scale; rows of no expert zero."""
    N = fields[2][0].shape[1]
    out = torch.zeros(rows, N, dtype=torch.float64)
    off = offsets.tolist()
    for e in range(len(fields[0])):
        s, t = off[e], min(off[e + 1], rows)
        if t <= s:
            continue
        idx = row_map[s:t].long() if row_map is not None else torch.arange(s, t)
        codes = unpack_codes_mma(fields[0][e], fields[1][e] if bits == 3 else None, N, K, bits, group).long()
        w = fields[4][e].to(a.dtype).double()[codes]  # [N, K]
        x = a[idx].double()
        sc = fields[2][e].double()  # [G, N]
        for gi in range(sc.shape[0]):
            ks = slice(gi * group, min((gi + 1) * group, K))
            out[s:t] += (x[:, ks] @ w[:, ks].t()) * sc[gi]
    return out


@pytest.mark.interpreter
@pytest.mark.parametrize("bits,N,K,group,split,dtype", [
    (4, 200, 300, 64, 1, torch.bfloat16), (4, 96, 576, 128, 3, torch.bfloat16), (3, 130, 640, 128, 2, torch.bfloat16),
    (4, 64, 512, 256, 2, torch.float16), (3, 40, 200, 256, 1, torch.float16), (4, 24, 130, 64, 2, torch.bfloat16)])
def test_lut_grouped_kernel_matches_reference(bits, N, K, group, split, dtype, monkeypatch):
    """The grouped LUT GEMM under the interpreter against the float64 reference of its numerics: N not a multiple of
    the 128-row program nor of the 16-row tile, K not a multiple of the group (padded codes meet masked x), 3 and 4
    bits, groups 64 / 128 / 256, split-K (summed, and returned as partials), gathered rows (gate_up) and direct rows
    (down), an expert with no rows, slots of no expert, and more rows per expert than one row step."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import lowbit.kernels.moe_grouped as mg
    from lowbit.kernels.moe_grouped import moe_gemm_triton

    if N == 24:  # 16-row steps: the experts' 12-21 rows take two
        monkeypatch.setattr(mg, "LUT_BLOCK_M", 16)
    E, T, k = 4, 30, 2
    idx, _ = _routing(T, k, 3, seed=N)  # expert 3 gets no rows
    idx[::4, 1] = E  # some slots no expert
    _, row_tok, off = route(idx, E)
    valid = int(off[-1])
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(K)).to(dtype)
    fields = _lut_experts(E, N, K, bits, group, dtype, seed=bits)
    for rmap, a in ((row_tok, x), (None, x[row_tok.long()])):
        want = _kernel_numerics(a, rmap, off, fields, K, bits, group, T * k)
        got = moe_gemm_triton("lut", a, None, rmap, off, fields[:4], None, K, group, dtype, T * k, 1, bits=bits,
                              split_k=split)
        assert rel_l2(got[:valid], want[:valid]) < 4e-3  # the output's rounding to 16 bits
        if split > 1:
            parts = moe_gemm_triton("lut", a, None, rmap, off, fields[:4], None, K, group, dtype, T * k, 1,
                                    bits=bits, split_k=split, partials=True)
            assert parts.shape == (split, T * k, N) and parts.dtype == torch.float32
            assert rel_l2(parts.sum(0)[:valid], want[:valid]) < 1e-5
    with pytest.raises(ValueError, match="output dtype"):
        moe_gemm_triton("lut", x, None, row_tok, off, fields[:4], None, K, group, torch.float32, T * k, 1, bits=bits)


@pytest.mark.parametrize("bits,group", [(4, 128), (4, 64), (3, 128)])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lut_grouped_equals_sparse_on_references(bits, group, arch, dtype, reference_ops):
    """With the references (the per-expert modules' CPU path, rows independent) the grouped op is the sparse schedule
    bit for bit: the same GEMMs, silu / weight roundings and per-token sum order; slots of no expert skipped."""
    block = _moe(arch).to(dtype).model.layers[0].mlp
    qe = QuantExperts.from_experts(block.experts, "lut", bits=bits, group_size=group)
    spec = qe.grouped_weights()
    assert spec["scheme"] == "lut" and spec["bits"] == bits and spec["dtype"] == dtype
    _grouped_is_sparse(qe, block, dtype, seed=3)


def test_lut_schedule_selection(reference_ops):
    """Grouped: LUT experts in the fragment layout (4-bit g >= 64, 3-bit g >= 128) called in their dtype. Not: the
    planar layout (2-bit, 4-bit g32), other activation dtypes (the modules cast per call), mixed configs."""
    experts = _moe("mixtral").to(torch.bfloat16).model.layers[0].mlp.experts
    for bits, group in ((2, 64), (4, 32)):
        assert QuantExperts.from_experts(experts, "lut", bits=bits, group_size=group).grouped_weights() is None
    qe = QuantExperts.from_experts(experts, "lut", bits=4, group_size=128)
    assert qe.grouped_weights()["scheme"] == "lut"
    x = torch.randn(3, 64)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.rand(3, 2)
    with torch.no_grad():
        want = qe(x, idx, w)  # float32 activations: the modules (each casts to bf16 and back)
        qe.grouped = False
        assert torch.equal(qe(x, idx, w), want)
        qe.grouped = True
    qe.down[1] = QuantExperts.from_experts(experts, "lut", bits=4, group_size=64).down[1]
    assert qe.grouped_weights() is None


@pytest.mark.parametrize("scheme,opts", [("lut", dict(bits=4, group_size=128)), ("w4a8-fp8", dict(group_size=32)),
                                         ("w4a8-int8", dict(group_size=128))])
def test_grouped_spec_needs_one_shape_per_field(scheme, opts, reference_ops):
    """An expert swapped for one of other shapes (the kernels would read it with expert 0's sizes, out of bounds) or
    held in a non-contiguous view leaves the grouped schedule: the per-expert modules run (a review of session 40)."""
    from lowbit import quantize_linear
    from lowbit.nn.moe import _as_linear

    experts = _moe("mixtral").to(torch.bfloat16).model.layers[0].mlp.experts
    qe = QuantExperts.from_experts(experts, scheme, **opts)
    assert qe.grouped_weights() is not None
    w = experts.down_proj[1].detach()
    qe.down[1] = quantize_linear(_as_linear(torch.cat([w, w], 1)), scheme, **opts)  # in_features 2I
    assert qe.grouped_weights() is None
    qe = QuantExperts.from_experts(experts, scheme, **opts)
    buf = qe.gate_up[0].qweight if scheme != "w4a8-fp8" else qe.gate_up[0].codes
    view = torch.empty(buf.shape[0], buf.shape[1] + 4, dtype=buf.dtype)[:, :buf.shape[1]]
    view.copy_(buf)
    if scheme == "w4a8-fp8":
        qe.gate_up[0].codes = view
    else:
        qe.gate_up[0].qweight = view
    qe.clear_grouped_cache()
    assert qe.grouped_weights() is None


def test_lut_bad_input(reference_ops):
    qe = QuantExperts.from_experts(_moe("mixtral").to(torch.bfloat16).model.layers[0].mlp.experts, "lut", bits=4,
                                   group_size=128)
    spec = qe.grouped_weights()
    gu, dn = spec["gate_up"], spec["down"]
    x = torch.randn(3, 64).bfloat16()
    idx = torch.zeros(3, 1, dtype=torch.long)
    w = torch.ones(3, 1)
    assert moe_lut(x, idx, w, gu, dn, 4, 128).shape == (3, 64)
    with pytest.raises(ValueError, match="bits and group_size"):
        moe_lut(x, idx, w, gu, dn, 4, 32)
    with pytest.raises(ValueError, match="bits and group_size"):
        moe_lut(x, idx, w, gu, dn, 2, 128)
    with pytest.raises(TypeError, match="x must be bf16 or fp16"):
        moe_lut(x.float(), idx, w, gu, dn, 4, 128)
    with pytest.raises(TypeError, match="scales"):
        moe_lut(x.half(), idx, w, gu, dn, 4, 128)  # fp16 x against bf16 scales
    with pytest.raises(ValueError, match="five fields"):
        moe_lut(x, idx, w, gu[:4], dn, 4, 128)
    with pytest.raises(ValueError, match="x has 32 features"):
        moe_lut(x[:, :32], idx, w, gu, dn, 4, 128)
    with pytest.raises(ValueError, match="qweight"):
        moe_lut(x, idx, w, gu, dn, 3, 128)  # 4-bit buffers called as 3-bit
    with pytest.raises(ValueError, match="top_k_index"):
        moe_lut(x, idx[:2], w, gu, dn, 4, 128)
    wide = [torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)[:, :t.shape[1]] for t in gu[0]]  # padded rows
    with pytest.raises(ValueError, match=r"gate_up qweight\[0\] must be contiguous"):
        moe_lut(x, idx, w, (wide, wide, *gu[2:]), dn, 4, 128)
    qe3 = QuantExperts.from_experts(_moe("mixtral").to(torch.bfloat16).model.layers[0].mlp.experts, "lut", bits=3,
                                    group_size=128)
    gu3, dn3 = qe3.grouped_weights()["gate_up"], qe3.grouped_weights()["down"]
    assert moe_lut(x, idx, w, gu3, dn3, 3, 128).shape == (3, 64)
    with pytest.raises(ValueError, match="qweight_hi"):
        moe_lut(x, idx, w, (gu3[0], None, *gu3[2:]), dn3, 3, 128)
    assert torch.equal(moe_lut(x[:0], idx[:0], w[:0], gu, dn, 4, 128), x[:0])


def test_lut_opcheck_and_compile(reference_ops):
    """Schema and fake implementation (opcheck; AOT dispatch is not run on bf16 inputs, which it differentiates, as
    for ``lowbit::lut_gemm``), and the experts module under torch.compile(fullgraph=True)."""
    block = _moe("mixtral").to(torch.bfloat16).model.layers[0].mlp
    qe = QuantExperts.from_experts(block.experts, "lut", bits=4, group_size=64)
    spec = qe.grouped_weights()
    x = torch.randn(4, 64).bfloat16()
    _, w, idx = block.gate(x)
    torch.library.opcheck(_moe_lut, (x, idx, w, *spec["gate_up"], *spec["down"], 4, 64),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with torch.no_grad():
        want = qe(x, idx, w)
        got = torch.compile(qe, fullgraph=True, backend="eager")(x, idx, w)
    assert torch.equal(got, want)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=4, deadline=None)
@given(bits_group=st.sampled_from(((4, 64), (4, 128), (3, 128), (3, 256))), E=st.integers(1, 9), k=st.integers(1, 4),
       T=st.integers(1, 12), H=st.sampled_from((16, 48, 130)), inter=st.sampled_from((8, 40, 72)),
       dtype=st.sampled_from((torch.bfloat16, torch.float16)), bad=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_fuzz_lut_grouped_op(bits_group, E, k, T, H, inter, dtype, bad, seed):
    """Random lut experts (any E, top-k, sizes not multiples of the blocks or of the groups, bf16 / fp16), random
    routing with duplicate ids and, with ``bad``, slots of no expert: the grouped op's references and, under the
    interpreter, its kernels stay within a bf16 / fp16 chain of two GEMMs of the per-token sum of the modules (not bit
    for bit here: the CPU reference's float32 matmul over all of an expert's rows rounds differently from one row at
    a time; ``test_lut_grouped_equals_sparse_on_references`` has the bit-for-bit check against the sparse schedule)."""
    import os

    bits, group = bits_group
    gu, dn, qe, x, idx, w = _fuzz_case("lut", dict(bits=bits, group_size=group, dtype=dtype), E, k, T, H, inter, dtype,
                                       bad, seed)
    spec = qe.grouped_weights()
    assert spec is not None and spec["scheme"] == "lut"
    want, ref = _on_references(lambda: (_module_sum(gu, dn, x, idx, w),
                                        moe_lut(x, idx, w, spec["gate_up"], spec["down"], bits, group)))
    with torch.no_grad():
        assert rel_l2(ref, want) < 0.02
        if os.environ.get("TRITON_INTERPRET") == "1":
            got = moe_lut(x, idx, w, spec["gate_up"], spec["down"], bits, group)
            assert rel_l2(got, want) < 0.08


@pytest.mark.interpreter
@pytest.mark.parametrize("bits,group", [(4, 64), (3, 128)])
def test_lut_dequant_experts_kernel_equals_per_expert(bits, group, monkeypatch):
    """Session 41: the experts' dequantization in one launch (``lut_dequant_mma_experts_triton``, the prefill form's
    first step) == the per-expert modules' large-M dequantization (``lut_dequant_mma_triton``) bit for bit, N and K
    not multiples of its 16 x 256 tiles; an expert without routed rows is skipped (its part of the buffer is not
    written, so it is not compared)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from lowbit.kernels.lut_gemm import lut_dequant_mma_experts_triton, lut_dequant_mma_triton

    E, N, K = 3, 40, 320
    f = _lut_experts(E, N, K, bits, group, torch.bfloat16, seed=bits)
    off = torch.tensor([0, 5, 5, 9], dtype=torch.int32)  # expert 1: no rows
    w = lut_dequant_mma_experts_triton(f[0], f[1] if bits == 3 else None, f[2], f[4], off, bits=bits,
                                       group_size=group, out_features=N, in_features=K, dtype=torch.bfloat16)
    for e in (0, 2):
        want = lut_dequant_mma_triton(f[0][e], f[1][e] if bits == 3 else None, f[2][e], f[4][e], bits=bits,
                                      group_size=group, out_features=N, in_features=K, dtype=torch.bfloat16)
        assert torch.equal(w[e], want)


@pytest.mark.interpreter
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_lut_prefill_form_matches_modules(arch, monkeypatch):
    """Session 41: with ``LUT_DEQUANT_ROWS`` lowered to 1, the ``lut`` op takes its prefill form (the experts
    dequantized once to bf16, ``torch._grouped_mm``) and matches the per-expert modules' references summed token by
    token; only bf16 with sizes that are multiples of 8 take it."""
    pytest.importorskip("triton")
    import lowbit.ops.moe as om

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(om, "LUT_DEQUANT_ROWS", 1)
    block = _moe(arch).bfloat16().model.layers[0].mlp
    qe = QuantExperts.from_experts(block.experts, "lut", bits=4, group_size=64)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    _, w, idx = block.gate(x)
    idx = idx.clone()
    idx[::3, 0] = qe.num_experts  # some slots no expert
    calls = []
    real = om._lut_dequant_gemm
    monkeypatch.setattr(om, "_lut_dequant_gemm", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = qe(x, idx, w)
    assert len(calls) == 2  # gate_up and down took the prefill form
    want = _on_references(lambda: _module_sum(list(qe.gate_up), list(qe.down), x, idx, w))
    assert rel_l2(got, want) < 2e-2  # (the references' float32 weights: as test_grouped_module_under_interpreter)
    assert not om._dequant_wanted("lut", 100, 4, x.half(), 64) and not om._dequant_wanted("lut", 100, 4, x, 60)
