"""INT4 packing: two 4-bit codes per uint8 byte along the last dimension.

Layout: element 2i sits in the low nibble and element 2i+1 in the high nibble of byte i.
Signed codes ([-8, 7], two's complement nibble) and unsigned codes ([0, 15]) pack alike; the
reader states which it expects. An odd last dimension is padded with a zero code.
"""
from __future__ import annotations

import torch


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8/uint8 codes [..., K] in [-8, 7] or [0, 15] -> uint8 [..., ceil(K/2)]."""
    if codes.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    c = codes.to(torch.int16)
    if c.numel() and (c.min() < -8 or c.max() > 15):
        raise ValueError("codes must lie in [-8, 7] (signed) or [0, 15] (unsigned)")
    if c.shape[-1] % 2:
        c = torch.nn.functional.pad(c, (0, 1))
    c = c & 0xF
    lo, hi = c[..., 0::2], c[..., 1::2]
    return (lo | (hi << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, *, signed: bool, k: int | None = None) -> torch.Tensor:
    """uint8 [..., K/2] -> int8 codes [..., K] (signed: [-8, 7]; unsigned: [0, 15]).

    ``k`` trims the padding added for an odd K.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    p = packed.to(torch.int16)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    out = torch.stack((lo, hi), dim=-1).flatten(-2)
    if signed:
        out = out - ((out & 0x8) << 1)
    if k is not None:
        out = out[..., :k]
    return out.to(torch.int8)
