"""Fast generation for (quantized) Llama-family models: a gpt-fast style runner.

``model.generate`` of transformers keeps working on every lowbit model; this runner is the
throughput path. It reuses the model's own modules (embeddings, RMSNorms, rotary embedding, the
seven linears of each layer, whatever quantized modules a recipe installed, ``lm_head``) but owns
the loop, the KV cache and the attention calls, so the decode step is a fixed-shape function
that is captured once per batch size in a CUDA graph (no Python or launch overhead per token).

Batched requests of different lengths: prompts are right-padded into one ``[B, S]`` prefill
(causal attention means a real token never sees the padding after it); each request then decodes
at its own position ``pos[b]`` (writes go to slot ``pos[b]``, attention sees keys ``<= pos[b]``),
so stale padding slots are overwritten before they are ever attended to.

KV cache backends (chosen from the recipe record ``model.lowbit_recipe``, or ``kv=``):

- ``None``: a static cache in the model's dtype, ``[B, Hkv, S_max, D]`` per layer; decode
  attention is ``F.scaled_dot_product_attention`` with the G = Hq/Hkv query heads of one KV head
  as G query rows (no K/V copy for GQA) and a per-request length mask;
- ``'kv4'`` / ``'kv4-zp'``: the paged INT4 cache of ``lowbit.ops.kv4`` (FireQ / QServe layout:
  codes ``uint8 [pages, Hkv, PAGE, D/2]``, one scale per token per head, page table ``int32
  [B, pages_per_seq]``), written with ``kv4_append`` (post-RoPE keys, CRS scales applied there)
  and read with the split-KV ``decode_kv4`` kernel (CRS inverse on Q inside).

Prefill attention: ``lowbit.attention(q, k, v, scheme=..., causal=True)`` with the recipe's
prefill scheme ('fp8', 'int8', ... or 'sdpa'), on post-RoPE Q/K/V in the model dtype; only the
last real token of each request goes through ``lm_head`` (serving convention).

CPU: the same code runs eagerly (no graphs); kernels run under the Triton interpreter or fall
back to their references, so tests compare the runner's greedy tokens with ``model.generate``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Generator", "generate"]


@dataclass
class _Arch:
    embed: nn.Module
    layers: list
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module
    hq: int
    hkv: int
    d: int
    interleaved: bool


def _arch(model) -> _Arch:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise ValueError(f"Generator supports Llama-family *ForCausalLM models, got {type(model).__name__}")
    cfg = model.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return _Arch(inner.embed_tokens, list(inner.layers), inner.norm, inner.rotary_emb, model.lm_head, hq, hkv, d,
                 bool(getattr(cfg, "rope_interleave", False)))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [B, H, S, D], cos/sin [B, S, D] (HF layout: the half pattern repeated)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin



# ------------------------------------------------------------------------------ fusion
def _fuse_rows(mods):
    """One module computing ``cat([m(x) for m in mods], -1)``, or None when the modules cannot be
    stacked exactly. ``nn.Linear``: weights concatenated. ``QuantLinear``: same class, same
    ``config()`` (e.g. the same PTS exponent), every buffer either row-major (dim 0 = that
    module's out_features: concatenated) or identical across modules (shared, e.g. a table);
    the fused module comes from ``cls.empty``. The originals' tensors become views of the fused
    ones, so no memory is duplicated and the transformers path keeps working."""
    from lowbit.nn.base import QuantLinear

    if all(type(m) is nn.Linear for m in mods):
        if len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in mods}) != 1:
            return None
        w = torch.cat([m.weight.detach() for m in mods], 0)
        f = nn.Linear(mods[0].in_features, w.shape[0], bias=mods[0].bias is not None, device=w.device,
                      dtype=w.dtype)
        f.weight = nn.Parameter(w, requires_grad=False)
        if f.bias is not None:
            f.bias = nn.Parameter(torch.cat([m.bias.detach() for m in mods], 0), requires_grad=False)
        a = 0
        for m in mods:
            b = a + m.out_features
            m.weight = nn.Parameter(f.weight[a:b], requires_grad=False)
            if f.bias is not None:
                m.bias = nn.Parameter(f.bias[a:b], requires_grad=False)
            a = b
        return f
    cls = type(mods[0])
    if not isinstance(mods[0], QuantLinear) or any(type(m) is not cls for m in mods):
        return None
    try:
        cfgs = [m.config() for m in mods]
    except NotImplementedError:
        return None
    m0 = mods[0]
    if any(c != cfgs[0] for c in cfgs) or len({(m.in_features, m.dtype) for m in mods}) != 1:
        return None
    names = [n for n, _ in m0.named_buffers(recurse=False)]
    plan = {}
    for n in names:
        ts = [dict(m.named_buffers(recurse=False)).get(n) for m in mods]
        if any(t is None for t in ts):
            return None
        if all(t.ndim >= 1 and t.shape[0] == m.out_features and t.shape[1:] == ts[0].shape[1:]
               for t, m in zip(ts, mods)):
            plan[n] = ("rows", torch.cat(ts, 0))
        elif all(t.shape == ts[0].shape and torch.equal(t, ts[0]) for t in ts):
            plan[n] = ("shared", ts[0])
        else:
            return None
    out = sum(m.out_features for m in mods)
    try:
        f = cls.empty(m0.in_features, out, "bias" in plan, m0.dtype, **cfgs[0])
    except Exception:
        return None
    fb = dict(f.named_buffers(recurse=False))
    if set(fb) != set(plan):
        return None
    for n, (_, t) in plan.items():
        if fb[n].shape != t.shape or fb[n].dtype != t.dtype:
            return None
    f = f.to(plan[names[0]][1].device)
    for n, (_, t) in plan.items():
        f._buffers[n] = t
    a = 0
    for m in mods:
        b = a + m.out_features
        for n, (kind, t) in plan.items():
            if kind == "rows":
                m._buffers[n] = t[a:b]
        a = b
    return f


class _FusedLayer:
    """Per-layer fused projections for the runner (qkv, gate_up), None where not fusable."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.split = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features) \
            if self.qkv is not None else None
        self.gate_up = None
        if all(hasattr(mlp, r) for r in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            self.gate_up = _fuse_rows([mlp.gate_proj, mlp.up_proj])
            self.inter = mlp.gate_proj.out_features
            self.act, self.down = mlp.act_fn, mlp.down_proj

# ---------------------------------------------------------------------------- KV backends
class DenseKV:
    """Static float cache, one ``[B, Hkv, S_max, D]`` K and V per layer."""

    name = "dense"
    rope_in_append = False

    def __init__(self, n_layers, batch, hkv, smax, d, dtype, device):
        smax = -(-smax // 64) * 64  # aligned key length: SDPA's memory-efficient kernel takes the mask
        self.k = [torch.zeros(batch, hkv, smax, d, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.smax = smax
        self.keys_pos = torch.arange(smax, device=device)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write_prefill(self, layer, k, v, lengths, cos=None, sin=None):
        S = k.shape[2]
        self.k[layer][: k.shape[0], :, :S] = k
        self.v[layer][: v.shape[0], :, :S] = v

    def decode(self, layer, q, k, v, pos, rows, cos=None, sin=None):
        """q [B, Hq, 1, D], k/v [B, Hkv, 1, D] post-RoPE; writes slot pos[b] then attends."""
        B, Hq, _, D = q.shape
        kc, vc = self.k[layer][:B], self.v[layer][:B]
        kc[rows, :, pos] = k[:, :, 0]
        vc[rows, :, pos] = v[:, :, 0]
        hkv = kc.shape[1]
        qg = q.view(B, hkv, Hq // hkv, D)
        mask = (self.keys_pos.view(1, 1, 1, -1) <= pos.view(B, 1, 1, 1))
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask)
        return o.reshape(B, Hq, 1, D)


class PagedKV4:
    """Paged INT4 cache through ``lowbit.ops.kv4`` (see module docstring). Request b owns pages
    ``[b * P, (b + 1) * P)``; ``lengths`` counts cached tokens including the new one."""

    name = "kv4"

    def __init__(self, n_layers, batch, hkv, smax, d, dtype, device, *, zero_point=False, page=64, crs=None,
                 scale_dtype=torch.float8_e4m3fn):
        from lowbit.ops import kv4 as kv4ops  # noqa: F401  (fails early with ImportError)

        self.ops = kv4ops
        self.page = page
        self.pages_per_seq = math.ceil(smax / page)
        self.smax = self.pages_per_seq * page
        n_pages = batch * self.pages_per_seq
        self.zero_point = zero_point

        def alloc():
            codes = torch.zeros(n_pages, hkv, page, d // 2, dtype=torch.uint8, device=device)
            scale = torch.zeros(n_pages, hkv, page, dtype=scale_dtype, device=device)
            zero = torch.zeros(n_pages, hkv, page, dtype=torch.uint8, device=device) if zero_point else None
            return codes, scale, zero

        self.kc, self.ks, self.kz, self.vc, self.vs, self.vz = [], [], [], [], [], []
        for _ in range(n_layers):
            c, s, z = alloc()
            self.kc.append(c), self.ks.append(s), self.kz.append(z)
            c, s, z = alloc()
            self.vc.append(c), self.vs.append(s), self.vz.append(z)
        self.page_table = torch.arange(n_pages, device=device, dtype=torch.int32).view(batch, self.pages_per_seq)
        # per layer CRS: (crs_k [Hkv, D] multiplies post-RoPE K, crs_q = 1 / crs_k for Q) or None
        self.crs = crs or [None] * n_layers

    def bytes(self) -> int:
        ts = [t for t in self.kc + self.ks + self.kz + self.vc + self.vs + self.vz if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def _cache_kw(self, layer):
        kw = dict(k_codes=self.kc[layer], k_scale=self.ks[layer], v_codes=self.vc[layer], v_scale=self.vs[layer])
        if self.zero_point:
            kw.update(k_zero=self.kz[layer], v_zero=self.vz[layer])
        return kw

    rope_in_append = True  # keys arrive pre-RoPE; kv4_append rotates them in fp32 (as the HF path)

    def write_prefill(self, layer, k, v, lengths, cos=None, sin=None):
        B = k.shape[0]
        start = torch.zeros(B, dtype=torch.int32, device=k.device)
        crs = self.crs[layer]
        self.ops.kv4_append(k, v, page_table=self.page_table[:B], start=start, cos=cos, sin=sin,
                            crs_k=None if crs is None else crs[0], **self._cache_kw(layer))

    def read_prefill(self, layer, q, S):
        """(q, k, v) for prefill attention from the cache itself: K/V dequantized from INT4 (CRS-scaled
        keys, so q gets the CRS inverse), i.e. what ``install_quantized_attention``'s HF path attends."""
        from lowbit.formats.kv4 import dequantize_kv4

        B = q.shape[0]
        pt = self.page_table[:B].long()

        def gather(codes, scale, zero):
            c = codes[pt].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :S]
            s_ = scale[pt].permute(0, 2, 1, 3).flatten(2, 3)[:, :, :S]
            z = None if zero is None else zero[pt].permute(0, 2, 1, 3).flatten(2, 3)[:, :, :S]
            return dequantize_kv4(c, s_, z, dtype=q.dtype)

        k = gather(self.kc[layer], self.ks[layer], self.kz[layer])
        v = gather(self.vc[layer], self.vs[layer], self.vz[layer])
        crs = self.crs[layer]
        if crs is not None:
            G = q.shape[1] // crs[1].shape[0]
            q = (q.float() * crs[1].repeat_interleave(G, 0)[None, :, None, :]).to(q.dtype)
        return q, k, v

    def decode(self, layer, q, k, v, pos, rows, cos=None, sin=None):
        B = q.shape[0]
        crs = self.crs[layer]
        self.ops.kv4_append(k, v, page_table=self.page_table[:B], start=pos.to(torch.int32), cos=cos, sin=sin,
                            crs_k=None if crs is None else crs[0], **self._cache_kw(layer))
        lengths = (pos + 1).to(torch.int32)
        return self.ops.decode_kv4(q, page_table=self.page_table[:B], lengths=lengths, max_len=self.smax,
                                   crs_q=None if crs is None else crs[1], **self._cache_kw(layer))


def _attn_configs(layers):
    """The per-layer config ``install_quantized_attention`` left on each ``self_attn`` (or None)."""
    return [getattr(layer.self_attn, "_lowbit", None) for layer in layers]


def _crs(cfgs, device):
    """Per-layer (crs_k, crs_q) fp32 ``[Hkv, D]`` from the installed attention, or None each."""
    out = []
    for c in cfgs:
        k = getattr(c, "crs_k", None) if c is not None else None
        out.append(None if k is None else (k.to(device, torch.float32), 1.0 / k.to(device, torch.float32)))
    return out if any(o is not None for o in out) else None


# ---------------------------------------------------------------------------------- runner
class Generator:
    """Prefill + CUDA-graph decode over a static or paged INT4 cache (module docstring).

    ``kv``: 'auto' (from ``model.lowbit_recipe``), None, 'kv4' or 'kv4-zp'. ``prefill``: 'auto'
    (the recipe's attention scheme, else 'sdpa') or a scheme name. ``layers``: run only the first
    ``layers`` decoder layers (benchmarks of trimmed models). ``cuda_graphs``: default True on CUDA.
    ``fuse``: run q/k/v as one projection and gate/up as one where the modules stack exactly
    (``_fuse_rows``; the original modules then share the fused storage).
    ``prefill_from_cache``: with an INT4 cache, prefill attends the K/V dequantized from the cache
    (the semantics of ``install_quantized_attention``'s transformers path and of perplexity with a
    KV4 cache) instead of the fresh float K/V (default; FireQ App. D prefills from unquantized
    (FP8) K/V and it saves a dequantization pass).
    """

    def __init__(self, model, *, max_batch: int, max_seq: int, kv="auto", prefill="auto",
                 cuda_graphs: bool | None = None, page_size: int = 64, layers: int | None = None,
                 prefill_from_cache: bool = False, fuse: bool = True):
        self.model = model
        self.a = _arch(model)
        if layers is not None:
            self.a.layers = self.a.layers[:layers]
        p = next(model.parameters())
        self.device, self.dtype = p.device, self.a.embed.weight.dtype
        info = getattr(model, "lowbit_recipe", None) or {}
        cfgs = _attn_configs(self.a.layers)
        installed = cfgs[0] if cfgs else None
        if kv == "auto":
            kv = installed.kv if installed is not None else info.get("kv")
        self.kv = None if kv == "bf16" else kv
        if self.kv not in (None, "kv4", "kv4-zp"):
            raise ValueError(f"kv must be 'auto', None, 'bf16', 'kv4' or 'kv4-zp', got {kv!r}")
        if prefill == "auto":
            scheme = installed.prefill if installed is not None else info.get("attention")
        else:
            scheme = prefill
        self.prefill_scheme = scheme or "sdpa"
        if self.prefill_scheme == "fp8-kv4":
            self.prefill_scheme = "fp8"  # the cache is empty before prefill: same math on fresh K/V
        self.max_batch, self.max_seq = int(max_batch), int(max_seq)
        if self.max_batch < 1 or self.max_seq < 2:
            raise ValueError("max_batch must be >= 1 and max_seq >= 2")
        n = len(self.a.layers)
        if self.kv is None:
            self.cache = DenseKV(n, self.max_batch, self.a.hkv, self.max_seq, self.a.d, self.dtype, self.device)
        else:
            crs = _crs(cfgs, self.device)
            self.cache = PagedKV4(n, self.max_batch, self.a.hkv, self.max_seq, self.a.d, self.dtype, self.device,
                                  zero_point=self.kv == "kv4-zp", page=page_size, crs=crs)
        self.prefill_from_cache = bool(prefill_from_cache) and self.kv is not None
        self.fused = [_FusedLayer(layer) if fuse else None for layer in self.a.layers]
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        self._graphs: dict[int, tuple] = {}
        self.rows = torch.arange(self.max_batch, device=self.device)
        self.sm_scale = self.a.d ** -0.5

    # -------------------------------------------------------------------------- pieces
    def _qkv(self, i, layer, h, pos_ids):
        attn = layer.self_attn
        B, S, _ = h.shape
        fz = self.fused[i]
        if fz is not None and fz.qkv is not None:
            q, k, v = fz.qkv(h).split(fz.split, dim=-1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q = q.reshape(B, S, -1, self.a.d).transpose(1, 2)
        k = k.reshape(B, S, -1, self.a.d).transpose(1, 2)
        v = v.reshape(B, S, -1, self.a.d).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.a.rotary(v, pos_ids)
        q = _rope(q, cos, sin, self.a.interleaved)
        if not self.cache.rope_in_append:
            k = _rope(k, cos, sin, self.a.interleaved)
        return q, k, v, cos, sin

    def _finish(self, i, layer, x, o):
        B, S = x.shape[:2]
        x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        h = layer.post_attention_layernorm(x)
        fz = self.fused[i]
        if fz is not None and fz.gate_up is not None:
            g, u = fz.gate_up(h).split(fz.inter, dim=-1)
            return x + fz.down(fz.act(g) * u)
        return x + layer.mlp(h)

    def _logits(self, h):
        return self.a.lm_head(self.a.norm(h)).float()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """ids ``[B, S]`` right-padded, lengths ``[B]``; fills the cache; logits ``[B, V]`` (fp32)
        of each request's last real token."""
        import lowbit

        B, S = ids.shape
        if B > self.max_batch or S > self.max_seq:
            raise ValueError(f"prefill of [{B}, {S}] exceeds max_batch={self.max_batch} / max_seq={self.max_seq}")
        ids = ids.to(self.device)
        lengths = lengths.to(self.device)
        pos_ids = torch.arange(S, device=self.device).expand(B, S)
        # padding rows are zeroed before attention: schemes with per-block scales (INT8 V, block
        # FP8) must not see them, and zeros never raise an absmax
        pad = None
        if int(lengths.min()) < S:
            pad = (pos_ids < lengths[:, None]).to(self.dtype)[:, None, :, None]
        x = self.a.embed(ids)
        for i, layer in enumerate(self.a.layers):
            q, k, v, cos, sin = self._qkv(i, layer, layer.input_layernorm(x), pos_ids)
            self.cache.write_prefill(i, k, v, lengths, cos, sin)
            if self.prefill_from_cache:
                q, k, v = self.cache.read_prefill(i, q, S)
            elif self.cache.rope_in_append:
                k = _rope(k, cos, sin, self.a.interleaved)
            if pad is not None:
                q, k, v = q * pad, k * pad, v * pad
            o = lowbit.attention(q, k, v, scheme=self.prefill_scheme, causal=True, sm_scale=self.sm_scale)
            x = self._finish(i, layer, x, o)
        last = x[self.rows[:B], lengths - 1]
        return self._logits(last)

    def _step(self, tokens, pos):
        B = tokens.shape[0]
        rows = self.rows[:B]
        x = self.a.embed(tokens.view(B, 1))
        pos_ids = pos.view(B, 1)
        for i, layer in enumerate(self.a.layers):
            q, k, v, cos, sin = self._qkv(i, layer, layer.input_layernorm(x), pos_ids)
            o = self.cache.decode(i, q, k, v, pos, rows, cos, sin)
            x = self._finish(i, layer, x, o)
        return self._logits(x[:, 0])

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One token per request: tokens ``[B]`` at positions ``pos [B]`` -> logits ``[B, V]``."""
        B = tokens.shape[0]
        if not self.cuda_graphs:
            return self._step(tokens.to(self.device), pos.to(self.device))
        g = self._graphs.get(B) or self._capture(B)
        graph, t_buf, p_buf, out = g
        t_buf.copy_(tokens)
        p_buf.copy_(pos)
        graph.replay()
        return out

    def _capture(self, B: int):
        t_buf = torch.zeros(B, dtype=torch.long, device=self.device)
        # warm-up steps really run: point them at the last cache slot, which holds no prompt token
        # yet (a later step at that position overwrites it before attending to it)
        p_buf = torch.full((B,), self.max_seq - 1, dtype=torch.long, device=self.device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up: compile / autotune outside the capture
                self._step(t_buf, p_buf)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(t_buf, p_buf)
        self._graphs[B] = (graph, t_buf, p_buf, out)
        return self._graphs[B]

    # ------------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 32, *, eos_token_id: int | None = None):
        """Greedy decoding of a batch of 1-D token tensors (any lengths); returns the new tokens of
        each request (cut after ``eos_token_id`` when given)."""
        if isinstance(prompts, torch.Tensor):
            prompts = list(prompts) if prompts.ndim == 2 else [prompts]
        if not prompts:
            raise ValueError("prompts must hold at least one sequence")
        lens = [int(p.numel()) for p in prompts]
        if min(lens) < 1:
            raise ValueError("every prompt needs at least one token")
        if max(lens) + max_new_tokens > self.max_seq:
            raise ValueError(f"prompt length {max(lens)} + max_new_tokens {max_new_tokens} exceeds max_seq "
                             f"{self.max_seq}")
        B = len(prompts)
        ids = torch.zeros(B, max(lens), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : lens[b]] = p.reshape(-1).cpu()
        lengths = torch.tensor(lens, device=self.device)
        logits = self.prefill(ids, lengths)
        tok = logits.argmax(-1)
        out = [tok]
        pos = lengths.clone()
        for _ in range(max_new_tokens - 1):
            logits = self.decode(tok, pos)
            tok = logits.argmax(-1)
            out.append(tok)
            pos = pos + 1
        new = torch.stack(out, 1).cpu()
        res = []
        for b in range(B):
            t = new[b]
            if eos_token_id is not None:
                hit = (t == eos_token_id).nonzero()
                if hit.numel():
                    t = t[: int(hit[0]) + 1]
            res.append(t)
        return res


def generate(model, prompts, max_new_tokens: int = 32, *, eos_token_id: int | None = None, **options):
    """One-shot helper: build a ``Generator`` sized for ``prompts`` and decode greedily."""
    if isinstance(prompts, torch.Tensor):
        prompts = list(prompts) if prompts.ndim == 2 else [prompts]
    smax = max(int(p.numel()) for p in prompts) + max_new_tokens
    g = Generator(model, max_batch=len(prompts), max_seq=smax, **options)
    return g.generate(prompts, max_new_tokens, eos_token_id=eos_token_id)
