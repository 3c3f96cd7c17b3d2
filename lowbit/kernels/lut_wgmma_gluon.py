"""4-bit LUT GEMM for small batches in Gluon: register-table decode into the wgmma A registers, every wgmma async,
the exact FP32 group scaling kept (GPU only, Hopper).

Same product, format and numerics as ``lowbit.kernels.lut_wgmma`` (FLUTE, seed 002)::

    Y[m, n] = sum_g s[g, n] * sum_{k in g} X[m, k] * T[c[n, k]]      (T rounded to the activation dtype)

and the same packed codes (``formats.lut.pack_codes_mma``, 4-bit, G in 64 / 128 / 256). Why a second kernel:
the Triton kernel's per-group partial product must be finished before it is scaled into the FP32 accumulator, so
Triton waits on every wgmma at once (``wgmma.wait_group 0``, four per 128-K group in its PTX); at 2-3 programs per SM
the decode then stalls behind each wait (session 14's ncu: 0.46 instructions per scheduler and cycle). Here the
waits are written out:

- Program = 64 weight rows (4 row tiles of 16; one warpgroup) x ``BLOCK_M`` tokens (8..64, the wgmma N) x one
  split-K range of scale groups. Per 64-K chunk: the code words (one 16-byte load per thread, prefetched one
  group pair ahead) are decoded by ``lut_wgmma._decode_asm``'s PTX (22 integer instructions per 8 codes) and
  relabelled into the wgmma A-register fragment exactly as ``lut_wgmma._reg_a`` does (a register renaming: the
  ``convert_layout`` to the dot-operand layout is trivial); the activation tile, gathered in the relabelled K order
  (``_reg_a_k``: 4-byte pairs, prefetched one chunk ahead in registers), goes to a 2-slot shared buffer.
- Two partial accumulators alternate by group (``pa``: even groups of the split, ``pb``: odd). Each chunk's wgmma
  is issued async and followed by ``wait(1)``: the previous chunk's wgmma is then complete, so its A registers and
  activation slot are free, and at a group's first chunk the other partial is final: ``acc += p * s`` (FP32, the
  scales of its rows) while the new group's first wgmma runs. The decode of chunk c overlaps the wgmma of c - 1.
  A pair of groups per loop step (static roles); a split with an odd group count runs one masked group (activation
  zero, scale zero).
- Split-K with the deterministic last-arriver reduction of the Triton kernels (``lut_gemm.split_plan``).

Measured (H200, session 22, ``benchmarks/results/h200/s22_lut_gluon*.json``; README lut section): the waits were not
the bound. At 16 tokens this kernel runs at the Triton kernel's speed (gate_up 44.6 vs 43.1 us), slower at 32-64
(its 64-row programs stage the activation tile twice as often as the Triton kernel's 128-row ones); the decode's
~4.4 instructions per weight bound both. It wins at 8..16 tokens on the smaller weights (o / qkv M = 8: 11.3 / 14.0 us vs
the fragment kernel's best 11.8 / 14.5), so the op sends it the ranges of ``gluon_tokens``. ptxas serializes
every wgmma of a kernel like this one when a loop-carried accumulator in flight is copied at the back edge or read
after the next wgmma's issue (notes C7515 / C7514): the fold's result goes through a wait, and the last chunk of each
group pair waits to zero (``benchmarks/offline_lut_gluon.py`` checks the notes are gone).

Option ``smem_table`` (session 23; on in the op's range since session 24, timed in ``gluon_config``): the decode
through the shared-memory pair table of ``lut_wgmma._lds_decode_asm`` (offline SASS per group pair at 8 / 16 tokens:
563 / 565 -> 392 / 458; the 64 KB 'wide' table, 329 / 370, lost on the H200 and was removed in session 26).

The interpreter cannot run Gluon: the CPU path is the Triton kernel, whose decode PTX and relabelling this kernel
shares (both checked on the CPU in ``tests/test_lut_wgmma.py``); the GPU tests (``tests/test_lut_gluon.py``) compare
this kernel with the float64 reference and the Triton kernel (rel-L2 within the kernels' tolerance: the split-K and
token-block shapes differ, so the summation order does) and the op's dispatch with the launcher bit for bit.
"""
from __future__ import annotations

import torch

from lowbit._utils import cdiv
from lowbit.formats.lut import MMA_CHUNK
from lowbit.kernels.lut_gemm import PAIR_STORE_PTX, split_plan
from lowbit.kernels.lut_prmt import _byte_tables
from lowbit.kernels.lut_wgmma import _decode_asm, _lds_decode_asm, check_mma_args, mma_output, table_offset

try:  # Gluon ships with Triton >= 3.4; the interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    HAS_GLUON = True
except Exception:  # pragma: no cover - older Triton
    HAS_GLUON = False

GLUON_GROUPS = (64, 128, 256)
BLOCK_MS = (8, 16, 32, 64)

if HAS_GLUON:
    _DEC = gl.constexpr(_decode_asm())
    _DEC_CONS = gl.constexpr(",".join(["=h"] * 8 + ["r"] * 9))
    _LDS = gl.constexpr(_lds_decode_asm())
    _LDS_CONS = gl.constexpr(",".join(["=h"] * 8 + ["r"] * 2))
    _PAIR_STORE = gl.constexpr(PAIR_STORE_PTX)

    @gluon.jit
    def _store_table(P, off):
        """``lut_gemm._store_pair_table`` (4-bit) in Gluon: its tensors need Gluon layouts, so unlike the scalar
        ``_tables`` it cannot call the Triton helper (the store PTX is shared): lane l's copy of pair row e at shared
        byte offset ``off + 128 e + 4 l`` (16-byte slot f = 4 lane copies of row f // 8), then a barrier."""
        fl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4], order=[0])
        f = gl.arange(0, 2048, layout=fl)
        pv = gl.load(P.to(gl.pointer_type(gl.int32)) + f // 8)
        gl.inline_asm_elementwise(_PAIR_STORE, "=r,r,r", [(f // 8) * 128 + (f % 8) * 16 + off, pv],
                                  dtype=gl.int32, is_pure=False, pack=1)
        gl.thread_barrier()

    @gluon.jit
    def _tables(P):
        """The 16 entries (``pairs[e, 0]`` = T[e], int16 bits) -> byte-table registers ``L0..L3``, ``H0..H3``: the
        Triton helper ``lut_prmt._byte_tables`` at 4 bits (scalar code, which a Gluon kernel can call). Built in the
        kernel from 16 loads rather than passed in precomputed: 8 precomputed words load into uniform registers, and
        ptxas then copies them to vector registers before every ``prmt`` (offline build: 721 instead of 565 SASS per
        loop step, 147 ``IMAD.U32``)."""
        return _byte_tables(P, 4)

    @gluon.jit
    def _decode_a(words, tabs, a_l: gl.constexpr, ODT: gl.constexpr, SMEM_TAB: gl.constexpr = 0):
        """Code words ``[32, 16]`` (row ``8 rt + g``, column ``4 t + s``) -> the ``[64, 64]`` A tile in the wgmma
        register fragment (``lut_wgmma._decode`` + the stacked halves + ``_reg_a``: row ``16 rt + 8 rh + g``,
        column ``16 s + 8 a + 2 t + b`` = K ``16 t + 4 s + 2 a + b``). ``SMEM_TAB``: ``tabs`` is the pair table's
        shared offset and the lookups are ``lut_wgmma._lds_decode_asm``'s."""
        z = words * 0
        if SMEM_TAB == 1:
            asm: gl.constexpr = _LDS
            cons: gl.constexpr = _LDS_CONS
            args = [words, z + tabs]
        else:
            asm: gl.constexpr = _DEC
            cons: gl.constexpr = _DEC_CONS
            lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = tabs
            args = [words, z + lo0, z + lo1, z + lo2, z + lo3, z + hi0, z + hi1, z + hi2, z + hi3]
        if ODT == gl.bfloat16:
            n0, n1, n2, n3, n4, n5, n6, n7 = gl.inline_asm_elementwise(
                asm, cons, args, is_pure=True, pack=1,
                dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16,
                       gl.bfloat16))
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = gl.inline_asm_elementwise(
                asm, cons, args, is_pure=True, pack=1,
                dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16,
                       gl.float16))
        w0 = gl.reshape(gl.join(gl.join(n0, n4), gl.join(n1, n5)), [32, 64])  # rows g, K natural
        w1 = gl.reshape(gl.join(gl.join(n2, n6), gl.join(n3, n7)), [32, 64])  # rows g + 8
        w = gl.reshape(gl.permute(gl.join(w0, w1), (2, 0, 1)), [64, 64])  # row 32 rh + 8 rt + g
        w = gl.reshape(w, [2, 4, 8, 4, 4, 2, 2])
        w = gl.reshape(gl.permute(w, (1, 0, 2, 4, 5, 3, 6)), [64, 64])
        return gl.convert_layout(w, a_l)

    @gluon.jit
    def _x_tile(x_rows, c, ok):
        """The activation tile of chunk ``c`` (columns in the relabelled K order; rows past M and masked chunks 0)."""
        return gl.load(x_rows + c * 64, mask=ok, other=0.0)

    @gluon.jit
    def _chunk(words, xt, xs, slot: gl.constexpr, tabs, p, use_acc: gl.constexpr, a_prev, a_l: gl.constexpr,
               ODT: gl.constexpr, PEND: gl.constexpr = 1, SMEM_TAB: gl.constexpr = 0):
        """Decode one chunk, stage its activation tile, issue its wgmma into ``p`` (async), then wait until only
        it is in flight: the previous chunk's wgmma (and its A registers, ``a_prev``) is done."""
        a = _decode_a(words, tabs, a_l, ODT, SMEM_TAB)
        xs.index(slot).store(xt)
        fence_async_shared()
        gl.thread_barrier()
        p = warpgroup_mma(a, xs.index(slot).permute((1, 0)), p, use_acc=use_acc, is_async=True)
        p, a_prev = warpgroup_mma_wait(num_outstanding=PEND, deps=(p, a_prev))
        return p, a

    @gluon.jit(do_not_specialize=["TAB_OFF"])
    def _lut_gluon_kernel(X, Q, S, P, Y, WS, LOCKS, M, N, NRT, NC, NG, GROUPS_PER_SPLIT, SPLIT_K,
                          stride_xm, stride_sg, stride_ym, TAB_OFF,
                          GROUP: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr,
                          XPF: gl.constexpr = 2, SMEM_TAB: gl.constexpr = 0):
        """Module docstring. Grid: (row blocks of 64, token blocks of ``BLOCK_M``, splits). ``SMEM_TAB`` (option
        ``smem_table``): the pair table at shared offset ``TAB_OFF`` (past this kernel's own
        buffers; the launcher raises the shared size) and ``lut_wgmma._lds_decode_asm``'s lookups."""
        ODT: gl.constexpr = Y.dtype.element_ty
        CPG: gl.constexpr = GROUP // 64  # chunks per scale group
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        wl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[4, 1],
                                            order=[1, 0])
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[1, 32], warps_per_cta=[4, 1],
                                            order=[1, 0])
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        xs = gl.allocate_shared_memory(ODT, [2, BLOCK_M, 64],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], ODT))
        # code words: row i = 8 rt + g of the 4 row tiles, column 4 t + s (16 words = 64 bytes per row and chunk)
        i = gl.arange(0, 32, layout=gl.SliceLayout(1, wl))
        rt = pid_n * 4 + i // 8
        q_rows = Q + (rt.to(gl.int64) * (NC * 128) + (i % 8) * 16)[:, None] + \
            gl.arange(0, 16, layout=gl.SliceLayout(0, wl))[None, :]
        rt_ok = (rt < NRT)[:, None]
        # activations: the relabelled K order (``lut_wgmma._reg_a_k``)
        kc = gl.arange(0, 64, layout=gl.SliceLayout(0, xl))
        kx = 16 * ((kc // 2) % 4) + 4 * (kc // 16) + 2 * ((kc // 8) % 2) + kc % 2
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, xl))
        x_rows = X + offs_m.to(gl.int64)[:, None] * stride_xm + kx[None, :]
        m_ok = (offs_m < M)[:, None]
        # scales: the accumulator's rows
        n_acc = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
        n_ok = n_acc < N
        if SMEM_TAB > 0:
            _store_table(P, TAB_OFF)
            tabs = TAB_OFF
        else:
            tabs = _tables(P)
        g0 = pid_k * GROUPS_PER_SPLIT
        g1 = gl.minimum(g0 + GROUPS_PER_SPLIT, NG)
        acc = gl.zeros([64, BLOCK_M], gl.float32, acc_l)
        pa = gl.zeros([64, BLOCK_M], gl.float32, acc_l)
        pb = gl.zeros([64, BLOCK_M], gl.float32, acc_l)
        sb = gl.zeros([64], gl.float32, gl.SliceLayout(1, acc_l))
        a_prev = gl.zeros([64, 64], ODT, a_l)
        # chunks [c0, c1) of this split; loads run two chunks ahead (masked past c1: a pair's missing odd group)
        c0 = g0 * CPG
        c1 = g1 * CPG
        w1 = gl.load(q_rows + c0 * 128, mask=rt_ok & (c0 < c1), other=0)
        w2 = gl.load(q_rows + (c0 + 1) * 128, mask=rt_ok & (c0 + 1 < c1), other=0)
        x1 = _x_tile(x_rows, c0, m_ok & (c0 < c1))
        x2 = x1
        if XPF == 2:  # activation tiles two chunks ahead (registers: 3 tiles live), else one
            x2 = _x_tile(x_rows, c0 + 1, m_ok & (c0 + 1 < c1))
        for gp in range(g0, g1, 2):
            sa = gl.load(S + gp * stride_sg + n_acc, mask=n_ok, other=0.0).to(gl.float32)
            sb_next = gl.load(S + (gp + 1) * stride_sg + n_acc, mask=n_ok & (gp + 1 < g1), other=0.0).to(gl.float32)
            for cc in gl.static_range(2 * CPG):
                c = gp * CPG + cc
                w3 = gl.load(q_rows + (c + 2) * 128, mask=rt_ok & (c + 2 < c1), other=0)
                if XPF == 2:
                    x3 = _x_tile(x_rows, c + 2, m_ok & (c + 2 < c1))
                else:
                    x3 = _x_tile(x_rows, c + 1, m_ok & (c + 1 < c1))
                if cc < CPG:
                    pa, a_prev = _chunk(w1, x1, xs, cc % 2, tabs, pa, cc > 0, a_prev, a_l, ODT, 1, SMEM_TAB)
                    if cc == 0:  # the odd group before this pair is final (zeros before the first pair)
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc + pb * sb[:, None],))
                else:
                    pb, a_prev = _chunk(w1, x1, xs, cc % 2, tabs, pb, cc > CPG, a_prev, a_l, ODT,
                                        0 if cc == 2 * CPG - 1 else 1, SMEM_TAB)
                    if cc == CPG:  # this pair's even group is final
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc + pa * sa[:, None],))
                w1 = w2
                w2 = w3
                if XPF == 2:
                    x1 = x2
                    x2 = x3
                else:
                    x1 = x3
            sb = sb_next
        pb, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(pb, a_prev))
        acc += pb * sb[:, None]
        # epilogue: Y[m, n] = acc[n, m]
        m_acc = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_l))
        mask = n_ok[:, None] & (m_acc < M)[None, :]
        if USE_SPLIT:
            ws = WS + pid_k.to(gl.int64) * M * N + m_acc[None, :] * N + n_acc[:, None]
            gl.store(ws, acc, mask=mask)
            gl.thread_barrier()  # every thread's partial is written before the release below
            tile = pid_m * gl.num_programs(0) + pid_n
            arrived = gl.atomic_add(LOCKS + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tot = gl.zeros([64, BLOCK_M], gl.float32, acc_l)
                wsk = WS + m_acc[None, :] * N + n_acc[:, None]
                for sk in range(0, SPLIT_K):
                    tot += gl.load(wsk, mask=mask, other=0.0, cache_modifier=".cg")
                    wsk += M * N
                gl.store(Y + m_acc[None, :] * stride_ym + n_acc[:, None], tot.to(ODT), mask=mask)
                gl.atomic_xchg(LOCKS + tile, 0, sem="relaxed", scope="gpu")
        else:
            gl.store(Y + m_acc[None, :] * stride_ym + n_acc[:, None], acc.to(ODT), mask=mask)


def supported(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether this kernel can run the launch: Gluon, a Hopper GPU, 4-bit codes, G in ``GLUON_GROUPS``, bf16/fp16."""
    return (HAS_GLUON and x.is_cuda and bits == 4 and group_size in GLUON_GROUPS
            and x.dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(x.device)[0] == 9)


def gluon_tokens(N: int, K: int) -> tuple[int, int] | None:
    """The token range ``(lo, hi)`` the op sends to this kernel for an ``N x K`` weight (None: never).
    Measured (H200, session 22, us, NF4 g128): at 8 tokens on the two smaller Llama-3-8B weights this kernel beats
    the fragment kernel's best launch (``s22_lut_fragment_small_m.json``: o / qkv 11.3 / 14.0 vs 11.8 / 14.5) and at
    9..16 the Triton register-table kernel (``s22_lut_gluon_dispatch.json``, M = 16: 12.3 / 15.6 vs 13.7 / 16.4);
    on down, gate_up and 8192^2 the fragment kernel's re-tuned small-M launches (``lut_gemm.mma_config``: down M = 8
    22.7 vs 25.4 here) and the Triton kernel at 12-16 tokens (gate_up M = 16 42.5 vs 44.1) stay ahead, and at 32-64
    tokens this kernel loses everywhere (gate_up M = 64 88.8 vs 63.9: its 64-row programs stage the activation tile
    twice as often as the Triton kernel's 128-row ones; the decode's instruction stream, not the wgmma waits, bounds
    both). Below 8 tokens the fragment kernel wins on every shape (o M = 4: 10.7 vs 11.1). The size threshold between
    the measured weights (qkv 25 M elements, down 59 M) is interpolated, not measured.
    Session 24 (H200, ``s24_m8_128.json``, both register-table kernels with the shared pair table, ``gluon_config``):
    at 8 tokens this kernel also passes the fragment kernel on the larger weights (down / 8192^2 20.4 / 20.5 vs
    22.5 / 23.1 us) but not the Triton kernel on gate_up-sized N (34.7 vs 33.7), which ``wgmma_preferred`` takes
    there; at 9..16 the Triton kernel keeps the larger ones (``s24_smem_table.json``, down M = 16 25.7 vs 27.1).
    Session 25 (H200, ``s25_caps.json``, then ``s25_probe.json`` and ``s25_ab.json``: three interleaved repeats
    each): with a split target of 2 programs per SM and one activation prefetch (``gluon_config``) this kernel takes
    gate_up-sized N at 16 tokens (35.97 / 35.84 vs the Triton kernel's 37.62 / 37.52 us) but not at 9 / 12 (36.62 /
    36.78 vs 33.76 / 34.16: its time is flat in M, the Triton kernel's is not); 8192^2 loses with the same launch
    (24.48 vs 23.78)."""
    if N * K <= 32_000_000:
        return (8, 16)
    return (8, 8) if N < 16384 else (16, 16)


def gluon_preferred(M: int, N: int, K: int, bits: int, group_size: int) -> bool:
    """Whether the op takes this kernel: 4-bit codes, G in ``GLUON_GROUPS``, M in ``gluon_tokens(N, K)``."""
    r = gluon_tokens(N, K)
    return bits == 4 and group_size in GLUON_GROUPS and r is not None and r[0] <= M <= r[1]


def gluon_config(M: int, N: int = 0) -> dict:
    """Launch parameters: ``block_m`` (the wgmma N, 8..64 tokens), the split-K target ``ctas_per_sm``, the
    activation prefetch depth ``xpf`` and ``smem_table``: on in the op's range (H200, session 24,
    ``s24_smem_table.json``, qkv / o, us: M = 9 13.7 / 11.2 vs 16.1 / 12.7, M = 16 14.1 / 11.9 vs 15.8 / 12.4; the
    64 KB 'wide' table 16.8 / 14.3 and 17.6 / 15.3). Gate_up-sized N (>= 16384) at 16 tokens: 2 programs per SM
    and one prefetch (session 25, ``s25_caps.json``, M = 16 gate_up 36.1 vs 38.9 us with 4 and 2)."""
    bm = 8 if M <= 8 else (16 if M <= 16 else (32 if M <= 32 else 64))
    if bm == 16 and N >= 16384:
        return dict(block_m=bm, ctas_per_sm=2, xpf=1, smem_table=True)
    return dict(block_m=bm, ctas_per_sm=4, xpf=2 if bm <= 32 else 1, smem_table=bm <= 16)


LAST_COMPILED: dict = {}


def lut_wgmma_gluon(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pairs: torch.Tensor, *,
                    group_size: int, out_features: int, **overrides) -> torch.Tensor:
    """Launch ``_lut_gluon_kernel`` (4-bit 'mma' codes, ``pairs`` = ``pair_table(table, 4, x.dtype)``, ``scales``
    ``[ceil(K/G), N]``; ``overrides``: ``block_m``, ``split_k``, ``ctas_per_sm``, ``maxnreg``, ``smem_table``: False
    or True as in ``lut_wgmma.lut_wgmma_triton``)."""
    M, K = x.shape
    N, G = out_features, group_size
    if not supported(x, 4, G):
        raise ValueError(f"lut_wgmma_gluon needs a Hopper GPU, Gluon, bf16/fp16 x and group_size in {GLUON_GROUPS}, "
                         f"got {x.device}, {x.dtype}, group_size={G}")
    nrt, nc = check_mma_args(x, qweight, scales, pairs, N, 4, G)
    cfg = gluon_config(M, N)
    cfg.update(overrides)
    bm = int(cfg["block_m"])
    if bm not in BLOCK_MS:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, got {bm}")
    y, done, ng, x = mma_output(x, N, G, nc * MMA_CHUNK[4], "lut_wgmma_gluon")
    if done:
        return y
    grid_n, grid_m = cdiv(nrt, 4), cdiv(M, bm)
    split, per, ws, locks = split_plan(cfg.get("split_k"), ng, grid_n * grid_m, cfg["ctas_per_sm"], y)
    kw = dict(GROUP=G, BLOCK_M=bm, USE_SPLIT=split > 1, XPF=int(cfg.get("xpf", 2)), num_warps=4)
    if cfg.get("maxnreg"):
        kw["maxnreg"] = int(cfg["maxnreg"])
    smem_tab = cfg.get("smem_table", False)
    if smem_tab not in (False, True):
        raise ValueError(f"smem_table must be False or True, got {smem_tab!r}")
    args = (x, qweight, scales, pairs, y, ws, locks, M, N, nrt, nc, ng, per, split, x.stride(0), scales.stride(0),
            y.stride(0))
    grid = (grid_n, grid_m, split)
    tab_off = 0
    if smem_tab:  # passed only when set (byte-table launches keep their kernels); the table past Gluon's buffers
        kw["SMEM_TAB"] = 1
        tab_off = table_offset(_lut_gluon_kernel, args, grid, kw)
    LAST_COMPILED["gluon"] = _lut_gluon_kernel[grid](*args, tab_off, **kw)
    LAST_COMPILED["gluon_split"] = split
    return y
