"""Number formats used on the wire: FP8 (E4M3/E5M2), INT8 and packed INT4.

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
