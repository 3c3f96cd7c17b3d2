"""KV4 append and decode kernels (Triton, interpreter on CPU) vs their PyTorch references, and
the ``lowbit::kv4_append`` / ``lowbit::decode_kv4`` ops (validation, opcheck)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowbit.kernels.decode_kv4 import choose_splits, decode_kv4_triton
from lowbit.formats.kv4 import dequantize_kv4, quantize_kv4
from lowbit.kernels.kv4_append import kv4_append_triton
from lowbit.ops import kv4 as ops
from tests.tolerances import rel_l2
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)

DEV = "cuda" if GPU else "cpu"
FP8 = torch.float8_e4m3fn


def _pool(P, H, page, D, zp, sd, *, random=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if random:
        kc = torch.randint(0, 256, (P, H, page, D // 2), dtype=torch.uint8, generator=g)
        vc = torch.randint(0, 256, (P, H, page, D // 2), dtype=torch.uint8, generator=g)
        ks = (torch.rand(P, H, page, generator=g) * 0.3 + 0.01).to(sd)
        vs = (torch.rand(P, H, page, generator=g) * 0.3 + 0.01).to(sd)
        kz = torch.randint(0, 16, (P, H, page), dtype=torch.uint8, generator=g) if zp else None
        vz = torch.randint(0, 16, (P, H, page), dtype=torch.uint8, generator=g) if zp else None
    else:
        kc, vc = torch.zeros(P, H, page, D // 2, dtype=torch.uint8), torch.zeros(P, H, page, D // 2, dtype=torch.uint8)
        ks, vs = torch.zeros(P, H, page, dtype=sd), torch.zeros(P, H, page, dtype=sd)
        kz = torch.zeros(P, H, page, dtype=torch.uint8) if zp else None
        vz = torch.zeros(P, H, page, dtype=torch.uint8) if zp else None
    return [t.to(DEV) if t is not None else None for t in (kc, ks, vc, vs, kz, vz)]


def _page_table(lens, page, seed=0):
    npg = [-(-L // page) for L in lens]
    P = sum(npg) + 1
    perm = torch.randperm(P, generator=torch.Generator().manual_seed(seed))
    pt = torch.zeros(len(lens), max(npg) + 1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(npg):
        pt[b, :n] = perm[i:i + n]
        i += n
    return pt.to(DEV), P


def _rope(B, T, D, dtype=torch.float32):
    ang = torch.rand(B, T, D // 2) * 6.28
    return torch.cat([ang.cos()] * 2, -1).to(dtype).to(DEV), torch.cat([ang.sin()] * 2, -1).to(dtype).to(DEV)


def _same(a, b):
    if a is None:
        return b is None
    if a.dtype == FP8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


# ---- append -----------------------------------------------------------------------------------

@settings(max_examples=5)
@given(B=st.integers(1, 2), H=st.integers(1, 2), T=st.integers(1, 4), D=st.sampled_from((16, 64, 128)),
       zp=st.booleans(), sd=st.sampled_from((FP8, torch.bfloat16, torch.float32)), rope=st.booleans(),
       crs=st.booleans(), inter=st.booleans(), xdt=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
def test_append_kernel_bit_exact(B, H, T, D, zp, sd, rope, crs, inter, xdt):
    torch.manual_seed(B * 100 + T)
    page = 16
    start = torch.randint(0, 30, (B,), dtype=torch.int32).to(DEV)
    pt, P = _page_table([int(s) + T for s in start], page)
    k = (torch.randn(B, H, T, D) * 4).to(xdt).to(DEV)
    v = torch.randn(B, H, T, D).to(xdt).to(DEV)
    k[0, 0, 0, :] = 0.0
    if T > 1:
        k[0, 0, 1] *= 1e-4
    cos, sin = _rope(B, T, D, xdt) if rope else (None, None)
    crs_k = (torch.rand(H, D) + 0.5).to(DEV) if crs else None
    a, b = _pool(P, H, page, D, zp, sd), _pool(P, H, page, D, zp, sd)
    kw = dict(cos=cos, sin=sin, crs_k=crs_k, interleaved=inter)
    kv4_append_triton(k, v, a[0], a[1], a[2], a[3], pt, start, k_zero=a[4], v_zero=a[5], **kw)
    ops.kv4_append_ref(k, v, b[0], b[1], b[2], b[3], pt, start, k_zero=b[4], v_zero=b[5], **kw)
    for x, y in zip(a, b):
        assert _same(x, y)


@pytest.mark.parametrize("sd", (FP8, torch.bfloat16))
def test_append_kernel_zero_point_scales_never_clip(sd):
    """The append kernel's ``kv4-zp`` scales follow ``quantize_kv4``'s rule (nearest unless the top code would clip,
    then the next value up) bit for bit over 256 rows of random spans, and no element is off by more than half a
    step."""
    torch.manual_seed(1)
    B, H, T, D, page = 2, 2, 64, 64, 16
    start = torch.zeros(B, dtype=torch.int32).to(DEV)
    pt, P = _page_table([T] * B, page)
    span = torch.exp(torch.empty(B, H, T, 1).uniform_(-3, 3))
    k = ((torch.rand(B, H, T, D) - torch.rand(B, H, T, 1)) * span).to(DEV)
    v = ((torch.rand(B, H, T, D) - 0.3) * span).to(DEV)
    a, b = _pool(P, H, page, D, True, sd), _pool(P, H, page, D, True, sd)
    kv4_append_triton(k, v, a[0], a[1], a[2], a[3], pt, start, k_zero=a[4], v_zero=a[5])
    ops.kv4_append_ref(k, v, b[0], b[1], b[2], b[3], pt, start, k_zero=b[4], v_zero=b[5])
    for x, y in zip(a, b):
        assert _same(x, y)
    kc, ks, kz = quantize_kv4(k.float().cpu(), zero_point=True, scale_dtype=sd)
    err = (dequantize_kv4(kc, ks, kz) - k.float().cpu()).abs()
    assert (err <= 0.5 * ks.float()[..., None] * (1 + 1e-6)).all()
    from lowbit.formats.kv4 import round_scale

    kf = k.float().cpu()
    near = round_scale((kf.amax(-1).clamp_min(0) - kf.amin(-1).clamp_max(0)) / 15.0, sd).float()
    assert (ks.float() != near).any()  # the rounded-up path ran


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), S=st.integers(1, 37), D=st.sampled_from((16, 32, 64, 24)),
       xdt=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)), strided=st.booleans(),
       bad=st.sampled_from((None, float("nan"), float("inf"))))
def test_kv4_quantize_is_the_format(B, H, S, D, xdt, strided, bad):
    """``ops.kv4_quantize`` (the dense tile kernel; D = 24 takes the reference) equals
    ``quantize_kv4`` bit for bit: scales (NaN for a non-finite row) and the codes of every finite row."""
    g = torch.Generator().manual_seed(B * 1000 + S * 10 + D)
    k = (torch.randn(B, S, H, D, generator=g) * 4).to(xdt)
    v = torch.randn(B, S, H, D, generator=g).to(xdt)
    k, v = (t.transpose(1, 2) if strided else t.transpose(1, 2).contiguous() for t in (k, v))
    k[0, 0, 0] = 0.0  # an all-zero row: the scale floor, codes 0
    if bad is not None:
        v[-1, -1, S // 2, D // 3] = bad
    out = ops.kv4_quantize(k.to(DEV), v.to(DEV))
    want = (*quantize_kv4(k)[:2], *quantize_kv4(v)[:2])
    for i, (a, w) in enumerate(zip(out, want)):
        a = a.cpu()
        assert a.shape == w.shape and a.dtype == w.dtype
        if i in (0, 2):  # a non-finite row's codes are unspecified
            ok = ~out[i + 1].cpu().float().isnan()
            a, w = a[ok], w[ok]
        assert _same(a, w), i


@pytest.mark.parametrize("fast", (False, True))
@pytest.mark.parametrize("zp", (False, True))
@pytest.mark.parametrize("sd", (FP8, torch.bfloat16, torch.float32))
def test_kv4_quantize_kernel_numerics(zp, sd, fast):
    """The dense launcher with zero points and every scale dtype, 19 tokens over tiles of 8 (a ragged last tile),
    IEEE or Markstein (``fast``) quotients: ``quantize_kv4`` bit for bit, on bf16 rows whose amax / 7 are exact E4M3
    rounding ties (multiples of 7 / 16)."""
    import triton

    from lowbit.kernels.kv4_append import kv4_quantize_triton

    if fast and DEV == "cpu" and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("this Triton's interpreter rounds tl.fma twice")

    g = torch.Generator().manual_seed(5)
    k = (torch.randn(2, 3, 19, 32, generator=g) * 2).to(torch.bfloat16)
    k[..., 0] = (torch.randint(1, 40, (2, 3, 19), generator=g) * 7 / 16).to(torch.bfloat16)  # the row amax
    k = k.clamp(-k[..., :1].abs(), k[..., :1].abs())
    v = torch.randn(2, 3, 19, 32, generator=g).to(torch.bfloat16)
    out = kv4_quantize_triton(k.to(DEV), v.to(DEV), zero_point=zp, scale_dtype=sd, rows=8, fast=fast)
    for x, (c, sc, z) in ((k, (out[0], out[1], out[4])), (v, (out[2], out[3], out[5]))):
        wc, ws, wz = quantize_kv4(x, zero_point=zp, scale_dtype=sd)
        assert _same(c.cpu(), wc) and _same(sc.cpu(), ws) and _same(None if z is None else z.cpu(), wz)


def test_kv4_quantize_overflowing_range_and_batch_slices(monkeypatch):
    """A finite fp32 row whose range hi - lo overflows (``kv4-zp``) gets a NaN scale as in ``quantize_kv4``; and the
    ops' launches in batch slices (``lowbit._utils.by_batch``: grid axis 1 holds at most 65535 (sequence, head) pairs;
    lowered here to 5) give the same bits as one launch, for the quantize launch and the KV4 -> FP8 conversion."""
    import lowbit._utils as U
    import lowbit.kernels.kv4_append as KA
    from lowbit.ops.attention_prefill import fp8_kv4_attention

    k = torch.randn(3, 2, 9, 32)
    v = torch.randn(3, 2, 9, 32)
    k[1, 0, 4, :2] = torch.tensor([3e38, -3e38])
    for sd in (FP8, torch.bfloat16, torch.float32):
        out = KA.kv4_quantize_triton(k.to(DEV), v.to(DEV), zero_point=True, scale_dtype=sd)
        want = quantize_kv4(k, zero_point=True, scale_dtype=sd)
        assert out[1].cpu().float().isnan()[1, 0, 4] and want[1].float().isnan()[1, 0, 4]
        assert _same(out[1].cpu(), want[1]) or torch.equal(out[1].cpu().float().nan_to_num(), want[1].float().nan_to_num())
    k[1, 0, 4, :2] = 0.0
    q = torch.randn(3, 4, 9, 32).to(DEV)
    one = ops.kv4_quantize(k.to(DEV), v.to(DEV))
    fp8_one = fp8_kv4_attention(q, kv4=one, causal=True)
    monkeypatch.setattr(U, "MAX_GRID_Y", 5)
    sliced = ops.kv4_quantize(k.to(DEV), v.to(DEV))
    assert all(_same(a, b) for a, b in zip(one, sliced))
    fp8_sliced = fp8_kv4_attention(q, kv4=sliced, causal=True)
    assert _same(fp8_one, fp8_sliced)


def test_kv4_quantize_errors_and_opcheck():
    k = torch.randn(1, 2, 5, 32)
    with pytest.raises(ValueError, match="even head_dim"):
        ops.kv4_quantize(k[..., :31], k[..., :31])
    with pytest.raises(ValueError, match="v must have shape"):
        ops.kv4_quantize(k, k[:, :1])
    with pytest.raises(TypeError, match="v must have dtype"):
        ops.kv4_quantize(k, k.half())
    torch.library.opcheck(torch.ops.lowbit.kv4_quantize.default, (k.to(DEV), k.to(DEV)),
                          test_utils=("test_schema", "test_faketensor"))


def test_append_ref_matches_format_and_rope():
    """The reference writes quantize_kv4(rope(k) * crs) at the right (page, offset)."""
    from lowbit.formats.kv4 import quantize_kv4

    B, H, T, D, page = 2, 2, 3, 64, 16
    start = torch.tensor([15, 2], dtype=torch.int32)
    pt = torch.tensor([[4, 1, 0], [2, 3, 0]], dtype=torch.int32)
    k, v = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    cos, sin = _rope(B, T, D)
    cos, sin = cos.cpu(), sin.cpu()
    crs = torch.rand(H, D) + 0.5
    kc, ks, vc, vs, _, _ = [t.cpu() if t is not None else None for t in _pool(5, H, page, D, False, FP8)]
    ops.kv4_append_ref(k, v, kc, ks, vc, vs, pt, start, cos=cos, sin=sin, crs_k=crs)
    x1, x2 = k[..., : D // 2], k[..., D // 2:]
    rot = torch.cat((-x2, x1), -1)
    kr = (k * cos[:, None] + rot * sin[:, None]) * crs[None, :, None, :]
    c, s, _ = quantize_kv4(kr)
    # sequence 0, token 1 -> position 16 -> logical page 1 -> physical 1, offset 0
    assert torch.equal(kc[1, :, 0], c[0, :, 1])
    assert torch.equal(ks[1, :, 0].view(torch.uint8), s[0, :, 1].view(torch.uint8))
    # sequence 1, token 2 -> position 4 -> physical page 2, offset 4
    assert torch.equal(vc[2, :, 4], quantize_kv4(v)[0][1, :, 2])


# ---- decode -----------------------------------------------------------------------------------

CASES = [  # B, Hq, Hkv, D, TQ, lens, page, block_n, zp, splits
    (3, 4, 1, 64, 1, [5, 40, 17], 16, 16, False, 0),  # MQA, lengths not multiples of the page
    (2, 8, 2, 128, 3, [70, 33], 32, 16, True, 3),  # GQA 4, kv4-zp, split-KV
    (2, 4, 4, 64, 4, [4, 50], 16, 16, False, 2),  # MHA, 4 query tokens, a sequence of exactly TQ
    (1, 6, 2, 64, 2, [37], 16, 16, True, 0),  # G*TQ = 6 rows padded to 16
    (2, 8, 2, 64, 1, [45, 20], 16, 64, False, 2),  # block_n above the page size: capped at it (a block in one page)
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sd", (FP8, torch.bfloat16))
def test_decode_kernel_vs_ref(case, sd):
    B, Hq, Hkv, D, TQ, lens, page, bn, zp, splits = case
    pt, P = _page_table(lens, page, seed=B)
    kc, ks, vc, vs, kz, vz = _pool(P, Hkv, page, D, zp, sd, random=True, seed=Hq)
    torch.manual_seed(0)
    q = torch.randn(B, Hq, TQ, D).to(DEV)
    crs = (torch.rand(Hkv, D) + 0.5).to(DEV)
    lengths = torch.tensor(lens, dtype=torch.int32).to(DEV)
    o = decode_kv4_triton(q, kc, ks, vc, vs, pt, lengths, k_zero=kz, v_zero=vz, crs_q=crs,
                          num_splits=splits or None, block_n=bn)
    r = ops.decode_kv4_ref(q, kc, ks, vc, vs, pt, lengths, k_zero=kz, v_zero=vz, crs_q=crs)
    assert rel_l2(o, r) < 2e-3  # fp16 Q (row-normalised) and fp16 P*v_scale on the tensor-core dots


@pytest.mark.parametrize("case", [CASES[1], CASES[3]])
def test_decode_tokens_major_variant(case):
    """TRANS=True (tokens as the MMA M dimension; the default is queries-major) and the eager
    rescale (lazy=False) compute the same attention."""
    B, Hq, Hkv, D, TQ, lens, page, bn, zp, splits = case
    pt, P = _page_table(lens, page, seed=B)
    kc, ks, vc, vs, kz, vz = _pool(P, Hkv, page, D, zp, FP8, random=True, seed=Hq)
    q = torch.randn(B, Hq, TQ, D).to(DEV)
    lengths = torch.tensor(lens, dtype=torch.int32).to(DEV)
    kw = dict(k_zero=kz, v_zero=vz, num_splits=splits or None, block_n=bn)
    o = decode_kv4_triton(q, kc, ks, vc, vs, pt, lengths, trans=True, lazy=False, **kw)
    r = ops.decode_kv4_ref(q, kc, ks, vc, vs, pt, lengths, k_zero=kz, v_zero=vz)
    assert rel_l2(o, r) < 2e-3


@pytest.mark.parametrize("case", [CASES[1]])  # kv4-zp, GQA, split-KV (CASES[3]: the two-plane test below)
def test_decode_qk_int8(case):
    """QK8 (INT8 Q per row x INT8 16*code K, int32 accumulation) matches its reference exactly up to
    P's fp16 rounding, and INT8 Q costs < 2% relative error against fp16 Q on random data."""
    B, Hq, Hkv, D, TQ, lens, page, bn, zp, splits = case
    pt, P = _page_table(lens, page, seed=B)
    kc, ks, vc, vs, kz, vz = _pool(P, Hkv, page, D, zp, FP8, random=True, seed=Hq)
    q = torch.randn(B, Hq, TQ, D).to(DEV)
    crs = (torch.rand(Hkv, D) + 0.5).to(DEV)
    lengths = torch.tensor(lens, dtype=torch.int32).to(DEV)
    kw = dict(k_zero=kz, v_zero=vz, crs_q=crs)
    r8 = ops.decode_kv4_ref(q, kc, ks, vc, vs, pt, lengths, q_int8=True, **kw)
    r = ops.decode_kv4_ref(q, kc, ks, vc, vs, pt, lengths, **kw)
    for trans in (False, True):
        o = decode_kv4_triton(q, kc, ks, vc, vs, pt, lengths, num_splits=splits or None, block_n=bn, qk_int8=True,
                              trans=trans, **kw)
        assert rel_l2(o, r8) < 2e-3
    assert rel_l2(r8, r) < 2e-2


@pytest.mark.parametrize("case", [CASES[3]])
def test_decode_q_int8_two_planes(case):
    """q_int8=2 (Q as two INT8 planes, 254 * hi + lo, int32 accumulation) matches its reference,
    and on Q with x20 outlier channels it stays close to fp16 Q where one INT8 plane does not."""
    B, Hq, Hkv, D, TQ, lens, page, bn, zp, splits = case
    pt, P = _page_table(lens, page, seed=B)
    kc, ks, vc, vs, kz, vz = _pool(P, Hkv, page, D, zp, FP8, random=True, seed=Hq)
    q = torch.randn(B, Hq, TQ, D).to(DEV)
    q[..., :4] *= 20
    lengths = torch.tensor(lens, dtype=torch.int32).to(DEV)
    kw = dict(k_zero=kz, v_zero=vz)
    r2 = ops.decode_kv4_ref(q, kc, ks, vc, vs, pt, lengths, q_int8=2, **kw)
    r8 = ops.decode_kv4_ref(q, kc, ks, vc, vs, pt, lengths, q_int8=True, **kw)
    r = ops.decode_kv4_ref(q, kc, ks, vc, vs, pt, lengths, **kw)
    for trans in (False, True):
        o = decode_kv4_triton(q, kc, ks, vc, vs, pt, lengths, num_splits=splits or None, block_n=bn, qk_int8=2,
                              trans=trans, **kw)
        assert rel_l2(o, r2) < 2e-3
    assert rel_l2(r2, r) < 1e-3 < rel_l2(r8, r)


def test_q_int8_default_in_sync():
    from lowbit.kernels.decode_kv4 import DEFAULT_QK8

    assert ops.Q_INT8_DEFAULT == DEFAULT_QK8


def test_decode_bf16_q_and_split_consistency():
    B, Hq, Hkv, D, TQ, page = 2, 4, 2, 64, 2, 16
    lens = [45, 64]
    pt, P = _page_table(lens, page)
    kc, ks, vc, vs, _, _ = _pool(P, Hkv, page, D, False, FP8, random=True)
    q = torch.randn(B, Hq, TQ, D, dtype=torch.bfloat16).to(DEV)
    lengths = torch.tensor(lens, dtype=torch.int32).to(DEV)
    o1 = decode_kv4_triton(q, kc, ks, vc, vs, pt, lengths, num_splits=1, block_n=16)
    o3 = decode_kv4_triton(q, kc, ks, vc, vs, pt, lengths, num_splits=3, block_n=16)
    assert o1.dtype == torch.bfloat16
    assert rel_l2(o1, o3) < 1e-2
    r = ops.decode_kv4_ref(q, kc, ks, vc, vs, pt, lengths)
    assert rel_l2(o3, r) < 1e-2


def test_choose_splits():
    assert choose_splits(16, 8, 8192, 64, 132) * 16 * 8 >= 2 * 132
    assert choose_splits(16, 8, 8192, 64, 132, num_warps=1) > choose_splits(16, 8, 8192, 64, 132)
    assert choose_splits(1, 8, 128, 64, 132) == 2  # short and small: down to one key block per split
    assert choose_splits(1, 8, 1025, 32, 132, 1, ctas_per_sm=16) == 33  # the runner's B=1 ctx 1k step (S9)
    assert choose_splits(1, 8, 8193, 32, 132, 1, ctas_per_sm=16) == 65  # long: >= 4 blocks per split
    assert choose_splits(16, 8, 1025, 32, 132, 1, ctas_per_sm=16) == 9  # enough programs: >= 4 blocks
    assert choose_splits(64, 8, 32768, 64, 132) == 2
    # with the compiled kernel's occupancy: >= one full wave, and the last wave nearly full
    from lowbit.kernels.decode_kv4 import _splits_used

    for B, L, occ in ((16, 8192, 8), (1, 32768, 8), (16, 32768, 12), (4, 100000, 5)):
        s = choose_splits(B, 8, L, 32, 132, 1, ctas_per_sm=occ)
        n = B * 8 * _splits_used(L, s, 32)
        assert n >= 0.95 * 132 * occ
        assert n / (-(-n // (132 * occ)) * 132 * occ) >= 0.9
    # the Gluon launcher's rule (good=0.95): one wave 0.97 full beats three waves 0.99 full (R10, B=16 L=32k)
    assert choose_splits(16, 8, 32768, 32, 132, 1, ctas_per_sm=16, good=0.95) == 16
    assert choose_splits(16, 8, 32768, 32, 132, 1, ctas_per_sm=16) == 49


# ---- ops ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ("decode_kv4", "decode_float"))
def test_decode_page_reads_are_range_checked(op):
    """CPU index tensors: a length past the page table's columns, a negative one, or a page id outside the pool
    (one the decode would read) raise ValueError naming the argument, instead of reading outside the cache
    (session 33: a page id of 10^6 segfaulted the interpreter; on the GPU it is an illegal address)."""
    from lowbit.bench.suites.kv4 import random_cache, random_float_pages

    q = torch.randn(2, 4, 1, 64)
    if op == "decode_kv4":
        c = random_cache(2, 2, 64, 100, page=16, device="cpu")
        cache = (c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"])
        pt, lens = c["page_table"], c["lengths"]
        fn = ops.decode_kv4
    else:
        k, v, pt, lens = random_float_pages([100, 90], 2, 16, 64, dtype=torch.float32, device="cpu")
        cache = (k, v)
        fn = ops.decode_float
    cap = pt.shape[1] * 16
    fn(q, *cache, pt, lens)  # valid
    for bad_lens in ([100, cap + 1], [-1, 100]):
        with pytest.raises(ValueError, match="lengths must lie in"):
            fn(q, *cache, pt, torch.tensor(bad_lens, dtype=torch.int32))
    for page in (10 ** 6, -1):
        bad = pt.clone()
        bad[0, 0] = page
        with pytest.raises(ValueError, match="page_table entries of the pages read"):
            fn(q, *cache, bad, lens)
    beyond = pt.clone()
    beyond[1, -1] = 10 ** 6  # a column past sequence 1's length is never read: no error
    if int(lens[1]) <= (pt.shape[1] - 1) * 16:
        fn(q, *cache, beyond, lens)


def test_ops_dispatch_and_errors():
    B, Hq, Hkv, D, page = 2, 4, 2, 64, 16
    pt, P = _page_table([20, 20], page)
    kc, ks, vc, vs, _, _ = _pool(P, Hkv, page, D, False, FP8)
    start = torch.zeros(B, dtype=torch.int32).to(DEV)
    k = torch.randn(B, Hkv, 20, D).to(DEV)
    ops.kv4_append(k, k, kc, ks, vc, vs, pt, start)
    q = torch.randn(B, Hq, 1, D).to(DEV)
    lengths = torch.full((B,), 20, dtype=torch.int32).to(DEV)
    o = ops.decode_kv4(q, kc, ks, vc, vs, pt, lengths)
    assert o.shape == q.shape and torch.isfinite(o).all()
    with pytest.raises(ValueError, match="multiple"):
        ops.decode_kv4(torch.randn(B, 3, 1, D).to(DEV), kc, ks, vc, vs, pt, lengths)
    with pytest.raises(TypeError, match="lengths"):
        ops.decode_kv4(q, kc, ks, vc, vs, pt, lengths.long())
    with pytest.raises(ValueError, match="both"):
        ops.decode_kv4(q, kc, ks, vc, vs, pt, lengths, k_zero=torch.zeros_like(kc[..., 0]))
    with pytest.raises(ValueError, match="head_dim/2"):
        ops.decode_kv4(torch.randn(B, Hq, 1, 32).to(DEV), kc, ks, vc, vs, pt, lengths)
    with pytest.raises(ValueError, match="1..16"):
        ops.decode_kv4(torch.randn(B, Hq, 17, D).to(DEV), kc, ks, vc, vs, pt, lengths)
    with pytest.raises(ValueError, match="cos"):
        ops.kv4_append(k, k, kc, ks, vc, vs, pt, start, cos=torch.randn(B, 20, D).to(DEV))
    if start.device.type == "cpu":  # host-side check (CUDA start tensors are not read back)
        cap = pt.shape[1] * page
        with pytest.raises(ValueError, match="start"):
            ops.kv4_append(k, k, kc, ks, vc, vs, pt, torch.full((B,), cap - 19, dtype=torch.int32))
        with pytest.raises(ValueError, match="start"):
            ops.kv4_append(k, k, kc, ks, vc, vs, pt, torch.full((B,), -1, dtype=torch.int32))


def test_append_kernel_skips_positions_outside_the_page_table():
    """The append kernel writes nothing for a position past the page table or a page outside the pool (the op
    checks CPU start tensors on the host; CUDA ones are not read back): the other sequence is written as usual."""
    B, Hkv, D, page, T = 2, 2, 64, 16, 3
    pt, P = _page_table([20, 20], page)
    kc, ks, vc, vs, _, _ = _pool(P, Hkv, page, D, False, FP8)
    before = [t.clone() for t in (kc, ks, vc, vs)]
    k = torch.randn(B, Hkv, T, D).to(DEV)
    start = torch.tensor([0, pt.shape[1] * page - 1], dtype=torch.int32).to(DEV)  # sequence 1 runs past the table
    kv4_append_triton(k, k, kc, ks, vc, vs, pt, start)
    ref = [t.clone() for t in before]
    ops.kv4_append_ref(k[:1], k[:1], *ref, pt[:1], start[:1])
    ops.kv4_append_ref(k[1:, :, :1], k[1:, :, :1], *ref, pt[1:], start[1:])  # its one in-table token
    for got, want in zip((kc, ks, vc, vs), ref):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    pt_bad = pt.clone()
    pt_bad[0, 0] = P + 5  # a page outside the pool
    kc2, ks2 = kc.clone(), ks.clone()
    kv4_append_triton(k[:1], k[:1], kc, ks, vc, vs, pt_bad[:1], start[:1])
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8)) and torch.equal(ks.view(torch.uint8), ks2.view(torch.uint8))


def test_append_op_checks_the_pages_it_writes(monkeypatch):
    """The op range-checks the page-table entries of the pages a CPU ``start`` writes (a clear ValueError naming
    page_table, not a silent drop); device index tensors are read back only with LOWBIT_CHECK_INDEX=1."""
    from lowbit._utils import check_indices

    B, Hkv, D, page, T = 1, 1, 32, 16, 3
    pt, P = _page_table([20], page)
    kc, ks, vc, vs = (t.cpu() for t in _pool(P, Hkv, page, D, False, FP8)[:4])  # CPU tensors on any machine
    k = torch.randn(B, Hkv, T, D)
    pt_bad = pt.cpu().clone()
    pt_bad[0, 1] = P + 5  # the second page, which positions 15..17 reach
    with pytest.raises(ValueError, match="page_table entries"):
        ops.kv4_append(k, k, kc, ks, vc, vs, pt_bad, torch.tensor([15], dtype=torch.int32))
    ops.kv4_append(k, k, kc, ks, vc, vs, pt_bad, torch.tensor([0], dtype=torch.int32))  # page 0 only: fine
    meta = torch.empty(2, dtype=torch.int32, device="meta")
    monkeypatch.delenv("LOWBIT_CHECK_INDEX", raising=False)
    assert check_indices(torch.zeros(2)) and not check_indices(meta)
    monkeypatch.setenv("LOWBIT_CHECK_INDEX", "1")
    assert check_indices(meta)


@pytest.mark.gpu
def test_append_op_checks_cuda_indices_on_request(monkeypatch):
    """With LOWBIT_CHECK_INDEX=1 the ops read CUDA index tensors back: kv4_append's start and pages, mla_append's
    slots raise a ValueError instead of being dropped by the kernel."""
    if not GPU:
        pytest.skip("needs CUDA")
    from lowbit.ops.mla import mla_append

    monkeypatch.setenv("LOWBIT_CHECK_INDEX", "1")
    pt, P = _page_table([20], 16)
    kc, ks, vc, vs, _, _ = _pool(P, 1, 16, 32, False, FP8)
    k = torch.randn(1, 1, 3, 32, device="cuda")
    with pytest.raises(ValueError, match="start"):
        ops.kv4_append(k, k, kc, ks, vc, vs, pt, torch.tensor([pt.shape[1] * 16 - 1], dtype=torch.int32, device="cuda"))
    pt_bad = pt.clone()
    pt_bad[0, 0] = P + 5
    with pytest.raises(ValueError, match="page_table entries"):
        ops.kv4_append(k, k, kc, ks, vc, vs, pt_bad, torch.tensor([0], dtype=torch.int32, device="cuda"))
    cache = (torch.zeros(4, 64, 512, device="cuda", dtype=torch.float8_e4m3fn),
             torch.zeros(4, 64, 64, device="cuda", dtype=torch.bfloat16), torch.zeros(4, 64, device="cuda"))
    with pytest.raises(ValueError, match="slots"):
        mla_append(torch.randn(2, 576, device="cuda"), cache, torch.tensor([3, 4 * 64], device="cuda"))


def test_opcheck():
    B, Hq, Hkv, D, page = 1, 2, 1, 32, 16
    pt, P = _page_table([9], page)
    # bf16 scales: opcheck's schema test multiplies the inputs, which float8 tensors do not support
    kc, ks, vc, vs, _, _ = _pool(P, Hkv, page, D, False, torch.bfloat16, random=True)
    q = torch.randn(B, Hq, 1, D).to(DEV)
    lengths = torch.tensor([9], dtype=torch.int32).to(DEV)
    torch.library.opcheck(torch.ops.lowbit.decode_kv4.default,
                          (q, kc, ks, vc, vs, pt, lengths, None, None, None, D ** -0.5, 0, 0, 0),
                          test_utils=("test_schema", "test_faketensor"))
    k = torch.randn(B, Hkv, 3, D).to(DEV)
    start = torch.tensor([2], dtype=torch.int32).to(DEV)
    torch.library.opcheck(torch.ops.lowbit.kv4_append.default,
                          (k, k, kc, ks, vc, vs, pt, start, None, None, None, None, None, False),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_decode_gpu_long_split():
    from lowbit.bench.suites.kv4 import random_cache

    c = random_cache(4, 8, 128, 5000, zero_point=False, device="cuda")
    c["lengths"] = torch.tensor([5000, 1, 4097, 64], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    o = ops.decode_kv4(q, **c)
    r = ops.decode_kv4_ref(q, **c)
    assert rel_l2(o, r) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("q8", (1, 2))
@pytest.mark.parametrize("zp", (False, True))
def test_decode_gpu_gluon(q8, zp):
    """The Gluon kernel (GPU only) against the reference of the same Q numerics: split-KV, a
    sequence of one token, lengths not multiples of the block, 1 and 3 query tokens, D 64 / 128."""
    from lowbit.bench.suites.kv4 import random_cache
    from lowbit.kernels.decode_kv4 import HAS_GLUON

    if not HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    for B, Hq, Hkv, D, TQ, L in ((4, 32, 8, 128, 1, 5000), (2, 8, 2, 64, 3, 300)):
        c = random_cache(B, Hkv, D, L, zero_point=zp, device="cuda")
        c["lengths"] = torch.tensor([L, TQ, L - 37, 64][:B], dtype=torch.int32, device="cuda")
        q = torch.randn(B, Hq, TQ, D, device="cuda", dtype=torch.bfloat16)
        crs = torch.rand(Hkv, D, device="cuda") + 0.5
        o = decode_kv4_triton(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"],
                              k_zero=c.get("k_zero"), v_zero=c.get("v_zero"), crs_q=crs, qk_int8=q8, gluon=True)
        r = ops.decode_kv4_ref(q, crs_q=crs, q_int8=q8, **c)
        assert rel_l2(o, r) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("flags", ({"pdl": False}, {"pdl": True}, {"cstore": True}, {"cstore": False},
                                   {"sraw": True}, {"sraw": False}))
def test_decode_gpu_gluon_options(flags):
    """The Gluon kernel's launch / epilogue / scale-load options give the default's result."""
    from lowbit.bench.suites.kv4 import random_cache
    from lowbit.kernels.decode_kv4 import HAS_GLUON

    if not HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    c = random_cache(3, 8, 128, 3000, device="cuda")
    c["lengths"] = torch.tensor([3000, 1, 2961], dtype=torch.int32, device="cuda")
    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"])
    o = decode_kv4_triton(*args, gluon=True, **flags)
    assert torch.equal(o, decode_kv4_triton(*args, gluon=True))
    assert rel_l2(o, ops.decode_kv4_ref(q, q_int8=2, **c)) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("D,TQ,splits,zero_point", [(128, 1, 1, False), (128, 1, None, False), (64, 1, 1, False),
                                                     (64, 2, None, True), (128, 2, 1, True)])
def test_decode_gpu_gluon_cstore(D, TQ, splits, zero_point):
    """``cstore`` (the epilogue's vector stores, channels in order): the same partials and the same O, bit for bit,
    with one split (O written by the kernel, bf16) and several (fp32 partials for the combine), D = 64 / 128."""
    from lowbit.bench.suites.kv4 import random_cache
    from lowbit.kernels.decode_kv4 import HAS_GLUON

    if not HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    c = random_cache(3, 8, D, 700, device="cuda", zero_point=zero_point)
    c["lengths"] = torch.tensor([700, 5, 513], dtype=torch.int32, device="cuda")
    q = torch.randn(3, 32 if TQ == 1 else 16, TQ, D, device="cuda", dtype=torch.bfloat16)
    args = (q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"])
    kw = dict(gluon=True, num_splits=splits, k_zero=c.get("k_zero"), v_zero=c.get("v_zero"))
    o = decode_kv4_triton(*args, cstore=True, **kw)
    assert torch.equal(o, decode_kv4_triton(*args, cstore=False, **kw))
    assert torch.equal(o, decode_kv4_triton(*args, **kw))  # the default ("short": on below 2048 keys per split)
    assert rel_l2(o, ops.decode_kv4_ref(q, q_int8=2, **c)) < 5e-3


@pytest.mark.slow
def test_torch_compile_fullgraph(monkeypatch):
    """The ops are opaque custom ops: a compiled decode step traces without graph breaks."""
    monkeypatch.setattr(ops, "use_triton", lambda *t: False)
    B, Hq, Hkv, D, page = 1, 2, 1, 32, 16
    pt, P = _page_table([9], page)
    kc, ks, vc, vs, _, _ = _pool(P, Hkv, page, D, False, FP8, random=True)
    q = torch.randn(B, Hq, 1, D).to(DEV)
    lengths = torch.tensor([9], dtype=torch.int32).to(DEV)
    f = torch.compile(lambda q: ops.decode_kv4(q, kc, ks, vc, vs, pt, lengths, max_len=9), fullgraph=True,
                      backend="eager")
    assert rel_l2(f(q), ops.decode_kv4(q, kc, ks, vc, vs, pt, lengths)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("zero_point", (False, True))
@pytest.mark.parametrize("vsub", (False, True))
def test_decode_gpu_gluon_vsub(zero_point, vsub):
    """``VSUB`` (V codes as fp16 subnormals, the offset subtracted at the end): the tensor core multiplies the
    subnormals exactly, so either form stays within the kernel's tolerance of the float64 reference and within
    fp32-accumulation distance of the other, with signed and with zero-point codes."""
    from lowbit.bench.suites.kv4 import random_cache
    from lowbit.kernels.decode_kv4 import HAS_GLUON

    if not HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    c = random_cache(3, 8, 128, 3000, device="cuda", zero_point=zero_point)
    c["lengths"] = torch.tensor([3000, 1, 2961], dtype=torch.int32, device="cuda")
    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"])
    kw = dict(k_zero=c.get("k_zero"), v_zero=c.get("v_zero"), gluon=True)
    o = decode_kv4_triton(*args, vsub=vsub, **kw)
    assert rel_l2(o, ops.decode_kv4_ref(q, q_int8=2, **c)) < 5e-3
    assert rel_l2(o, decode_kv4_triton(*args, vsub=not vsub, **kw)) < 2e-3


def test_gluon_launcher_plumbing(monkeypatch):
    """The Gluon launcher's Python side on the CPU, with the compiled kernel stubbed (the kernel itself is checked
    on the GPU and by offline builds): grid and split plan, the constexprs it passes (CSTORE below
    ``GLUON_CSTORE_MAX_SPLIT`` keys per split, VSUB for zero-point caches, SRAW for signed codes from
    ``GLUON_SRAW_MIN_SPLIT`` keys per split, PDL only with a split), the combine
    launched only with a split, and the compiled kernel's keyword set (every constexpr it names exists)."""
    import inspect

    import lowbit.kernels.decode_kv4 as dk
    from lowbit.bench.suites.kv4 import random_cache

    if not dk.HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    params = set(inspect.signature(dk._decode_kv4_gluon_kernel.fn).parameters)
    calls, combines = [], []

    class Stub:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                assert set(kw) - {"num_warps", "maxnreg"} <= params, set(kw) - params
                calls.append((grid, kw))
                return None
            return launch

    monkeypatch.setattr(dk, "_decode_kv4_gluon_kernel", Stub())
    monkeypatch.setattr(dk, "_combine", lambda *a, **k: combines.append(k))
    for zp, max_len, splits, cstore, pdl, sraw in ((False, 8192, 16, True, True, True),
                                                   (True, 8192, 2, False, True, False),
                                                   (False, 8192, 32, True, True, False),
                                                   (False, 300, 1, True, False, False)):
        c = random_cache(2, 8, 128, max_len, device="cpu", zero_point=zp)
        q = torch.randn(2, 32, 1, 128, dtype=torch.bfloat16)
        calls.clear()
        combines.clear()
        dk._launch_gluon(q, c["k_codes"], c["k_scale"], c["v_codes"], c["v_scale"], c["page_table"], c["lengths"],
                         c.get("k_zero"), c.get("v_zero"), None, None, max_len, splits, None, None, None, 2, False)
        (grid, kw), = calls
        assert grid == (2 * 8, splits)
        assert kw["SPLIT"] == (splits > 1) and kw["PDL"] == pdl and kw["CSTORE"] == cstore and kw["SRAW"] == sraw
        assert kw["VSUB"] == zp and kw["ZERO_POINT"] == zp and kw["STAGES"] == dk.GLUON_STAGES
        assert len(combines) == (splits > 1)


def test_occupancy_key_per_variant():
    """The residency cache of the split choice is keyed per compiled variant (session 27): SPLIT on / off and
    Triton's integer / alignment specialization give different keys, and the key read before a split launch is the
    one that launch stores (the output allocated first: a strided q view and its empty_like output differ)."""
    from lowbit.kernels.decode_kv4 import _occupancy_key

    q = torch.randn(2, 8, 1, 64)
    kc = torch.zeros(4, 2, 16, 32, dtype=torch.uint8)
    ks = torch.zeros(4, 2, 16)
    pt = torch.zeros(2, 4, dtype=torch.int32)
    out = torch.empty_like(q)
    base = ("x",)
    assert _occupancy_key(base, True, q, kc, ks, pt, 2, out) == _occupancy_key(base, True, q, kc, ks, pt, 2, out)
    assert _occupancy_key(base, True, q, kc, ks, pt, 2, out) != _occupancy_key(base, False, q, kc, ks, pt, 2, out)
    assert _occupancy_key(base, True, q, kc, ks, pt, 2, out) != _occupancy_key(base, True, q, kc, ks, pt, 1, out)
    qv = torch.randn(2, 8, 1, 72)[..., :64]  # a view whose strides (72) are not multiples of 16
    assert _occupancy_key(base, True, qv, kc, ks, pt, 2, qv) != _occupancy_key(base, True, qv, kc, ks, pt, 2,
                                                                                torch.empty_like(qv))
