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

Packed layout (kernel side, "offline restructuring", FLUTE §3.1). Rows are output channels.
K is cut into packing blocks of ``PB = 16 * PER`` codes (``PER`` = codes per word: 8 at 4-bit,
16 at 2-bit, 32 at 3-bit), and K is zero-padded to ``Kq = ceil(K / PB) * PB`` (padded codes
are 0; the kernel masks x there). Inside a block the codes are stored *planar*: word ``w``
(0..15) of the block holds, in its slot ``j`` (0..PER-1), the code of

    k = block * PB + j * 16 + w

so slot ``j`` of the block's 16 words is the contiguous K slice ``[j*16, j*16 + 16)``. The kernel
loads the 16 words of a row as one 64-byte segment (16-byte vector loads), and extracting slot
``j`` with one shift and mask gives a ``[BLOCK_N, 16]`` tile of codes *in the layout of the load*:
no reshape, no shared-memory round trip, and each 16-wide slice meets x[k0 + 16j : k0 + 16j + 16]
(a K = 16 tensor-core step on the dot path). This plays the role of FLUTE's reorder into MMA
fragment order, for Triton.

- 4-bit: ``qweight`` int32 ``[N, Kq/8]``, slot j = bits ``4j..4j+3``.
- 2-bit: ``qweight`` int32 ``[N, Kq/16]``, slot j = bits ``2j..2j+1``.
- 3-bit: bit-sliced 1 + 2 (as FLUTE, after FP6-LLM): ``qweight`` int64 ``[N, Kq/32]`` holds the
  low 2 bits (slot j = bits ``2j..2j+1`` of the 64-bit word) and ``qweight_hi`` int32
  ``[N, Kq/32]`` the high bit (slot j = bit j). Two planes of the same [N, Kq/32] shape, each read
  with its own wide load and recombined in registers: 3.0 bits per weight, no padding inside.
- scales: ``[ceil(K / group_size), N]`` (group-major, transposed from the reference layout), so
  the ``BLOCK_N`` scales of one group are one contiguous load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit._utils import check_choice
from lowbit.formats.common import AMAX_EPS

BITS = (2, 3, 4)
GROUP_SIZES = (32, 64, 128, 256)
SCALE_DTYPES = (torch.bfloat16, torch.float16)
NF_DELTA = 0.5 * (1.0 / 30.0 + 1.0 / 32.0)

__all__ = [
    "BITS", "GROUP_SIZES", "SCALE_DTYPES", "nf_table", "int_table", "make_table", "table_is_uniform",
    "LUTWeight", "quantize_lut", "dequantize_lut", "nearest_codes", "pack_codes", "unpack_codes",
    "packed_shapes", "packed_k", "pack_lut", "pair_table", "pack_block", "codes_per_word", "bits_per_weight",
    "MMA_CHUNK", "mma_shapes", "mma_packed_shapes", "mma_layout_ok", "pack_codes_mma", "unpack_codes_mma",
]


def _check_bits(bits: int) -> int:
    return check_choice(bits, "bits", BITS)


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
    try:
        t = torch.as_tensor(table).detach().to("cpu", torch.float32).flatten()
    except (TypeError, ValueError, RuntimeError):  # None, a dict, ragged lists: torch's own message names no argument
        raise TypeError(f"table must be 'nf', 'int' or a tensor of 2**bits floats, got {type(table).__name__} "
                        f"{table!r}") from None
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
    _, perm, mids = sorted_midpoints(table, u.device)
    idx = torch.searchsorted(mids, u.contiguous().float(), right=False)
    return perm[idx].to(torch.uint8)


def sorted_midpoints(table: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``table``'s entries sorted ascending (float32), the sort's permutation and the midpoints of neighbours, on
    ``device``: the nearest entry to u is ``perm[#{i: mids[i] < u}]`` (``nearest_codes``; the GPTQ kernel's LUT grid)."""
    ts, perm = torch.sort(table.to(device, torch.float32))
    return ts, perm, (ts[1:] + ts[:-1]) * 0.5


def group_scales(amax: torch.Tensor, tmax: float, scale_dtype: torch.dtype) -> torch.Tensor:
    """Absmax group scale ``amax / max|T|`` (>= AMAX_EPS and the dtype's smallest normal) in ``scale_dtype``."""
    s = (amax.float() / tmax).clamp_min(AMAX_EPS)
    tiny = torch.finfo(scale_dtype).smallest_normal
    return s.clamp_min(tiny).to(scale_dtype)


def quantize_lut(w: torch.Tensor, *, bits: int = 4, group_size: int = 128, table="nf",
                 scale_dtype: torch.dtype = torch.bfloat16, scales: torch.Tensor | None = None) -> LUTWeight:
    """Reference quantizer: ``w`` [N, K] float -> ``LUTWeight``. ``scales`` [N, ceil(K/group)]
    overrides the absmax scales (learned NF, FLUTE §4.2); codes are then nearest under them."""
    bits = _check_bits(bits)
    check_choice(group_size, "group_size", GROUP_SIZES)
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
        s = group_scales(wf.abs().amax(-1), float(t.abs().max()), scale_dtype)
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
WORDS_PER_BLOCK = 16


def codes_per_word(bits: int) -> int:
    return 32 if _check_bits(bits) == 3 else 32 // bits


def pack_block(bits: int) -> int:
    """Codes per packing block (PB): 128 at 4-bit, 256 at 2-bit, 512 at 3-bit."""
    return WORDS_PER_BLOCK * codes_per_word(bits)


def packed_k(k: int, bits: int) -> int:
    """Kq: K rounded up to the packing block."""
    pb = pack_block(bits)
    return -(-k // pb) * pb


def packed_shapes(n: int, k: int, bits: int) -> tuple[tuple, torch.dtype, tuple | None]:
    """(qweight shape, qweight dtype, qweight_hi shape or None) for ``k`` = in_features."""
    kq = packed_k(k, bits)
    if bits == 4:
        return (n, kq // 8), torch.int32, None
    if bits == 2:
        return (n, kq // 16), torch.int32, None
    return (n, kq // 32), torch.int64, (n, kq // 32)


def _planar(c: torch.Tensor, per: int) -> torch.Tensor:
    """[N, Kq] -> [N, Kq/PB, PER, 16]: slot j, word w of each block."""
    n, kq = c.shape
    return c.reshape(n, kq // (per * WORDS_PER_BLOCK), per, WORDS_PER_BLOCK)


def _or_slots(planes: torch.Tensor, width: int, first: int, count: int) -> torch.Tensor:
    """int64 OR of slots [first, first+count) shifted by width*(j-first) -> int32 (wrapping) [N, nb*16]."""
    n, nb = planes.shape[:2]
    shifts = (torch.arange(count, device=planes.device, dtype=torch.int64) * width).view(1, 1, count, 1)
    words = (planes[:, :, first:first + count] << shifts).sum(2)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32).reshape(n, nb * WORDS_PER_BLOCK)


def pack_codes(codes: torch.Tensor, bits: int, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """uint8 codes [N, >= K] (reference layout, K order) -> (qweight, qweight_hi or None) in the
    planar layout of the module docstring. ``k`` (default: codes.shape[1]) = in_features; codes
    beyond ``k`` are dropped and the tail is padded with code 0 up to Kq."""
    bits = _check_bits(bits)
    if codes.ndim != 2:
        raise ValueError(f"codes must be [N, K], got {list(codes.shape)}")
    k = codes.shape[1] if k is None else int(k)
    c = codes[:, :k].to(torch.int64)
    if c.numel() and (c.min() < 0 or c.max() >= 2 ** bits):
        raise ValueError(f"codes must lie in [0, {2 ** bits - 1}]")
    c = torch.nn.functional.pad(c, (0, packed_k(k, bits) - k))
    per = codes_per_word(bits)
    if bits in (2, 4):
        return _or_slots(_planar(c, per), bits, 0, per).contiguous(), None
    lo = _planar(c & 3, per)
    lo_words = torch.stack([_or_slots(lo, 2, 0, 16), _or_slots(lo, 2, 16, 16)], dim=-1)  # little endian
    hi = _or_slots(_planar((c >> 2) & 1, per), 1, 0, 32)
    return lo_words.contiguous().view(torch.int64).squeeze(-1), hi.contiguous()


def _slots(words: torch.Tensor, width: int, count: int, first: int = 0) -> torch.Tensor:
    """int words [N, nb*16] -> int64 [N, nb, count, 16] slot values."""
    n = words.shape[0]
    w = (words.to(torch.int64) & 0xFFFFFFFF).reshape(n, -1, 1, WORDS_PER_BLOCK)
    shifts = (torch.arange(count, device=words.device, dtype=torch.int64) * width).view(1, 1, count, 1)
    return (w >> shifts) & (2 ** width - 1)


def unpack_codes(qweight: torch.Tensor, qweight_hi: torch.Tensor | None, bits: int,
                 k: int | None = None) -> torch.Tensor:
    """Inverse of ``pack_codes``: -> uint8 codes [N, k] in K order (default k = Kq)."""
    bits = _check_bits(bits)
    n = qweight.shape[0]
    if bits in (2, 4):
        c = _slots(qweight, bits, 32 // bits)
    else:
        if qweight_hi is None:
            raise ValueError("3-bit codes need qweight_hi (the 1-bit plane)")
        pair = qweight.contiguous().view(torch.int32).reshape(n, -1, 2)
        lo = torch.cat([_slots(pair[..., 0], 2, 16), _slots(pair[..., 1], 2, 16)], dim=2)
        c = lo | (_slots(qweight_hi, 1, 32) << 2)
    c = c.reshape(n, -1)
    return (c if k is None else c[:, :k]).to(torch.uint8)


def pack_lut(q: LUTWeight) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``LUTWeight`` -> (qweight, qweight_hi or None, scales [ceil(K/G), N]): the kernel's buffers."""
    qw, qh = pack_codes(q.codes, q.bits, q.in_features)
    return qw, qh, q.scales.t().contiguous()


def pair_table(table: torch.Tensor, bits: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FLUTE's vectorized table (§3.2): ``dtype`` [2**(2*bits), 2], row i = the values of a pair
    of codes (first, second; the kernel reads a row as one 32-bit word) of adjacent planar
    slots (j, j+1). The pair index is the bits the kernel extracts in one shift + mask:
    4/2-bit: ``c_j | c_{j+1} << bits``; 3-bit: ``lo_j | lo_{j+1} << 2 | hi_j << 4 | hi_{j+1} << 5``."""
    bits = _check_bits(bits)
    if dtype not in SCALE_DTYPES:
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    i = torch.arange(2 ** (2 * bits), dtype=torch.int64)
    if bits == 3:
        c0 = (i & 3) | (((i >> 4) & 1) << 2)
        c1 = ((i >> 2) & 3) | (((i >> 5) & 1) << 2)
    else:
        c0, c1 = i & (2 ** bits - 1), i >> bits
    t = table.detach().to("cpu", torch.float32).to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    v = t[c0] | (t[c1] << 16)
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32).view(dtype).reshape(-1, 2)


# ----------------------------------------------------------------------------- MMA fragment layout
# A fused gate_up (``lowbit.nn.lut.fuse_mlp``) interleaves gate / up rows in blocks of 8
# (``formats.common.interleave_rows``): rows g / g + 8 of each 16-row fragment tile, so N is a multiple of 16.
SILU_BLOCK = 8
MMA_CHUNK = {4: 64, 3: 128}  # K codes per row tile per loop step of the fragment kernel (4 / 8 mma k-steps)


def mma_shapes(n: int, k: int, bits: int, group_size: int) -> tuple[int, int]:
    """(row tiles NRT = ceil(N/16), chunks NC = Kp/chunk) of the fragment layout; Kp = K padded to
    the group size (the reference padding), so no chunk straddles a scale group."""
    if _check_bits(bits) not in MMA_CHUNK:
        raise ValueError(f"the fragment layout is implemented for bits 3 and 4, got {bits}")
    kp = -(-k // group_size) * group_size
    if kp % MMA_CHUNK[bits]:
        raise ValueError(f"group_size must be a multiple of {MMA_CHUNK[bits]} for the {bits}-bit fragment layout")
    return -(-n // 16), kp // MMA_CHUNK[bits]


def mma_layout_ok(bits: int, group_size: int) -> bool:
    """Whether the fragment layout exists for (bits, group_size): 4-bit g >= 64, 3-bit g >= 128."""
    return bits in MMA_CHUNK and group_size % MMA_CHUNK[bits] == 0


def mma_packed_shapes(n: int, k: int, bits: int, group_size: int) -> tuple[tuple, torch.dtype, tuple | None]:
    """(qweight shape, dtype, qweight_hi shape or None) of the fragment layout."""
    nrt, nc = mma_shapes(n, k, bits, group_size)
    return (nrt, nc * 128), torch.int32, ((nrt, nc * 64) if bits == 3 else None)


def _words(c: torch.Tensor, width: int) -> torch.Tensor:
    """int64 [..., n] fields of ``width`` bits (first = least significant) -> int32 [...]."""
    shifts = torch.arange(c.shape[-1], device=c.device, dtype=torch.int64) * width
    words = (c << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def pack_codes_mma(codes: torch.Tensor, bits: int, group_size: int,
                   k: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """uint8 codes [N, >= K] -> (qweight int32 ``[NRT, NC * 128]``, qweight_hi int32 ``[NRT, NC * 64]``
    or None) in tensor-core fragment order (FLUTE §3.1's offline restructuring, for
    ``mma.sync.m16n8k16``; used by ``kernels.lut_gemm._lut_mma_kernel``).

    Lane ``lane = 4 g + t`` of row tile ``rt`` (16 rows), chunk ``c`` (64 K at 4-bit, 128 K at
    3-bit), k-step ``s`` holds the A fragment: register ``a_b`` (b = 0..3) = one code pair (h = 0, 1)
    of

        row = 16 rt + g + 8 (b & 1),   K = CK c + (CK / 4) t + 4 s + 2 (b >> 1) + h

    i.e. the mma position ``kk = 2 t + h + 8 (b >> 1)`` of k-step ``s`` stands for that K: the K
    order inside a chunk is permuted so that the activations lane ``t`` needs (its B fragments)
    are the contiguous ``x[CK c + (CK/4) t : + CK/4]`` (16-byte loads). A pair is an index into
    ``pair_table`` (low code first). Rows beyond N and K beyond the input are padded with code 0.

    - 4-bit: word ``((rt * NC + c) * 32 + lane) * 4 + s`` (one 16-byte load per lane per chunk),
      byte ``b`` = the pair (low nibble = h 0).
    - 3-bit (bit-sliced 2 + 1, as FLUTE after FP6-LLM): low-2-bit plane word
      ``((rt * NC + c) * 32 + lane) * 4 + e`` holds k-steps ``2 e`` (low nibble of byte b) and
      ``2 e + 1`` (high nibble); a nibble = the pair's low bits (h 0 at bits 0-1, h 1 at 2-3).
      High-bit plane word ``((rt * NC + c) * 32 + lane) * 2 + q`` covers k-steps ``4 q .. 4 q + 3``:
      byte b holds the pair's high bits (h 0 then h 1) of k-steps ``4q + 2, 4q + 3, 4q, 4q + 1`` at
      bits 0-1, 2-3, 4-5, 6-7, so one shift and one select (``lop3``) put a k-step's 6-bit pair
      index into each byte. 3 bits per weight, no padding inside."""
    bits = _check_bits(bits)
    if codes.ndim != 2:
        raise ValueError(f"codes must be [N, K], got {list(codes.shape)}")
    k = codes.shape[1] if k is None else int(k)
    n = codes.shape[0]
    nrt, nc = mma_shapes(n, k, bits, group_size)
    ck = MMA_CHUNK[bits]
    ks = ck // 16
    c = codes[:, :k].to(torch.int64)
    c = torch.nn.functional.pad(c, (0, nc * ck - k, 0, nrt * 16 - n))
    # row = 16 rt + 8 rh + g; K = ck c + (ck/4) t + 4 s + 2 bh + h  ->  [rt, c, g, t, s, bh, rh, h]
    c = c.reshape(nrt, 2, 8, nc, 4, ks, 2, 2).permute(0, 3, 2, 4, 5, 6, 1, 7)
    if bits == 4:
        return _words(c.reshape(nrt, nc * 128, 8), 4).contiguous(), None
    lo = c & 3
    hi = c >> 2
    # lo word e: [s = 2e + so (nibble), b = bh*2 + rh (byte), h] -> field order (b, so, h), 2 bits each
    lo = lo.reshape(nrt, nc, 32, 4, 2, 2, 2, 2)  # [.., e, so, bh, rh, h]
    lo = lo.permute(0, 1, 2, 3, 5, 6, 4, 7).reshape(nrt, nc * 128, 16)
    # hi word q: k-step s = 4q + j, byte b, bit pair position (j + 2) % 4, h
    hi = hi.reshape(nrt, nc, 32, 2, 4, 2, 2, 2)  # [.., q, j, bh, rh, h]
    hi = hi[:, :, :, :, [2, 3, 0, 1]]  # bit-pair position p holds k-step j = (p + 2) % 4
    hi = hi.permute(0, 1, 2, 3, 5, 6, 4, 7).reshape(nrt, nc * 64, 32)  # fields (b, p, h), 1 bit each
    return _words(lo, 2).contiguous(), _words(hi, 1).contiguous()


def unpack_codes_mma(qweight: torch.Tensor, qweight_hi: torch.Tensor | None, n: int, k: int, bits: int,
                     group_size: int) -> torch.Tensor:
    """Inverse of ``pack_codes_mma`` -> uint8 codes [n, k]."""
    bits = _check_bits(bits)
    nrt, nc = mma_shapes(n, k, bits, group_size)

    def fields(w, width, count):
        w = w.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF
        shifts = torch.arange(count, device=w.device, dtype=torch.int64) * width
        return (w >> shifts) & (2 ** width - 1)

    if bits == 4:
        c = fields(qweight.reshape(nrt, nc * 128), 4, 8).reshape(nrt, nc, 8, 4, 4, 2, 2, 2)
    else:
        if qweight_hi is None:
            raise ValueError("3-bit codes need qweight_hi (the 1-bit plane)")
        lo = fields(qweight.reshape(nrt, nc * 128), 2, 16).reshape(nrt, nc, 32, 4, 2, 2, 2, 2)  # e, bh, rh, so, h
        lo = lo.permute(0, 1, 2, 3, 6, 4, 5, 7).reshape(nrt, nc, 8, 4, 8, 2, 2, 2)  # g, t, s, bh, rh, h
        hi = fields(qweight_hi.reshape(nrt, nc * 64), 1, 32).reshape(nrt, nc, 32, 2, 2, 2, 4, 2)  # q, bh, rh, p, h
        hi = hi.permute(0, 1, 2, 3, 6, 4, 5, 7)[:, :, :, :, [2, 3, 0, 1]]  # p -> j
        hi = hi.reshape(nrt, nc, 8, 4, 8, 2, 2, 2)
        c = lo | (hi << 2)
    ks = MMA_CHUNK[bits] // 16
    c = c.reshape(nrt, nc, 8, 4, ks, 2, 2, 2).permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(nrt * 16, nc * MMA_CHUNK[bits])
    return c[:n, :k].to(torch.uint8)
