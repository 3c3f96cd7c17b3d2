"""Paged MLA latent cache (bf16 or SnapMLA FP8) for all layers of a model, with decode/prefill.

Per layer, a pool of ``pages`` pages of ``page_size`` tokens (64, as FlashMLA and SnapMLA):
- ``fp8=True``: content float8_e4m3fn ``[pages, page_size, Dc]``, rope bf16 ``[pages, page_size, Dr]``
  (pre-divided by the token scale), scale fp32 ``[pages, page_size]`` (644 B/token for 512 + 64);
- ``fp8=False``: one ``[pages, page_size, Dc + Dr]`` buffer in ``dtype`` (1152 B/token in bf16),
  seen as content/rope views.
One page table ``[batch, pages_per_seq]`` int32 is shared by all layers (sequence b owns pages
``page_table[b]``; ``shuffle_pages=True`` scatters them over the pool, as a real allocator would).
Lengths are tracked per layer and per sequence on the host (no device sync to plan a launch).
"""
from __future__ import annotations

import torch

from lowbit._utils import cdiv, check_index, check_int, check_tensor
from lowbit.formats.mla_fp8 import bytes_per_token
from lowbit.ops.mla import MAX_DECODE_TOKENS, mla_append, mla_decode, mla_gather, mla_prefill


class PagedMLACache:
    def __init__(self, num_layers: int, batch: int, max_len: int, kv_lora_rank: int = 512, rope_dim: int = 64, *,
                 fp8: bool = True, page_size: int = 64, dtype: torch.dtype = torch.bfloat16, device=None,
                 shuffle_pages: bool = False, seed: int = 0):
        if num_layers < 1 or batch < 1 or max_len < 1:
            raise ValueError(f"num_layers, batch and max_len must be >= 1, got {num_layers}, {batch}, {max_len}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        check_int(kv_lora_rank, "kv_lora_rank", 1)
        check_int(rope_dim, "rope_dim")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
        device = torch.device(device or "cpu")
        self.num_layers, self.batch, self.max_len = num_layers, batch, max_len
        self.kv_lora_rank, self.rope_dim, self.page_size = kv_lora_rank, rope_dim, page_size
        self.fp8, self.dtype, self.device = fp8, dtype, device
        self.pages_per_seq = cdiv(max_len, page_size)
        n_pages = batch * self.pages_per_seq
        order = torch.arange(n_pages)
        if shuffle_pages:
            order = order[torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))]
        self.page_table = order.view(batch, self.pages_per_seq).to(torch.int32).to(device)
        self.layers = []
        for _ in range(num_layers):
            if fp8:
                self.layers.append((
                    torch.zeros(n_pages, page_size, kv_lora_rank, device=device, dtype=torch.float8_e4m3fn),
                    torch.zeros(n_pages, page_size, rope_dim, device=device, dtype=torch.bfloat16),
                    torch.zeros(n_pages, page_size, device=device, dtype=torch.float32)))
            else:
                buf = torch.zeros(n_pages, page_size, kv_lora_rank + rope_dim, device=device, dtype=dtype)
                self.layers.append((buf[..., :kv_lora_rank], buf[..., kv_lora_rank:], None))
        self.lengths = [[0] * batch for _ in range(num_layers)]
        self._seq_lens = [None] * num_layers

    # --- bookkeeping -----------------------------------------------------------------------
    def reset(self) -> None:
        self.lengths = [[0] * self.batch for _ in range(self.num_layers)]
        self._seq_lens = [None] * self.num_layers

    def seq_lens(self, layer: int) -> torch.Tensor:
        layer = check_index(layer, self.num_layers, "layer")
        if self._seq_lens[layer] is None:
            self._seq_lens[layer] = torch.tensor(self.lengths[layer], dtype=torch.int32, device=self.device)
        return self._seq_lens[layer]

    def bytes_per_token(self) -> int:
        """Bytes per cached token per layer (644 for FP8 512 + 64, 1152 for bf16)."""
        if self.fp8:
            return bytes_per_token(self.kv_lora_rank, self.rope_dim, True)
        return (self.kv_lora_rank + self.rope_dim) * torch.tensor([], dtype=self.dtype).element_size()

    # --- data path ---------------------------------------------------------------------------
    def append(self, layer: int, kv: torch.Tensor) -> None:
        """Append ``kv [B, S, Dc + Dr]`` (latent after its norm, RoPE key rotated) to every sequence."""
        layer = check_index(layer, self.num_layers, "layer")
        B, S, D = check_tensor(kv, "kv", ndim=3).shape
        if B != self.batch:
            raise ValueError(f"kv batch {B} != cache batch {self.batch}")
        lens = self.lengths[layer]
        if max(lens) + S > self.max_len:
            raise ValueError(f"cache full: {max(lens)} + {S} tokens > max_len {self.max_len}")
        pos = torch.tensor(lens, dtype=torch.int64).view(B, 1) + torch.arange(S).view(1, S)
        pt = self.page_table.cpu().long()
        slots = pt.gather(1, pos // self.page_size) * self.page_size + pos % self.page_size
        mla_append(kv.reshape(B * S, D), self.layers[layer], slots.reshape(-1).to(self.device))
        self.lengths[layer] = [n + S for n in lens]
        self._seq_lens[layer] = None

    def attend(self, layer: int, q: torch.Tensor, *, sm_scale: float | None = None) -> torch.Tensor:
        """Attention of ``q [B, S, H, Dc + Dr]`` (the last S cached tokens) over the cache: the decode
        kernel for S <= 4 (MTP), the fetch-dequant prefill path otherwise. Returns ``[B, S, H, Dc]``."""
        layer = check_index(layer, self.num_layers, "layer")
        S = check_tensor(q, "q", ndim=4).shape[1]
        mx = max(self.lengths[layer])
        if S <= MAX_DECODE_TOKENS:
            qd = q if (self.fp8 or q.dtype == self.dtype) else q.to(self.dtype)
            return mla_decode(qd, self.layers[layer], self.page_table, self.seq_lens(layer), sm_scale=sm_scale,
                              max_seq_len=mx).to(q.dtype)
        return mla_prefill(q, self.layers[layer], self.page_table, self.seq_lens(layer), sm_scale=sm_scale,
                           max_seq_len=mx)

    def gather(self, layer: int, dtype=torch.bfloat16) -> torch.Tensor:
        """Dequantized latents ``[B, max_len_now, Dc + Dr]`` (Fused-Fetch-Dequant)."""
        layer = check_index(layer, self.num_layers, "layer")
        return mla_gather(self.layers[layer], self.page_table, self.seq_lens(layer), max(self.lengths[layer]), dtype=dtype)
