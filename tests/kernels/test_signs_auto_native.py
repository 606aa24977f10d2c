"""Issue 13: the native C kernels of `signs="auto"` (intB-hadamard), against the eager reference
(`functional.int_encode(..., flips=D)`, tests/codec/test_codec_signs_auto.py).

Criteria of the other native int kernels (tests/kernels/test_kernels_native_intn.py): bytes identical where
every fp32 sum is exact (small integers); on Gaussian data the per-group choice agrees with eager's
but where the two candidates' scales tie to rounding (the rotations sum in another order),
codes within one step where choice and scale agree; decoded values of the same bytes within
rounding; the AVX-512 build and the portable one give the same bytes. Zeros and NaN/Inf groups:
tests/codec/test_codec_signs_auto.py (every kernel backend).
"""

from __future__ import annotations

import math

import pytest
import torch

import taco
from benchmarks.native_simd_check import build_with, decode, dsum, encode
from taco.codec.formats import unpack_bits
from taco.codec.functional import _int_quant
from taco.codec.hadamard import hadamard_matrix, sign_flips
from taco.kernels import native
from tests.helpers.kernels import assert_dsum_identical, dsum_outputs, structured

pytestmark = [
    pytest.mark.skipif(native.library() is None, reason="no C compiler: native kernels not built"),
    pytest.mark.filterwarnings("ignore:(All-NaN|invalid value):RuntimeWarning"),
    # written against the intB-hadamard settings before the measured defaults (conftest.py)
    pytest.mark.usefixtures("legacy_int_defaults"),
]


def pair(bits: int, sfmt: str = "bf16", g: int = 64) -> tuple[taco.Codec, taco.Codec]:
    """(eager, native) instances of int{bits}-hadamard with signs="auto"."""
    e, n = (
        taco.get_codec(f"int{bits}-hadamard", group_size=g, scale_fmt=sfmt, signs="auto", backend=b)
        for b in ("eager", "native")
    )
    assert n.kernel(torch.device("cpu")).name == "native", n.spec
    return e, n


def picked(c: taco.Codec, buf: torch.Tensor) -> torch.Tensor:
    """Per group: whether the randomized rotation was kept (the scale's sign bit)."""
    return c._split(buf)[1][0].view(-1).signbit()


@pytest.mark.parametrize("sfmt", ["fp32", "bf16"])
def test_exact_inputs_bit_identical_to_eager(sfmt):
    gen = torch.Generator().manual_seed(1)
    for bits in (3, 4, 6, 8):
        for g in (64, 32):
            e, n = pair(bits, sfmt, g)
            for numel in (g - 3, 16 * g, 19 * g + 5):  # ragged, one 16-group batch, batch + ragged tail
                x = torch.randint(-40, 41, (numel,), generator=gen).bfloat16()
                pe, pn = e.encode(x), n.encode(x)
                assert torch.equal(pn.data, pe.data), f"int{bits} {sfmt} G={g} n={numel}: bytes"
                if numel > 16 * g:
                    p = picked(e, pe.data)
                    assert p.any() and not p.all(), "both rotations chosen somewhere"
                if sfmt != "fp32" and g == 64:  # short scale x code exact, /8 exact: decode is exact
                    assert torch.equal(n.decode(pe), e.decode(pe)), f"int{bits} {sfmt} n={numel}: decode"


def test_structured_groups_get_the_expected_rotation():
    x, want = structured(64, 5)
    e, n = pair(6, "fp32")
    assert torch.equal(picked(n, n.encode(x.reshape(-1)).data), want)


def eager_scales(x: torch.Tensor, bits: int, sfmt: str, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager's two sides of the choice per group: the scales s_1 (plain) and s_2 (x D)."""
    xg = torch.nn.functional.pad(x.float(), (0, -x.numel() % g)).view(-1, g)
    h, qmax = hadamard_matrix(g), 2 ** (bits - 1) - 1
    s1, s2 = (_int_quant(z, qmax, sfmt)[1].view(-1) for z in (xg @ h / math.sqrt(g),
                                                               (xg * sign_flips(g)) @ h / math.sqrt(g)))
    return s1, s2


@pytest.mark.parametrize("sfmt", ["fp32", "bf16"])
def test_gaussian_choice_codes_and_decode_match_eager(sfmt):
    gen = torch.Generator().manual_seed(2)
    g = 64
    numel = 700 * g + 37
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(numel, generator=gen).to(dtype)
        for bits in (4, 6):
            e, n = pair(bits, sfmt, g)
            pe, pn = e.encode(x), n.encode(x)
            ce, cn = picked(e, pe.data), picked(n, pn.data)
            assert 0.3 < ce.float().mean() < 0.7  # i.i.d. groups: either rotation about half the time
            differ = ce != cn
            assert differ.float().mean() <= 0.01, f"int{bits} {sfmt}: {differ.float().mean():.4f} differ"
            s1, s2 = eager_scales(x, bits, sfmt, g)
            step = 1e-6 if sfmt == "fp32" else 2.0**-7  # an ulp of the absmax; one bf16 step
            assert ((s1 - s2).abs() <= step * s1)[differ].all(), "choices differ only at near-ties"
            (qe, (se,)), (qn, (sn,)) = e._split(pe.data), n._split(pn.data)
            same = ~differ & (se == sn).view(-1)
            if sfmt == "fp32":  # an ulp of the absmax moves a code by at most one step: all agreed groups
                same = ~differ
                assert torch.allclose(sn.view(-1)[same], se.view(-1)[same], rtol=1e-6, atol=0)
            assert same.float().mean() >= 0.9, f"int{bits} {sfmt}: {same.float().mean():.3f} equal"
            de = unpack_bits(qe, bits).int().view(-1, g)
            dn = unpack_bits(qn, bits).int().view(-1, g)
            d = (de - dn).abs()[same]
            assert d.max() <= 1 and (d > 0).float().mean() < 0.01, f"int{bits} {sfmt} {dtype}: codes"
            ye, yn = e.decode(pe).float(), n.decode(pe).float()  # decode of the same (eager) bytes
            tol = 1e-6 if dtype == torch.float32 else 2.0**-8
            assert ((ye - yn).abs() <= tol * ye.abs().amax()).all(), f"int{bits} {sfmt} {dtype}: decode"


def test_decode_sum_encode_bit_identical_to_eager_composition():
    gen = torch.Generator().manual_seed(3)
    for bits in (2, 4, 6, 8):
        e, n = pair(bits)
        assert_dsum_identical(e, n, 17 * 64 + 9, gen, (0, 1, 2), f"int{bits} auto")


def test_gaussian_decode_sum_encode_close_to_eager():
    gen = torch.Generator().manual_seed(4)
    numel = 40 * 64 + 3
    e, n = pair(6)
    x = torch.randn(numel, generator=gen).bfloat16()
    bufs = torch.cat([e.encode(x * 2).data, e.encode(-x).data])
    (oe, se), (on, sn) = dsum_outputs((e, n), bufs, 2, numel, x, 1, torch.bfloat16)
    assert ((sn - se).abs() <= 1e-6 * se.abs().max()).all(), "sums"
    ye, yn = (e.decode(e.wrap(o, x.shape, torch.float32)) for o in (oe, on))
    assert abs(taco.codec.sqnr_db(se, yn) - taco.codec.sqnr_db(se, ye)) < 0.1, "re-encode fidelity"
    assert (picked(e, oe) == picked(e, on)).float().mean() >= 0.95


def test_avx512_and_portable_builds_agree(tmp_path):
    """Encode, decode (of real and of random bytes, both scale signs) and decode-sum-encode: the same
    bytes from the AVX-512 build and a build without AVX-512."""
    scalar = build_with("-mno-avx512f", tmp_path, "scalar")
    lib = native.library()
    gen = torch.Generator().manual_seed(6)
    for bits, sfmt, g in ((6, "bf16", 64), (5, "fp32", 128), (8, "bf16", 32)):
        _, c = pair(bits, sfmt, g)
        numel = 33 * g + 11
        x = torch.randn(numel, generator=gen) * 10
        want = encode(lib, c, x)
        assert torch.equal(encode(scalar, c, x), want), f"int{bits} {sfmt}: encode"
        rnd = torch.randint(0, 256, (c.nbytes(numel),), generator=gen, dtype=torch.uint8)
        ng = c.groups(numel)
        sign = torch.where(torch.rand(ng, generator=gen) < 0.5, -1.0, 1.0)  # both flags
        sdt = torch.float32 if sfmt == "fp32" else torch.bfloat16
        scales = ((torch.rand(ng, generator=gen) + 0.5) * sign).to(sdt)
        rnd[ng * g * bits // 8 :] = scales.view(torch.uint8)
        for buf in (want, rnd):
            ya, yb = (decode(lb, c, buf, numel, torch.float32) for lb in (lib, scalar))
            assert torch.equal(ya, yb), f"int{bits} {sfmt}: decode"
        bufs = torch.cat([want, encode(lib, c, -2 * x)])
        got = [dsum(lb, c, bufs, 2, numel, x.bfloat16(), 1, True, torch.float32) for lb in (lib, scalar)]
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), f"int{bits}: dsum"
