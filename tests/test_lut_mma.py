"""The tensor-core fragment kernel (``_lut_mma_kernel``) and its layout, under the interpreter on
CPU (the inline-PTX mma is replaced by an emulation that reads the same fragment layout), plus the
OutOfResources fallback of the planar kernel."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowbit.formats.lut import (dequantize_lut, mma_shapes, pack_codes_mma, pack_lut, pair_table, quantize_lut,
                                unpack_codes_mma)
from lowbit.kernels import lut_gemm as K
from tests._ptx import pair_smem, run_ptx
from tests.tolerances import KERNEL_VS_REF, rel_l2
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 300), g=st.sampled_from([128, 256]), bits=st.sampled_from([3, 4]))
def test_fragment_layout_roundtrip(n, k, g, bits):
    c = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8)
    q, qh = pack_codes_mma(c, bits, g)
    nrt, nc = mma_shapes(n, k, bits, g)
    assert q.shape == (nrt, nc * 128) and q.dtype == torch.int32
    assert (qh is None) == (bits == 4) and (qh is None or qh.shape == (nrt, nc * 64))
    assert torch.equal(unpack_codes_mma(q, qh, n, k, bits, g), c)


def test_fragment_layout_formula():
    """Word (rt, c, lane, v), byte b, nibble h = code of row 16rt + g + 8(b&1), K = 64c + 16t + 4v + 2(b>>1) + h."""
    n, k = 32, 128
    c = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    q, _ = pack_codes_mma(c, 4, 64)
    for rt, cc, lane, v, b, h in [(0, 0, 0, 0, 0, 0), (1, 1, 31, 3, 3, 1), (0, 1, 6, 2, 1, 0), (1, 0, 13, 1, 2, 1)]:
        g, t = divmod(lane, 4)
        word = int(q[rt, (cc * 32 + lane) * 4 + v]) & 0xFFFFFFFF
        code = (word >> (8 * b + 4 * h)) & 15
        assert code == int(c[16 * rt + g + 8 * (b & 1), 64 * cc + 16 * t + 4 * v + 2 * (b >> 1) + h])


def _run(m, n, k, g, dtype, dev, bits=4, **cfg):
    torch.manual_seed(m * 7 + n)
    w = torch.randn(n, k, device=dev)
    q = quantize_lut(w, bits=bits, group_size=g, scale_dtype=dtype)
    x = torch.randn(m, k, device=dev, dtype=dtype)
    qm, qh = pack_codes_mma(q.codes, bits, g, k)
    y = K.lut_mma_triton(x, qm, qh, q.scales.t().contiguous(), pair_table(q.table, bits, dtype).to(dev),
                         q.table.to(dev), bits=bits, group_size=g, out_features=n, **cfg)
    assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
    return rel_l2(y, x.double() @ dequantize_lut(q).double().t())


@pytest.mark.parametrize("m,n,k,g,dtype,cfg", [
    (1, 40, 200, 64, torch.bfloat16, {}),                       # K not a multiple of the group: x padded
    (5, 33, 130, 128, torch.float16, {"split_k": 2}),           # split-K reduction, fp16
    (12, 70, 256, 256, torch.bfloat16, {}),                     # nt = 2
    (20, 17, 128, 64, torch.bfloat16, {"r": 2}),                # nt = 4, R = 2 row-tile repeats
    (37, 24, 64, 64, torch.bfloat16, {"nt": 2}),                # several token blocks (grid_m = 3)
    (1, 40, 300, 128, torch.bfloat16, {"bits": 3}),             # 3-bit planes
    (9, 20, 256, 256, torch.float16, {"bits": 3, "split_k": 2}),
    (30, 17, 128, 128, torch.bfloat16, {"bits": 3, "r": 2}),
    (2, 24, 640, 128, torch.bfloat16, {"gu": 2, "split_k": 2}),  # groups per step; ragged last step
    (3, 24, 640, 128, torch.bfloat16, {"bits": 3, "gu": 4}),
])
def test_mma_kernel_matches_reference(m, n, k, g, dtype, cfg, dev):
    assert _run(m, n, k, g, dtype, dev, **cfg) < KERNEL_VS_REF[dtype]


@pytest.mark.parametrize("m,n,k,g,bits,dtype,cfg", [
    (1, 48, 200, 64, 4, torch.bfloat16, {}),                     # K padded
    (5, 64, 384, 128, 4, torch.float16, {"split_k": 3}),         # the epilogue after the split-K reduction
    (20, 96, 256, 128, 4, torch.bfloat16, {"r": 2}),             # nt = 4, R = 2 row-tile repeats
    (3, 32, 256, 128, 3, torch.float16, {}),                     # 3-bit planes
])
def test_mma_kernel_silu_mul_epilogue(m, n, k, g, bits, dtype, cfg, dev):
    """A fused gate_up (gate / up rows interleaved by 8): each lane pairs its C registers v / v + 2 in the
    ``SILU_MUL`` epilogue; ``silu_mul_ref`` of the float64 product."""
    from lowbit.formats.common import interleave_rows, silu_mul_ref

    torch.manual_seed(m + n)
    w = interleave_rows(torch.randn(n // 2, k, device=dev), torch.randn(n // 2, k, device=dev), 8)
    q = quantize_lut(w, bits=bits, group_size=g, table="nf", scale_dtype=dtype)
    x = torch.randn(m, k, device=dev, dtype=dtype)
    qm, qh = pack_codes_mma(q.codes, bits, g, k)
    y = K.lut_mma_triton(x, qm.to(dev), None if qh is None else qh.to(dev), q.scales.t().contiguous().to(dev),
                         pair_table(q.table, bits, dtype).to(dev), q.table.to(dev), bits=bits, group_size=g,
                         out_features=n, silu_mul=True, **cfg)
    assert y.shape == (m, n // 2) and y.dtype == dtype
    ref = silu_mul_ref((x.double() @ dequantize_lut(q).double().t()).to(dtype), 8)
    assert rel_l2(y, ref) < 2 * KERNEL_VS_REF[dtype]


def test_mma_kernel_rejects_group_32_and_bad_words():
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    q = quantize_lut(torch.randn(8, 64), bits=4, group_size=64)
    qm, _ = pack_codes_mma(q.codes, 4, 64)
    args = (q.scales.t().contiguous(), pair_table(q.table, 4), q.table)
    with pytest.raises(ValueError, match="group_size"):
        K.lut_mma_triton(x, qm, None, *args, bits=4, group_size=32, out_features=8)
    with pytest.raises(ValueError, match="group_size"):
        K.lut_mma_triton(x, qm, None, *args, bits=3, group_size=64, out_features=8)
    with pytest.raises(ValueError, match="qweight"):
        K.lut_mma_triton(x, qm[:, :64], None, *args, bits=4, group_size=64, out_features=8)


def test_out_of_resources_falls_back_to_smaller_config(monkeypatch, dev):
    """A config that does not fit (r1: flute-nf3 at batch 64) is retried with fewer stages / smaller tiles."""
    import triton

    real = K._lut_gemm_kernel
    seen = []

    class Flaky:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append((kw["num_stages"], kw["BLOCK_N"]))
                if kw["num_stages"] > 1:
                    raise triton.runtime.errors.OutOfResources(270336, 232448, "shared memory")
                return real[grid](*a, **kw)
            return launch

    monkeypatch.setattr(K, "_lut_gemm_kernel", Flaky())
    w = torch.randn(24, 128, device=dev)
    q = quantize_lut(w, bits=3, group_size=64)
    qw, qh, s = pack_lut(q)
    x = torch.randn(3, 128, dtype=torch.bfloat16, device=dev)
    y = K.lut_gemm_triton(x, qw, qh, s, q.table.to(dev), bits=3, group_size=64, out_features=24)
    assert seen[0][0] == 2 and seen[-1][0] == 1
    assert rel_l2(y, x.double() @ dequantize_lut(q).double().t()) < KERNEL_VS_REF[torch.bfloat16]
    assert K._smaller_config(dict(num_stages=1, block_n=16, block_m=16, use_dot=True)) is None


@pytest.mark.parametrize("bits,g", [(4, 64), (3, 128)])
def test_dequant_mma_kernel(bits, g, dev):
    w = torch.randn(37, 300, device=dev)
    q = quantize_lut(w, bits=bits, group_size=g)
    qm, qh = pack_codes_mma(q.codes, bits, g, 300)
    wd = K.lut_dequant_mma_triton(qm, qh, q.scales.t().contiguous(), q.table.to(dev), bits=bits, group_size=g,
                                  out_features=37, in_features=300, dtype=torch.float32)
    assert torch.equal(wd, dequantize_lut(q))


def test_gpu_only_options_fall_back_and_validate(dev):
    """``xh`` (x one group ahead), ``ring`` (cp.async ring of the codes), ``sp`` (scales one group ahead) are
    GPU options: under
    the interpreter they run the plain loop (same numerics), compiled they run as asked; bad values are refused on
    the GPU path."""
    assert _run(3, 24, 256, 128, torch.bfloat16, dev, xh=2, ring=4, sp=True) < KERNEL_VS_REF[torch.bfloat16]
    asm = K._ring_read_asm(6)
    assert "cp.async.wait_group 6;" in asm and "ld.shared.v4.b32" in asm
    assert "cp.async.commit_group" in K._CP_ASM.value and "@p cp.async.cg.shared.global" in K._CP_ASM.value
    assert set(K._RING_RD) >= {(r - 1) * rr for r in (2, 4, 8) for rr in (1, 2, 4)} | {0}
    assert set(K._RING_RD3) >= {2 * (r - 1) * rr for r in (2, 4, 8) for rr in (1, 2, 4)}  # 3-bit: 2 groups per chunk
    assert "cp.async.ca.shared.global [d], [$4], 8;" in K._CPH_ASM.value


def test_balanced_split(dev):
    """Option ``balance``: the split-K count that evens out the SMs' load (H200: 132 SMs)."""
    from lowbit._utils import cdiv

    s = K.balanced_split(112, 32, 132, 2)  # gate_up M=1 r2 w8
    assert s == 8 and cdiv(112 * s, 132) * cdiv(32, s) == 28  # vs 33 for the ctas_per_sm rule (split 3)
    assert K.balanced_split(16, 112, 132, 2) == 16  # down: 256 programs of 7 groups
    assert K.balanced_split(1, 1, 132, 4) == 1 and K.balanced_split(500, 1, 132, 4) == 1
    assert _run(2, 24, 640, 128, torch.bfloat16, dev, balance=True) < KERNEL_VS_REF[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(16, 20480, 1024), (12, 4096, 2048), (32, 16384, 1024), (24, 3000, 1111),
                                   (64, 16400, 1024), (48, 3000, 1111), (40, 4096, 2048), (1, 3000, 1111),
                                   (4, 4096, 9000), (8, 20480, 1024), (3, 1000, 576)])
def test_gpu_default_configs_small_m(m, n, k):
    """GPU: the 4-bit M = 1..64 defaults of ``mma_config`` (R14 sweep, the session-8 probe and session 22's small-M
    launches: ``ring`` / ``xh`` / ``sp`` / ``balance`` / 2 row tiles per warp, which the interpreter does not run)
    against float64, both sides of the N >= 16384 and K >= 8192 rules, ragged N and K."""
    if not GPU:
        pytest.skip("needs CUDA")
    cfg = K.mma_config(m, n, k, 4, 128)
    assert cfg.get("xh") == 2 or (m <= 4 and n >= 16384)
    assert _run(m, n, k, 128, torch.bfloat16, "cuda") < KERNEL_VS_REF[torch.bfloat16]


def test_small_m_config_rule():
    """The 4-bit M = 9..64 rule: gate_up-like N (>= 16384) vs down-like N take the R14 sweep's and the
    session-8 probe's winners (M > 16: 4 warps per program; gate_up-like N: 2 row tiles per warp)."""
    assert K.mma_config(16, 28672, 4096, 4, 128)["prefetch"] and not K.mma_config(16, 28672, 4096, 4, 128).get("ring")
    assert K.mma_config(16, 4096, 14336, 4, 128)["ring"] == 4 and K.mma_config(16, 4096, 14336, 4, 128)["sp"]
    assert K.mma_config(32, 28672, 4096, 4, 128)["ring"] == 4 and K.mma_config(32, 28672, 4096, 4, 128)["r"] == 2
    assert K.mma_config(32, 8192, 8192, 4, 128)["prefetch"] and K.mma_config(32, 8192, 8192, 4, 128)["num_warps"] == 4
    assert K.mma_config(1, 28672, 4096, 4, 128) == dict(nt=1, r=2, num_warps=8, ctas_per_sm=2, prefetch=False, gu=1)
    # session 22 (s22_lut_fragment_small_m.json): M <= 8 by shape
    assert K.mma_config(8, 28672, 4096, 4, 128)["prefetch"] and K.mma_config(8, 28672, 4096, 4, 128)["r"] == 1
    assert K.mma_config(1, 4096, 14336, 4, 128)["prefetch"] and K.mma_config(2, 8192, 8192, 4, 128)["xh"] == 2
    assert K.mma_config(1, 4096, 4096, 4, 128)["ring"] == 4 and K.mma_config(8, 6144, 4096, 4, 128)["sp"]
    for m, n in ((48, 4096), (64, 28672)):
        c = K.mma_config(m, n, 4096, 4, 128)
        assert c["nt"] == 4 and c["xh"] == 2 and c["num_warps"] == 4


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.integers(0, 2 ** 32 - 1), min_size=4, max_size=4),
       table=st.lists(st.integers(0, 2 ** 16 - 1), min_size=16, max_size=16), lane=st.integers(0, 31))
def test_fragment_lookup_ptx_reads_the_pair_table(words, table, lane):
    """The lookups of the fragment kernel's PTX (``_mma_asm``, 4-bit), run k-step by k-step through the tests' PTX
    interpreter (the ``mma.sync`` lines left out): A register b of k-step s holds the pair of code byte b of word s,
    read from lane ``lane``'s copy of the table (entries 128 bytes apart)."""
    stride = 128
    smem = {a: v for a, v in pair_smem(table, 0, stride).items() if a % stride == 4 * lane}
    stmts = [t.strip().strip("{}").strip() for t in K._mma_asm(1, True, 4).split(";")]
    steps, cur = [], []
    for t in stmts:  # k-step s = the statements before its mma.sync
        if t.startswith("mma.sync"):
            steps.append(cur)
            cur = []
        elif t and not t.startswith((".reg", "mov.b32 sel")):
            cur.append(t)
    assert len(steps) == 4
    ops = {f"${4 + w}": words[w] for w in range(4)} | {"$8": 4 * lane}
    for s_, body in enumerate(steps):
        out = ops = run_ptx(";".join(body) + ";", ops, smem, lane)  # (registers carry over: gs is set once)
        for b in range(4):
            byte = (words[s_] >> 8 * b) & 0xFF
            assert out[f"a{b}"] == table[byte & 15] | table[byte >> 4] << 16


def _frag_args(m, n, k, dtype, dev, bits=4):
    """(launcher arguments, keyword arguments) of ``lut_mma_triton`` for one random g128 weight and input."""
    g = 128
    torch.manual_seed(m + n)
    w = torch.randn(n, k, device=dev)
    q = quantize_lut(w, bits=bits, group_size=g, scale_dtype=dtype)
    x = torch.randn(m, k, device=dev, dtype=dtype)
    qm, qh = pack_codes_mma(q.codes, bits, g, k)
    args = (x, qm, qh, q.scales.t().contiguous(), pair_table(q.table, bits, dtype).to(dev), q.table.to(dev))
    return args, dict(bits=bits, group_size=g, out_features=n)


def _pdl_case(m, n, k, dtype, dev):
    """(y of the PDL launch, y of the plain launch) of one weight and input."""
    args, kw = _frag_args(m, n, k, dtype, dev)
    return K.lut_mma_triton(*args, pdl=True, **kw), K.lut_mma_triton(*args, **kw)


@pytest.mark.parametrize("m,n,k,dtype", [(1, 40, 300, torch.bfloat16), (3, 33, 256, torch.float16)])
def test_pdl_flag_same_result(m, n, k, dtype, dev):
    """``pdl=True`` (the runner's batch-1 chain) changes the launch, not the result (ignored off Hopper
    and under the interpreter)."""
    got, ref = _pdl_case(m, n, k, dtype, dev)
    assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (1, 4096, 14336), (16, 4096, 4096), (64, 28672, 1024)])
def test_gpu_pdl_bit_equal(m, n, k):
    """GPU: the PDL launch gives exactly the plain launch's output (default configs: split-K at M = 1,
    ring / xh at M = 16, 64)."""
    if not GPU:
        pytest.skip("needs CUDA")
    got_pdl, ref = _pdl_case(m, n, k, torch.bfloat16, "cuda")
    assert torch.equal(got_pdl, ref)


def test_prmt_decode_lines_contract():
    """``lut_prmt.decode_lines`` (the register-table kernel's decode): the 4 A-fragment pairs (pair p = nibbles
    2 p, 2 p + 1, low half first) for any word and table."""
    from lowbit.kernels.lut_prmt import DECODE_REGS, decode_lines
    from tests.test_lut_wgmma import _run_ptx

    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        table = torch.randint(0, 2 ** 16, (16,), generator=gen).tolist()
        word = int(torch.randint(0, 2 ** 32, (1,), generator=gen, dtype=torch.int64))
        ops = {"$0": word}
        for j in range(4):
            ops[f"$L{j}"] = sum((table[4 * j + i] & 0xFF) << 8 * i for i in range(4))
            ops[f"$H{j}"] = sum((table[4 * j + i] >> 8) << 8 * i for i in range(4))
        asm = "\n".join([DECODE_REGS] + decode_lines("$0", [f"$L{j}" for j in range(4)], [f"$H{j}" for j in range(4)],
                                                     ["a0", "a1", "a2", "a3"]))
        out = _run_ptx(asm.replace("$L", "$l").replace("$H", "$h"),
                       {k.replace("$L", "$l").replace("$H", "$h"): v for k, v in ops.items()})
        for p in range(4):
            nib = [(word >> 4 * (2 * p + h)) & 15 for h in (0, 1)]
            assert out[f"a{p}"] == table[nib[0]] | table[nib[1]] << 16
