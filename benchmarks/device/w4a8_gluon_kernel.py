"""Session 28's probe kernel (issue 3; not in the library: measured, it does not beat the Triton kernel): the
W4A8-FP GEMM for mid-size M in Gluon, INT4 codes decoded into the wgmma A registers, every wgmma async (GPU only,
Hopper). Used by ``s28_w4a8_gluon.py`` (timing, checks), ``w4a8_ncu.py --gluon`` and
``benchmarks/offline_w4a8_gluon.py``.

Same product, format and numerics as ``lowbit.kernels.w4a8_fp8_gemm``'s swap-AB path (FireQ §3.1, Fig. 2)::

    y[m, n] = sx[m] * inv_delta * sum_kt P_kt[n, m]  (+ bias[n])  (+ residual[m, n])
    P_kt[n, m] = sum_{k in tile kt} FP8(q[n, k] * sigma[n, k // g]) * xq[m, k]   (FP8 wgmma, a fresh partial per tile)

Each K tile of 128 is its own partial (the wgmma's fast FP8 accumulation stays within 128 products), added into the
FP32 accumulator in tile order, as the Triton kernel's ``ACC_TILE`` + ``CAT`` do: with the same split-K plan the
outputs were bit-equal to the Triton kernel's on the H200 (7 shapes: ragged N / K, K = 576 and 10944, group 64, bias,
residual, split-K 16; ``s28_w4a8_gluon_r1.json``).

The question it answered: Triton waits on every wgmma right after issuing it, so could explicit async wgmma (the
decode of one tile beside the previous tile's wgmma) close the M = 128 gap to ``torch._scaled_mm``? Layout:

- Program = ``BLOCK_N`` weight rows (the wgmma M, 64 per warpgroup row block) x ``BLOCK_T`` tokens (the wgmma N) x
  one split-K range of K tiles; token blocks vary fastest in the grid. A ``STAGES``-deep TMA ring holds per K tile the
  ``[BLOCK_N, 64 B]`` code box and the two ``[BLOCK_T, 64]`` FP8 halves of the activation tile (zero-filled past M,
  K and the split's end, so a padded tile adds exact zeros), one ``mbarrier`` per slot.
- The code box is read from shared memory straight into the A operand's register layout (``ldmatrix``; 4 code bytes
  per register), decoded by ``FP8_LOOKUP2_PTX`` into the lo / hi halves (code byte j = columns j and 64 + j), two
  async wgmma (lo, hi) into the tile's partial. ``PIPE = 0``: decode, issue, wait(0), fold per tile (the other
  programs on the SM fill the gaps). ``PIPE = 2``: two partials alternate by tile parity, ``wait(2)`` retires tile
  t - 1 (folded while tile t runs) and the next tile is decoded beside it; ``UNROLL`` tiles per loop step, the last
  waits to zero. (Carrying decoded FP8 registers across the loop's back edge made Triton unpack them to one byte per
  register, 255 registers; folding a partial at the top of the next step made ptxas inject a wait, note C7517.)
- Group scales: one FP8 byte per (row, group) loaded a tile ahead, the 8-byte LUT FP8(k * sigma) per row
  (``FP8_LUT_PTX``); groups of 128 and 64. Split-K with the last-arriver reduction of the Triton kernel.

Measured (H200, GEMM alone on pre-quantized x, CUDA graphs over rotated weight copies; ``s28_w4a8_gluon_r{1,2,3}.json``):
the best variant per shape beat the committed Triton path by 2-6 % on qkv (M = 128: 18.5 vs 19.6 us) and gate_up at
M = 256 (96.7 vs 99.2-100.9) and lost elsewhere (gate_up M = 128 52.6 vs 50.5, o M = 128 17.8 vs 16.0, down M = 128
37.6 vs 30.2); 3-4 programs per SM (``maxnreg`` 168 / 128) or 32-token tiles did not help. Nsight Compute (gate_up
M = 128, ``BLOCK_N`` 64, ``BLOCK_T`` 128): 2 warps per scheduler, 4.5 cycles between issues per warp, 34% of the SM's
compute and 55% of L2 throughput used; neither more programs per SM nor 128-row programs (half the activation
tile's L2 re-reads; gate_up M = 128 55.0 us) helped, so the cause is not isolated. Next, untested: per-instruction
stall sampling, then a warp-specialized form (a loader warp, two decoding consumer warpgroups sharing one activation
tile).

Session 32 (``s32_w4a8_gluon_bigm.json``, ``S28_MS=1024,4096``): at full token tiles the best variant runs at about
cuBLAS bf16 speed (0.94-1.09x), 1.3-1.7x slower than the committed dequantize-once + ``torch._scaled_mm`` path.
"""
from __future__ import annotations

import torch

from lowbit._utils import arrival_counters, cdiv
from lowbit.formats.w4a8_fp8 import PACK_BLOCK
from lowbit.kernels.w4a8_fp8_gemm import FP8_LOOKUP2_CONS, FP8_LOOKUP2_PTX, FP8_LUT_PTX, _split_k

try:  # Gluon ships with Triton >= 3.4; the interpreter cannot run it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    HAS_GLUON = True
except Exception:  # pragma: no cover - older Triton
    HAS_GLUON = False

GLUON_GROUPS = (64, 128)
HALF = PACK_BLOCK // 2  # code bytes per row and K tile

if HAS_GLUON:
    _HALF = gl.constexpr(HALF)
    _KT = gl.constexpr(PACK_BLOCK)
    _LUT = gl.constexpr(FP8_LUT_PTX)
    _LOOKUP2 = gl.constexpr(FP8_LOOKUP2_PTX)
    _LOOKUP2_CONS = gl.constexpr(FP8_LOOKUP2_CONS)

    @gluon.jit
    def _luts(S, s_rows, n_ok, kt, GROUP: gl.constexpr):
        """FP8 group scales of K tile ``kt`` for the rows ``s_rows`` -> the lo and hi halves' LUT words
        ``(l0, l1, h0, h1)`` (int32 per row: bytes FP8(k * sigma), k = 0..3 and 4..7)."""
        if GROUP == 128:
            s_lo = gl.load(S + s_rows + kt, mask=n_ok, other=0.0).to(gl.float16)
            l0, l1 = gl.inline_asm_elementwise(_LUT, "=r,=r,h", [s_lo], dtype=(gl.int32, gl.int32), is_pure=True,
                                               pack=1)
            h0 = l0
            h1 = l1
        else:  # GROUP == 64: the lo half is group 2 kt, the hi half 2 kt + 1
            s_lo = gl.load(S + s_rows + 2 * kt, mask=n_ok, other=0.0).to(gl.float16)
            s_hi = gl.load(S + s_rows + 2 * kt + 1, mask=n_ok, other=0.0).to(gl.float16)
            l0, l1 = gl.inline_asm_elementwise(_LUT, "=r,=r,h", [s_lo], dtype=(gl.int32, gl.int32), is_pure=True,
                                               pack=1)
            h0, h1 = gl.inline_asm_elementwise(_LUT, "=r,=r,h", [s_hi], dtype=(gl.int32, gl.int32), is_pure=True,
                                               pack=1)
        return l0, l1, h0, h1

    @gluon.jit
    def _decode(c_slot, luts, a_l: gl.constexpr, BLOCK_N: gl.constexpr):
        """Code box ``[BLOCK_N, 64]`` (shared) -> FP8 ``(w_lo, w_hi)`` ``[BLOCK_N, 64]`` in the A register layout."""
        l0, l1, h0, h1 = luts
        p = c_slot.load(a_l)
        z = gl.zeros([BLOCK_N, _HALF], gl.int32, a_l)
        w_lo, w_hi = gl.inline_asm_elementwise(
            _LOOKUP2, _LOOKUP2_CONS, [p, z + l0[:, None], z + l1[:, None], z + h0[:, None], z + h1[:, None]],
            dtype=(gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)
        return w_lo, w_hi

    @gluon.jit
    def _issue(c_desc, x_desc, c_smem, xl_smem, xh_smem, ready, i, kt0, n_real, NKT, n0, t0, STAGES: gl.constexpr):
        """TMA of loop tile ``i`` (K tile ``kt0 + i``; past the split's last tile: a box past the end, all zeros)
        into slot ``i % STAGES``."""
        st = i % STAGES
        kt = kt0 + i
        if i >= n_real:
            kt = NKT
        bar = ready.index(st)
        mbarrier.expect(bar, c_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(c_desc, [n0, kt * _HALF], bar, c_smem.index(st))
        tma.async_copy_global_to_shared(x_desc, [t0, kt * _KT], bar, xl_smem.index(st))
        tma.async_copy_global_to_shared(x_desc, [t0, kt * _KT + _HALF], bar, xh_smem.index(st))

    @gluon.jit
    def _epilogue(acc, SX, Bias, Res, Y, offs_n, offs_t, M, N, inv_delta, stride_rm, stride_ym,
                  HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr):
        """``acc [BLOCK_N, BLOCK_T]`` (weight rows x tokens, a layout with N along the threads) -> Y[t, n]."""
        t_ok = offs_t < M
        sx = gl.load(SX + offs_t, mask=t_ok, other=0.0)
        y = acc * (sx * inv_delta)[None, :]
        n_ok = offs_n < N
        if HAS_BIAS:
            b = gl.load(Bias + offs_n, mask=n_ok, other=0.0)
            y += b.to(gl.float32)[:, None]
        mask = n_ok[:, None] & t_ok[None, :]
        if HAS_RES:
            r = gl.load(Res + offs_t.to(gl.int64)[None, :] * stride_rm + offs_n[:, None], mask=mask, other=0.0)
            y = y.to(Y.dtype.element_ty).to(gl.float32) + r.to(gl.float32)
        gl.store(Y + offs_t.to(gl.int64)[None, :] * stride_ym + offs_n[:, None], y.to(Y.dtype.element_ty), mask=mask)

    @gluon.jit
    def _w4a8_gluon_kernel(c_desc, x_desc, S, SX, Bias, Res, Y, WS, LOCKS,
                           M, N, NKT, PER, SPLIT_K, inv_delta, stride_sn, stride_rm, stride_ym,
                           GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr,
                           UNROLL: gl.constexpr, PIPE: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                           USE_SPLIT: gl.constexpr):
        """Module docstring. Grid: (token blocks of ``BLOCK_T``, weight row blocks of ``BLOCK_N``, splits);
        ``PER`` K tiles per split (the last split shorter)."""
        NW: gl.constexpr = gl.num_warps()
        pid_t = gl.program_id(0)  # token blocks vary fastest: programs running together share the code tiles
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        n0 = pid_n * BLOCK_N
        t0 = pid_t * BLOCK_T
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, BLOCK_T, 32])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
        c_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, _HALF], c_desc.layout)
        xl_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_T, _HALF], x_desc.layout)
        xh_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_T, _HALF], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(STAGES):
            mbarrier.init(ready.index(b), count=1)
        fence_async_shared()

        kt0 = pid_k * PER
        n_real = gl.minimum(PER, NKT - kt0)  # real K tiles of this split
        n_loop = gl.cdiv(n_real, UNROLL) * UNROLL  # padded to whole loop steps (zero tiles)
        for b in gl.static_range(STAGES):
            if b < n_loop:
                _issue(c_desc, x_desc, c_smem, xl_smem, xh_smem, ready, b, kt0, n_real, NKT, n0, t0, STAGES)

        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
        n_ok = rows < N
        s_rows = rows.to(gl.int64) * stride_sn
        luts = _luts(S, s_rows, n_ok, kt0, GROUP)
        acc = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, acc_l)
        if PIPE == 0:
            # per tile: decode, two async wgmma, wait(0), fold (the other programs on the SM fill the gaps)
            for i in range(0, n_loop):
                st = i % STAGES
                luts_next = _luts(S, s_rows, n_ok & (i + 1 < n_real), kt0 + i + 1, GROUP)
                mbarrier.wait(ready.index(st), (i // STAGES) & 1)
                w_lo, w_hi = _decode(c_smem.index(st), luts, a_l, BLOCK_N)
                p = warpgroup_mma(w_lo, xl_smem.index(st).permute((1, 0)), acc, use_acc=False, is_async=True)
                p = warpgroup_mma(w_hi, xh_smem.index(st).permute((1, 0)), p, is_async=True)
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                acc += p
                gl.thread_barrier()  # tile i's slot is free in every warp: refill it
                if i + STAGES < n_loop:
                    _issue(c_desc, x_desc, c_smem, xl_smem, xh_smem, ready, i + STAGES, kt0, n_real, NKT, n0, t0,
                           STAGES)
                luts = luts_next
        else:
            pa = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, acc_l)
            pb = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, acc_l)
            wa_lo = gl.zeros([BLOCK_N, _HALF], gl.float8e4nv, a_l)
            wa_hi = wa_lo
            wb_lo = wa_lo
            wb_hi = wa_lo
            for j in range(0, n_loop, UNROLL):
                for u in gl.static_range(UNROLL):
                    i = j + u
                    st = i % STAGES
                    luts_next = _luts(S, s_rows, n_ok & (i + 1 < n_real), kt0 + i + 1, GROUP)
                    mbarrier.wait(ready.index(st), (i // STAGES) & 1)
                    if u % 2 == 0:
                        wa_lo, wa_hi = _decode(c_smem.index(st), luts, a_l, BLOCK_N)
                        pa = warpgroup_mma(wa_lo, xl_smem.index(st).permute((1, 0)), pa, use_acc=False, is_async=True)
                        pa = warpgroup_mma(wa_hi, xh_smem.index(st).permute((1, 0)), pa, is_async=True)
                        if u > 0:  # tile i - 1 (odd) retires; fold it beside this tile
                            pb = warpgroup_mma_wait(num_outstanding=2, deps=(pb,))
                            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc + pb,))
                    else:
                        wb_lo, wb_hi = _decode(c_smem.index(st), luts, a_l, BLOCK_N)
                        pb = warpgroup_mma(wb_lo, xl_smem.index(st).permute((1, 0)), pb, use_acc=False, is_async=True)
                        pb = warpgroup_mma(wb_hi, xh_smem.index(st).permute((1, 0)), pb, is_async=True)
                        pa = warpgroup_mma_wait(num_outstanding=2, deps=(pa,))
                        acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc + pa,))
                    if u == UNROLL - 1:  # nothing in flight across the back edge: the step's last tile is folded here
                        pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
                        acc += pb
                    # slots of retired tiles are free in every warp: refill them (tile i - 1's, retired by the wait
                    # above for u > 0 (for u = 0 at the previous step's end), and tile i's at the step's end)
                    gl.thread_barrier()
                    if u > 0:
                        if i - 1 + STAGES < n_loop:
                            _issue(c_desc, x_desc, c_smem, xl_smem, xh_smem, ready, i - 1 + STAGES, kt0, n_real, NKT, n0,
                                   t0, STAGES)
                    if u == UNROLL - 1:
                        if i + STAGES < n_loop:
                            _issue(c_desc, x_desc, c_smem, xl_smem, xh_smem, ready, i + STAGES, kt0, n_real, NKT, n0, t0,
                                   STAGES)
                    luts = luts_next
        for b in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(b))

        # epilogue in a layout with N along the threads (coalesced stores of Y's rows)
        out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[32, 1],
                                               warps_per_cta=[1, NW], order=[0, 1])
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
        offs_t = t0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, out_l))
        res = gl.convert_layout(acc, out_l)
        if USE_SPLIT:
            mask = (offs_n < N)[:, None] & (offs_t < M)[None, :]
            ws = WS + offs_t.to(gl.int64)[None, :] * N + offs_n[:, None]
            gl.store(ws + pid_k.to(gl.int64) * M * N, res, mask=mask)
            gl.thread_barrier()  # every thread's partial is written before the release below
            tile = pid_n * gl.num_programs(0) + pid_t
            arrived = gl.atomic_add(LOCKS + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tot = gl.zeros([BLOCK_N, BLOCK_T], gl.float32, out_l)
                for sk in range(0, SPLIT_K):
                    tot += gl.load(ws + sk * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                _epilogue(tot, SX, Bias, Res, Y, offs_n, offs_t, M, N, inv_delta, stride_rm, stride_ym,
                          HAS_BIAS, HAS_RES)
                gl.atomic_xchg(LOCKS + tile, 0, sem="relaxed", scope="gpu")
        else:
            _epilogue(res, SX, Bias, Res, Y, offs_n, offs_t, M, N, inv_delta, stride_rm, stride_ym,
                      HAS_BIAS, HAS_RES)


def supported(xq: torch.Tensor, codes: torch.Tensor, group_size: int, *, silu_mul: bool = False,
              tiled: bool = False) -> bool:
    """Whether this kernel can run the GEMM: Gluon on a Hopper GPU, FP8 x with K % 16 == 0 and 16-byte aligned rows
    (TMA), row-major codes with 16-byte aligned rows, group 64 / 128, no fused SiLU*mul."""
    return (HAS_GLUON and xq.is_cuda and not silu_mul and not tiled and group_size in GLUON_GROUPS
            and torch.cuda.get_device_capability(xq.device)[0] == 9
            and xq.shape[1] % 16 == 0 and xq.stride(0) % 16 == 0 and xq.data_ptr() % 16 == 0
            and codes.stride(0) % 16 == 0 and codes.data_ptr() % 16 == 0)


def gluon_config(M: int, N: int, K: int) -> dict:
    """Launch parameters: ``block_n`` weight rows (64 per warpgroup), ``block_t`` tokens, ``stages``, ``unroll`` and
    the split-K (until the programs fill the GPU ``ctas_per_sm`` times, keeping >= 4 K tiles per split)."""
    bt = 64 if M <= 64 else 128
    cfg = dict(block_n=64, block_t=bt, stages=4, unroll=2, pipe=0, num_warps=4, ctas_per_sm=2)
    return cfg


LAST_COMPILED: dict = {}


def w4a8_fp8_gluon(xq: torch.Tensor, sx: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, inv_delta: float,
                   group_size: int, *, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.bfloat16, **overrides) -> torch.Tensor:
    """Launch ``_w4a8_gluon_kernel`` on checked arguments (``lowbit.kernels.w4a8_fp8_gemm.w4a8_fp8_gemm`` checks them
    and dispatches here): ``xq [M, K]`` FP8, ``sx [M]`` fp32, ``codes [N, Kp/2]`` uint8, ``scales [N, Gp]`` FP8.
    ``overrides``: ``block_n`` (64 / 128), ``block_t``, ``stages``, ``unroll`` (even), ``split_k``, ``ctas_per_sm``."""
    M, K = xq.shape
    N = codes.shape[0]
    if not supported(xq, codes, group_size):
        raise ValueError("w4a8_fp8_gluon needs a Hopper GPU with Gluon, FP8 x with K % 16 == 0 and 16-byte aligned "
                         f"rows, and group_size in {GLUON_GROUPS}; got {xq.device}, K={K}, group_size={group_size}")
    cfg = gluon_config(M, N, K)
    cfg.update(overrides)
    bn, bt, unroll = int(cfg["block_n"]), int(cfg["block_t"]), int(cfg["unroll"])
    nw = int(cfg["num_warps"])
    if bn not in (64, 128, 256) or bn % (16 * nw) or bt not in (16, 32, 64, 128, 256) or unroll % 2 or unroll < 2:
        raise ValueError(f"block_n must be 64, 128 or 256 (a multiple of 16 x num_warps), block_t 16..256 (a power of "
                         f"two) and unroll even >= 2; got {bn}, {bt}, {unroll}, num_warps={nw}")
    y = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0 or N == 0:
        return y
    nkt = cdiv(K, PACK_BLOCK)
    grid_n, grid_t = cdiv(N, bn), cdiv(M, bt)
    split = cfg.get("split_k") or _split_k(grid_n * grid_t, nkt, cfg["ctas_per_sm"] * torch.cuda.get_device_properties(
        xq.device).multi_processor_count)
    per = cdiv(nkt, split)
    split = cdiv(nkt, per)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=xq.device) if split > 1 else y
    locks = arrival_counters("w4a8_fp8_gluon", xq.device, grid_n * grid_t) if split > 1 else y
    c_desc = GluonTensorDescriptor(codes, list(codes.shape), [codes.stride(0), 1], [bn, HALF],
                                   gl.NVMMASharedLayout.get_default_for([bn, HALF], gl.uint8))
    x_desc = GluonTensorDescriptor(xq, [M, K], [xq.stride(0), 1], [bt, HALF],
                                   gl.NVMMASharedLayout.get_default_for([bt, HALF], gl.float8e4nv))
    dummy = sx
    k = _w4a8_gluon_kernel[(grid_t, grid_n, split)](
        c_desc, x_desc, scales, sx, bias if bias is not None else dummy, residual if residual is not None else dummy,
        y, ws, locks, M, N, nkt, per, split, float(inv_delta), scales.stride(0),
        residual.stride(0) if residual is not None else 0, y.stride(0),
        GROUP=group_size, BLOCK_N=bn, BLOCK_T=bt, STAGES=int(cfg["stages"]), UNROLL=unroll, PIPE=int(cfg["pipe"]),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, USE_SPLIT=split > 1, num_warps=int(cfg["num_warps"]),
        **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {}),
    )
    LAST_COMPILED["kernel"] = k
    return y
