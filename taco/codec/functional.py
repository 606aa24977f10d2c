"""Reference group quantizers as pure functions on [ng, G] fp32 tensors (the specification).

Every codec in `codecs.py` is a thin wrapper around these; fused kernels (`taco.kernels`)
are tested against them. Shapes: xg [ng, G] fp32; per-group scales [ng, 1] fp32.

Non-finite handling (docs/design.md section 4): a group holding NaN/Inf gets a NaN scale, so the whole
group decodes to NaN (never 0). With all inputs finite every intermediate below is finite, so the
check is made on the group's max after rotation, a [ng, 1] tensor that is computed anyway.
"""

from __future__ import annotations

import math

import torch

from .scales import round_up


def _rotate(x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    return x if h is None else (x @ h) / math.sqrt(h.shape[0])


FLT_MIN = 2.0**-126  # fp32's smallest normal number
SUB = 2.0**-149  # fp32's smallest subnormal: the grid step below FLT_MIN


def absmax_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Scale mapping a group's absmax onto qmax; 1 for all-zero groups, NaN for non-finite ones.

    No clamps: the relative error is the same for groups at 1e-30 and 1e30 (fp32 range permitting).
    Where amax / qmax is below FLT_MIN (absmax < qmax * 2^-126) the scale lives on fp32's subnormal
    grid (steps of 2^-149), where rounding to nearest can give 0 (0 / 0: NaN codes for a finite
    group) or a scale far enough below amax / qmax that the top codes saturate. There the scale
    is rounded up on that grid instead: k * 2^-149 with k = ceil(amax / (qmax * 2^-149)) >= 1
    (qmax * 2^-149 is exact, so k is amax * 2^149 / qmax rounded once, then up; k <= 2^23 and
    the product is exact), so every code fits and finite groups decode finite. Groups whose
    amax / qmax is a normal number keep exactly the scale amax / qmax.
    """
    s = amax / qmax
    up = torch.ceil(amax / (qmax * SUB)) * SUB  # inf for large amax: not selected
    s = torch.where(s < FLT_MIN, up, s)
    s = torch.where(amax > 0, s, torch.ones_like(s))
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, math.nan))


def taco_encode(
    xg: torch.Tensor,
    h: torch.Tensor,
    fp8: torch.dtype,
    fmax: float,
    lam: float,
    target: float,
    sfmt: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TACO encode (docs/design.md 1.1 steps 1-4) -> (q uint8 [ng, G], s_q [ng, 1], s_a [ng, 1]).

    Both scales are rounded up onto `sfmt`'s grid (`taco.codec.scales`) before they are used."""
    g = xg.shape[1]
    s_a = (fmax / torch.sqrt(xg.square().mean(1, keepdim=True) + lam)).clamp(1e-3, 1e3)
    s_a = round_up(s_a, sfmt)
    z = (xg * s_a) @ h / math.sqrt(g)
    amax = z.abs().amax(1, keepdim=True)
    s_q = (amax.clamp_min(1e-12) / target).clamp(1e-12, 1e6)
    s_q = round_up(torch.where(torch.isfinite(amax), s_q, torch.full_like(s_q, math.nan)), sfmt)
    q = (z / s_q).clamp(-fmax, fmax).to(fp8).view(torch.uint8)
    return q, s_q, s_a


def taco_decode(
    q: torch.Tensor, s_q: torch.Tensor, s_a: torch.Tensor, h: torch.Tensor, fp8: torch.dtype
) -> torch.Tensor:
    """TACO decode (docs/design.md 1.1 step 5): x^ = H (fp32(q) * s_q) / sqrt(G) / s_a."""
    g = q.shape[1]
    return (q.view(fp8).float() * s_q) @ h / math.sqrt(g) / s_a


def fp8_encode(
    xg: torch.Tensor, h: torch.Tensor | None, fp8: torch.dtype, fmax: float, sfmt: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional rotation, one absmax scale per row (rounded up onto `sfmt`), saturating RNE cast
    -> (q uint8 [ng, G], s [ng, 1])."""
    z = _rotate(xg, h)
    s = round_up(absmax_scale(z.abs().amax(1, keepdim=True), fmax), sfmt)
    q = (z / s).clamp(-fmax, fmax).to(fp8).view(torch.uint8)
    return q, s


def fp8_decode(q: torch.Tensor, s: torch.Tensor, h: torch.Tensor | None, fp8: torch.dtype) -> torch.Tensor:
    return _rotate(q.view(fp8).float() * s, h)


def int_encode(
    xg: torch.Tensor, h: torch.Tensor | None, qmax: int, sfmt: str = "fp32", flips: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional rotation, absmax scale (rounded up onto `sfmt`), round-half-even to ints in
    [-qmax, qmax] -> (q int8, s [ng, 1]).

    With `flips` (the randomized Hadamard's +-1 diagonal D, [G]; the intB-hadamard codecs'
    signs="auto"), each group is also rotated as (x D) `h`, and the rotation whose scale (rounded onto
    `sfmt`) is smaller, the finer grid, is kept: x D where s_2 < s_1 (ties and NaN groups: `h`). With
    absmax scales the rounding error per code is about the same for both, so the smaller step is the
    smaller error (within 0.15 dB of comparing the errors themselves on captured TP tensors, at no
    error pass). The choice is the sign of the kept scale (scales are > 0 or NaN, so the bit is free):
    negative means x D was rotated."""
    v, s = _int_quant(_rotate(xg, h), qmax, sfmt)
    if flips is None:
        return v.to(torch.int8), s
    v2, s2 = _int_quant(_rotate(xg * flips, h), qmax, sfmt)
    pick = s2 < s  # NaN groups: False
    return torch.where(pick, v2, v).to(torch.int8), torch.where(pick, -s2, s)


def _int_quant(z: torch.Tensor, qmax: int, sfmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated groups -> (codes as fp32, scales [ng, 1])."""
    s = round_up(absmax_scale(z.abs().amax(1, keepdim=True), qmax), sfmt)
    return torch.round(z / s).clamp_(-qmax, qmax).nan_to_num_(0.0), s  # NaN groups: s is NaN already


def int_decode(
    q: torch.Tensor, s: torch.Tensor, h: torch.Tensor | None, flips: torch.Tensor | None = None
) -> torch.Tensor:
    """Codes times scales, rotated back. With `flips` (see `int_encode`): the scale's magnitude, and
    the groups whose scale is negative times D after the rotation (0 - y, so zeros stay +0)."""
    if flips is None:
        return _rotate(q.float() * s, h)
    y = _rotate(q.float() * s.abs(), h)
    return torch.where(torch.signbit(s) & (flips < 0), 0.0 - y, y)
