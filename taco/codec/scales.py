"""Per-group scale formats on the wire: fp32 (4 bytes), bf16 (2 bytes), e8m0 (1 byte, a power of two).

Why: at G=128 an fp32 scale costs 4/G = 0.031 B/elem, 4% of an int6 payload; bf16 halves that and
e8m0 (OCP MX's exponent-only byte) quarters it. A scale is rounded UP onto its format's grid before
the group is quantized with it (the codes then never exceed FMAX/qmax, and decode multiplies by
exactly the stored value), so a lean scale only costs the unused top of the code range.

- fp32: unchanged (the default; today's wire format, byte for byte);
- bf16: fp32 bits rounded up to the next multiple of 2^16, capped at bf16's largest finite value;
- e8m0: 2^e, e in [-127, 127], byte e + 127, 255 = NaN; scales above 2^127 store 2^127 (the
  group then saturates: only amax > qmax * 2^127, beyond fp32 for qmax >= 2).
NaN scales (non-finite groups, docs/design.md 4) stay NaN in every format. Pure integer bit
operations, so the Triton kernels (`taco.kernels.triton_bits`) reproduce them bit for bit.
"""

from __future__ import annotations

import math

import torch

SCALE_FORMATS: dict[str, int] = {"fp32": 4, "bf16": 2, "e8m0": 1}
"""Format name -> bytes per scale."""

BF16_MAX_BITS = 0x7F7F0000  # bf16's largest finite value, as fp32 bits


def max_scale(fmt: str) -> float:
    """The largest finite scale of `fmt` (fp32's max, bf16's max, 2^127): where a scale saturates."""
    if fmt == "e8m0":
        return 2.0**127
    return torch.finfo(torch.float32 if fmt == "fp32" else torch.bfloat16).max


def check_scale_fmt(name: object) -> str:
    """Validate a scale format name ("fp32", "bf16" or "e8m0")."""
    if not isinstance(name, str) or name not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt={name!r} is not supported: use one of {list(SCALE_FORMATS)}")
    return name


def scale_bytes(fmt: str) -> int:
    return SCALE_FORMATS[fmt]


def _e8m0_code(s: torch.Tensor) -> torch.Tensor:
    """int32 exponent byte of the smallest power of two >= s (s > 0 or NaN), clamped to [0, 254]."""
    u = s.view(torch.int32)
    e, m = (u >> 23) & 0xFF, u & 0x7FFFFF
    b = torch.where(e == 0, (m > 0x400000).to(torch.int32), e + (m != 0).to(torch.int32))
    b = b.clamp(0, 254)
    return torch.where(torch.isnan(s), torch.full_like(b, 255), b)


def _e8m0_value(b: torch.Tensor) -> torch.Tensor:
    """Exponent bytes (int32) -> exact fp32 values 2^(b - 127) (255 -> NaN)."""
    bits = torch.where(b == 0, torch.full_like(b, 0x400000), b << 23)
    v = bits.view(torch.float32)
    return torch.where(b == 255, torch.full_like(v, math.nan), v)


def round_up(s: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 scales (> 0 or NaN) -> the smallest value of `fmt` >= s (capped at its largest), as fp32."""
    if fmt == "fp32":
        return s
    s = s.contiguous()
    if fmt == "bf16":
        r = ((s.view(torch.int32) + 0xFFFF) & ~0xFFFF).clamp_max(BF16_MAX_BITS).view(torch.float32)
        return torch.where(torch.isnan(s), s, r)
    return _e8m0_value(_e8m0_code(s))


def to_bytes(s: torch.Tensor, fmt: str) -> torch.Tensor:
    """Scales already on `fmt`'s grid (from `round_up`) -> their wire bytes, uint8 [numel * bytes]."""
    s = s.reshape(-1).contiguous()
    if fmt == "fp32":
        return s.view(torch.uint8)
    if fmt == "bf16":
        return (s.view(torch.int32) >> 16).to(torch.int16).view(torch.uint8)
    return _e8m0_code(s).to(torch.uint8)


def from_bytes(buf: torch.Tensor, fmt: str) -> torch.Tensor:
    """Wire bytes (uint8, any alignment) -> fp32 scales [numel / bytes]."""
    if fmt == "e8m0":
        return _e8m0_value(buf.to(torch.int32))
    if buf.storage_offset() % 4 or buf.data_ptr() % 4:
        buf = buf.clone()
    if fmt == "fp32":
        return buf.view(torch.float32)
    return (buf.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
