"""Number formats used on the wire: FP8 (E4M3/E5M2), INT8 and bit-packed INT2..INT7.

Kept apart from the codecs so that kernels and tests share one definition of each
format's range and rounding (docs/design.md 1.1: round-to-nearest-even, saturating).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """An FP8 format: its torch dtype and largest finite magnitude FMAX."""

    name: str
    dtype: torch.dtype
    fmax: float


FP8_FORMATS: dict[str, FP8Format] = {
    "e4m3": FP8Format("e4m3", torch.float8_e4m3fn, 448.0),
    "e5m2": FP8Format("e5m2", torch.float8_e5m2, 57344.0),
}


def fp8_format(name: str) -> FP8Format:
    """Look up an FP8 format by name ("e4m3" or "e5m2")."""
    if not isinstance(name, str):
        raise TypeError(f"fmt must be an fp8 format name, one of {sorted(FP8_FORMATS)}; got {name!r}")
    try:
        return FP8_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown fp8 format {name!r}: use one of {sorted(FP8_FORMATS)}") from None


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int values in [-8, 7] (any int dtype, even count along the last dim) into uint8 nibbles.

    Element 2i goes to the low nibble and 2i+1 to the high nibble of byte i (two's complement).
    """
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(b: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [..., n/2] -> int8 [..., n] in [-8, 7]."""
    lo = (b & 0xF).to(torch.int8)
    hi = (b >> 4).to(torch.int8)
    out = torch.stack((lo, hi), dim=-1).flatten(-2)
    return out - ((out >= 8).to(torch.int8) << 4)


def int_qmax(bits: int) -> int:
    """Largest code of a symmetric `bits`-bit integer grid [-qmax, qmax] (2^(bits-1) - 1)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"integer codes have 2..8 bits, got bits={bits!r}")
    return (1 << (bits - 1)) - 1


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int codes of `bits` bits (two's complement; last dim a multiple of 8) LSB first.

    Element i occupies bits [i * bits, (i + 1) * bits) of a little-endian bit stream, so 8 codes
    fill `bits` bytes (int6: 4 codes in 3 bytes). For bits = 4 this is `pack_int4`'s layout and for
    bits = 8 the plain int8 bytes. int [..., n] -> uint8 [..., n * bits / 8].
    """
    if bits == 8:
        return q.to(torch.int8).view(torch.uint8)
    u = (q.to(torch.int64) & ((1 << bits) - 1)).reshape(*q.shape[:-1], -1, 8)
    w = (u << (torch.arange(8, device=q.device) * bits)).sum(-1, keepdim=True)  # <= 56 bits
    b = (w >> (torch.arange(bits, device=q.device) * 8)) & 0xFF
    return b.to(torch.uint8).reshape(*q.shape[:-1], -1)


def unpack_bits(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 [..., m] -> int8 [..., m * 8 / bits], sign-extended."""
    if bits == 8:
        return b.view(torch.int8)
    v = b.to(torch.int64).reshape(*b.shape[:-1], -1, bits)
    w = (v << (torch.arange(bits, device=b.device) * 8)).sum(-1, keepdim=True)
    c = (w >> (torch.arange(8, device=b.device) * bits)) & ((1 << bits) - 1)
    c = c - ((c >> (bits - 1)) << bits)
    return c.to(torch.int8).reshape(*b.shape[:-1], -1)
