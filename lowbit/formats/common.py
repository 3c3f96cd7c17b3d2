"""Shared scale rules and per-token reference quantizers (FP8 E4M3 and INT8).

Scale rule used by every lowbit format (one place, so kernels and references agree):

    amax_c = max(amax, AMAX_EPS)          # AMAX_EPS = 1e-12: an all-zero row/group gives scale
    scale  = amax_c / qmax  (float32)     #   AMAX_EPS/qmax, codes 0, dequant 0 (never 0/0 = NaN)
    q      = cast(clamp(x / scale, -qmax, qmax))

- no 0/0: all-zero groups get codes 0 and dequantize to exactly 0;
- no overflow from a tiny amax: scale >= 1e-12/qmax, so 1/scale stays finite in fp32;
- FP8 E4M3 (``torch.float8_e4m3fn``) has no infinity and maps out-of-range values to NaN, so we
  always clamp to +-448 before the cast; the cast rounds to nearest even.
- INT rounding is round-half-to-even (``torch.round``; ``libdevice.rint`` in kernels).
"""
from __future__ import annotations

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
INT4_MAX = 7.0
AMAX_EPS = 1e-12

QMAX = {FP8_E4M3: FP8_E4M3_MAX, torch.int8: INT8_MAX}


def div_ieee(x: torch.Tensor, d: float) -> torch.Tensor:
    """``x / d`` correctly rounded on every device. PyTorch's CUDA kernel divides by a Python scalar as a multiply by
    its reciprocal (up to an ulp off, where the CPU divides exactly). Where the quotient is then rounded to a coarse
    grid that matters: a bf16 row's amax / 7 can be exactly an E4M3 rounding tie, which the reciprocal breaks the other
    way (found on the H200, session 35: the KV4 and ``w4a8-fp8`` scales; ``safe_scale`` too, where a 1-ulp fp32 scale
    moves a code only at an exact tie). Dividing by a tensor is IEEE everywhere."""
    return x / torch.full_like(x, d)


def inf_to_nan(t: torch.Tensor) -> torch.Tensor:
    """An infinite maximum (or range) becomes NaN: the reference side of ``lowbit.kernels.act_quant.amax_floor``. A row
    with an Inf gets a NaN scale, so every output that reads it is NaN (a NaN in the row already makes amax NaN)."""
    return torch.where(torch.isinf(t), float("nan"), t)


def safe_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """float32 scale = max(amax, AMAX_EPS) / qmax (see module docstring), the quotient IEEE on every device."""
    return div_ieee(amax.float().clamp_min(AMAX_EPS), qmax)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp to the format's range and cast (RNE). ``x`` is already divided by its scale."""
    qmax = QMAX[dtype]
    x = x.clamp(-qmax, qmax)
    if dtype == torch.int8:
        return torch.round(x).to(torch.int8)
    return x.to(dtype)


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype = FP8_E4M3):
    """Per-row (last dim) symmetric quantization. Returns (q: dtype [..., K], scale: fp32 [...]).

    Reference for ``lowbit.ops.quant.per_token_quant`` and its Triton kernel.
    """
    if dtype not in QMAX:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.int8, got {dtype}")
    xf = x.float()
    scale = safe_scale(xf.abs().amax(dim=-1), QMAX[dtype])
    q = round_to(xf / scale.unsqueeze(-1), dtype)
    return q, scale


def dequantize_per_token(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def int8_planes(x: torch.Tensor, eps: float = AMAX_EPS):
    """Each row (last dim) of ``x`` as two INT8 planes, ~15 bits: ``x ~= amax / 127 * (hi + lo / 254)``. In fp32:
    ``a = max(amax, eps)``, ``u = x / a * 127``, ``hi = floor(u + 0.5)``, ``lo = floor((u - hi) * 254 + 0.5)``, both
    in [-127, 127] (error <= a / 64516 per element). Returns (hi int8, lo int8, a fp32 [...]). The one reference of
    the kv4 decode's two-plane Q (``eps = 1e-30``, its kernel's floor) and of the ``w8`` activations."""
    xf = x.float()
    a = xf.abs().amax(dim=-1, keepdim=True).clamp_min(eps)
    u = xf / a * INT8_MAX
    hi = torch.floor(u + 0.5)
    lo = torch.floor((u - hi) * 254.0 + 0.5)
    return hi.to(torch.int8), lo.to(torch.int8), a.squeeze(-1)


def tile_rows(codes: torch.Tensor, rows: int, chunk: int = 64) -> torch.Tensor:
    """Row-block tiling of packed codes ``[N, B]`` (B a multiple of ``chunk``), flat uint8: the first
    ``rows * (N // rows)`` rows as blocks of ``rows`` rows x ``chunk`` bytes, block (t, c) at byte
    ``(t * B/chunk + c) * rows * chunk`` (one contiguous read per (row tile, K chunk)); the remaining
    rows follow row-major. Used by the decode GEMMs' tiled code layouts (w4a8-fp8, w4a8-int8)."""
    n, b = codes.shape
    nh = (n // rows) * rows
    head = codes[:nh].reshape(nh // rows, rows, b // chunk, chunk).permute(0, 2, 1, 3)
    return torch.cat((head.reshape(-1), codes[nh:].reshape(-1)))


def untile_rows(flat: torch.Tensor, n: int, b: int, rows: int, chunk: int = 64) -> torch.Tensor:
    """Inverse of ``tile_rows``: flat tiled bytes -> codes ``[n, b]``."""
    nh = (n // rows) * rows
    flat = flat.reshape(-1)
    head = flat[:nh * b].reshape(nh // rows, b // chunk, rows, chunk).permute(0, 2, 1, 3)
    return torch.cat((head.reshape(-1), flat[nh * b:])).reshape(n, b)



def interleave_rows(a: torch.Tensor, b: torch.Tensor, block: int = 1) -> torch.Tensor:
    """A fused gate_up weight: ``a`` (gate) and ``b`` (up) ``[N, ...]`` -> ``[2N, ...]`` with their rows alternating
    in blocks of ``block`` (``a[0:block], b[0:block], a[block:2 block], ...``; N a multiple of ``block``). The
    GEMM epilogue then finds gate and up of one output column in one tile: ``block`` 1 for w4a8-fp8 (adjacent
    columns), 8 for the LUT layout (rows g / g + 8 of each 16-row fragment tile: ``kernels.lut_wgmma``)."""
    n = a.shape[0]
    if b.shape != a.shape or n % block:
        raise ValueError(f"interleave_rows needs two equal shapes with rows a multiple of block={block}, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    ab = torch.stack((a.reshape(n // block, block, *a.shape[1:]), b.reshape(n // block, block, *b.shape[1:])), 1)
    return ab.reshape(2 * n, *a.shape[1:])


def split_interleaved(y: torch.Tensor, block: int = 1, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``interleave_rows`` along ``dim`` of an output (or weight): ``(gate, up)`` views."""
    y = y.movedim(dim, -1)
    n2 = y.shape[-1]
    if n2 % (2 * block):
        raise ValueError(f"split_interleaved: size {n2} is not a multiple of 2 * block = {2 * block}")
    t = y.reshape(*y.shape[:-1], n2 // (2 * block), 2, block)
    g, u = t[..., 0, :].reshape(*y.shape[:-1], n2 // 2), t[..., 1, :].reshape(*y.shape[:-1], n2 // 2)
    return g.movedim(-1, dim), u.movedim(-1, dim)


def silu_mul_ref(y: torch.Tensor, block: int = 1) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate_up output ``y [..., 2n]`` (``interleave_rows(.., block)``), in y's dtype
    with each of gate, up, silu(gate) and the product rounded to it (the eager Llama MLP's roundings; float32 y:
    no rounding). The numerics of every lowbit SiLU*mul epilogue."""
    g, u = split_interleaved(y, block)
    dt = y.dtype
    return (torch.nn.functional.silu(g.float()).to(dt).float() * u.float()).to(dt)
