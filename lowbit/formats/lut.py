"""Lookup-table (LUT) weight format of FLUTE (Guo et al., seed 002): tables, reference
quantize / dequantize, and the packed layout the Triton kernel reads.

Math (FLUTE §3, §4.1). A weight ``W [N, K]`` (``nn.Linear`` layout: N = out_features,
K = in_features, the reduction dim) is cut into groups of ``group_size`` consecutive elements
along K (the paper's scale index ``s_{(i*j) mod B}`` is a typo; we use the natural
``s[n, k // group_size]``, notes §5.1). Each element stores a ``bits``-bit code ``c`` into one
tensor-level table ``T`` of ``2**bits`` floats, and dequantizes as

    W_hat[n, k] = T[c[n, k]] * s[n, k // group_size]        (computed in float32)

- ``T`` (float32, ``2**bits`` entries): NormalFloat (``table="nf"``, notes §1.3: quantiles of
  N(0, 1) at 2^(b-1) probabilities in [delta, 1/2] and 2^(b-1)+1 in [1/2, 1-delta],
  delta = (1/30 + 1/32)/2, divided by the largest; NF4 equals QLoRA's NF4), the uniform RTN grid
  (``table="int"``: ``arange(-2^(b-1), 2^(b-1)) / (2^(b-1) - 1)``, so with the absmax scale it is
  exactly notes §2.3's min-max INT quantizer), or any user tensor of ``2**bits`` finite floats.
- ``s`` (``scale_dtype`` = bf16 or fp16, shape ``[N, ceil(K / group_size)]``):
  ``s = max(absmax(group) / max|T|, AMAX_EPS)`` rounded to ``scale_dtype`` and clamped to its
  smallest normal (an fp16 scale cannot underflow to 0). Codes are chosen against the *rounded*
  scale, so the kernel and this reference dequantize identically. All-zero groups give codes of
  the entry nearest 0 and dequantize to ``T[c0] * tiny`` (exactly 0 for NF and INT tables): never
  0/0. Learned scales (FLUTE §4.2, ``lowbit.ptq.nfl``) replace ``s``; codes then follow them.
- Code choice: nearest table entry (argmin |T - W/s|); an exact tie between two entries goes to
  the smaller value (``searchsorted`` on the midpoints). For the uniform table this differs from
  ``torch.round``'s half-to-even only on exact ties.
- K is zero-padded to ``Kp = ceil(K / group_size) * group_size``; padded codes are those of 0.

Packed layout (kernel side, "offline restructuring", FLUTE §3.1). Rows are output channels; each
row holds its Kp codes in K order, little-endian inside a word, so one 16-byte load carries 32
(4-bit), 42.7 (3-bit) or 64 (2-bit) codes and every plane row starts 16-byte aligned when
``Kp % 128 == 0``:

- 4-bit: ``qweight`` int32 ``[N, Kp/8]``, code of k in bits ``4*(k%8)`` of word ``k//8``.
- 2-bit: ``qweight`` int32 ``[N, Kp/16]``, code of k in bits ``2*(k%16)`` of word ``k//16``.
- 3-bit: bit-sliced 1 + 2 (as FLUTE, after FP6-LLM): ``qweight`` int64 ``[N, Kp/32]`` holds
  the low 2 bits (code of k in bits ``2*(k%32)`` of word ``k//32``) and ``qweight_hi`` int32
  ``[N, Kp/32]`` the high bit (bit ``k%32`` of word ``k//32``). Two planes, each read with its
  own wide load and recombined in registers: 3.0 bits per weight, no padding.
- scales: ``[Kp/group_size, N]`` (group-major, transposed from the reference layout), so the
  ``BLOCK_N`` scales one K step needs are one contiguous load.

FLUTE's further permutation into tensor-core fragment order is not needed: the Triton kernel
unpacks with a reshape and lets the compiler place the dequantized tile in the dot operand layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.formats.common import AMAX_EPS

BITS = (2, 3, 4)
GROUP_SIZES = (32, 64, 128, 256)
SCALE_DTYPES = (torch.bfloat16, torch.float16)
NF_DELTA = 0.5 * (1.0 / 30.0 + 1.0 / 32.0)

__all__ = [
    "BITS", "GROUP_SIZES", "SCALE_DTYPES", "nf_table", "int_table", "make_table", "table_is_uniform",
    "LUTWeight", "quantize_lut", "dequantize_lut", "nearest_codes", "pack_codes", "unpack_codes",
    "packed_shapes", "bits_per_weight",
]


def _check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return int(bits)


def nf_table(bits: int = 4) -> torch.Tensor:
    """NormalFloat table of ``2**bits`` float32 values in [-1, 1] (notes §1.3, FLUTE §4.2).

    Asymmetric: 2^(b-1)-1 negative values, an exact 0, 2^(b-1) positive values. ``nf_table(4)``
    is QLoRA's NF4 table.
    """
    bits = _check_bits(bits)
    half = 2 ** (bits - 1)
    neg = torch.linspace(NF_DELTA, 0.5, half, dtype=torch.float64)  # ends at 1/2 -> 0
    pos = torch.linspace(0.5, 1.0 - NF_DELTA, half + 1, dtype=torch.float64)[1:]
    q = torch.special.ndtri(torch.cat([neg, pos]))
    q[half - 1] = 0.0
    return (q / q[-1]).float()


def int_table(bits: int = 4) -> torch.Tensor:
    """Uniform (RTN) grid ``arange(-2^(b-1), 2^(b-1)) / (2^(b-1) - 1)``: with an absmax scale
    this is min-max symmetric INT quantization, clamp(round(u / s'), -2^(b-1), 2^(b-1) - 1) with
    s' = absmax / (2^(b-1) - 1) (notes §2.3)."""
    bits = _check_bits(bits)
    half = 2 ** (bits - 1)
    return torch.arange(-half, half, dtype=torch.float64).div(half - 1).float()


def make_table(table, bits: int) -> torch.Tensor:
    """'nf' | 'int' | a sequence/tensor of ``2**bits`` finite floats -> float32 [2**bits] (CPU)."""
    bits = _check_bits(bits)
    if isinstance(table, str):
        if table == "nf":
            return nf_table(bits)
        if table == "int":
            return int_table(bits)
        raise ValueError(f"table must be 'nf', 'int' or a tensor of 2**bits floats, got {table!r}")
    t = torch.as_tensor(table).detach().to("cpu", torch.float32).flatten()
    if t.numel() != 2 ** bits:
        raise ValueError(f"table must have 2**bits = {2 ** bits} entries for bits={bits}, got {t.numel()}")
    if not torch.isfinite(t).all():
        raise ValueError("table must hold finite values")
    if t.abs().max() == 0:
        raise ValueError("table must have a nonzero entry")
    return t.clone()


def table_is_uniform(table: torch.Tensor) -> bool:
    """True when ``table[c] == table[0] + c * step`` for every code (to fp32 rounding): the
    kernel may then dequantize by arithmetic instead of a lookup."""
    t = table.detach().double().cpu()
    c = torch.arange(t.numel(), dtype=torch.float64)
    fit = t[0] + c * (t[1] - t[0])
    return bool((fit - t).abs().max() <= 1e-6 * t.abs().max())


def bits_per_weight(bits: int, group_size: int, scale_bits: int = 16) -> float:
    """Stored bits per weight: codes plus one 16-bit scale per group (FLUTE Table 1)."""
    return bits + scale_bits / group_size


@dataclass
class LUTWeight:
    """Reference form: ``codes`` uint8 [N, Kp], ``scales`` [N, Kp/group_size] (bf16/fp16),
    ``table`` float32 [2**bits], the original ``in_features`` K (Kp >= K is padded)."""

    codes: torch.Tensor
    scales: torch.Tensor
    table: torch.Tensor
    bits: int
    group_size: int
    in_features: int


def nearest_codes(u: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest ``table`` entry for each element of ``u`` (ties: smaller value).
    Uses midpoints and ``searchsorted``: no [.., 2**bits] temporary."""
    t = table.to(u.device, torch.float32)
    ts, perm = torch.sort(t)
    mids = (ts[1:] + ts[:-1]) * 0.5
    idx = torch.searchsorted(mids, u.contiguous().float(), right=False)
    return perm[idx].to(torch.uint8)


def _scales_from_amax(amax: torch.Tensor, tmax: float, scale_dtype: torch.dtype) -> torch.Tensor:
    s = (amax.float() / tmax).clamp_min(AMAX_EPS)
    tiny = torch.finfo(scale_dtype).smallest_normal
    return s.clamp_min(tiny).to(scale_dtype)


def quantize_lut(w: torch.Tensor, *, bits: int = 4, group_size: int = 128, table="nf",
                 scale_dtype: torch.dtype = torch.bfloat16, scales: torch.Tensor | None = None) -> LUTWeight:
    """Reference quantizer: ``w`` [N, K] float -> ``LUTWeight``. ``scales`` [N, ceil(K/group)]
    overrides the absmax scales (learned NF, FLUTE §4.2); codes are then nearest under them."""
    bits = _check_bits(bits)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be torch.bfloat16 or torch.float16, got {scale_dtype}")
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        raise ValueError(f"w must be a 2-D tensor [N, K], got {getattr(w, 'shape', type(w))}")
    if not w.is_floating_point():
        raise TypeError(f"w must be floating point, got {w.dtype}")
    if not torch.isfinite(w).all():
        raise ValueError("w has non-finite values")
    t = make_table(table, bits)
    N, K = w.shape
    ng = math.ceil(K / group_size) if K else 0
    Kp = ng * group_size
    wf = torch.nn.functional.pad(w.detach().float(), (0, Kp - K)).reshape(N, ng, group_size)
    if scales is None:
        s = _scales_from_amax(wf.abs().amax(-1), float(t.abs().max()), scale_dtype)
    else:
        if tuple(scales.shape) != (N, ng):
            raise ValueError(f"scales must have shape [{N}, {ng}], got {list(scales.shape)}")
        s = scales.detach().to(w.device).float().abs().clamp_min(torch.finfo(scale_dtype).smallest_normal).to(scale_dtype)
    codes = nearest_codes(wf / s.float().unsqueeze(-1), t).reshape(N, Kp)
    return LUTWeight(codes, s, t, bits, group_size, K)


def dequantize_lut(q: LUTWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W_hat`` [N, K] = T[codes] * scale, computed in float32 then cast to ``dtype``."""
    t = q.table.to(q.codes.device, torch.float32)
    vals = t[q.codes.long()]
    s = q.scales.float().repeat_interleave(q.group_size, dim=1)
    return (vals * s)[:, :q.in_features].to(dtype)


# ----------------------------------------------------------------------------- packing
def packed_shapes(n: int, kp: int, bits: int) -> tuple[tuple, torch.dtype, tuple | None]:
    """(qweight shape, qweight dtype, qweight_hi shape or None) for ``Kp = kp`` padded columns."""
    bits = _check_bits(bits)
    if bits == 4:
        return (n, kp // 8), torch.int32, None
    if bits == 2:
        return (n, kp // 16), torch.int32, None
    return (n, kp // 32), torch.int64, (n, kp // 32)


def _pack_words(vals: torch.Tensor, width: int) -> torch.Tensor:
    """vals int64 [..., 32 // width * ...] grouped as [..., per] -> int32 words (wrapping)."""
    per = 32 // width
    shifts = torch.arange(per, device=vals.device, dtype=torch.int64) * width
    words = (vals.reshape(*vals.shape[:-1], -1, per) << shifts).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def pack_codes(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """uint8 codes [N, Kp] (Kp % 32 == 0) -> (qweight, qweight_hi or None), module docstring layout."""
    bits = _check_bits(bits)
    if codes.ndim != 2 or codes.shape[1] % 32:
        raise ValueError(f"codes must be [N, Kp] with Kp % 32 == 0, got {list(codes.shape)}")
    c = codes.to(torch.int64)
    if c.numel() and (c.min() < 0 or c.max() >= 2 ** bits):
        raise ValueError(f"codes must lie in [0, {2 ** bits - 1}]")
    if bits in (2, 4):
        return _pack_words(c, bits).contiguous(), None
    lo = _pack_words(c & 3, 2)  # [N, Kp/16] int32; two consecutive words = one int64 (little endian)
    hi = _pack_words((c >> 2) & 1, 1)  # [N, Kp/32]
    return lo.contiguous().view(torch.int64), hi.contiguous()


def _unpack_words(words: torch.Tensor, width: int) -> torch.Tensor:
    per = 32 // width
    shifts = torch.arange(per, device=words.device, dtype=torch.int64) * width
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w.unsqueeze(-1) >> shifts) & (2 ** width - 1)).flatten(-2)


def unpack_codes(qweight: torch.Tensor, qweight_hi: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: -> uint8 codes [N, Kp]."""
    bits = _check_bits(bits)
    if bits in (2, 4):
        return _unpack_words(qweight, bits).to(torch.uint8)
    if qweight_hi is None:
        raise ValueError("3-bit codes need qweight_hi (the 1-bit plane)")
    lo = _unpack_words(qweight.contiguous().view(torch.int32), 2)
    hi = _unpack_words(qweight_hi, 1)
    return (lo | (hi << 2)).to(torch.uint8)
