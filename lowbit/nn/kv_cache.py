"""PagedKVCache: one paged KV cache for all layers, three numerics.

Numerics (``numerics=``):

- ``'kv4'``    FireQ: post-RoPE symmetric INT4 K/V per token per head, FP8 E4M3 scales (BF16 or
  FP32 by ``scale_dtype``), CRS applied to K after RoPE (FireQ §1.6-1.9).
- ``'kv4-zp'`` QServe KV4: the same bytes plus a uint8 zero point per token per head
  (asymmetric INT4, ``lowbit.formats.kv4``).
- ``'bf16'``   unquantized paged baseline (post-RoPE K/V in ``dtype``).

Layout (per layer; ``PAGE`` tokens per page, pages shared by K and V and by all layers)::

    kv4/kv4-zp: k_codes, v_codes uint8 [num_pages, Hkv, PAGE, D/2]; k_scale, v_scale
                [num_pages, Hkv, PAGE]; (kv4-zp) k_zero, v_zero uint8 [num_pages, Hkv, PAGE]
    bf16:       k, v [num_pages, Hkv, PAGE, D]
    page_table  int32 [max_batch, max_pages]   logical page i of sequence b -> physical page
    lengths     int32 [batch]                  cached tokens per sequence (device copy; the
                                               host keeps its own so no step needs a sync)

A page holds the same token range of one sequence in every layer, so there is one page table
and one allocator for the whole model. Pages come from a free list and the pools grow (doubling)
when it runs out; ``release(b)`` returns a sequence's pages.

Protocol of one forward step over ``T`` new tokens per sequence: ``begin_step(T)`` (allocates
pages, returns the start positions), then per layer ``append(layer, k, v, cos=, sin=, crs_k=)``
and ``decode(layer, q, ...)`` (1-16 new tokens) or ``dequantize(layer)`` (prefill). The HF
integration (``lowbit.models.hf_attention``) drives this from the attention modules.
"""
from __future__ import annotations

import torch

from lowbit._utils import FLOAT_DTYPES, check_index, check_int, check_same_device, check_tensor
from lowbit.formats.common import FP8_E4M3
from lowbit.formats.kv4 import SCALE_DTYPES, dequantize_kv4

NUMERICS = ("kv4", "kv4-zp", "bf16")


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, numerics: str = "kv4",
                 batch_size: int = 1, page_size: int = 64, num_pages: int | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 scale_dtype: torch.dtype = FP8_E4M3, interleaved: bool = False):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        check_int(num_layers, "num_layers", 1)
        check_int(num_kv_heads, "num_kv_heads", 1)
        check_int(head_dim, "head_dim", 2)
        check_int(batch_size, "batch_size")
        check_int(num_pages or 0, "num_pages")  # None / 0: 4 per sequence
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 16, got {page_size}")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even, got {head_dim}")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.numerics, self.page_size = numerics, page_size
        self.device, self.dtype, self.scale_dtype = torch.device(device), dtype, scale_dtype
        self.interleaved = interleaved
        self.num_pages = 0
        self.pools: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self._free: list[int] = []
        self._grow(num_pages or max(1, 4 * batch_size))
        self.reset(batch_size)

    # ---- allocation -------------------------------------------------------------------------
    def _pool_shapes(self, n: int) -> dict:
        H, P, D = self.num_kv_heads, self.page_size, self.head_dim
        if self.numerics == "bf16":
            return {"k": ((n, H, P, D), self.dtype), "v": ((n, H, P, D), self.dtype)}
        shapes = {"k_codes": ((n, H, P, D // 2), torch.uint8), "v_codes": ((n, H, P, D // 2), torch.uint8),
                  "k_scale": ((n, H, P), self.scale_dtype), "v_scale": ((n, H, P), self.scale_dtype)}
        if self.numerics == "kv4-zp":
            shapes.update(k_zero=((n, H, P), torch.uint8), v_zero=((n, H, P), torch.uint8))
        return shapes

    def _grow(self, new_total: int) -> None:
        old = self.num_pages
        if new_total <= old:
            return
        for layer in self.pools:
            for name, (shape, dt) in self._pool_shapes(new_total).items():
                t = torch.zeros(shape, dtype=dt, device=self.device)
                if old:
                    t[:old] = layer[name]
                layer[name] = t
        self._free.extend(range(old, new_total))
        self.num_pages = new_total

    def reset(self, batch_size: int) -> None:
        """Drop every sequence and start ``batch_size`` empty ones."""
        self._free = list(range(self.num_pages))
        self.batch_size = batch_size
        self._pages: list[list[int]] = [[] for _ in range(batch_size)]
        self.host_lengths = [0] * batch_size
        self.page_table = torch.zeros(batch_size, 1, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        self.start = self.lengths.clone()
        self._step_tokens = 0

    def release(self, b: int) -> None:
        """Return sequence ``b``'s pages to the free list (its length becomes 0)."""
        b = check_index(b, self.batch_size, "b")
        self._free.extend(self._pages[b])
        self._pages[b] = []
        self.host_lengths[b] = 0
        self.lengths[b] = 0

    def begin_step(self, num_tokens: int) -> torch.Tensor:
        """Reserve room for ``num_tokens`` new tokens in every sequence; returns ``start`` (int32
        [B], positions of the first new token) and advances ``lengths``."""
        num_tokens = check_int(num_tokens, "num_tokens")  # (a negative count shrank every length)
        P = self.page_size
        need = [-(-(L + num_tokens) // P) - len(pg) for L, pg in zip(self.host_lengths, self._pages)]
        total = sum(max(0, n) for n in need)
        if total > len(self._free):
            self._grow(max(2 * self.num_pages, self.num_pages + total - len(self._free)))
        for b, n in enumerate(need):
            for _ in range(max(0, n)):
                self._pages[b].append(self._free.pop(0))
        width = max(1, max((len(pg) for pg in self._pages), default=0))
        table = [pg + [0] * (width - len(pg)) for pg in self._pages]
        self.page_table = torch.tensor(table, dtype=torch.int32).reshape(len(table), width).to(self.device)
        self.start = torch.tensor(self.host_lengths, dtype=torch.int32).to(self.device)
        self.host_lengths = [L + num_tokens for L in self.host_lengths]
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.int32).to(self.device)
        self._step_tokens = num_tokens
        return self.start

    @property
    def max_length(self) -> int:
        return max(self.host_lengths) if self.host_lengths else 0

    # ---- per-layer operations ---------------------------------------------------------------
    def _pool(self, layer: int) -> dict[str, torch.Tensor]:
        return self.pools[check_index(layer, self.num_layers, "layer")]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, cos=None, sin=None, crs_k=None) -> None:
        """Write the step's new tokens ``k``/``v`` ``[B, Hkv, T, D]`` (k pre-RoPE when cos/sin are
        given; CRS ``crs_k [Hkv, D]`` after RoPE) of ``layer``. Call ``begin_step(T)`` first."""
        from lowbit.ops import kv4 as ops

        pool = self._pool(layer)
        check_tensor(k, "k", dtype=FLOAT_DTYPES, ndim=4)
        if k.shape[2] != self._step_tokens or k.shape[0] != self.batch_size:
            raise ValueError(f"append got k of shape {list(k.shape)}; begin_step({k.shape[2]}) for a batch of "
                             f"{self.batch_size} must come first (last step: {self._step_tokens} tokens)")
        if self.numerics == "bf16":  # (the kv4 op checks its own arguments)
            check_tensor(k, "k", shape=[self.batch_size, self.num_kv_heads, k.shape[2], self.head_dim])
            check_tensor(v, "v", dtype=FLOAT_DTYPES, shape=list(k.shape))
            check_same_device(k=k, v=v, cache=pool["k"])
            kf = ops.rope_ref(k, cos, sin, interleaved=self.interleaved) if cos is not None else k.float()
            if crs_k is not None:
                kf = kf * crs_k.float()[None, :, None, :]
            page, off = ops._slots(self.page_table, self.start, k.shape[2], self.page_size)
            B, H, T, _ = k.shape
            pi = page[:, None, :].expand(B, H, T)
            hi = torch.arange(H, device=k.device)[None, :, None].expand(B, H, T)
            oi = off[:, None, :].expand(B, H, T)
            pool["k"][pi, hi, oi] = kf.to(self.dtype)
            pool["v"][pi, hi, oi] = v.to(self.dtype)
            return
        ops.kv4_append(k, v, pool["k_codes"], pool["k_scale"], pool["v_codes"], pool["v_scale"],
                       self.page_table, self.start, cos=cos, sin=sin, crs_k=crs_k,
                       k_zero=pool.get("k_zero"), v_zero=pool.get("v_zero"), interleaved=self.interleaved)

    def dequantize(self, layer: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of every sequence as ``[B, Hkv, max_length, D]`` in ``dtype`` (positions past a
        sequence's length are zeros)."""
        dtype = dtype or self.dtype
        pool = self._pool(layer)
        L, P = self.max_length, self.page_size
        pos = torch.arange(L, device=self.device)
        page = self.page_table.long()[:, pos // P]  # [B, L]
        off = (pos % P).expand_as(page)
        valid = (pos[None, :] < self.lengths.long()[:, None])[:, None, :, None]
        outs = []
        for side in ("k", "v"):
            if self.numerics == "bf16":
                x = pool[side][page, :, off].to(dtype)  # [B, L, H, D]
            else:
                z = pool.get(f"{side}_zero")
                x = dequantize_kv4(pool[f"{side}_codes"][page, :, off], pool[f"{side}_scale"][page, :, off],
                                   z[page, :, off] if z is not None else None, dtype=dtype)
            outs.append(torch.where(valid, x.transpose(1, 2), torch.zeros((), dtype=dtype, device=self.device)))
        return outs[0], outs[1]

    def decode(self, layer: int, q: torch.Tensor, *, crs_q=None, sm_scale=None) -> torch.Tensor:
        """Attention of the step's queries ``q [B, Hq, T, D]`` (post-RoPE, T <= 16, causal among
        them) over everything cached for ``layer``. Returns q's shape and dtype."""
        pool = self._pool(layer)
        if self.numerics == "bf16":  # split-KV kernel over the float pages (ragged batches too)
            from lowbit.ops.kv4 import decode_float

            if crs_q is not None:
                q = q * crs_q.to(q.dtype).repeat_interleave(q.shape[1] // self.num_kv_heads, 0)[:, None, :]
            return decode_float(q, pool["k"], pool["v"], self.page_table, self.lengths, sm_scale=sm_scale,
                                max_len=self.max_length)
        from lowbit.ops.kv4 import decode_kv4

        return decode_kv4(q, pool["k_codes"], pool["k_scale"], pool["v_codes"], pool["v_scale"], self.page_table,
                          self.lengths, k_zero=pool.get("k_zero"), v_zero=pool.get("v_zero"), crs_q=crs_q,
                          sm_scale=sm_scale, max_len=self.max_length)

    # ---- reporting --------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Stored bytes of one token over all layers and KV heads (K and V)."""
        per_page = sum(t[0].numel() * t.element_size() for t in self.pools[0].values())
        return per_page * self.num_layers // self.page_size

    def bytes(self) -> int:
        """Bytes held by the pages currently allocated to sequences (all layers, K and V, scales and
        zero points included), i.e. the cache's real footprint at this point."""
        used_pages = sum(len(pg) for pg in self._pages)
        return used_pages * self.page_size * self.bytes_per_token()

    def memory_report(self) -> dict:
        tokens = sum(self.host_lengths)
        bf16 = 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2
        return {"numerics": self.numerics, "tokens": tokens, "pages_used": sum(len(pg) for pg in self._pages),
                "pages_total": self.num_pages, "bytes_used": self.bytes(),
                "bytes_allocated": self.num_pages * self.page_size * self.bytes_per_token(),
                "bytes_per_token": self.bytes_per_token(), "bf16_bytes_per_token": bf16,
                "compression_vs_bf16": bf16 / self.bytes_per_token()}
