"""Non-finite inputs reach the outputs of the quantized attention paths (the brief: never silent garbage).

Rule: a non-finite input reaches every output computed from it. Where codes cannot hold a NaN (INT8, INT4), an Inf or
a NaN among the values that share a scale gives that scale NaN (``lowbit.kernels.act_quant.abs_or_inf``; in the INT8
prefill schemes only with ``LOWBIT_NAN_SAFE=1``, which costs speed there); the prefill's FP8 codes keep the NaN
themselves (``attention_quant._quant_tile``). The GPU's ``max`` (and the Triton
interpreter's) skips NaN, so the quantizers take NaN as +inf and turn an infinite maximum into NaN; the attention
kernels carry it through P (FP8, bf16) or the scales of V. Where integer P codes and row sums would drop it (the
``int8`` scheme's keys), the K scale is added to l as ``0 * scale``; the MLA decode divides by l only where
``l != 0`` (session 35; before, a NaN l gave 0).

What is checked, per path: every output row that reads the bad element (as float attention does) is non-finite here
(the quantized paths may poison more rows: a V scale spans a block of keys, and Inf becomes NaN), a NaN query row
poisons only its own row, and an untouched head (or sequence) stays finite. Kernels run compiled on CUDA and under
the interpreter on the CPU; the interpreter reads E4M3 NaN as the GPU does (``lowbit._utils._patch_triton_interpreter_e4m3_nan``).
"""
import pytest
import torch

import lowbit
from lowbit.formats.kv4 import dequantize_kv4, quantize_kv4
from lowbit.formats.mla_fp8 import quantize_latent
from lowbit.nn.kv_cache import PagedKVCache
from tests.test_mla import DC, DR, make_cache

NAN, INF = float("nan"), float("inf")


def _bad_rows(o: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(o.float())).any(-1)


@pytest.mark.parametrize("scheme", ["fp8", "fp8-kv4", "int8", "int8-qk"])
@pytest.mark.parametrize("where,val,causal", [("q", NAN, False), ("k", NAN, False), ("v", NAN, False),
                                              ("k", INF, True), ("v", NAN, True)])
def test_prefill_attention_propagates(dev, scheme, where, val, causal, monkeypatch):
    """The FP8 schemes by default; the INT8 ones with ``LOWBIT_NAN_SAFE=1`` (``attention_quant.NAN_SAFE``, off by
    default for speed)."""
    import lowbit.kernels.attention_quant as aq

    if scheme.startswith("int8"):
        monkeypatch.setattr(aq, "NAN_SAFE", True)
    torch.manual_seed(0)
    S, D = 70, 64  # not a multiple of the key block
    q = torch.randn(1, 4, S, D, device=dev, dtype=torch.bfloat16)  # GQA 4 / 2
    k = torch.randn(1, 2, S, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 2, S, D, device=dev, dtype=torch.bfloat16)
    t = {"q": q, "k": k, "v": v}[where]
    t[0, 0, 37, 5] = val  # query head 0, or KV head 0 (query heads 0 and 1)
    o = lowbit.api.attention(q, k, v, scheme=scheme, causal=causal)
    bad = _bad_rows(o)
    # float attention's rows that read the bad element: the query's own row, or every row that sees key 37 (torch's
    # CPU SDPA also poisons the rows the causal mask hides from it: 0 * NaN in its P V)
    want = torch.zeros_like(bad)
    rows = torch.arange(S, device=dev)
    want[0, :1 if where == "q" else 2] = (rows == 37) if where == "q" else ((rows >= 37) if causal else True)
    assert bool((bad | ~want).all()), f"{int((want & ~bad).sum())} rows lost the non-finite value"
    assert not bad[0, 2:].any()  # the other KV head's query heads
    if where == "q":
        assert torch.equal(bad, want)  # exactly the NaN query's row


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("val", [NAN, INF, -INF])
def test_kv4_reference_gives_nan_scale(zero_point, scale_dtype, val):
    x = torch.randn(3, 64)
    x[1, 7] = val
    codes, scale, zero = quantize_kv4(x, zero_point=zero_point, scale_dtype=scale_dtype)
    assert scale.float()[1].isnan() and torch.isfinite(scale.float()[[0, 2]]).all()
    y = dequantize_kv4(codes, scale, zero)
    assert y[1].isnan().all() and torch.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("numerics", ["kv4", "kv4-zp"])
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_kv4_cache_append_and_decode_propagate(dev, numerics, where):
    """A non-finite token appended (the fused RoPE + quantize + page-write kernel) poisons the decode of its
    sequence and KV head, and only those; a NaN query poisons its own row."""
    torch.manual_seed(1)
    H, Hq, D, B, T = 2, 4, 64, 2, 21
    c = PagedKVCache(1, H, D, numerics=numerics, batch_size=B, page_size=16, num_pages=4, device=dev,
                     dtype=torch.bfloat16)
    c.begin_step(T)
    k = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, Hq, 2, D, device=dev, dtype=torch.bfloat16)
    {"k": k, "v": v, "q": q}[where][0, 0, 1 if where == "q" else 9, 3] = NAN
    c.append(0, k, v)
    if where != "q":
        assert int(c.pools[0][f"{where}_scale"].float().isnan().sum()) == 1  # the append kernel stored a NaN scale
    bad = _bad_rows(c.decode(0, q))  # [B, Hq, 2]
    want = torch.zeros_like(bad)
    if where == "q":
        want[0, 0, 1] = True  # that query row alone
    else:
        want[0, :2] = True  # sequence 0, KV head 0's query heads
    assert torch.equal(bad, want)


@pytest.mark.parametrize("val", [NAN, INF])
def test_mla_latent_gets_nan_scale(dev, val):
    """The FP8 latent format and its append kernel give a non-finite token a NaN scale."""
    x = torch.randn(3, DC + DR)
    x[1, 5] = val
    _, s, _ = quantize_latent(x, DC)
    assert s[1].isnan() and torch.isfinite(s[[0, 2]]).all()
    c, kv = make_cache([40, 23], True, dev)
    kvn = kv.clone()
    kvn[0, 11, 3] = val
    c.reset()
    c.append(0, kvn)
    content, rope, scale = c.layers[0]
    assert int(scale.isnan().sum()) == 1  # the append kernel stored the NaN scale


@pytest.mark.parametrize("variant", ["fp8", "fp8-bf16pv", "fp8-pv16", "fp8-block-rule", "bf16"])
@pytest.mark.parametrize("H,Sq,splits", [(4, 2, 1), (4, 1, 3), (64, 1, 2)])
def test_mla_decode_propagates(dev, variant, H, Sq, splits):
    """A non-finite latent (content part) poisons every query row of its sequence, in every decode kernel: the FP8
    ones through its NaN scale (P and l turn NaN; the epilogues divide by l only where ``l != 0``, and the block-wide
    P-scale rule floors its ``log2(sigma)`` so a fully masked block gives l = 0, not NaN), the bf16 one through the
    value. The other sequence stays finite. (On the GPU, 4 heads take the Gluon few-rows kernel and 64 heads the
    warp-specialized one where the shapes allow.)"""
    from lowbit.kernels.mla_decode import mla_decode_triton
    from lowbit.ops.mla import mla_decode

    fp8 = variant != "bf16"
    lens = [40, 23]
    c, kv = make_cache(lens, fp8, dev, H=H)
    kvn = kv.clone()
    kvn[0, 11, 3] = NAN
    c.reset()
    c.append(0, kvn)
    c.lengths[0] = list(lens)
    c._seq_lens[0] = None
    cache, pt, sl = c.layers[0], c.page_table, c.seq_lens(0)
    q = torch.randn(2, Sq, H, DC + DR, device=dev, dtype=torch.bfloat16)
    if variant == "fp8-block-rule":
        qc, qs, qr = quantize_latent(q.reshape(-1, DC + DR), DC)
        out = mla_decode_triton(qc.view(2, Sq * H, DC), qr.view(2, Sq * H, DR), qs.view(2, Sq * H),
                                cache[0].flatten(0, 1), cache[1].flatten(0, 1), cache[2].flatten(0, 1), pt, sl,
                                num_heads=H, sm_scale=(DC + DR) ** -0.5, max_seq_len=max(lens),
                                page_size=cache[0].shape[1], fp8=True, num_splits=splits, p_block=True, t_step=True)
        out = out.view(2, Sq, H, DC)
    else:
        kw = {"fp8-bf16pv": {"pv_fp8": False}, "fp8-pv16": {"pv16": True}}.get(variant, {})
        out = mla_decode(q, cache, pt, sl, num_splits=splits, max_seq_len=max(lens), **kw)
    bad = _bad_rows(out)  # [B, Sq, H]
    assert bad[0].all(), f"{int((~bad[0]).sum())} rows of sequence 0 lost the NaN"
    assert not bad[1].any()
