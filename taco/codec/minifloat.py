"""Sub-byte floating-point element formats of the hardware block formats (OCP MX v1.0, NVFP4).

FP6 E2M3, FP6 E3M2 and FP4 E2M1 have no Inf or NaN: every code is a finite value. A code is
`sign << (ebits + mbits) | index`, the index counting the non-negative magnitudes in order
(biased exponent << mbits | mantissa; exponent 0 is the subnormal binade). The cast from fp32 rounds
to nearest, ties to even, and saturates at the largest magnitude, keeping the sign (of zero too),
which is what the MX spec's conversion and the GPUs' `cvt.rn.satfinite` do. FP8 elements use torch's
own float8 dtypes. Codes are written as pure arithmetic and bit operations, so every backend that
follows them gets the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ElementFormat:
    """An element format of a block-scaled code: `bits` wide, `emax` the exponent of its largest
    power of two (the MX spec's emax_elem), `fmax` its largest magnitude."""

    name: str
    bits: int
    ebits: int
    mbits: int
    emax: int
    fmax: float
    torch_dtype: torch.dtype | None = None  # fp8: cast with torch

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1


ELEMENT_FORMATS: dict[str, ElementFormat] = {
    "e4m3": ElementFormat("e4m3", 8, 4, 3, 8, 448.0, torch.float8_e4m3fn),
    "e5m2": ElementFormat("e5m2", 8, 5, 2, 15, 57344.0, torch.float8_e5m2),
    "e2m3": ElementFormat("e2m3", 6, 2, 3, 2, 7.5),
    "e3m2": ElementFormat("e3m2", 6, 3, 2, 4, 28.0),
    "e2m1": ElementFormat("e2m1", 4, 2, 1, 2, 6.0),
}


def to_codes(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """fp32 values (already divided by their block scale) -> uint8 codes of `fmt`, round to nearest
    even, saturating (FP8: the clamp, then torch's cast; NaN stays NaN there, and becomes the largest
    magnitude in the sub-byte formats, whose block scale then says NaN)."""
    if fmt.torch_dtype is not None:
        return x.clamp(-fmt.fmax, fmt.fmax).to(fmt.torch_dtype).view(torch.uint8)
    a = x.abs()
    # the binade of a (the subnormal one below 2^emin), from frexp: a = m 2^E with m in [0.5, 1)
    # (frexp gives E = 0 for a zero, which belongs to the subnormal binade too)
    emin = 1 - fmt.bias
    e = torch.where(a > 0, torch.frexp(a).exponent - 1, emin).clamp_min(emin)
    step = torch.ldexp(torch.ones_like(a), e - fmt.mbits)  # exact powers of two
    k = torch.round(a / step)  # a / step is exact; round is half to even
    top = (1 << (fmt.ebits + fmt.mbits)) - 1
    idx = ((e + fmt.bias) << fmt.mbits) + k.to(torch.int32) - (1 << fmt.mbits)
    # a value rounded up into the next binade lands on that binade's first index: the same formula
    idx = torch.where(a < fmt.fmax, idx.clamp(0, top), torch.full_like(idx, top))  # NaN: top
    sign = torch.signbit(x).to(torch.int32) << (fmt.ebits + fmt.mbits)
    return (idx | sign).to(torch.uint8)


def magnitudes(fmt: ElementFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 2^(bits-1) non-negative values of a sub-byte format, in index order (fp32)."""
    idx = torch.arange(1 << (fmt.bits - 1), device=device)
    be, m = idx >> fmt.mbits, (idx & ((1 << fmt.mbits) - 1)).float()
    normal = torch.ldexp(m + (1 << fmt.mbits), be - fmt.bias - fmt.mbits)
    sub = torch.ldexp(m, torch.full_like(be, 1 - fmt.bias - fmt.mbits))
    return torch.where(be > 0, normal, sub)


def from_codes(q: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """uint8 codes of `fmt` -> their exact fp32 values."""
    if fmt.torch_dtype is not None:
        return q.view(fmt.torch_dtype).float()
    half = 1 << (fmt.bits - 1)
    v = magnitudes(fmt, q.device)[(q & (half - 1)).long()]
    return torch.where((q & half) != 0, -v, v)
