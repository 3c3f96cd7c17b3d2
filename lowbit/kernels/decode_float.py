"""Decode attention over the paged float KV cache (bf16 / fp16): split-KV flash-decoding.

The unquantized numerics ``'bf16'`` of ``lowbit.nn.kv_cache.PagedKVCache`` and the dense cache of
the fast runner (``lowbit.models.generate.DenseKV``: ``[B, Hkv, S, D]`` is this layout with one page
of ``S`` tokens per sequence). Math (per sequence b, KV head h; G = Hq/Hkv query heads share h;
TQ in 1..16 new query tokens)::

    rows m = (g, t), m = g*TQ + t          (all G*TQ rows of one KV head in ONE program: they
                                            share every K/V tile the program loads)
    S[m,n] = sm_scale * q[b, h*G+g, t] . k[n]       tensor-core dot in the cache dtype, fp32 acc.
    P      = softmax_n(S) over keys n <= L_b - TQ + t (causal among the TQ new tokens)
    O[m,:] = sum_n P[m,n] v[n,:]                    P rounded to the cache dtype, fp32 accumulation

Q is rounded to the cache dtype (it is already in it when it comes from the model). exp2 with
``sm_scale * log2(e)`` folded into one multiply of S.

Cache layout: ``k, v [num_pages, Hkv, PAGE, D]`` (any strides, unit stride along D), ``page_table
int32 [B, max_pages]``, ``lengths int32 [B]`` counting every cached token *including* the TQ new
ones (appended before the call). A block of BLOCK_N keys lies in one page (PAGE % BLOCK_N == 0):
one page-table read per block. Keys past the length are masked (loaded as 0, score -inf), so stale
page memory never reaches the output.

Split-KV: grid ``(B * Hkv, NUM_SPLITS)``; split s handles keys ``[s*SPLIT_LEN, (s+1)*SPLIT_LEN)``
and writes its un-normalised fp32 accumulator, running max (log2 domain) and denominator in the
partial layout of ``lowbit.kernels.decode_kv4``, whose combine kernel finishes the rows (one
kernel for both caches). With one split the kernel writes O directly. Split count: about 4 programs
per SM (``16 // num_warps * SMs / (B * Hkv)``), at least one key block per split, at most 256 (H200
sweep, round S8e, ``benchmarks/results/h200/decode_float_sweep.json``: B=1 L=1k 9.6 us vs 12.3 us with
``decode_kv4.choose_splits``' 4-blocks-per-split rule, B=4 L=1k 12.2 vs 13.1 us; B=16 gets the same 5 splits).
From 3 (sequence, KV head) programs per SM on, one split (``NO_SPLIT_PER_SM``): H200 session 25,
``benchmarks/results/h200/s25_probe.json`` part ``f`` (32 / 8 heads, D = 128, the runner's dense cache), B=64 L=1k
66.7 vs 74.0 us with the rule's 2 splits (SDPA flash on exactly L keys 67.6), L=8k 470.8 vs 499.4 (4.56 TB/s; SDPA
472.7); block 64 / 3 stages / 4 warps stay (the best of 60 launches within 1 % at B=16 and 64). B=32 (256
programs, between the measured points) keeps the rule's 3 splits.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lowbit.kernels.decode_kv4 import LOG2E, _combine, _num_sms, split_rows, split_workspace

DEFAULT_BLOCK_N = 64
DEFAULT_WARPS = 4
DEFAULT_STAGES = 3
NO_SPLIT_PER_SM = 3  # B * Hkv >= this many programs per SM: one split (no partials, no combine launch)


@triton.jit
def _decode_float_kernel(
    Q, K, V, PT, LENS, O, OP, MP, LP,
    qk_scale, SPLIT_LEN, Hkv,
    stride_qb, stride_qh, stride_qt,
    stride_kp, stride_kh, stride_kn,
    stride_vp, stride_vh, stride_vn,
    stride_ptb,
    stride_ob, stride_oh, stride_ot,
    G: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    pid_bh, sid, b, h, L, start, end, m_idx, g, t, row_ok = split_rows(LENS, SPLIT_LEN, Hkv, G, TQ, BLOCK_M)
    d = tl.arange(0, D)
    q_ptr = Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(K.dtype.element_ty)
    qpos = L - TQ + t  # absolute position of query row m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        page = tl.load(PT + b * stride_ptb + n0 // PAGE).to(tl.int64)
        row = (n0 % PAGE + n_off)[:, None]
        n = n0 + n_off
        kmask = n < end
        k = tl.load(K + page * stride_kp + h * stride_kh + row * stride_kn + d[None, :], mask=kmask[:, None],
                    other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        s = tl.where((n[None, :] <= qpos[:, None]) & kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + page * stride_vp + h * stride_vh + row * stride_vn + d[None, :], mask=kmask[:, None],
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLIT:  # partials in decode_kv4's layout: row (pid_bh * NUM_SPLITS + sid) * BLOCK_M + m
        base = (pid_bh * tl.num_programs(1) + sid) * BLOCK_M
        tl.store(MP + base + m_idx, m_i, mask=row_ok)
        tl.store(LP + base + m_idx, l_i, mask=row_ok)
        tl.store(OP + (base + m_idx)[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    else:
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        o_ptr = O + b * stride_ob + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :]
        tl.store(o_ptr, (acc * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])


LAST_LAUNCH: dict = {}  # split count of the latest launch (benchmarks report it)


def decode_float_triton(q, k, v, page_table, lengths, *, sm_scale=None, max_len=None, num_splits=None,
                        block_n=None, num_warps=None, num_stages=None):
    """Launcher. q ``[B, Hq, TQ, D]`` (post-RoPE); k, v ``[num_pages, Hkv, PAGE, D]`` bf16 / fp16;
    returns O ``[B, Hq, TQ, D]`` in q's dtype. Arguments are checked by ``lowbit.ops.kv4.decode_float``;
    ``max_len`` (host int) sizes the split grid without a device sync."""
    B, Hq, TQ, D = q.shape
    _, Hkv, PAGE, _ = k.shape
    G = Hq // Hkv
    BLOCK_M = max(16, triton.next_power_of_2(G * TQ))
    bn = block_n or DEFAULT_BLOCK_N
    while PAGE % bn:
        bn //= 2
    if bn < 16:
        raise ValueError(f"decode_float: the page size ({PAGE}) must be a multiple of 16")
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    if max_len is None:
        max_len = int(lengths.max().item()) if B else 0
    nw = num_warps or DEFAULT_WARPS
    if num_splits is None:  # ~4 one-warp-group programs per SM, splits of >= 1 key block (S8e sweep); none from
        # 3 (sequence, KV head) programs per SM (session 25)
        sms = _num_sms(q.device)
        num_splits = 1 if B * Hkv >= NO_SPLIT_PER_SM * sms else max(1, min(
            math.ceil(16 // nw * sms / max(1, B * Hkv)), math.ceil(max(max_len, 1) / bn), 256))
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), bn) * bn
    num_splits = max(1, triton.cdiv(max(max_len, 1), split_len))
    LAST_LAUNCH["num_splits"] = num_splits
    out = torch.empty_like(q)
    split = num_splits > 1
    op, mp, lp = split_workspace(out, B * Hkv, num_splits, BLOCK_M, D)
    _decode_float_kernel[(B * Hkv, num_splits)](
        q, k, v, page_table, lengths, out, op, mp, lp,
        sm_scale * LOG2E, split_len, Hkv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        G=G, TQ=TQ, BLOCK_M=BLOCK_M, D=D, PAGE=PAGE, BLOCK_N=bn, SPLIT=split,
        num_warps=nw, num_stages=num_stages or DEFAULT_STAGES,
    )
    if split:
        _combine(op, mp, lp, out, B, Hkv, num_splits, G, TQ, BLOCK_M, D)
    return out
