"""MLA ops over a paged latent cache, bf16 or SnapMLA FP8: decode, append, query quant, fetch-dequant.

Cache (one layer) = ``(content, rope, scale)``:
- bf16/fp16 cache: ``content [P, PAGE, Dc]`` and ``rope [P, PAGE, Dr]`` (usually two views of one
  ``[P, PAGE, Dc + Dr]`` buffer: 1152 bytes per token for DeepSeek-V3), ``scale`` None;
- FP8 cache (``lowbit.formats.mla_fp8``): ``content`` float8_e4m3fn ``[P, PAGE, Dc]``, ``rope`` bf16
  ``[P, PAGE, Dr]`` pre-divided by the token scale, ``scale`` fp32 ``[P, PAGE]`` (644 bytes per token).
``page_table [B, max_pages]`` int32 maps a sequence's page i to a pool page; ``seq_lens [B]`` int32
counts its cached tokens (including the query tokens being decoded, which must be appended first).

Public functions: ``mla_decode`` (1-4 query tokens, MTP, causal among them), ``mla_append``
(Fused-K-Append), ``mla_quantize_q`` (Fused-Q-Quant), ``mla_gather`` (Fused-Fetch-Dequant) and
``mla_prefill`` (prefill / chunked prefill on the fetch-dequantized latents). ``mla_decode_ref`` is
the float64 reference every kernel test compares to; with ``p_block`` it also emulates the FP8
kernel's per-block P re-quantization (same block and split plan), i.e. the same numerics.
"""
from __future__ import annotations

import math

import torch

from lowbit._utils import (by_batch, check_indices, check_int, check_page_reads, check_same_device, check_sm_scale,
                           check_tensor, run_op, use_triton, warn_once)
from lowbit.formats.mla_fp8 import P_SCALE_HEADROOM, dequantize_latent, quantize_latent, quantize_q

__all__ = ["mla_decode", "mla_append", "mla_quantize_q", "mla_gather", "mla_prefill", "mla_decode_ref",
           "MAX_DECODE_TOKENS"]

MAX_DECODE_TOKENS = 4
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _kernel_ok(dc: int, dr: int, what: str) -> bool:
    if _pow2(dc) and _pow2(dr):
        return True
    warn_once(f"{what}: Triton kernel needs power-of-two latent ({dc}) and RoPE ({dr}) widths >= 16; "
              "using the PyTorch reference")
    return False


def _check_cache(content, rope, scale, name="cache"):
    check_tensor(content, f"{name}[0] (content)", dtype=(torch.float8_e4m3fn,) + _FLOATS, ndim=3)
    P, page = content.shape[:2]
    if scale is None:
        if content.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{name}: an fp8 content tensor needs its per-token scale tensor (cache[2])")
        check_tensor(rope, f"{name}[1] (rope)", dtype=content.dtype, ndim=3, shape=(P, page, None))
    else:
        check_tensor(content, f"{name}[0] (content)", dtype=torch.float8_e4m3fn)
        check_tensor(rope, f"{name}[1] (rope)", dtype=torch.bfloat16, ndim=3, shape=(P, page, None))
        check_tensor(scale, f"{name}[2] (scale)", dtype=torch.float32, shape=(P, page))
    for t, n in ((content, "content"), (rope, "rope")):
        if t.stride(-1) != 1 or t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError(f"{name} {n} must be a [pages, page_size, dim] tensor with contiguous rows")
    return P, page


def _unpack_cache(cache):
    if isinstance(cache, torch.Tensor):
        raise TypeError("cache must be a tuple (content, rope, scale_or_None); see lowbit.nn.mla_cache.PagedMLACache")
    if not isinstance(cache, (tuple, list)) or len(cache) != 3:
        raise TypeError("cache must be a tuple (content, rope, scale_or_None)")
    return tuple(cache)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(0, 1)


# ----------------------------------------------------------------------------------------------
# reference (float64)


def _gather_ref(content, rope, scale, page_table, seq_lens, b: int, dtype=torch.float64):
    L = int(seq_lens[b])
    page = content.shape[1]
    idx = torch.arange(L, device=content.device)
    slots = page_table[b, idx // page].long() * page + idx % page
    c, r = _rows(content)[slots], _rows(rope)[slots]
    if scale is None:
        return torch.cat([c, r], dim=-1).to(dtype)
    return dequantize_latent(c, _rows(scale)[slots], r, dtype)


def mla_decode_ref(q, cache, page_table, seq_lens, *, sm_scale=None, p_block=None, quantize_query=None):
    """Float64 absorbed-MLA decode over the paged cache: ``q [B, Sq, H, Dc+Dr]`` -> ``[B, Sq, H, Dc]``
    float64. FP8 caches use the dequantized latents and (``quantize_query``, default True for
    them) the FP8-quantized query, exactly as the kernel sees them. ``p_block=(block_n, chunk)``
    additionally emulates the kernel's P re-quantization: per chunk of ``chunk`` tokens, per block
    of ``block_n``, the monotone block scale of ``lowbit.kernels.mla_decode`` (FP8 caches only;
    a fifth entry "block" selects its block-wide P-scale rule, default "row");
    a third entry ``tau`` > 0 emulates its lazy mode (running max moved only past ``tau`` in base 2,
    the P scale grown with the kernel's headroom), a fourth the dtype P is rounded to (fp8 e4m3;
    torch.float16 for the kernel's fp16-PV variant)."""
    content, rope, scale = _unpack_cache(cache)
    B, Sq, H, D = q.shape
    dc = content.shape[-1]
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    fp8 = scale is not None
    quantize_query = fp8 if quantize_query is None else quantize_query
    if quantize_query:
        qq = dequantize_latent(*quantize_q(q, dc), torch.float64)
    else:
        qq = q.double()
    out = torch.zeros(B, Sq, H, dc, dtype=torch.float64, device=q.device)
    for b in range(B):
        kv = _gather_ref(content, rope, scale, page_table, seq_lens, b)
        L = kv.shape[0]
        qb = qq[b].reshape(Sq * H, D)
        s = qb @ kv.T * sm_scale
        lim = (L - Sq + 1 + torch.arange(Sq * H, device=q.device) // H).unsqueeze(1)
        keep = torch.arange(L, device=q.device).unsqueeze(0) < lim
        s = s.masked_fill(~keep, float("-inf"))
        if p_block is None or not fp8:
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)
            out[b] = (p @ kv[:, :dc]).reshape(Sq, H, dc)
        else:
            tok_scale = _rows(scale)[_slots(page_table, b, L, content.shape[1])].double()
            c_hat = kv[:, :dc] / tok_scale.unsqueeze(1)  # the fp8 codes, exactly
            out[b] = _emulate_fp8_pv(s, tok_scale, c_hat, *p_block).reshape(Sq, H, dc)
    return out


def _slots(page_table, b, L, page):
    idx = torch.arange(L, device=page_table.device)
    return page_table[b, idx // page].long() * page + idx % page


def _emulate_fp8_pv(s, ks, c_hat, block_n: int, chunk: int, tau: float = 0.0, p_dtype=torch.float8_e4m3fn,
                    rule: str = "row"):
    """The kernel's online softmax with per-block FP8 P (see lowbit.kernels.mla_decode), float64
    apart from the FP8 rounding of P; splits merged by log-sum-exp. ``rule``: "row" = the P scale
    of a block is rowmax(P̃) / 448 per row; "block" = max s_k of the block / 448 (an upper bound of
    every row's P̃, ``_softmax_step_pblock``); either way made monotone."""
    R, L = s.shape
    dev = s.device
    outs, lses = [], []
    for c0 in range(0, max(L, 1), chunk):
        m = torch.full((R,), float("-inf"), dtype=torch.float64, device=dev)
        l = torch.zeros(R, dtype=torch.float64, device=dev)
        sig = torch.zeros(R, dtype=torch.float64, device=dev)
        acc = torch.zeros(R, c_hat.shape[1], dtype=torch.float64, device=dev)
        for n0 in range(c0, min(c0 + chunk, L), block_n):
            n1 = min(n0 + block_n, L, c0 + chunk)
            sb = s[:, n0:n1]
            mb = sb.max(1).values
            if tau > 0:
                m_new = torch.where(mb > m + tau * math.log(2.0), mb, m)
            else:
                m_new = torch.maximum(m, mb)
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp(sb - m_safe[:, None])
            alpha = torch.where(m_new == m, torch.ones_like(m), torch.exp(m - m_safe))
            pv = p * ks[n0:n1][None, :]
            if rule == "block":
                need = ks[n0:n1].max().expand(R) / 448.0
            else:
                need = pv.max(1).values / 448.0
            if tau > 0:
                sig_new = torch.where(need <= sig * alpha, sig * alpha, need * P_SCALE_HEADROOM)
            else:
                sig_new = torch.maximum(need, sig * alpha)
            inv = torch.where(sig_new > 0, 1.0 / sig_new, torch.zeros_like(sig_new))
            r = torch.where(sig_new == sig * alpha, torch.ones_like(sig), sig * alpha * inv)
            p8 = (pv * inv[:, None]).clamp(max=448.0).to(p_dtype).double()
            l = l * r + p.sum(1) * inv
            acc = acc * r[:, None] + p8 @ c_hat[n0:n1]
            sig, m = sig_new, m_new
        o = torch.where(l[:, None] > 0, acc / l.clamp_min(1e-300)[:, None], torch.zeros_like(acc))
        lse = torch.where(l > 0, m + torch.log(l * sig), torch.full_like(l, float("-inf")))
        outs.append(o)
        lses.append(lse)
    lse = torch.stack(lses)
    w = torch.softmax(lse, dim=0).nan_to_num(0.0)
    return (torch.stack(outs) * w[:, :, None]).sum(0)


# ----------------------------------------------------------------------------------------------
# torch.library ops


@torch.library.custom_op("lowbit::mla_decode", mutates_args=())
def _mla_decode_op(q: torch.Tensor, content: torch.Tensor, rope: torch.Tensor, scale: torch.Tensor | None,
                   page_table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, max_seq_len: int,
                   num_splits: int, pv_fp8: bool = True, pv16: bool = False) -> torch.Tensor:
    B, Sq, H, D = q.shape
    dc = content.shape[-1]
    dr = D - dc
    fp8 = scale is not None
    if use_triton(q, content, page_table) and _kernel_ok(dc, dr, "mla_decode"):
        from lowbit.kernels.mla_decode import mla_decode_triton
        from lowbit.kernels.mla_quant import latent_quant_triton

        def run(q, page_table, seq_lens):
            B = q.shape[0]
            q3 = q.reshape(B, Sq * H, D)
            if fp8:  # Fused-Q-Quant: fp8 content, fp32 scale, bf16 RoPE pre-divided by the scale
                qc, qs, qr = latent_quant_triton(q3.reshape(B * Sq * H, D), dc)
                qc, qs, qr = qc.view(B, Sq * H, dc), qs.view(B, Sq * H), qr.view(B, Sq * H, dr)
            else:
                qc, qs, qr = q3[..., :dc], None, q3[..., dc:]
            out = mla_decode_triton(qc, qr, qs, _rows(content), _rows(rope), _rows(scale) if fp8 else None,
                                    page_table, seq_lens, num_heads=H, sm_scale=sm_scale, max_seq_len=max_seq_len,
                                    page_size=content.shape[1], fp8=fp8, out_dtype=q.dtype,
                                    num_splits=num_splits or None, pv_fp8=pv_fp8, pv16=pv16)
            return out.view(B, Sq, H, dc)

        return by_batch(run, 1, q, page_table, seq_lens)  # the decode kernels put the batch on grid axis 2
    from lowbit.kernels.mla_decode import P_BLOCK

    rule = "block" if (P_BLOCK["fp8"] and not pv16) else "row"
    p_block = (64, 1 << 30, 0.0, torch.float16 if pv16 else torch.float8_e4m3fn, rule) if (fp8 and pv_fp8) else None
    return mla_decode_ref(q, (content, rope, scale), page_table, seq_lens, sm_scale=sm_scale,
                          p_block=p_block).to(q.dtype)


@_mla_decode_op.register_fake
def _(q, content, rope, scale, page_table, seq_lens, sm_scale, max_seq_len, num_splits, pv_fp8=True, pv16=False):
    B, Sq, H, _ = q.shape
    return q.new_empty(B, Sq, H, content.shape[-1])


@torch.library.custom_op("lowbit::mla_append", mutates_args=("content", "rope", "scale"))
def _mla_append_op(kv: torch.Tensor, slots: torch.Tensor, content: torch.Tensor, rope: torch.Tensor,
                   scale: torch.Tensor | None) -> None:
    dc = content.shape[-1]
    fp8 = scale is not None
    if use_triton(kv, content) and _kernel_ok(dc, kv.shape[-1] - dc, "mla_append"):
        from lowbit.kernels.mla_quant import latent_quant_triton

        latent_quant_triton(kv, dc, out=(_rows(content), _rows(rope), _rows(scale) if fp8 else None),
                            slots=slots, fp8=fp8)
        return
    c2, r2 = _rows(content), _rows(rope)
    if fp8:
        c, s, r = quantize_latent(kv, dc)
        c2[slots], r2[slots], _rows(scale)[slots] = c, r, s
    else:
        c2[slots], r2[slots] = kv[:, :dc].to(c2.dtype), kv[:, dc:].to(r2.dtype)


@_mla_append_op.register_fake
def _(kv, slots, content, rope, scale):
    return None


@torch.library.custom_op("lowbit::mla_quantize_q", mutates_args=())
def _mla_quantize_q_op(q: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    D = q.shape[-1]
    if use_triton(q) and _kernel_ok(kv_lora_rank, D - kv_lora_rank, "mla_quantize_q"):
        from lowbit.kernels.mla_quant import latent_quant_triton

        c, s, r = latent_quant_triton(q.reshape(-1, D), kv_lora_rank)
        lead = q.shape[:-1]
        return c.view(*lead, kv_lora_rank), s.view(lead), r.view(*lead, D - kv_lora_rank)
    return quantize_q(q, kv_lora_rank)


@_mla_quantize_q_op.register_fake
def _(q, kv_lora_rank):
    lead = q.shape[:-1]
    return (q.new_empty(*lead, kv_lora_rank, dtype=torch.float8_e4m3fn), q.new_empty(lead, dtype=torch.float32),
            q.new_empty(*lead, q.shape[-1] - kv_lora_rank, dtype=torch.bfloat16))


@torch.library.custom_op("lowbit::mla_gather", mutates_args=())
def _mla_gather_op(content: torch.Tensor, rope: torch.Tensor, scale: torch.Tensor | None, page_table: torch.Tensor,
                   seq_lens: torch.Tensor, max_len: int, out_dtype: torch.dtype) -> torch.Tensor:
    dc, dr = content.shape[-1], rope.shape[-1]
    if use_triton(content, page_table) and _kernel_ok(dc, dr, "mla_gather"):
        from lowbit.kernels.mla_quant import latent_gather_triton

        return by_batch(lambda pt, sl: latent_gather_triton(  # the gather puts the batch on grid axis 1
            _rows(content), _rows(rope), _rows(scale) if scale is not None else None, pt, sl, max_len,
            page_size=content.shape[1], out_dtype=out_dtype), 1, page_table, seq_lens)
    B = page_table.shape[0]
    out = torch.zeros(B, max_len, dc + dr, device=content.device, dtype=out_dtype)
    for b in range(B):
        kv = _gather_ref(content, rope, scale, page_table, seq_lens, b, torch.float32)[:max_len]
        out[b, : kv.shape[0]] = kv.to(out_dtype)
    return out


@_mla_gather_op.register_fake
def _(content, rope, scale, page_table, seq_lens, max_len, out_dtype):
    return content.new_empty(page_table.shape[0], max_len, content.shape[-1] + rope.shape[-1], dtype=out_dtype)


# ----------------------------------------------------------------------------------------------
# public functions


def _check_tables(page_table, seq_lens, B, P, page):
    check_tensor(page_table, "page_table", dtype=torch.int32, ndim=2)
    check_tensor(seq_lens, "seq_lens", dtype=torch.int32, shape=(page_table.shape[0],))
    if page_table.shape[0] != B:
        raise ValueError(f"page_table has {page_table.shape[0]} rows but the batch is {B}")
    if page_table.stride(1) != 1:
        raise ValueError("page_table must have contiguous rows")
    check_page_reads(seq_lens, page_table, page, P, name="seq_lens")


def mla_decode(q: torch.Tensor, cache, page_table: torch.Tensor, seq_lens: torch.Tensor, *,
               sm_scale: float | None = None, fp8: bool | None = None, max_seq_len: int | None = None,
               num_splits: int | None = None, pv_fp8: bool = True, pv16: bool = False) -> torch.Tensor:
    """Absorbed-MLA decode of ``Sq`` (1-4, MTP) query tokens per sequence over a paged latent cache.

    q ``[B, Sq, H, Dc + Dr]`` (bf16/fp16; the absorbed query ``[q_C W_UK | q_R]``, RoPE applied),
    ``cache = (content, rope, scale)`` (module docstring), ``page_table [B, pages]`` int32,
    ``seq_lens [B]`` int32 >= Sq (the Sq query tokens are the last Sq cached ones; query t attends
    to keys ``j < seq_len - Sq + t + 1``). Returns ``[B, Sq, H, Dc]`` in q's dtype: the attention
    output in latent space (multiply by W_UV per head for the value projection).
    ``fp8``: None follows the cache; True/False must match it. ``max_seq_len``: host-side bound on
    ``seq_lens`` (avoids a device sync). ``sm_scale`` defaults to ``(Dc + Dr) ** -0.5``.
    ``pv_fp8`` (FP8 caches): True = SnapMLA's FP8 PV with per-block re-quantized P; False = FP8 QK
    with a bf16 PV on the exactly upcast latent (P * s_k in bf16; no P quantization). ``pv16`` (with
    ``pv_fp8``): SnapMLA's P scaling, but P rounded to fp16 and the latent upcast to fp16 (exact) for
    an fp16 PV (lowbit.kernels.mla_decode docstring).
    """
    content, rope, scale = _unpack_cache(cache)
    check_tensor(q, "q", dtype=_FLOATS, ndim=4)
    P, page = _check_cache(content, rope, scale)
    B, Sq, H, D = q.shape
    dc, dr = content.shape[-1], rope.shape[-1]
    is_fp8 = scale is not None
    if fp8 is not None and bool(fp8) != is_fp8:
        raise ValueError(f"fp8={fp8} but the cache is {'fp8' if is_fp8 else str(content.dtype)}")
    if D != dc + dr:
        raise ValueError(f"q's last dim ({D}) must equal latent ({dc}) + rope ({dr}) of the cache")
    if not 1 <= Sq <= MAX_DECODE_TOKENS:
        raise ValueError(f"q must have 1..{MAX_DECODE_TOKENS} query tokens (dim 1) for decode, got {Sq}; "
                         "use mla_prefill for longer chunks")
    if not is_fp8 and q.dtype != content.dtype:
        raise TypeError(f"q dtype {q.dtype} must match the bf16/fp16 cache dtype {content.dtype}")
    if is_fp8 and q.dtype == torch.float32:
        q = q.to(torch.bfloat16)
    _check_tables(page_table, seq_lens, B, P, page)
    check_same_device(q=q, content=content, rope=rope, page_table=page_table, seq_lens=seq_lens)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if B else 0
    max_seq_len, num_splits = check_int(max_seq_len, "max_seq_len"), check_int(num_splits or 0, "num_splits")
    if max_seq_len > page_table.shape[1] * page:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the page table capacity {page_table.shape[1] * page}")
    if B and check_indices(seq_lens) and int(seq_lens.min()) < Sq:
        raise ValueError(f"every seq_len must be >= Sq ({Sq}): append the query tokens' latents first")
    if B and check_indices(seq_lens) and int(seq_lens.max()) > max_seq_len:  # (it cut the keys read: a wrong output)
        raise ValueError(f"max_seq_len ({max_seq_len}) must bound seq_lens (up to {int(seq_lens.max())})")
    sm_scale = check_sm_scale(sm_scale, D)
    if q.numel() == 0:  # no sequence or no head: nothing to launch (the split rule divides by them)
        return q.new_empty(B, Sq, H, dc)
    return run_op(_mla_decode_op, q.contiguous(), content, rope, scale, page_table, seq_lens, sm_scale,
                  max_seq_len, num_splits, bool(pv_fp8), bool(pv16))


def mla_append(kv: torch.Tensor, cache, slots: torch.Tensor) -> None:
    """Fused-K-Append: write latents ``kv [T, Dc + Dr]`` (content then RoPE-applied key) into cache
    slots ``slots [T]`` (int64, slot = page * page_size + offset), quantizing to the FP8 format
    for FP8 caches in the same launch."""
    content, rope, scale = _unpack_cache(cache)
    P, page = _check_cache(content, rope, scale)
    check_tensor(kv, "kv", dtype=_FLOATS, ndim=2)
    check_tensor(slots, "slots", dtype=torch.int64, shape=(kv.shape[0],))
    if kv.shape[1] != content.shape[-1] + rope.shape[-1]:
        raise ValueError(f"kv's last dim ({kv.shape[1]}) must equal latent + rope ({content.shape[-1] + rope.shape[-1]})")
    check_same_device(kv=kv, slots=slots, content=content)
    if slots.numel() and check_indices(slots) and (int(slots.min()) < 0 or int(slots.max()) >= P * page):
        raise ValueError(f"slots must lie in [0, {P * page}) (the cache's pages x page size), "
                         f"got [{int(slots.min())}, {int(slots.max())}]")
    run_op(_mla_append_op, kv.contiguous(), slots, content, rope, scale)


def mla_quantize_q(q: torch.Tensor, kv_lora_rank: int):
    """Fused-Q-Quant: ``q [..., Dc + Dr]`` -> (fp8 [..., Dc], scale fp32 [...], bf16 RoPE [..., Dr] / scale)."""
    check_tensor(q, "q", dtype=_FLOATS)
    if q.ndim < 1:
        raise ValueError("q must have at least 1 dim")
    if not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"kv_lora_rank ({kv_lora_rank}) must be in (0, {q.shape[-1]})")
    return run_op(_mla_quantize_q_op, q.contiguous(), int(kv_lora_rank))


def mla_gather(cache, page_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int | None = None, *,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Fused-Fetch-Dequant: the cached latents as a dense ``[B, max_len, Dc + Dr]`` tensor in
    ``dtype`` (FP8 caches dequantized in the kernel that reads them); rows past a sequence's
    length are zero."""
    content, rope, scale = _unpack_cache(cache)
    P, page = _check_cache(content, rope, scale)
    _check_tables(page_table, seq_lens, page_table.shape[0], P, page)
    if max_len is None:
        max_len = int(seq_lens.max()) if page_table.shape[0] else 0
    return run_op(_mla_gather_op, content, rope, scale, page_table, seq_lens, int(max_len), dtype)


def mla_prefill(q: torch.Tensor, cache, page_table: torch.Tensor, seq_lens: torch.Tensor, *,
                sm_scale: float | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Prefill / chunked prefill in absorbed form: ``q [B, S, H, Dc + Dr]`` are the last S tokens of
    each sequence (already appended); keys are the fetch-dequantized latents (bf16 for FP8
    caches, as SnapMLA's prefill path) and attention runs in q's dtype with fp32 softmax
    (bottom-right causal). Returns ``[B, S, H, Dc]``. Sequences of one batch must share their length."""
    content, rope, scale = _unpack_cache(cache)
    check_tensor(q, "q", dtype=_FLOATS, ndim=4)
    B, S, H, D = q.shape
    if D != content.shape[-1] + rope.shape[-1]:
        raise ValueError(f"q's last dim ({D}) must equal latent + rope ({content.shape[-1] + rope.shape[-1]})")
    dc = content.shape[-1]
    sm_scale = check_sm_scale(sm_scale, D)
    kv = mla_gather(cache, page_table, seq_lens, max_seq_len, dtype=q.dtype if q.dtype != torch.float32 else torch.float32)
    if B == 0:  # (the cache then holds 0 tokens, fewer than any S)
        return q.new_empty(0, S, H, dc)
    L = kv.shape[1]
    if S > L:
        raise ValueError(f"q has {S} tokens but the cache holds only {L}")
    qf = q.reshape(B, S * H, D)
    s = torch.matmul(qf, kv.transpose(1, 2)).float() * sm_scale  # [B, S*H, L]
    lim = (seq_lens.view(B, 1, 1) - S + 1 + (torch.arange(S * H, device=q.device) // H).view(1, -1, 1))
    keep = torch.arange(L, device=q.device).view(1, 1, L) < lim
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0).to(kv.dtype)
    return torch.matmul(p, kv[..., :dc]).view(B, S, H, dc)


def flops(batch: int, heads: int, sq: int, seq_len: int, dc: int = 512, dr: int = 64) -> float:
    """Decode FLOPs (the FlashMLA convention): 2*B*Sq*H*L*(Dc + Dr) for QK^T + 2*B*Sq*H*L*Dc for PV."""
    return 2.0 * batch * sq * heads * seq_len * (2 * dc + dr)


def log2e() -> float:
    return 1.0 / math.log(2.0)
