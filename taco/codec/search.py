"""Least-squares scales for the narrow integer codes: per group, the scale of least error, not absmax.

Why: an absmax scale spends the outer codes on the group's one or two largest values; at 4 bits (15
levels) a scale a little below absmax / qmax, which clips those values, lowers the group's squared
error on Gaussian-like rotated groups by ~1.5 dB. The search (`scale_search="mse"` of the
intB-hadamard codecs, docs/design.md 1.2): for each group, every candidate scale
c * absmax / qmax (c in `CLIPS`, rounded up onto the scale format's grid) under each rotation the codec
allows (with signs="auto" the plain and the sign-flipped one), and keep the candidate whose codes
reconstruct the rotated group with the least squared error (the rotation is orthonormal, so this is
the error of the decoded group too). Codes take the whole two's-complement range [-qmax - 1, qmax]:
the bottom code, which absmax scales never reach, is one more level on the negative side once a
scale clips (+0.5 dB at 4 bits on the captured tensors, 16 levels instead of 15). Ties keep the
earlier candidate (c = 1, the plain rotation first), and a NaN group keeps the absmax scale, NaN, as
`functional.int_encode` does.

The choice depends on the group's values alone (a pure function of the group, docs/design.md 4), and
the wire format is that of the absmax codes: the decoder is `functional.int_decode`, unchanged.
Every candidate scale is > 0, so finite groups code finite.
"""

from __future__ import annotations

import torch

from . import functional as Fn
from .scales import round_up

CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
"""Candidate fractions of the absmax scale. Measured on 108 captured TP tensors (int4, G=64, bf16
scales, signs="auto", codes in [-qmax, qmax]): 3 candidates +0.45 dB over absmax, these 6 +0.59 dB,
10 +0.63 dB."""


def _candidates(z: torch.Tensor, qmax: int, sfmt: str, unit: torch.Tensor, p: torch.Tensor):
    """Yield (codes as fp32, wire scale [ng, 1], squared error [ng, 1]) per clip fraction of a group
    rotated after the pre-scale `p` (`functional.prescale`: groups near fp32's max rotate in a scaled
    domain, finite in, finite out); the error in units of `unit` (the plain rotation's absmax scale),
    so that it neither overflows nor underflows whatever the group's magnitude, and scales with it
    exactly."""
    s1 = Fn.absmax_scale(z.abs().amax(1, keepdim=True), qmax)
    for c in CLIPS:
        s = s1 if c == 1.0 else torch.where(s1 * c > 0, s1 * c, s1)  # subnormal products: keep s1
        w, s = Fn.wire_scale(round_up(s, sfmt), p, sfmt)  # s: w * p, unless w saturated
        q = torch.round(z / s).clamp_(-qmax - 1, qmax).nan_to_num_(0.0)
        err = (z / unit - q * (s / unit)).square().sum(1, keepdim=True)
        yield q, w, err


def int_mse_encode(
    xg: torch.Tensor,
    h: torch.Tensor | None,
    qmax: int,
    sfmt: str = "fp32",
    flips: torch.Tensor | None = None,
    signs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`functional.int_encode` with the least-squares scale: xg [ng, G] fp32 -> (q int8 [ng, G],
    s [ng, 1]). With `flips` alone (signs="auto") both rotations are searched and a negative scale
    marks the sign-flipped one; with `flips` and `signs` (signs=True) every group is rotated as x D."""
    p = Fn.prescale(xg) if h is not None else torch.ones_like(xg[:, :1])
    if flips is not None and signs:
        xg, flips = Fn.flip(xg, flips), None
    rotations = [Fn._rotate(xg * p, h)]
    if flips is not None:
        rotations.append(Fn._rotate(Fn.flip(xg, flips) * p, h))
    unit = Fn.absmax_scale(rotations[0].abs().amax(1, keepdim=True), qmax)
    best_q = best_s = best_e = None
    for r, z in enumerate(rotations):
        for q, s, err in _candidates(z, qmax, sfmt, unit, p):
            s = -s if r else s
            if best_e is None:
                best_q, best_s, best_e = q, s, err
                continue
            take = err < best_e  # NaN errors (non-finite groups): never taken
            best_q = torch.where(take, q, best_q)
            best_s = torch.where(take, s, best_s)
            best_e = torch.where(take, err, best_e)
    return best_q.to(torch.int8), best_s


def int_mse_decode(
    q: torch.Tensor, s: torch.Tensor, h: torch.Tensor | None, flips: torch.Tensor | None = None,
    signs: bool = False,
) -> torch.Tensor:
    """The absmax codes' decoder (`functional.int_decode`); 8-bit payloads arrive as raw bytes."""
    return Fn.int_decode(q.view(torch.int8) if q.dtype == torch.uint8 else q, s, h, flips, signs)
