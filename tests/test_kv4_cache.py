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


# ---- stateful fuzz of the allocator and the page writes ------------------------------------
from hypothesis import settings as _settings  # noqa: E402
from hypothesis import strategies as _st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

from lowbit.formats.kv4 import dequantize_kv4, quantize_kv4  # noqa: E402


class PagedCacheMachine(RuleBasedStateMachine):
    """Random interleavings of ``begin_step`` (1-40 tokens: page boundaries crossed, the pool grown from one page),
    per-layer ``append`` and ``release``: no physical page is held twice (by two sequences, or by a sequence and the
    free list), every sequence holds exactly the pages its length needs, and ``dequantize`` of every layer returns
    what was appended, quantized by the format's reference (exactly, for every numerics)."""

    @initialize(numerics=_st.sampled_from(("kv4", "kv4-zp", "bf16")), batch=_st.integers(1, 3),
                sd=_st.sampled_from((torch.float8_e4m3fn, torch.bfloat16)))
    def setup(self, numerics, batch, sd):
        self.c = PagedKVCache(2, 2, 16, numerics=numerics, batch_size=batch, page_size=16, num_pages=1, device=DEV,
                              dtype=torch.float32, scale_dtype=sd)
        self.rows = [[[] for _ in range(batch)] for _ in range(2)]  # [layer][b] -> list of (k, v) [H, D] rows
        self.gen = torch.Generator().manual_seed(batch)

    def _expect(self, x):
        if self.c.numerics == "bf16":
            return x
        c, s, z = quantize_kv4(x, zero_point=self.c.numerics == "kv4-zp", scale_dtype=self.c.scale_dtype)
        return dequantize_kv4(c, s, z)

    @rule(T=_st.integers(1, 40), mag=_st.sampled_from((1e-3, 1.0, 30.0)))
    def step(self, T, mag):
        B = self.c.batch_size
        self.c.begin_step(T)
        for layer in range(2):
            k = torch.randn(B, 2, T, 16, generator=self.gen) * mag
            v = torch.randn(B, 2, T, 16, generator=self.gen) * mag
            self.c.append(layer, k.to(DEV), v.to(DEV))
            ek, ev = self._expect(k), self._expect(v)
            for b in range(B):
                self.rows[layer][b].extend((ek[b, :, t], ev[b, :, t]) for t in range(T))

    @rule(data=_st.data())
    def release(self, data):
        b = data.draw(_st.integers(0, self.c.batch_size - 1))
        self.c.release(b)
        for layer in range(2):
            self.rows[layer][b] = []

    @invariant()
    def pages_are_owned_once(self):
        held = [p for pg in self.c._pages for p in pg]
        assert len(held) == len(set(held)) and not set(held) & set(self.c._free)
        assert len(held) + len(self.c._free) == self.c.num_pages
        for b, pg in enumerate(self.c._pages):
            assert len(pg) == -(-self.c.host_lengths[b] // self.c.page_size)
        assert self.c.lengths.tolist() == self.c.host_lengths

    @invariant()
    def dequantize_returns_what_was_appended(self):
        if self.c.max_length == 0:
            return
        for layer in range(2):
            k, v = self.c.dequantize(layer, dtype=torch.float32)
            for b, rows in enumerate(self.rows[layer]):
                L = len(rows)
                assert L == self.c.host_lengths[b]
                if L:
                    assert torch.equal(k[b, :, :L].cpu(), torch.stack([r[0] for r in rows], 1))
                    assert torch.equal(v[b, :, :L].cpu(), torch.stack([r[1] for r in rows], 1))
                assert (k[b, :, L:] == 0).all() and (v[b, :, L:] == 0).all()


PagedCacheMachine.TestCase.settings = _settings(max_examples=10, stateful_step_count=8, deadline=None)
test_paged_cache_state_machine = PagedCacheMachine.TestCase
