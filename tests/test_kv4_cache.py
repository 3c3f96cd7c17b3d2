"""lowbit.nn.kv_cache.PagedKVCache: allocation, growth, the three numerics, decode vs dequantize."""
import pytest
import torch

from lowbit.nn.kv_cache import PagedKVCache
from lowbit.ops.attention import attention_ref
from lowbit.ops.kv4 import rope_ref
from tests.tolerances import rel_l2
from tests.conftest import GPU  # CUDA with compiled kernels (not under TRITON_INTERPRET)

DEV = "cuda" if GPU else "cpu"


@pytest.fixture(autouse=True)
def _reference_ops_on_cpu(monkeypatch):
    """The kernels are checked against the references in test_kv4_kernels; here the cache logic
    is tested, so on CPU the ops take their (fast) reference path instead of the interpreter."""
    if DEV == "cpu":
        import lowbit.ops.kv4 as ops

        monkeypatch.setattr(ops, "use_triton", lambda *t: False)


def _rope(B, T, D, offset=0):
    pos = torch.arange(offset, offset + T, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    return emb.cos()[None].expand(B, T, D).to(DEV), emb.sin()[None].expand(B, T, D).to(DEV)


@pytest.mark.parametrize("numerics", ("kv4", "kv4-zp", "bf16"))
def test_prefill_then_decode_matches_dequantized_attention(numerics):
    torch.manual_seed(0)
    L, H, Hq, D, B = 2, 2, 4, 64, 2
    c = PagedKVCache(L, H, D, numerics=numerics, batch_size=B, page_size=16, num_pages=2, device=DEV,
                     dtype=torch.float32)
    ks, vs = [], []
    crs = (torch.rand(H, D) + 0.5).to(DEV)
    for T, off in ((21, 0), (1, 21), (3, 22)):  # prefill 21 tokens (pool grows), then 1 and 3
        c.begin_step(T)
        cos, sin = _rope(B, T, D, off)
        k, v = torch.randn(B, H, T, D).to(DEV), torch.randn(B, H, T, D).to(DEV)
        for layer in range(L):
            c.append(layer, k, v, cos=cos, sin=sin, crs_k=crs)
        ks.append(rope_ref(k, cos, sin) * crs[None, :, None, :])
        vs.append(v)
    assert c.host_lengths == [25, 25] and c.max_length == 25
    kd, vd = c.dequantize(1, torch.float32)
    kfull, vfull = torch.cat(ks, 2), torch.cat(vs, 2)
    tol = 1e-6 if numerics == "bf16" else 0.15
    assert rel_l2(kd, kfull) < tol and rel_l2(vd, vfull) < tol
    q = torch.randn(B, Hq, 3, D).to(DEV)
    o = c.decode(1, q, crs_q=1.0 / crs)
    qs = q * (1.0 / crs).repeat_interleave(Hq // H, 0)[:, None, :]
    r = attention_ref(qs, kd, vd, causal=True)
    assert rel_l2(o, r) < 5e-3
    assert c.bytes() > 0


def test_bytes_and_compression():
    c = PagedKVCache(30, 3, 64, numerics="kv4", batch_size=1, page_size=64)
    assert c.bytes() == 0
    c.begin_step(100)
    assert c.bytes_per_token() == 30 * 3 * 2 * (32 + 1)
    assert c.bytes() == 2 * 64 * c.bytes_per_token()  # 2 pages
    rep = c.memory_report()
    assert rep["compression_vs_bf16"] == pytest.approx(256 / 66)
    zp = PagedKVCache(30, 3, 64, numerics="kv4-zp")
    assert zp.bytes_per_token() == 30 * 3 * 2 * 34


def test_release_and_ragged_lengths():
    c = PagedKVCache(1, 1, 32, batch_size=2, page_size=16, num_pages=8, device=DEV)
    c.begin_step(20)
    assert len(c._free) == 4
    c.release(0)
    assert len(c._free) == 6 and c.host_lengths == [0, 20]
    c.begin_step(1)
    assert c.host_lengths == [1, 21] and c.lengths.tolist() == [1, 21]


def test_errors():
    with pytest.raises(ValueError, match="numerics"):
        PagedKVCache(1, 1, 64, numerics="int8")
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(1, 1, 64, page_size=24)
    c = PagedKVCache(1, 1, 64, batch_size=1)
    with pytest.raises(ValueError, match="begin_step"):
        c.append(0, torch.randn(1, 1, 2, 64), torch.randn(1, 1, 2, 64))
