"""Per-Tensor Scaling (PTS), FireQ Definition 3.2 / Appendix C.1.

Each weight matrix is multiplied by ``delta = 2^n`` before INT4 quantization with FP8 group scales;
``delta^-1`` is applied in the GEMM epilogue (``inv_delta`` of ``lowbit.formats.w4a8_fp8``), so the
float function is unchanged. The point: an FP8 E4M3 group scale ``sigma = amax/7`` below 2^-9
rounds to 0 and zeroes its whole group (Lemma B.1), and scales below 2^-6 are subnormal (fewer
mantissa bits); scaling the tensor up moves them into the normal range.

Rule implemented (``pts_exponent``): the paper's Definition 3.2, literally --
``n`` is the smallest integer ``n >= 0`` such that

1. underflow saturation: ``S(W 2^n) == S(W 2^(n+i))`` for all ``i >= 0``, with the element-wise
   underflow score ``S(W) = sum_w max(0, 7*2^-9 - |w|)``. S is non-increasing in n and reaches a
   constant only once every *nonzero* ``|w| 2^n >= 7*2^-9`` (zeros contribute a constant), so this
   is ``n1 = max(0, ceil(log2(7*2^-9 / min_nonzero|w|)))``;  or
2. overflow guard (Eq. 9): some element has ``7*2^(5-n) <= |w| < 7*2^(6-n)``, i.e.
   ``224 <= 2^n max|w| < 448``: doubling again could push a group's largest LUT entry past the E4M3
   maximum 448. That is ``n2 = floor(log2(448 / max|w|))`` when ``max|w| < 448``.

so ``n = min(n1, n2)``; ``n = 0`` when ``max|w| >= 224`` already (the paper leaves ``max|w| >= 448``
open: we do not scale down, and the FP8 scale clamp at 448 then clips) and for an all-zero tensor.

Where paper and code disagree (notes §1.5, §7.4, §8): the released code tries ``n = 0..14``, stops
at the first ``n`` whose largest *group max* exceeds 448, and picks the ``n`` with the least
*group-max* underflow slack. Its overflow limit (448, i.e. the largest n with ``2^n max < 448``)
gives the same ``n2`` as Eq. 9's window [224, 448); the difference is condition 1, element-wise
(paper) versus group maxima (code). With element-wise S, tiny weights keep S from saturating, so
in practice ``n = n2`` (the largest non-overflowing power of two): that maximises the FP8
precision of the group scales and LUT entries (subnormal scales lose mantissa bits), which is the
point of PTS, so we follow the paper's definition. ``tests/test_cas_pts.py`` checks the rule on
crafted weights.
"""
from __future__ import annotations

import math

import torch

UNDERFLOW = 7 * 2.0 ** -9  # group max below this gives sigma = max/7 < 2^-9 (Lemma B.1)
OVERFLOW_LO = 224.0  # 7 * 2^5: Eq. 9 window [224, 448)
FP8_MAX = 448.0
MAX_EXP = 30


def underflow_score(w: torch.Tensor) -> float:
    """S(W) = sum over elements of max(0, 7*2^-9 - |w|) (Definition 3.2), in float64."""
    return (UNDERFLOW - w.double().abs()).clamp_min(0).sum().item()


def underflow_groups(w: torch.Tensor, group_size: int = 128) -> int:
    """Number of nonzero groups (along the last dim, zero-padded) whose max is below 7*2^-9, i.e.
    whose FP8 scale would underflow to 0 (FireQ App. E.3's statistic)."""
    n, k = w.shape
    g = -(-k // group_size)
    wg = torch.nn.functional.pad(w.float().abs(), (0, g * group_size - k)).reshape(n, g, group_size).amax(-1)
    return int(((wg > 0) & (wg < UNDERFLOW)).sum().item())


def subnormal_groups(w: torch.Tensor, group_size: int = 128) -> int:
    """Number of nonzero groups whose FP8 scale max/7 is subnormal in E4M3 (< 2^-6: fewer than 3
    mantissa bits; includes the underflowing ones)."""
    n, k = w.shape
    g = -(-k // group_size)
    wg = torch.nn.functional.pad(w.float().abs(), (0, g * group_size - k)).reshape(n, g, group_size).amax(-1)
    return int(((wg > 0) & (wg / 7 < 2.0 ** -6)).sum().item())


def exponent_for(w: torch.Tensor, group_size: int = 128, *, pts: bool = True, pts_exp: int | None = None) -> int:
    """The exponent a w4a8-fp8 weight is quantized with: ``pts_exp`` when given, else ``pts_exponent(w)`` with PTS
    on and 0 without (``W4A8FP8Linear.from_weight``'s rule; GPTQ fixes it with this before moving the weights)."""
    if pts_exp is not None:
        return int(pts_exp)
    return pts_exponent(w, group_size) if pts else 0


def pts_exponent(w: torch.Tensor, group_size: int = 128) -> int:
    """PTS's ``n`` (delta = 2^n) for weight ``w`` by the rule in the module docstring.

    ``group_size`` is accepted for the interface (the rule is element-wise, Definition 3.2).
    """
    a = w.detach().abs().double()
    if not torch.isfinite(a).all():
        raise ValueError("w has NaN or Inf entries")
    nz = a[a > 0]
    if nz.numel() == 0:
        return 0
    wmax = nz.max().item()
    wmin = nz.min().item()
    n1 = max(0, math.ceil(math.log2(UNDERFLOW / wmin))) if wmin < UNDERFLOW else 0
    if wmax >= OVERFLOW_LO:
        n2 = 0
    else:
        n2 = math.floor(math.log2(FP8_MAX / wmax))
        # guard float rounding of log2 at exact powers of two: the window is [224, 448)
        while wmax * 2.0 ** n2 >= FP8_MAX:
            n2 -= 1
        while wmax * 2.0 ** (n2 + 1) < FP8_MAX:
            n2 += 1
    return int(min(n1, n2, MAX_EXP))
