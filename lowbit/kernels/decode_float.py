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

Two fusions for the fast runner's decode step (session 27; ``decode_float_append_triton``), both off in the plain
launcher:

- ``APPEND``: the step's TQ new tokens come in pre-RoPE (q ``[B, Hq, TQ, D]``, k / v ``[B, Hkv, TQ, D]``, half-split
  cos / sin ``[B, TQ, D]``) instead of through ``lowbit.kernels.kv4_append.float_append_triton`` first. Every
  program rotates its query rows itself (``lowbit.kernels.rope``'s half-precision rounding, so q is bit for bit what
  the append launch would have stored) and writes the new keys of its own key range (rotated with the same
  rounding) and values to their slots ``L - TQ + t`` (a position outside the page table or a page outside the pool
  writes nothing, as in the append kernel); a barrier (``bar.sync``: CTA-scope memory ordering) then lets the key
  loop read them from the cache like every other key. Blocks, values and order are the unfused launches', so the
  output and the cache are bit for bit theirs. Offline sm_90 build (``benchmarks/offline_decode_float.py``): 244
  registers (250 with a split), no spill, as the plain kernel. (Taking the new rows from registers inside the
  loop's last blocks instead, built first, cost 255 registers and 2.5 KB of spills and ran the batch-64 model
  1.17x bf16 against 1.52x unfused, session 27.)
- ``FUSE_COMBINE``: the split partials are combined by the last program of each (sequence, KV head) to finish
  (an atomic counter, acquire / release at GPU scope, reset by that program: graph-safe), reading all splits'
  rows in one round trip, in place of ``decode_kv4._combine``'s launch; used where the splits' rows fit one
  program (``splits x rows x D <= FUSED_COMBINE_MAX``), else the combine launch stays.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lowbit._utils import arrival_counters, interpret_mode
from lowbit.kernels.decode_kv4 import LOG2E, _combine, _num_sms, split_rows, split_workspace
from lowbit.kernels.rope import norm_args, rope_tile

DEFAULT_BLOCK_N = 64
DEFAULT_WARPS = 4
DEFAULT_STAGES = 3
NO_SPLIT_PER_SM = 3  # B * Hkv >= this many programs per SM: one split (no partials, no combine launch)
FUSED_COMBINE_MAX = 8192  # splits (next power of 2) x query rows (next power of 2) x D read by one program


@triton.jit
def _attend(q, k, v, n, kmask, qpos, m_i, l_i, acc, qk_scale):
    """One key block of the online softmax (log2 domain): keys ``k`` / values ``v`` [BLOCK_N, D] at positions
    ``n`` (``kmask``: real keys), causal against the query rows' positions ``qpos``."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    s = tl.where((n[None, :] <= qpos[:, None]) & kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


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
    # APPEND (module docstring): the new tokens pre-RoPE, their cos / sin rows, page-table / pool bounds
    KN=None, VN=None, COS=None, SIN=None, NPT=0, NPAGES=0,
    stride_knb=0, stride_knh=0, stride_knt=0, stride_vnb=0, stride_vnh=0, stride_vnt=0, stride_cb=0, stride_ct=0,
    # FUSE_COMBINE: per-(sequence, KV head) arrival counters (zero between launches)
    CNT=None,
    APPEND: tl.constexpr = False, TQ_P2: tl.constexpr = 16, ROW_BF16: tl.constexpr = True,
    INTERPRET: tl.constexpr = False, FUSE_COMBINE: tl.constexpr = False, SPLITS_P2: tl.constexpr = 1,
    ROWS_P2: tl.constexpr = 1,
    # APPEND + NORM (session 37, q/k-norm models): q and the new keys RMS-normalised with QW / KW before RoPE
    QW=None, KW=None, eps=0.0, NORM: tl.constexpr = False,
):
    pid_bh, sid, b, h, L, start, end, m_idx, g, t, row_ok = split_rows(LENS, SPLIT_LEN, Hkv, G, TQ, BLOCK_M)
    d = tl.arange(0, D)
    q_row = b * stride_qb + (h * G + g) * stride_qh + t * stride_qt
    if APPEND:  # q rotated here (the bits the append launch would have stored); this split's new keys written
        q = rope_tile(Q, q_row, d, row_ok, COS, SIN, b * stride_cb + t * stride_ct, D, ROW_BF16,
                       INTERPRET, QW, eps, NORM).to(K.dtype.element_ty)
        j = tl.arange(0, TQ_P2)
        pos = L - TQ + j
        mine = (j < TQ) & (pos >= start) & (pos < end)
        kn = rope_tile(KN, b * stride_knb + h * stride_knh + j * stride_knt, d, mine, COS, SIN,
                        b * stride_cb + j * stride_ct, D, ROW_BF16, INTERPRET, KW, eps, NORM).to(K.dtype.element_ty)
        vn = tl.load(VN + (b * stride_vnb + h * stride_vnh + j * stride_vnt)[:, None] + d[None, :],
                     mask=mine[:, None], other=0.0)
        # a position past the page table or a page outside the pool writes nothing (the append kernel's rule)
        w_ok = mine & (pos < NPT * PAGE)
        pg = tl.load(PT + b * stride_ptb + tl.where(w_ok, pos, 0) // PAGE, mask=w_ok, other=-1).to(tl.int64)
        w_ok = (w_ok & (pg >= 0) & (pg < NPAGES))[:, None]
        slot = (pos % PAGE)[:, None]
        tl.store(K + pg[:, None] * stride_kp + h * stride_kh + slot * stride_kn + d[None, :], kn, mask=w_ok)
        tl.store(V + pg[:, None] * stride_vp + h * stride_vh + slot * stride_vn + d[None, :], vn, mask=w_ok)
        tl.debug_barrier()  # bar.sync orders the CTA's global stores before the loop's loads (membar.cta)
    else:
        q = tl.load(Q + q_row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(K.dtype.element_ty)
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
        v = tl.load(V + page * stride_vp + h * stride_vh + row * stride_vn + d[None, :], mask=kmask[:, None],
                    other=0.0)
        m_i, l_i, acc = _attend(q, k, v, n, kmask, qpos, m_i, l_i, acc, qk_scale)
    if SPLIT:  # partials in decode_kv4's layout: row (pid_bh * NUM_SPLITS + sid) * BLOCK_M + m
        NS = tl.num_programs(1)
        base = (pid_bh * NS + sid) * BLOCK_M
        tl.store(MP + base + m_idx, m_i, mask=row_ok)
        tl.store(LP + base + m_idx, l_i, mask=row_ok)
        tl.store(OP + (base + m_idx)[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        if FUSE_COMBINE:  # the last program of (b, h) to finish combines every split (decode_kv4._combine_kernel)
            tl.debug_barrier()  # every thread's partials are written before the release below
            if tl.atomic_add(CNT + pid_bh, 1, sem="acq_rel", scope="gpu") == NS - 1:
                i = tl.arange(0, SPLITS_P2 * ROWS_P2)
                r = i % ROWS_P2
                ok = (i // ROWS_P2 < NS) & (r < G * TQ)
                prow = (pid_bh * NS + i // ROWS_P2) * BLOCK_M + r
                m_all = tl.reshape(tl.load(MP + prow, mask=ok, other=float("-inf"), cache_modifier=".cg"),
                                   [SPLITS_P2, ROWS_P2])
                l_all = tl.reshape(tl.load(LP + prow, mask=ok, other=0.0, cache_modifier=".cg"), [SPLITS_P2, ROWS_P2])
                part = tl.reshape(tl.load(OP + prow[:, None] * D + d[None, :], mask=ok[:, None], other=0.0,
                                          cache_modifier=".cg"), [SPLITS_P2, ROWS_P2, D])
                m_tot = tl.max(m_all, axis=0)
                m_safe = tl.where(m_tot == float("-inf"), 0.0, m_tot)
                w = tl.exp2(m_all - m_safe[None, :])  # 0 for the masked entries (-inf)
                l_tot = tl.sum(w * l_all, axis=0)
                o = tl.sum(w[:, :, None] * part, axis=0) * tl.where(l_tot > 0, 1.0 / tl.where(l_tot > 0, l_tot, 1.0), 0.0)[:, None]
                rr = tl.arange(0, ROWS_P2)
                o_ptr = O + b * stride_ob + (h * G + rr // TQ)[:, None] * stride_oh + (rr % TQ)[:, None] * stride_ot
                tl.store(o_ptr + d[None, :], o.to(O.dtype.element_ty), mask=(rr < G * TQ)[:, None])
                tl.atomic_xchg(CNT + pid_bh, 0, sem="relaxed", scope="gpu")
    else:
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        o_ptr = O + b * stride_ob + (h * G + g)[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :]
        tl.store(o_ptr, (acc * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])


LAST_LAUNCH: dict = {}  # split count of the latest launch (benchmarks report it)


def decode_float_triton(q, k, v, page_table, lengths, *, sm_scale=None, max_len=None, num_splits=None,
                        block_n=None, num_warps=None, num_stages=None, fuse_combine=False):
    """Launcher. q ``[B, Hq, TQ, D]`` (post-RoPE); k, v ``[num_pages, Hkv, PAGE, D]`` bf16 / fp16;
    returns O ``[B, Hq, TQ, D]`` in q's dtype. Arguments are checked by ``lowbit.ops.kv4.decode_float``;
    ``max_len`` (host int) sizes the split grid without a device sync. ``fuse_combine``: the splits combined by
    the decode launch's last program per (sequence, KV head) where they fit (module docstring)."""
    return _launch(q, k, v, page_table, lengths, None, sm_scale, max_len, num_splits, block_n, num_warps,
                   num_stages, fuse_combine)


def decode_float_append_triton(q, k, v, k_cache, v_cache, page_table, lengths, *, cos, sin, sm_scale=None,
                               max_len=None, num_splits=None, fuse_combine=True, block_n=None, num_warps=None,
                               num_stages=None, qk_norm=None):
    """``APPEND`` launcher (module docstring): one launch in place of ``float_append_triton(k, v, k_cache, v_cache,
    page_table, lengths - TQ, cos=cos, sin=sin, q=q, q_out=qo)`` + ``decode_float_triton(qo, k_cache, v_cache,
    ...)``. q ``[B, Hq, TQ, D]``, k / v ``[B, Hkv, TQ, D]`` pre-RoPE (bf16 / fp16, the caches' dtype, unit stride on
    D); cos / sin ``[B, TQ, D]`` half-split; ``lengths[b]`` counts the TQ new tokens too (their slots are
    ``lengths[b] - TQ + t``). Writes k (rotated) and v to the cache; returns O ``[B, Hq, TQ, D]``. Arguments are
    checked by ``lowbit.ops.kv4.decode_float_append``. ``qk_norm = (w_q, w_k, eps)`` (session 37, Qwen3): q and k
    RMS-normalised first (``lowbit.kernels.rope``'s ``NORM``; weights ``[D]`` in q's dtype)."""
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return _launch(q, k_cache, v_cache, page_table, lengths, (k, v, cos, sin), sm_scale, max_len, num_splits,
                   block_n, num_warps, num_stages, fuse_combine, norm_args(qk_norm, q, "decode_float_append"))


def _launch(q, k, v, page_table, lengths, append, sm_scale, max_len, num_splits, block_n, num_warps, num_stages,
            fuse_combine, norm=None):  # norm: ``rope.norm_args``
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
    sp2, rp2 = triton.next_power_of_2(num_splits), triton.next_power_of_2(G * TQ)
    fused = bool(fuse_combine) and split and sp2 * rp2 * D <= FUSED_COMBINE_MAX
    LAST_LAUNCH["fused_combine"] = fused
    kw = {}
    if append is not None:
        kn, vn, cos, sin = append
        kw = dict(KN=kn, VN=vn, COS=cos, SIN=sin, NPT=page_table.shape[1], NPAGES=k.shape[0],
                  stride_knb=kn.stride(0), stride_knh=kn.stride(1), stride_knt=kn.stride(2), stride_vnb=vn.stride(0),
                  stride_vnh=vn.stride(1), stride_vnt=vn.stride(2), stride_cb=cos.stride(0), stride_ct=cos.stride(1),
                  APPEND=True, TQ_P2=max(16, triton.next_power_of_2(TQ)), ROW_BF16=q.dtype == torch.bfloat16,
                  INTERPRET=interpret_mode(), **(norm or {}))
    if fused:
        kw.update(CNT=arrival_counters("decode_float", q.device, B * Hkv), FUSE_COMBINE=True, SPLITS_P2=sp2, ROWS_P2=rp2)
    _decode_float_kernel[(B * Hkv, num_splits)](
        q, k, v, page_table, lengths, out, op, mp, lp,
        sm_scale * LOG2E, split_len, Hkv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        G=G, TQ=TQ, BLOCK_M=BLOCK_M, D=D, PAGE=PAGE, BLOCK_N=bn, SPLIT=split,
        num_warps=nw, num_stages=num_stages or DEFAULT_STAGES, **kw,
    )
    if split and not fused:
        _combine(op, mp, lp, out, B, Hkv, num_splits, G, TQ, BLOCK_M, D)
    return out
