"""The intB-hadamard defaults chosen by measurement (docs/design.md 1.2) and the least-squares scale
search (`taco.codec.search`): bytes kept, specs explicit, the rules of docs/design.md 4 on the new
code path, and the lead over the hardware formats on heavy-tailed data."""

from __future__ import annotations

import math

import pytest
import torch

import taco
from taco.codec import build_codec, sqnr_db
from taco.codec.formats import unpack_bits

WIDTHS = range(8, 1, -1)
MSE = [
    "int4-hadamard",
    "int4-hadamard-g32",
    "int6-hadamard(scale_search=mse)",
    "int8-hadamard(scale_search=mse)",
]


def build(spec: str) -> taco.Codec:
    return build_codec(spec)


@pytest.mark.parametrize("bits", WIDTHS)
def test_defaults_keep_each_width_bytes_and_spell_out_their_spec(bits):
    c = taco.get_codec(f"int{bits}-hadamard")
    assert (c.group_size, c.scale_fmt, c.signs) == (64, "bf16", "auto")
    assert c.scale_search == ("mse" if bits == 4 else "absmax")
    n = 1 << 16
    assert c.nbytes(n) == n * bits // 8 + n // 32  # B/8 + 1/32, the bytes of G = 128 with fp32 scales
    assert c.nbytes(n) == taco.get_codec(f"int{bits}-hadamard", group_size=128, scale_fmt="fp32").nbytes(n)
    assert build_codec(c.spec).spec == c.spec and "group_size=64,signs=auto,scale_fmt=bf16" in c.spec
    assert taco.get_codec(f"int{bits}-hadamard", scale_fmt="e8m0").signs is False  # no sign bit: plain
    with pytest.raises(ValueError, match="scale_search"):
        taco.get_codec(f"int{bits}-hadamard", scale_search="best")


def test_named_codec_at_nvfp4_bytes():
    c = taco.get_codec("int4-hadamard-g32")
    assert c.nbytes(1 << 20) == taco.get_codec("nvfp4").nbytes(1 << 20) - 4 == (1 << 20) * 9 // 16
    want = "int4-hadamard-g32(group_size=32,signs=auto,scale_fmt=bf16,scale_search=mse)"
    assert build_codec(c.spec).spec == c.spec == want
    absmax = build_codec("int4-hadamard(scale_search=absmax)")
    assert "scale_search=absmax" in absmax.spec and build_codec(absmax.spec).scale_search == "absmax"


@pytest.mark.parametrize("spec", MSE)
def test_least_squares_scale_beats_absmax_and_never_loses_a_group(spec):
    """Per group the search keeps absmax's candidate unless one errs less: no group is worse (up to
    fp32 rounding of the error sums), and the tensor gains."""
    c = build(spec)
    ref = build_codec(c.spec.replace("scale_search=mse", "scale_search=absmax"))
    x = torch.randn(256, c.group_size)
    y, y0 = c.roundtrip(x), ref.roundtrip(x)
    e, e0 = (y - x).square().sum(1), (y0 - x).square().sum(1)
    assert (e <= e0 * (1 + 1e-5)).all()
    assert sqnr_db(x, y) > sqnr_db(x, y0) + {4: 0.8, 6: 0.1}.get(c.bits, 0.0)


@pytest.mark.parametrize("spec", MSE)
def test_search_codes_use_the_bottom_code_and_decode_with_the_absmax_decoder(spec):
    c = build(spec)
    x = torch.randn(512, c.group_size)
    p = c.encode(x)
    q = unpack_bits(p.data[: 512 * c.group_size * c.bits // 8].view(512, -1), c.bits)
    qmax = (1 << (c.bits - 1)) - 1
    assert q.min() >= -qmax - 1 and q.max() <= qmax
    if c.bits <= 6:
        assert q.min() == -qmax - 1
    # the scale's sign carries the rotation choice, as for signs="auto" with absmax scales
    absmax = c.spec.replace("scale_search=mse", "scale_search=absmax").replace(")", ",backend=eager)")
    eager = build_codec(absmax)
    assert torch.equal(eager.decode(eager.wrap(p.data, x.shape, x.dtype)), c.decode(p))


@pytest.mark.parametrize("spec", MSE)
def test_search_rules_of_the_codes(spec):
    """Finite in finite out down to subnormals, zero groups exact, NaN/Inf groups NaN, the group's
    code a function of the group alone, powers of two scale exactly."""
    c = build(spec)
    g = c.group_size
    gen = torch.Generator().manual_seed(5)
    pool = torch.randn(20, g, generator=gen) * torch.logspace(-38, 30, 20).view(-1, 1)
    pool[3] = 0.0
    pool[7, 5] = math.nan
    pool[9, 2] = math.inf
    pool[11] = torch.zeros(g).index_fill_(0, torch.tensor([1, 4]), 2.0**-149)
    y = c.roundtrip(pool.reshape(-1)).view(pool.shape)
    bad = torch.zeros(20, dtype=torch.bool)
    bad[[7, 9]] = True
    assert torch.isfinite(y[~bad]).all() and (~torch.isfinite(y[bad])).all()
    assert torch.equal(y[3], torch.zeros(g))
    whole = c.encode(pool.reshape(-1)).data
    pb, sb = g * c.bits // 8, c.scale_bytes
    for k in range(20):
        alone = c.encode(pool[k]).data
        got = torch.cat([whole[k * pb : (k + 1) * pb], whole[20 * pb + k * sb : 20 * pb + (k + 1) * sb]])
        assert torch.equal(got, alone), (spec, k)
    x = torch.randn(8, g)
    for k in (-100, 100):
        assert torch.equal(c.roundtrip(x * 2.0**k), c.roundtrip(x) * 2.0**k)


def test_defaults_lead_the_hardware_formats_on_heavy_tails():
    """Student-t(3) data, each width's default against every hardware format at its bytes."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(256, 1024, generator=gen)
    x = z / (torch.randn(3, 256, 1024, generator=gen).square().sum(0) / 3).sqrt()
    hw = {"int8-hadamard": ["mxfp8-e4m3", "mxfp8-e4m3(scale_rule=rceil)"],
          "int6-hadamard": ["mxfp6-e2m3", "mxfp6-e2m3(scale_rule=rceil)", "mxfp6-e3m2(scale_rule=rceil)"],
          "int4-hadamard": ["mxfp4", "mxfp4(scale_rule=rceil)", "mxfp4(scale_rule=rceil,hadamard=True)"],
          "int4-hadamard-g32": ["nvfp4", "nvfp4(hadamard=True)"]}  # fmt: skip
    lead = {"int8-hadamard": 10.0, "int6-hadamard": 1.0, "int4-hadamard": 1.0, "int4-hadamard-g32": 0.5}
    for ours, theirs in hw.items():
        c = build(ours)
        s = sqnr_db(x, c.roundtrip(x))
        for t in theirs:
            h = build(t)
            assert abs(h.nbytes(x.numel()) - c.nbytes(x.numel())) <= 4
            assert s > sqnr_db(x, h.roundtrip(x)) + lead[ours], (ours, t)


def _collectives_body(rank: int, world: int) -> None:
    import taco.comm as tc
    from tests.helpers.dist import assert_equal

    xs = [torch.randn(8, 256, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(world)]
    for spec in ("int4-hadamard", "int4-hadamard-g32", "int6-hadamard"):
        c = build_codec(spec)
        rt = c.roundtrip
        assert_equal(tc.all_gather(xs[rank], codec=c), torch.cat([rt(v) for v in xs]), f"{spec} all_gather")
        want = sum(rt(v.reshape(-1)) for v in xs).view(8, 256)
        assert_equal(tc.all_reduce(xs[rank], codec=c, algo="gather", slices=3), want, f"{spec} all_reduce")
        base = tc.all_reduce(xs[rank], codec=c, algo="two_shot", slices=1)
        assert_equal(tc.all_reduce(xs[rank], codec=c, algo="two_shot", slices=3), base, f"{spec} slices")


def test_defaults_in_the_collectives():
    """The new defaults (the search on the eager path, int6 on the fused one) in the collectives:
    the composition of round trips, and slicing changes nothing."""
    from tests.helpers.dist import run_distributed

    run_distributed(_collectives_body, 2)
