"""Lookup-table weight-only GEMM op: ``lowbit::lut_gemm`` (FLUTE, seed 002).

``lut_gemm(x [..., K], packed weight) -> y [..., N]``, y = x @ W_hat^T with W_hat = T[c] * s
(layouts: ``lowbit.formats.lut``). Dispatch:

- bf16/fp16 ``x`` on CUDA (or on the CPU under TRITON_INTERPRET=1): layout 'mma' (3 or 4 bits), from 9 tokens
  (8 on gate_up-sized 4-bit weights; ``kernels.lut_wgmma.wgmma_preferred``, session 24) up to ``MAX_WGMMA_M``
  (= 128): the register-table kernel ``lowbit.kernels.lut_wgmma`` (session 12; 3-bit from session 13); at 8..16
  tokens on the smaller weights, at 8 on the larger ones but gate_up, and at 16 on gate_up (4-bit, G in 64 / 128 /
  256, Hopper; ``lut_wgmma_gluon.gluon_tokens``) its Gluon form ``lowbit.kernels.lut_wgmma_gluon`` (session 22);
  otherwise the
  Triton kernels of ``lowbit.kernels.lut_gemm`` for M <= ``MAX_KERNEL_M`` (= 64) rows; above that, the
  Triton dequantize kernel + cuBLAS (``F.linear``), which wins once the product is
  compute-bound (crossover measured by ``lowbit/bench/suites/lut.py`` on H200, gate_up 4-bit:
  kernel faster at M = 64, dequantize + cuBLAS faster from M = 128). The kernels themselves are
  correct for any M (tested up to 300);
- otherwise (float32 ``x``, CPU without the interpreter): the plain-PyTorch reference
  ``lut_gemm_ref`` (dequantize in float32, float32 matmul, cast to x's dtype).

All paths accumulate in float32. ``silu_mul=True`` (a fused gate_up, ``lowbit.nn.lut.fuse_mlp``): the same dispatch
but the Gluon kernel, SiLU*mul in the kernels' epilogues where measured faster, else one ``kernels.silu_mul`` pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit._utils import cached_dense, check_choice, check_rows, check_tensor, derived, run_op, use_triton, warn_once
from lowbit.formats.common import silu_mul_ref
from lowbit.formats.lut import (BITS, GROUP_SIZES, SILU_BLOCK, mma_packed_shapes, packed_shapes, pair_table, unpack_codes,
                                unpack_codes_mma)

MAX_KERNEL_M = 64  # measured crossover on H200 (r2): kernel 0.124 vs 0.176 ms at M=64, 0.234 vs 0.180 at 128
_ACT = (torch.float16, torch.bfloat16)


def dequantize_packed(qweight, qweight_hi, scales, table, bits: int, group_size: int, in_features: int,
                      dtype: torch.dtype = torch.float32, layout: str = "planar") -> torch.Tensor:
    """Reference: packed buffers (``layout`` 'planar' or 'mma') -> W_hat [N, K] (float32 math, then ``dtype``)."""
    if layout == "mma":
        codes = unpack_codes_mma(qweight, qweight_hi, scales.shape[1], in_features, bits, group_size)
    else:
        codes = unpack_codes(qweight, qweight_hi, bits, in_features)
    s = scales.float().t().repeat_interleave(group_size, dim=1)[:, :in_features]
    w = table.to(codes.device, torch.float32)[codes.long()] * s
    return w.to(dtype)


def lut_gemm_ref(x, qweight, qweight_hi, scales, table, bits: int, group_size: int, in_features: int,
                 layout: str = "planar", silu_mul: bool = False) -> torch.Tensor:
    deps = (scales, table) + ((qweight_hi,) if qweight_hi is not None else ())
    w = cached_dense(lambda: dequantize_packed(qweight, qweight_hi, scales, table, bits, group_size, in_features,
                                               layout=layout), qweight, *deps, tag=(bits, group_size, in_features, layout))
    y = (x.float() @ w.t()).to(x.dtype)
    return silu_mul_ref(y, SILU_BLOCK) if silu_mul else y


def _silu_mul(y: torch.Tensor, pdl: bool) -> torch.Tensor:
    """A kernel's full fused gate_up output -> silu(gate) * up (``kernels.silu_mul``, one pass)."""
    from lowbit.kernels.silu_mul import silu_mul_triton

    return silu_mul_triton(y, block=SILU_BLOCK, pdl=pdl)


def _uniform(table: torch.Tensor) -> bool:
    """``table_is_uniform``, kept per table tensor (``_utils.derived``): the check copies the table to the
    host (a device sync), which must not happen on every call."""
    from lowbit.formats.lut import table_is_uniform

    return derived(lambda: table_is_uniform(table), table, tag=("uniform",))


def _pairs_for(table: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Pair table of ``table`` in ``dtype`` on its device, kept per table tensor (``_utils.derived``)."""
    return derived(lambda: pair_table(table, bits, dtype).to(table.device), table, tag=("pairs", bits, dtype))


@torch.library.custom_op("lowbit::lut_gemm", mutates_args=())
def _lut_gemm(x: torch.Tensor, qweight: torch.Tensor, qweight_hi: torch.Tensor | None, scales: torch.Tensor,
              table: torch.Tensor, pairs: torch.Tensor | None, bits: int, group_size: int, lookup: str,
              layout: str = "planar", pdl: bool = False, silu_mul: bool = False) -> torch.Tensor:
    N = scales.shape[1]
    K = x.shape[1]
    if layout == "mma":
        if x.dtype in _ACT and use_triton(x, qweight, scales, table):
            from lowbit.kernels.lut_gemm import lut_dequant_mma_triton, lut_mma_triton
            from lowbit.kernels.lut_wgmma import MAX_WGMMA_M, WGMMA_BITS, lut_wgmma_triton, wgmma_preferred

            M = x.shape[0]
            if pairs is None or pairs.dtype != x.dtype:  # both kernels read the pair table (cached per table)
                pairs = _pairs_for(table, bits, x.dtype)
            from lowbit.kernels import lut_wgmma_gluon as LG

            wg = bits in WGMMA_BITS and M <= MAX_WGMMA_M and wgmma_preferred(M, N, K, bits)
            if silu_mul and wg:  # the epilogue's SiLU*mul beats the Gluon kernel + a separate pass
                return lut_wgmma_triton(x, qweight, scales, pairs, group_size=group_size, out_features=N, bits=bits,
                                        qweight_hi=qweight_hi, silu_mul=True)
            if LG.gluon_preferred(M, N, K, bits, group_size) and LG.supported(x, bits, group_size):
                y = LG.lut_wgmma_gluon(x, qweight, scales, pairs, group_size=group_size, out_features=N)
            elif wg:
                y = lut_wgmma_triton(x, qweight, scales, pairs, group_size=group_size, out_features=N, bits=bits,
                                     qweight_hi=qweight_hi)
            elif M <= MAX_KERNEL_M:  # SiLU*mul in its epilogue but in a PDL chain (kernel docstring: slower there)
                ep = silu_mul and not pdl
                y = lut_mma_triton(x, qweight, qweight_hi, scales, pairs, table, bits=bits, group_size=group_size,
                                   out_features=N, pdl=pdl, silu_mul=ep)
                if ep:
                    return y
            else:
                w = lut_dequant_mma_triton(qweight, qweight_hi, scales, table, bits=bits, group_size=group_size,
                                           out_features=N, in_features=K, dtype=x.dtype)
                y = F.linear(x, w)
            return _silu_mul(y, pdl) if silu_mul else y
        return lut_gemm_ref(x, qweight, qweight_hi, scales, table, bits, group_size, K, layout, silu_mul)
    if x.dtype in _ACT and use_triton(x, qweight, scales, table):
        if lookup == "pair" and (pairs is None or pairs.dtype != x.dtype):
            lookup = "load"
        from lowbit.kernels.lut_gemm import lut_dequant_triton, lut_gemm_triton

        if x.shape[0] <= MAX_KERNEL_M:
            y = lut_gemm_triton(x, qweight, qweight_hi, scales, table, bits=bits, group_size=group_size,
                                out_features=N, lookup=lookup, pairs=pairs)
        else:
            w = lut_dequant_triton(qweight, qweight_hi, scales, table, bits=bits, group_size=group_size,
                                   out_features=N, in_features=K, dtype=x.dtype, lookup=lookup)
            y = F.linear(x, w)
        return _silu_mul(y, False) if silu_mul else y
    return lut_gemm_ref(x, qweight, qweight_hi, scales, table, bits, group_size, K, silu_mul=silu_mul)


@_lut_gemm.register_fake
def _(x, qweight, qweight_hi, scales, table, pairs, bits, group_size, lookup, layout="planar", pdl=False,
      silu_mul=False):
    return x.new_empty((x.shape[0], scales.shape[1] // 2 if silu_mul else scales.shape[1]))


def lut_gemm(x: torch.Tensor, qweight: torch.Tensor, qweight_hi: torch.Tensor | None, scales: torch.Tensor,
             table: torch.Tensor, *, bits: int, group_size: int, lookup: str = "auto",
             pairs: torch.Tensor | None = None, layout: str = "planar", pdl: bool = False,
             silu_mul: bool = False, weight_checked: bool = False) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W_hat^T. ``qweight``/``qweight_hi``/``scales`` [ceil(K/G), N]/
    ``table`` as packed by ``lowbit.formats.lut``; ``lookup`` 'auto' | 'load' | 'select' |
    'affine' | 'pair' ('affine' only for uniform tables; 'pair' needs ``pairs`` =
    ``formats.lut.pair_table(table, bits, x.dtype)``; 'auto' picks 'affine' for uniform tables,
    else 'load'). ``layout``: 'planar' (``formats.lut.pack_codes``) or 'mma' (``formats.lut.pack_codes_mma``,
    the tensor-core fragment kernel; ``lookup`` is then ignored: always the pair table). Float32
    ``x`` always runs the reference. ``pdl`` (layout 'mma', the fragment kernel's range, Hopper): the kernel
    is a programmatic dependent launch, its table set-up before the wait (same result; the runner's
    batch-1 chain); the register-table kernel (9..128 tokens) ignores it. ``silu_mul``: the weight is a fused
    gate_up, its rows interleaved in blocks of ``SILU_BLOCK`` = 8 (``formats.common.interleave_rows(gate, up, 8)``;
    N a multiple of 16), and the result is ``silu(gate) * up`` ``[..., N / 2]`` (``formats.common.silu_mul_ref``'s
    roundings): in the epilogue of the register-table kernel wherever it runs with two dots (preferred to the
    Gluon kernel then) and of the fragment kernel without ``pdl``, else one ``kernels.silu_mul`` pass after the
    GEMM (measured choices: the kernels' docstrings). ``weight_checked``: the caller vouches for the weight tensors'
    shapes, ``bits``, ``group_size``, ``layout`` and x's width (``LUTLinear``): only x's dtype and device and the
    floating buffers' dtypes are checked (host time, session 38)."""
    check_rows(x)
    # the weight checks; a LUTLinear (weight_checked) skips them unless its floating buffers changed dtype (a module
    # cast by .to(dtype) still gets the full checks and their errors)
    full = not (weight_checked and table.dtype == torch.float32 and scales.dtype in _ACT
                and (pairs is None or pairs.dtype in _ACT))
    if full:
        _check_lut_weight(x, qweight, qweight_hi, scales, table, bits, group_size, layout, silu_mul)
    if lookup == "auto":  # layout 'mma' ignores lookup; else decided once per table (host check, cached)
        lookup = "load" if layout == "mma" else ("affine" if _uniform(table) else "load")
    if lookup not in ("load", "global", "smem", "select", "affine", "pair"):
        raise ValueError(f"lookup must be 'auto', 'load', 'global', 'smem', 'select', 'affine' or 'pair', "
                         f"got {lookup!r}")
    if layout == "mma":  # the fragment kernel always reads the pair table (given, or built once and cached)
        ok = pairs is not None and tuple(pairs.shape) == (4 ** bits, 2) and pairs.dtype == x.dtype
        pairs = pairs if ok else None
    elif lookup == "pair":
        check_tensor(pairs, "pairs", shape=(4 ** bits, 2))
        if x.dtype in _ACT and pairs.dtype != x.dtype:
            raise TypeError(f"pairs must have x's dtype {x.dtype} (build with pair_table(table, bits, x.dtype)), "
                            f"got {pairs.dtype}")
    else:
        pairs = None
    devs = {t.device for t in ((x, qweight, scales, table) if full else (x, qweight))}
    if len(devs) > 1:
        raise ValueError(f"x, qweight, scales and table must be on one device, got {sorted(map(str, devs))}")
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != K):
        x2 = x2.contiguous()
    if x.dtype not in _ACT and x.is_cuda:
        warn_once("lut_gemm: float32 activations run the PyTorch reference; pass bf16/fp16 for the kernel")
    y = run_op(_lut_gemm, x2, qweight, qweight_hi, scales, table, pairs, bits, group_size, lookup, layout, bool(pdl),
               bool(silu_mul))
    return y.reshape(*lead, y.shape[-1])


def _check_lut_weight(x, qweight, qweight_hi, scales, table, bits, group_size, layout, silu_mul) -> None:
    """``lut_gemm``'s checks of the weight tensors and options against ``x``'s width."""
    check_choice(bits, "bits", BITS)
    check_choice(group_size, "group_size", GROUP_SIZES)
    check_tensor(scales, "scales", dtype=_ACT, ndim=2)
    check_tensor(table, "table", dtype=torch.float32, shape=(2 ** bits,))
    ng, N = scales.shape
    K = x.shape[-1]
    if ng * group_size < K or (ng - 1) * group_size >= max(K, 1):
        raise ValueError(f"x has K={K} columns but scales cover {ng} groups of {group_size}")
    if layout not in ("planar", "mma"):
        raise ValueError(f"layout must be 'planar' or 'mma', got {layout!r}")
    if layout == "mma":
        qshape, qdtype, hshape = mma_packed_shapes(N, K, bits, group_size)
    else:
        qshape, qdtype, hshape = packed_shapes(N, K, bits)
    check_tensor(qweight, "qweight", dtype=qdtype, shape=qshape)
    if hshape is not None:
        check_tensor(qweight_hi, "qweight_hi", dtype=torch.int32, shape=hshape)
    elif qweight_hi is not None:
        raise ValueError(f"qweight_hi must be None for bits={bits}")
    if silu_mul and N % (2 * SILU_BLOCK):
        raise ValueError(f"silu_mul needs N (gate/up rows interleaved in blocks of {SILU_BLOCK}) a multiple of "
                         f"{2 * SILU_BLOCK}, got N={N}")
