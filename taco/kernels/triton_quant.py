"""Per-group quantization steps of the Triton kernels: the absmax scale (FP8, intB), taco's s_q,
round-half-even integer codes, the intB-hadamard `signs="auto"` choice between two rotations, and the
scaled domains that keep finite groups near the dtype's max finite (docs/codecs.md).

Why a file of its own: `triton_taco.py` holds the tiles (load, rotate, store) and `triton_bits.py` the
wire bits; these are the steps between, each the twin of `taco.codec.functional` (`absmax_scale`,
`taco_encode`, `_int_quant`, `int_encode(..., flips=D)`), with the same fp32 operations so the
interpreter and the GPU reproduce the reference's bytes (only `tl.sum`'s order differs from torch's
reductions).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_bits import _round_scale


@triton.jit
def _absmax_scale(z, qm, R: tl.constexpr, SFMT: tl.constexpr):
    """functional.absmax_scale of the rows of z [R, G] onto qm (fmax or qmax), rounded up onto SFMT:
    1 for all-zero rows, NaN for rows holding NaN or Inf."""
    bad = tl.max((z != z).to(tl.int32), axis=1) > 0  # NaN anywhere in the group
    amax = tl.max(tl.abs(z), axis=1)
    qv = tl.full((R,), 1.0, tl.float32) * qm
    s = tl.div_rn(amax, qv)
    # a subnormal scale is rounded up on the 2^-149 grid (absmax_scale); the products are exact
    sub = s < 1.1754943508222875e-38  # 2^-126
    units = tl.div_rn(tl.where(sub, amax, 0.0), qv * 1.401298464324817e-45)  # 2^-149
    s = tl.where(sub, tl.math.ceil(units) * 1.401298464324817e-45, s)
    s = tl.where(amax > 0, s, 1.0)
    return _round_scale(tl.where(bad | (amax == float("inf")), float("nan"), s), SFMT)


@triton.jit
def _taco_scale(z, target, R: tl.constexpr, SFMT: tl.constexpr):
    """taco's s_q (functional.taco_encode): clamp(max(absmax, 1e-12) / target, 1e-12, 1e6), rounded up
    onto SFMT; NaN for rows holding NaN or Inf."""
    bad = tl.max((z != z).to(tl.int32), axis=1) > 0  # NaN anywhere in the group
    amax = tl.max(tl.abs(z), axis=1)
    s = tl.div_rn(tl.where(amax < 1e-12, 1e-12, amax), tl.full((R,), 1.0, tl.float32) * target)
    s = tl.where(s < 1e-12, 1e-12, s)
    s = tl.where(s > 1e6, 1e6, s)
    return _round_scale(tl.where(bad | (amax == float("inf")), float("nan"), s), SFMT)


@triton.jit
def _int_codes(t, qmax):
    """Values in code units -> round-half-even integers in [-qmax, qmax] (fp32); NaN -> 0."""
    r = (t + 12582912.0) - 12582912.0  # round half to even (|t| <= qmax)
    r = tl.where(r < -qmax, -qmax, r)
    r = tl.where(r > qmax, qmax, r)
    return tl.where(r != r, 0.0, r)


@triton.jit
def _int_quant(z, qmax, p, R: tl.constexpr, G: tl.constexpr, SFMT: tl.constexpr, signed=None):
    """Rotated rows z [R, G], pre-scaled by p [R] (`_prescale`) -> (codes [R, G] fp32, wire scales [R]).
    signed: the wire scales `_pick` chose (their magnitude is z's scale), instead of z's own."""
    if signed is None:
        w, s = _wire_scale(_absmax_scale(z, qmax, R, SFMT), p, SFMT)
    else:
        w, s = signed, tl.abs(signed) * p
    return _int_codes(tl.div_rn(z, s[:, None] + tl.zeros((R, G), tl.float32)), qmax), w


# -- finite in, finite out (functional.prescale / wire_scale / decode_factor) ------------------------
@triton.jit
def _prescale(x, G: tl.constexpr):
    """Per row of x [R, G]: 1/G where some |x| >= 2^127 / G (its butterflies could overflow), else 1."""
    big = tl.max((tl.abs(x) >= 2.0**127 / G).to(tl.int32), axis=1) > 0
    return tl.where(big, 1.0 / G, 1.0)


@triton.jit
def _wire_scale(s, p, SFMT: tl.constexpr):
    """A scale s of rows pre-scaled by p -> (written: s / p saturating at SFMT's largest value; the
    scale codes are divided by: that times p). Power-of-two factors: exact."""
    if SFMT == 0:
        smax = 3.4028234663852886e38
    elif SFMT == 1:
        smax = 3.3895313892515355e38
    else:
        smax = 1.7014118346046923e38  # 2^127
    w = tl.div_rn(s, p)
    w = tl.where(w > smax, smax, w)  # NaN stays NaN
    return w, w * p


@triton.jit
def _decode_factor(s, G: tl.constexpr):
    """Per scale: 2^-16 / G where |s| >= 2^111 / G (codes * s summed over G could overflow), else 1."""
    return tl.where(tl.abs(s) >= 2.0**111 / G, 1.0 / (G * 65536.0), 1.0)


@triton.jit
def _saturate(y, m):
    """y clamped to [-m, m], NaN kept."""
    y = tl.where(y > m, m, y)
    return tl.where(y < -m, -m, y)


@triton.jit
def _pick(z1, z2, qmax, p, R: tl.constexpr, SFMT: tl.constexpr):
    """signs="auto" (functional.int_encode with flips): per row of the two rotations z1, z2 (pre-scaled by
    p) the one with the smaller wire scale, the second (the randomized rotation) where s_2 < s_1 (ties
    and NaN rows: the first), flagged by a negative scale. -> (kept rows, signed wire scales); the rows
    are quantized once, after the choice (`_int_quant(..., signed)`)."""
    s1 = _wire_scale(_absmax_scale(z1, qmax, R, SFMT), p, SFMT)[0]
    s2 = _wire_scale(_absmax_scale(z2, qmax, R, SFMT), p, SFMT)[0]
    pick = s2 < s1
    return tl.where(pick[:, None], z2, z1), tl.where(pick, 0.0 - s2, s1)
