"""The Gluon 4-bit LUT kernel (``lowbit.kernels.lut_wgmma_gluon``): GPU correctness against the reference and the
Triton register-table kernel (same decode, relabelling and exact group scaling), the op's dispatch range, and the
launcher's errors. Gluon does not run under the interpreter: its decode PTX and the relabelling are the Triton
kernel's, checked on the CPU in ``tests/test_lut_wgmma.py``; here the CPU checks the index algebra the kernel
writes out (the activation gather order and the odd-group masking plan)."""
import pytest
import torch

from lowbit.kernels import lut_wgmma as LW
from lowbit.kernels import lut_wgmma_gluon as LGL
from tests.conftest import GPU
from tests.test_lut_wgmma import _case, _ref
from tests.tolerances import KERNEL_VS_REF, rel_l2


def test_activation_gather_order_matches_the_relabelled_tile():
    """The kernel's ``kx`` (written out in Gluon) is ``lut_wgmma._reg_a_k`` and a permutation of one chunk."""
    kc = torch.arange(64)
    kx = 16 * ((kc // 2) % 4) + 4 * (kc // 16) + 2 * ((kc // 8) % 2) + kc % 2
    assert sorted(kx.tolist()) == list(range(64))
    t, s, a, b = (kc // 2) % 4, kc // 16, (kc // 8) % 2, kc % 2  # column 16 s + 8 a + 2 t + b
    assert torch.equal(kx, 16 * t + 4 * s + 2 * a + b)


def test_dispatch_range_and_supported_on_cpu():
    """The measurements behind ``gluon_tokens``: 8..16 tokens on o / qkv-sized weights (session 22), 8 on the larger
    ones but gate_up (session 24, with the shared pair table), 16 on gate_up (session 25), never below 8 tokens."""
    pref = LGL.gluon_preferred
    assert pref(8, 4096, 4096, 4, 128) and pref(16, 6144, 4096, 4, 64) and pref(12, 4096, 4096, 4, 256)
    assert not pref(7, 4096, 4096, 4, 128) and not pref(1, 6144, 4096, 4, 128) and not pref(17, 4096, 4096, 4, 128)
    # the larger weights: 8 tokens only (session 24); gate_up-sized N at 16 (session 25)
    assert all(pref(m, n, k, 4, 128) == (m == 8) for m in range(1, 65) for n, k in ((4096, 14336), (8192, 8192)))
    assert all(pref(m, 28672, 4096, 4, 128) == (m == 16) for m in range(1, 65))
    assert LGL.gluon_config(16, 28672) == dict(block_m=16, ctas_per_sm=2, xpf=1, smem_table=True)
    assert LGL.gluon_config(16, 6144)["ctas_per_sm"] == 4 and LGL.gluon_config(8, 28672)["ctas_per_sm"] == 4
    assert not pref(8, 4096, 4096, 3, 128) and not pref(8, 4096, 4096, 4, 32)
    assert not LGL.supported(torch.zeros(2, 64, dtype=torch.bfloat16), 4, 128)  # CPU tensor
    # session 24: the shared pair table in the op's range (8..16 tokens), the default decode above
    assert all(LGL.gluon_config(m)["smem_table"] for m in (1, 8, 9, 16)) and not LGL.gluon_config(17)["smem_table"]


def test_launcher_errors_name_the_argument():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    if GPU and LGL.HAS_GLUON:
        xg = torch.zeros(4, 128, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="smem_table"):
            LGL.lut_wgmma_gluon(xg, torch.zeros(256, dtype=torch.int32, device="cuda"),
                                torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"),
                                torch.zeros(256, 2, dtype=torch.bfloat16, device="cuda"), group_size=128,
                                out_features=16, smem_table="yes")
    with pytest.raises(ValueError, match="lut_wgmma_gluon needs"):
        LGL.lut_wgmma_gluon(x, torch.zeros(128, dtype=torch.int32), torch.zeros(1, 16, dtype=torch.bfloat16),
                            torch.zeros(256, 2, dtype=torch.bfloat16), group_size=128, out_features=16)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or not LGL.HAS_GLUON, reason="compiled Gluon kernels on a Hopper GPU")
@pytest.mark.parametrize("m,n,k,g,dtype,cfg", [
    (1, 4096, 4096, 128, torch.bfloat16, {}),
    (2, 1000, 576, 64, torch.float16, {}),                        # K not a multiple of the group, N % 16 != 0
    (8, 6144, 4096, 128, torch.bfloat16, {}),
    (5, 4096, 14336, 128, torch.bfloat16, {"split_k": 3}),       # odd group counts per split: a masked group
    (8, 520, 1280, 256, torch.bfloat16, {"split_k": 1}),         # no split, G = 256 (4 chunks per group)
    (16, 1000, 4096, 128, torch.float16, {"block_m": 16, "maxnreg": 128}),
    (33, 700, 1000, 64, torch.bfloat16, {"block_m": 32, "xpf": 1}),   # two token blocks
    (64, 512, 2048, 128, torch.bfloat16, {"block_m": 64}),
    (3, 24, 128, 128, torch.bfloat16, {}),                        # one group, one program
])
def test_gluon_matches_reference_and_triton_gpu(m, n, k, g, dtype, cfg):
    q, x, qm, s, pairs = _case(m, n, k, g, dtype, "cuda")
    y = LGL.lut_wgmma_gluon(x, qm, s, pairs, group_size=g, out_features=n, **cfg)
    ref = _ref(q, x)
    assert y.dtype == dtype and y.shape == (m, n) and torch.isfinite(y).all()
    assert rel_l2(y, ref) < KERNEL_VS_REF[dtype]
    yt = LW.lut_wgmma_triton(x, qm, s, pairs, group_size=g, out_features=n)
    assert rel_l2(y, yt) < KERNEL_VS_REF[dtype]
    for mode in (False, True):  # the byte tables / session 23's pair-table lookups: the same values, bit-equal
        assert torch.equal(LGL.lut_wgmma_gluon(x, qm, s, pairs, group_size=g, out_features=n, smem_table=mode, **cfg),
                           y)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or not LGL.HAS_GLUON, reason="compiled Gluon kernels on a Hopper GPU")
def test_gluon_all_zero_groups_and_the_op_dispatch_gpu():
    """All-zero weight rows (scale 0: no 0/0) give exact zeros; the op sends 8..16 tokens here on small weights, deterministically."""
    from lowbit.ops.lut import lut_gemm

    q, x, qm, s, pairs = _case(8, 300, 1024, 128, torch.bfloat16, "cuda", zero_rows=40)
    y = LGL.lut_wgmma_gluon(x, qm, s, pairs, group_size=128, out_features=300)
    assert torch.equal(y[:, :40], torch.zeros_like(y[:, :40]))
    assert rel_l2(y, _ref(q, x)) < KERNEL_VS_REF[torch.bfloat16]
    yo = lut_gemm(x, qm, None, s, q.table.cuda(), bits=4, group_size=128, layout="mma")
    assert torch.equal(yo, y) and torch.equal(lut_gemm(x, qm, None, s, q.table.cuda(), bits=4, group_size=128,
                                                       layout="mma"), y)



def test_host_byte_tables_decode_to_the_table():
    """``lut_prmt.byte_table_words`` (the host form of the kernels' table registers) fed to the decode PTX returns
    every NF4 entry's bf16 bits (the PTX interpreter of ``tests/test_lut_wgmma.py``)."""
    from lowbit.formats.lut import nf_table
    from lowbit.kernels.lut_prmt import byte_table_words
    from tests.test_lut_wgmma import _run_ptx

    bits = (nf_table(4).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    ops = {f"${9 + j}": w & 0xFFFFFFFF for j, w in enumerate(byte_table_words(bits))}
    for word in (0x76543210, 0xFEDCBA98):
        out = _run_ptx(LW._DECODE_ASM.value, dict(ops, **{"$8": word}))
        assert [out[f"${j}"] for j in range(8)] == [bits[(word >> 4 * j) & 15] for j in range(8)]


def test_small_m_launches_are_valid_for_any_shape():
    """``mma_config`` at 1..8 tokens and ``gluon_tokens``: a complete launch for every shape (hypothesis-style sweep
    over the N / K sides of the rules), and the Gluon range never below 8 tokens or above 16."""
    from lowbit.kernels import lut_gemm as K

    for n in (16, 1000, 4096, 6144, 16383, 16384, 28672):
        for k in (64, 576, 4096, 8191, 8192, 14336):
            for m in range(1, 9):
                c = K.mma_config(m, n, k, 4, 128)
                assert c["nt"] == 1 and c["num_warps"] in (4, 8) and c["ctas_per_sm"] >= 1 and c["r"] in (1, 2)
                assert c.get("ring") in (None, 4) and (c.get("ring") is None or c.get("xh") == 2)
            r = LGL.gluon_tokens(n, k)
            assert r == ((8, 16) if n * k <= 32_000_000 else ((8, 8) if n < 16384 else (16, 16)))
