"""Decode attention over the paged float (bf16 / fp16) cache: the Triton kernel (interpreter on CPU)
vs its float64 reference, the ``lowbit::decode_float`` op (validation, opcheck), the runner's dense
cache and ``PagedKVCache(numerics='bf16')`` on ragged batches."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lowbit.bench.suites.kv4 import random_float_pages
from lowbit.kernels.decode_float import decode_float_triton
from lowbit.ops import kv4 as ops
from tests.tolerances import rel_l2
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)

DEV = "cuda" if GPU else "cpu"


def _paged(lens, Hkv, page, D, dtype, seed=0):
    return random_float_pages(lens, Hkv, page, D, dtype, seed=seed, device=DEV)


# (lengths, Hq, Hkv, TQ, D, page, splits): ragged, GQA / MQA / MHA, 1-4 new tokens, lengths not a
# multiple of the page or of BLOCK_N, one split and several (the combine kernel)
CASES = [
    ([37, 5], 4, 2, 1, 64, 16, None),
    ([70, 129], 8, 2, 2, 128, 32, 3),
    ([3, 64, 17], 4, 1, 4, 64, 64, 1),
    ([100], 2, 2, 3, 32, 16, 5),
]


@pytest.mark.parametrize("lens,Hq,Hkv,TQ,D,page,splits", CASES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_kernel_matches_reference(lens, Hq, Hkv, TQ, D, page, splits, dtype):
    k, v, pt, lengths = _paged(lens, Hkv, page, D, dtype)
    q = torch.randn(len(lens), Hq, TQ, D).to(dtype).to(DEV)
    out = decode_float_triton(q, k, v, pt, lengths, num_splits=splits, block_n=16 if page == 16 else 32)
    ref = ops.decode_float_ref(q, k, v, pt, lengths)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_l2(out, ref) < (1.5e-2 if dtype == torch.bfloat16 else 3e-3)


@settings(deadline=None, max_examples=6)
@given(b=st.integers(1, 3), hkv=st.sampled_from([1, 2]), grp=st.sampled_from([1, 2, 4]), tq=st.integers(1, 4),
       L=st.integers(4, 90), splits=st.sampled_from([None, 1, 2, 7]))
def test_kernel_fuzz_shapes(b, hkv, grp, tq, L, splits):
    lens = [max(tq, L - 13 * i) for i in range(b)]
    k, v, pt, lengths = _paged(lens, hkv, 16, 32, torch.bfloat16, seed=L)
    q = torch.randn(b, hkv * grp, tq, 32).to(torch.bfloat16).to(DEV)
    out = decode_float_triton(q, k, v, pt, lengths, num_splits=splits, block_n=16)
    assert rel_l2(out, ops.decode_float_ref(q, k, v, pt, lengths)) < 1.5e-2


def test_dense_cache_is_one_page_per_sequence():
    """The runner's dense ``[B, Hkv, S, D]`` cache = pages of S tokens, page_table[b] = [b]."""
    B, Hkv, S, D = 2, 2, 48, 64
    kd = torch.randn(B, Hkv, S, D).to(torch.bfloat16).to(DEV)
    vd = torch.randn(B, Hkv, S, D).to(torch.bfloat16).to(DEV)
    pt = torch.arange(B, dtype=torch.int32, device=DEV)[:, None]
    lengths = torch.tensor([30, 47], dtype=torch.int32, device=DEV)
    q = torch.randn(B, 4, 1, D).to(torch.bfloat16).to(DEV)
    out = ops.decode_float(q, kd, vd, pt, lengths, max_len=S)
    from lowbit.ops.attention import attention_ref

    for b in range(B):
        L = int(lengths[b])
        ref = attention_ref(q[b:b + 1], kd[b:b + 1, :, :L], vd[b:b + 1, :, :L], causal=True)
        assert rel_l2(out[b:b + 1], ref) < 1.5e-2


def test_op_validation_and_opcheck():
    k, v, pt, lengths = _paged([9], 1, 16, 32, torch.bfloat16)
    q = torch.randn(1, 2, 1, 32).to(DEV)
    with pytest.raises(ValueError, match="1..16"):
        ops.decode_float(torch.randn(1, 2, 17, 32).to(DEV), k, v, pt, lengths)
    with pytest.raises(ValueError, match="multiple of the cache's KV heads"):
        ops.decode_float(torch.randn(1, 3, 1, 32).to(DEV), torch.cat([k, k], 1), torch.cat([v, v], 1), pt, lengths)
    with pytest.raises(ValueError, match="head dim"):
        ops.decode_float(torch.randn(1, 2, 1, 64).to(DEV), k, v, pt, lengths)
    with pytest.raises(ValueError, match="page size"):
        ops.decode_float(q, k[:, :, :8], v[:, :, :8], pt, lengths)
    with pytest.raises(TypeError, match="lengths"):
        ops.decode_float(q, k, v, pt, lengths.long())
    with pytest.raises(TypeError, match="v must have dtype"):
        ops.decode_float(q, k, v.half(), pt, lengths)
    torch.library.opcheck(torch.ops.lowbit.decode_float.default, (q, k, v, pt, lengths, 32 ** -0.5, 0, 0),
                          test_utils=("test_schema", "test_faketensor"))


def test_paged_bf16_cache_ragged_decode():
    """``PagedKVCache(numerics='bf16').decode`` on a ragged batch (was: NotImplementedError)."""
    from lowbit.nn.kv_cache import PagedKVCache

    H, D = 2, 32
    pc = PagedKVCache(1, H, D, numerics="bf16", batch_size=2, page_size=16, device=DEV, dtype=torch.bfloat16)
    pc.begin_step(20)
    pc.append(0, torch.randn(2, H, 20, D).to(torch.bfloat16).to(DEV), torch.randn(2, H, 20, D).to(torch.bfloat16).to(DEV))
    pc.release(1)
    pc.begin_step(3)  # lengths 23 and 3
    pc.append(0, torch.randn(2, H, 3, D).to(torch.bfloat16).to(DEV), torch.randn(2, H, 3, D).to(torch.bfloat16).to(DEV))
    q = torch.randn(2, 2 * H, 3, D).to(torch.bfloat16).to(DEV)
    out = pc.decode(0, q)
    kd, vd = pc.dequantize(0)
    from lowbit.ops.attention import attention_ref

    for b, L in enumerate((23, 3)):
        ref = attention_ref(q[b:b + 1], kd[b:b + 1, :, :L], vd[b:b + 1, :, :L], causal=True)
        assert rel_l2(out[b:b + 1], ref) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("lens,Hq,Hkv,TQ,D,page,splits", CASES + [([1000, 37, 513], 32, 8, 1, 128, 64, None),
                                                                  ([4100, 70], 32, 8, 4, 128, 64, 9)])
def test_gpu_kernel_ragged(lens, Hq, Hkv, TQ, D, page, splits):
    """GPU (compiled kernel): ragged paged batches vs the float64 reference, bf16."""
    if not GPU:
        pytest.skip("needs CUDA")
    k, v, pt, lengths = _paged(lens, Hkv, page, D, torch.bfloat16)
    q = torch.randn(len(lens), Hq, TQ, D).to(torch.bfloat16).cuda()
    out = ops.decode_float(q, k, v, pt, lengths, num_splits=splits or 0)
    assert rel_l2(out, ops.decode_float_ref(q, k, v, pt, lengths)) < 1e-2



def _unfused_append_decode(q, kn, vn, k, v, pt, lengths, cos, sin, **kw):
    """The runner's two launches: ``float_append_triton`` (q and k rotated, k / v written) then the decode."""
    from lowbit.kernels.kv4_append import float_append_triton

    TQ = q.shape[2]
    qo = torch.empty_like(q)
    float_append_triton(kn, vn, k, v, pt, (lengths - TQ).to(torch.int32), cos=cos, sin=sin, q=q, q_out=qo)
    return decode_float_triton(qo, k, v, pt, lengths, **kw)


def _rope_inputs(B, Hq, Hkv, TQ, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, TQ, D, generator=g).to(dtype).to(DEV)
    kn = torch.randn(B, Hkv, TQ, D, generator=g).to(dtype).to(DEV)
    vn = torch.randn(B, Hkv, TQ, D, generator=g).to(dtype).to(DEV)
    ang = torch.rand(B, TQ, D // 2, generator=g) * 6.0
    ang = torch.cat([ang, ang], dim=-1)  # half-split: cos[..., i] == cos[..., i + D/2]
    return q, kn, vn, ang.cos().to(dtype).to(DEV), ang.sin().to(dtype).to(DEV)


# (lengths incl. the new tokens, Hq, Hkv, TQ, D, page, splits): one split, several (fused combine), a split
# boundary inside the new tokens (TQ = 4, splits of 16 keys), MQA, a length equal to TQ (no cached key)
APPEND_CASES = CASES[:2] + [([34, 4, 18], 4, 1, 4, 64, 16, 3)] + CASES[3:]


@pytest.mark.parametrize("lens,Hq,Hkv,TQ,D,page,splits", APPEND_CASES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_append_fused_matches_unfused(lens, Hq, Hkv, TQ, D, page, splits, dtype):
    """``decode_float_append_triton`` = ``float_append_triton`` + ``decode_float_triton``: the same cache bytes
    (k rotated with the same rounding, v copied) and the same output: bit for bit with the combine launch (the
    key blocks and their values are the unfused launches'), to fp32 summation order with the fused combine."""
    from lowbit.kernels.decode_float import LAST_LAUNCH, decode_float_append_triton

    k, v, pt, lengths = _paged(lens, Hkv, page, D, dtype)
    q, kn, vn, cos, sin = _rope_inputs(len(lens), Hq, Hkv, TQ, D, dtype)
    k2, v2 = k.clone(), v.clone()
    ref = _unfused_append_decode(q, kn, vn, k2, v2, pt, lengths, cos, sin, num_splits=splits, block_n=16)
    for fuse in (False, True):
        k1, v1 = k.clone(), v.clone()
        out = decode_float_append_triton(q, kn, vn, k1, v1, pt, lengths, cos=cos, sin=sin, num_splits=splits,
                                         block_n=16, fuse_combine=fuse)
        assert LAST_LAUNCH["fused_combine"] == (fuse and LAST_LAUNCH["num_splits"] > 1)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert torch.equal(out, ref) if not fuse else rel_l2(out, ref) < 1e-3
        qr = ops.rope_ref(q, cos, sin).to(dtype)
        assert rel_l2(out, ops.decode_float_ref(qr, k1, v1, pt, lengths)) < (1.5e-2 if dtype == torch.bfloat16 else 3e-3)


@pytest.mark.parametrize("splits", (2, 5))
def test_fused_combine_matches_combine_launch(splits):
    """``fuse_combine``: the last program per (sequence, KV head) combines the splits like the combine launch
    (same partials, same formula); the counters are back at zero after the launch (a second call agrees)."""
    from lowbit._utils import ARRIVAL_COUNTERS

    k, v, pt, lengths = _paged([70, 33], 2, 16, 64, torch.bfloat16)
    q = torch.randn(2, 8, 2, 64).to(torch.bfloat16).to(DEV)
    a = decode_float_triton(q, k, v, pt, lengths, num_splits=splits, block_n=16)
    b = decode_float_triton(q, k, v, pt, lengths, num_splits=splits, block_n=16, fuse_combine=True)
    c = decode_float_triton(q, k, v, pt, lengths, num_splits=splits, block_n=16, fuse_combine=True)
    assert rel_l2(b, a) < 1e-3 and torch.equal(b, c)
    assert all(int(t.abs().sum()) == 0 for t in ARRIVAL_COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.parametrize("lens,page,splits", [([1025], 1088, None), ([1025, 7, 300], 64, None), ([8192], 8256, None)])
def test_gpu_append_fused_llama_shapes(lens, page, splits):
    """GPU (compiled): the runner's fused decode at Llama-3-8B's head shapes (32 / 8 heads, D = 128; the dense cache
    as one page per request, and a paged ragged batch) against the append + decode + combine launches: the same
    cache bytes, the output within fp32 summation order (fused combine), and under a CUDA graph."""
    if not GPU:
        pytest.skip("needs CUDA")
    from lowbit._utils import capture_cuda_graph
    from lowbit.kernels.decode_float import LAST_LAUNCH, decode_float_append_triton

    k, v, pt, lengths = _paged(lens, 8, page, 128, torch.bfloat16)
    q, kn, vn, cos, sin = _rope_inputs(len(lens), 32, 8, 1, 128, torch.bfloat16)
    k2, v2 = k.clone(), v.clone()
    ref = _unfused_append_decode(q, kn, vn, k2, v2, pt, lengths, cos, sin, max_len=max(lens))
    out = decode_float_append_triton(q, kn, vn, k, v, pt, lengths, cos=cos, sin=sin, max_len=max(lens))
    assert LAST_LAUNCH["num_splits"] > 1
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert rel_l2(out, ref) < 1e-3
    g, o2 = capture_cuda_graph(lambda: decode_float_append_triton(q, kn, vn, k, v, pt, lengths, cos=cos, sin=sin,
                                                                  max_len=max(lens)))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(o2, out)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_op_decode_float_append(dtype):
    """``lowbit::decode_float_append``: the kernel (interpreter / GPU) and the CPU reference write the same cache
    and agree on O; opcheck (schema, fake tensor); torch.compile(fullgraph) traces it; bad arguments name
    themselves."""
    lens = [40, 3]
    k, v, pt, lengths = _paged(lens, 2, 16, 64, dtype)
    q, kn, vn, cos, sin = _rope_inputs(2, 4, 2, 2, 64, dtype)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.cpu().clone(), v.cpu().clone()
    out = ops.decode_float_append(q, kn, vn, k1, v1, pt, lengths, cos=cos, sin=sin, max_len=64)
    ref = ops.decode_float_append_ref(q.cpu(), kn.cpu(), vn.cpu(), k2, v2, pt.cpu(), lengths.cpu(), cos=cos.cpu(),
                                      sin=sin.cpu())
    assert torch.equal(k1.cpu(), k2) and torch.equal(v1.cpu(), v2)
    assert rel_l2(out.cpu(), ref) < (1.5e-2 if dtype == torch.bfloat16 else 3e-3)
    torch.library.opcheck(torch.ops.lowbit.decode_float_append.default,
                          (q, kn, vn, k.clone(), v.clone(), pt, lengths, cos, sin, 64 ** -0.5, 64, 0),
                          test_utils=("test_schema", "test_faketensor"))
    f = torch.compile(lambda q: ops.decode_float_append(q, kn, vn, k.clone(), v.clone(), pt, lengths, cos=cos, sin=sin,
                                                         max_len=64), fullgraph=True, backend="eager")
    assert rel_l2(f(q), out) < 1e-6
    with pytest.raises(ValueError, match="k_new"):
        ops.decode_float_append(q, kn[:, :1], vn, k, v, pt, lengths, cos=cos, sin=sin)
    with pytest.raises(ValueError, match="cos"):
        ops.decode_float_append(q, kn, vn, k, v, pt, lengths, cos=cos[:, :1], sin=sin)
    with pytest.raises(TypeError, match="q"):
        ops.decode_float_append(q.float(), kn, vn, k, v, pt, lengths, cos=cos, sin=sin)


@settings(deadline=None, max_examples=8)
@given(b=st.integers(1, 3), hkv=st.sampled_from([1, 2]), grp=st.sampled_from([1, 2, 4]), tq=st.integers(1, 4),
       L=st.integers(4, 90), splits=st.sampled_from([None, 1, 2, 7]), fuse=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_append_fused_fuzz_shapes(b, hkv, grp, tq, L, splits, fuse, dtype):
    """``decode_float_append_triton`` against the append + decode launches on fuzzed ragged batches (1-4 new tokens,
    GQA / MQA / MHA, split counts that put split boundaries among the new tokens): the same cache bytes, the same
    output bit for bit with the combine launch, within fp32 summation order with the fused combine."""
    from lowbit.kernels.decode_float import decode_float_append_triton

    lens = [max(tq, L - 13 * i) for i in range(b)]
    k, v, pt, lengths = _paged(lens, hkv, 16, 32, dtype, seed=L)
    q, kn, vn, cos, sin = _rope_inputs(b, hkv * grp, hkv, tq, 32, dtype, seed=L)
    k2, v2 = k.clone(), v.clone()
    ref = _unfused_append_decode(q, kn, vn, k2, v2, pt, lengths, cos, sin, num_splits=splits, block_n=16)
    out = decode_float_append_triton(q, kn, vn, k, v, pt, lengths, cos=cos, sin=sin, num_splits=splits, block_n=16,
                                     fuse_combine=fuse)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert rel_l2(out, ref) < 1e-3 if fuse else torch.equal(out, ref)
