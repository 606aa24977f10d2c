"""Reference group quantizers as pure functions on [ng, G] fp32 tensors (the specification).

Every codec in `codecs.py` is a thin wrapper around these; fused kernels (`taco.kernels`)
are tested against them. Shapes: xg [ng, G] fp32; per-group scales [ng, 1] fp32. `h` (the Sylvester
matrix, or None) says whether groups are rotated; the rotation itself is `hadamard.rotate`, fixed-order
butterflies, and every reduction is over one group in a fixed order (absmax: exact in any order; taco's
sum of squares: index order), so a group's bytes depend on the group alone (docs/design.md "Same bytes
everywhere").

Non-finite handling (docs/design.md section 4): a group holding NaN/Inf gets a NaN scale, so the whole
group decodes to NaN (never 0). With all inputs finite every intermediate below is finite, so the
check is made on the group's max after rotation, a [ng, 1] tensor that is computed anyway.

Finite in, finite out (docs/codecs.md): the butterflies of a group whose absmax is at least
2^(127 - log2 G) could overflow fp32, so such a group is rotated as x * 2^-log2(G) (exact: a power of
two) and its scale multiplied back by 2^log2(G), saturating at the scale format's largest value;
decode does the same in reverse for scales of at least 2^(111 - log2 G), and decoded values saturate at
the output dtype's largest finite value. Power-of-two factors commute with every rounding in the
normal range, so groups of ordinary magnitude keep their bytes bit for bit.
"""

from __future__ import annotations

import math

import torch

from .hadamard import flip, rotate
from .scales import max_scale, round_up


def _rotate(x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    return x if h is None else rotate(x)


def _log2(g: int) -> int:
    return g.bit_length() - 1


def prescale(xg: torch.Tensor) -> torch.Tensor:
    """[ng, 1] factor applied before a group's rotation: 2^-log2(G) where some |x_i| >= 2^(127 - log2 G)
    (its butterflies could overflow: partial sums reach G * absmax), else 1."""
    lg = _log2(xg.shape[1])
    big = (xg.abs() >= 2.0 ** (127 - lg)).any(1, keepdim=True)
    return torch.where(big, 2.0**-lg, 1.0)


def wire_scale(s: torch.Tensor, p: torch.Tensor, sfmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A scale `s` of a group pre-scaled by `p` -> (the scale written, s / p saturating at `sfmt`'s
    largest value; the scale codes are divided by, that times p: s itself unless it saturated)."""
    w = (s / p).clamp_max(max_scale(sfmt))
    return w, w * p


def decode_factor(s: torch.Tensor, g: int) -> torch.Tensor:
    """[ng, 1] factor applied to a rotated group's scale before its inverse rotation: 2^-(log2(G) + 16)
    where |s| >= 2^(111 - log2 G) (codes * s summed over G could overflow: codes are below 2^16), else 1."""
    lg = _log2(g)
    return torch.where(s.abs() >= 2.0 ** (111 - lg), 2.0 ** -(lg + 16), 1.0)


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
    s_a = (torch.reciprocal(sqrt_rn(sum_squares(xg) / g + lam)) * fmax).clamp(1e-3, 1e3)
    s_a = round_up(s_a, sfmt)
    z = rotate(xg * s_a)
    amax = z.abs().amax(1, keepdim=True)
    s_q = (amax.clamp_min(1e-12) / target).clamp(1e-12, 1e6)
    s_q = round_up(torch.where(torch.isfinite(amax), s_q, torch.full_like(s_q, math.nan)), sfmt)
    q = (z / s_q).clamp(-fmax, fmax).to(fp8).view(torch.uint8)
    return q, s_q, s_a


def taco_decode(
    q: torch.Tensor, s_q: torch.Tensor, s_a: torch.Tensor, h: torch.Tensor, fp8: torch.dtype
) -> torch.Tensor:
    """TACO decode (docs/design.md 1.1 step 5): x^ = H (fp32(q) * s_q) / sqrt(G) / s_a."""
    return rotate(q.view(fp8).float() * s_q) / s_a


def sqrt_rn(m: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (m >= 0 or NaN/inf), the kernels' sqrtf / sqrt_rn.

    torch.sqrt on the CPU may be off by an ulp, depending on the library and the ISA it dispatches
    to. The candidate from fp64 is checked against the two neighbouring midpoints in fp64, where
    the squares of 25-bit midpoints are exact, and moved by one ulp where it is not the nearest."""
    r = torch.sqrt(m.double()).float()
    lo, hi = torch.nextafter(r, torch.zeros_like(r)), torch.nextafter(r, torch.full_like(r, math.inf))
    md = m.double()
    r = torch.where(md < ((lo.double() + r.double()) / 2).square(), lo, r)
    return torch.where(md > ((r.double() + hi.double()) / 2).square(), hi, r)


def sum_squares(xg: torch.Tensor) -> torch.Tensor:
    """Per-group sum of squares [ng, 1] in index order, ((x_0^2 + x_1^2) + x_2^2) + ...: one column
    at a time, so neither the number of groups nor the CPU's vector width changes the rounding."""
    sq = xg * xg
    acc = sq[:, :1].clone()
    for i in range(1, xg.shape[1]):
        acc += sq[:, i : i + 1]
    return acc


def fp8_encode(
    xg: torch.Tensor, h: torch.Tensor | None, fp8: torch.dtype, fmax: float, sfmt: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional rotation, one absmax scale per row (rounded up onto `sfmt`), saturating RNE cast
    -> (q uint8 [ng, G], s [ng, 1])."""
    if h is None:
        z = xg
        s = w = round_up(absmax_scale(z.abs().amax(1, keepdim=True), fmax), sfmt)
    else:
        p = prescale(xg)
        z = rotate(xg * p)
        w, s = wire_scale(round_up(absmax_scale(z.abs().amax(1, keepdim=True), fmax), sfmt), p, sfmt)
    q = (z / s).clamp(-fmax, fmax).to(fp8).view(torch.uint8)
    return q, w


def fp8_decode(q: torch.Tensor, s: torch.Tensor, h: torch.Tensor | None, fp8: torch.dtype) -> torch.Tensor:
    return _dequant_rotate(q.view(fp8).float(), s, h)


def _dequant_rotate(v: torch.Tensor, s: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """Codes v (fp32) times scales s, rotated back when h is given, in the scaled domain of
    `decode_factor` (a product with the same bits wherever the plain one does not overflow)."""
    if h is None:
        return v * s
    d = decode_factor(s, v.shape[1])
    return rotate(v * (s * d)) * torch.reciprocal(d)


def int_encode(
    xg: torch.Tensor,
    h: torch.Tensor | None,
    qmax: int,
    sfmt: str = "fp32",
    flips: torch.Tensor | None = None,
    signs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional rotation, absmax scale (rounded up onto `sfmt`), round-half-even to ints in
    [-qmax, qmax] -> (q int8, s [ng, 1]).

    With `flips` (the randomized Hadamard's +-1 diagonal D, [G]) and `signs` True, every group is
    rotated as x D (the intB-hadamard codecs' signs=True). With `flips` alone (signs="auto"), each group
    is rotated both ways, and the rotation whose scale (rounded onto `sfmt`) is smaller, the finer grid,
    is kept: x D where s_2 < s_1 (ties and NaN groups: plain). With absmax scales the rounding error per
    code is about the same for both, so the smaller step is the smaller error (within 0.15 dB of
    comparing the errors themselves on captured TP tensors, at no error pass). The choice is the sign
    of the kept scale (scales are > 0 or NaN, so the bit is free): negative means x D was rotated."""
    if h is None:
        v, s, _ = _int_quant(xg, qmax, sfmt, None)
        return v.to(torch.int8), s
    p = prescale(xg)
    if flips is not None and signs:
        xg = flip(xg, flips)
    v, s, c = _int_quant(rotate(xg * p), qmax, sfmt, p)
    if flips is None or signs:
        return v.to(torch.int8), s
    v2, s2, _ = _int_quant(rotate(flip(xg, flips) * p), qmax, sfmt, p)
    pick = s2 < s  # NaN groups: False
    return torch.where(pick, v2, v).to(torch.int8), torch.where(pick, -s2, s)


def _int_quant(
    z: torch.Tensor, qmax: int, sfmt: str, p: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups (rotated after a pre-scale p, or None) -> (codes as fp32, wire scales [ng, 1], the scales
    the codes were divided by)."""
    s = round_up(absmax_scale(z.abs().amax(1, keepdim=True), qmax), sfmt)
    w, s = (s, s) if p is None else wire_scale(s, p, sfmt)
    return torch.round(z / s).clamp_(-qmax, qmax).nan_to_num_(0.0), w, s  # NaN groups: s is NaN already


def int_decode(
    q: torch.Tensor,
    s: torch.Tensor,
    h: torch.Tensor | None,
    flips: torch.Tensor | None = None,
    signs: bool = False,
) -> torch.Tensor:
    """Codes times scales, rotated back. With `flips` and `signs`: times D after the rotation; with
    `flips` alone (signs="auto", see `int_encode`): the scale's magnitude, and the groups whose scale
    is negative times D after the rotation (0 - y, so zeros stay +0)."""
    if flips is None:
        return _dequant_rotate(q.float(), s, h)
    y = _dequant_rotate(q.float(), s.abs(), h)
    return flip(y, flips, True if signs else torch.signbit(s))
