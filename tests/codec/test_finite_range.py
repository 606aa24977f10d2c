"""Finite in, finite out (docs/codecs.md): finite inputs up to the dtype's max decode finite, on every
codec and backend, with the group error they have at ordinary magnitudes.

Groups near the max are rotated in a scaled domain by a power of two, so their codes are those of
the same groups scaled down by 2^100, and their decoded values exactly 2^100 times those, wherever
the scale does not saturate (a scale saturates only where sqrt(G) |x|max / qmax passes the scale
format's largest value: int4..int2, e8m0). `taco` keeps its clamps: finite only.
"""

from __future__ import annotations

import math

import pytest
import torch

from taco.codec.mx import MX_CODECS
from taco.codec.scales import max_scale
from tests.helpers.numerics import LOSSY, PAIRS, build, missing

# the Triton interpreter computes through numpy, which warns where a value saturates past the range
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
G = 128
FAST_TRITON = {"int8-hadamard", "taco-1s", "int6-hadamard(signs=auto)"}


def near_max(dtype: torch.dtype) -> torch.Tensor:
    """[8, G] groups from 1e37 to the dtype's max: constant, alternating, mixed signs, spread."""
    m = torch.finfo(dtype).max
    i = torch.arange(G, dtype=torch.float64)
    alt = torch.where(i % 2 == 0, 1.0, -1.0)
    ramp = (i + 1) / G
    rows = [
        torch.full((G,), m), torch.full((G,), -m), alt * m, alt * m * (0.5 + 0.5 * ramp), 1e37 * (1 + ramp),
        -m * ramp, torch.where(i % 3 == 0, -1.0, 1.0) * m * (1 - ramp / 4), alt * 1e37 * (1 + 8 * ramp),
    ]  # fmt: skip
    return torch.stack(rows).clamp(-m, m).to(dtype)


PARAMS = [
    pytest.param(n, b, marks=() if b != "triton" or n in FAST_TRITON else pytest.mark.slow, id=f"{n}-{b}")
    for n, b in PAIRS
    if n in LOSSY
]


@pytest.mark.parametrize(("name", "backend"), PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_inputs_up_to_the_max_decode_finite(name, backend, dtype):
    why = missing(backend)
    if why:
        pytest.skip(why)
    c = build(name, backend)
    x = near_max(dtype)
    y = c.decode(c.encode(x.reshape(-1))).view(x.shape)
    assert y.dtype == dtype and torch.isfinite(y).all(), f"{name} {backend} {dtype}: non-finite output"
    if name.startswith("taco/") or name == "taco" or name == "fp8-tensor" or name in MX_CODECS:
        return  # clamps (taco), one scale per tensor, the E8M0 rules of MX: finite is the guarantee
    small = (x.double() * 2.0**-100).to(dtype)  # exact: a power of two, far from both ends of the range
    m = torch.finfo(dtype).max
    ys = (c.decode(c.encode(small.reshape(-1))).view(x.shape).double() * 2.0**100).clamp(-m, m)  # saturation
    qmax = getattr(c, "qmax", None) or c.fmt.fmax
    room = qmax * max_scale(c.scale_fmt) / math.sqrt(G)  # no group below this saturates its scale
    ok = x.double().abs().amax(1) < room
    assert ok.any()
    assert torch.equal(y.double()[ok], ys[ok]), f"{name} {backend} {dtype}: not 2^100 x the scaled-down"
